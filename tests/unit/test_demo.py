"""The `megatron-stepwise demo` command runs the whole pipeline and reports what it did."""

import re

from megatron_stepwise import merge_steps
from megatron_stepwise.cli import main
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps


def test_demo_reports_each_stage(capsys):
    args = [
        "demo",
        "--prompts",
        "4",
        "--samples",
        "2",
        "--max-turns",
        "3",
        "--dp",
        "2",
        "--prompts-per-minibatch",
        "2",
        "--max-tokens",
        "8192",
        "--seed",
        "3",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    for stage in ("[1/4] validate", "[2/4] mini-batches", "[3/4] prepare", "[4/4] plan"):
        assert stage in out
    # The prepare line reports the same merge counts as merging the same workload directly
    # (merging is per trajectory, so per mini-batch or all at once gives the same rows).
    steps = make_agent_steps(AgentWorkload(num_prompts=4, samples_per_prompt=2, turns=(1, 3), drift_prob=0.15, seed=3))
    _, stats = merge_steps(steps, max_tokens=8192)
    assert re.search(
        rf"prefix merge: {stats.rows_before} -> {stats.rows_after} rows, {stats.tokens_before:,} -> "
        rf"{stats.tokens_after:,} tokens",
        out,
    )
    assert "2 x 2 prompts = 2 optimizer steps" in out


def test_demo_reports_user_mistakes_without_a_traceback(capsys):
    assert main(["demo", "--prompts", "5", "--prompts-per-minibatch", "4"]) == 2
    err = capsys.readouterr().err
    assert "5 prompts, which is not a multiple of prompts_per_minibatch=4" in err and "Traceback" not in err
    assert (
        main(["demo", "--prompts", "2", "--samples", "1", "--prompts-per-minibatch", "2", "--max-tokens", "300"]) == 2
    )
    assert re.search(r"mini-batch 0: row \d+ has \d+ tokens, more than max_tokens=300", capsys.readouterr().err)
