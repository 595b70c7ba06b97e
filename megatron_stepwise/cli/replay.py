"""`megatron-stepwise replay RUN_DIR [key=value ...] --iteration K`: retrain a dumped iteration offline.

Reads the run's config from the dump (`trainer.dump_rollouts`), applies the overrides (e.g.
`parallel.tensor=2` for another layout), launches itself under torchrun with
`launch.nproc_per_node` ranks when needed, and runs `offline/replay.py`. Prints each optimizer
step's loss and grad norm beside the recorded ones and writes the report as JSON
(`RUN_DIR/replay/iter_K.json`, or `--out`; never through a link planted in RUN_DIR). Exit 0 when
it ran; 2 for a missing dump or checkpoint, or a bad override; with `--check-tol` a mismatch exits 1.
First it checks that every trained token's route and log-prob came from one engine forward pass
(`algo/route_pairing.py`, when the dump carries their ids): a dump that pairs them wrongly trained
on routes the engine never used for those tokens, so it exits 1 naming each mismatch, replaying nothing.
The dump is not trusted: the modules its config names are not imported, nothing is downloaded and
no tokenizer code runs, unless `--trust-dump-code` (offline/dump_trust.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_stepwise.cli.view import TRUST_FLAG, TRUST_HELP


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="re-run a dumped iteration's optimizer steps from its checkpoint, at any layout")
    p.add_argument("run_dir", help="the run directory (holds rollouts/ and checkpoints/)")
    p.add_argument("--iteration", type=int, required=True, help="the dumped iteration to replay")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, e.g. parallel.tensor=2 (right after RUN_DIR)",
    )
    p.add_argument("--out", default=None, help="report path (default RUN_DIR/replay/iter_K.json)")
    p.add_argument(TRUST_FLAG, dest="trust_dump_code", action="store_true", help=TRUST_HELP)
    p.add_argument(
        "--check-tol",
        type=float,
        default=None,
        help="exit 1 unless loss, grad norm and parameters match within this absolute tolerance",
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from megatron_stepwise.rundir.dump_trust import stay_offline

    if not args.trust_dump_code:
        stay_offline()  # before anything imports huggingface_hub; torchrun's ranks inherit it
    from megatron_stepwise.config import config_from_dict
    from megatron_stepwise.config.errors import ConfigError
    from megatron_stepwise.offline.dump_trust import DumpProbes, tokenizer_source
    from megatron_stepwise.rundir.dump_trust import needs_trust_hint
    from megatron_stepwise.rundir.dumps import read_dump

    dump = read_dump(args.run_dir, args.iteration)  # a missing dump: DumpError, a UserError (cli/main.py)
    if "RANK" not in os.environ:  # once, before any rank starts
        problems, summary = route_pairing_problems(dump)
        if problems:
            print(f"error: iteration {dump.iteration}: {summary}", file=sys.stderr)
            print("\n".join(f"  {p}" for p in problems), file=sys.stderr)
            return 1
        print(summary)
    config, probes = _untrusted_config(dump.meta, tokenizer_source, DumpProbes, args.trust_dump_code)
    overrides = [f"logging.run_dir={os.path.abspath(args.run_dir)}", *args.overrides]
    under_launcher = "RANK" in os.environ
    try:
        cfg = config_from_dict(config, overrides, probes=probes)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        hint = "" if args.trust_dump_code else needs_trust_hint(config)
        if hint:
            print(f"note: {hint}", file=sys.stderr)
        return 2
    nproc = cfg.launch.nproc_per_node * cfg.launch.nnodes
    if not under_launcher and nproc > 1:
        from megatron_stepwise.rundir.torchrun import single_node_args

        argv = [
            *single_node_args(),  # the rendezvous store on loopback only
            f"--nproc-per-node={nproc}",
            "-m",
            "megatron_stepwise.cli",
            "replay",
            args.run_dir,
            *args.overrides,
            "--iteration",
            str(args.iteration),
        ]
        argv += [f"--out={args.out}"] if args.out else []
        argv += [f"--check-tol={args.check_tol}"] if args.check_tol is not None else []
        argv += [TRUST_FLAG] if args.trust_dump_code else []
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        from megatron_stepwise.rundir.lifecycle import run_torchrun

        return run_torchrun(argv)
    return _replay(cfg, dump, args)


def route_pairing_problems(dump) -> tuple[list[str], str]:
    """(one line per route/log-prob mismatch found, a summary) over every mini-batch of `dump`."""
    from megatron_stepwise.algo.route_pairing import check_route_pairing, describe_mismatches

    problems: list[str] = []
    checked = unknown = bad = 0
    for m, batch in enumerate(dump.minibatches):
        pairing = check_route_pairing(batch)
        checked, unknown, bad = checked + pairing.checked, unknown + pairing.unknown, bad + pairing.total_mismatches
        problems += describe_mismatches(pairing, batch, where=f"mini-batch {m}, ")
    if bad:
        return problems, (
            f"{bad} of {checked} trained tokens have a route and a log-prob from different engine forward passes"
        )
    return [], f"route/log-prob pairing: {checked} trained tokens from one forward each, {unknown} without provenance"


def _untrusted_config(meta: dict, tokenizer_source, probes_class, trusted: bool) -> tuple[dict, object]:
    """The dump's config as replay uses it, and the validation probes: untrusted, with the
    tokenizer pinned to the one the dump records (finding it needs no environment module), no
    download allowed, and probes that import and read nothing the config names."""
    import copy

    config = copy.deepcopy(meta.get("config") or {})
    if trusted:
        return config, None
    source = tokenizer_source(meta, trusted=False)
    model = config.setdefault("model", {})
    if not model.get("tokenizer") and not model.get("hf_checkpoint"):
        model["tokenizer"] = source
    model["allow_download"] = False
    return config, probes_class(tokenizer=source)


def _replay(cfg, dump, args) -> int:
    from megatron_stepwise.mcore.runtime.runtime import silence_megatron_noise
    from megatron_stepwise.offline.replay import replay

    silence_megatron_noise()
    rank = int(os.environ.get("RANK", "0"))
    report = replay(cfg, dump, trusted=args.trust_dump_code)  # bad input raises a UserError (cli/main.py)
    if rank == 0:
        out = write_report(args.run_dir, args.out, report)
    if rank != 0:
        return 0
    print(render(report))
    print(f"report: {out}")
    if args.check_tol is not None and not within(report, args.check_tol):
        print(f"error: the replay differs from the recorded run by more than {args.check_tol}", file=sys.stderr)
        return 1
    return 0


def write_report(run_dir: str, out: str | None, report: dict) -> str:
    """The report as JSON at `out` (default RUN_DIR/replay/iter_K.json), never through a link in RUN_DIR."""
    from megatron_stepwise.rundir.paths import RunDir
    from megatron_stepwise.rundir.run_files import write_path

    out = out or str(RunDir(run_dir).replay_report(report["iteration"]))
    write_path(out, json.dumps(report, indent=2).encode(), base=run_dir)
    return out


def within(report: dict, tol: float) -> bool:
    diffs = [report["max_abs_diff"].get("loss"), report["max_abs_diff"].get("grad_norm"), report["params_max_abs_diff"]]
    return all(d is not None and d <= tol for d in diffs)


def render(report: dict) -> str:
    lines = [
        f"replay of iteration {report['iteration']} at {report['layout']} (recorded at {report['recorded_layout']})"
    ]
    for i, s in enumerate(report["steps"]):
        lines.append(
            f"  step {i}: loss {s['loss']!r} (recorded {s['recorded_loss']!r}), grad_norm {s['grad_norm']!r} "
            f"(recorded {s['recorded_grad_norm']!r})"
        )
    d = report["max_abs_diff"]
    params = report["params_max_abs_diff"]
    lines.append(
        f"  max |diff|: loss {d['loss']!r}, grad_norm {d['grad_norm']!r}, parameters vs "
        f"{report['params_checkpoint'] or '(no next checkpoint)'} {params!r}"
    )
    return "\n".join(lines)
