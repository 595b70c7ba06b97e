"""The run as a whole: its name and the directories it writes, the logging packages, and sizes
each key allows but no run can hold."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_stepwise.config.checker import Checker
from megatron_stepwise.config.probes import Probes
from megatron_stepwise.config.schema import ExperimentConfig

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def check_outputs(cfg: ExperimentConfig, check: Checker, probes: Probes) -> None:
    if not _SAFE_NAME.fullmatch(cfg.name) or ".." in cfg.name:
        # The default run directory is runs/<name>: a path in the name would write elsewhere.
        check.fail(
            "name",
            f"{cfg.name!r} must be a plain name (letters, digits, . _ + -, no path); choose "
            "another directory with logging.run_dir",
            "logging.run_dir",
        )
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never") and not Path(resume).expanduser().exists():
        check.fail("checkpoint.resume", f"is neither auto, never nor an existing checkpoint path: {resume!r}")
    # The directories the run writes, checked before anything starts (not a traceback at the first write).
    outputs = {"logging.run_dir": cfg.run_dir}
    if cfg.checkpoint.dir:
        outputs["checkpoint.dir"] = cfg.checkpoint.dir
    if cfg.weight_sync.mode == "disk" and cfg.weight_sync.dir:
        outputs["weight_sync.dir"] = cfg.weight_sync.dir
    for key, directory in outputs.items():
        problem = probes.output_dir_problem(directory)
        if problem:
            check.fail(key, problem)
    if cfg.logging.tensorboard and not probes.has_module("tensorboard"):
        check.fail("logging.tensorboard", "needs the tensorboard package (pip install tensorboard)")
    if cfg.logging.wandb.project and not probes.has_module("wandb"):
        check.fail("logging.wandb.project", "W&B logging needs the wandb package (pip install wandb)")


INT32_MAX = 2**31 - 1  # token positions, packed-sequence offsets (cu_seqlens) and row counts are int32
MAX_BUCKET_MB = 1 << 20  # one weight bucket is held in host memory: 1 TiB is past any node


def check_sizes(cfg: ExperimentConfig, check: Checker) -> None:
    """Sizes each key's own bounds allow but no run can have (they fail deep inside a run)."""
    ro, data = cfg.rollout, cfg.data
    if ro.engine == "sglang" and not ro.sglang.servers:
        last = ro.sglang.base_port + ro.num_engines - 1
        if last > 65535:
            check.fail(
                "rollout.sglang.base_port",
                f"{ro.sglang.base_port} + rollout.num_engines {ro.num_engines} - 1 = port {last}, past 65535",
                "rollout.num_engines",
            )
    if cfg.weight_sync.bucket_mb > MAX_BUCKET_MB:
        check.fail(
            "weight_sync.bucket_mb",
            f"{cfg.weight_sync.bucket_mb} MiB: one bucket is held in memory (at most {MAX_BUCKET_MB})",
        )
    longest = ro.max_input_length + ro.max_new_tokens
    if longest > INT32_MAX:
        check.fail(
            "rollout.max_input_length",
            f"+ rollout.max_new_tokens = {longest} tokens: past the {INT32_MAX} positions a sequence can have",
            "rollout.max_new_tokens",
        )
    if data.max_tokens_per_microbatch > INT32_MAX:
        check.fail(
            "data.max_tokens_per_microbatch",
            f"{data.max_tokens_per_microbatch}: past the {INT32_MAX} tokens a packed micro-batch can index",
        )
    samples = max(data.samples_per_prompt, cfg.eval_.samples_per_prompt or 0)
    if data.prompts_per_iteration * samples > INT32_MAX:
        check.fail(
            "data.prompts_per_iteration",
            f"{data.prompts_per_iteration} x {samples} samples per prompt = "
            f"{data.prompts_per_iteration * samples} trajectories per iteration: past {INT32_MAX}",
            "data.samples_per_prompt",
            "eval.samples_per_prompt",
        )
