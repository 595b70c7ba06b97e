"""tools/ is sorted: benchmarks in tools/bench/, the examples in examples/, the user tools and test
infrastructure in tools/ itself; every script path the docs, README, Makefile, tests and scripts
name exists (a move that left a stale command behind fails here)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT_PATH = re.compile(r"\b((?:tools|examples)/[\w./-]*?\.(?:py|sh))\b")
# bench_x.py is the harness's placeholder for "any benchmark"; bench_not_here.py a test's missing one
PLACEHOLDERS = {"tools/bench/bench_x.py"}


def _texts():
    yield from [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").glob("*.md"))]
    for top in ("tools", "examples", "tests", "megatron_stepwise", "configs", "results"):
        yield from sorted(p for p in (REPO / top).rglob("*") if p.suffix in {".py", ".sh", ".md", ".yaml"})


def test_every_named_tools_or_examples_script_exists():
    stale = set()
    for path in _texts():
        for name in SCRIPT_PATH.findall(path.read_text(encoding="utf-8")):
            if name not in PLACEHOLDERS and not (REPO / name).is_file():
                stale.add(f"{path.relative_to(REPO)}: {name}")
    assert not stale, sorted(stale)


def test_benchmarks_live_in_tools_bench_and_examples_apart():
    top = {p.name for p in (REPO / "tools").iterdir() if p.is_file()}
    assert not {n for n in top if n.startswith("bench") or n in {"flops.py", "routing_sim.py"}}, top
    assert {"suite.py", "harness.py", "bench_pipeline.py", "flops.py"} <= {
        p.name for p in (REPO / "tools/bench").iterdir()
    }
    assert {"megatron_loop.py", "megatron_lm_pretrain.py"} <= {p.name for p in (REPO / "examples").iterdir()}
    assert (REPO / "tools" / "README.md").is_file()
