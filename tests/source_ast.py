"""`ast.parse` for the tests that read the package's own source (budgets, layering rules, the public API).

CPython 3.11's AST constructor can raise a spurious `SystemError: AST constructor recursion depth
mismatch` (python/cpython gh-106905, seen here in long test processes on a loaded machine); the
same source parses on the next try. Any other error, or the same one three times, is raised.
"""

import ast


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    for attempt in range(3):
        try:
            return ast.parse(source, filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")
