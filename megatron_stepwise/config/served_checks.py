"""Checks of the second models (`teacher:`, `judge:`) and what uses them (`algo.opd_coef`, `env.judge`)."""

from __future__ import annotations

from megatron_stepwise.config.checker import Checker
from megatron_stepwise.config.probes import Probes
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.hf import hub

# SGLang 0.5.23 computes prompt (input) log-probs from the raw logits: only output tokens' are
# divided by the temperature (sglang/srt/layers/logprob_processor.py, InputLogprobProcessor).
SGLANG_PROMPT_LOGPROBS = "SGLang 0.5.23 returns prompt log-probs without temperature"


def check_served(cfg: ExperimentConfig, check: Checker, probes: Probes) -> None:
    _check_teacher(cfg, check)
    _check_judge(cfg, check)
    for role in ("teacher", "judge"):
        _check_source(cfg, check, probes, role)
        _check_ports(cfg, check, role)


def _check_teacher(cfg: ExperimentConfig, check: Checker) -> None:
    from megatron_stepwise.algo.distill import OPD, opd_coef

    teacher, temperature = cfg.teacher, cfg.rollout.sampling.temperature
    coef = opd_coef(cfg.algo.estimator, cfg.algo.opd_coef)
    if coef and not teacher.enabled:
        key = "algo.estimator" if cfg.algo.estimator == OPD else "algo.opd_coef"
        check.fail(key, "on-policy distillation needs a teacher: set teacher.hf_checkpoint", "teacher.hf_checkpoint")
    if teacher.enabled and not coef:
        check.fail(
            "teacher.hf_checkpoint",
            "a teacher is served but nothing trains on its scores: set algo.estimator: opd or algo.opd_coef > 0",
            "algo.opd_coef",
        )
    if teacher.temperature is not None and teacher.temperature != temperature:
        check.fail(
            "teacher.temperature",
            f"is {teacher.temperature} but rollout.sampling.temperature is {temperature}: the distillation "
            "advantage subtracts the rollout's log-probs, taken at the rollout temperature, from the teacher's, "
            "so both must be at one temperature (leave teacher.temperature null)",
            "rollout.sampling.temperature",
        )
    if teacher.enabled and teacher.engine == "sglang" and temperature != 1.0:
        check.fail(
            "teacher.engine",
            f"is sglang but rollout.sampling.temperature is {temperature}: {SGLANG_PROMPT_LOGPROBS}, so an SGLang "
            "teacher can score only at temperature 1.0 (use teacher.engine: embedded, or sample at 1.0)",
            "rollout.sampling.temperature",
        )


def _check_judge(cfg: ExperimentConfig, check: Checker) -> None:
    if cfg.env.judge.enabled and not cfg.judge.enabled:
        check.fail("env.judge.prompt", "is set but no judge model is: set judge.hf_checkpoint", "judge.hf_checkpoint")
    if cfg.judge.enabled and not cfg.env.judge.enabled:
        check.fail("judge.hf_checkpoint", "a judge is served but env.judge.prompt is not set: nothing asks it")


def _check_source(cfg: ExperimentConfig, check: Checker, probes: Probes, role: str) -> None:
    """The served model must be found on this node, as the policy's `model.hf_checkpoint`: a local
    directory, a GGUF source, or a hub id in the HF cache (or one `model.allow_download` fetches)."""
    key, source = f"{role}.hf_checkpoint", getattr(cfg, role).hf_checkpoint
    if not source:
        return
    if hub.is_gguf_source(source):
        problem = probes.gguf_problem(source, key)
        if problem:
            check.fail(key, problem)
        return
    if probes.locate_model(source, hub.CHECKPOINT_FILES) is not None:
        return
    if hub.looks_like_path(source) or source.count("/") != 1:  # a hub id is exactly Org/Name
        check.fail(key, f"{source!r}: no such file or directory")
    elif not cfg.model.allow_download:
        check.fail(
            key,
            f"{source!r} is neither a local path nor in the Hugging Face cache ({hub.hub_cache_dir()}); "
            f"download it first (hf download {source}) or set model.allow_download=true",
            "model.allow_download",
        )


def _check_ports(cfg: ExperimentConfig, check: Checker, role: str) -> None:
    """Launched SGLang servers of two groups must not share ports (both default to 30000 + i)."""
    section = getattr(cfg, role)
    if not section.enabled or section.engine != "sglang" or section.sglang.servers:
        return
    mine = set(range(section.sglang.base_port, section.sglang.base_port + section.num_engines))
    r = cfg.rollout
    groups = [("rollout", r.sglang.base_port, r.num_engines)] if r.engine == "sglang" and not r.sglang.servers else []
    for other in ("teacher", "judge"):
        o = getattr(cfg, other)
        if other != role and o.enabled and o.engine == "sglang" and not o.sglang.servers:
            groups.append((other, o.sglang.base_port, o.num_engines))
    for name, base, n in groups:
        if mine & set(range(base, base + n)) and (name == "rollout" or name < role):
            check.fail(
                f"{role}.sglang.base_port",
                f"{section.sglang.base_port} gives {role}'s servers ports {name}'s servers launch on too "
                f"({base}..{base + n - 1}): give it a range of its own",
                f"{name}.sglang.base_port",
            )
