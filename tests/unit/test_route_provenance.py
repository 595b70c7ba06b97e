"""Provenance of every trained token (MoE routing replay): its route and its log-prob come from one
engine forward pass, whatever pauses, continuations and merges happened on the way.

The conformance table runs the tiny Qwen3-MoE in the embedded engine behind a fleet (in process,
no Ray), the multi-turn echo environment through the agent loop (token mode), and a weight update
in the middle of generation, over every pause mode x partial rollout on/off x merge layout:

- partial rollouts on: a turn is held after a known number of tokens (`pause_after`), the fleet
  updates the weights with `pause_mode` = retract (KV recomputed), in_place (old KV kept) or abort
  (requests end; the agent loop continues them as a new request);
- partial rollouts off: the update waits for the turns in flight, so the next turn of the same
  trajectory re-prefills its history under the new weights (the multi-turn prefix resend);
- merge layouts: one row per turn, or `merge_steps` (one row per trajectory).

Per case: for every trained token, `logprob_forwards[q] == route_forwards[q - 1]` (both known);
the held turn's routes of positions sampled before the pause were computed before it (never
rewritten) and every token after it comes from the new weights; no request was aborted by the
update except in abort mode, where none was lost (every trajectory valid, counted in
`aborted_by_update`).
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import tiny_lm
from in_process_fleet import in_process_fleet

from megatron_stepwise.algo.merge import merge_steps
from megatron_stepwise.algo.route_pairing import check_route_pairing
from megatron_stepwise.algo.validate import validate_steps
from megatron_stepwise.hf.presets import tiny_config
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm, save_safetensors_dir
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.steps import StepBatch

TOKENIZER, _ = tiny_lm("tiny_word")
MOE = tiny_config(model_type="qwen3_moe", vocab_size=len(TOKENIZER))
NEW_TOKENS = 8
HELD_RID, HELD_AT = "p0#0/turn1", 3  # the turn a partial-rollout update pauses, after this many tokens
DEADLINE_S = 300.0
SAMPLES = [{"prompt_id": f"p{i}", "digits": [i % 10, (i + 3) % 10, (i + 5) % 10]} for i in range(3)]


def new_weights(directory) -> str:
    """Other weights for the engine, as a safetensors directory (an update from disk needs no Ray)."""
    return str(save_safetensors_dir(build_causal_lm(MOE, seed=11), directory))


async def poll(condition, what: str, task=None):
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not await condition():
        if task is not None and task.done():
            task.result()
            pytest.fail(f"the rollout finished before {what}")
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"not {what} after {DEADLINE_S} s")
        await asyncio.sleep(0.01)


async def rollout_with_update(pause_mode: str, partial: bool, weights: str):
    """The rollout's steps, the fleet's metrics and the first forward id after the pause."""
    engine = LocalEngine(MOE, tokenizer=TOKENIZER, eos_token_ids=[], seed=5, max_batch_size=16)
    fleet = in_process_fleet(engine, MOE, partial_rollouts=partial, pause_mode=pause_mode)
    loop = AgentLoop(
        fleet,
        TOKENIZER,
        "echo",
        AgentLoopConfig(
            max_turns=3,
            context="tokens",
            n_samples_per_prompt=2,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS),
        ),
    )
    try:
        if partial:
            await engine.pause_after(HELD_RID, HELD_AT)  # armed before the request exists
        task = asyncio.create_task(loop.rollout(SAMPLES, seed=1))
        if partial:
            await poll(lambda: _held(engine), f"held at {HELD_AT} tokens of {HELD_RID}", task)
            boundary = engine.next_forward_id
            await fleet.update_weights_from_disk(weights)
        else:  # mid-generation of the first turns: the update waits for them, later turns re-prefill
            # (held there, so a fast machine cannot finish the turns between two polls)
            await engine.pause_after("p0#0/turn0", 2)
            await poll(lambda: _held_at(engine, "p0#0/turn0", 2), "turn 0 held after 2 tokens", task)
            boundary = engine.next_forward_id
            update = asyncio.create_task(fleet.update_weights_from_disk(weights))
            await poll(lambda: _update_waiting(fleet), "the update waiting for the turns in flight")
            await engine.resume()  # the turns in flight finish, then the update runs
            await asyncio.wait_for(update, DEADLINE_S)
        steps = await asyncio.wait_for(task, DEADLINE_S)
        return steps, fleet.metrics(), boundary
    finally:
        loop.close()
        await engine.close()


async def _held(engine) -> bool:
    return await engine.decoded_tokens(HELD_RID) == HELD_AT and engine.paused


async def _held_at(engine, rid, n) -> bool:
    return await engine.decoded_tokens(rid) == n and engine.paused


async def _update_waiting(fleet) -> bool:
    return not fleet._gate.is_set()  # the update closed the gate and waits for the fleet to drain


CASES = [
    pytest.param(mode, partial, layout, id=f"{mode}-{'partial' if partial else 'drain'}-{layout}")
    for mode in ("retract", "in_place", "abort")
    for partial in (True, False)
    for layout in ("per_turn", "merged")
]


@pytest.mark.parametrize("pause_mode, partial, layout", CASES)
def test_every_trained_token_has_route_and_logprob_from_one_forward(pause_mode, partial, layout, tmp_path):
    steps, metrics, boundary = asyncio.run(rollout_with_update(pause_mode, partial, new_weights(tmp_path / "w")))
    validate_steps(steps)
    assert all(s.invalid_reason is None for s in steps if s.is_last_step), [s.invalid_reason for s in steps]
    # the update lost nothing: only abort mode aborts, and those turns were continued
    aborted = metrics["aborted_by_update"]
    assert aborted == 0 if pause_mode != "abort" or not partial else aborted > 0

    rows = merge_steps(steps)[0] if layout == "merged" else steps
    if layout == "merged":
        assert any(r.metadata["merged_steps"] > 1 for r in rows)
    batch = StepBatch.from_steps(rows)
    pairing = check_route_pairing(batch)
    trained = int(batch.token_fields["loss_mask"].sum())
    assert pairing.unknown == 0 and pairing.checked == trained > 0
    assert pairing.ok, pairing.mismatches

    # the update reached the rollout: tokens of both weight versions were trained
    versions = batch.token_fields["weight_versions"][batch.token_fields["loss_mask"] == 1]
    assert set(versions.tolist()) == {0, 1}

    if partial:
        held = next(s for s in steps if s.trajectory_id.prompt_id == "p0" and s.trajectory_id.sample_index == 0)
        held = [s for s in steps if s.trajectory_id == held.trajectory_id][1]  # its turn 1
        check_held_turn(held, pause_mode, boundary)


def check_held_turn(step, pause_mode: str, boundary: int) -> None:
    """The turn paused after HELD_AT tokens: what was sampled before the pause kept its routes and
    log-probs; the rest came from forward passes after it, with the new weights."""
    prompt = step.prompt_ids.numel()
    sampled = int(step.loss_mask.sum())
    assert sampled == NEW_TOKENS  # continued to its full length, nothing lost
    frozen = prompt + HELD_AT - 1  # positions whose logits gave the tokens sampled before the pause
    assert bool((step.route_forwards[:frozen] < boundary).all())  # never rewritten
    lp = step.logprob_forwards[:sampled]
    assert bool((lp[:HELD_AT] < boundary).all())
    # in_place continues on the logits it had: one more token from the old forward and weights
    old = HELD_AT + (pause_mode == "in_place")
    assert bool((lp[old:] >= boundary).all()) and bool((lp[:old] < boundary).all())
    assert step.weight_versions[:old].tolist() == [0] * old
    assert step.weight_versions[old:sampled].tolist() == [1] * (sampled - old)
