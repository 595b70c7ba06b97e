"""What the plugin needs of a megatron-core model built by the host (docs/megatron.md, "Bring your
own model"), checked once per model before its first forward, each failure naming the fix.

Models built by `mcore/train/model.py` meet it by construction; a host's own `GPTModel` meets it
when built with `megatron_stepwise.layer_spec(config, use_te=...)` (or TE's spec) and
a `TransformerConfig` like `mcore/train/model.py`'s `transformer_config`.
"""

from __future__ import annotations

from megatron_stepwise.steps import StepwiseBatchError


class ModelContractError(StepwiseBatchError):
    """A host-built model the plugin cannot drive; the message names the fix."""


LAYER_SPEC_FIX = (
    "build the decoder with megatron_stepwise.layer_spec(config, use_te=False) (local: "
    "packed causal attention) or use_te=True (Transformer Engine)"
)


def check_model_contract(gpt) -> None:
    """Raise ModelContractError for the first unmet requirement; remembered per model once met."""
    if getattr(gpt, "_stepwise_contract_ok", False):
        return
    for attr in ("decoder", "config", "vocab_size"):
        if not hasattr(gpt, attr):
            raise ModelContractError(
                f"the model has no {attr!r}: the plugin drives megatron-core's GPTModel "
                "(megatron.core.models.gpt.GPTModel), unwrapped from DDP/Float16Module"
            )
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for i, layer in enumerate(getattr(gpt.decoder, "layers", [])):
        core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
        if type(core) is DotProductAttention:
            raise ModelContractError(
                f"decoder layer {i}: core attention is megatron-core's local DotProductAttention, which refuses "
                f"packed sequences (the plugin packs every micro-batch's rows); {LAYER_SPEC_FIX}"
            )
    gpt._stepwise_contract_ok = True
