"""`megatron-stepwise view RUN_DIR [--iteration K]`: self-contained HTML pages of a dumped iteration.

Writes `RUN_DIR/view/iter_K.html` (or `--out`): the iteration's trajectories with filters, each
turn's prompt delta and response with tokens coloured by role, advantage and log-prob gap on
hover, and the run's curves (viewer/). An iteration of more than `viewer.page.PAGE_TOKENS` tokens
gets an index there and numbered pages in `iter_K_pages/`. It opens from disk; nothing is served
or fetched. The dump is not trusted: nothing it names is imported or downloaded, and no tokenizer
code runs, unless `--trust-dump-code` (rundir/dump_trust.py); no write follows a link planted in
the run directory (rundir/run_files.py). The viewer reads files only; for an older dump that
records no tokenizer, this command asks its environment (offline/dump_trust.py `tokenizer_source`).
"""

from __future__ import annotations

import argparse

# rundir/dump_trust.py's TRUST_FLAG, spelled here so that building the parser imports nothing heavy
TRUST_FLAG = "--trust-dump-code"
TRUST_HELP = (
    "import the modules the dump's config names (trainer.imports, env.name / env.reward_fn module paths) "
    "and allow hub downloads; only for a run directory you trust (tokenizer code never runs)"
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("view", help="write HTML pages of a dumped iteration's trajectories")
    p.add_argument("run_dir", help="the run directory (holds rollouts/ and metrics.jsonl)")
    p.add_argument("--iteration", type=int, default=None, help="the dumped iteration (default: the last one)")
    p.add_argument("--out", default=None, help="HTML path (default RUN_DIR/view/iter_K.html)")
    p.add_argument(TRUST_FLAG, dest="trust_dump_code", action="store_true", help=TRUST_HELP)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from megatron_stepwise.rundir.dump_trust import recorded_tokenizer, stay_offline

    if not args.trust_dump_code:
        stay_offline()
    from megatron_stepwise.viewer.page import write_pages

    def tokenizer_source(meta: dict) -> str:
        recorded = recorded_tokenizer(meta)
        if recorded is not None:
            return recorded
        # an older dump: its environment's shipped vocabulary (the config and environments load)
        from megatron_stepwise.offline.dump_trust import tokenizer_source

        return tokenizer_source(meta, trusted=args.trust_dump_code)

    # a missing dump (DumpError) or a planted link (UnsafePathError): UserErrors, one line (cli/main.py)
    path, pages = write_pages(
        args.run_dir, args.iteration, args.out, trusted=args.trust_dump_code, tokenizer_source=tokenizer_source
    )
    print(f"wrote {path}" + (f" (an index of {pages} pages)" if pages > 1 else ""))
    return 0
