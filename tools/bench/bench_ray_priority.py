"""Ray worker niceness under load: Ray's default (15) vs what the package sets (0).

Ray starts its worker processes (our engines and agent workers) at niceness 15. This starts one
busy loop per core at niceness 0 (a training rank spinning on its GPU, a data loader, another
job), then a local Ray with `worker_niceness` 15 or 0, and times a fixed amount of CPU work in a
Ray actor: the same work an engine or agent worker does between two waits. Each setting runs in
its own process (Ray's system config is fixed at start), alternating, side by side in one run.

    python tools/bench/bench_ray_priority.py            # 3 runs of each setting
    python tools/bench/bench_ray_priority.py --quick    # 1 run of each
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

from harness import add_seed_and_out, bench_parser, config, run_args, script_main  # noqa: E402

WORK = 3_000_000  # loop iterations: ~0.2-0.5 s of one core


def parse_args(argv=None):
    p = bench_parser(__doc__, "one run of each setting")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy", type=int, default=os.cpu_count(), help="busy loops at niceness 0 (default: one per core)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one timed run may take")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
    return args


def _spin(n: int) -> float:
    start = time.process_time()
    total = 0
    for i in range(n):
        total += i * i
    return time.process_time() - start


def child(niceness: int) -> dict:
    """In a fresh process: Ray at `niceness`, one actor, its fixed work timed (busy loops already run)."""
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"worker_niceness": niceness, "prestart_worker_first_driver": False},
    )

    @ray.remote(num_cpus=0.5)
    class Worker:
        def nice(self) -> int:
            return os.getpriority(os.PRIO_PROCESS, 0)

        def spin(self, n: int) -> float:
            return _spin(n)

    w = Worker.remote()
    seen = ray.get(w.nice.remote())  # started and answering
    start = time.perf_counter()
    cpu = ray.get(w.spin.remote(WORK))
    wall = time.perf_counter() - start
    ray.shutdown()
    return {"worker_niceness": seen, "wall_s": wall, "cpu_s": cpu}


def run(quick: bool = False, **options) -> dict:
    args = run_args(parse_args, quick, options)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    results: dict[int, list[dict]] = {15: [], 0: []}
    try:
        for _ in range(args.repeats):
            for niceness in (15, 0):
                cmd = [sys.executable, __file__, "--child", str(niceness)]
                try:
                    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                    r = (
                        json.loads(out.stdout.strip().splitlines()[-1])
                        if out.returncode == 0
                        else {"error": out.stderr[-500:]}
                    )
                except subprocess.TimeoutExpired:
                    r = {"error": f"not done within {args.timeout:.0f} s"}
                results[niceness].append(r)
                print(
                    f"niceness {niceness:>2}: "
                    + (f"{r['wall_s']:.2f} s wall for {r['cpu_s']:.2f} s of CPU" if "wall_s" in r else r["error"]),
                    flush=True,
                )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    summary = {"config": config(args), "busy_loops": args.busy, "runs": {str(k): v for k, v in results.items()}}
    walls = {k: [r["wall_s"] for r in v if "wall_s" in r] for k, v in results.items()}
    if walls[15] and walls[0]:
        summary["median_wall_s"] = {str(k): statistics.median(v) for k, v in walls.items()}
        summary["slowdown_at_15"] = statistics.median(walls[15]) / statistics.median(walls[0])
        print(
            f"\n{args.busy} busy loops: the same actor work takes {summary['slowdown_at_15']:.1f}x as long at "
            f"Ray's default niceness 15 as at 0 (median {summary['median_wall_s']['15']:.2f} s vs "
            f"{summary['median_wall_s']['0']:.2f} s)"
        )
    return summary


if __name__ == "__main__":
    if "--child" in sys.argv:  # one timed run, started by run()
        print(json.dumps(child(int(sys.argv[sys.argv.index("--child") + 1]))))
    else:
        script_main(parse_args, run)
