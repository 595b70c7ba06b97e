"""No fork after threads: every multiprocessing Manager, Pool and Process in the package, the tests and
the tools comes from a spawn or forkserver context.

A process forked from one that runs threads (Ray's, aiohttp's, gRPC's, torch's) inherits their locks
in whatever state they were: a `mp.Manager()` server forked from a pytest worker that had started Ray
hung the suite on a futex (issue 41). Linux's default start method is fork, so the default context
(`multiprocessing.Manager()`, `torch.multiprocessing.Pool()`, `class W(mp.Process)`,
`ProcessPoolExecutor()` without `mp_context`, `get_context()` / `get_context("fork")`) is refused
here, naming file:line. Use `multiprocessing.get_context("spawn")` (or "forkserver") and call its
`Manager()`, `Pool()`, `Process()`. subprocess (fork then exec at once) is not affected.
"""

from __future__ import annotations

import ast
from pathlib import Path

from source_ast import parse_python

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("megatron_stepwise", "tests", "tools", "launch", "examples")
MP_MODULES = {"multiprocessing", "torch.multiprocessing"}
DEFAULT_CONTEXT = {"Manager", "Pool", "Process", "SyncManager"}
SAFE_METHODS = {"spawn", "forkserver"}


def _aliases(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to a multiprocessing module, and names imported from one (name -> what)."""
    modules, names = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MP_MODULES:
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module in MP_MODULES or node.module in {"multiprocessing.managers", "multiprocessing.pool"}:
                    names[a.asname or a.name] = a.name
                elif node.module == "torch" and a.name == "multiprocessing":
                    modules.add(a.asname or a.name)
                elif node.module == "concurrent.futures" and a.name == "ProcessPoolExecutor":
                    names[a.asname or a.name] = a.name
    return modules, names


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def default_context_uses(source: str, filename: str = "<source>") -> list[str]:
    """`filename:line: what` for every default-context Manager, Pool, Process (and the like) in `source`."""
    tree = parse_python(source, filename)
    modules, names = _aliases(tree)
    found = []

    def refers(expr: ast.AST) -> str | None:
        """What a default-context callable `expr` is, or None."""
        dotted = _dotted(expr)
        if not dotted:
            return None
        head, _, attr = dotted.rpartition(".")
        if head in modules and attr in DEFAULT_CONTEXT:
            return dotted
        if head == "" and names.get(attr) in DEFAULT_CONTEXT:
            return attr
        if dotted == "multiprocessing.Process" or (head in ("multiprocessing.managers",) and attr == "SyncManager"):
            return dotted
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            what = refers(node.func)
            dotted = _dotted(node.func)
            head, _, attr = dotted.rpartition(".")
            if what:
                found.append(f"{filename}:{node.lineno}: {what}() uses the default (fork) context")
            elif attr == "get_context" and (head in modules or names.get("get_context") == "get_context" and not head):
                method = (
                    node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "method"), None)
                )
                if not (isinstance(method, ast.Constant) and method.value in SAFE_METHODS):
                    found.append(f'{filename}:{node.lineno}: {dotted}() without "spawn" or "forkserver"')
            elif attr == "set_start_method" and head in modules:
                method = node.args[0] if node.args else None
                if not (isinstance(method, ast.Constant) and method.value in SAFE_METHODS):
                    found.append(f"{filename}:{node.lineno}: {dotted}() to a method other than spawn or forkserver")
            elif (
                attr == "ProcessPoolExecutor"
                and (head.endswith("futures") or names.get(attr) == attr)
                and not any(k.arg == "mp_context" for k in node.keywords)
            ):
                found.append(f"{filename}:{node.lineno}: {dotted}() without mp_context uses the default (fork) context")
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                what = refers(base)
                if what:
                    found.append(f"{filename}:{node.lineno}: class {node.name}({what}) uses the default (fork) context")
    return sorted(found, key=lambda f: int(f.split(":")[-2]))


def test_the_scanner_finds_each_default_context_form():
    bad = """
import multiprocessing
import multiprocessing as mpx
import torch.multiprocessing as mp
from multiprocessing import Manager, Pool as P
from concurrent.futures import ProcessPoolExecutor
mp.Manager()
mpx.Pool(2)
multiprocessing.Process(target=f)
Manager()
P()
class W(mp.Process): pass
mp.get_context()
mp.get_context("fork").Manager()
ProcessPoolExecutor(2)
mp.set_start_method("fork")
"""
    assert [f.split(":")[1] for f in default_context_uses(bad)] == [str(n) for n in range(7, 17)]
    good = """
import multiprocessing as mp
import concurrent.futures
ctx = mp.get_context("spawn")
ctx.Manager(); ctx.Pool(2); ctx.Process(target=f)
mp.get_context("forkserver").Manager()
mp.get_context(method="spawn").Process()
class W(ctx.Process): pass
concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx)
mp.spawn(f, nprocs=2)  # torch.multiprocessing.spawn: the spawn start method
"""
    assert default_context_uses(good) == []


def test_no_manager_pool_or_process_uses_the_default_context():
    found = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            found += default_context_uses(path.read_text(), str(path.relative_to(REPO)))
    assert not found, 'fork after threads can deadlock; use multiprocessing.get_context("spawn"):\n' + "\n".join(found)
