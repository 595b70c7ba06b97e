"""Start-up cost of `env.agent_command`'s sandbox per trajectory (prints figures; never asserts).

Runs a command `--repeats` times through `run_command` (its namespaces, the endpoint's socket
handed over, Landlock, seccomp, tear-down) and the same command without the sandbox, and prints
the median and fastest wall time of each: `true` (the sandbox alone) and `python -c "import
openai"` (what an SDK agent adds before its first call).

    python tools/bench/bench_agent_command.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from megatron_stepwise.envs.sandbox_command import CommandLimits, command_environment, command_isolation, run_command


def timed(argv: list[str], sandboxed: bool, repeats: int) -> str:
    times = []
    for _ in range(repeats):
        start = time.monotonic()
        if sandboxed:
            done = run_command(argv, command_environment({}), os.getcwd(), {}, CommandLimits(60.0), lambda s: s.close)
            assert done.returncode == 0, done.stderr
        else:
            subprocess.run(argv, check=True, env=command_environment({}))
        times.append(time.monotonic() - start)
    return f"median {statistics.median(times) * 1000:.0f} ms, fastest {min(times) * 1000:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print("isolation:", command_isolation().describe())
    for argv in (["true"], ["python", "-c", "import openai"]):
        for sandboxed in (True, False):
            where = "sandboxed" if sandboxed else "plain    "
            print(f"{' '.join(argv):28} {where} {timed(argv, sandboxed, args.repeats)}")


if __name__ == "__main__":
    main()
