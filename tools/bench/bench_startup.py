"""What a training launch costs before its first iteration: CPU seconds per process, wall seconds.

Runs `megatron-stepwise train configs/tiny_cpu.yaml` (2 training ranks under torchrun, 2
embedded engines on a local Ray, `--iterations` iterations, no checkpoints) and samples the CPU
of every process it starts (the launcher, the ranks, Ray's GCS, raylet and agents, the engine
actors, Ray's idle workers) until it exits. It prints, per role, the CPU seconds spent up to the
moment the first iteration's metrics line appears (start-up plus that one iteration, whose own
`budget/wall` is printed too) and over the whole run, and the wall seconds to that line.

With `--against REF` the same launch also runs on the code of git revision REF (exported into a
temporary directory), the two alternating so machine load hits both alike, and the figures are
printed side by side; then every metrics line of the two is compared: each non-timing value must
be equal (a cut in start-up must not change what the run computes).

    python tools/bench/bench_startup.py                          # this checkout, 1 launch
    python tools/bench/bench_startup.py --against main --repeats 3 --iterations 3
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

from harness import REPO, add_seed_and_out, bench_parser, write_json  # noqa: E402
from process_cpu import ProcessTreeSampler  # noqa: E402

# Keys that measure time (or a rate over time): they differ between any two runs.
TIMING_PREFIXES = ("time/", "budget/", "perf/")
TIMING_KEYS = {"weight_sync/seconds", "weight_sync/MBps", "weight_sync/verify_s", "weight_sync/verify_share"}
# Keys that differ between two launches of the same code (measured): which requests an engine
# batches together depends on when they arrive, which moves its prefix-cache hits and the last
# bits of its log-probs. Compared within these tolerances (None: not compared).
VARIES_BETWEEN_LAUNCHES = {
    "fleet/cached_tokens": None,
    "train/logprob_gap": 1e-6,
    "train/logprob_gap_max": 1e-6,
    "train/logprob_gap/train_vs_rollout": 1e-6,
}
POLL_S = 0.2


def parse_args(argv=None):
    p = bench_parser(__doc__, "one launch per variant, 2 iterations")
    p.add_argument("--against", metavar="REF", help="also run git revision REF's code, side by side")
    p.add_argument("--repeats", type=int, default=1, help="launches per variant (medians are printed)")
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--config", default="configs/tiny_cpu.yaml", help="relative to each variant's checkout")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every launch")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.iterations = 1, 2
    return args


def export_revision(ref: str, into: Path) -> Path:
    """REF's tracked files in `into` (git archive: no build outputs, no venv)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"--against {ref}: git archive failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def launch(code: Path, run_dir: Path, args) -> dict[str, Any]:
    """One `train` launch of the checkout at `code`: per-role CPU at the first metrics line and at
    the end, wall seconds to that line and in all, and the metrics lines."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "megatron_stepwise.cli",
        "train",
        str(code / args.config),
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        f"trainer.iterations={args.iterations}",
        "checkpoint.every=0",
        "checkpoint.resume=never",
        *args.overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(code)}
    metrics = run_dir / "metrics.jsonl"
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = ProcessTreeSampler(proc.pid)
        first: Optional[dict] = None
        first_wall = None
        while proc.poll() is None:
            now = time.monotonic() - start
            sampler.poll(now)
            if first is None and _has_line(metrics):
                first, first_wall = sampler.by_role(), now
            if now > args.timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                raise SystemExit(f"launch of {code} ran past {args.timeout:.0f} s; its output: {log.name}")
            time.sleep(POLL_S)
        wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"launch of {code} failed (exit code {proc.returncode}); its output: {log.name}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {
        "first": first or sampler.by_role(),
        "first_wall": first_wall if first_wall is not None else wall,
        "first_iteration_wall": rows[0].get("budget/wall", 0.0) if rows else 0.0,
        "whole": sampler.by_role(),
        "wall": wall,
        "rows": rows,
    }


def _has_line(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return b"\n" in f.read(1 << 16)
    except OSError:
        return False


def metric_differences(a: list[dict], b: list[dict]) -> list[str]:
    """Every non-timing value that differs between two runs' metrics lines, one line each."""
    if len(a) != len(b):
        return [f"{len(a)} vs {len(b)} metrics lines"]
    diffs = []
    for i, (ra, rb) in enumerate(zip(a, b)):
        keys = {k for k in ra.keys() | rb.keys() if not k.startswith(TIMING_PREFIXES) and k not in TIMING_KEYS}
        diffs += [f"line {i}: {k}: {ra.get(k)!r} vs {rb.get(k)!r}" for k in sorted(keys) if _differ(k, ra, rb)]
    return diffs


def _differ(key: str, a: dict, b: dict) -> bool:
    va, vb = a.get(key), b.get(key)
    if key not in VARIES_BETWEEN_LAUNCHES or va is None or vb is None:
        return va != vb
    tolerance = VARIES_BETWEEN_LAUNCHES[key]
    return tolerance is not None and abs(va - vb) > tolerance


def summarise(launches: list[dict]) -> dict[str, Any]:
    """Medians over the launches of one variant: per role CPU (first line / whole run), walls."""
    roles = {r for launch in launches for r in launch["whole"]}

    def med(part: str, r: str) -> float:
        return statistics.median(launch[part].get(r, {}).get("cpu", 0.0) for launch in launches)

    per_role = {
        r: {
            "first": med("first", r),
            "whole": med("whole", r),
            "count": max(launch["whole"].get(r, {}).get("count", 0) for launch in launches),
        }
        for r in roles
    }
    return {
        "roles": dict(sorted(per_role.items(), key=lambda kv: -kv[1]["first"])),
        "first_cpu": statistics.median(sum(v["cpu"] for v in x["first"].values()) for x in launches),
        "whole_cpu": statistics.median(sum(v["cpu"] for v in x["whole"].values()) for x in launches),
        "first_wall": statistics.median(x["first_wall"] for x in launches),
        "first_iteration_wall": statistics.median(x["first_iteration_wall"] for x in launches),
        "wall": statistics.median(x["wall"] for x in launches),
    }


def print_table(results: dict[str, dict]) -> None:
    names = list(results)
    roles = list(dict.fromkeys(r for s in results.values() for r in s["roles"]))
    head = "".join(f" | {n[:26]:>26s}" for n in names)
    print(f"\n{'CPU seconds: to the 1st metrics line / whole run':50s}{head}")
    for r in roles:
        cells = ""
        for n in names:
            v = results[n]["roles"].get(r)
            cells += f" | {v['first']:8.2f} / {v['whole']:6.2f} (x{v['count']:<2d})" if v else f" | {'-':>26s}"
        print(f"{r:50s}{cells}")
    rows = [
        ("total CPU seconds", lambda s: f"{s['first_cpu']:8.2f} / {s['whole_cpu']:6.2f}     "),
        (
            "wall seconds to the 1st metrics line / whole run",
            lambda s: f"{s['first_wall']:8.2f} / {s['wall']:6.2f}     ",
        ),
        ("of which the 1st iteration itself (budget/wall)", lambda s: f"{s['first_iteration_wall']:8.2f}          "),
    ]
    for label, cell in rows:
        print(f"{label:50s}" + "".join(f" | {cell(results[n]):>26s}" for n in names))


def run(
    against: Optional[str] = None,
    repeats: int = 1,
    iterations: int = 2,
    config: str = "configs/tiny_cpu.yaml",
    timeout: float = 600.0,
    overrides: Optional[list[str]] = None,
    quick: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    args = parse_args(["--repeats", str(repeats), "--iterations", str(iterations), "--config", config])
    args.timeout, args.overrides = timeout, list(overrides or [])
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        variants = {"this checkout": REPO}
        if against:
            variants[against] = export_revision(against, Path(tmp) / "against")
        launches: dict[str, list[dict]] = {name: [] for name in variants}
        for i in range(repeats):  # alternating: load on the machine hits every variant alike
            for n, (name, code) in enumerate(variants.items()):
                print(f"[{name}] launch {i + 1}/{repeats}", flush=True)
                launches[name].append(launch(code, Path(tmp) / f"run{n}_{i}", args))
    results = {name: summarise(runs) for name, runs in launches.items()}
    print_table(results)
    base_rows = next(iter(launches.values()))[0]["rows"]
    diffs = [d for runs in launches.values() for x in runs for d in metric_differences(base_rows, x["rows"])]
    print(
        f"\nmetrics, every non-timing value of {len(base_rows)} lines x {sum(map(len, launches.values()))} launches: ",
        end="",
    )
    print("equal" if not diffs else f"{len(diffs)} differences:\n  " + "\n  ".join(diffs[:40]))
    return {"config": vars(args), "results": results, "metric_differences": diffs}


if __name__ == "__main__":
    a = parse_args()
    out = run(a.against, a.repeats, a.iterations, a.config, a.timeout, a.overrides, a.quick, a.seed)
    write_json(out, a.out)
    sys.exit(1 if out["metric_differences"] else 0)
