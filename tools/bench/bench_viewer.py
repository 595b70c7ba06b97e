"""What `megatron-stepwise view` costs on large iterations: seconds, peak RSS and page sizes.

Writes a synthetic dump per size (trajectories of 4 turns of 1,000 response tokens each, prompts
carrying the whole history, as multi-turn dumps do; tiny_word tokenizer), then runs `view` on it
in a child process and prints its wall time, its peak RSS (wait4) and the size of the largest page
and of all pages. No asserts: numbers are printed.

    python tools/bench/bench_viewer.py                       # ~40k and ~400k response tokens
    python tools/bench/bench_viewer.py --tokens 40000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TURNS, TURN_TOKENS = 4, 1000


def synthetic_dump(run_dir: Path, response_tokens: int) -> None:
    from megatron_stepwise.algo.groups import groups_of
    from megatron_stepwise.loop.rounds import RowsOnRank0
    from megatron_stepwise.rundir.dump_recorder import DumpRecorder
    from megatron_stepwise.rundir.dump_table import dump_path
    from megatron_stepwise.rundir.dumps import write_dump
    from megatron_stepwise.steps import Step, TrajectoryID

    steps = []
    for t in range(max(1, response_tokens // (TURNS * TURN_TOKENS))):
        history = [1, 5, 8, 11 + t % 9, 2, 1, 6]
        for turn in range(TURNS):
            resp = [4 + (k * 7 + t) % 16 for k in range(TURN_TOKENS - 1)] + [2]
            steps.append(
                Step(
                    TrajectoryID(f"p{t // 4}", t % 4),
                    list(history),
                    resp,
                    [1] * (TURN_TOKENS - 1) + [0],
                    rollout_logprobs=[-0.25] * TURN_TOKENS,
                    reward=float(t % 2) if turn == TURNS - 1 else 0.0,
                    is_last_step=turn == TURNS - 1,
                    stop_reason="stop" if turn == TURNS - 1 else "length",
                    weight_versions=[3] * TURN_TOKENS,
                    metadata={"turn": turn},
                )
            )
            history = history + resp + [1, 5, 10, 2, 1, 6]
    recorder = DumpRecorder(every=1)
    recorder.begin(3)
    RowsOnRank0(recorder=recorder).hold(groups_of(steps))  # rank 0 prepares it: the recorder keeps it
    for cap in recorder.minibatches:
        cap.trainer_logprobs = cap.batch.token_fields["rollout_logprobs"] + 1e-4
    config = {"name": "bench_viewer", "env": {"name": "echo"}}
    write_dump(dump_path(run_dir, 3), recorder.minibatches, iteration=3, weight_version=3, config=config,
               train_metrics=[], tokenizer="tiny_word")  # fmt: skip


def measure(response_tokens: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_viewer_") as tmp:
        run_dir = Path(tmp)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        # the dump is made in a process of its own: a child forked from a large parent would
        # report the parent's size as its peak RSS (Linux keeps ru_maxrss across exec)
        subprocess.run(
            [sys.executable, __file__, "--make-dump", str(run_dir), str(response_tokens)], env=env, check=True
        )
        cmd = [sys.executable, "-m", "megatron_stepwise.cli", "view", str(run_dir)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        out = proc.stdout.read().decode()
        proc.stdout.close()
        if status != 0:
            raise SystemExit(f"view failed: {out}")
        pages = list((run_dir / "view").rglob("*.html"))
        sizes = [p.stat().st_size for p in pages]
        dump_size = sum(p.stat().st_size for p in (run_dir / "rollouts").glob("*.parquet"))
        return {
            "response tokens": response_tokens,
            "view s": round(wall, 2),
            "peak RSS MiB": round(usage.ru_maxrss / 1024),  # Linux: KiB
            "files": len(pages),
            "largest page MB": round(max(sizes) / 1e6, 2),
            "all pages MB": round(sum(sizes) / 1e6, 1),
            "dump MB": round(dump_size / 1e6, 2),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[40_000, 400_000])
    ap.add_argument("--make-dump", nargs=2, metavar=("RUN_DIR", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_dump:
        return synthetic_dump(Path(args.make_dump[0]), int(args.make_dump[1]))
    rows = [measure(n) for n in args.tokens]
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))


if __name__ == "__main__":
    main()
