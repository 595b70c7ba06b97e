"""torchrun worker: examples/megatron_lm_pretrain.py under Megatron-LM's real `pretrain()`, then the
same mini-batches through `plugin.train_minibatch` from the same initial weights, for several
layouts one after another in the same processes (Megatron-LM's global state is torn down between
them, so each layout starts as a fresh launch would; one launch pays the imports once).

    torchrun --nproc-per-node 2 tests/workers/megatron_lm_worker.py OUT_DIR LAYOUTS_JSON

LAYOUTS_JSON maps a layout name to its Megatron-LM flags. For each layout, rank 0 of the last
pipeline stage writes OUT_DIR/<name>/result.pt: per step, what Megatron-LM logged (the loss dict
its train_step reduced, the grad norm) and the reference metrics, plus both runs' final
parameters; the last rank (the one Megatron-LM prints its console on) prints LAYOUT_MARKER
before the layout's console lines. Needs MEGATRON_LM_SRC (the test skips without it).
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import load_script
from worker_entry import run_worker

from megatron_stepwise.mcore.train.plugin import StepwisePlugin
from megatron_stepwise.mcore.weights import full_views as W

example = load_script(Path(__file__).resolve().parents[2] / "examples" / "megatron_lm_pretrain.py")
SEED = 7
LAYOUT_MARKER = "[megatron_lm_worker] layout "  # + the name: where a layout's console output starts


def deterministic_provider(*args, **kwargs):
    """The example's model provider with layout-independent initial weights, so both runs start
    from the same parameters."""
    model = example.model_provider(*args, **kwargs)
    W.init_deterministic([model], seed=SEED)
    return model


def main() -> None:
    out_dir, layouts = Path(sys.argv[1]), json.loads(sys.argv[2])
    from megatron_stepwise.mcore.runtime.megatron_lm_cpu import enable_megatron_lm_cpu

    sys.path.append(os.environ["MEGATRON_LM_SRC"])
    enable_megatron_lm_cpu()
    from megatron.training import training

    for name, flags in layouts.items():
        if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
            print(LAYOUT_MARKER + name, flush=True)
        run_layout(out_dir / name, flags)
        # What pretrain() set up (arguments, parallel groups, micro-batch calculator, rerun state
        # machine) goes, as at the end of a process; the gloo process group itself is reused.
        training.destroy_global_state()
        example.datasets_provider.__defaults__[-1].clear()  # the example's per-process stream cache (VPP)


def run_layout(out_dir: Path, flags: list[str]) -> None:
    """One layout: pretrain() with `flags`, then the reference; writes out_dir/result.pt."""
    plugin = example.make_plugin()
    from megatron.core import parallel_state as ps
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
    from megatron.training import get_args, training

    logged, captured = [], {}
    log = training.training_log
    setup = training.setup_model_and_optimizer

    def training_log(*args, **kwargs):
        arguments = inspect.signature(log).bind(*args, **kwargs).arguments
        logged.append(
            {
                "loss_dict": {k: float(v) for k, v in arguments["loss_dict"].items()},
                "grad_norm": float(arguments["grad_norm"]),
            }
        )
        return log(*args, **kwargs)

    def setup_model_and_optimizer(*args, **kwargs):
        captured["model"], captured["optimizer"], scheduler = setup(*args, **kwargs)
        return captured["model"], captured["optimizer"], scheduler

    training.training_log = training_log
    training.setup_model_and_optimizer = setup_model_and_optimizer
    try:
        example.run(plugin, flags, model_provider=deterministic_provider)
    finally:  # the next layout wraps the originals, not these wrappers
        training.training_log, training.setup_model_and_optimizer = log, setup
    pretrain_params = W.full_state(captured["model"])

    # The reference: Megatron-LM's model and optimizer built again from the same arguments and
    # initial weights, the same mini-batches through the plugin's own driver.
    model, optimizer, _ = setup(deterministic_provider, ModelType.encoder_or_decoder)
    config = model[0].config  # what Megatron-LM's train() sets before its loop
    # NaN checks of gradients are Megatron-LM's train_step business (its rerun state machine).
    get_rerun_state_machine().set_mode(RerunMode.DISABLED)
    config.grad_scale_func, config.finalize_model_grads_func = optimizer.scale_loss, training.finalize_model_grads
    reference = StepwisePlugin(
        plugin.loss_config,
        max_tokens_per_microbatch=plugin.max_tokens,
        vocab_size=plugin.vocab_size,
        num_microbatches=get_num_microbatches(),
    )
    iterations = get_args().train_iters
    ref_metrics = [
        reference.train_minibatch(model, optimizer, batch)
        for batch in itertools.islice(example.rollout_batches(), iterations)
    ]
    result = {
        "logged": logged,
        "reference": ref_metrics,
        "pretrain_params": pretrain_params,
        "reference_params": W.full_state(model),
        "num_microbatches": get_num_microbatches(),
    }
    if (
        ps.is_pipeline_last_stage(ignore_virtual=True)
        and ps.get_data_parallel_rank() == 0
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    ):
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(result, out_dir / "result.pt")
    dist.barrier()


if __name__ == "__main__":
    run_worker(main)
