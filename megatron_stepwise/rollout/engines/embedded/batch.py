"""The embedded engine's running batch: one row per request, joined and left between decode steps.

`Request` is one generation in flight (its tokens, log-probs, versions, routes and provenance);
`RunningBatch` holds the rows decoding together (HF KV cache, left-padded) and runs their
forwards: a prefill when rows join (prefix-cache hits reused), one decode step at a time, a
rebuild after a weight load. The scheduler (`scheduler.py`) decides who joins and when.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from megatron_stepwise.rollout.engines.embedded.prefix_cache import PrefixCache
from megatron_stepwise.rollout.engines.embedded.sampling import sample_next
from megatron_stepwise.rollout.engines.embedded.weights import EngineWeights
from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams

log = logging.getLogger(__name__)


class EngineParts(Protocol):
    """What the running batch and the scheduler use of their engine (`LocalEngine` is one): its
    model and weights, the prefix cache, the stop rules and how a finished request is answered.
    Named here so that neither module imports the engine that builds them."""

    name: str
    model: torch.nn.Module
    weights: EngineWeights
    prefix_cache: PrefixCache
    cache_name: str  # the model's keyword for its KV cache ("cache" or "past_key_values")
    pad_token_id: int
    max_positions: int
    generator: torch.Generator
    router_recorder: Any  # the MoE route recorder, or None
    routed_shape: tuple[int, int]
    next_forward: Callable[[], int]
    check_finished: Callable[["Request"], None]
    result: Callable[["Request"], GenerateResult]


@dataclass
class Request:
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


class RunningBatch:
    """The running batch: one row per request, left-padded, one token per row per `step()`.

    Rows join (`admit`: prefilled on their own, then merged in) and leave (finished, aborted or
    cancelled) between two decode steps, each with its own KV, mask and position: a short request
    arriving while a long one decodes starts at the next step instead of after the batch.

    After a weight swap in the middle of the batch, `rebuild()` runs again over each row's prompt
    plus the tokens it has generated so far: generation continues (nothing is discarded) and
    every later token is sampled from the new weights' distribution, with their exact log-prob.
    """

    def __init__(self, engine: EngineParts, requests: list[Request]):
        self.engine = engine
        self.requests: list[Request] = []
        self.weights_epoch = engine.weights.epoch  # the weights the cache was computed with
        self.fresh_kv = True  # False once continued in place across a weight load: never cached
        self.cache = self.mask = self.next_pos = self.last_logits = None
        self.admit(requests)

    def admit(self, requests: list[Request]) -> None:
        """Prefill `requests` (prefix-cache hits reused) and add them as rows of this batch."""
        rows = self._prefill(requests, first=True)
        if self.requests:
            rows = merge_rows(self._rows(), rows)
        self.requests = self.requests + requests
        self.cache, self.mask, self.next_pos, self.last_logits = rows

    def rebuild(self) -> None:
        """Recompute every row's KV (prompt + tokens so far) with the weights loaded now. Routes
        are append-only: only the last position's (whose logits give the next token) is replaced."""
        self.weights_epoch = self.engine.weights.epoch
        self.cache, self.mask, self.next_pos, self.last_logits = self._prefill(self.requests, first=False)

    def continue_in_place(self) -> None:
        """Keep every row's KV as the old weights computed it (SGLang's `in_place` pause): the next
        token comes from the logits already computed, later ones from the new weights."""
        self.weights_epoch = self.engine.weights.epoch
        self.fresh_kv = False

    @property
    def mergeable(self) -> bool:
        """Rows can join: every cache layer is a plain `DynamicLayer` (a sliding window's is not)."""
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def _rows(self) -> tuple:
        return self.cache, self.mask, self.next_pos, self.last_logits

    def _prefill(self, requests: list[Request], first: bool) -> tuple:
        """Run every row's sequence (prompt + tokens generated so far) but the prefix the prefix
        cache holds (a `first` prefill; a rebuild after a weight load computes everything): row i is [pad][cached c_i][pad][new s_i], the cached KV left-padded to the
        longest hit, the new tokens to the longest suffix, the pads masked out. Returns the rows'
        (cache, mask, next positions, last logits)."""
        eng = self.engine
        store = eng.prefix_cache if eng.prefix_cache.enabled and first else None
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
        forward, version = eng.next_forward(), eng.weights.version
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
                eng.prefix_cache.count(n, c)
        if eng.router_recorder is not None:  # each row's new positions are its last `n - c` columns
            routed = eng.router_recorder.take(ids.numel()).reshape(len(seqs), S, *eng.routed_shape)
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

    def _keep(self, i: int, r: Request) -> None:
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
            eng.prefix_cache = PrefixCache(0)
            return
        cols = self.mask[i].nonzero().squeeze(1)
        tokens = (r.input_ids + r.output_ids)[: len(cols)]
        kv = [(layer.keys[i][:, cols], layer.values[i][:, cols]) for layer in layers]  # copies
        routed = torch.cat(r.routed)[: len(cols)] if r.routed else None
        forwards = torch.cat(r.route_forwards)[: len(cols)] if r.route_forwards else None
        eng.prefix_cache.insert(tokens, kv, routed, forwards)

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

    def step(self) -> list[Request]:
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
                eng.check_finished(r)
                if r.finish_reason is not None and eng.prefix_cache.enabled and self.fresh_kv:
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
        forward, version = eng.next_forward(), eng.weights.version
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
        if eng.router_recorder is not None:  # the fed token's experts, for rows that ran a new one
            routed = eng.router_recorder.take(len(feed))
            for r, row in zip(self.requests, routed):
                if r.routed is not None and r.routed_len == len(r.input_ids) + len(r.output_ids) - 1:
                    r.routed.append(row[None])
                    r.route_forwards.append(torch.tensor([forward]))
                    r.routed_len += 1
        return done


def merge_rows(a: tuple, b: tuple) -> tuple:
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
