"""The package's layering (pyproject.toml [tool.importlinter]) holds, and it has no import cycle.

`lint-imports` checks the contracts (cli -> offline -> loop -> workers -> compose -> config ->
(mcore | rollout) -> envs -> metrics -> algo -> data -> viewer -> rundir -> base -> errors; algo/steps/data/
config/hf free of Megatron, Ray and engines; the viewer reads files only). Cycles are counted on
the same import graph (grimp, function-local imports included) as networkx's strongly connected
components.
"""

import shutil
import sys
from pathlib import Path

import grimp
import networkx
from helpers import run_launch

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    result = run_launch([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def import_cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (networkx)."""
    g = networkx.DiGraph()
    for m in graph.modules:
        g.add_node(m)
        g.add_edges_from((m, i) for i in graph.find_modules_directly_imported_by(m))
    return sorted(sorted(c) for c in networkx.strongly_connected_components(g) if len(c) > 1)


def test_the_package_has_no_import_cycle():
    graph = grimp.build_graph("megatron_stepwise", cache_dir=None)
    assert len(graph.modules) > 50  # the whole package was scanned
    assert import_cycles(graph) == []


def test_the_cycle_counter_finds_a_cycle():
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.b", imported="p.c")
    assert import_cycles(graph) == [["p.a", "p.b"]]
