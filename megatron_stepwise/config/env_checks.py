"""The environment: its name or reward function, env.agent, its options, and the dataset it reads."""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path

from megatron_stepwise.config.checker import Checker
from megatron_stepwise.config.probes import Probes
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.hf.hub import looks_like_path


def check_env(cfg: ExperimentConfig, check: Checker, probes: Probes) -> None:
    env = cfg.env
    if env.agent:
        problem = _agent_problem(env.agent)
        if problem:
            check.fail("env.agent", problem)
    if env.agent_command is not None:
        problem = _agent_command_problem(env)
        if problem:
            check.fail("env.agent_command", problem, "env.agent")
    # env.name keeps its default (echo, also what tiny_cpu.yaml names) unless the user chose another one.
    if env.reward_fn and env.name != type(env)().name:
        check.fail(
            "env.reward_fn",
            f"is set and so is env.name ({env.name!r}): the reward function is the environment; set only one",
            "env.name",
        )
        return
    dotted = ":" in env.name or bool(env.reward_fn)
    names = probes.registered("env")
    if not dotted and names is not None and env.name not in names:
        hint = difflib.get_close_matches(env.name, sorted(names), n=1)
        check.fail(
            "env.name",
            f"unknown environment {env.name!r} (registered: {', '.join(sorted(names))})"
            + (f"; did you mean {hint[0]!r}?" if hint else ""),
        )
        return
    missing_file = False
    for key in ("dataset", "eval_dataset"):
        value = getattr(env, key)
        if value and looks_like_path(value) and not Path(value).expanduser().exists():
            check.fail(f"env.{key}", f"no such file: {value}")
            missing_file = True
    spec = probes.env_spec(env.name, env.reward_fn)
    if isinstance(spec, str):
        if dotted:  # a registered name that is unknown was reported above, when the registry was known
            check.fail("env.reward_fn" if env.reward_fn else "env.name", spec)
        return
    unknown = _unaccepted_options(spec.factory, env.options)
    if unknown:
        check.fail(
            "env.options",
            f"environment {spec.name!r} takes no option {', '.join(map(repr, unknown))} "
            f"(it accepts: {', '.join(_accepted_options(spec.factory)) or 'none'})",
        )
    if spec.tokenizer is None and not (cfg.model.tokenizer or cfg.model.hf_checkpoint):
        check.fail(
            "model.tokenizer",
            f"environment {spec.name!r} ships no tokenizer: set model.tokenizer (or model.hf_checkpoint)",
            "model.hf_checkpoint",
        )
    if not missing_file:
        _check_dataset(cfg, check, probes, spec)


def _agent_problem(path: str) -> str | None:
    """Why `env.agent` names no function (its module is imported, as env.name's is); None if it does."""
    from megatron_stepwise.envs.custom import load_object

    try:
        agent = load_object(path, key="env.agent")
    except Exception as e:  # the user's module failing to import is a finding, not a crash
        return str(e).removeprefix(f"env.agent={path!r}: ")
    return None if callable(agent) else f"{path!r} is not a function"


def _agent_command_problem(env) -> str | None:
    """Why `env.agent_command` cannot run: both agents set, no command line, no such program."""
    import shutil

    from megatron_stepwise.gateway.config import AgentConfig

    if env.agent:
        return "is set and so is env.agent: your agent is a function or a command; set only one"
    try:
        argv = AgentConfig(agent_command=env.agent_command).argv()
    except ValueError as e:
        return str(e).removeprefix("env.agent_command: ")
    from megatron_stepwise.envs.sandbox_command import command_environment

    if shutil.which(argv[0], path=command_environment({})["PATH"]) is None:
        return f"no program {argv[0]!r} (looked in the interpreter's bin, /usr/local/bin, /usr/bin, /bin)"
    return None


def _accepted_options(factory) -> list[str]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _unaccepted_options(factory, options: dict) -> list[str]:
    """Keys of env.options the factory cannot take (none when it takes **kwargs or is opaque):
    a typo would otherwise fail every trajectory at start-up instead of here."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return []
    accepted = set(_accepted_options(factory))
    return sorted(k for k in options if k not in accepted)


def _check_dataset(cfg: ExperimentConfig, check: Checker, probes: Probes, spec) -> None:
    """The samples exist, hold the fields the environment reads, and are enough for one iteration."""
    env = cfg.env
    if env.fields and not (env.dataset or env.eval_dataset):
        check.fail(
            "env.fields",
            "maps the columns of env.dataset / env.eval_dataset files, but neither is set "
            "(the environment's shipped dataset already has its fields)",
            "env.dataset",
        )
    if not env.dataset and getattr(spec.dataset, "ships_none", False):
        check.fail("env.dataset", f"environment {spec.name!r} ships no dataset: set env.dataset")
        return
    if env.dataset:
        facts = probes.dataset_facts(env.dataset, env.dataset_split)
    else:
        unknown = _unaccepted_options(spec.dataset, env.dataset_options)
        if unknown:  # typically inherited from a config written for another environment (tiny_cpu's echo)
            check.fail(
                "env.dataset_options",
                f"the dataset of environment {spec.name!r} takes no option "
                f"{', '.join(map(repr, unknown))} (it accepts: "
                f"{', '.join(_accepted_options(spec.dataset)) or 'none'}); options "
                "written for another environment? override with "
                "env.dataset_options={}",
            )
            return
        facts = probes.shipped_facts(spec, env.dataset_options)
    if isinstance(facts, str):  # the file, or the shipped dataset's options (env.dataset null)
        check.fail("env.dataset" if env.dataset else "env.dataset_options", facts, "env.dataset_split")
        return
    if facts is None:
        return
    ok = _check_fields(cfg, check, facts, "env.dataset", spec)
    if env.eval_dataset:
        eval_facts = probes.dataset_facts(env.eval_dataset, env.eval_split)
        if isinstance(eval_facts, str):
            check.fail("env.eval_dataset", eval_facts, "env.eval_split")
        elif eval_facts is not None:
            _check_fields(cfg, check, eval_facts, "env.eval_dataset", spec)
    data = cfg.data
    if ok and facts.num_rows < data.prompts_per_iteration:
        check.fail(
            "data.prompts_per_iteration",
            f"{data.prompts_per_iteration} prompts per iteration but "
            f"{facts.description} has {facts.num_rows}: lower it or use a "
            "larger env.dataset",
            "env.dataset",
        )


def _check_fields(cfg: ExperimentConfig, check: Checker, facts, key: str, spec) -> bool:
    """env.fields name existing columns, and every field the environment reads is there."""
    columns = facts.columns
    # env.fields maps the columns of env.dataset and env.eval_dataset, not of a shipped dataset.
    fields = cfg.env.fields if (key == "env.eval_dataset" or cfg.env.dataset) else {}
    ok = True
    for target, column in fields.items():
        if column not in columns:
            check.fail(
                f"env.fields.{target}",
                f"column {column!r} is not in {facts.description} (columns: {', '.join(columns)})",
                key,
            )
            ok = False
    for field in spec.required_fields:
        if field not in columns and field not in fields:
            check.fail(
                key,
                f"{facts.description} has no field {field!r}, which environment {spec.name!r} "
                f"reads (columns: {', '.join(columns)}); map a column to it with env.fields.{field}",
            )
            ok = False
    return ok
