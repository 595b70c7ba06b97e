"""Bad input gets an OpenAI- or Anthropic-shaped error naming the field, with the right status;
sampling stays the trainer's; a retried request is answered once."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from megatron_stepwise.gateway.config import AgentConfig
from megatron_stepwise.gateway.server import GatewaySettings
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from tests.gateway_fixtures import Scripted, Served
from tests.helpers import tiny_lm

TOK, _ = tiny_lm("tiny_bpe")
CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


def served(replies=("ok",) * 8, **settings):
    base = dict(sampling=SamplingParams(temperature=1.0, max_new_tokens=8), max_input_length=64, max_request_bytes=4096)
    return Served(Scripted(TOK, list(replies)), TOK, GatewaySettings(**{**base, **settings}))


def post(url, body, key, headers=()):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", **dict(headers)}
    )
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def gw():
    s = served()
    yield s
    s.close()


def test_bad_requests_are_refused_naming_the_field(gw):
    url, key = gw.open(), gw.gateway.api_key
    chat = url + "/chat/completions"
    cases = [
        (b"{not json", key, 400, "body"),
        (CHAT, None, 401, None),
        (CHAT, "wrong", 401, None),
        ({**CHAT, "n": 2}, key, 400, "n"),
        ({**CHAT, "messages": []}, key, 400, "messages"),
        ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, key, 400, "messages[0].role"),
        ({**CHAT, "max_tokens": 0}, key, 400, "max_tokens"),
        ({**CHAT, "messages": [{"role": "user", "content": "x " * 200}]}, key, 400, "messages"),
        ({**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}, key, 413, None),
    ]
    for body, k, status, param in cases:
        got, answer = post(chat, body, k)
        assert got == status, (body if isinstance(body, bytes) else str(body)[:80], answer)
        assert answer["error"]["param"] == param and answer["error"]["message"]
    _, answer = post(chat, {**CHAT, "messages": [{"role": "user", "content": "x " * 200}]}, key)
    assert answer["error"]["code"] == "context_length_exceeded"
    assert post(url.replace(url.split("/")[-2], "0" * 32) + "/chat/completions", CHAT, key)[0] == 404
    assert gw.recording.calls == []  # none of them reached the engine
    status, answer = post(chat, CHAT, key)  # any model name reaches the policy
    assert status == 200 and answer["model"] == "gpt-4o"
    gw.gateway.finish(url, 0.0)
    status, answer = post(chat, CHAT, key)
    assert status == 404 and answer["error"]["type"] == "not_found_error"


def test_anthropic_errors_have_anthropic_shape(gw):
    url, key = gw.open(), gw.gateway.api_key
    status, answer = post(url + "/messages", {"model": "c", "messages": [{"role": "user", "content": "hi"}]}, key)
    assert status == 400 and answer["type"] == "error" and "max_tokens" in answer["error"]["message"]
    body = {"model": "c", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    status, answer = post(url + "/messages", body, None, {"x-api-key": key})
    assert status == 200 and answer["type"] == "message"
    status, answer = post(url + "/messages", body, None, {"x-api-key": "nope"})
    assert status == 401 and answer["error"]["type"] == "authentication_error"


def test_client_sampling_is_ignored_and_counted_or_refused():
    s = served()
    try:
        url, key = s.open(), s.gateway.api_key
        status, _ = post(url + "/chat/completions", {**CHAT, "temperature": 0.2, "top_p": 1.0}, key)
        assert status == 200 and s.gateway.counts["ignored_sampling"] == 1  # top_p equals the trainer's
        assert s.recording.calls[-1][3].temperature == 1.0
    finally:
        s.close()
    s = served(agent=AgentConfig(client_sampling="refuse"))
    try:
        status, answer = post(s.open() + "/chat/completions", {**CHAT, "temperature": 0.2}, s.gateway.api_key)
        assert status == 400 and answer["error"]["param"] == "temperature"
    finally:
        s.close()


def test_a_retried_request_is_answered_once(gw):
    url, key = gw.open(), gw.gateway.api_key
    first = post(url + "/chat/completions", CHAT, key, {"Idempotency-Key": "abc"})
    again = post(url + "/chat/completions", CHAT, key, {"Idempotency-Key": "abc"})
    sdk_retry = post(url + "/chat/completions", CHAT, key, {"x-stainless-retry-count": "1"})
    assert first == again == sdk_retry and len(gw.recording.calls) == 1
    post(url + "/chat/completions", CHAT, key)  # the same body sent anew (no retry header): a new call
    assert len(gw.gateway.finish(url, 1.0)) == 2 and gw.gateway.counts["retries_answered"] == 2


def test_call_cap_and_completions(gw):
    gw.gateway.settings.agent = AgentConfig(agent_max_calls=2)
    url, key = gw.open(), gw.gateway.api_key
    status, a = post(url + "/completions", {"model": "m", "prompt": "say 1"}, key)
    assert status == 200 and a["object"] == "text_completion" and a["choices"][0]["text"] == "ok"
    ids = gw.recording.calls[-1][0] + gw.recording.calls[-1][1] + [5]
    assert post(url + "/completions", {"model": "m", "prompt": ids}, key)[0] == 200  # token ids in: extends
    status, a = post(url + "/completions", {"model": "m", "prompt": "x"}, key)
    assert status == 400 and "agent_max_calls" in a["error"]["message"]
    steps = gw.gateway.finish(url, 1.0)
    assert steps[1].prompt_ids.tolist() == ids and [s.metadata["prefix_break"] for s in steps] == [False, False]
