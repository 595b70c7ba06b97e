"""Routed experts of the embedded engine (MoE routing replay, see mcore/train/routing_replay.py).

`RouterRecorder` hooks the router (`mlp.gate`: transformers' Qwen3-MoE and Mixtral top-k routers
alike) of every MoE layer of a Hugging Face model and
keeps the top-k expert ids each forward chose, so the engine can return, per request, the
experts of every position it ran: the prompt at prefill, then each fed-back token. Ids are
reported per decoder layer (SGLang's layout: [tokens, num_hidden_layers, topk], int32 on the
wire), -1 for a layer without a router.

`router_noise` is a test hook: it perturbs the engine's routers slightly, as bf16 kernels or
another parallel layout would, so that some tokens go to other experts than the trainer's
router picks. The perturbed router is the gate weight plus `router_noise` x its standard
deviation x a fixed Gaussian matrix. `router_noise_mode="select"` (default) perturbs only which
experts are chosen: the top-k runs on the perturbed logits, the gating values are the exact
router's at the chosen experts; this is the discontinuous part of a numerical mismatch, the
part routing replay removes. `"weights"` uses the perturbed router for both (the continuous
part, a small change of every gating value, remains with replay).
"""

from __future__ import annotations

import base64
from typing import Optional

import torch
import torch.nn.functional as F

WIRE_DTYPE = torch.int32  # SGLang sends routed experts as base64 of int32 bytes


def moe_gates(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """decoder layer index -> its router module (`mlp.gate` with top_k: transformers 5's
    Qwen3MoeTopKRouter and MixtralTopKRouter; Mixtral's hub name `block_sparse_moe` is only a
    checkpoint name, the module is `mlp`)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    out = {}
    for i, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "weight"):
            out[i] = gate
    return out


class RouterRecorder:
    """Forward hooks on a model's routers that keep the experts of the last forward."""

    def __init__(
        self, model: torch.nn.Module, router_noise: float = 0.0, seed: int = 0, router_noise_mode: str = "select"
    ):
        if router_noise_mode not in ("select", "weights"):
            raise ValueError(f"router_noise_mode must be 'select' or 'weights', got {router_noise_mode!r}")
        self.noise_mode = router_noise_mode
        self.gates = moe_gates(model)
        if not self.gates:
            raise ValueError("routed experts need a MoE model (no router modules found)")
        # Mixtral's router always renormalises the top-k and keeps the gating values in fp32;
        # Qwen3-MoE's renormalises when norm_topk_prob and casts them to the logits' dtype.
        self._mixtral = getattr(getattr(model, "config", None), "model_type", None) == "mixtral"
        self.num_layers = len(model.model.layers)
        self.topk = int(next(iter(self.gates.values())).top_k)
        self.router_noise = float(router_noise)
        self._noise: dict[int, torch.Tensor] = {}
        if self.router_noise:
            g = torch.Generator().manual_seed(seed + 7919)
            for i, gate in sorted(self.gates.items()):
                self._noise[i] = torch.randn(gate.weight.shape, generator=g)
        self._last: dict[int, torch.Tensor] = {}
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in self.gates.items()]

    def _hook(self, index: int):
        def hook(module, args, output):
            if self.router_noise:
                output = self._perturbed(module, args[0], index)
            self._last[index] = output[2].detach()
            return output

        return hook

    def _perturbed(self, gate, hidden: torch.Tensor, index: int):
        """The router's outputs with a slightly perturbed weight (the same computation as HF's)."""
        weight = gate.weight
        delta = self._noise[index].to(weight.dtype) * (self.router_noise * float(weight.float().std()))
        hidden = hidden.reshape(-1, weight.size(1))
        logits = F.linear(hidden, weight + delta)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        _, indices = torch.topk(probs, gate.top_k, dim=-1)
        if self.noise_mode == "select":  # the exact router's gating values at the chosen experts
            logits = F.linear(hidden, weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top = probs.gather(1, indices)
        if self._mixtral or getattr(gate, "norm_topk_prob", False):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, (top if self._mixtral else top.to(logits.dtype)), indices

    def take(self, num_tokens: int) -> torch.Tensor:
        """int16 [num_tokens, num_layers, topk]: the experts of the last forward (its tokens
        flattened batch-major), -1 for layers without a router; then forgets them."""
        out = torch.full((num_tokens, self.num_layers, self.topk), -1, dtype=torch.int16)
        for i, idx in self._last.items():
            out[:, i] = idx.reshape(num_tokens, self.topk).to(torch.int16)
        self._last = {}
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def encode(routed: torch.Tensor) -> str:
    """SGLang's wire form: base64 of the int32 bytes, row-major [tokens, layers, topk]."""
    return base64.b64encode(routed.to(WIRE_DTYPE).contiguous().numpy().tobytes()).decode("ascii")


def decode(blob: str, num_layers: int, topk: int) -> torch.Tensor:
    """int16 [tokens, num_layers, topk] from SGLang's `meta_info.routed_experts`."""
    import numpy as np

    flat = torch.from_numpy(np.frombuffer(base64.b64decode(blob), dtype=np.int32).copy())
    if flat.numel() % (num_layers * topk):
        raise ValueError(
            f"routed_experts: {flat.numel()} ids are not a multiple of layers x topk = {num_layers} x {topk}"
        )
    return flat.reshape(-1, num_layers, topk).to(torch.int16)


def pad_to_tokens(routed: Optional[torch.Tensor], num_tokens: int, start: int = 0) -> Optional[torch.Tensor]:
    """The engine's experts for positions [start, start + len) as a [num_tokens, layers, topk]
    tensor, -1 elsewhere (SGLang reports up to the second-to-last token; a step's tokens are
    prompt + response)."""
    if routed is None:
        return None
    out = torch.full((num_tokens, *routed.shape[1:]), -1, dtype=torch.int16)
    n = max(0, min(routed.size(0), num_tokens - start))
    out[start : start + n] = routed[:n].to(torch.int16)
    return out
