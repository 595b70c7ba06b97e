"""The embedded CPU engine: a Hugging Face causal LM behind the `Engine` protocol.

Concurrent `generate` calls are batched continuously on one worker thread, so the event loop
stays responsive: between two decode steps (HF KV cache, left-padded rows) newly arrived
requests are prefilled and join the running batch, finished or cancelled ones leave it, and the
engine can be paused, aborted or have its weights replaced. A finished request's KV stays in a
prefix cache (`prefix_cache.py`): a later request sharing its prefix prefills only the rest. Requests in flight across a weight
update continue with the new weights (their KV cache rebuilt first; or on their old KV after an
`in_place` pause; an `abort` pause ends them). Every sampled token records the forward pass (and weights) whose logits gave it, every routed
position the forward that computed it; a rebuild never re-records the routes of positions whose
logits already gave a token (docs/megatron.md, 'Route provenance'). A load refuses non-finite
weights; a model-thread failure makes the engine unhealthy until the next good load.
Colocated mode follows SGLang's release / resume semantics.

The prefix cache, partial rollouts, faults and colocated mode in detail: docs/architecture.md,
'The embedded CPU engine'.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch

from megatron_stepwise import weight_checks, weight_transport
from megatron_stepwise.rollout import routing
from megatron_stepwise.rollout.embedded import hf_model
from megatron_stepwise.rollout.embedded.prefix_cache import PrefixCache
from megatron_stepwise.rollout.embedded.sampling import sample_next
from megatron_stepwise.rollout.engine import (
    EngineError,
    EngineReleasedError,
    GenerateResult,
    NamedTensors,
    SamplingParams,
    memory_tags,
)

log = logging.getLogger(__name__)

#: How paused requests continue after a weight load (SGLang's /pause_generation modes).
PAUSE_MODES = ("retract", "in_place", "abort")


@dataclass
class _Request:
    input_ids: list[int]
    sampling: SamplingParams
    rid: str
    future: asyncio.Future
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    matched: Any = None
    text_len: int = 0
    generator: Optional[torch.Generator] = None  # per-request sampler when sampling_seed is set
    decoded: int = 0  # tokens of finished decode steps, as the event loop saw them (decoded_tokens)
    # int16 [positions, layers, topk] pieces of the positions run, in order (record_routed_experts):
    # one per prefill and per decode step, concatenated once when the request finishes
    routed: Optional[list[torch.Tensor]] = None
    routed_len: int = 0
    # the id of the forward pass that computed each routed position (int64 pieces beside `routed`)
    route_forwards: Optional[list[torch.Tensor]] = None
    token_forwards: list[int] = field(default_factory=list)  # per output token: the forward its logits came from
    logits_forward: int = -1  # the forward that produced this row's next-token logits, and its weights
    logits_version: int = 0
    start_version: int = 0  # the engine's weight version when the request arrived (staleness bound)
    abort_reason: Optional[str] = None  # why it was aborted: "pause" (a weight update) or "stale"
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cancelled: bool = False  # its caller went away (set on the event loop; acted on between steps)
    left: bool = False  # reported finished by the batch (set on the model thread)
    resolved: bool = False


class _Batch:
    """The running batch: one row per request, left-padded, one token per row per `step()`.

    Rows join (`admit`: prefilled on their own, then merged in) and leave (finished, aborted or
    cancelled) between two decode steps, each with its own KV, mask and position: a short request
    arriving while a long one decodes starts at the next step instead of after the batch.

    After a weight swap in the middle of the batch, `rebuild()` runs again over each row's prompt
    plus the tokens it has generated so far: generation continues (nothing is discarded) and
    every later token is sampled from the new weights' distribution, with their exact log-prob.
    """

    def __init__(self, engine: "LocalEngine", requests: list[_Request]):
        self.engine = engine
        self.requests: list[_Request] = []
        self.weights_epoch = engine._weights_epoch  # the weights the cache was computed with
        self.fresh_kv = True  # False once continued in place across a weight load: never cached
        self.cache = self.mask = self.next_pos = self.last_logits = None
        self.admit(requests)

    def admit(self, requests: list[_Request]) -> None:
        """Prefill `requests` (prefix-cache hits reused) and add them as rows of this batch."""
        rows = self._prefill(requests, first=True)
        if self.requests:
            rows = _merge(self._rows(), rows)
        self.requests = self.requests + requests
        self.cache, self.mask, self.next_pos, self.last_logits = rows

    def rebuild(self) -> None:
        """Recompute every row's KV (prompt + tokens so far) with the weights loaded now. Routes
        are append-only: only the last position's (whose logits give the next token) is replaced."""
        self.weights_epoch = self.engine._weights_epoch
        self.cache, self.mask, self.next_pos, self.last_logits = self._prefill(self.requests, first=False)

    def continue_in_place(self) -> None:
        """Keep every row's KV as the old weights computed it (SGLang's `in_place` pause): the next
        token comes from the logits already computed, later ones from the new weights."""
        self.weights_epoch = self.engine._weights_epoch
        self.fresh_kv = False

    @property
    def mergeable(self) -> bool:
        """Rows can join: every cache layer is a plain `DynamicLayer` (a sliding window's is not)."""
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def _rows(self) -> tuple:
        return self.cache, self.mask, self.next_pos, self.last_logits

    def _prefill(self, requests: list[_Request], first: bool) -> tuple:
        """Run every row's sequence (prompt + tokens generated so far) but the prefix the prefix
        cache holds (a `first` prefill; a rebuild after a weight load computes everything): row i is [pad][cached c_i][pad][new s_i], the cached KV left-padded to the
        longest hit, the new tokens to the longest suffix, the pads masked out. Returns the rows'
        (cache, mask, next positions, last logits)."""
        eng = self.engine
        store = eng._prefix_cache if eng._prefix_cache.enabled and first else None
        seqs = [r.input_ids + r.output_ids for r in requests]
        lengths = [len(s) for s in seqs]
        # at least one token runs: its logits give the first sample
        hits = [store.lookup(s, n - 1) if store else (None, 0) for s, n in zip(seqs, lengths)]
        cached = [c for _, c in hits]
        C, S = max(cached), max(n - c for n, c in zip(lengths, cached))
        ids = torch.tensor([[eng.pad_token_id] * (S - n + c) + s[c:] for s, n, c in zip(seqs, lengths, cached)])
        mask = torch.tensor(
            [[0] * (C - c) + [1] * c + [0] * (S - n + c) + [1] * (n - c) for n, c in zip(lengths, cached)]
        )
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, C:]
        cache = self._hit_cache(hits, C) if C else None
        forward, version = eng._next_forward(), eng._weight_version
        with torch.no_grad():
            out = eng.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                **{eng.cache_name: cache},
                use_cache=True,
            )
        for r in requests:
            r.logits_forward, r.logits_version = forward, version
        if first:
            for r, n, c in zip(requests, lengths, cached):
                r.cached_tokens = c
                eng._prefix_cache.count(n, c)
        if eng._router_recorder is not None:  # each row's new positions are its last `n - c` columns
            routed = eng._router_recorder.take(ids.numel()).reshape(len(seqs), S, *eng._routed_shape)
            for r, row, n, (e, c) in zip(requests, routed, lengths, hits):
                new = row[S - n + c :].clone()
                ids_new = torch.full((n - c,), forward, dtype=torch.long)
                if first:
                    r.routed = ([e.routed[:c]] if c else []) + [new]
                    r.route_forwards = ([e.route_forwards[:c]] if c else []) + [ids_new]
                else:  # a rebuild: positions whose logits already gave a sampled token keep their routes
                    keep = min(r.routed_len, n - 1)
                    r.routed = [torch.cat(r.routed)[:keep], new[keep:]]
                    r.route_forwards = [torch.cat(r.route_forwards)[:keep], ids_new[keep:]]
                r.routed_len = n
        return getattr(out, eng.cache_name), mask, torch.tensor(lengths), out.logits[:, -1, :].float()

    def _hit_cache(self, hits: list, width: int):
        """A batch cache (`DynamicCache`) of `width` positions holding each hit's KV, right-aligned."""
        from transformers.cache_utils import DynamicCache

        layers = []
        for layer, (k0, v0) in enumerate(next(e for e, _ in hits if e is not None).kv):
            keys = k0.new_zeros(len(hits), k0.shape[0], width, k0.shape[2])
            values = torch.zeros_like(keys)
            for i, (e, c) in enumerate(hits):
                if c:
                    keys[i, :, width - c :] = e.kv[layer][0][:, :c]
                    values[i, :, width - c :] = e.kv[layer][1][:, :c]
            layers.append((keys, values))
        return DynamicCache(layers)

    def _keep(self, i: int, r: _Request) -> None:
        """Store finished row i's KV (every token it ran: prompt + output but the last) in the
        prefix cache, before the next decode step feeds it a token past its end."""
        eng = self.engine
        layers = self.cache.layers
        if not self.mergeable:  # sliding windows etc.: not cached
            log.info(
                "embedded engine %s: prefix cache off (cache layers %s)",
                eng.name,
                sorted({type(layer).__name__ for layer in layers}),
            )
            eng._prefix_cache = PrefixCache(0)
            return
        cols = self.mask[i].nonzero().squeeze(1)
        tokens = (r.input_ids + r.output_ids)[: len(cols)]
        kv = [(layer.keys[i][:, cols], layer.values[i][:, cols]) for layer in layers]  # copies
        routed = torch.cat(r.routed)[: len(cols)] if r.routed else None
        forwards = torch.cat(r.route_forwards)[: len(cols)] if r.route_forwards else None
        eng._prefix_cache.insert(tokens, kv, routed, forwards)

    def _retire(self, keep: list[int]) -> None:
        """Keep only rows `keep`; drop the columns no remaining row uses (the left padding a
        longer, finished row needed)."""
        from transformers.cache_utils import DynamicCache

        self.requests = [self.requests[i] for i in keep]
        if not keep:
            return
        index = torch.tensor(keep)
        mask = self.mask[index]
        start = int(mask.any(0).nonzero()[0])
        self.cache = DynamicCache(
            [(layer.keys[index, :, start:], layer.values[index, :, start:]) for layer in self.cache.layers]
        )
        self.mask, self.next_pos, self.last_logits = mask[:, start:], self.next_pos[index], self.last_logits[index]

    def step(self) -> list[_Request]:
        """Sample the next token of every active row, apply stop rules, retire the finished rows,
        run one decode forward over the rest. Returns the requests that finished or left."""
        eng = self.engine
        keep = []
        for i, r in enumerate(self.requests):
            if r.finish_reason is None:  # (aborted or cancelled rows just leave)
                token, lp = sample_next(self.last_logits[i], r.sampling, r.generator or eng.generator)
                r.output_ids.append(token)
                r.logprobs.append(lp)
                # the weights and forward pass that computed these logits (a row continued in
                # place samples one token from the old weights' logits)
                r.versions.append(r.logits_version)
                r.token_forwards.append(r.logits_forward)
                eng._check_finished(r)
                if r.finish_reason is not None and eng._prefix_cache.enabled and self.fresh_kv:
                    self._keep(i, r)
            if r.finish_reason is None:
                keep.append(i)
        done = [r for r in self.requests if r.finish_reason is not None and not r.left]
        for r in done:
            r.left = True
        if not keep:
            self.requests = []
            return done
        if len(keep) < len(self.requests) and self.mergeable:
            self._retire(keep)
        # (a cache that cannot be sliced keeps its finished rows, fed a pad, until the batch ends)
        feed = [r.output_ids[-1] if not r.left else eng.pad_token_id for r in self.requests]
        self.mask = torch.cat([self.mask, torch.ones(len(self.requests), 1, dtype=self.mask.dtype)], dim=1)
        forward, version = eng._next_forward(), eng._weight_version
        with torch.no_grad():
            out = eng.model(
                input_ids=torch.tensor(feed).unsqueeze(1),
                attention_mask=self.mask,
                position_ids=self.next_pos.unsqueeze(1),
                **{eng.cache_name: self.cache},
                use_cache=True,
            )
        self.next_pos = self.next_pos + 1
        self.cache = getattr(out, eng.cache_name)
        self.last_logits = out.logits[:, -1, :].float()
        for r in self.requests:
            r.logits_forward, r.logits_version = forward, version
        if eng._router_recorder is not None:  # the fed token's experts, for rows that ran a new one
            routed = eng._router_recorder.take(len(feed))
            for r, row in zip(self.requests, routed):
                if r.routed is not None and r.routed_len == len(r.input_ids) + len(r.output_ids) - 1:
                    r.routed.append(row[None])
                    r.route_forwards.append(torch.tensor([forward]))
                    r.routed_len += 1
        return done


def _merge(a: tuple, b: tuple) -> tuple:
    """Two batches' (cache, mask, next positions, last logits) as one: the narrower one's rows
    left-padded (masked) to the wider one's width, then stacked."""
    from transformers.cache_utils import DynamicCache

    width = max(a[1].shape[1], b[1].shape[1])

    def pad(x: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - x.shape[dim]
        if not missing:
            return x
        shape = list(x.shape)
        shape[dim] = missing
        return torch.cat([x.new_zeros(shape), x], dim=dim)

    layers = [
        (torch.cat([pad(la.keys, 2), pad(lb.keys, 2)]), torch.cat([pad(la.values, 2), pad(lb.values, 2)]))
        for la, lb in zip(a[0].layers, b[0].layers)
    ]
    return (
        DynamicCache(layers),
        torch.cat([pad(a[1], 1), pad(b[1], 1)]),
        torch.cat([a[2], b[2]]),
        torch.cat([a[3], b[3]]),
    )


class LocalEngine:
    """Embedded CPU engine (Qwen2/Llama family via transformers).

    Args:
        model_config: HF config (object, dict, config.json or model directory).
        weights: optional safetensors directory with HF-named weights.
        tokenizer: needed only for stop strings (and `text` in results).
        eos_token_ids: tokens that end a generation besides per-request `stop_token_ids`.
        max_batch_size: how many requests decode together (rows of the running batch).
        continuous_batching: queued requests join the running batch between two decode steps
            (False: a batch runs to its end before the next one starts; for comparisons).
        max_prefill_tokens: prompt tokens (not served by the prefix cache) prefilled between two
            decode steps, besides the oldest queued request's, which always goes: a short prompt
            passes long ones that do not fit, and decoding never stalls behind a long queue.
        overload_queued_tokens: `scheduler_stats()["overloaded"]` once more prompt tokens than
            this wait in the queue (or more than 4 x max_batch_size requests); None: 4 x
            max_prefill_tokens.
        seed: seeds both the random init and the sampler.
        torch_threads: intra-op threads for this engine (None leaves torch's setting).
        record_routed_experts: return each request's routed experts (`GenerateResult.routed_experts`,
            MoE models only: routing replay). None: on for MoE models.
        router_noise, router_noise_mode: test hook: perturb the routers slightly (`rollout.routing`).
        prefix_cache_tokens: token budget of the prefix cache (`prefix_cache.py`: finished requests'
            KV, reused by a later request sharing their prefix; 0 turns it off). Each token costs
            2 x layers x kv_heads x head_dim x 4 bytes (fp32): 46 KB for SmolLM2-135M, so the
            default 32768 tokens is about 1.5 GB there.
    """

    def __init__(
        self,
        model_config: hf_model.ModelConfigLike,
        weights: Optional[Union[str, os.PathLike]] = None,
        tokenizer: Any = None,
        eos_token_ids: Optional[list[int]] = None,
        max_batch_size: int = 16,
        seed: int = 0,
        torch_threads: Optional[int] = None,
        name: str = "local",
        record_routed_experts: Optional[bool] = None,
        router_noise: float = 0.0,
        router_noise_mode: str = "select",
        prefix_cache_tokens: int = 32768,
        continuous_batching: bool = True,
        max_prefill_tokens: int = 2048,
        overload_queued_tokens: Optional[int] = None,
    ):
        if max_batch_size < 1 or max_prefill_tokens < 1:
            raise ValueError(
                f"max_batch_size and max_prefill_tokens must be >= 1, got {max_batch_size} and {max_prefill_tokens}"
            )
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.model = hf_model.build_causal_lm(model_config, weights=weights, seed=seed)
        self.config = self.model.config
        # transformers 5 renamed the KV cache argument and output to `cache` (the old name warns every call)
        self.cache_name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self._router_recorder = None
        if record_routed_experts or (record_routed_experts is None and routing.moe_gates(self.model)) or router_noise:
            self._router_recorder = routing.RouterRecorder(
                self.model, router_noise=router_noise, seed=seed, router_noise_mode=router_noise_mode
            )
            self._routed_shape = (self._router_recorder.num_layers, self._router_recorder.topk)
        self._return_routed = bool(record_routed_experts or (record_routed_experts is None and self._router_recorder))
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else self.config.eos_token_id
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_token_id = int(pad if pad is not None else 0)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.max_batch_size = max_batch_size
        self.continuous_batching = continuous_batching
        self.max_prefill_tokens = max_prefill_tokens
        self.overload_queued_tokens = (
            4 * max_prefill_tokens if overload_queued_tokens is None else overload_queued_tokens
        )
        self.joined_running_batch = 0  # requests that joined a batch already decoding
        self.cancelled_requests = 0  # requests whose caller went away before they finished
        self._batch: Optional[_Batch] = None
        self.name = name
        self.generator = torch.Generator().manual_seed(seed)
        self._prefix_cache = PrefixCache(prefix_cache_tokens)
        self._weight_version = 0
        self._weights_epoch = 0  # bumped by every weight load; in-flight batches compare it
        # Forward-pass ids: random high bits per engine, so ids from engines of one fleet differ
        # (a turn continued on another engine, a prefix computed by another request).
        self._forward_base = (int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF) << 32
        self._forwards = 0
        self._continue_mode = "retract"  # how requests paused by the last pause() continue
        self.aborted_by_pause = 0  # requests a pause ("abort" mode, or an abort while paused) ended
        self.dropped_stale = 0  # requests `abort_stale` ended
        self._pending: list[_Request] = []
        self._inflight: dict[str, _Request] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-model")
        self._loop_task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wakeup: Optional[asyncio.Event] = None
        self._running: Optional[asyncio.Event] = None
        self._model_lock: Optional[asyncio.Lock] = None
        self._failure: Optional[BaseException] = None
        self._next_rid = 0
        self._weight_groups: dict[str, Any] = {}
        self._pause_points: dict[str, int] = {}  # rid -> pause the engine once it has this many tokens
        self._released: set[str] = set()  # memory tags released (colocated mode)
        self._freed_storages: list[tuple[torch.UntypedStorage, int]] = []  # (storage, its size) while released
        self._needs_weights = False  # weights resumed without their values: a weight update must come first
        self._params_by_name: Optional[dict] = None  # for the weight checks
        self._loaded: tuple = (None, [])  # (version, [(name, tensor)] its sampled updates loaded so far)
        self._positions: Optional[weight_checks.Positions] = None  # the next version's, prepared after a load
        self._names_share_memory: dict[tuple, bool] = {}  # names of a version's updates -> `overlapping`

    def _next_forward(self) -> int:
        self._forwards += 1
        return self._forward_base + self._forwards

    @property
    def next_forward_id(self) -> int:
        """The id the next forward pass will get: every route or log-prob reported with a smaller
        id (from this engine) was computed before now."""
        return self._forward_base + self._forwards + 1

    # ---- scheduling -------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        # (Re)start the scheduler on the running event loop; a new loop (e.g. a second
        # asyncio.run) gets fresh events, since asyncio primitives are bound to one loop.
        loop = asyncio.get_running_loop()
        if self._loop_task is None or self._loop is not loop or self._loop_task.done():
            self._loop = loop
            self._pending.clear()
            self._inflight.clear()
            self._pause_points.clear()
            self._wakeup = asyncio.Event()
            self._running = asyncio.Event()
            self._running.set()
            self._model_lock = asyncio.Lock()
            self._loop_task = loop.create_task(self._schedule_loop())

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _schedule_loop(self) -> None:
        self._batch = None
        try:
            while True:
                while self._batch is None and not self._pending:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                await self._running.wait()
                async with self._model_lock:  # no abort or weight load in the middle of a step
                    await self._next_step()
                if self._batch is not None and not self._batch.requests:
                    self._batch = None
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a model failure makes the engine unhealthy; callers see it
            log.exception("embedded engine %s failed", self.name)
            self._failure = e
            self._batch = None
            for r in list(self._inflight.values()):
                if not r.future.done():
                    r.future.set_exception(EngineError(f"engine {self.name} failed: {e!r}"))

    async def _next_step(self) -> None:
        """Between two decode steps: cancelled rows leave, the KV is rebuilt after a weight load,
        queued requests join (continuous batching), then one decode step."""
        batch = self._batch
        if batch is not None:
            for r in batch.requests:
                if r.cancelled and r.finish_reason is None:
                    r.finish_reason, r.matched = "abort", None
            active = any(r.finish_reason is None for r in batch.requests)
            if active and batch.weights_epoch != self._weights_epoch:  # weights changed since the cache was built
                await self._run(batch.continue_in_place if self._continue_mode == "in_place" else batch.rebuild)
        joinable = batch is None or (self.continuous_batching and batch.mergeable)
        slots = self.max_batch_size - (len(batch.requests) if batch is not None else 0)
        admitted = self._take_admissible(slots) if joinable else []
        if admitted:
            if batch is None:
                self._batch = batch = await self._run(_Batch, self, admitted)
            else:
                await self._run(batch.admit, admitted)
                self.joined_running_batch += len(admitted)
        if batch is None:
            return
        done = await self._run(batch.step)
        self._after_step(batch.requests + done)
        for r in done:
            self._resolve(r)

    def _take_admissible(self, slots: int) -> list[_Request]:
        """Queued requests to prefill now, in arrival order: the oldest always (nothing waits
        forever), then each later one whose uncached prompt still fits `max_prefill_tokens`, so a
        short prompt passes long ones that do not fit and one prefill never runs unbounded."""
        taken: list[_Request] = []
        budget = self.max_prefill_tokens
        for r in list(self._pending):
            if len(taken) >= slots or budget <= 0:
                break
            if r.cancelled or self._finish_early(r):
                self._pending.remove(r)
                continue
            cost = len(r.input_ids) - self._prefix_cache.match_length(r.input_ids, len(r.input_ids) - 1)
            if taken and cost > budget:
                continue
            if taken:
                budget -= cost
            taken.append(r)
            self._pending.remove(r)
        return taken

    def _after_step(self, requests: list[_Request]) -> None:
        # Runs on the event loop right after a decode step, before the next one can start: a
        # pause point takes effect with exactly its number of tokens, and `decoded_tokens` shows
        # a count only once this has run (output_ids grows on the model thread during the step).
        for r in requests:
            r.decoded = len(r.output_ids)
            n = self._pause_points.get(r.rid)
            if n is not None and r.decoded >= n:
                del self._pause_points[r.rid]
                self._running.clear()

    def _finish_early(self, r: _Request) -> bool:
        """Requests that need no forward pass: nothing to generate."""
        if r.sampling.max_new_tokens == 0 or len(r.input_ids) >= self.max_positions:
            r.finish_reason, r.matched = "length", None
        else:
            return False
        self._resolve(r)
        return True

    def _check_finished(self, r: _Request) -> None:
        token = r.output_ids[-1]
        if token in self.eos_token_ids or token in r.sampling.stop_token_ids:
            r.finish_reason, r.matched = "stop", token
            return
        if r.sampling.stop:
            if self.tokenizer is None:
                raise EngineError("stop strings need a tokenizer: pass tokenizer= to LocalEngine")
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.sampling.skip_special_tokens)
            for s in r.sampling.stop:
                if text.find(s, max(0, r.text_len - len(s) + 1)) >= 0:
                    r.finish_reason, r.matched = "stop", s
                    return
            r.text_len = len(text)
        if len(r.output_ids) >= r.sampling.max_new_tokens:
            r.finish_reason, r.matched = "length", None
        elif len(r.input_ids) + len(r.output_ids) >= self.max_positions:
            r.finish_reason, r.matched = "length", None

    def _resolve(self, r: _Request) -> None:
        if r.resolved:
            return
        r.resolved = True
        if self._inflight.get(r.rid) is r:
            del self._inflight[r.rid]
            self._pause_points.pop(r.rid, None)
        if r.future.done():  # its caller was cancelled
            return
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.sampling.skip_special_tokens)
            if isinstance(r.matched, str) and not r.sampling.no_stop_trim:
                text = text[: text.rfind(r.matched)]
        r.future.set_result(
            GenerateResult(
                output_ids=list(r.output_ids),
                logprobs=list(r.logprobs),
                finish_reason=r.finish_reason,
                weight_version=r.versions[-1] if r.versions else self._weight_version,
                token_weight_versions=list(r.versions),
                token_forwards=list(r.token_forwards),
                route_forwards=torch.cat(r.route_forwards) if self._return_routed and r.route_forwards else None,
                abort_reason=r.abort_reason if r.finish_reason == "abort" else None,
                matched=r.matched,
                text=text,
                engine=self.name,
                routed_experts=torch.cat(r.routed) if self._return_routed and r.routed else None,
                cached_tokens=r.cached_tokens,
            )
        )

    # ---- Engine protocol ----------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: Optional[str] = None, session: Optional[str] = None
    ) -> GenerateResult:
        if self._failure is not None:
            raise EngineError(f"engine {self.name} is unhealthy: {self._failure!r}")
        self._check_can_generate()
        # Checked again here, not only when the params were built: a bad value that reached the
        # batched sampler would fail the whole batch and leave this engine unhealthy for good.
        sampling.validate()
        self._ensure_started()
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError("input_ids is empty")
        vocab = int(self.config.vocab_size)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids contain ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop (stop strings) needs an engine with a tokenizer")
        if rid is None:
            self._next_rid += 1
            rid = f"{self.name}-{self._next_rid}"
        if rid in self._inflight:
            raise ValueError(f"request id {rid!r} is already in flight")
        req = _Request(ids, sampling, rid, asyncio.get_running_loop().create_future())
        req.start_version = self._weight_version
        if sampling.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(sampling.sampling_seed % (1 << 63))
        self._inflight[rid] = req
        self._pending.append(req)
        self._wakeup.set()
        try:
            return await req.future
        except asyncio.CancelledError:  # the caller went away (an HTTP client disconnected, a timeout)
            self._cancel(req)
            raise

    def _cancel(self, r: _Request) -> None:
        """Stop a request nobody waits for: out of the queue now, out of the batch at the next step."""
        if r.resolved:
            return
        self.cancelled_requests += 1
        r.cancelled, r.resolved = True, True
        if r in self._pending:
            self._pending.remove(r)
        if self._inflight.get(r.rid) is r:
            del self._inflight[r.rid]
            self._pause_points.pop(r.rid, None)

    def scheduler_stats(self) -> dict:
        """The scheduler's load: rows decoding, requests queued and their prompt tokens, whether
        that is more than the engine works off soon (`overloaded`), and counters."""
        queued_tokens = sum(len(r.input_ids) for r in self._pending)
        return {
            "running": len(self._batch.requests) if self._batch is not None else 0,
            "queued": len(self._pending),
            "queued_prompt_tokens": queued_tokens,
            "overloaded": queued_tokens > self.overload_queued_tokens or len(self._pending) > 4 * self.max_batch_size,
            "max_batch_size": self.max_batch_size,
            "continuous_batching": self.continuous_batching,
            "joined_running_batch": self.joined_running_batch,
            "cancelled_requests": self.cancelled_requests,
            "aborted_by_pause": self.aborted_by_pause,
            "dropped_stale": self.dropped_stale,
        }

    async def update_weights_from_tensors(
        self, named_tensors: NamedTensors, weight_version: Optional[int] = None, sample_weights: bool = False
    ) -> Union[int, dict]:
        """Load HF-named tensors; the new weight version (with `sample_weights`: `_answer`)."""
        self._check_weights_resident("update_weights_from_tensors")
        return await self._load(lambda: named_tensors, weight_version, sample_weights)

    async def update_weights_from_disk(
        self, path: str, weight_version: Optional[int] = None, sample_weights: bool = False
    ) -> Union[int, dict]:
        """Load the HF safetensors in `path`; the new weight version (with `sample_weights`: `_answer`)."""
        self._check_weights_resident("update_weights_from_disk")
        return await self._load(lambda: hf_model.read_safetensors_dir(path), weight_version, sample_weights)

    async def _load(self, read: Callable, weight_version: Optional[int], sample_weights: bool) -> Union[int, dict]:
        """Load `read()`'s named tensors under the model lock (on the model thread), then the new
        weight version, or with `sample_weights` the answer that carries the loaded tensors' samples."""
        self._ensure_started()
        async with self._model_lock:
            version = self._next_version(weight_version)
            samples = await self._run(lambda: self._apply(read(), version, sample_weights))
            return self._answer(self._bump_version(weight_version), samples)

    def _apply(self, named: NamedTensors, version: int, sample: bool) -> Optional[tuple]:
        """Load `named` into the model as weight `version`; with `sample` also take, from the
        tensors the names now hold, the values the trainer's sampled check compares: (samples,
        seconds the sampling took).

        Each tensor is sampled right after it is written (`weight_checks.Sampler`), unless two
        names of this version's update (this request or an earlier one: a push sent a bucket at a
        time) load into the same memory: then a later write could change a tensor already
        sampled, so every name of the version is sampled by name after the whole load, and shows it."""
        items = list(named.items()) if isinstance(named, Mapping) else list(named)
        if not sample:
            hf_model.load_named_tensors(self.model, items)
            if self._positions is not None:  # sampled updates were seen: the next may be one again
                self._prepare_positions_after(version, items)
            return None
        targets = hf_model.load_targets(self.model, items)
        start = time.perf_counter()
        if self._loaded[0] != version:
            self._loaded = (version, [])
        earlier = self._loaded[1]
        earlier.extend((name, target) for (name, _), target in zip(items, targets))
        sampler = None
        if not self._share_memory(earlier):
            positions = self._positions
            if positions is None or positions.version != version:
                positions = weight_checks.Positions(version)
            sampler = weight_checks.Sampler([n for n, _ in items], [t.numel() for t in targets], positions)
        seconds = time.perf_counter() - start
        with torch.no_grad(), weight_checks.plain_torch():
            for i, (target, (_, tensor)) in enumerate(zip(targets, items)):
                target.copy_(tensor.to(target.dtype))
                if sampler is not None:
                    start = time.perf_counter()
                    sampler.take(i, target)
                    seconds += time.perf_counter() - start
        self._prepare_positions_after(version, earlier)
        if sampler is not None:
            start = time.perf_counter()
            samples = sampler.checks()
            return samples, seconds + time.perf_counter() - start
        start = time.perf_counter()
        held = hf_model.weights_by_name(self.model, [name for name, _ in earlier], self._parameters())
        samples = weight_checks.samples_of(held.items(), version)
        return samples, seconds + time.perf_counter() - start

    def _share_memory(self, loaded: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether two of a version's loaded tensors share memory (`weight_checks.overlapping`),
        remembered by their names: which names alias is fixed for the model, and a push loads the
        same names every version."""
        key = tuple(name for name, _ in loaded)
        shared = self._names_share_memory.get(key)
        if shared is None:
            if len(self._names_share_memory) > 64:  # pushes of changing subsets (tests): stay small
                self._names_share_memory.clear()
            shared = self._names_share_memory[key] = weight_checks.overlapping([t for _, t in loaded])
        return shared

    def _prepare_positions_after(self, version: int, loaded: list[tuple[str, torch.Tensor]]) -> None:
        """Queue, behind this load on the model thread (its answer does not wait), the sample
        positions of version + 1 for the names just loaded: the next sampled update's, most likely."""
        names, numels = [n for n, _ in loaded], [t.numel() for _, t in loaded]

        def prepare() -> None:
            if self._positions is None or self._positions.version != version + 1:
                self._positions = weight_checks.Positions(version + 1)
            self._positions.prepare(names, numels)

        with contextlib.suppress(RuntimeError):  # the engine shutting down
            self._executor.submit(prepare)

    def _answer(self, version: int, samples: Optional[tuple]) -> Union[int, dict]:
        """The version, or the answer of a sampled update: {"engine", "weight_version", "samples":
        its samples of what it loaded (`weight_checks.Samples`; `Checks` when names shared memory),
        "sample_s": the seconds sampling took}."""
        if samples is None:
            return version
        return {"engine": self.name, "weight_version": version, "samples": samples[0], "sample_s": samples[1]}

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        if backend != "gloo":
            raise ValueError(f"the embedded CPU engine joins weight-update groups over gloo, not {backend!r}")
        # This engine is one rank (no tensor parallelism): rank = rank_offset.
        group = await asyncio.get_running_loop().run_in_executor(
            None, weight_transport.join_group, master_address, master_port, rank_offset, world_size
        )
        self._weight_groups[group_name] = group

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: Optional[int] = None,
        sample_weights: bool = False,
    ) -> Union[int, dict]:
        """Receive the named tensors by broadcast and load them; the new weight version (with
        `sample_weights`: `_answer`)."""
        group = self._weight_groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight-update group {group_name!r}: call init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        self._check_weights_resident("update_weights_from_distributed")
        buffers = [torch.empty(shape, dtype=weight_transport.parse_dtype(d)) for d, shape in zip(dtypes, shapes)]
        self._ensure_started()
        async with self._model_lock:
            await asyncio.get_running_loop().run_in_executor(None, weight_transport.receive, group, buffers)
            version = self._next_version(weight_version)
            samples = await self._run(self._apply, list(zip(names, buffers)), version, sample_weights)
            return self._answer(self._bump_version(weight_version), samples)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._weight_groups.pop(group_name, None)

    def _bump_version(self, weight_version: Optional[int]) -> int:
        if self._failure is not None:  # the model thread failed on the old weights; the new ones get a chance
            log.warning(
                "embedded engine %s: healthy again after a weight load (it had failed: %r)", self.name, self._failure
            )
            self._failure = None
        self._needs_weights = False
        self._weights_epoch += 1
        # how requests in flight go on: as the pause around this load says (a load outside a pause: retract)
        self._continue_mode = self._continue_mode if self.paused else "retract"
        self._prefix_cache.clear()  # its KV was computed by the old weights
        self._weight_version = self._next_version(weight_version)
        return self._weight_version

    def _next_version(self, weight_version: Optional[int]) -> int:
        return self._weight_version + 1 if weight_version is None else int(weight_version)

    async def verify_weights(self, checks: Mapping[str, weight_checks.TensorCheck], weight_version: int) -> dict:
        """Compare the weights held now with the trainer's record of a push (`weight_checks`):
        {"engine": name, "weight_version": held version, "problems": {tensor: why it differs}}."""
        self._check_weights_resident("verify_weights")
        self._ensure_started()
        async with self._model_lock:  # never in the middle of a load
            problems = await self._run(self._compare_weights, checks, int(weight_version))
        return {"engine": self.name, "weight_version": self._weight_version, "problems": problems}

    def _compare_weights(self, checks: Mapping[str, weight_checks.TensorCheck], version: int) -> dict:
        held = hf_model.weights_by_name(self.model, list(checks), self._parameters())
        return weight_checks.compare_all(held, checks, version)

    def _parameters(self) -> dict:
        if self._params_by_name is None:  # the parameter objects live as long as the model
            self._params_by_name = hf_model.parameters_by_name(self.model)
        return self._params_by_name

    async def weights_manifest(self) -> dict:
        """{"engine", "weight_version", "tensors": {HF name: {shape, dtype, sha256}}} of every weight
        held now (a tied `lm_head` is left out, as a sync never sends it)."""
        self._check_weights_resident("weights_manifest")
        self._ensure_started()
        async with self._model_lock:
            tensors = await self._run(self._manifest)
        return {"engine": self.name, "weight_version": self._weight_version, "tensors": tensors}

    def _manifest(self) -> dict:
        state = hf_model.checkpoint_state(self.model)
        if getattr(self.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return weight_checks.manifest(state.items())

    async def set_weight_version(self, weight_version: int) -> None:
        self._weight_version = int(weight_version)

    async def pause(self, mode: str = "retract") -> int:
        """Hold every request between two decode steps. How they continue after a weight load,
        SGLang's modes: "retract" recomputes their KV with the new weights, "in_place" keeps the
        old weights' KV, "abort" ends them now (reason "abort", abort_reason "pause"). Returns how
        many requests it aborted."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._ensure_started()
        self._running.clear()
        self._continue_mode = mode
        return await self.abort() if mode == "abort" and self._inflight else 0

    async def resume(self) -> None:
        self._ensure_started()
        self._running.set()

    @property
    def paused(self) -> bool:
        """Held between two decode steps (`pause`, or a `pause_after` point reached)."""
        return self._running is not None and not self._running.is_set()

    async def pause_after(self, rid: str, num_tokens: int) -> None:
        """Pause the engine (as `pause()`) right after the decode step that gives request `rid`
        its `num_tokens`-th token; `resume()` continues. Returns at once: the request may not have
        arrived yet. If it already has that many tokens the engine pauses before its next step;
        if it finishes with fewer, nothing happens. For tests and drills that need a request held
        at a known point whatever the machine's speed (poll `decoded_tokens(rid)` to see it).
        """
        if int(num_tokens) < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self._ensure_started()
        r = self._inflight.get(rid)
        if r is not None and r.decoded >= int(num_tokens):
            self._running.clear()
        else:
            self._pause_points[rid] = int(num_tokens)

    async def decoded_tokens(self, rid: str) -> Optional[int]:
        """How many tokens request `rid` has generated so far (counting finished decode steps, so
        a request held by `pause_after(rid, n)` shows exactly n); None if it is not in flight."""
        r = self._inflight.get(rid)
        return None if r is None else r.decoded

    async def flush_cache(self) -> None:
        """Drop the prefix cache (requests in flight keep their own KV)."""
        self._ensure_started()
        async with self._model_lock:
            self._prefix_cache.clear()

    def cache_stats(self) -> dict:
        """The prefix cache: its budget and contents, prompt tokens prefilled so far and how many
        of them it served (`hit_rate` = cached / prompt tokens)."""
        return self._prefix_cache.stats()

    async def abort(self, rid: Optional[str] = None) -> int:
        """Finish the request(s) now with reason "abort", keeping the tokens generated so far.
        While the engine is paused (a weight update) they count as aborted by the pause
        (`aborted_by_pause`, their results' `abort_reason` "pause"). Returns how many it ended."""
        if rid is not None and rid not in self._inflight:
            return 0
        targets = list(self._inflight.values()) if rid is None else [self._inflight[rid]]
        self._ensure_started()
        reason = "pause" if not self._running.is_set() else None
        return await self._abort(targets, reason)

    async def abort_stale(self, min_version: int) -> int:
        """Abort every request that arrived before weight version `min_version` (abort_reason
        "stale"): its trajectory is past the staleness bound, continuing it (re-prefilled under
        new weights) only wastes the engine. Counted in `dropped_stale`; returns how many."""
        self._ensure_started()
        return await self._abort([r for r in self._inflight.values() if r.start_version < int(min_version)], "stale")

    async def _abort(self, targets: list[_Request], reason: Optional[str]) -> int:
        ended = 0
        async with self._model_lock:  # no decode step is running while we finish requests
            for r in targets:
                if r in self._pending:
                    self._pending.remove(r)
                if r.finish_reason is None:
                    r.finish_reason, r.matched, r.abort_reason = "abort", None, reason
                if not r.future.done():
                    ended += not r.resolved
                    self._resolve(r)
        self.aborted_by_pause += ended if reason == "pause" else 0
        self.dropped_stale += ended if reason == "stale" else 0
        return ended

    # ---- colocated mode: memory release / resume (see the module docstring) -------------------

    def _check_can_generate(self) -> None:
        blocking = sorted(self._released & {"weights", "kv_cache"})
        if blocking:
            raise EngineReleasedError(
                f"engine {self.name}: cannot generate while its {' and '.join(blocking)} memory is released "
                f"(colocated mode); call resume_memory_occupation first"
            )
        if self._needs_weights:
            raise EngineReleasedError(
                f"engine {self.name}: its weights were resumed after a release and hold no values yet; "
                "load weights (update_weights_from_*) before generating"
            )

    def _check_weights_resident(self, what: str) -> None:
        if "weights" in self._released:
            raise EngineReleasedError(
                f"engine {self.name}: {what} while the weights' memory is released; the order is "
                "resume_memory_occupation(['weights']) -> update -> resume_memory_occupation(['kv_cache'])"
            )

    async def released_memory(self) -> list[str]:
        """The memory tags released now."""
        return sorted(self._released)

    async def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Free the memory of `tags` (None = all); see the module docstring."""
        tags = memory_tags(tags)
        again = [t for t in tags if t in self._released]
        if again:
            raise ValueError(f"memory {again} of engine {self.name} is already released")
        if self._inflight:  # SGLang asserts the same: releasing under a running batch would crash it
            raise ValueError(
                f"engine {self.name}: release_memory_occupation needs an idle engine, "
                f"{len(self._inflight)} request(s) in flight"
            )
        self._ensure_started()
        async with self._model_lock:
            if "weights" in tags:
                await self._run(self._free_weights)
            if "kv_cache" in tags:
                self._prefix_cache.clear()
            self._released.update(tags)

    async def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Take back the memory of `tags` (None = all), each released before."""
        tags = memory_tags(tags)
        missing = [t for t in tags if t not in self._released]
        if missing:
            raise ValueError(f"memory {missing} of engine {self.name} is not released; nothing to resume")
        self._ensure_started()
        async with self._model_lock:
            if "weights" in tags:
                await self._run(self._restore_weights)
            self._released.difference_update(tags)

    def _free_weights(self) -> None:
        # Each storage once (tied embeddings, fused experts share one): its bytes go back to the
        # allocator, while the tensors keep shape and dtype so loads can refill them in place.
        seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for p in self.model.parameters():
            storage = p.untyped_storage()
            seen.setdefault(storage.data_ptr(), (storage, storage.nbytes()))
        for storage, _ in seen.values():
            storage.resize_(0)
        self._freed_storages = list(seen.values())

    def _restore_weights(self) -> None:
        for storage, nbytes in self._freed_storages:
            storage.resize_(nbytes)
            storage.fill_(0)
        self._freed_storages = []
        self._needs_weights = True

    async def health(self) -> bool:
        return self._failure is None and (self._loop_task is None or not self._loop_task.done())

    async def weight_version(self) -> int:
        return self._weight_version

    def model_info(self) -> dict:
        return {
            "model_path": None,
            "served_model_name": self.name,
            "is_generation": True,
            "weight_version": str(self._weight_version),
            "model_type": getattr(self.config, "model_type", None),
            "architectures": getattr(self.config, "architectures", None),
            "vocab_size": int(self.config.vocab_size),
            "prefix_cache": self.cache_stats(),
            "scheduler": self.scheduler_stats(),
        }

    async def close(self) -> None:
        await self.abort()
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
            self._loop_task = None
        self._executor.shutdown(wait=False)
