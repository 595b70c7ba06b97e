"""Environments: registry, echo scoring, sandboxed Python tool, BM25 retrieval, shipped data."""

import json
import socket
from pathlib import Path

import pytest
from helpers import load_script

from megatron_stepwise.envs.base import get_env_spec, list_envs, make_env
from megatron_stepwise.envs.bm25 import BM25
from megatron_stepwise.envs.sandbox import run_python
from megatron_stepwise.envs.search import normalize_answer, search
from megatron_stepwise.hf.tokenizers import TOKENIZER_NAMES, build_tokenizer_files, tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]


def test_registry():
    assert {"echo", "math_tool", "search"} <= set(list_envs())
    with pytest.raises(KeyError, match="unknown environment 'nope'"):
        make_env("nope")
    for name in ("echo", "math_tool", "search"):
        spec = get_env_spec(name)
        samples = spec.dataset()
        ids = [s["prompt_id"] for s in samples]
        assert len(ids) == len(set(ids)) and len(ids) >= 50
        messages = make_env(name).reset(samples[0])
        assert messages and all({"role", "content"} <= set(m) for m in messages)


def test_echo_partial_credit_sums_to_the_mean_turn_score():
    env = make_env("echo")
    assert env.reset({"prompt_id": "p", "digits": [3, 5, 7]}) == [{"role": "user", "content": "say 3"}]
    obs, r1, done, _ = env.step("3 good")
    assert obs == [{"role": "user", "content": "good say 5"}] and r1 == pytest.approx(1 / 3) and not done
    obs, r2, done, _ = env.step("no 5")
    assert obs == [{"role": "user", "content": "no say 7"}] and r2 == pytest.approx(0.5 / 3) and not done
    obs, r3, done, _ = env.step("1 2")
    assert obs == [] and r3 == 0.0 and done
    with pytest.raises(ValueError, match="digits"):
        env.reset({"prompt_id": "bad", "digits": [12]})


@pytest.mark.launches  # the sandbox runs the code in a child process
def test_sandbox_runs_code_with_limits(tmp_path):
    assert run_python("print(6 * 7)").stdout == "42\n"
    assert run_python("1/0").as_observation().startswith("ZeroDivisionError")
    timed = run_python("while True: pass", timeout_s=1)
    assert timed.timed_out and timed.as_observation() == "Error: timed out"
    assert "MemoryError" in run_python("x = bytearray(1 << 31)", memory_mb=256).as_observation()
    # No network, not even to a server listening on this machine's loopback.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')"
        result = run_python(code, timeout_s=3)
        assert "connected" not in result.stdout and result.returncode != 0
        blocked = run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}))")
        assert blocked.returncode != 0 and "PermissionError" in blocked.stderr
    # The working directory is a fresh temporary one, not ours. (The hostile corpus: test_sandbox.py.)
    assert run_python("import os; print(os.getcwd())").stdout.strip() != str(Path.cwd())


def call(code):
    return f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call>"


@pytest.mark.launches  # the python tool runs in the sandbox's child process
def test_math_tool_env_episode():
    spec = get_env_spec("math_tool")
    sample = spec.dataset(2)[1]  # "A crate holds 17 bottles. How many bottles are in 46 crates?"
    env = spec.factory()
    messages = env.reset(sample)
    assert "<tool_call>" in messages[0]["content"] and [t["function"]["name"] for t in env.tools] == ["python"]
    obs, reward, done, info = env.step("Let me compute. " + call("print(17 * 46)"))
    assert obs == [{"role": "tool", "name": "python", "content": "782"}] and reward == 0 and not done
    assert info == {"tool_calls": 1, "tool_errors": 0}
    obs, reward, done, _ = env.step("thinking")
    assert obs[0]["role"] == "user" and "format" not in obs[0]["content"] and not done
    assert "<answer>" in obs[0]["content"] and "<tool_call>" in obs[0]["content"]
    assert env.step("<answer>782</answer>")[1:3] == (1.0, True)
    env.reset(sample)
    assert env.step("<answer>781</answer>")[1:3] == (0.0, True)
    for row in spec.dataset():  # every shipped answer is an integer the question's numbers give
        assert str(int(row["answer"])) == row["answer"]


@pytest.mark.launches  # the python tool runs in the sandbox's child process
def test_math_tool_answers_every_call_in_order_and_malformed_ones_with_an_error():
    env = make_env("math_tool")
    env.reset({"prompt_id": "p", "question": "What is 2 + 3?", "answer": "5"})
    text = (
        call("print(2 + 3)")
        + '<tool_call>{"name": "python", "arguments": {"code": 1}}</tool_call>'
        + '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
        + '<tool_call>{"name": "python", "arguments": [1]}</tool_call>'
        + "<tool_call>{name: python}</tool_call>"
        + call("print('x'  * 3)")
    )
    obs, reward, done, info = env.step(text)
    assert [m["role"] for m in obs] == ["tool"] * 5 and reward == 0 and not done
    assert obs[0]["content"] == "5"
    assert obs[1]["content"].startswith("Error: tool call 2: python: argument 'code' must be string, got an integer")
    assert "unknown tool 'calc' (available: python)" in obs[2]["content"]
    assert '"arguments" must be a JSON object, got an array' in obs[3]["content"]
    assert "at most 4 tool calls per turn; the other 2 were not run" in obs[4]["content"]
    assert info == {"tool_calls": 1, "tool_errors": 4}
    obs, _, _, info = env.step("<tool_call>{name: python}</tool_call>")  # never crashes the trajectory
    assert obs == [
        {
            "role": "tool",
            "content": "Error: tool call 1: invalid JSON (Expecting property name "
            "enclosed in double quotes at line 1 column 2)",
        }
    ]
    # Code with raw newlines inside the JSON string (as models write it) runs.
    code = '{"name": "python", "arguments": {"code": "x = 6\nprint(x * 7)"}}'
    obs, _, _, _ = env.step(f"<tool_call>\n{code}\n</tool_call>")
    assert obs[0]["content"] == "42"
    assert env.step("The answer: <answer>5</answer>")[1:3] == (1.0, True)


def test_bm25_scores_by_hand():
    index = BM25(["apple banana", "banana banana cherry", "cherry"], k1=1.2, b=0.75)
    # idf(apple) = ln(1 + (3 - 1 + 0.5) / (1 + 0.5)); doc 0 has length 2, avg length 2 -> norm k1
    import math

    idf = math.log(1 + 2.5 / 1.5)
    assert index.score("apple", 0) == pytest.approx(idf * 1 * 2.2 / (1 + 1.2))
    assert index.top_k("banana", 3)[0][0] == 1 and index.score("apple", 2) == 0.0


def test_search_finds_the_answering_document_for_every_question():
    spec = get_env_spec("search")
    questions = [json.loads(line) for line in (ROOT / "megatron_stepwise/envs/data/search_questions.jsonl").open()]
    corpus = [json.loads(line) for line in (ROOT / "megatron_stepwise/envs/data/search_corpus.jsonl").open()]
    assert len(corpus) == 100 and len(questions) == 50
    for q in questions:
        hits = search(q["question"], top_k=3)
        assert q["doc_id"] in [h["id"] for h in hits], q["question"]
        assert q["answer"] in next(d["text"] for d in corpus if d["id"] == q["doc_id"])
    env = spec.factory()
    env.reset(spec.dataset(1)[0])
    obs, reward, done, _ = env.step("<search>national animal Dravenri</search>")
    assert obs[0]["content"].startswith("<information>Doc 1(Title: Dravenri (animal))") and not done
    assert env.step("<answer>The Crane.</answer>")[1:3] == (1.0, True)
    assert normalize_answer("  The  Kofi-Ulsel! ") == "kofiulsel"


def test_shipped_files_are_reproducible(tmp_path):
    for name in TOKENIZER_NAMES:
        build_tokenizer_files(name, tmp_path / name)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            assert (tmp_path / name / f).read_text() == (tokenizer_dir(name) / f).read_text(), f"{name}/{f}"
    import random

    make_env_data = load_script(ROOT / "tools" / "make_env_data.py")
    shipped = [json.loads(line) for line in (ROOT / "megatron_stepwise/envs/data/math_problems.jsonl").open()]
    assert make_env_data.math_problems(random.Random(0)) == shipped
