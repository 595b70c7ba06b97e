"""Training on megatron-core: the plugin, packing, log-probs, the model, MoE routers."""
