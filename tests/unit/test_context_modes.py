"""The agent loop's context modes with a real byte-level BPE (the shipped `tiny_bpe`).

`tokens`: every prompt is exactly the previous prompt + response + the template's delta, the
prefix merge leaves one row per trajectory, and a teacher-forced forward over the merged rows
gives the engine's log-probs. `retokenize`: the drift the BPE causes is measured and is exactly
where the merge breaks. The word- and char-level tokenizers of the other tests never drift.
"""

import asyncio

import pytest
import torch
from helpers import tiny_lm
from transformers import AutoTokenizer

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.algo.merge import merge_steps
from megatron_stepwise.envs.echo import EchoEnv, echo_dataset
from megatron_stepwise.hf.tokenizers import tokenizer_dir
from megatron_stepwise.metrics.core import rollout_metrics
from megatron_stepwise.rollout.agent.context import ChatTemplateError, extend_context, template_delta
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams
from megatron_stepwise.steps import TrajectoryID

TOK, CONFIG = tiny_lm("tiny_bpe")
EOS = TOK.eos_token_id
TURNS = 5


def encode(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


class RecordingEngine:
    """Keeps the prompt every request was sent with, by request id."""

    def __init__(self, engine):
        self.engine = engine
        self.prompts = {}

    async def generate(self, input_ids, sampling, rid=None, session=None):
        self.prompts[rid] = list(input_ids)
        return await self.engine.generate(input_ids, sampling, rid=rid, session=session)


def run(generator, samples, tokenizer=TOK, env=EchoEnv, seed=7, **cfg):
    cfg.setdefault("sampling", SamplingParams(max_new_tokens=8))
    cfg.setdefault("max_input_length", 4096)
    loop = AgentLoop(generator, tokenizer, env, AgentLoopConfig(**cfg))
    try:
        return asyncio.run(loop.rollout(samples, seed=seed))
    finally:
        loop.close()


def trajectories(steps):
    out = {}
    for s in steps:
        out.setdefault(s.trajectory_id, []).append(s)
    return out


def echo_observation(sample, step):
    """The echo env's next user message after `step` (feedback and the next digit)."""
    feedback = "good" if step.metadata["env_info"]["turn_score"] == 1.0 else "no"
    return f"{feedback} say {sample['digits'][step.metadata['turn'] + 1]}"


def merge_stats(steps):
    merged, stats = merge_steps(steps)
    unique = sum(s.num_tokens for s in steps if s.is_last_step)
    return merged, stats, stats.tokens_after / unique


@pytest.fixture(scope="module")
def samples():
    return echo_dataset(4, num_turns=TURNS, seed=5)


@pytest.fixture(scope="module")
def engine():
    return LocalEngine(CONFIG, tokenizer=TOK, seed=0)


def test_the_bpe_is_byte_level_with_chatml_specials_and_can_drift():
    assert TOK.convert_ids_to_tokens(encode("<|im_start|>user\nsay 3<|im_end|>\n"))[0] == "<|im_start|>"
    assert encode("<|im_end|>") == [EOS]
    # Any byte round-trips (byte-level), but sampled ids need not be canonical: the merged
    # "say" and its bytes decode to the same text and re-encode to one of them only.
    say = encode("say")
    assert len(say) == 1 and TOK.decode(say) == "say"
    split = [t for ch in "say" for t in encode(ch)]
    assert TOK.decode(split) == "say" and encode(TOK.decode(split)) == say != split
    # Half a UTF-8 character decodes to U+FFFD, which re-encodes to other bytes.
    euro = encode("\u20ac")
    assert len(euro) > 1 and encode(TOK.decode(euro[:1])) != euro[:1]
    assert len(TOK) <= CONFIG["vocab_size"]


def test_token_mode_prompts_extend_exactly_and_merge_to_one_row(engine, samples):
    rec = RecordingEngine(engine)
    steps = run(rec, samples, n_samples_per_prompt=3, max_turns=TURNS, context="tokens", drift_sample_rate=1.0)
    by_prompt = {s["prompt_id"]: s for s in samples}
    trajs = trajectories(steps)
    assert len(trajs) == 12 and all(len(t) == TURNS for t in trajs.values())
    for tid, traj in trajs.items():
        for prev, nxt in zip(traj, traj[1:]):
            # The response ends with an end-of-turn token (sampled, or appended with loss_mask 0):
            # the delta is what ChatML adds after it, tokenised on its own.
            assert prev.response_ids[-1] == EOS
            delta = encode(
                f"\n<|im_start|>user\n{echo_observation(by_prompt[tid.prompt_id], prev)}<|im_end|>\n"
                "<|im_start|>assistant\n"
            )
            assert nxt.prompt_ids.tolist() == prev.prompt_ids.tolist() + prev.response_ids.tolist() + delta
        for s in traj:  # each step holds the prompt the engine was sent
            assert s.prompt_ids.tolist() == rec.prompts[f"{tid}/turn{s.metadata['turn']}"]
    merged, stats, ratio = merge_stats(steps)
    assert stats.broken_prefixes == 0 and stats.rows_after == len(trajs) and ratio == 1.0
    # The history is not what re-tokenising would give (the BPE drifts), yet nothing broke.
    assert rollout_metrics(groups_of(steps))["rollout/retokenize_drift_rate"] > 0


def test_token_mode_merged_rows_score_as_the_engine_sampled(engine, samples):
    """One teacher-forced forward per merged row (what the trainer computes) reproduces every
    trained token's rollout log-prob: each sampled token keeps the context it was sampled in."""
    steps = run(engine, samples, n_samples_per_prompt=2, max_turns=TURNS, context="tokens")
    merged, _, _ = merge_stats(steps)
    worst = 0.0
    for row in merged:
        ids = torch.cat([row.prompt_ids, row.response_ids])[None]
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(input_ids=ids).logits[0].float(), -1)
        start = row.prompt_ids.numel()
        positions = torch.arange(start - 1, ids.shape[1] - 1)
        scored = logp[positions, row.response_ids]
        trained = row.loss_mask.bool()
        assert int(trained.sum()) > 0
        worst = max(worst, float((scored[trained] - row.rollout_logprobs[trained]).abs().max()))
    assert worst <= 1e-4, worst


def test_retokenize_mode_drift_is_measured_and_is_where_the_merge_breaks(engine, samples):
    steps = run(engine, samples, n_samples_per_prompt=3, max_turns=TURNS, context="retokenize")
    drifted = 0
    for traj in trajectories(steps).values():
        for prev, nxt in zip(traj, traj[1:]):
            head = prev.prompt_ids.tolist() + prev.response_ids.tolist()
            assert prev.metadata["retokenize_drift"] == (nxt.prompt_ids.tolist()[: len(head)] != head)
            drifted += prev.metadata["retokenize_drift"]
        assert "retokenize_drift" not in traj[-1].metadata
    _, stats, ratio = merge_stats(steps)
    rate = rollout_metrics(groups_of(steps))["rollout/retokenize_drift_rate"]
    boundaries = len(steps) - len(trajectories(steps))
    assert stats.broken_prefixes == drifted and rate == pytest.approx(drifted / boundaries)
    assert drifted > 0 and ratio > 1.0
    print(
        f"\nretokenize mode, tiny_bpe, random tiny policy, T={TURNS}: drift rate {rate:.3f}, "
        f"merged / unique tokens {ratio:.3f}"
    )


def test_token_mode_measures_drift_on_a_stable_share_of_trajectories(engine, samples):
    """rollout.drift_sample_rate: the measured trajectories are picked by their id (the same in
    a new loop, as in a resumed run), measure every turn boundary, and the measurement changes
    nothing else; unmeasured steps carry no drift, and the rate averages measured ones only."""

    def measured(steps):
        return {tid for tid, traj in trajectories(steps).items() if "retokenize_drift" in traj[0].metadata}

    full = run(engine, samples, n_samples_per_prompt=4, max_turns=3, context="tokens", drift_sample_rate=1.0)
    half = run(engine, samples, n_samples_per_prompt=4, max_turns=3, context="tokens", drift_sample_rate=0.5)
    again = run(engine, samples, n_samples_per_prompt=4, max_turns=3, context="tokens", drift_sample_rate=0.5)
    assert measured(full) == set(trajectories(full)) and len(full) == len(half)
    assert 0 < len(measured(half)) < len(trajectories(half)) and measured(again) == measured(half)
    by_id = {(s.trajectory_id, s.metadata["turn"]): s for s in full}
    for s in half:
        ref = by_id[(s.trajectory_id, s.metadata["turn"])]
        assert s.prompt_ids.tolist() == ref.prompt_ids.tolist()  # same prompts with or without measuring
        if s.trajectory_id in measured(half) and not s.is_last_step:
            assert s.metadata["retokenize_drift"] == ref.metadata["retokenize_drift"]
        else:
            assert "retokenize_drift" not in s.metadata
    kept = [s for s in full if s.trajectory_id in measured(half) and not s.is_last_step]
    assert rollout_metrics(groups_of(half))["rollout/retokenize_drift_rate"] == pytest.approx(
        sum(s.metadata["retokenize_drift"] for s in kept) / len(kept)
    )
    none = run(engine, samples, n_samples_per_prompt=2, max_turns=3, context="tokens", drift_sample_rate=0.0)
    assert not measured(none) and "rollout/retokenize_drift_rate" not in rollout_metrics(groups_of(none))
    # Re-tokenising measures every boundary whatever the rate: the next prompt IS the re-rendered chat.
    retok = run(engine, samples, n_samples_per_prompt=2, max_turns=3, context="retokenize", drift_sample_rate=0.0)
    assert all("retokenize_drift" in s.metadata for s in retok if not s.is_last_step)


def first_prompt(sample):
    return encode(
        TOK.apply_chat_template(
            [{"role": "user", "content": f"say {sample['digits'][0]}"}], add_generation_prompt=True, tokenize=False
        )
    )


def test_both_modes_send_the_same_first_prompt_and_check_length_on_what_is_sent(engine, samples):
    by_prompt = {s["prompt_id"]: s for s in samples}
    limit = max(len(first_prompt(s)) for s in samples) + 20  # room for a turn or two, not five
    for context in ("tokens", "retokenize"):
        rec = RecordingEngine(engine)
        steps = run(rec, samples, n_samples_per_prompt=2, max_turns=TURNS, context=context, max_input_length=limit)
        assert max(len(p) for p in rec.prompts.values()) <= limit
        for tid, traj in trajectories(steps).items():
            assert traj[0].prompt_ids.tolist() == first_prompt(by_prompt[tid.prompt_id])
            assert len(traj) < TURNS and traj[-1].stop_reason == "context_limit"


class Scripted:
    """Answers every turn with the same text, ending on EOS or (no_eos) cut by the length limit."""

    def __init__(self, text, no_eos=False):
        self.ids = encode(text) + ([] if no_eos else [EOS])
        self.finish = "length" if no_eos else "stop"

    async def generate(self, input_ids, sampling, rid=None, session=None):
        return GenerateResult(output_ids=list(self.ids), logprobs=[-0.5] * len(self.ids), finish_reason=self.finish)


def test_an_end_of_turn_the_model_did_not_sample_stays_untrained_in_token_mode(samples):
    for append_eos in (True, False):
        steps = run(
            Scripted("3 3", no_eos=True),
            samples[:1],
            n_samples_per_prompt=1,
            max_turns=3,
            context="tokens",
            append_eos=append_eos,
        )
        prev, nxt = steps[0], steps[1]
        obs = f"\n<|im_start|>user\n{echo_observation(samples[0], prev)}<|im_end|>\n<|im_start|>assistant\n"
        if append_eos:  # appended to the response, loss_mask 0; the delta starts after it
            assert prev.response_ids.tolist() == encode("3 3") + [EOS] and prev.loss_mask.tolist()[-1] == 0
            expected = prev.prompt_ids.tolist() + encode("3 3") + [EOS] + encode(obs)
        else:  # the template's closing token is part of the next prompt (never trained)
            assert prev.response_ids.tolist() == encode("3 3") and prev.loss_mask.tolist() == [1] * len(encode("3 3"))
            expected = prev.prompt_ids.tolist() + encode("3 3") + encode("<|im_end|>" + obs)
        assert nxt.prompt_ids.tolist() == expected
        _, stats, ratio = merge_stats(steps)
        assert stats.rows_after == 1 and ratio == 1.0


# Drops the reasoning of assistant turns before the last user message (as Qwen3's template does).
REASONING_DROPPING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_with_template(template):
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir("tiny_bpe")))  # a fresh copy: the shared one is cached
    tok.chat_template = template
    return tok


def test_token_mode_keeps_reasoning_a_history_rewriting_template_drops(samples):
    tok = tokenizer_with_template(REASONING_DROPPING_TEMPLATE)
    reply = "<think>the user wants a digit</think>3"
    kept = encode(reply)
    for context in ("tokens", "retokenize"):
        steps = run(
            Scripted(reply),
            samples[:1],
            tokenizer=tok,
            n_samples_per_prompt=1,
            max_turns=3,
            context=context,
            drift_sample_rate=1.0,
        )
        for prev, nxt in zip(steps, steps[1:]):
            head = prev.prompt_ids.tolist() + prev.response_ids.tolist()
            assert prev.metadata["retokenize_drift"]  # re-rendering drops the reasoning just sampled
            if context == "tokens":
                obs = f"\n<|im_start|>user\n{echo_observation(samples[0], prev)}<|im_end|>\n<|im_start|>assistant\n"
                assert nxt.prompt_ids.tolist() == head + encode(obs)
            else:
                assert nxt.prompt_ids.tolist()[: len(head)] != head
        last = steps[-1].prompt_ids.tolist()
        count = sum(last[i : i + len(kept)] == kept for i in range(len(last)))
        assert count == (2 if context == "tokens" else 0)  # both earlier turns' reasoning kept, or none


def test_a_template_that_cannot_be_extended_is_a_clear_error(samples):
    counting = "{{ messages | length }} messages\n" + TOK.chat_template  # every render changes its first line
    tok = tokenizer_with_template(counting)
    with pytest.raises(ChatTemplateError, match="rollout.context=tokens.*rollout.context=retokenize"):
        template_delta(tok, [{"role": "user", "content": "say 1"}], "1", [{"role": "user", "content": "say 2"}])
    loop = AgentLoop(Scripted("1"), tok, EchoEnv, AgentLoopConfig(max_turns=2, context="tokens"))
    try:
        with pytest.raises(ChatTemplateError):
            asyncio.run(loop.run_trajectory(samples[0], TrajectoryID(samples[0]["prompt_id"], 0)))
        # The same template is fine when the chat is re-tokenised each turn.
        loop.config = AgentLoopConfig(max_turns=2, context="retokenize")
        assert len(asyncio.run(loop.run_trajectory(samples[0], TrajectoryID(samples[0]["prompt_id"], 0)))) == 2
    finally:
        loop.close()


def test_extend_context_drops_only_an_end_of_turn_the_response_already_has():
    close = "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tail = encode(close)[1:]
    assert extend_context(TOK, [1, 5], [9, EOS], close, [EOS]) == [1, 5, 9, EOS] + tail
    assert extend_context(TOK, [1, 5], [9], close, [EOS]) == [1, 5, 9, EOS] + tail  # the closing is prompt
    assert extend_context(TOK, [1, 5], [9, 0], close, [EOS]) == [1, 5, 9, 0, EOS] + tail  # 0 is not an EOS


def test_an_unknown_context_mode_is_refused_by_name():
    with pytest.raises(ValueError, match=r"rollout.context: must be one of retokenize, tokens \(got 'token'\)"):
        AgentLoopConfig(context="token")
