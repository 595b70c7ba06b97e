"""One process (gloo, world size 1): a host-built GPTModel with megatron-core's local spec gets
the model-contract error before its first forward; the same model with `layer_spec` trains.
Prints one JSON line. Run by tests/integration/test_model_contract.py."""

import json
import os
import socket

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402

from megatron_stepwise import LossConfig, Step, StepBatch, TrajectoryID, layer_spec, transformer_config  # noqa: E402  # noqa: E402
from megatron_stepwise.hf.arch import arch_from_hf  # noqa: E402
from megatron_stepwise.mcore.runtime.runtime import init_distributed  # noqa: E402
from megatron_stepwise.mcore.train.model import tiny_config  # noqa: E402
from megatron_stepwise.mcore.train.model_contract import ModelContractError  # noqa: E402
from megatron_stepwise.mcore.train.plugin import StepwisePlugin  # noqa: E402

init_distributed(1, 1, 1)
arch = arch_from_hf(tiny_config(num_layers=2))
config = transformer_config(arch, use_te=False)


def model(spec):
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
    )
    calls = []
    gpt.register_forward_pre_hook(lambda *_: calls.append(1))
    return gpt, calls


steps = [Step(TrajectoryID("p", k), [1, 2, 3], [4, 5], [1, 1], reward=float(k), is_last_step=True) for k in range(2)]
batch = StepBatch.from_steps(steps)
plugin = StepwisePlugin(LossConfig(), max_tokens_per_microbatch=64)
out = {}
own, calls = model(get_gpt_layer_local_spec())  # what a host writes from megatron-core's docs
try:
    plugin.compute_logprobs_flat([own], batch)
    out["error"] = None
except ModelContractError as e:
    out["error"] = str(e)
out["forwards_before_error"] = len(calls)
ours, calls = model(layer_spec(config, use_te=False))
logprobs = plugin.compute_logprobs_flat([ours], batch)
out["fixed_forwards"] = len(calls)
out["fixed_logprobs"], out["tokens"] = int(logprobs.numel()), int(batch.tokens.numel())
print(json.dumps(out))
