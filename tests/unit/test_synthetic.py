"""The synthetic agent workload is shaped as documented and is a valid step-wise batch."""

import torch

from megatron_stepwise import validate_steps
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps


def test_workload_shape_and_prefix_consistency():
    w = AgentWorkload(
        num_prompts=3,
        samples_per_prompt=2,
        turns=(2, 4),
        obs_len=(5, 9),
        response_len=(2, 6),
        prompt_len=(3, 4),
        vocab_size=50,
        seed=7,
    )
    steps = make_agent_steps(w)
    validate_steps(steps, vocab_size=50)
    assert len({s.trajectory_id for s in steps}) == 6
    assert all(2 <= s.response_ids.numel() <= 6 for s in steps)
    for prev, cur in zip(steps, steps[1:]):
        if prev.trajectory_id != cur.trajectory_id:
            assert 3 <= cur.prompt_ids.numel() <= 4
            continue
        p, r = prev.prompt_ids.numel(), prev.response_ids.numel()
        assert torch.equal(cur.prompt_ids[:p], prev.prompt_ids)
        assert torch.equal(cur.prompt_ids[p : p + r], prev.response_ids)
        assert 5 <= cur.prompt_ids.numel() - p - r <= 9  # the observation
        assert cur.prompt_ids.data_ptr() != prev.prompt_ids.data_ptr()  # steps own their tensors
    again = make_agent_steps(w)
    assert all(
        torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.response_ids, b.response_ids)
        for a, b in zip(steps, again)
    )


def test_drift_breaks_the_prefix_at_the_previous_response():
    steps = make_agent_steps(
        AgentWorkload(
            num_prompts=2,
            samples_per_prompt=2,
            turns=(3, 3),
            drift_prob=1.0,
            obs_len=(1, 2),
            response_len=(2, 3),
            prompt_len=(2, 2),
            seed=1,
        )
    )
    for prev, cur in zip(steps, steps[1:]):
        if prev.trajectory_id == cur.trajectory_id:
            p, r = prev.prompt_ids.numel(), prev.response_ids.numel()
            assert torch.equal(cur.prompt_ids[: p + r - 1], torch.cat([prev.prompt_ids, prev.response_ids])[:-1])
            assert cur.prompt_ids[p + r - 1] != prev.response_ids[-1]
