"""`megatron-stepwise validate` and `megatron-stepwise config {docs,metrics,show}`.

User mistakes in a config end with exit code 2 and the list of problems, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from megatron_stepwise.config import effective_world_size, load_config
from megatron_stepwise.config.errors import ConfigError
from megatron_stepwise.config.schema import ExperimentConfig

EXIT_BAD_CONFIG = 2


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """CONFIG, KEY=VALUE overrides and --world-size: shared by every subcommand that reads a config."""
    parser.add_argument("config", help="experiment YAML file")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="overrides such as optim.lr=1e-6 or rollout.sampling.stop='[\"</answer>\"]'",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="check the parallel layout for this many ranks (default: $WORLD_SIZE, "
        "else launch.nnodes x launch.nproc_per_node)",
    )
    parser.add_argument(
        "--skip-local-checks",
        action="store_true",
        help="skip this machine's checks (installed sglang/TE, HF cache, HF_HUB_OFFLINE): "
        "for a GPU recipe on a CPU login node",
    )


def load_or_report(args: argparse.Namespace) -> ExperimentConfig | None:
    """The validated config of parsed `add_config_arguments`, or None after printing its problems."""
    try:
        from megatron_stepwise.config.probes import ClusterProbes

        probes = ClusterProbes() if getattr(args, "skip_local_checks", False) else None
        return load_config(args.config, args.overrides, world_size=args.world_size, probes=probes)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return None


def summary(cfg: ExperimentConfig, world_size: int) -> str:
    """One line saying what the config will run."""
    par, data, ro = cfg.parallel, cfg.data, cfg.rollout
    steps = data.optimizer_steps_per_iteration
    return (
        f"{cfg.name}: model {cfg.model.architecture()[0]}, {world_size} ranks = TP{par.tensor} x PP{par.pipeline} "
        f"x CP{par.context} x DP{par.data_parallel_size(world_size)}"
        f"{f' (experts over EP{par.expert})' if par.expert > 1 else ''}, {ro.num_engines} {ro.engine} "
        f"engine(s), env {cfg.env.name}, estimator {cfg.algo.estimator}, {cfg.trainer.iterations} "
        f"iterations x {steps} optimizer steps of {data.prompts_per_minibatch} prompts x "
        f"{data.samples_per_prompt} samples{_served(cfg)}"
    )


def _served(cfg: ExperimentConfig) -> str:
    """The second models the run serves beside the policy (docs/distill.md)."""
    parts = [
        f"{role} {section.hf_checkpoint} on {section.num_engines} {section.engine} engine(s)"
        for role, section in (("teacher", cfg.teacher), ("judge", cfg.judge))
        if section.enabled
    ]
    return "; " + "; ".join(parts) if parts else ""


def _validate(args: argparse.Namespace) -> int:
    cfg = load_or_report(args)
    if cfg is None:
        return EXIT_BAD_CONFIG
    world = effective_world_size(cfg, args.world_size)
    print(f"OK {args.config}: {summary(cfg, world)}")
    return 0


def _docs(args: argparse.Namespace) -> int:
    from megatron_stepwise.config.docs import render_markdown, render_text

    sys.stdout.write(render_markdown() if args.markdown else render_text())
    return 0


def _metrics_docs(args: argparse.Namespace) -> int:
    from megatron_stepwise.metrics.keys import render_markdown, render_text

    sys.stdout.write(render_markdown() if args.markdown else render_text())
    return 0


def _show(args: argparse.Namespace) -> int:
    cfg = load_or_report(args)
    if cfg is None:
        return EXIT_BAD_CONFIG
    sys.stdout.write(cfg.to_yaml())
    return 0


def register_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="check an experiment config without running anything",
        description="Exit 0 with a one-line summary if the config can run, else exit 2 "
        "listing every problem with the key it is about.",
    )
    add_config_arguments(p)
    p.set_defaults(func=_validate)


def register_config(sub: argparse._SubParsersAction) -> None:
    from megatron_stepwise.config.docs import render_text

    p = sub.add_parser(
        "config",
        help="config key reference (config docs) and resolved configs (config show)",
        epilog=render_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    csub = p.add_subparsers(dest="config_command", required=True)
    docs = csub.add_parser("docs", help="print the reference of every key (type, default, help)")
    docs.add_argument("--markdown", action="store_true", help="Markdown, as in docs/config.md")
    docs.set_defaults(func=_docs)
    metrics = csub.add_parser("metrics", help="print the reference of every metrics.jsonl key (unit, level, meaning)")
    metrics.add_argument("--markdown", action="store_true", help="Markdown, as in docs/metrics.md")
    metrics.set_defaults(func=_metrics_docs)
    show = csub.add_parser("show", help="print the resolved YAML (defaults merged, overrides applied)")
    add_config_arguments(show)
    show.set_defaults(func=_show)
