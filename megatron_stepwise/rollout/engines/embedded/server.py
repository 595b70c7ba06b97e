"""HTTP server for the embedded engine with SGLang's native endpoints and payloads.

The same `SGLangClient` drives this server and a real SGLang server, so the HTTP path of the
rollout stack is exercised for real on machines without a GPU. Endpoints (SGLang 0.5.x names):
/generate, /health, /health_generate, /get_model_info, /model_info, /flush_cache,
/update_weights_from_disk, /update_weights_from_tensor, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group, /update_weight_version,
/pause_generation, /continue_generation, /abort_request, /release_memory_occupation,
/resume_memory_occupation (colocated mode; a request the released engine cannot serve is
answered 400 naming why, where SGLang would fail or hang); and two of its own: /verify_weights
(the trainer's record of a push against the weights held, docs/weights.md) and
/weights_manifest (every weight's sha256 by HF name). One field of its own on the three update
endpoints: `sample_weights: true` answers the update with the engine's samples of what it loaded
(the sampled sync check, in the same request).

Limits: a request body over `max_request_bytes` is refused with 413 before it is read (default
`default_max_request_bytes`: sized from the context window; `/update_weights_from_tensor` has its
own limit, sized from the model's weights). A `/generate` whose client disconnects is cancelled
(the engine counts it in `scheduler.cancelled_requests`); other endpoints run to their end (a
weight load is never left half done). `/health` answers 200 while the engine lives, with its load
as JSON (`status` "ok" or "overloaded", queue depth, queued prompt tokens): the fleet's router
treats a non-200 as a dead engine and restarts it, which a busy one is not. `/health_generate`
is the readiness check: 503 with `Retry-After` while overloaded. `/generate` is admitted by a
budget of tokens in flight, shared fairly between clients (`admission.py`): past it, 503 with
`Retry-After`.

Prompt log-probs (`logprob_start_len` >= 0, SGLang's way to score given tokens: a teacher's
log-probs for distillation) are answered as SGLang does (`prompt_logprobs.py`), for a prompt-only
request (`max_new_tokens` 0).

Deviation: `/update_weights_from_tensor` takes each entry of `serialized_named_tensors` as
base64 of a safetensors blob (`load_format="safetensors"`), not SGLang's pickled CUDA-IPC
handles, which only work between processes sharing a GPU and should never be unpickled from a
socket.

    megatron-stepwise serve --model-config tiny_word --host 127.0.0.1 --port 30000
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any, Optional

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from megatron_stepwise import weight_checks
from megatron_stepwise.errors import UserError
from megatron_stepwise.rollout.engines.auth import (
    API_KEY_ENV,
    bearer_matches,
    is_loopback,
    redact_bearer_tokens,
)
from megatron_stepwise.rollout.engines.embedded import prompt_logprobs as P
from megatron_stepwise.rollout.engines.embedded import request_fields as F
from megatron_stepwise.rollout.engines.embedded.admission import Admission, Overloaded
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.generate_fields import check_generate_fields
from megatron_stepwise.rollout.engines.embedded.generate_response import generate_response
from megatron_stepwise.rollout.engines.protocol import EngineReleasedError, SamplingParams

log = logging.getLogger(__name__)

ENGINE_TAG = "megatron_stepwise.local"
BYTES_PER_TOKEN = 32  # a token in a JSON body: an id and its separator, or its text (escaped), generously
# Routes of our own, not SGLang's (every other route is SGLang's, with its method and fields):
# the per-sync weight check and the full manifest (docs/weights.md, 'Every sync verified').
OWN_ROUTES = {("POST", "/verify_weights"), ("GET", "/weights_manifest")}
SMALL_BODY = 1 << 20  # sampling parameters, rids, weight names: what a body holds besides its prompts


def default_max_request_bytes(engine: LocalEngine) -> int:
    """The body limit of every endpoint but the weight upload: `max_batch_size` prompts filling
    the context window (`max_position_embeddings`, at most 1M tokens counted) + 1 MiB."""
    context = min(engine.max_positions, 1 << 20)
    return SMALL_BODY + BYTES_PER_TOKEN * context * engine.scheduler.max_batch_size


def default_max_tokens_in_flight(engine: LocalEngine) -> int:
    """Admission's default budget: two full batches of requests of up to 2048 tokens (prompt +
    max_new_tokens), i.e. the running batch and one more waiting to join it."""
    return 2 * engine.scheduler.max_batch_size * min(engine.max_positions, 2048)


def weight_upload_bytes(engine: LocalEngine) -> int:
    """The body limit of /update_weights_from_tensor: every parameter in fp32 as base64 (4/3), twice
    over for safetensors headers and a trainer sending more than one dtype, + 16 MiB."""
    params = sum(p.numel() for p in engine.model.parameters())
    return 2 * (4 * params * 4 // 3) + (16 << 20)


def updated(answer: Any, **fields: Any) -> web.Response:
    """The answer to a weight update: SGLang's {"success", "message"}, and with `sample_weights`
    (our own field) also the engine's name, its weight version and its samples of what it loaded
    (`weight_checks.to_wire`), so the trainer checks the update without another request."""
    if not isinstance(answer, dict):
        return web.json_response({"success": True, "message": f"weight version {answer}", **fields})
    body = {"success": True, "message": f"weight version {answer['weight_version']}", **fields, **answer}
    body["samples"] = weight_checks.to_wire(answer["samples"])
    return web.json_response(body)


class BodyTooLarge(UserError):
    """A request body over its endpoint's limit (answered 413)."""


BadRequest = F.BadRequest


class _Handler(RequestHandler):
    """aiohttp answers a request it cannot parse with 400 and the parser's message, which quotes
    the offending header line (an `Authorization: Bearer <key>` included) back to the sender and
    to anything logging responses on the way: the answer here names the fault, never the bytes."""

    def handle_error(self, request, status=500, exc=None, message=None):
        if status == 400:
            message = "malformed HTTP request (its request line or a header could not be parsed)"
        return super().handle_error(request, status, exc, message)


class _Server(Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same object, its connections handled by _Handler
        return server


class _QuietGrpcProbe(logging.Filter):
    """sglang-router probes each worker for gRPC (an HTTP/2 preface): aiohttp answers 400, as it
    should, but would also log a traceback per probe."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


class EngineServer:
    """aiohttp handlers around one `LocalEngine`."""

    def __init__(
        self,
        engine: LocalEngine,
        api_key: Optional[str] = None,
        max_request_bytes: Optional[int] = None,
        max_tokens_in_flight: Optional[int] = None,
    ):
        if max_request_bytes is not None and max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        # None: the default budget; 0: every request admitted (the engine's queue is the only limit)
        budget = default_max_tokens_in_flight(engine) if max_tokens_in_flight is None else max_tokens_in_flight
        self.admission = Admission(budget) if budget else None
        self.engine = engine
        self.api_key = api_key
        self.configured_limit = max_request_bytes is not None
        self.max_request_bytes = default_max_request_bytes(engine) if max_request_bytes is None else max_request_bytes
        self.weight_upload_bytes = weight_upload_bytes(engine)
        self._rid = 0

    def app(self) -> web.Application:
        # aiohttp's own limit only backs ours up (`_body` reads each endpoint's limit)
        limit = max(self.max_request_bytes, self.weight_upload_bytes)
        app = web.Application(middlewares=[self._auth, self._errors, self._uncancelled], client_max_size=limit)
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/verify_weights", self.verify_weights)
        r.add_get("/weights_manifest", self.weights_manifest)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        for method in ("GET", "POST"):  # as SGLang's api_route(methods=["GET", "POST"])
            r.add_route(method, "/release_memory_occupation", self.release_memory_occupation)
            r.add_route(method, "/resume_memory_occupation", self.resume_memory_occupation)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        # As SGLang with --api-key: every endpoint but health checks needs the key.
        if (
            self.api_key
            and not request.path.startswith("/health")
            and not bearer_matches(request.headers.get("Authorization"), self.api_key)
        ):
            return web.json_response(
                {"error": {"message": "missing or wrong API key (Authorization: Bearer ...)"}}, status=401
            )
        return await handler(request)

    @web.middleware
    async def _uncancelled(self, request: web.Request, handler):
        # The server cancels a handler whose client disconnected: wanted for /generate (nobody
        # reads the answer), never for a weight load or an abort, which must finish what they began.
        if request.path == "/generate":
            return await handler(request)
        return await asyncio.shield(handler(request))

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except BodyTooLarge as e:
            return web.json_response({"error": {"message": str(e)}}, status=413)
        except Overloaded as e:
            headers = {"Retry-After": str(e.retry_after)}
            return web.json_response({"error": {"message": str(e)}}, status=503, headers=headers)
        except (BadRequest, ValueError, KeyError, TypeError, FileNotFoundError, EngineReleasedError) as e:
            msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            if request.path.startswith(("/update_weights", "/init_weights", "/destroy_weights")):
                return web.json_response({"success": False, "message": msg}, status=400)
            return web.json_response({"error": {"message": msg}}, status=400)

    async def _body(self, request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        weights = request.path in ("/update_weights_from_tensor", "/verify_weights")  # sized from the model
        limit = self.weight_upload_bytes if weights else self.max_request_bytes
        size = request.content_length
        if size is not None and size > limit:
            raise BodyTooLarge(self._too_large(request.path, f"{size} bytes", limit, weights))
        data, size = bytearray(), 0
        async for chunk in request.content.iter_chunked(1 << 16):  # (no Content-Length: count as it comes)
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(self._too_large(request.path, f"more than {limit} bytes", limit, weights))
            data += chunk
        return F.parse_body(bytes(data))

    def _too_large(self, path: str, size: str, limit: int, weights: bool) -> str:
        if weights:
            why = "sized from the model's weights"
        elif self.configured_limit:
            why = "set by max_request_bytes"
        else:
            why = f"sized from the context window of {self.engine.max_positions} tokens"
        return (
            f"{path}: request body of {size} is over the limit of {limit} bytes ({why}; "
            f"`megatron-stepwise serve --max-request-bytes N` sets it)"
        )

    async def generate(self, request: web.Request) -> web.Response:
        where = "/generate"
        body = await self._body(request)
        check_generate_fields(body)  # SGLang's fields: honoured, ignored, or refused by name
        if F.flag(body, "stream", where):
            raise BadRequest("/generate: stream=true is not supported by the embedded engine")
        routed = F.flag(body, "return_routed_experts", where)
        if F.integer(body, "routed_experts_start_len", where, 0) != 0:
            raise BadRequest("/generate: only routed_experts_start_len=0 (every position) is supported")
        if routed and not getattr(self.engine, "_return_routed", False):
            raise BadRequest("/generate: return_routed_experts needs a MoE model (this engine records no routing)")
        text_in_logprobs = F.flag(body, "return_text_in_logprobs", where)
        input_ids = body.get("input_ids")
        if input_ids is None and body.get("text") is not None:
            input_ids = self._encode(body["text"])
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("/generate: 'input_ids' must be a non-empty list of token ids (or a list of them)")
        batched = isinstance(input_ids[0], list)
        prompts = (
            [F.token_ids(p, where, f"input_ids[{i}]") for i, p in enumerate(input_ids)]
            if batched
            else [F.token_ids(input_ids, where)]
        )
        n = len(prompts)
        sps = F.one_or_each(
            body.get("sampling_params"),
            n,
            lambda v: v is None or isinstance(v, dict),
            "a JSON object",
            where,
            "sampling_params",
        )
        lp = body.get("return_logprob")
        lps = F.one_or_each(
            False if lp is None else lp, n, lambda v: isinstance(v, bool), "true or false", where, "return_logprob"
        )
        rids = body.get("rid")
        if rids is None:
            rids = [self._new_rid() for _ in range(n)]
        elif isinstance(rids, str):
            rids = [rids] if n == 1 else [f"{rids}-{i}" for i in range(n)]
        else:
            rids = F.one_or_each(rids, n, lambda v: isinstance(v, str), "a string", where, "rid")
        try:
            params = [SamplingParams.from_dict(s) for s in sps]
        except TypeError as e:
            raise BadRequest(f"sampling_params: {e}") from None
        starts = P.logprob_starts(body, prompts, lps, params, routed, where)
        results = await self._admitted(request, prompts, params, rids, starts)
        token_text = None
        if text_in_logprobs and self.engine.tokenizer is not None:
            token_text = lambda t: self.engine.tokenizer.decode([t])  # noqa: E731
        vocab = int(self.engine.config.vocab_size)
        inputs = [P.input_token_logprobs(p, k, v, vocab, token_text) for p, k, (_, v) in zip(prompts, starts, results)]
        out = [
            generate_response(r, len(p), res, flag, routed, token_text, entries)
            for r, p, (res, _), flag, entries in zip(rids, prompts, results, lps, inputs)
        ]
        return web.json_response(out if batched else out[0])

    async def _admitted(self, request: web.Request, prompts: list, params: list, rids: list, starts: list) -> list:
        """`_one` per prompt once admitted (raises Overloaded: 503); the tokens count until every prompt ends."""
        runs = (self._one(p, s, r, k) for p, s, r, k in zip(prompts, params, rids, starts))
        if self.admission is None:
            return await asyncio.gather(*runs)
        client = request.headers.get("X-Client-Id") or request.remote or "unknown"
        cost = sum(len(p) + s.max_new_tokens for p, s in zip(prompts, params))
        self.admission.admit(client, cost)
        try:
            return await asyncio.gather(*runs)
        finally:
            self.admission.release(client, cost)

    async def _one(self, prompt: list, sampling: SamplingParams, rid: str, start: int) -> tuple:
        """(result, prompt log-prob values) of one prompt: its generation, or with a logprob_start_len
        >= 0 (a prompt-only request) its prompt log-probs (`prompt_logprobs.py`)."""
        if start < 0:
            return await self.engine.generate(prompt, sampling, rid=rid), []
        values = await P.input_logprobs(self.engine, prompt, start)
        return P.prompt_only_result(self.engine), values

    def _encode(self, texts: Any) -> list:
        """`text` (one string, or a batch of them) as token ids."""
        if self.engine.tokenizer is None:
            raise BadRequest("/generate: 'text' needs a server started with --tokenizer; send input_ids")
        batch = isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)
        if not (isinstance(texts, str) or batch):
            raise BadRequest(f"/generate: text must be a string or a non-empty list of strings, got {texts!r}"[:500])
        encode = lambda t: self.engine.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
        return [encode(t) for t in texts] if isinstance(texts, list) else encode(texts)

    def _new_rid(self) -> str:
        self._rid += 1
        return f"req-{self._rid}"

    async def health(self, request: web.Request) -> web.Response:
        """/health: liveness (200 unless the engine failed) with the load as JSON; /health_generate:
        readiness (503 with Retry-After while overloaded)."""
        if not await self.engine.health():
            return web.json_response({"status": "unhealthy"}, status=503)
        load = self.engine.scheduler_stats()
        body = {"status": "overloaded" if load["overloaded"] else "ok", **load}
        if self.admission is not None:
            body["admission"] = self.admission.stats()
        if load["overloaded"] and request.path == "/health_generate":
            return web.json_response(body, status=503, headers={"Retry-After": "1"})
        return web.json_response(body)

    async def model_info(self, request: web.Request) -> web.Response:
        info = self.engine.model_info()
        info["engine"] = ENGINE_TAG
        return web.json_response(info)

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self.engine.flush_cache()
        return web.Response(text="Cache flushed.\n")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        where = "/update_weights_from_disk"
        body = await self._body(request)
        path = F.text(body, "model_path", where)
        version = F.version(body.get("weight_version"), where)
        sample = F.flag(body, "sample_weights", where)
        if F.flag(body, "abort_all_requests", where):
            await self.engine.abort()
        answer = await self.engine.update_weights_from_disk(path, version, sample_weights=sample)
        return updated(answer, num_paused_requests=0)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        from safetensors.torch import load as load_safetensors

        where = "/update_weights_from_tensor"
        body = await self._body(request)
        if body.get("load_format") != "safetensors":
            raise BadRequest(
                "/update_weights_from_tensor: the embedded engine takes load_format='safetensors' "
                "(base64 safetensors blobs in serialized_named_tensors)"
            )
        blobs = body.get("serialized_named_tensors")
        if not isinstance(blobs, list) or not blobs or not all(isinstance(b, str) for b in blobs):
            raise BadRequest(f"{where}: serialized_named_tensors must be a non-empty list of base64 strings")
        version = F.version(body.get("weight_version"), where)
        abort = F.flag(body, "abort_all_requests", where)
        sample = F.flag(body, "sample_weights", where)
        # One entry per tensor-parallel rank in SGLang; this engine has one rank: all are equal.
        try:
            raw = base64.b64decode(blobs[0], validate=True)
        except ValueError as e:
            raise BadRequest(f"{where}: serialized_named_tensors[0] is not base64 ({e})") from None
        try:
            tensors = load_safetensors(raw)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError on bad bytes
            raise BadRequest(f"{where}: serialized_named_tensors[0] is not a safetensors blob ({e})") from None
        if abort:
            await self.engine.abort()
        return updated(await self.engine.update_weights_from_tensors(tensors, version, sample_weights=sample))

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        where = "/init_weights_update_group"
        body = await self._body(request)
        address = F.text(body, "master_address", where)
        port, rank_offset, world_size = (
            F.integer(body, k, where) for k in ("master_port", "rank_offset", "world_size")
        )
        if not 0 < port < 65536 or not 0 <= rank_offset < world_size:
            raise BadRequest(
                f"{where}: need 0 < master_port < 65536 and 0 <= rank_offset < world_size, got "
                f"master_port={port}, rank_offset={rank_offset}, world_size={world_size}"
            )
        await self.engine.init_weights_update_group(
            address,
            port,
            rank_offset,
            world_size,
            F.text(body, "group_name", where, "weight_update_group"),
            F.text(body, "backend", where, "gloo"),
        )
        return web.json_response({"success": True, "message": "joined"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        where = "/update_weights_from_distributed"
        body = await self._body(request)
        missing = [k for k in ("names", "dtypes", "shapes") if k not in body]
        if missing:
            raise BadRequest(f"{where}: missing field(s) {missing}")
        names, dtypes = F.text_list(body, "names", where), F.text_list(body, "dtypes", where)
        shapes = body["shapes"]
        if not isinstance(shapes, list) or not all(
            isinstance(s, list) and all(F.is_int(d) and d >= 0 for d in s) for s in shapes
        ):
            raise BadRequest(f"{where}: shapes must be a list of lists of integers >= 0, got {shapes!r}"[:500])
        group = F.text(body, "group_name", where, "weight_update_group")
        version = F.version(body.get("weight_version"), where)
        sample = F.flag(body, "sample_weights", where)
        if F.flag(body, "abort_all_requests", where):
            await self.engine.abort()
        answer = await self.engine.update_weights_from_distributed(
            names, dtypes, shapes, group, version, sample_weights=sample
        )
        return updated(answer)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        await self.engine.destroy_weights_update_group(
            F.text(body, "group_name", "/destroy_weights_update_group", "weight_update_group")
        )
        return web.json_response({"success": True, "message": "destroyed"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        where = "/update_weight_version"
        body = await self._body(request)
        if body.get("new_version") is None:
            raise BadRequest(f"{where}: new_version is required")
        version = F.version(body["new_version"], where, "new_version")
        if F.flag(body, "abort_all_requests", where, default=True):
            await self.engine.abort()
        await self.engine.set_weight_version(version)
        return web.json_response({"success": True})

    async def verify_weights(self, request: web.Request) -> web.Response:
        """The trainer's record of a push (`weight_checks.to_wire`) against the weights held now."""
        where = "/verify_weights"
        body = await self._body(request)
        version = F.version(body.get("weight_version"), where)
        checks = body.get("checks")
        if version is None or not isinstance(checks, dict):
            raise BadRequest(f"{where}: weight_version (an integer) and checks (an object) are required")
        try:
            parsed = weight_checks.from_wire(checks)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"{where}: {e}") from None
        return web.json_response(await self.engine.verify_weights(parsed, version))

    async def weights_manifest(self, request: web.Request) -> web.Response:
        """sha256, shape and dtype of every weight held now, by HF name (a full check on demand)."""
        return web.json_response(await self.engine.weights_manifest())

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        mode = F.text(body, "mode", "/pause_generation", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"/pause_generation: unknown mode {mode!r}")
        await self.engine.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        await self.engine.release_memory_occupation(self._tags(await self._body(request)))
        return web.json_response(None)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        await self.engine.resume_memory_occupation(self._tags(await self._body(request)))
        return web.json_response(None)

    @staticmethod
    def _tags(body: dict) -> Optional[list[str]]:
        tags = body.get("tags")
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            raise BadRequest(f"'tags' must be a list of strings, got {tags!r}")
        return tags

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        abort_all = F.flag(body, "abort_all", "/abort_request")
        rid = F.text(body, "rid", "/abort_request", None)
        await self.engine.abort(None if abort_all else rid)
        return web.Response(status=200)


async def start_server(
    engine: LocalEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    api_key: Optional[str] = None,
    allow_unauthenticated: bool = False,
    max_request_bytes: Optional[int] = None,
    max_tokens_in_flight: Optional[int] = None,
) -> tuple[web.AppRunner, int]:
    """Start serving in the running event loop; returns (runner, bound port). `port=0` picks one.

    Anything that can reach the port can replace the weights or abort requests: beyond loopback a
    server needs an `api_key` unless `allow_unauthenticated` (a network you trust).
    `max_request_bytes`: the body limit (None: `default_max_request_bytes`); `max_tokens_in_flight`:
    admission's budget (None: `default_max_tokens_in_flight`, 0: none)."""
    if not is_loopback(host) and not api_key and not allow_unauthenticated:
        raise ValueError(
            f"serving on {host} (beyond loopback) needs an API key: set {API_KEY_ENV}, or pass "
            "--allow-unauthenticated on a network you trust"
        )
    redact_bearer_tokens()  # aiohttp logs an unparsable request with its header line
    logging.getLogger("aiohttp.server").addFilter(_QuietGrpcProbe())
    server = EngineServer(engine, api_key, max_request_bytes, max_tokens_in_flight)
    # handler_cancellation: a /generate whose client disconnected is cancelled, with its generation
    runner = _Runner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    return runner, bound
