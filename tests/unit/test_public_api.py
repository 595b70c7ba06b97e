"""The public API is the package root's `__all__`, and every other name is imported from the module
that defines it: no module forwards a name it only imported (a re-export)."""

import ast
import importlib
from pathlib import Path

from source_ast import parse_python

import megatron_stepwise

REPO = Path(__file__).resolve().parents[2]

# The one forwarding address kept: cli's `main` is the console script's entry point in installed
# environments (pyproject.toml [project.scripts]).
KEPT = {"megatron_stepwise.cli"}


def test_every_public_name_imports_from_the_root():
    assert len(megatron_stepwise.__all__) == len(set(megatron_stepwise.__all__))
    for name in megatron_stepwise.__all__:
        value = getattr(megatron_stepwise, name)
        assert value is not None, name
        assert name in dir(megatron_stepwise), name


def test_the_root_names_what_a_user_needs():
    # the plugin API (README), config loading, the batch types, environments and the error base
    needed = {"StepwisePlugin", "LossConfig", "Step", "StepBatch", "compute_advantages", "load_config"}
    needed |= {"ExperimentConfig", "ConfigError", "register_env", "Environment", "UserError", "layer_spec"}
    assert needed <= set(megatron_stepwise.__all__)


def test_each_public_name_comes_from_its_defining_module():
    for module, names in megatron_stepwise._EXPORTS.items():
        for name in names:
            value = getattr(importlib.import_module(module), name)
            home = getattr(value, "__module__", module)  # constants have no home: their module is checked below
            assert home == module, f"{name}: exported from {module}, defined in {home}"
            assert name in _top_level(module)[0], f"{name}: {module} imports it, it does not define it"


def _module_names() -> dict[str, Path]:
    out = {}
    for path in (REPO / "megatron_stepwise").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _module_names()


def _top_level(module: str) -> tuple[set[str], set[str]]:
    """(names `module` defines, names it imports) at its top level (TYPE_CHECKING blocks left out)."""
    defined, imported = set(), set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined.update(e.id for t in targets for e in ast.walk(t) if isinstance(e, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.If) and ast.unparse(node.test) != "TYPE_CHECKING":
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(parse_python(MODULES[module].read_text()).body)
    return defined, imported


def forwarded_imports(roots=("megatron_stepwise", "tests", "tools", "examples", "launch")) -> list[str]:
    """`file:line: from M import n` wherever M did not define n but imported it (not KEPT)."""
    cache: dict[str, tuple[set[str], set[str]]] = {}
    found = []
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            text = path.read_text()
            if "from megatron_stepwise" not in text:
                continue
            for node in ast.walk(parse_python(text)):
                if not isinstance(node, ast.ImportFrom) or node.level or node.module not in MODULES:
                    continue
                if node.module in KEPT:
                    continue
                defined, imported = cache.setdefault(node.module, _top_level(node.module))
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}" in MODULES
                    if not submodule and alias.name in imported and alias.name not in defined:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {alias.name}")
    return found


def test_callers_import_each_name_from_its_defining_module():
    # one deliberate exception: the test that the schema's LossConfig is algo's own class
    found = [f for f in forwarded_imports() if "test_config.py" not in f or "LossConfig" not in f]
    assert not found, "import these from the module that defines them:\n  " + "\n  ".join(found)
