"""What training does with the rollouts: mini-batches, the estimator and the loss, the optimizer's schedule."""

from __future__ import annotations

import difflib
import re

from megatron_stepwise.config.checker import Checker
from megatron_stepwise.config.schema import ExperimentConfig

_KEY_RE = re.compile(r"^[a-z_]+(\.[a-z_]+)+$")


def check_data(cfg: ExperimentConfig, check: Checker) -> None:
    data, ro = cfg.data, cfg.rollout
    if data.prompts_per_iteration % data.prompts_per_minibatch:
        check.fail(
            "data.prompts_per_minibatch",
            f"{data.prompts_per_minibatch} does not divide "
            f"data.prompts_per_iteration {data.prompts_per_iteration} "
            "(each mini-batch is a fixed number of prompts)",
            "data.prompts_per_iteration",
        )
    longest = ro.max_input_length + ro.max_new_tokens
    if data.max_tokens_per_microbatch < longest:
        check.fail(
            "data.max_tokens_per_microbatch",
            f"{data.max_tokens_per_microbatch} cannot hold one step "
            f"of rollout.max_input_length + rollout.max_new_tokens = "
            f"{longest} tokens",
            "rollout.max_input_length",
            "rollout.max_new_tokens",
        )


def check_algo(cfg: ExperimentConfig, check: Checker) -> None:
    from megatron_stepwise.algo import advantages

    algo, data = cfg.algo, cfg.data
    _check_turn_estimator(cfg, check)  # imports turn_credit, which registers the turn estimators
    if data.samples_per_prompt == 1:
        # Outcome and turn estimators compare the trajectories of a prompt (the registry's kinds).
        name = algo.estimator
        compares = not (advantages.is_temporal_estimator(name) or advantages.is_token_estimator(name))
        if name in advantages.list_estimators() and compares:
            check.fail(
                "data.samples_per_prompt",
                f"is 1 but algo.estimator {name} compares the trajectories of a prompt: every advantage would be 0",
                "algo.estimator",
            )
            return  # the filters below fail for the same reason; one fix solves both
        for key in ("zero_variance", "dynamic_sampling"):
            if getattr(algo.filters, key):
                check.fail(
                    f"algo.filters.{key}",
                    "a group of one trajectory (data.samples_per_prompt=1) has "
                    "no reward variance: every group would be dropped",
                    "data.samples_per_prompt",
                )


def _check_turn_estimator(cfg: ExperimentConfig, check: Checker) -> None:
    """The estimator's options (any estimator), and a turn-level one's per-turn rewards to credit
    (docs/credit.md)."""
    from megatron_stepwise.algo import advantages, turn_credit

    name = cfg.algo.estimator
    if name not in advantages.list_estimators():
        return
    if not advantages.is_turn_estimator(name):
        for key, message in advantages.option_problems(name, dict(cfg.algo.estimator_options)):
            check.fail(key, message, "algo.estimator")
        return
    if cfg.rollout.max_turns == 1:
        check.fail(
            "algo.estimator",
            f"{name} credits each turn with the rewards from it on, but "
            "rollout.max_turns=1 leaves one turn per trajectory and no per-turn "
            "rewards: use its outcome estimator (rloo, grpo, dr_grpo)",
            "rollout.max_turns",
        )
    for key, message in turn_credit.check_turn_options(name, dict(cfg.algo.estimator_options)):
        check.fail(key, message, "algo.estimator")


# Keys the loss checks of megatron_stepwise.algo read: a parse error in any of them silences them.
_LOSS_KEYS = ("algo.estimator", "algo.loss", "data.merge_steps", "rollout.max_turns")


def check_loss_combinations(cfg: ExperimentConfig, check: Checker) -> None:
    """Estimator and loss options that cannot work (together, or with merged steps).

    Delegated to `megatron_stepwise.algo.losses.check_loss_compatibility`, which knows the
    estimator registry (custom estimators included) and which losses are sequence-level; its
    messages start with the offending key (`algo.loss.reduction='step_mean' cannot ...`). The
    loss section's own checks (`LossConfig.problems()`) ran in `_check_declared`.
    """
    from megatron_stepwise.algo import advantages, losses

    errors = losses.check_loss_compatibility(
        cfg.algo.loss,
        merge_steps=cfg.data.merge_steps,
        estimator=cfg.algo.estimator,
        multi_step=cfg.rollout.max_turns > 1,
    )
    names = {"algo.estimator": advantages.list_estimators()}
    for error in errors:
        key = _leading_key(error, "algo")
        message = _after_key(error)
        if key in names and "not a registered" in error:
            hint = difflib.get_close_matches(_value_at(cfg, key), names[key], n=1)
            message += (
                f"; did you mean {hint[0]!r}?" if hint else ""
            ) + " (custom ones are registered by a module listed in trainer.imports)"
        check.fail(key, message, *_LOSS_KEYS)


def _leading_key(message: str, fallback: str) -> str:
    head = message.split("=", 1)[0]
    return head if "=" in message and _KEY_RE.match(head) else fallback


def _after_key(message: str) -> str:
    """`algo.loss.tis='sequence' cannot ...` -> `'sequence' cannot ...` (the key is shown separately)."""
    head, sep, rest = message.partition("=")
    return rest if sep and _KEY_RE.match(head) else message


def _value_at(cfg: ExperimentConfig, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check_optim(cfg: ExperimentConfig, check: Checker) -> None:
    opt, data = cfg.optim, cfg.data
    if opt.min_lr > opt.lr:
        check.fail("optim.min_lr", f"{opt.min_lr} is above optim.lr {opt.lr}", "optim.lr")
    if data.prompts_per_iteration % data.prompts_per_minibatch == 0:
        steps = cfg.total_optimizer_steps
        if opt.warmup_steps > steps:
            check.fail(
                "optim.warmup_steps",
                f"{opt.warmup_steps} exceeds the {steps} optimizer steps of the run "
                "(trainer.iterations x data.epochs x mini-batches per iteration)",
                "trainer.iterations",
                "data.epochs",
                "data.prompts_per_iteration",
                "data.prompts_per_minibatch",
            )
