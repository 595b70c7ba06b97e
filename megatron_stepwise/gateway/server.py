"""The gateway's HTTP app: `/trajectories/<id>/v1/...` in front of any `Engine` or fleet.

Routes: OpenAI `POST chat/completions`, `POST completions`, `GET models`, Anthropic `POST
messages`. Every call is rendered with the policy's chat template (`recorder.py` decides whether
it extends the last prompt or breaks the prefix), generated from token ids with the trainer's
sampling (`generate_continued`: a weight update pauses it, never fails it), recorded as a step,
and answered in the client's shape. Auth: `Authorization: Bearer <key>` or Anthropic's
`x-api-key`. A retried request (same `Idempotency-Key`, or an SDK retry of the same body) is
answered from the first one: one step, never two.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from aiohttp import web

from megatron_stepwise.envs.tool_calls import parse_tool_calls
from megatron_stepwise.gateway import anthropic_api, openai_api
from megatron_stepwise.gateway.call import Answer, Call, flag, max_tokens_of, sampling_of, stop_of
from megatron_stepwise.gateway.config import AgentConfig
from megatron_stepwise.gateway.errors import GatewayError, bad, error_response
from megatron_stepwise.gateway.messages import reply_message
from megatron_stepwise.gateway.recorder import Prompt, TrajectoryRecorder
from megatron_stepwise.rollout.agent.context import ChatTemplateError, encode
from megatron_stepwise.rollout.agent.continuation import generate_continued
from megatron_stepwise.rollout.agent.loop import turn_seed
from megatron_stepwise.rollout.engines.auth import bearer_matches, is_loopback, redact_bearer_tokens
from megatron_stepwise.rollout.engines.protocol import EngineError, SamplingParams
from megatron_stepwise.steps import Step, TrajectoryID

log = logging.getLogger(__name__)

PREFIX = "/trajectories/{tid}/v1"


@dataclass
class GatewaySettings:
    """What the trainer decides for every call: sampling, context, caps."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_input_length: int = 2048
    max_model_length: Optional[int] = None
    agent: AgentConfig = field(default_factory=AgentConfig)
    append_eos: bool = True
    max_request_bytes: int = 8 << 20
    model_name: str = "policy"


class Gateway:
    """Serves the trajectories it has `open`; `finish` hands one's calls over as its steps."""

    def __init__(
        self,
        generator: Any,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        settings: Optional[GatewaySettings] = None,
        api_key: Optional[str] = None,
        host: str = "127.0.0.1",
    ):
        if not is_loopback(host) and not api_key:
            raise ValueError(f"a gateway on {host} (beyond loopback) needs an api_key")
        self.generator, self.tokenizer = generator, tokenizer
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.settings = settings or GatewaySettings()
        self.api_key = api_key or secrets.token_urlsafe(24)  # agents get it with their base_url
        self.host = host
        self.url: Optional[str] = None
        self.counts: Counter = Counter()  # calls, prefix_breaks, ignored_sampling, retries_answered, refused
        self._open: dict[str, TrajectoryRecorder] = {}
        self._keys: dict[str, str] = {}  # trajectory id -> its own key
        self._runner: Optional[web.AppRunner] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self, port: int = 0) -> str:
        """Listen (port 0: any free one); returns the root URL."""
        redact_bearer_tokens()
        app = web.Application(client_max_size=self.settings.max_request_bytes + 1)
        r = app.router
        r.add_post(PREFIX + "/chat/completions", self._chat)
        r.add_post(PREFIX + "/completions", self._completions)
        r.add_get(PREFIX + "/models", self._models)
        r.add_post(PREFIX + "/messages", self._messages)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop = asyncio.get_running_loop()
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{bound}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def close_from_sync(self, timeout: float = 30.0) -> None:
        """`close` from synchronous code, on the loop the gateway serves on. Without it, agents
        that keep their connections alive (a shared httpx client) leave request handlers pending
        when that loop is closed, and asyncio logs each as "Task was destroyed but it is pending"."""
        loop = self._loop
        if self._runner is None or loop is None or loop.is_closed():
            return
        if not loop.is_running():
            loop.run_until_complete(self.close())
        elif not _on_loop_thread(loop):
            asyncio.run_coroutine_threadsafe(self.close(), loop).result(timeout)
        else:  # called from a callback of its own loop: it cannot wait here
            loop.create_task(self.close())

    async def serve_socket(self, listener) -> web.SockSite:
        """Accept on `listener` too (an agent command's own network namespace's socket); stop
        the returned site to close it."""
        site = web.SockSite(self._runner, listener)
        await site.start()
        return site

    def open(self, traj_id: TrajectoryID, seed: Optional[int] = None) -> str:
        """A new trajectory; returns its OpenAI base URL (`.../trajectories/<id>/v1`; an
        Anthropic client takes it without the `/v1`). With `seed`, call k of the trajectory samples
        with the agent loop's seed of turn k: a rollout repeats whichever engine serves it.
        Its calls take the gateway's key or its own (`key_of`), which no other path accepts."""
        tid = uuid.uuid4().hex
        self._open[tid] = TrajectoryRecorder(
            traj_id, self.tokenizer, self.eos_token_ids, self.settings.append_eos, seed
        )
        self._keys[tid] = secrets.token_urlsafe(24)
        return f"{self.url}/trajectories/{tid}/v1"

    def key_of(self, base_url: str) -> str:
        """The trajectory's own API key: valid for its URL only, and only while it is open."""
        return self._keys[_tid_of(base_url)]

    def recorder(self, base_url: str) -> TrajectoryRecorder:
        return self._open[_tid_of(base_url)]

    def finish(
        self,
        base_url: str,
        reward: float,
        turn_rewards: Optional[Sequence[float]] = None,
        invalid: Optional[str] = None,
    ) -> list[Step]:
        """The trajectory's steps; its URL answers 404 from now on."""
        recorder = self._open.pop(_tid_of(base_url))
        self._keys.pop(_tid_of(base_url), None)
        return recorder.finish(reward, turn_rewards, invalid)

    # ---- routes -----------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, "openai", openai_api.chat_call)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, "anthropic", anthropic_api.messages_call)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
            self._recorder(request)
        except GatewayError as e:
            return error_response(e, "openai")
        return web.json_response(openai_api.models_answer(self.settings.model_name))

    async def _call(self, request: web.Request, api: str, parse) -> web.StreamResponse:
        try:
            self._authorize(request)
            rec = self._recorder(request)
            raw, body = await self._body(request)
            call = parse(body)
            answer = await self._once(request, rec, raw, lambda: self._chat_answer(rec, call, api))
        except GatewayError as e:
            self.counts["refused"] += 1
            return error_response(e, api)
        if api == "anthropic":
            if call.stream:
                events = (
                    f"event: {k}\ndata: {json.dumps(v)}\n\n" for k, v in anthropic_api.messages_events(call, answer)
                )
                return await _sse(request, events)
            return web.json_response(anthropic_api.messages_answer(call, answer))
        if call.stream:
            return await _sse(request, _data_lines(openai_api.chat_events(call, answer)))
        return web.json_response(openai_api.chat_answer(call, answer))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            self._authorize(request)
            rec = self._recorder(request)
            raw, body = await self._body(request)
            prompt = openai_api.completion_prompt(body)
            call = Call(
                messages=[],
                max_tokens=max_tokens_of(body, "max_tokens"),
                stop=stop_of(body.get("stop")),
                stream=flag(body, "stream"),
                logprobs=body.get("logprobs") not in (None, False, 0),
                model=str(body.get("model") or "policy"),
                sampling=sampling_of(body),
            )
            answer = await self._once(request, rec, raw, lambda: self._completion_answer(rec, call, prompt))
        except GatewayError as e:
            self.counts["refused"] += 1
            return error_response(e, "openai")
        if call.stream:
            return await _sse(request, _data_lines(openai_api.completion_events(call.model, answer, call.logprobs)))
        return web.json_response(openai_api.completion_answer(call.model, answer, call.logprobs))

    # ---- one call ---------------------------------------------------------------------------

    async def _once(self, request: web.Request, rec: TrajectoryRecorder, raw: bytes, compute) -> Answer:
        """`compute()`, or the answer already given (or being given) to this request's retry."""
        idem = request.headers.get("Idempotency-Key")
        by_body = "body:" + hashlib.sha256(raw).hexdigest()
        keys = [f"idem:{idem}", by_body] if idem else [by_body]
        sdk_retry = request.headers.get("x-stainless-retry-count", "0") not in ("", "0")
        asked = keys[0] if idem else (by_body if sdk_retry else None)
        if asked in rec.answers:
            self.counts["retries_answered"] += 1
            return await asyncio.shield(rec.answers[asked])
        future = asyncio.get_running_loop().create_future()
        rec.answers.update(dict.fromkeys(keys, future))
        try:
            answer = await compute()
        except BaseException as e:
            for k in keys:
                rec.answers.pop(k, None)
            future.set_exception(e)
            future.exception()  # retrieved: a retry may never come
            raise
        future.set_result(answer)
        return answer

    async def _chat_answer(self, rec: TrajectoryRecorder, call: Call, api: str) -> Answer:
        async with rec.lock:
            self._check_open(rec)
            try:
                prompt = rec.prompt_for(call.messages, call.tools)
            except ChatTemplateError as e:
                raise bad("messages", str(e)) from None
            result, text = await self._generate(rec, call, prompt)
            self._check_open(rec, counted=False)  # the agent's run may have ended meanwhile
            parsed = parse_tool_calls(text, call.tools) if call.tools and call.parse_tools else None
            reply = reply_message(parsed, text) if parsed is not None else {"role": "assistant", "content": text}
            rec.record(prompt, result, call.messages, call.tools, reply, text, api)
            n = len(rec.steps)
            calls = [(f"call_{uuid.uuid4().hex[:12]}", c.name, c.arguments) for c in (parsed.calls if parsed else [])]
            return self._answer(call, prompt, result, reply["content"], calls, n)

    async def _completion_answer(self, rec: TrajectoryRecorder, call: Call, prompt_in: Any) -> Answer:
        async with rec.lock:
            self._check_open(rec)
            ids = list(prompt_in) if isinstance(prompt_in, list) else encode(self.tokenizer, prompt_in)
            prompt = rec.raw_prompt(ids)
            result, text = await self._generate(rec, call, prompt)
            self._check_open(rec, counted=False)
            rec.record(prompt, result, [], None, {"role": "completion", "content": text}, text, "openai")
            return self._answer(call, prompt, result, text, [], len(rec.steps))

    async def _generate(self, rec: TrajectoryRecorder, call: Call, prompt: Prompt):
        s, cap = self.settings, self.settings.agent
        n = len(prompt.ids)
        if n > s.max_input_length:
            raise bad(
                "messages",
                f"the prompt is {n} tokens, over the context of {s.max_input_length} (rollout.max_input_length)",
                "context_length_exceeded",
            )
        if rec.tokens + n > cap.agent_max_tokens:
            raise bad(
                "messages", f"the trajectory would use more than env.agent_max_tokens={cap.agent_max_tokens} tokens"
            )
        sampling = self._sampling(call, n)
        if rec.seed is not None:
            sampling.__dict__["sampling_seed"] = turn_seed(rec.seed, rec.traj_id, len(rec.steps))
        self.counts["calls"] += 1
        self.counts["prefix_breaks"] += prompt.prefix_break
        tid = f"gw-{rec.traj_id}-{id(rec):x}"
        try:
            result = await generate_continued(self.generator, prompt.ids, sampling, f"{tid}/call{len(rec.steps)}", tid)
        except EngineError as e:
            raise GatewayError(503, f"the engine failed this call: {e}") from None
        text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        if isinstance(result.matched, str) and text.endswith(result.matched):
            text = text[: -len(result.matched)]  # OpenAI's stop: the sequence is not returned
        return result, text

    def _sampling(self, call: Call, prompt_len: int) -> SamplingParams:
        """The trainer's sampling, with the client's length and stop strings (which do not change
        a token's log-prob); a client temperature/top_p/top_k is ignored (counted) or refused."""
        s = self.settings
        base = s.sampling
        for name, value in call.sampling.items():
            if value != getattr(base, name):
                if s.agent.client_sampling == "refuse":
                    raise bad(
                        name, f"is set by the trainer (rollout.sampling.{name}={getattr(base, name)}), got {value!r}"
                    )
                self.counts["ignored_sampling"] += 1
                log.warning(
                    "gateway: ignoring the client's %s=%r (rollout.sampling.%s=%r)",
                    name,
                    value,
                    name,
                    getattr(base, name),
                )
        room = base.max_new_tokens if call.max_tokens is None else min(call.max_tokens, base.max_new_tokens)
        if s.max_model_length is not None:
            room = min(room, s.max_model_length - prompt_len)
        if room < 1:
            raise bad(
                "messages", "the prompt leaves no room to generate in the model's context", "context_length_exceeded"
            )
        # a copy of the validated params with values checked here (as the agent loop does per turn)
        params = copy.copy(base)
        params.__dict__.update(max_new_tokens=room, stop=list(base.stop) + call.stop)
        return params

    def _answer(self, call: Call, prompt: Prompt, result, text: str, calls: list, n: int) -> Answer:
        texts = [self.tokenizer.decode([t]) for t in result.output_ids] if call.logprobs else []
        finish = "tool_calls" if calls else ("length" if result.finish_reason == "length" else "stop")
        return Answer(
            id=f"gw-{uuid.uuid4().hex[:16]}",
            created=int(time.time()),
            text=text,
            calls=calls,
            finish=finish,
            prompt_tokens=len(prompt.ids),
            completion_tokens=len(result.output_ids),
            token_texts=texts,
            logprobs=list(result.logprobs),
        )

    # ---- checks -----------------------------------------------------------------------------

    def _authorize(self, request: web.Request) -> None:
        key = request.headers.get("x-api-key")
        headers = [request.headers.get("Authorization")] + ([f"Bearer {key}"] if key is not None else [])
        own = self._keys.get(request.match_info["tid"])  # a trajectory's own key opens its path only
        keys = [self.api_key] + ([own] if own else [])
        if not any(bearer_matches(h, k) for h in headers for k in keys):
            raise GatewayError(401, "missing or wrong API key (Authorization: Bearer <key>, or x-api-key)")

    def _recorder(self, request: web.Request) -> TrajectoryRecorder:
        rec = self._open.get(request.match_info["tid"])
        if rec is None:
            raise GatewayError(404, "unknown or finished trajectory (its agent run has ended)", "trajectory")
        return rec

    def _check_open(self, rec: TrajectoryRecorder, counted: bool = True) -> None:
        if rec.finished:
            raise GatewayError(404, "the trajectory has finished", "trajectory")
        if counted and len(rec.steps) >= self.settings.agent.agent_max_calls:
            raise bad(
                "messages", f"the trajectory made env.agent_max_calls={self.settings.agent.agent_max_calls} calls"
            )

    async def _body(self, request: web.Request) -> tuple[bytes, dict]:
        limit = self.settings.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise GatewayError(413, f"request body of {request.content_length} bytes is over the limit of {limit}")
        raw = bytearray()
        async for chunk in request.content.iter_chunked(1 << 16):
            raw += chunk
            if len(raw) > limit:
                raise GatewayError(413, f"request body is over the limit of {limit} bytes")
        try:
            body = json.loads(bytes(raw))
        except (ValueError, UnicodeDecodeError) as e:
            raise GatewayError(400, f"malformed JSON body: {e}", "body") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object", "body")
        return bytes(raw), body


def _tid_of(base_url: str) -> str:
    return base_url.rstrip("/").split("/trajectories/", 1)[1].split("/", 1)[0]


def _data_lines(chunks) -> Any:
    for c in chunks:
        yield "data: [DONE]\n\n" if c is None else f"data: {json.dumps(c)}\n\n"


async def _sse(request: web.Request, lines) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for line in lines:
        await response.write(line.encode())
    await response.write_eof()
    return response


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
