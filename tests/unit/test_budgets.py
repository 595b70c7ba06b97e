"""Size budgets of the package, measured so that the formatter cannot change them.

- a function (or method) holds at most FUNCTION_STATEMENTS statements: every statement of its
  body counted through `if`/`for`/`with`/`try`..., its docstring not, a nested function or class
  one statement (its own body is measured as its own);
- a class spans at most CLASS_LINES lines; a file at most FILE_LINES lines.

ALLOWED lists today's exceptions with their figure. It may only shrink: the test fails when a
listed entry grew, when it is back within budget or gone (delete its line: the list tightens as
things get fixed), and when anything not listed is over budget.

    python tests/unit/test_budgets.py   # prints the current exceptions as a new ALLOWED
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, when run as a script
from source_ast import parse_python  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_stepwise"
FUNCTION_STATEMENTS = 45
CLASS_LINES = 400
FILE_LINES = 600
BUDGETS = {"function": FUNCTION_STATEMENTS, "class": CLASS_LINES, "file": FILE_LINES}
UNITS = {"function": "statements", "class": "lines", "file": "lines"}

# "kind path[::qualified.name]": its figure today (statements for a function, lines otherwise)
ALLOWED = {
    "class megatron_stepwise/loop/async_source.py::AsyncRollouts": 443,
    "class megatron_stepwise/mcore/train/plugin.py::StepwisePlugin": 529,
    "class megatron_stepwise/rollout/fleet/fleet.py::RolloutFleet": 471,
    "function megatron_stepwise/config/fields.py::coerce": 51,
    "function megatron_stepwise/loop/handoff.py::Handoff._to_ranks": 51,
    "function megatron_stepwise/loop/trainer.py::Trainer.__init__": 49,
    "function megatron_stepwise/mcore/train/packing.py::pack_rows": 46,
    "function megatron_stepwise/rollout/agent/loop.py::AgentLoop.run_trajectory": 51,
}


def _statements(body: list[ast.stmt]) -> int:
    """Statements of a body, through compound statements; a nested def or class counts as one."""
    n = 0
    for stmt in body:
        n += 1
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody"):
            n += _statements(getattr(stmt, field, []) or [])
        for handler in getattr(stmt, "handlers", []) or []:
            n += _statements(handler.body)
        for case in getattr(stmt, "cases", []) or []:
            n += _statements(case.body)
    return n


def _docstring_free(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    is_doc = (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    )
    return body[1:] if is_doc else body


def measure(package: Path = PACKAGE) -> dict[str, int]:
    """Every file's lines, every class's lines and every function's statements, by entry name."""
    sizes: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        text = path.read_text()
        sizes[f"file {rel}"] = len(text.splitlines())

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    name = prefix + child.name
                    sizes[f"class {rel}::{name}"] = child.end_lineno - child.lineno + 1
                    visit(child, name + ".")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = prefix + child.name
                    sizes[f"function {rel}::{name}"] = _statements(_docstring_free(child.body))
                    visit(child, name + ".")
                else:
                    visit(child, prefix)

        visit(parse_python(text, filename=rel), "")
    return sizes


def over_budget(sizes: dict[str, int]) -> dict[str, int]:
    return {entry: n for entry, n in sizes.items() if n > BUDGETS[entry.split(" ", 1)[0]]}


def problems(sizes: dict[str, int], allowed: dict[str, int] = ALLOWED) -> list[str]:
    """One line per breach of the budgets or of the allow-list, naming the entry and its figure."""
    out = []
    for entry, n in sorted(over_budget(sizes).items()):
        kind = entry.split(" ", 1)[0]
        limit, unit = BUDGETS[kind], UNITS[kind]
        if entry not in allowed:
            out.append(f"{entry}: {n} {unit}, over the budget of {limit}: split it")
        elif n > allowed[entry]:
            out.append(f"{entry}: {n} {unit}, grew past its allowed {allowed[entry]} (budget {limit}): shrink it")
    for entry, listed in sorted(allowed.items()):
        kind = entry.split(" ", 1)[0]
        if entry not in sizes:
            out.append(f"{entry}: listed in ALLOWED ({listed}) but gone: delete its line")
        elif sizes[entry] <= BUDGETS[kind]:
            out.append(
                f"{entry}: {sizes[entry]} {UNITS[kind]}, within the budget of {BUDGETS[kind]} now: "
                "delete its line from ALLOWED"
            )
    return out


def render_allowed(sizes: dict[str, int]) -> str:
    lines = ["ALLOWED = {"]
    lines += [f'    "{entry}": {n},' for entry, n in sorted(over_budget(sizes).items())]
    return "\n".join([*lines, "}"])


def test_the_package_keeps_its_budgets():
    found = problems(measure())
    assert not found, "size budgets (tests/unit/test_budgets.py):\n  " + "\n  ".join(found)


def test_statements_are_counted_through_blocks_and_not_into_nested_functions():
    tree = parse_python(
        "def f(x):\n"
        '    """doc"""\n'
        "    if x:\n"
        "        a = 1\n"
        "    else:\n"
        "        a = 2\n"
        "    try:\n"
        "        b = a\n"
        "    except ValueError:\n"
        "        b = 0\n"
        "    def g():\n"
        "        return 1\n"
        "        return 2\n"
        "    return a + b + g()\n"
    )
    # if, a=1, a=2, try, b=a, b=0, def g, return: 8 (g's own two statements are g's)
    assert _statements(_docstring_free(tree.body[0].body)) == 8


def test_every_breach_is_named_with_its_figure():
    sizes = {"function a.py::f": 46, "function a.py::g": 50, "class a.py::C": 300, "file b.py": 700}
    allowed = {"function a.py::g": 48, "class a.py::C": 420, "file gone.py": 900}
    assert problems(sizes, allowed) == [
        "file b.py: 700 lines, over the budget of 600: split it",
        "function a.py::f: 46 statements, over the budget of 45: split it",
        "function a.py::g: 50 statements, grew past its allowed 48 (budget 45): shrink it",
        "class a.py::C: 300 lines, within the budget of 400 now: delete its line from ALLOWED",
        "file gone.py: listed in ALLOWED (900) but gone: delete its line",
    ]


if __name__ == "__main__":
    sizes = measure()
    print(render_allowed(sizes))
    found = problems(sizes)
    if found:
        print("\n# against the ALLOWED in this file:\n# " + "\n# ".join(found), file=sys.stderr)
