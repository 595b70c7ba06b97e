"""Users' environments by dotted path and reward-function-only environments (envs/custom.py)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from megatron_stepwise.envs.custom import EnvPathError, RewardFnEnv, resolve_env_spec


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
    (tmp_path / "user_envs_probe.py").write_text(
        textwrap.dedent('''
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
    ''')
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = resolve_env_spec("user_envs_probe:Counting")
    assert (spec.tokenizer, spec.required_fields, spec.description) == ("tiny_char", ("prompt", "n"), "Counts.")
    assert len(spec.dataset(num=5)) == 5 and resolve_env_spec("user_envs_probe:Counting") is spec  # registered once
    with pytest.raises(EnvPathError, match="is a int, not an Environment class or factory"):
        resolve_env_spec("user_envs_probe:NOT_CALLABLE")
    with pytest.raises(EnvPathError, match="expected module:name"):
        resolve_env_spec("user_envs_probe:")
    sys.modules.pop("user_envs_probe", None)


def test_a_dataset_callable_without_prompt_ids_gets_row_ids_like_a_file():
    from megatron_stepwise.data.files import DatasetError, with_prompt_ids

    samples = with_prompt_ids([{"prompt": "a"}, {"prompt": "b", "prompt_id": 7}, {"prompt": "c", "prompt_id": ""}])
    assert [s["prompt_id"] for s in samples] == ["row0", "7", "row2"]
    with pytest.raises(DatasetError, match="prompt_id 'x' \\(sample 1 of the environment's dataset\\) appears twice"):
        with_prompt_ids([{"prompt_id": "x"}, {"prompt_id": "x"}])
    with pytest.raises(DatasetError, match="sample 0 of the environment's dataset is a str, not a dict"):
        with_prompt_ids(["what is 2+2?"])


def test_validate_and_the_trainer_dataset_accept_a_callable_without_prompt_ids(tmp_path, monkeypatch):
    from megatron_stepwise.compose.components import build_dataset
    from megatron_stepwise.config import config_from_dict

    (tmp_path / "user_guess_env.py").write_text(
        textwrap.dedent("""
        class Guess:
            tokenizer = "tiny_char"

            @staticmethod
            def dataset(num=8):
                return [{"prompt": f"guess {i}", "target": i} for i in range(num)]

            def reset(self, sample):
                return [{"role": "user", "content": sample["prompt"]}]

            def step(self, text):
                return [], 0.0, True, {}
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = config_from_dict({"env": {"name": "user_guess_env:Guess"}})
    dataset = build_dataset(cfg)
    assert sorted(s["prompt_id"] for s in dataset.next(8)) == sorted(f"row{i}" for i in range(8))
    sys.modules.pop("user_guess_env", None)
