"""Users' environments by dotted path and reward-function-only environments (envs/custom.py)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from megatron_stepwise.envs import RewardFnEnv, resolve_env_spec
from megatron_stepwise.envs.custom import EnvPathError


def test_single_turn_reward_function_ends_after_one_reply():
    env = RewardFnEnv(lambda response, sample: float(response == sample["answer"]))
    assert env.reset({"prompt_id": "a", "prompt": "say 3", "answer": "3"}) == [{"role": "user", "content": "say 3"}]
    assert env.step("3") == ([], 1.0, True, {})


def test_multi_turn_reward_function_continues_with_its_message_and_gets_the_turn():
    turns = []

    def score(response, sample, turn):
        turns.append(turn)
        return (0.0, "again") if turn < 2 else (0.5, None)

    env = RewardFnEnv(score)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert env.reset({"prompt": chat}) == chat
    assert env.step("x") == ([{"role": "user", "content": "again"}], 0.0, False, {})
    assert env.step("y")[2] is False
    assert env.step("z") == ([], 0.5, True, {})
    assert turns == [0, 1, 2]


def test_a_sample_without_a_usable_prompt_is_named():
    with pytest.raises(ValueError, match="sample 'p7': 'prompt' must be a string or a list of chat messages"):
        RewardFnEnv(lambda r, s: 0.0).reset({"prompt_id": "p7", "question": "say 1"})


def test_dotted_path_reads_the_optional_class_attributes(tmp_path, monkeypatch):
    (tmp_path / "user_envs_probe.py").write_text(textwrap.dedent('''
        class Counting:
            """Counts."""
            tokenizer = "tiny_char"
            required_fields = ("prompt", "n")

            @staticmethod
            def dataset(num=3):
                return [{"prompt_id": str(i), "prompt": "count", "n": i} for i in range(num)]

            def reset(self, sample):
                return [{"role": "user", "content": sample["prompt"]}]

            def step(self, text):
                return [], 0.0, True, {}

        NOT_CALLABLE = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = resolve_env_spec("user_envs_probe:Counting")
    assert (spec.tokenizer, spec.required_fields, spec.description) == ("tiny_char", ("prompt", "n"), "Counts.")
    assert len(spec.dataset(num=5)) == 5 and resolve_env_spec("user_envs_probe:Counting") is spec  # registered once
    with pytest.raises(EnvPathError, match="is a int, not an Environment class or factory"):
        resolve_env_spec("user_envs_probe:NOT_CALLABLE")
    with pytest.raises(EnvPathError, match="expected module:name"):
        resolve_env_spec("user_envs_probe:")
    sys.modules.pop("user_envs_probe", None)
