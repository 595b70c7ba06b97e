"""One rollout engine in a Ray actor: how to build it (`EngineSpec`) and the actor (`EngineActor`).

Apart from fleet.py so that an engine's process, which unpickles both, imports what an engine
needs (the embedded engine, or the SGLang client and server launcher, when it builds one) and not
the fleet's router, agent-loop settings and HTTP client stack (~0.12 CPU-seconds per engine
start). Callers import both from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from megatron_stepwise.rollout.engines.protocol import GenerateResult
    from megatron_stepwise.rollout.engines.sglang import SGLangServerConfig


@dataclass
class EngineSpec:
    """How to build one engine actor."""

    kind: str = "local"  # "local" | "sglang" | "http"
    # local
    model_config: Any = None
    weights: Optional[str] = None
    tokenizer: Optional[str] = None
    seed: int = 0
    max_batch_size: int = 16
    torch_threads: int = 1
    prefix_cache_tokens: int = 32768  # `rollout.embedded_cache_tokens`
    # sglang (launched by the actor) / http (already running)
    sglang: Optional[SGLangServerConfig] = None
    url: Optional[str] = None
    generate_url: Optional[str] = None  # an sglang-router in front of the servers (generation only)
    tp_size: int = 1
    # Ray resources of the actor
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # MoE routing replay: (num_hidden_layers, topk) when the engine must return routed experts
    routed_experts: Optional[tuple[int, int]] = None

    def __post_init__(self) -> None:
        if self.kind not in ("local", "sglang", "http"):
            raise ValueError(f"EngineSpec.kind must be 'local', 'sglang' or 'http', got {self.kind!r}")
        if self.kind == "local" and self.model_config is None:
            raise ValueError("EngineSpec(kind='local') needs model_config")
        if self.kind == "sglang" and self.sglang is None:
            raise ValueError("EngineSpec(kind='sglang') needs sglang=SGLangServerConfig(...)")
        if self.kind == "http" and not self.url:
            raise ValueError("EngineSpec(kind='http') needs url")
        if self.kind == "sglang" and self.sglang.tp_size != self.tp_size:
            # The client sends one tensor payload per TP rank and the weight-update group counts
            # every rank: both need the size the server was launched with.
            raise ValueError(f"EngineSpec.tp_size ({self.tp_size}) must equal sglang.tp_size ({self.sglang.tp_size})")

    @property
    def group_ranks(self) -> int:
        """Ranks this engine takes in a weight-update group: one per SGLang TP rank (SGLang joins
        rank `rank_offset + tp_rank`); the embedded engine is a single rank."""
        return 1 if self.kind == "local" else int(self.tp_size)


class EngineActor:
    """Runs inside a Ray actor: owns one engine (and its server process for kind='sglang')."""

    def __init__(self, spec: EngineSpec, name: str):
        self.proc = None
        if spec.torch_threads:
            os.environ.setdefault("OMP_NUM_THREADS", str(spec.torch_threads))
        if spec.kind == "local":
            from megatron_stepwise.hf.tokenizers import load_tokenizer
            from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine

            tokenizer = load_tokenizer(spec.tokenizer) if spec.tokenizer else None
            self.engine = LocalEngine(
                spec.model_config,
                weights=spec.weights,
                tokenizer=tokenizer,
                max_batch_size=spec.max_batch_size,
                seed=spec.seed,
                torch_threads=spec.torch_threads,
                name=name,
                record_routed_experts=spec.routed_experts is not None,
                prefix_cache_tokens=spec.prefix_cache_tokens,
            )
        else:
            from megatron_stepwise.rollout.engines.sglang import SGLangClient, launch_sglang_server

            url = spec.url
            if spec.kind == "sglang":
                self.proc = launch_sglang_server(spec.sglang)
                url = spec.sglang.url
            self.engine = SGLangClient(
                url, tp_size=spec.tp_size, routed_experts=spec.routed_experts, generate_url=spec.generate_url
            )

    async def generate(self, input_ids, sampling, rid=None, session=None) -> GenerateResult:
        return await self.engine.generate(input_ids, sampling, rid=rid, session=session)

    async def call(self, method: str, *args, **kwargs):
        """Any other `Engine` method by name (weight updates, pause, resume, flush, abort...)."""
        return await getattr(self.engine, method)(*args, **kwargs)

    async def shutdown(self) -> None:
        await self.engine.close()
        if self.proc is not None:
            self.proc.kill()
