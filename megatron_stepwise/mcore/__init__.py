"""megatron-core integration, by concern: `train/` (the plugin, packing, log-probs, the model,
MoE routers), `weights/` (HF conversion, distributed checkpoints, crash-safe files, the push
to the fleet), `runtime/` (process groups and the CPU stand-ins).

Import the submodules by their full path. `layer_spec` and `transformer_config` (the decoder spec
and config a host-built model needs, train/model.py) are in the package root's public API:
`from megatron_stepwise import layer_spec, transformer_config`.
"""
