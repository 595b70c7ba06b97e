"""SGLang: an async HTTP client for its native API, and a server launcher.

`SGLangClient` implements the `Engine` protocol over SGLang's native endpoints (checked against
the pinned sglang wheel by tests/integration/test_sglang_contract.py). It drives a real SGLang server, an
`sglang_router` (generation only: send weight updates to the workers), or the embedded
engine's server (`megatron-stepwise serve`), which speaks the same API.

`launch_sglang_server` starts `python -m sglang.launch_server` on loopback (for a Ray actor on
the GPU node) and waits for /health.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import aiohttp

from megatron_stepwise.rollout.engines.auth import api_key_from_env, auth_headers
from megatron_stepwise.rollout.engines.protocol import (
    EngineError,
    GenerateResult,
    NamedTensors,
    SamplingParams,
    checked_score_args,
    memory_tags,
)
from megatron_stepwise.weight_checks import Checks, from_wire, to_wire
from megatron_stepwise.weight_transport import dtype_name

SGLANG_VERSION = "0.5.23"  # the version the contract test checks (and the `sglang` extra pins)


class EngineRequestError(EngineError):
    """The engine refused the request itself (HTTP 4xx): retrying elsewhere will not help."""


def _retry_after(resp: aiohttp.ClientResponse) -> Optional[float]:
    """The seconds of a 503's `Retry-After` (None: absent, or a date, which no server of ours sends)."""
    try:
        return max(0.0, float(resp.headers["Retry-After"]))
    except (KeyError, ValueError):
        return None


def _version_int(value: Any) -> int:
    """SGLang reports weight versions as strings ("default" before any update)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def parse_generate_response(data: dict, routed_experts: Optional[tuple[int, int]] = None) -> GenerateResult:
    """Tokens and log-probs from `meta_info.output_token_logprobs` ([logprob, token_id, text]);
    with `routed_experts` = (num_hidden_layers, topk), the experts of `meta_info.routed_experts`
    (base64 int32, [positions, layers, topk], as SGLang sends them for `return_routed_experts`)."""
    meta = data.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise EngineError("response has no meta_info.output_token_logprobs (was return_logprob sent?)")
    output_ids = [int(e[1]) for e in entries]
    logprobs = [float(e[0]) for e in entries]
    if data.get("output_ids") is not None and list(data["output_ids"]) != output_ids:
        raise EngineError("output_ids and meta_info.output_token_logprobs disagree")
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    version = _version_int(meta.get("weight_version"))
    per_token = None
    spans = meta.get("weight_versions")
    if spans:
        per_token = [version] * len(output_ids)
        for span in spans:
            for i in range(int(span["start"]), min(int(span["end"]), len(output_ids))):
                per_token[i] = _version_int(span["version"])
    return GenerateResult(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=kind if kind in ("stop", "length") else "abort",
        weight_version=version,
        token_weight_versions=per_token,
        matched=reason.get("matched") if isinstance(reason, dict) else None,
        text=data.get("text"),
        routed_experts=_routed_experts(meta, routed_experts),
        cached_tokens=int(meta.get("cached_tokens") or 0),
    )


def parse_input_logprobs(data: dict, input_ids: list[int], start: int) -> list[float]:
    """The log-probs of `input_ids[start:]` from the answer to a prompt-scoring request sent with
    logprob_start_len `start - 1`: `meta_info.input_token_logprobs` holds [logprob, token_id, text]
    for `input_ids[start - 1:]`, the first with no log-prob (SGLang reports none for the first token
    it covers). SGLang reports ids >= its vocab_size - 1 as 0, so a 0 passes for any id."""
    entries = (data.get("meta_info") or {}).get("input_token_logprobs")
    if entries is None:
        raise EngineError("response has no meta_info.input_token_logprobs (was return_logprob sent?)")
    want = input_ids[start - 1 :]
    if len(entries) != len(want):
        raise EngineError(
            f"{len(entries)} prompt log-probs for the {len(want)} tokens from logprob_start_len {start - 1}"
        )
    ids = [int(e[1]) for e in entries]
    if any(got not in (sent, 0) for got, sent in zip(ids, want)):
        raise EngineError(f"meta_info.input_token_logprobs ids {ids[:8]}... are not the tokens sent {want[:8]}...")
    values = [e[0] for e in entries[1:]]
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in values):
        raise EngineError("meta_info.input_token_logprobs has an entry without a log-prob past its first")
    return [float(v) for v in values]


def _routed_experts(meta: dict, shape: Optional[tuple[int, int]]):
    if shape is None:
        return None
    blob = meta.get("routed_experts")
    if blob is None:
        raise EngineError("response has no meta_info.routed_experts (start SGLang with --enable-return-routed-experts)")
    from megatron_stepwise.rollout.engines.routed_experts import decode

    try:
        return decode(blob, *shape)
    except ValueError as e:
        raise EngineError(str(e)) from None


def serialize_tensors_safetensors(named_tensors: NamedTensors) -> str:
    """base64 safetensors blob: the embedded server's `update_weights_from_tensor` payload."""
    from safetensors.torch import save

    items = dict(named_tensors.items()) if hasattr(named_tensors, "items") else dict(named_tensors)
    blob = save({k: v.detach().contiguous().cpu() for k, v in items.items()})
    return base64.b64encode(blob).decode("ascii")


def serialize_tensors_sglang(named_tensors: NamedTensors) -> str:
    """SGLang's own format (MultiprocessingSerializer): base64 of a ForkingPickler dump of
    [(name, tensor)]. For CUDA tensors this carries IPC handles, so the server must share the
    GPU (colocated training and rollout), exactly as with SGLang's own callers."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  registers the tensor reductions

    items = list(named_tensors.items()) if hasattr(named_tensors, "items") else list(named_tensors)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(items)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _tags_body(tags: Optional[list[str]]) -> dict[str, Any]:
    """Body of /release_memory_occupation and /resume_memory_occupation (`tags`: None = all)."""
    memory_tags(tags)  # an unknown tag is refused here, naming it, before anything is sent
    return {} if tags is None else {"tags": list(tags)}


@dataclass
class TensorHandles:
    """Named tensors already in SGLang's `update_weights_from_tensor` format
    (`serialize_tensors_sglang`): for CUDA tensors, IPC handles into the memory of the process
    that serialized them. Colocated on GPU, the trainer serializes its tensors once and every
    engine on its node maps them, no copy through the host; the handles are valid only while the
    trainer keeps those tensors, so until the update call returns."""

    blob: str


# Why a real SGLang server's weight syncs go unchecked: it offers no per-tensor check of HF-named
# weights (`/get_weights_by_name` returns a prefix of Llama-family tensors, a test helper;
# `/weights_checker` hashes its own fused, sharded layout), and its update endpoints carry none.
UNVERIFIED = "an SGLang server has no per-tensor check of HF-named weights"


class SGLangClient:
    """`Engine` over SGLang's native HTTP API at `base_url`.

    Args:
        base_url: e.g. "http://127.0.0.1:30000".
        timeout_s: per-request timeout (generation included).
        tp_size: tensor-parallel size of the server (update_weights_from_tensor sends one entry per rank).
        routed_experts: (num_hidden_layers, topk) of a MoE model: ask for the routed experts of every
            position (routing replay; the server needs --enable-return-routed-experts).
        generate_url: where /generate goes instead of `base_url` (an sglang-router in front of the
            servers); everything else (weights, pause, abort, health) still goes to `base_url`.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        tp_size: int = 1,
        api_key: Optional[str] = None,
        routed_experts: Optional[tuple[int, int]] = None,
        generate_url: Optional[str] = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.generate_url = (generate_url or base_url).rstrip("/")
        self.timeout_s = timeout_s
        self.tp_size = tp_size
        self.api_key = api_key or api_key_from_env()  # sent as a Bearer header (SGLang --api-key)
        self._session: Optional[aiohttp.ClientSession] = None
        self.overload_retries = 0  # /generate answers 503 + Retry-After waited out
        self._embedded: Optional[bool] = None
        self._paused = False  # between pause() and resume(): an aborted result was ended by the pause
        self._version_seen = 0  # the server's weight version as this client last read it
        self._started: dict[str, int] = {}  # rid in flight -> the version when it was sent
        self._stale: set[str] = set()  # rids `abort_stale` aborted
        # MoE routing replay: (num_hidden_layers, topk); requests ask for the routed experts
        self.routed_experts = None if routed_experts is None else (int(routed_experts[0]), int(routed_experts[1]))

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=auth_headers(self.api_key)
            )
        return self._session

    async def _request(
        self, method: str, path: str, json: Any = None, params: Any = None, base_url: Optional[str] = None
    ) -> Any:
        url = (base_url or self.base_url) + path
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            while True:
                async with self._http().request(method, url, json=json, params=params) as resp:
                    text = await resp.text()
                    wait = _retry_after(resp) if resp.status == 503 and path == "/generate" else None
                    if wait is None or loop.time() + wait >= deadline:
                        if resp.status >= 400:
                            cls = EngineRequestError if 400 <= resp.status < 500 else EngineError
                            raise cls(f"{method} {url} -> HTTP {resp.status}: {text[:500]}")
                        if resp.content_type == "application/json":
                            return await resp.json()
                        return text
                self.overload_retries += 1  # not admitted now (serve's admission): it said when to retry
                await asyncio.sleep(wait)
        except aiohttp.ClientError as e:
            raise EngineError(f"{method} {url} failed: {e!r}") from e
        except asyncio.TimeoutError as e:
            raise EngineError(f"{method} {url} timed out after {self.timeout_s}s") from e

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: Optional[str] = None, session: Optional[str] = None
    ) -> GenerateResult:
        payload: dict[str, Any] = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": sampling.to_dict(),
            "return_logprob": True,
        }
        if rid is not None:
            payload["rid"] = rid
            self._started[rid] = self._version_seen
        if self.routed_experts is not None:
            payload["return_routed_experts"] = True  # all positions: routed_experts_start_len 0
        try:
            data = await self._request("POST", "/generate", json=payload, base_url=self.generate_url)
        finally:
            if rid is not None:
                self._started.pop(rid, None)
        result = parse_generate_response(data, self.routed_experts)
        result.engine = self.generate_url
        if result.finish_reason == "abort" and (rid in self._stale or self._paused):
            result.abort_reason = "stale" if rid in self._stale else "pause"
        self._stale.discard(rid)
        return result

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """`Engine.score` as SGLang's prompt-scoring request: /generate with max_new_tokens 0 and
        logprob_start_len `start - 1` (`parse_input_logprobs`). Temperature 1 only: SGLang 0.5.23
        computes prompt log-probs from the raw logits (its InputLogprobProcessor), not divided by the
        temperature as output log-probs are. It goes to `generate_url`, as generation does."""
        ids = checked_score_args(input_ids, start, temperature)
        if temperature != 1.0:
            raise EngineRequestError(
                f"SGLang {SGLANG_VERSION} returns prompt log-probs without temperature, so a teacher served "
                f"by SGLang scores only at rollout temperature 1.0 (asked for {temperature})"
            )
        payload = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": start - 1,
        }
        data = await self._request("POST", "/generate", json=payload, base_url=self.generate_url)
        return parse_input_logprobs(data, ids, start)

    async def _is_embedded(self) -> bool:
        if self._embedded is None:
            info = await self._request("GET", "/get_model_info")
            self._embedded = isinstance(info, dict) and info.get("engine") == "megatron_stepwise.local"
        return self._embedded

    async def update_weights_from_disk(
        self, path: str, weight_version: Optional[int] = None, sample_weights: bool = False
    ) -> Union[int, dict]:
        payload: dict[str, Any] = {"model_path": str(path), "flush_cache": True}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._update("/update_weights_from_disk", payload, sample_weights)

    async def _update(self, path: str, payload: dict, sample_weights: bool) -> Union[int, dict]:
        """POST an update; the new weight version, or with `sample_weights` the update's answer
        (`Engine.update_weights_from_disk`): the embedded server samples what it loaded in the same
        request (our own field `sample_weights`); an SGLang server cannot, so it is unverified."""
        if sample_weights and await self._is_embedded():
            answer = await self._request("POST", path, json={**payload, "sample_weights": True})
            try:
                samples = Checks(from_wire(answer["samples"]))
                return {
                    "engine": str(answer["engine"]),
                    "weight_version": int(answer["weight_version"]),
                    "samples": samples,
                    "sample_s": float(answer.get("sample_s", 0.0)),
                }
            except (KeyError, TypeError, ValueError) as e:
                raise EngineError(f"POST {self.base_url}{path}: the answer carries no valid samples ({e})") from None
        await self._request("POST", path, json=payload)
        version = await self.weight_version()
        if not sample_weights:
            return version
        return {"weight_version": version, "unverified": True, "reason": UNVERIFIED}

    async def update_weights_from_tensors(
        self, named_tensors: NamedTensors, weight_version: Optional[int] = None, sample_weights: bool = False
    ) -> Union[int, dict]:
        if isinstance(named_tensors, TensorHandles):  # serialized by the trainer (colocated GPU push)
            if await self._is_embedded():
                raise EngineRequestError("the embedded engine takes tensors, not CUDA IPC handles")
            blob, load_format = named_tensors.blob, None
        elif await self._is_embedded():
            blob, load_format = serialize_tensors_safetensors(named_tensors), "safetensors"
        else:
            blob, load_format = serialize_tensors_sglang(named_tensors), None
        payload: dict[str, Any] = {"serialized_named_tensors": [blob] * self.tp_size, "flush_cache": True}
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._update("/update_weights_from_tensor", payload, sample_weights)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        await self._request(
            "POST",
            "/init_weights_update_group",
            json={
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": int(rank_offset),
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: Optional[int] = None,
        sample_weights: bool = False,
    ) -> Union[int, dict]:
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": [d if isinstance(d, str) else dtype_name(d) for d in dtypes],
            "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name,
            "flush_cache": True,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._update("/update_weights_from_distributed", payload, sample_weights)

    async def verify_weights(self, checks: Any, weight_version: int) -> Optional[dict]:
        """The embedded server compares the trainer's record of a push with what it holds
        (/verify_weights). None for a real SGLang server: it stays unverified (`UNVERIFIED`)."""
        if not await self._is_embedded():
            return None
        body = {"weight_version": int(weight_version), "checks": to_wire(checks)}
        return await self._request("POST", "/verify_weights", json=body)

    async def weights_manifest(self) -> dict:
        """Every weight's sha256 by HF name (/weights_manifest; the embedded server only)."""
        if not await self._is_embedded():
            raise EngineRequestError(f"{self.base_url}: an SGLang server lists no per-tensor weight manifest")
        return await self._request("GET", "/weights_manifest")

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._request("POST", "/destroy_weights_update_group", json={"group_name": group_name})

    async def pause(self, mode: str = "retract") -> None:
        # retract: running requests go back to the queue, keeping their output so far, and their
        # KV cache is rebuilt on /continue_generation, so after a weight update (partial rollouts,
        # async training) every later token comes from the new weights, like the embedded engine.
        # ("in_place" would continue on the old weights' cache, and /flush_cache would refuse to
        # run while they are paused.) With nothing running, both modes are the same.
        self._paused = True
        await self._request("POST", "/pause_generation", json={"mode": mode})

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", json={})
        self._paused = False

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        # Colocated mode. The server must run with --enable-memory-saver (else this frees nothing)
        # and be idle (SGLang asserts it). No tags = everything: weights, kv_cache, cuda_graph.
        await self._request("POST", "/release_memory_occupation", json=_tags_body(tags))

    async def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        # Without --enable-weights-cpu-backup resumed weights hold no values: update them next.
        await self._request("POST", "/resume_memory_occupation", json=_tags_body(tags))

    async def abort_stale(self, min_version: int) -> int:
        """Abort the requests (sent with a rid) that were sent before weight version `min_version`."""
        stale = [rid for rid, v in self._started.items() if v < int(min_version)]
        for rid in stale:
            self._stale.add(rid)
            await self.abort(rid)
        return len(stale)

    async def abort(self, rid: Optional[str] = None) -> None:
        body = {"abort_all": True} if rid is None else {"rid": rid}
        await self._request("POST", "/abort_request", json=body)

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health")
            return True
        except EngineError:
            return False

    async def weight_version(self) -> int:
        info = await self._request("GET", "/get_model_info")
        self._version_seen = _version_int(info.get("weight_version") if isinstance(info, dict) else None)
        return self._version_seen

    async def model_info(self) -> dict:
        return await self._request("GET", "/get_model_info")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# ---- launching ------------------------------------------------------------------------------


@dataclass
class SGLangServerConfig:
    """How to start one SGLang server. `extra_args` go to `sglang.launch_server` verbatim."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    mem_fraction_static: Optional[float] = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 900.0

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--tp-size",
            str(self.tp_size),
        ]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        key = api_key_from_env()
        if key and "--api-key" not in self.extra_args:
            cmd += ["--api-key", key]  # every endpoint but /health then needs it (the client sends it)
        return cmd + list(self.extra_args)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def launch_sglang_server(config: SGLangServerConfig, log_path: Optional[str] = None) -> subprocess.Popen:
    """Start the server process and block until /health answers 200 (or fail with its log tail)."""
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        config.command(),
        env={**os.environ, **config.env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_health(config.url, config.startup_timeout_s, proc)
    except BaseException:
        proc.kill()
        raise
    return proc


def wait_for_health(url: str, timeout_s: float, proc: Optional[subprocess.Popen] = None) -> None:
    """Poll `url`/health until 200; raises if `proc` exits first or the timeout passes."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise EngineError(f"server process for {url} exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1.0)
    raise EngineError(f"server at {url} not healthy after {timeout_s}s")
