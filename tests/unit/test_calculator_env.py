"""The `calculator` environment: tags, a safe evaluator, and a held-out set never trained on."""

from __future__ import annotations

import pytest

from megatron_stepwise.envs.base import get_env_spec, make_env
from megatron_stepwise.envs.calculator import calculator_dataset, calculator_eval_dataset, evaluate


def test_an_episode_calc_then_answer():
    env = make_env("calculator")
    messages = env.reset({"prompt_id": "p", "question": "How many?", "answer": 84})
    assert messages[0]["role"] == "system" and messages[-1]["content"] == "How many?"
    assert any("<calc>" in m["content"] for m in messages if m["role"] == "assistant")  # the worked example
    obs, reward, done, info = env.step("<calc>12 * 7 = 80</calc>")  # the left side is what is computed
    assert obs == [{"role": "user", "content": "Result: 84"}] and (reward, done) == (0.0, False)
    obs, reward, done, info = env.step("so <answer>84</answer>")
    assert (obs, reward, done, info["answer"], info["calls"]) == ([], 1.0, True, "84", 1)


def test_wrong_answers_hints_and_bad_expressions():
    env = make_env("calculator", worked_example=False)
    assert len(env.reset({"question": "q", "answer": 5})) == 2
    assert env.step("<answer>6</answer>")[1:3] == (0.0, True)
    env.reset({"question": "q", "answer": 5})
    obs, reward, done, info = env.step("I think it is five")
    assert "<calc>" in obs[0]["content"] and info["format_error"] and not done
    for bad in ["__import__('os').system('true')", "2 ** 100000", "1 / 0", "", "x" * 300]:
        obs, _, done, _ = env.step(f"<calc>{bad}</calc>")
        assert obs[0]["content"].startswith("Error") and not done, bad


def test_the_evaluator_is_arithmetic_only():
    assert evaluate("(3 + 4) * 2 - 10 / 4") == 11.5
    assert evaluate("-3 + +2") == -1
    assert evaluate("12 x 7") == 84
    with pytest.raises(ValueError):
        evaluate("abs(-3)")
    with pytest.raises(ValueError):
        evaluate("True + 1")


def test_training_sets_are_deterministic_and_never_hold_a_held_out_question():
    held_out = {p["question"] for p in calculator_eval_dataset(256)}
    for seed in (0, 1, 2):
        train = calculator_dataset(2048, seed=seed)
        assert train == calculator_dataset(2048, seed=seed)
        assert len({p["question"] for p in train}) == 2048
        assert not held_out & {p["question"] for p in train}
    assert calculator_eval_dataset() == calculator_eval_dataset()
    assert all(isinstance(p["answer"], int) and p["answer"] >= 0 for p in calculator_eval_dataset())
    assert get_env_spec("calculator").eval_dataset is calculator_eval_dataset


def test_varied_worked_examples_are_stable_per_question_and_cover_three_operations():
    env = make_env("calculator", vary_example=True)
    calls = set()
    for p in calculator_eval_dataset():
        first = env.reset(p)
        assert env.reset(p) == first
        calls.add(first[2]["content"])
    assert {c[c.index(" ") + 1] for c in calls} == {"*", "+", "-"}, calls
