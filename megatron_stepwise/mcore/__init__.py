"""megatron-core integration, by concern: `train/` (the plugin, packing, log-probs, the model,
MoE routers), `weights/` (HF conversion, distributed checkpoints, crash-safe files, the push
to the fleet), `runtime/` (process groups and the CPU stand-ins).

Import the submodules by their full path. `layer_spec` (the decoder spec a host-built model
needs) and `transformer_config` are exported here and imported on first use, the third case
of the lazy-import rule (docs/architecture.md, Layers): this package's import stays light.
"""


def __getattr__(name: str):
    if name in ("layer_spec", "transformer_config"):
        from megatron_stepwise.mcore.train import model

        return getattr(model, name)
    raise AttributeError(f"module 'megatron_stepwise.mcore' has no attribute {name!r}")
