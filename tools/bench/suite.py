"""The benchmark suite: one command, one table per benchmark, a summary against the performance targets,
and every result in one JSON file (plus a markdown table for the README). Benchmarks print
figures; they never assert. Every figure is a ratio or rate measured side by side in the same
run, because these machines are shared and noisy.

    python tools/bench/suite.py                      # the CPU suite (under 10 minutes on 2 cores)
    python tools/bench/suite.py --quick              # smaller workloads, no Ray start-up (under 2 minutes)
    python tools/bench/suite.py --only merge,host_pipeline --out results/bench.json
    python tools/bench/suite.py --only context --update --out results/bench_cpu.json   # re-run one, keep the rest
    megatron-stepwise bench ...                # the same

Each benchmark is a module `tools/bench/<module>.py` run in its own process (isolation: megatron's
process groups, Ray, memory; a hang is cut by a timeout). A module with a top-level
`run(quick) -> dict` is called through it and its dict is stored; one without is run as a
script (`--quick` passed in quick mode) and its printed output is stored instead. A module that
is not in this checkout is reported as missing, and the suite goes on. Benchmarks marked CPU
run with CUDA hidden, so the CPU suite measures the CPU on any machine; the GPU benchmark runs
where a GPU is present and prints why it is skipped otherwise. `--quick` leaves out the
benchmarks that start a Ray cluster (rollout, weight sync) unless `--only` names them: their
start-up alone is over a minute each on a busy 2-core machine.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parents[1]


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str  # tools/bench/<module>.py
    items: str  # the performance targets it covers
    title: str
    device: str = "cpu"  # "cpu": run with CUDA hidden; "gpu": as the machine is
    starts_ray: bool = False  # a Ray cluster per run: ~1-1.5 min of start-up on a busy 2-core machine


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark("padding", "bench_pipeline", "1, 6", "padding efficiency, layouts, DP balance"),
        Benchmark("merge", "bench_merge", "2", "merge savings as turns grow"),
        Benchmark("context", "bench_context", "2", "token-in/token-out vs re-tokenised context, BPE agent loop"),
        Benchmark("logprobs", "bench_logprobs", "3", "trained-positions-only log-probs vs full logits"),
        Benchmark("trainer_step", "bench_trainer_step", "4", "trainer step on CPU, packed vs padded"),
        Benchmark("host_pipeline", "bench_host", "5", "host pipeline overhead"),
        Benchmark("rollout", "bench_rollout", "7", "rollout fleet throughput, 1 vs 2 engines", starts_ray=True),
        Benchmark("weight_sync", "bench_weight_sync", "8", "weight sync Megatron -> HF", starts_ray=True),
        Benchmark("turn_cost", "bench_turn_cost", "-", "agent-loop host CPU per turn, both context modes"),
        Benchmark("env_calls", "bench_env_calls", "-", "sandboxed tool calls per second vs env concurrency"),
        Benchmark(
            "scale", "bench_scale", "-", "rollout side at 512x8x5: agent workers, sharded hand-off", starts_ray=True
        ),
        Benchmark("gpu", "bench_gpu", "9", "GPU training step tokens/s and MFU", device="gpu"),
    ]
}

SUITES: dict[str, list[str]] = {
    "cpu": list(BENCHMARKS),  # the GPU benchmark skips itself (with a message) without a GPU
    "gpu": ["gpu"],
}

TIMEOUT_S = {False: 300, True: 180}  # per benchmark: full, quick


# ------------------------------------------------------------------------------ child side


def worker(path: str, quick: bool, result_file: str) -> int:
    """Run `run(quick)` of the module at `path` in this (child) process; store its dict as JSON."""
    module_path = Path(path)
    sys.path.insert(0, str(module_path.parent))  # benchmarks import their siblings (flops, ...)
    spec = importlib.util.spec_from_file_location(module_path.stem, module_path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module_path.stem] = mod
    spec.loader.exec_module(mod)
    params = inspect.signature(mod.run).parameters
    result = mod.run(quick=quick) if "quick" in params else mod.run(quick) if params else mod.run()
    if not isinstance(result, dict):
        result = {"returned": result}
    with open(result_file, "w") as f:
        json.dump(result, f, indent=2, default=str)
    return 0


# ----------------------------------------------------------------------------- parent side


def has_run_function(path: Path) -> bool:
    """Whether the module defines a top-level `run` (read without importing it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(isinstance(node, ast.FunctionDef) and node.name == "run" for node in tree.body)


def gpu_visible() -> bool:
    """A cheap look for a GPU driver without importing torch (the benchmark checks CUDA itself)."""
    return bool(shutil.which("nvidia-smi")) or os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


def child_env(bench: Benchmark) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    # Polite on shared machines, and stable figures: one thread per benchmark process.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    if bench.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def stream(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str, bool]:
    """Run `cmd`, echoing its output live; (return code, output, timed out). On timeout the
    child's whole process group (it runs in a session of its own) is killed."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        code = proc.wait()
    finally:
        timer.cancel()
    return code, "".join(lines), timed_out.is_set()


def run_benchmark(bench: Benchmark, *, quick: bool, timeout_s: float, skip: Optional[str] = None) -> dict[str, Any]:
    path = TOOLS / f"{bench.module}.py"
    header = f"[{bench.name}] targets {bench.items}: {bench.title} (tools/bench/{path.name})"
    print(f"\n{'=' * len(header)}\n{header}\n{'=' * len(header)}", flush=True)

    def not_run(status: str, message: str) -> dict[str, Any]:
        print(f"{status.upper()}: {message}")
        return {"status": status, "module": bench.module, "message": message}

    if skip:
        return not_run("skipped", skip)
    if not path.exists():
        return not_run("missing", f"tools/bench/{path.name} is not in this checkout yet; nothing measured")
    if bench.device == "gpu" and not gpu_visible():
        return not_run(
            "skipped", "no GPU on this machine (no nvidia-smi, /dev/nvidiactl or /dev/kfd); nothing measured"
        )
    t0 = time.perf_counter()
    env = child_env(bench)
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        result_file = os.path.join(tmp, "result.json")
        if has_run_function(path):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path), "--result-file", result_file]
        else:
            cmd = [sys.executable, str(path)]
        if quick:
            cmd.append("--quick")
        code, output, timed_out = stream(cmd, env, timeout_s)
        entry: dict[str, Any] = {"module": bench.module, "seconds": time.perf_counter() - t0}
        if timed_out:
            entry.update(status="timeout", message=f"killed after {timeout_s:.0f} s")
        elif code != 0:
            entry.update(status="failed", message=f"exit code {code}; last output: {output.strip()[-500:]}")
        elif os.path.exists(result_file):
            with open(result_file) as f:
                result = json.load(f)
            if isinstance(result, dict) and result.get("skipped"):
                entry.update(status="skipped", message=str(result["skipped"]))
            else:
                entry.update(status="ok", result=result)
        else:  # a script without run(): its printed tables are the result
            entry.update(
                status="ok", message="no run() function: figures in the stored output only", result={"stdout": output}
            )
    print(f"[{bench.name}] {entry['status']} in {entry['seconds']:.1f} s", flush=True)
    return entry


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(label: Optional[str]) -> dict[str, Any]:
    torch_version = _version("torch")
    auto = f"{os.cpu_count()}-core CPU, torch {torch_version}"
    return {
        "label": label or auto,
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_version,
        "megatron_core": _version("megatron-core"),
    }


def select(suite: str, only: Optional[str]) -> list[Benchmark]:
    names = SUITES[suite]
    if only:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in BENCHMARKS]
        if unknown:
            raise SystemExit(f"--only: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
        names = [n for n in BENCHMARKS if n in wanted]
    return [BENCHMARKS[n] for n in names]


def quick_skip(bench: Benchmark, args: argparse.Namespace) -> Optional[str]:
    """Why --quick leaves `bench` out (None: it runs). Naming it in --only always runs it."""
    named = args.only and bench.name in [n.strip() for n in args.only.split(",")]
    if args.quick and bench.starts_ray and not named:
        return (
            f"--quick leaves out benchmarks that start a Ray cluster (1-1.5 min of start-up each on a busy "
            f"2-core machine); run it with --quick --only {bench.name}"
        )
    return None


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    if str(TOOLS) not in sys.path:  # also when loaded by `megatron-stepwise bench`
        sys.path.insert(0, str(TOOLS))
    import bench_report

    benches = select(args.suite, args.only)
    timeout_s = args.timeout or TIMEOUT_S[args.quick]
    previous = previous_report(args)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    fresh = {b.name: run_benchmark(b, quick=args.quick, timeout_s=timeout_s, skip=quick_skip(b, args)) for b in benches}
    total = time.perf_counter() - t0
    kept = previous.get("benchmarks", {})
    results = {name: fresh.get(name, kept.get(name)) for name in BENCHMARKS if name in fresh or name in kept}
    rows = [r for r in bench_report.evaluate(results) if r["benchmark"] in results]
    machine = machine_info(args.machine)
    mode = "quick" if args.quick else "full"
    print(f"\n{'=' * 30} summary: suite {args.suite} ({mode}), {total:.0f} s on {machine['label']} {'=' * 30}")
    print(bench_report.summary_table(rows))
    for name, entry in results.items():
        if entry["status"] != "ok":
            print(f"  {name}: {entry['status']}: {entry.get('message', '')}")
    report = {
        "suite": args.suite,
        "quick": args.quick,
        "started_utc": started.isoformat(timespec="seconds"),
        "total_seconds": total,
        "machine": machine,
        "figures": rows,
        "benchmarks": results,
    }
    if previous:  # the whole-suite run stays the reference; what was re-run is listed
        update = {
            "benchmarks": list(fresh),
            "quick": args.quick,
            "total_seconds": total,
            "started_utc": report["started_utc"],
            "machine": machine,
        }
        updates = previous.get("updates", []) + [update]
        report.update(
            {k: previous[k] for k in ("suite", "quick", "started_utc", "total_seconds", "machine")}, updates=updates
        )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str))
        md = out.with_suffix(".md")
        preamble = describe_runs(report)
        report_mode = "quick" if report["quick"] else "full"
        md.write_text(
            bench_report.markdown(
                rows, results, title=f"Benchmarks ({report['suite']} suite, {report_mode})", preamble=preamble
            )
        )
        print(f"\nwrote {out} and {md}")
    return report


def describe_runs(report: dict[str, Any]) -> str:
    """The tables' first paragraph: the run that measured them, and any later --update runs."""
    machine = report["machine"]
    started = datetime.datetime.fromisoformat(report["started_utc"])
    command = f"python tools/bench/suite.py --suite {report['suite']}{' --quick' if report['quick'] else ''}"
    text = (
        f"Measured with `{command}` on {machine['label']} (megatron-core {machine['megatron_core']}, Python "
        f"{machine['python']}), {started:%Y-%m-%d}, {report['total_seconds']:.0f} s in all. Ratios are measured "
        f"side by side in the same run."
    )
    for u in report.get("updates", []):
        when = datetime.datetime.fromisoformat(u["started_utc"])
        flags = f"--only {','.join(u['benchmarks'])}{' --quick' if u.get('quick') else ''} --update"
        text += f" Re-run later with `{flags}` on {u['machine']['label']}, {when:%Y-%m-%d}, {u['total_seconds']:.0f} s."
    return text


def previous_report(args: argparse.Namespace) -> dict[str, Any]:
    """With --update, the report already at --out (its other benchmarks are kept)."""
    if not getattr(args, "update", False):
        return {}
    if not args.out or not Path(args.out).exists():
        raise SystemExit(f"--update: no report at --out {args.out!r} to update")
    return json.loads(Path(args.out).read_text())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", choices=sorted(SUITES), default="cpu", help="which benchmarks to run (default: cpu)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller workloads; benchmarks that start Ray run only if named in --only (under 2 minutes)",
    )
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument("--out", default="results/bench.json", help="JSON results (and a .md table next to it)")
    p.add_argument("--machine", help="machine description for the tables (default: CPU count and torch version)")
    p.add_argument(
        "--update",
        action="store_true",
        help="re-run only the selected benchmarks and keep the others' results already in --out",
    )
    p.add_argument(
        "--timeout", type=float, help=f"seconds per benchmark (default {TIMEOUT_S[False]}, quick {TIMEOUT_S[True]})"
    )


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.quick, args.result_file)
    run_suite(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
