"""LLM-judge rewards: the template over the sample and the trajectory, the verdict parsers, outcome
and per-turn rewards, and an unparsable answer making the trajectory invalid (counted, not 0)."""

import asyncio

import pytest

from megatron_stepwise.algo.groups import RolloutGroup
from megatron_stepwise.algo.prepare import prepare_rows
from megatron_stepwise.config import config_from_dict
from megatron_stepwise.config.errors import ConfigError
from megatron_stepwise.rollout.engines.protocol import GenerateResult
from megatron_stepwise.rollout.judge import Judge, JudgeConfig, parse_verdict
from megatron_stepwise.steps import Step, TrajectoryID


class CharTokenizer:
    """Characters as token ids (the judge's and the policy's), with a visible chat template."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class ScriptedJudge:
    """Answers each request with the next scripted answer; records the prompts it was given."""

    def __init__(self, *answers):
        self.answers, self.prompts = list(answers), []

    async def generate(self, input_ids, sampling, rid=None, session=None):
        self.prompts.append(CharTokenizer().decode(input_ids))
        text = self.answers.pop(0)
        return GenerateResult([ord(c) for c in text], [0.0] * len(text), "stop")


def ids(text):
    return [ord(c) for c in text]


def trajectory(k=0, env_reward=0.25):
    t = TrajectoryID("p", k)
    first = Step(t, ids("Q:2+2?"), ids("four"), [1] * 4, rollout_logprobs=[-1.0] * 4, turn_reward=0.0)
    second = Step(
        t, ids("Q:2+2?four|again"), ids("4"), [1], rollout_logprobs=[-1.0], reward=env_reward, is_last_step=True
    )
    return [first, second]


def judge(answers, **config):
    cfg = JudgeConfig(prompt="Rate {answer} to {question} ({sample[level]}) in {transcript}", **config)
    generator = ScriptedJudge(*answers)
    return Judge(generator, CharTokenizer(), cfg, CharTokenizer()), generator


SAMPLE = {"prompt_id": "p", "prompt": "2+2?", "level": "easy"}


def test_outcome_verdict_replaces_the_reward_and_is_kept_with_its_prompt():
    hook, generator = judge(["I'd say 0.8 out of 1"])
    steps = trajectory()
    asyncio.run(hook(steps, SAMPLE))
    assert generator.prompts == ["<user>Rate 4 to 2+2? (easy) in Q:2+2?four|again4<assistant>"]
    assert steps[-1].reward == pytest.approx(0.8)
    assert steps[-1].metadata["judge"][0]["answer"] == "I'd say 0.8 out of 1"
    assert hook.metrics() == {"judge/calls": 1.0, "judge/unparsable": 0.0}


def test_turn_verdicts_become_turn_rewards_and_add_to_the_env_reward():
    hook, generator = judge(
        ["<score>1</score>", "<score>0.5</score>"], reward="turn", parser="tag:score", combine="add"
    )
    steps = trajectory(env_reward=0.25)
    asyncio.run(hook(steps, SAMPLE))
    assert [s.turn_reward for s in steps] == [1.0, 0.5]
    assert steps[-1].reward == pytest.approx(1.75)
    assert "Rate four" in generator.prompts[0] and "Rate 4" in generator.prompts[1]


def test_an_unparsable_verdict_makes_the_trajectory_invalid_and_untrained():
    hook, _ = judge(["no idea", "7"])
    bad, good = trajectory(0), trajectory(1)
    asyncio.run(hook(bad, SAMPLE))
    asyncio.run(hook(good, SAMPLE))
    assert bad[-1].invalid_reason.startswith("judge: no verdict") and good[-1].invalid_reason is None
    assert hook.metrics()["judge/unparsable"] == 1.0
    batch, metrics = prepare_rows([RolloutGroup("p", [bad, good])], estimator="grpo")
    assert metrics["advantages/invalid_trajectories"] == 1
    assert int(batch.token_fields["loss_mask"][: int(batch.offsets[2])].sum()) == 0  # the invalid rows train nothing


@pytest.mark.parametrize(
    "parser,answer,value",
    [
        ("number", "4.5 / 10, not 3", 4.5),
        ("number", "none", None),
        ("tag:verdict", "<verdict> -2 </verdict> and 9", -2.0),
        ("tag:verdict", "verdict: 3", None),
        ("regex:Score=(\\d+)", "Score=7 (of 10)", 7.0),
        ("yes_no", "No, it is not; yes would be wrong", 0.0),
        ("yes_no", "YES.", 1.0),
        ("yes_no", "Nobody knows", None),
    ],
)
def test_parsers(parser, answer, value):
    assert parse_verdict(parser, answer) == value


def test_config_names_a_bad_parser_a_bad_template_and_a_missing_judge_model():
    data = {
        "model": {"hf_config": "tiny"},
        "launch": {"nproc_per_node": 1},
        "env": {"name": "echo", "judge": {"prompt": "rate {answr}", "parser": "regex:no group"}},
    }
    with pytest.raises(ConfigError) as e:
        config_from_dict(data, world_size=1)
    found = [(p.key, p.message) for p in e.value.problems]
    assert any(k == "env.judge.parser" and "capturing group" in m for k, m in found)
    assert any(k == "env.judge.prompt" and "answr" in m for k, m in found)
    assert any(k == "env.judge.prompt" and "set judge.hf_checkpoint" in m for k, m in found)


def test_the_eval_command_gets_the_judge_in_process(tmp_path):
    """`megatron-stepwise eval` runs no fleet: the judge is an engine in its process, so its
    rewards are those of training's evaluation; an SGLang judge it cannot launch is refused."""
    from helpers import tiny_lm

    from megatron_stepwise.compose.served import standalone_judge
    from megatron_stepwise.errors import UserError
    from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
    from megatron_stepwise.rollout.engines.embedded.hf_model import build_causal_lm, save_safetensors_dir

    _, config = tiny_lm("tiny_word")
    save_safetensors_dir(build_causal_lm(config, seed=1), tmp_path)
    data = {
        "model": {"hf_config": "tiny"},
        "launch": {"nproc_per_node": 1},
        "env": {"name": "echo", "judge": {"prompt": "say {answer}"}},
        "judge": {"hf_checkpoint": str(tmp_path), "tokenizer": "tiny_word"},
    }
    assert isinstance(standalone_judge(config_from_dict(data, world_size=1)), LocalEngine)
    data["judge"]["engine"] = "sglang"
    with pytest.raises(UserError, match="judge.sglang.servers"):
        standalone_judge(config_from_dict(data, world_size=1))
    assert (
        standalone_judge(
            config_from_dict({k: v for k, v in data.items() if k != "judge"} | {"env": {"name": "echo"}}, world_size=1)
        )
        is None
    )


def test_a_judge_that_fails_gives_no_verdict_and_the_trajectory_is_invalid():
    from megatron_stepwise.rollout.engines.protocol import EngineError

    class Down:
        async def generate(self, input_ids, sampling, rid=None, session=None):
            raise EngineError("judge engine 0 timed out after 300s")

    hook = Judge(Down(), CharTokenizer(), JudgeConfig(prompt="rate {answer}"), CharTokenizer())
    steps = trajectory()
    asyncio.run(hook(steps, SAMPLE))
    assert "no answer: EngineError: judge engine 0 timed out" in steps[-1].invalid_reason
    assert hook.metrics() == {"judge/calls": 1.0, "judge/unparsable": 1.0}
