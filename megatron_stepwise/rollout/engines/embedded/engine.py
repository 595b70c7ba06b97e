"""The embedded CPU engine: a Hugging Face causal LM behind the `Engine` protocol.

`LocalEngine` builds the model and answers the protocol; its parts, each in its own module:
- scheduler.py  concurrent `generate` calls batched continuously on one model thread, so the
                event loop stays responsive: between two decode steps newly arrived requests are
                admitted and join the running batch, finished or cancelled ones leave it, and the
                engine can be paused or aborted;
- batch.py      the running batch's rows (HF KV cache, left-padded) and their forwards;
- weights.py    loads, their sampled checks, verification, versions and colocated mode's memory
                release (SGLang's release / resume semantics);
- prefix_cache.py  a finished request's KV, so a later request sharing its prefix prefills only
                the rest;
- scoring.py    `score` (a teacher's log-probs of given tokens): one forward of the whole sequence,
                run between two decode steps.
Requests in flight across a weight update continue with the new weights (their KV cache rebuilt
first; or on their old KV after an `in_place` pause; an `abort` pause ends them). Every sampled
token records the forward pass (and weights) whose logits gave it, every routed position the
forward that computed it; a rebuild never re-records the routes of positions whose logits already
gave a token (docs/megatron.md, 'Route provenance'). A load refuses non-finite weights; a
model-thread failure makes the engine unhealthy until the next good load.

The prefix cache, partial rollouts, faults and colocated mode in detail: docs/architecture.md,
'The embedded CPU engine'.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from typing import Any, Mapping, Optional, Union

import torch

from megatron_stepwise import weight_checks, weight_transport
from megatron_stepwise.rollout.engines import routed_experts as routing
from megatron_stepwise.rollout.engines.embedded import hf_model
from megatron_stepwise.rollout.engines.embedded.batch import Request
from megatron_stepwise.rollout.engines.embedded.prefix_cache import PrefixCache
from megatron_stepwise.rollout.engines.embedded.scheduler import Scheduler
from megatron_stepwise.rollout.engines.embedded.scoring import ScoreBatcher, score_rows
from megatron_stepwise.rollout.engines.embedded.weights import EngineWeights
from megatron_stepwise.rollout.engines.protocol import (
    EngineError,
    GenerateResult,
    NamedTensors,
    SamplingParams,
    checked_score_args,
    memory_tags,
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
        self.name = name
        # transformers 5 renamed the KV cache argument and output to `cache` (the old name warns every call)
        self.cache_name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.router_recorder = None
        if record_routed_experts or (record_routed_experts is None and routing.moe_gates(self.model)) or router_noise:
            self.router_recorder = routing.RouterRecorder(
                self.model, router_noise=router_noise, seed=seed, router_noise_mode=router_noise_mode
            )
            self.routed_shape = (self.router_recorder.num_layers, self.router_recorder.topk)
        self._return_routed = bool(record_routed_experts or (record_routed_experts is None and self.router_recorder))
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else self.config.eos_token_id
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_token_id = int(pad if pad is not None else 0)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.generator = torch.Generator().manual_seed(seed)
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        # Forward-pass ids: random high bits per engine, so ids from engines of one fleet differ
        # (a turn continued on another engine, a prefix computed by another request).
        self._forward_base = (int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF) << 32
        self._forwards = 0
        self.scheduler = Scheduler(
            self, max_batch_size, continuous_batching, max_prefill_tokens, overload_queued_tokens
        )
        self.weights = EngineWeights(self.model, name, behind_loads=self.scheduler.executor.submit)
        self.scores = ScoreBatcher(self._score_rows)  # requests that wait for the model go together

    def next_forward(self) -> int:
        """A new forward pass's id."""
        self._forwards += 1
        return self._forward_base + self._forwards

    @property
    def next_forward_id(self) -> int:
        """The id the next forward pass will get: every route or log-prob reported with a smaller
        id (from this engine) was computed before now."""
        return self._forward_base + self._forwards + 1

    # ---- a request's tokens: stop rules and result ------------------------------------------

    def check_finished(self, r: Request) -> None:
        """Set `r.finish_reason` once its last sampled token ends it (eos, stop, length)."""
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

    def result(self, r: Request) -> GenerateResult:
        """A finished request's result (its text only with a tokenizer, stop strings trimmed)."""
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.sampling.skip_special_tokens)
            if isinstance(r.matched, str) and not r.sampling.no_stop_trim:
                text = text[: text.rfind(r.matched)]
        return GenerateResult(
            output_ids=list(r.output_ids),
            logprobs=list(r.logprobs),
            finish_reason=r.finish_reason,
            weight_version=r.versions[-1] if r.versions else self.weights.version,
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

    # ---- Engine protocol: generation (the scheduler) ----------------------------------------

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: Optional[str] = None, session: Optional[str] = None
    ) -> GenerateResult:
        self._check_healthy()
        self.weights.check_can_generate()
        # Checked again here, not only when the params were built: a bad value that reached the
        # batched sampler would fail the whole batch and leave this engine unhealthy for good.
        sampling.validate()
        self.scheduler.ensure_started()
        ids = self._vocab_ids(input_ids)
        if sampling.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop (stop strings) needs an engine with a tokenizer")
        return await self.scheduler.submit(ids, sampling, rid)

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """`Engine.score`: a forward of the whole sequence (no KV cache, no prefix cache) on the
        model thread between two decode steps, so generations in flight go on unchanged; requests
        that wait meanwhile share the next forward (right-padded)."""
        self._check_healthy()
        ids = checked_score_args(self._vocab_ids(input_ids), start, temperature)
        if len(ids) > self.max_positions:
            raise ValueError(f"input_ids hold {len(ids)} tokens, more than the model's {self.max_positions} positions")
        return await self.scores.score(ids, start, float(temperature))

    async def _score_rows(self, rows: list) -> list[list[float]]:
        """One padded forward of queued score requests (`scoring.ScoreBatcher`), between decode steps."""
        async with self.scheduler.exclusive():
            self.weights.check_can_generate()  # under the lock: a memory release may have come first
            return await self.scheduler.run(score_rows, self.model, rows, self.pad_token_id)

    def _check_healthy(self) -> None:
        if self.scheduler.failure is not None:
            raise EngineError(f"engine {self.name} is unhealthy: {self.scheduler.failure!r}")

    def _vocab_ids(self, input_ids: list[int]) -> list[int]:
        """The ids as ints; ValueError if there are none or one is outside the vocabulary."""
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError("input_ids is empty")
        vocab = int(self.config.vocab_size)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids contain ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return ids

    def scheduler_stats(self) -> dict:
        return self.scheduler.stats()

    async def pause(self, mode: str = "retract") -> int:
        return await self.scheduler.pause(mode)

    async def resume(self) -> None:
        await self.scheduler.resume()

    @property
    def paused(self) -> bool:
        return self.scheduler.paused

    async def pause_after(self, rid: str, num_tokens: int) -> None:
        await self.scheduler.pause_after(rid, num_tokens)

    async def decoded_tokens(self, rid: str) -> Optional[int]:
        return self.scheduler.decoded_tokens(rid)

    async def abort(self, rid: Optional[str] = None) -> int:
        return await self.scheduler.abort(rid)

    async def abort_stale(self, min_version: int) -> int:
        return await self.scheduler.abort_stale(min_version)

    async def flush_cache(self) -> None:
        """Drop the prefix cache (requests in flight keep their own KV)."""
        async with self.scheduler.exclusive():
            self.prefix_cache.clear()

    def cache_stats(self) -> dict:
        """The prefix cache: its budget and contents, prompt tokens prefilled so far and how many
        of them it served (`hit_rate` = cached / prompt tokens)."""
        return self.prefix_cache.stats()

    # ---- Engine protocol: weights (loaded between two decode steps) -------------------------

    async def update_weights_from_tensors(
        self, named_tensors: NamedTensors, weight_version: Optional[int] = None, sample_weights: bool = False
    ) -> Union[int, dict]:
        """Load HF-named tensors; the new weight version (with `sample_weights`: `EngineWeights.answer`)."""
        self.weights.check_resident("update_weights_from_tensors")
        return await self._load(lambda: named_tensors, weight_version, sample_weights)

    async def update_weights_from_disk(
        self, path: str, weight_version: Optional[int] = None, sample_weights: bool = False
    ) -> Union[int, dict]:
        """Load the HF safetensors in `path`; the new weight version (with `sample_weights`: `EngineWeights.answer`)."""
        self.weights.check_resident("update_weights_from_disk")
        return await self._load(lambda: hf_model.read_safetensors_dir(path), weight_version, sample_weights)

    async def _load(self, read, weight_version: Optional[int], sample_weights: bool) -> Union[int, dict]:
        """Load `read()`'s named tensors under the model lock (on the model thread), then the new
        weight version, or with `sample_weights` the answer that carries the loaded tensors' samples."""
        async with self.scheduler.exclusive():
            version = self.weights.next_version(weight_version)
            samples = await self.scheduler.run(lambda: self.weights.apply(read(), version, sample_weights))
            return self.weights.answer(self._replaced(weight_version), samples)

    def _replaced(self, weight_version: Optional[int]) -> int:
        """After a load: the scheduler told, the prefix cache (the old weights' KV) cleared; the new version."""
        self.scheduler.weights_replaced()
        self.prefix_cache.clear()
        return self.weights.replaced(weight_version)

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
        self.weights.groups[group_name] = group

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
        `sample_weights`: `EngineWeights.answer`)."""
        group = self.weights.groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight-update group {group_name!r}: call init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        self.weights.check_resident("update_weights_from_distributed")
        buffers = [torch.empty(shape, dtype=weight_transport.parse_dtype(d)) for d, shape in zip(dtypes, shapes)]
        async with self.scheduler.exclusive():
            await asyncio.get_running_loop().run_in_executor(None, weight_transport.receive, group, buffers)
            version = self.weights.next_version(weight_version)
            samples = await self.scheduler.run(self.weights.apply, list(zip(names, buffers)), version, sample_weights)
            return self.weights.answer(self._replaced(weight_version), samples)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self.weights.groups.pop(group_name, None)

    async def verify_weights(self, checks: Mapping[str, weight_checks.TensorCheck], weight_version: int) -> dict:
        """Compare the weights held now with the trainer's record of a push (`weight_checks`):
        {"engine": name, "weight_version": held version, "problems": {tensor: why it differs}}."""
        self.weights.check_resident("verify_weights")
        async with self.scheduler.exclusive():  # never in the middle of a load
            problems = await self.scheduler.run(self.weights.compare, checks, int(weight_version))
        return {"engine": self.name, "weight_version": self.weights.version, "problems": problems}

    async def weights_manifest(self) -> dict:
        """{"engine", "weight_version", "tensors": {HF name: {shape, dtype, sha256}}} of every weight
        held now (a tied `lm_head` is left out, as a sync never sends it)."""
        self.weights.check_resident("weights_manifest")
        async with self.scheduler.exclusive():
            tensors = await self.scheduler.run(self.weights.manifest)
        return {"engine": self.name, "weight_version": self.weights.version, "tensors": tensors}

    async def set_weight_version(self, weight_version: int) -> None:
        self.weights.version = int(weight_version)

    async def weight_version(self) -> int:
        return self.weights.version

    # ---- colocated mode: memory release / resume (see weights.py) ---------------------------

    async def released_memory(self) -> list[str]:
        """The memory tags released now."""
        return sorted(self.weights.released)

    async def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Free the memory of `tags` (None = all): the weights' bytes, the prefix cache's KV."""
        tags = memory_tags(tags)
        again = [t for t in tags if t in self.weights.released]
        if again:
            raise ValueError(f"memory {again} of engine {self.name} is already released")
        if self.scheduler.inflight:  # SGLang asserts the same: releasing under a running batch would crash it
            raise ValueError(
                f"engine {self.name}: release_memory_occupation needs an idle engine, "
                f"{len(self.scheduler.inflight)} request(s) in flight"
            )
        async with self.scheduler.exclusive():
            if "weights" in tags:
                await self.scheduler.run(self.weights.free)
            if "kv_cache" in tags:
                self.prefix_cache.clear()
            self.weights.released.update(tags)

    async def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Take back the memory of `tags` (None = all), each released before."""
        tags = memory_tags(tags)
        missing = [t for t in tags if t not in self.weights.released]
        if missing:
            raise ValueError(f"memory {missing} of engine {self.name} is not released; nothing to resume")
        async with self.scheduler.exclusive():
            if "weights" in tags:
                await self.scheduler.run(self.weights.restore)
            self.weights.released.difference_update(tags)

    # ---- the rest ---------------------------------------------------------------------------

    async def health(self) -> bool:
        return self.scheduler.healthy

    def model_info(self) -> dict:
        return {
            "model_path": None,
            "served_model_name": self.name,
            "is_generation": True,
            "weight_version": str(self.weights.version),
            "model_type": getattr(self.config, "model_type", None),
            "architectures": getattr(self.config, "architectures", None),
            "vocab_size": int(self.config.vocab_size),
            "prefix_cache": self.cache_stats(),
            "scheduler": self.scheduler_stats(),
        }

    async def close(self) -> None:
        await self.scheduler.close()
