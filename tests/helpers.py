"""Plain helpers shared by the test modules (imported by bare name: `tests` is on pytest's
`pythonpath`). Fixtures live in conftest.py; these are functions because they are also called at
import time, from module-level data builders and from hypothesis strategies.

- `make_step`: the one Step factory of the tests.
- `run_launch`: `subprocess.run` for the tests' launches: the command gets its own session, and on a
  timeout (its own or the test's) its whole process tree is killed and its output printed.
- `run_torchrun` / `check_ok`: the one way the tests launch tests/workers/*_worker.py under torchrun.
- `tiny_lm`: a tiny tokenizer and the Qwen2 config sized to it, for the embedded engine.
- `load_script`: import a script of tools/ or launch/ by path, without touching sys.path.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_stepwise.steps import Step, TrajectoryID

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"


# ---- shard decisions ----------------------------------------------------------------------------


def stride_decide(dp: int = 1):
    """A `decide_shards` stand-in without a model: DP rank i trains rows i, i + dp, ... in one
    micro-batch, with the weights the batch has (no loss denominators)."""
    import torch

    from megatron_stepwise.algo.shards import ShardDecision

    def decide(rows) -> list:
        out, tokens = [], int(rows.lengths.sum())
        for rank in range(dp):
            mine = list(range(rank, rows.num_rows, dp))
            index = torch.as_tensor(mine, dtype=torch.long)
            trained = int(rows.trained.sum())
            out.append(
                ShardDecision(
                    [list(range(len(mine)))],
                    mine,
                    rank,
                    dp,
                    trained,
                    rows.num_rows,
                    tokens,
                    tokens,
                    False,
                    False,
                    rows.traj_index[index],
                    rows.group_index[index],
                )
            )
        return out

    return decide


# ---- steps ------------------------------------------------------------------------------------


def make_step(
    pid: str,
    k: int,
    prompt: Sequence[int] = (0, 1),
    resp: Optional[Sequence[int]] = None,
    mask: Optional[Sequence[int]] = None,
    *,
    last: bool = True,
    reward: float = 0.0,
    lp: Optional[Sequence[float]] = None,
    versions: Optional[Sequence[int]] = None,
    stop: str = "stop",
    meta: Optional[dict[str, Any]] = None,
) -> Step:
    """Step `k` of prompt `pid`'s trajectory (sample index `k`).

    `resp` defaults to token 7 at every position of `mask`; `mask` defaults to all ones over
    `resp` (at least one of the two is needed). Everything else is keyword-only:
    `last` -> is_last_step, `lp` -> rollout_logprobs, `versions` -> weight_versions,
    `stop` -> stop_reason, `meta` -> metadata.
    """
    if resp is None and mask is None:
        raise ValueError("make_step needs resp or mask")
    resp = [7] * len(mask) if resp is None else resp
    mask = [1] * len(resp) if mask is None else mask
    return Step(
        TrajectoryID(pid, k),
        list(prompt),
        resp,
        mask,
        rollout_logprobs=lp,
        reward=reward,
        is_last_step=last,
        stop_reason=stop,
        weight_versions=versions,
        metadata=dict(meta or {}),
    )


# ---- launches ---------------------------------------------------------------------------------


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launch's process group and every descendant (torchrun starts its workers in
    sessions of their own, which the group signal does not reach)."""
    import signal

    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group id is the launch's pid
    except OSError:
        pass
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(tree, timeout=10)


def run_launch(
    cmd: Sequence[str],
    *,
    timeout: float,
    input: Optional[str] = None,
    check: bool = False,
    capture_output: bool = True,
    text: bool = True,
    **popen_kwargs,
) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, ...)` for a launch that may hang.

    The command starts in a session (and process group) of its own. If it outlives `timeout`, or the
    test's own timeout (tests/timeouts.py) or anything else interrupts the wait, the group and every
    descendant are killed, what the command wrote is printed to stderr (the test's captured output:
    with the stack dumps the test's timeout made its Python processes write) and the exception goes on
    (subprocess.TimeoutExpired for `timeout`). No process of it outlives the call.
    """
    if capture_output:
        popen_kwargs.setdefault("stdout", subprocess.PIPE)
        popen_kwargs.setdefault("stderr", subprocess.PIPE)
    if input is not None:
        popen_kwargs["stdin"] = subprocess.PIPE
    proc = subprocess.Popen(list(cmd), text=text, start_new_session=True, **popen_kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException as e:
        _kill_tree(proc)
        try:
            out, err = proc.communicate(timeout=10)
        except BaseException:  # a pipe held open by a process that left the tree: give up on the output
            out = err = None
        print(
            f"[run_launch] killed after {type(e).__name__}: {' '.join(map(str, cmd))[:500]}\n"
            f"--- its stdout (tail) ---\n{(out or '')[-8000:]}\n--- its stderr (tail) ---\n{(err or '')[-16000:]}",
            file=sys.stderr,
        )
        if isinstance(e, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
        raise
    done = subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# ---- torchrun ---------------------------------------------------------------------------------


def train_command(run_dir, *overrides: str, config: str = "configs/tiny_cpu.yaml") -> list[str]:
    """`megatron-stepwise train CONFIG` of this checkout into `run_dir`, without the progress bar."""
    cli = [sys.executable, "-m", "megatron_stepwise.cli", "train", str(REPO / config)]
    return [*cli, f"logging.run_dir={run_dir}", "logging.progress=false", *overrides]


def run_torchrun(
    script: str, nproc: int, args: Sequence[str], timeout: float = 300, env: Optional[dict[str, str]] = None
) -> subprocess.CompletedProcess:
    """Run tests/workers/<script> under torchrun (CPU, gloo) with `nproc` processes; returns the
    CompletedProcess with its output captured (check it with `check_ok`).

    The repository goes first on PYTHONPATH; the worker imports its tests/workers/ siblings
    (worker_entry) by bare name because Python puts a script's directory on sys.path, and the
    tests/ helpers (megatron_cases, oracles) because tests/ goes on PYTHONPATH too.
    `env` adds or overrides variables (e.g. CUDA_VISIBLE_DEVICES="").
    """
    pythonpath = os.pathsep.join(p for p in (str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    full_env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1", **(env or {}))
    # --standalone: torchrun binds its own free port (a port picked here could be taken by
    # another job on a shared machine before torchrun listens on it).
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(TESTS / "workers" / script),
        *args,
    ]
    return run_launch(cmd, env=full_env, timeout=timeout, cwd=REPO)


def check_ok(proc: subprocess.CompletedProcess, what: str = "torchrun") -> None:
    """Fail with the tail of the output when a `run_torchrun` launch did not exit 0."""
    assert proc.returncode == 0, (
        f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )


# ---- tiny models ------------------------------------------------------------------------------


def tiny_lm(tokenizer: str = "tiny_word") -> tuple[Any, dict]:
    """(tokenizer, config): a shipped tiny tokenizer ("tiny_word", "tiny_char", "tiny_bpe"; loaded
    once per process, shared) and a fresh tiny Qwen2 config dict sized to its vocabulary."""
    from megatron_stepwise.hf.tokenizers import load_tokenizer
    from megatron_stepwise.rollout.engines.embedded.hf_model import tiny_qwen2_config

    tok = load_tokenizer(tokenizer)
    return tok, tiny_qwen2_config(len(tok))


# ---- scripts ----------------------------------------------------------------------------------


def load_script(path: Path, name: Optional[str] = None):
    """Import the script at `path` as module `name` (default: its stem) and register it in
    sys.modules, so that scripts outside the package (tools/, launch/) are tested without
    putting their folder on sys.path."""
    path = Path(path)
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
