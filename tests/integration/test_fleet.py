"""The Ray fleet of embedded engines: faults, weight broadcast, routing (local Ray, CPU).

Marked slow: starting Ray and the engine actors takes ~20-30 s on a 2-core machine.
`make test` runs them; `make test-fast` leaves them out.
"""

import asyncio
import collections

import pytest
import torch
from helpers import tiny_lm

from megatron_stepwise.envs.echo import echo_dataset
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

TOK, CONFIG = tiny_lm("tiny_word")


def specs(n):
    return [EngineSpec(model_config=CONFIG, tokenizer="tiny_word", seed=0, num_cpus=0.5) for _ in range(n)]


def test_killing_an_engine_mid_rollout_loses_and_duplicates_nothing():
    samples = echo_dataset(16, num_turns=3, seed=7)
    n = 4

    async def scenario():
        fleet = RolloutFleet(specs(3), max_concurrency=48, max_retries=2, request_timeout_s=60)
        await fleet.wait_ready()
        loop = AgentLoop(
            fleet,
            TOK,
            "echo",
            AgentLoopConfig(
                max_turns=3, max_input_length=100, n_samples_per_prompt=n, sampling=SamplingParams(max_new_tokens=16)
            ),
        )
        task = asyncio.create_task(loop.rollout(samples))
        # Kill engine 1 while it has turns in flight (so they must be retried elsewhere).
        deadline = asyncio.get_running_loop().time() + 120
        while fleet.metrics()["requests"] < 10 or fleet.outstanding(1) == 0:
            if task.done():
                task.result()  # raises the rollout's error, if that is why it ended
                pytest.fail("the rollout finished before engine 1 could be killed mid-rollout")
            assert asyncio.get_running_loop().time() < deadline, "engine 1 never had turns in flight"
            await asyncio.sleep(0.005)
        fleet.kill_engine(1)
        steps = await task
        during = fleet.metrics()
        await fleet.wait_restarts()
        after = fleet.metrics()
        # The restarted engine serves again.
        r = await fleet.engine(1).generate.remote([1, 5, 8, 2, 1, 6], SamplingParams(max_new_tokens=2))
        loop.close()
        await fleet.shutdown()
        return steps, during, after, r

    steps, during, after, r = asyncio.run(scenario())
    trajectories = collections.OrderedDict()
    for s in steps:
        trajectories.setdefault(s.trajectory_id, []).append(s)
    expected = [(p["prompt_id"], k) for p in samples for k in range(n)]
    assert [(t.prompt_id, t.sample_index) for t in trajectories] == expected  # each exactly once, in order
    assert len(steps) == sum(len(v) for v in trajectories.values())
    for traj in trajectories.values():
        assert [s.metadata["turn"] for s in traj] == list(range(len(traj)))  # no turn lost or repeated
        assert [s.is_last_step for s in traj] == [False] * (len(traj) - 1) + [True]
        assert len(traj) == 3  # echo always runs its 3 turns: every turn was eventually served
    assert during["engine_failures"] == 1 and during["retries"] >= 1
    assert during["requests"] == len(steps)
    assert after["restarts"] == 1 and after["alive_engines"] == 3 and after["removed_engines"] == 0
    assert len(r.output_ids) >= 1


def test_weight_broadcast_versions_every_generation_and_replays_on_restart():
    target = build_causal_lm(CONFIG, seed=4)
    prompt = [1, 5, 8, 2, 1, 6]
    greedy = SamplingParams(temperature=0, max_new_tokens=4)

    async def scenario():
        fleet = RolloutFleet(specs(2), max_concurrency=8, request_timeout_s=60)
        await fleet.wait_ready()
        out = {}
        out["before"] = await asyncio.gather(*(fleet.generate(prompt, greedy, session=f"s{i}") for i in range(6)))
        # Stickiness: a session's next turn goes to the engine that served its previous one.
        again = await asyncio.gather(*(fleet.generate(prompt, greedy, session=f"s{i}") for i in range(6)))
        out["sticky"] = [(a.engine, b.engine) for a, b in zip(out["before"], again)]
        # Update while requests are in flight: they finish on the old version, later ones on the new.
        inflight = [asyncio.create_task(fleet.generate(prompt, SamplingParams(max_new_tokens=32))) for _ in range(4)]
        await asyncio.sleep(0)
        out["version"] = await fleet.update_weights_from_tensors(dict(target.state_dict()))
        out["inflight"] = await asyncio.gather(*inflight)
        out["after"] = await asyncio.gather(*(fleet.generate(prompt, greedy) for _ in range(6)))
        fleet.kill_engine(0)
        # ray.kill is asynchronous: the actor stops answering shortly after, not at once.
        for _ in range(1200):
            try:
                await fleet.engine(0).call.remote("health")
            except Exception:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the killed engine still answers after 120 s")
        # The fleet finds the death on the next request routed there (no request is outstanding:
        # least-outstanding routing picks engine 0), retries it on engine 1 and restarts engine 0.
        await fleet.generate(prompt, greedy)
        await fleet.wait_restarts()
        out["restarted_version"] = await fleet.engine(0).call.remote("weight_version")
        out["restarted"] = await fleet.engine(0).generate.remote(prompt, greedy)
        out["metrics"] = fleet.metrics()
        await fleet.shutdown()
        return out

    out = asyncio.run(scenario())
    engines = {r.engine for r in out["before"]}
    assert len(engines) == 2  # least-outstanding routing spread the sessions
    assert all(a == b for a, b in out["sticky"])
    assert out["version"] == 1 and all(r.weight_version == 0 for r in out["inflight"])
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = []
        for _ in range(4):
            nxt = int(target(input_ids=ids).logits[0, -1].argmax())
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
            if nxt == TOK.eos_token_id:
                break
    for r in out["after"]:
        assert r.weight_version == 1 and r.token_weight_versions == [1] * len(r.output_ids)
        assert r.output_ids == want
    assert out["restarted_version"] == 1 and out["restarted"].output_ids == want
    assert out["metrics"]["weight_updates"] == 1 and out["metrics"]["restarts"] == 1
