"""The gateway's recorded steps trained through megatron-core, merged and unmerged (for
tests/workers/megatron_worker.py, layouts with `gateway=1`).

The test process records a context-managing agent's calls through a `Gateway` (a prefix break
from its fourth call on) and saves the steps; here they go through `prepare` (the trainer's
path: GRPO advantages, `merge_steps` on or off) and one forward and backward of the plugin on
megatron-core's GPTModel at this layout, per merge-invariant reduction. What comes back per run:
the reduced metrics, every gradient (this stage's, full shapes) and each row as the model was
fed it (its packed tokens and which of them were trained), so the test can check that each step
trained on exactly what it sent and that merging changed nothing.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.algo.losses import LossConfig
from megatron_stepwise.algo.prepare import prepare
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.train.plugin import StepwisePlugin
from megatron_stepwise.mcore.weights import full_views as W

REDUCTIONS = ("token_mean", "trajectory_mean")
# Rows of the window agent are under 100 tokens: every prefix-holding run fits one merged row.
BUDGET = 128
# On-policy PPO (no old log-probs: ratio 1, as the trainer's first update), the engine's
# log-probs as truncated importance weights, an entropy bonus (a full-vocabulary term).
LOSS = LossConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.28, entropy_coef=0.01, tis="token", tis_cap=2.0)


def build_model(vocab: int, overrides: dict, seed: int) -> list:
    """The tiny GPT with the gateway tokenizer's vocabulary, on the current parallel state."""
    cfg = M.tiny_config(vocab_size=vocab)
    return M.build_model_chunks(cfg, config_overrides=overrides, init=lambda c: W.init_deterministic(c, seed=seed))


def fed_rows(inputs) -> dict[int, dict]:
    """Mini-batch row -> the tokens megatron's forward got for it and the positions (within the
    row) of its trained tokens, read back from the packed micro-batches."""
    rows = {}
    for mb in inputs.microbatches:
        tokens, cu = mb.tokens[0], mb.cu_seqlens.long()
        for k, row in enumerate(mb.rows):
            start, end = int(cu[k]), int(cu[k + 1])
            trained = mb.pred_index[mb.row_ids == row] + 1  # a hidden state predicts the next token
            assert torch.equal(tokens[trained], mb.targets[mb.row_ids == row])
            rows[row] = {"tokens": tokens[start:end].tolist(), "trained": (trained - start).tolist()}
    return rows


def forward_backward(chunks: list, reduction: str, batch) -> dict:
    """One forward and backward of `batch` (gradients left in the buffers): what the model was fed
    and the reduced metrics."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    plugin = StepwisePlugin(dataclasses.replace(LOSS, reduction=reduction), max_tokens_per_microbatch=BUDGET)
    inputs = plugin.prepare_minibatch(chunks, batch)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=plugin.forward_step,
        data_iterator=inputs.data_iterator(),
        model=chunks,
        num_microbatches=inputs.num_microbatches,
        seq_length=inputs.seq_length,
        micro_batch_size=1,
        forward_only=False,
    )
    return {"rows": fed_rows(inputs), "metrics": plugin.reduce_metrics(losses), "num_rows": batch.num_rows}


def train_gateway_steps(steps_path: str, overrides: dict, seed: int) -> dict:
    """`{f"{reduction}/{merged|unmerged}": run}` for the saved steps (see the module doc)."""
    saved = torch.load(steps_path, weights_only=False)
    chunks = build_model(saved["vocab"], overrides, seed)
    groups = groups_of(saved["steps"])
    out = {}
    for reduction in REDUCTIONS:
        for merged in (False, True):
            batch, _ = prepare(groups, merge_steps=merged, max_tokens=BUDGET)
            run = forward_backward(chunks, reduction, batch)
            run["grads"] = W.full_state(chunks, grads=True)
            out[f"{reduction}/{'merged' if merged else 'unmerged'}"] = run
    return out
