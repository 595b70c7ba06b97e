"""Megatron (megatron-core 0.16) integration.

- `runtime`: process groups (torchrun/SLURM env), NCCL on GPU, gloo + `cpu_compat` on CPU.
- `cpu_compat`: scoped redirection of megatron-core's hard-coded CUDA uses to the CPU.
- `model`: GPTModel from a Llama/Qwen2 HF config (TE or local spec), DDP-wrapped model chunks.
- `local_layers`: packed causal attention (with CP) and SP-aware RMSNorm for the local spec.
- `packing`: step rows -> THD packed micro-batches, trained positions, the CP split.
- `logprobs`: vocab-parallel log-probs and entropy at trained positions only.
- `plugin`: `StepwisePlugin` (forward_step / train_minibatch / compute_logprobs).
- `routing_replay`: MoE rollout routing replay, the routers take the engine's experts.
- `weights`: full (unsharded) parameter and gradient views by canonical name.
- `hf_mapping`: Megatron <-> Hugging Face names and layouts (pure functions).
- `convert`: HF import/export and bucketed weight streaming at any TP/PP.
- `sync`: `WeightSync`, pushing the policy's weights to the rollout fleet (disk/tensor/distributed).
- `checkpoint`: dist_checkpointing save / load / resume, atomic, keep-last-K.
- `fileops`: crash-safe files and renames for checkpoints and exports.

Most submodules import megatron-core; import them explicitly. `layer_spec` (the decoder spec a
model built by the host needs: packed causal attention, or TE's) and `transformer_config` are
exported here, imported on first use (`model_contract` checks a host-built model).
"""


def __getattr__(name: str):
    if name in ("layer_spec", "transformer_config"):
        from megatron_stepwise.megatron import model

        return getattr(model, name)
    raise AttributeError(f"module 'megatron_stepwise.megatron' has no attribute {name!r}")
