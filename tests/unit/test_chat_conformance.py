"""Chat-template conformance over real model families (real vocabularies, released templates).

Each family (tools/chat_families.py: Qwen2.5-Instruct, Qwen3, Qwen3.5, Llama-3.1-Instruct,
DeepSeek-R1-Distill-Qwen, DeepSeek-V3.1, GLM-4.6) is written as a model directory and loaded the
way the trainer loads `model.tokenizer` (`load_tokenizer`, `end_of_turn`); the real `AgentLoop`
then runs several hundred seeded scripted trajectories (tool calls and results, consecutive and
empty tool messages, user follow-ups, `<think>` blocks, endings on the end-of-turn token, a stop
string or the length limit, non-canonical ids). Checked in `tokens` mode: every prompt extends
the previous prompt + response exactly; the inserted ids are the tokenised text the template
renders for the new messages; the family's end-of-turn token is appended (loss_mask 0) when a
turn ends without it. In `retokenize` mode: the drift flag is set exactly on the turns whose ids
or history re-tokenising changes. Failures name the family, the trajectory and the turn.

Needs llama.cpp's tokenizer files: `STEPWISE_TOKENIZERS_SRC` (.ci/run sets it where the
third-party copy exists).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import REPO, load_script

from megatron_stepwise.hf.end_of_turn import end_of_turn
from megatron_stepwise.hf.tokenizers import load_tokenizer

SRC = os.environ.get("STEPWISE_TOKENIZERS_SRC")
pytestmark = pytest.mark.skipif(
    not SRC,
    reason="STEPWISE_TOKENIZERS_SRC is not set: llama.cpp's vocabularies and chat templates are needed; "
    ".ci/run sets it where the third-party copy exists",
)
families = load_script(Path(REPO) / "tools" / "chat_families.py")
TRAJECTORIES = int(os.environ.get("STEPWISE_CONFORMANCE_TRAJECTORIES", "300"))
SEED = 28


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    out = tmp_path_factory.mktemp("families")
    return {name: families.build_family(name, SRC, out) for name in families.FAMILIES}


def _render(tok, messages, generation_prompt):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _expected_delta(tok, history, text, observation):
    """What the template renders after the reply `text` for the new messages: from the real
    history, or (a template that rewrites earlier turns) after a one-turn history."""
    head = _render(tok, history, True) + text
    turn = history + [{"role": "assistant", "content": text}]
    closed, extended = _render(tok, turn, False), _render(tok, turn + observation, True)
    if closed.startswith(head) and extended.startswith(closed):
        return extended[len(head) :], False
    mark = "<<<reply>>>"
    neutral = [{"role": "user", "content": "hi"}]
    extended = _render(tok, neutral + [{"role": "assistant", "content": mark}] + observation, True)
    assert extended.startswith(_render(tok, neutral, False))
    return extended[extended.rfind(mark) + len(mark) :], True


FAMILY_NAMES = list(families.FAMILIES)
TALLY: dict[str, dict] = {}


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_token_mode_extends_exactly_with_the_templates_delta(name, model_dirs):
    fam = families.FAMILIES[name]
    tok = load_tokenizer(str(model_dirs[name]))  # as the trainer loads model.tokenizer
    eot = end_of_turn(tok)
    script = families.Scripted(tok, fam, eot, TRAJECTORIES, seed=SEED)
    runs = families.run_loop(tok, script, eot, "tokens")
    tally = TALLY.setdefault(
        name,
        {"trajectories": 0, "turns": 0, "boundaries": 0, "appended": 0, "rewrites": 0, "tool->": 0, "noncanonical": 0},
    )
    for i, steps in runs.items():
        turns, history = script.turns[i], list(script.first[i])
        tally["trajectories"] += 1
        where = f"{name}: trajectory {i}"
        assert steps[0].prompt_ids.tolist() == tok(_render(tok, history, True), add_special_tokens=False)["input_ids"]
        for k, step in enumerate(steps):
            at = f"{where}, turn {k}"
            sampled, _ = script.ids[i][k]
            response, mask = step.response_ids.tolist(), step.loss_mask.tolist()
            tally["turns"] += 1
            tally["noncanonical"] += turns[k].noncanonical
            if sampled and sampled[-1] in eot.ids or eot.append is None:
                assert response == sampled and all(mask), f"{at}: response is not the sampled ids"
            else:  # ended without it: the family's end-of-turn token, never trained on
                assert response == sampled + [eot.append] and mask == [1] * len(sampled) + [0], (
                    f"{at}: expected {tok.convert_ids_to_tokens(eot.append)} appended with loss_mask 0"
                )
                tally["appended"] += 1
            text = tok.decode(sampled, skip_special_tokens=True)
            if k + 1 == len(steps):
                break
            nxt = steps[k + 1].prompt_ids.tolist()
            prefix = step.prompt_ids.tolist() + response
            assert nxt[: len(prefix)] == prefix, f"{at}: the next prompt does not extend prompt + response"
            delta = nxt[len(prefix) :]
            expected, rewrote = _expected_delta(tok, history, text, turns[k].observation)
            closing = tok.decode([response[-1]])
            if response[-1] in eot.ids and expected.startswith(closing):  # the response already closes the turn
                expected = expected[len(closing) :]
            assert tok.decode(delta) == expected, f"{at}: delta {tok.decode(delta)!r} != template {expected!r}"
            assert delta == tok(expected, add_special_tokens=False)["input_ids"], f"{at}: delta ids not canonical"
            tally["boundaries"] += 1
            tally["rewrites"] += rewrote
            tally["tool->"] += any(m["role"] == "tool" for m in turns[k].observation)
            history = history + [{"role": "assistant", "content": text}] + turns[k].observation


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_retokenize_mode_flags_every_rewrite(name, model_dirs):
    fam = families.FAMILIES[name]
    tok = load_tokenizer(str(model_dirs[name]))
    eot = end_of_turn(tok)
    script = families.Scripted(tok, fam, eot, TRAJECTORIES, seed=SEED)
    runs = families.run_loop(tok, script, eot, "retokenize")
    flagged = truth = 0
    for i, steps in runs.items():
        history = list(script.first[i])
        for k, step in enumerate(steps[:-1]):
            sampled, _ = script.ids[i][k]
            text = tok.decode(sampled, skip_special_tokens=True)
            after = history + [{"role": "assistant", "content": text}] + script.turns[i][k].observation
            # Re-tokenising changes the turn when its ids are not its text's own encoding, or the
            # template renders the chat after it otherwise than the chat before it + the reply.
            noncanonical = tok(tok.decode(sampled), add_special_tokens=False)["input_ids"] != sampled
            rewritten = not _render(tok, after, True).startswith(
                _render(tok, history, True) + tok.decode(step.response_ids.tolist())
            )
            expected = noncanonical or rewritten
            assert step.metadata["retokenize_drift"] == expected, (
                f"{name}: trajectory {i}, turn {k}: drift {step.metadata['retokenize_drift']}, expected {expected} "
                f"(noncanonical ids {noncanonical}, template rewrote {rewritten})"
            )
            flagged += step.metadata["retokenize_drift"]
            truth += expected
            history = after
    TALLY.setdefault(name, {})["drift_flagged"] = flagged
    assert truth > 0  # the script does produce rewrites


@pytest.mark.parametrize(
    "name, closing, also",
    [
        ("qwen2.5-instruct", "<|im_end|>", ["<|endoftext|>"]),
        ("qwen3", "<|im_end|>", ["<|endoftext|>"]),
        ("qwen3.5", "<|im_end|>", ["<|endoftext|>"]),
        ("llama-3.1-instruct", "<|eot_id|>", ["<|end_of_text|>", "<|eom_id|>"]),
        ("deepseek-r1-distill-qwen", "<｜end▁of▁sentence｜>", []),
        ("deepseek-v3.1", "<｜end▁of▁sentence｜>", []),
        ("glm-4.6", None, ["<|endoftext|>", "<|user|>", "<|observation|>"]),  # GLM closes no turn
    ],
)
def test_end_of_turn_comes_from_the_models_own_files(name, closing, also, model_dirs):
    """The appended token is the one the chat template closes a reply with; every
    generation_config.json eos_token_id also ends a turn (none of this is per-family code)."""
    tok = load_tokenizer(str(model_dirs[name]))
    eot = end_of_turn(tok)
    assert (None if eot.append is None else tok.convert_ids_to_tokens(eot.append)) == closing
    assert tok.convert_ids_to_tokens(list(eot.ids)) == ([closing] if closing else []) + also


def test_drift_tool_measures_the_share_of_non_canonical_samples(model_dirs):
    """tools/bench/bench_drift_real.py: with a template that re-renders nothing (Qwen2.5), natural text
    never drifts and every flagged boundary is one whose ids were split."""
    bench = load_script(Path(REPO) / "tools" / "bench" / "bench_drift_real.py")
    tok = load_tokenizer(str(model_dirs["qwen2.5-instruct"]))
    fam = families.FAMILIES["qwen2.5-instruct"]
    clean = bench.measure(tok, fam, 0.0, 40, seed=1)
    split = bench.measure(tok, fam, 1.0, 40, seed=1)
    assert clean["drift_rate"] == 0.0 and clean["boundaries"] > 40
    assert split["drift_rate"] > 0.8 and split["drift_rate"] == split["noncanonical"] and split["template"] == 0.0
