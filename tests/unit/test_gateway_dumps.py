"""Prefix breaks of gateway calls in rollout dumps and in the viewer: each step (or merged row)
that started a fresh prefix is marked, in the dump's `prefix_break` column and on its turn in
the page, and each trajectory's page summary counts them."""

from __future__ import annotations

import functools
import json

import pytest

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.algo.prepare import prepare
from megatron_stepwise.loop.rounds import RowsOnRank0, decide_round
from megatron_stepwise.rundir.dump_recorder import DumpRecorder
from megatron_stepwise.rundir.dump_table import dump_path
from megatron_stepwise.rundir.dumps import read_dump, write_dump
from megatron_stepwise.viewer.page import write_pages
from tests.gateway_fixtures import Scripted, Served
from tests.helpers import stride_decide, tiny_lm

openai = pytest.importorskip("openai")

TOK, _ = tiny_lm("tiny_bpe")


def summarising_agent_steps():
    """Four calls: two that extend one prefix, then the agent replaces its history with a
    summary (a prefix break), then one call that extends the new prefix."""
    served = Served(Scripted(TOK, ["one", "two", "three", "four"]), TOK)
    try:
        url = served.open("summary")
        client = openai.OpenAI(base_url=url, api_key=served.gateway.api_key, max_retries=0)
        messages = [{"role": "user", "content": "count"}]
        for turn in range(4):
            if turn == 2:
                messages = [{"role": "user", "content": "we counted to two; go on"}]
            text = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
            messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "next"}]
        return served.gateway.finish(url, 1.0)
    finally:
        served.close()


def dumped(tmp_path, steps, merge: bool):
    recorder = DumpRecorder(every=1)
    recorder.begin(1)
    prepare_round = RowsOnRank0(functools.partial(prepare, merge_steps=merge), recorder)
    decide_round([groups_of(steps)], prepare_round, decide=stride_decide(1), dp_size=1)
    write_dump(
        dump_path(tmp_path, 1),
        recorder.minibatches,
        iteration=1,
        weight_version=1,
        config={"name": "gateway"},
        train_metrics=[{"loss": 0.0}],
        tokenizer="tiny_bpe",
    )
    return tmp_path


def page_data(html: str) -> dict:
    payload = html[html.index('<script id="data" type="application/json">') :].split(">", 1)[1]
    return json.loads(payload[: payload.index("</script>")])


@pytest.mark.parametrize("merge, marks", [(False, [False, False, True, False]), (True, [False, True])])
def test_a_dump_of_gateway_steps_marks_each_row_that_started_a_fresh_prefix(tmp_path, merge, marks):
    steps = summarising_agent_steps()
    assert [s.metadata["prefix_break"] for s in steps] == [False, False, True, False]
    rows = read_dump(dumped(tmp_path, steps, merge), 1).table.to_pylist()
    # a merged row starts where its first step starts: the break, then the call extending it
    assert [r["prefix_break"] for r in rows] == marks
    assert [json.loads(r["info"])["prefix_break"] for r in rows] == marks


@pytest.mark.parametrize("merge", [False, True])
def test_the_viewer_marks_the_turn_that_broke_the_prefix(tmp_path, merge):
    page, _ = write_pages(dumped(tmp_path, summarising_agent_steps(), merge))
    html = page.read_text()
    (trajectory,) = page_data(html)["trajectories"]
    assert trajectory["prefix_breaks"] == 1
    turns = [t["prefix_break"] for t in trajectory["turns"]]
    assert turns == ([False, False, True, False] if not merge else [False, True])
    broken = trajectory["turns"][turns.index(True)]
    assert not broken["history_kept"]  # the page says why the prompt no longer extends the last one
    assert "prefix break: the agent sent a new context" in html  # the badge the page draws for it
    assert "u.prefix_break" in html and "t.prefix_breaks" in html
