"""`StepwisePlugin`: step-wise RL training inside a megatron-core training loop.

It gives an existing loop the `forward_step(data_iterator, model) -> (output_tensor, loss_func)`
that megatron-core's schedules take, a data iterator of packed micro-batches, and two drivers:
`train_minibatch` (one optimizer step on one mini-batch) and `compute_logprobs` (forward-only
log-probs). Token weights are computed once per mini-batch and the loss function undoes
megatron-core's one rescaling, so the gradient is the same under any TP/PP/DP/CP/micro-batch
split. All input errors are raised before any collective.

How each `calculate_per_token_loss` setting is undone, and sharded inputs: docs/megatron.md,
'Loss normalisation: exactly once' and 'The plugin's loss scaling'.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_stepwise.algo.losses import combine_metric_partials
from megatron_stepwise.algo.rows import RowTable
from megatron_stepwise.algo.shards import (
    LOGPROBS,
    TRAIN,
    HostLoopMismatchError,
    MinibatchShard,
    ShardDecision,
    ShardLayout,
    ShardPlanner,
    UnsupportedLayoutError,
    check_tokens,
)
from megatron_stepwise.mcore.runtime.runtime import ParallelLayout, comm_device, current_layout
from megatron_stepwise.mcore.train.logprobs import check_temperature, output_layer_bypassed, trained_position_logprobs
from megatron_stepwise.mcore.train.minibatch_inputs import (
    MinibatchInputs,
    PendingMicroBatch,
    check_host_count,
    host_count,
)
from megatron_stepwise.mcore.train.model import unwrap
from megatron_stepwise.mcore.train.model_contract import check_model_contract
from megatron_stepwise.mcore.train.packing import PackedMicroBatch, alignment_for, pack_rows, split_for_context_parallel
from megatron_stepwise.mcore.train.router_losses import RoutedMicroBatch, RouterLosses, check_recompute
from megatron_stepwise.mcore.train.router_losses import install as install_router_hooks
from megatron_stepwise.steps import Step, StepBatch


class StepwisePlugin:
    """Step-wise policy-gradient training for megatron-core models (see module docstring).

    loss_config: the `algo.losses.LossConfig` (policy loss, clipping, reduction, KL, entropy...).
    max_tokens_per_microbatch: token budget of one packed micro-batch, alignment padding included
        with the package planner (it packs to the layout's alignment); a step longer than this
        is an error.
    temperature: the rollout's sampling temperature T. Every trained position is scored as
        `log_softmax(logits / T)`, the distribution the engine sampled from and reported log-probs
        of, so the policy ratio, TIS/IcePop weights, KL, entropy and the train-vs-rollout gap
        compare like with like. Must be > 0 (greedy rollouts cannot be trained on).
    num_microbatches: a fixed number of micro-batches per mini-batch and DP rank, for host loops
        that run a fixed count (Megatron-LM's `pretrain`: global_batch_size / (micro_batch_size x
        DP)). The plan is padded to it with loss-neutral empty micro-batches; a mini-batch that
        needs more is an error naming both numbers. None: as many as the token budget needs.
    vocab_size: the real vocabulary (the HF config's vocab_size) when the megatron model's is
        padded (Megatron-LM's --make-vocab-size-divisible-by): padding rows are left out of the
        softmax so log-probs match the rollout engine. Default: what `model.build_gpt_model`
        records on the model, else the model's own vocab_size.
    The algorithm hooks default to `megatron_stepwise.algo` and can be replaced:
    `policy_loss(inputs, cfg) -> (partial_sum, metrics)`, `token_weights(batch, reduction,
    max_response_len=...) -> [T]`, `plan_microbatches(lengths, dp_size=, max_tokens=)`,
    `loss_inputs(**fields)` (the `LossInputs` constructor).
    """

    def __init__(
        self,
        loss_config: Any,
        *,
        max_tokens_per_microbatch: int,
        logprob_chunk_tokens: Optional[int] = None,
        pad_token_id: int = 0,
        temperature: float = 1.0,
        num_microbatches: Optional[int] = None,
        vocab_size: Optional[int] = None,
        policy_loss: Optional[Callable] = None,
        token_weights: Optional[Callable] = None,
        plan_microbatches: Optional[Callable] = None,
        loss_inputs: Optional[Callable] = None,
    ):
        if max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
        check_temperature(temperature)
        if num_microbatches is not None and num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.loss_config, self.temperature = loss_config, float(temperature)
        self.chunk_tokens, self.pad_token_id, self.vocab_size = logprob_chunk_tokens, pad_token_id, vocab_size
        # Which rows each DP rank trains, in which micro-batches, and the loss's denominators.
        self.shards = ShardPlanner(
            loss_config,
            max_tokens=int(max_tokens_per_microbatch),
            num_microbatches=num_microbatches,
            plan_microbatches=plan_microbatches,
            token_weights=token_weights,
        )
        self._policy_loss, self._loss_inputs = policy_loss, loss_inputs
        self._in_own_schedule = False  # train_minibatch / compute_logprobs pass the plan's count themselves
        # MoE router balance / z losses (algo.loss.router_aux_coef / router_z_coef) and expert-load metrics.
        self.router_losses = RouterLosses(
            aux_coef=getattr(loss_config, "router_aux_coef", 0.0), z_coef=getattr(loss_config, "router_z_coef", 0.0)
        )

    @property
    def max_tokens(self) -> int:
        return self.shards.max_tokens

    @property
    def num_microbatches(self) -> Optional[int]:
        return self.shards.num_microbatches

    # ----------------------------------------------------------------- algorithm hooks
    def _algo(self):
        if None in (self._policy_loss, self._loss_inputs):
            from megatron_stepwise.algo import losses

            self._policy_loss = self._policy_loss or losses.policy_loss
            self._loss_inputs = self._loss_inputs or losses.LossInputs

    # ----------------------------------------------------------------- input preparation
    @staticmethod
    def as_batch(steps_or_batch: Union[StepBatch, Sequence[Step]]) -> StepBatch:
        if isinstance(steps_or_batch, StepBatch):
            return steps_or_batch
        return StepBatch.from_steps(list(steps_or_batch))

    def _vocab_size(self, gpt) -> int:
        """The vocabulary log-probs are over (the model's rows minus any padding)."""
        vocab = self.vocab_size or getattr(gpt, "unpadded_vocab_size", None) or gpt.vocab_size
        if vocab > gpt.vocab_size:
            raise ValueError(f"vocab_size={vocab} is larger than the model's {gpt.vocab_size} vocabulary rows")
        return int(vocab)

    @staticmethod
    def _layout(model_chunks) -> ParallelLayout:
        """This rank's layout; `model_chunks` must be all of this rank's chunks, or one of them (a
        host loop's forward_step sees one at a time)."""
        layout = current_layout()
        if len(model_chunks) not in (1, layout.vpp):
            raise UnsupportedLayoutError(
                f"got {len(model_chunks)} model chunks, but megatron's parallel state has {layout.vpp} per rank "
                "(virtual_pipeline_model_parallel_size): pass all of this rank's chunks"
            )
        return layout

    def prepare_minibatch(
        self,
        model_chunks: list,
        steps_or_batch: Union[StepBatch, Sequence[Step]],
        *,
        mode: str = TRAIN,
        num_microbatches: Optional[int] = None,
    ) -> MinibatchInputs:
        """Validate, weight (once per mini-batch), plan and pack this DP rank's micro-batches, for a
        host loop that runs the schedule itself.

        `num_microbatches` (default: the plugin's) pads the plan to a fixed count. When megatron's
        micro-batch calculator is set up (Megatron-LM), its count must be the plan's: checked
        here, on every rank before any collective.
        """
        inputs = self._prepare(model_chunks, steps_or_batch, mode=mode, num_microbatches=num_microbatches)
        check_host_count(inputs.num_microbatches)
        return inputs

    def _prepare(self, model_chunks: list, steps_or_batch, *, mode: str, num_microbatches: Optional[int] = None):
        """This rank's packed micro-batches: of its shard, or of its part of a whole mini-batch."""
        if isinstance(steps_or_batch, MinibatchShard):
            planned = len(steps_or_batch.decision.plan)
            if num_microbatches is not None and planned != num_microbatches:
                raise HostLoopMismatchError(
                    f"this shard was planned as {planned} micro-batches but the host loop runs num_microbatches="
                    f"{num_microbatches}: pass the same num_microbatches to plan_shards"
                )
            return self._pack(model_chunks, steps_or_batch, mode=mode)
        shard = self.plan_shards(
            model_chunks,
            steps_or_batch,
            mode=mode,
            num_microbatches=num_microbatches,
            only=self._layout(model_chunks).dp_rank,
        )[0]
        return self._pack(model_chunks, shard, mode=mode)

    def plan_shards(
        self,
        model_chunks: list,
        steps_or_batch: Union[StepBatch, Sequence[Step]],
        *,
        mode: str = TRAIN,
        num_microbatches: Optional[int] = None,
        only: Optional[int] = None,
    ) -> list[MinibatchShard]:
        """Decide a mini-batch for every data-parallel rank at once: validate it, weight its tokens
        (once, over the whole mini-batch), plan every rank's micro-batches, and cut one
        `MinibatchShard` per DP rank (or only rank `only`'s). The decision depends on the layout,
        not on the rank, so one process can make it for all (the trainer's driver does) and each
        rank trains its shard with `train_minibatch(chunks, optimizer, shard)`."""
        batch = self.as_batch(steps_or_batch)
        need = ("loss_mask", "advantages") if mode == TRAIN else ("loss_mask",)
        check_tokens(batch, self._vocab_size(unwrap(model_chunks[0])), need=need)
        layout = self._shard_layout(model_chunks)
        return self.shards.plan(batch, layout, mode=mode, num_microbatches=num_microbatches, only=only)

    def decide_shards(
        self,
        model_chunks: list,
        rows: RowTable,
        *,
        mode: str = TRAIN,
        num_microbatches: Optional[int] = None,
        only: Optional[int] = None,
        weigh: bool = True,
    ) -> list[ShardDecision]:
        """`plan_shards` from the rows' lengths and counts alone (no token): every DP rank's rows,
        micro-batches, totals and loss denominators. Whoever holds a rank's rows (in `rows` order)
        turns its decision into a `MinibatchShard` with `ShardDecision.cut`, so the process that
        decides never needs the token data. The tokens' own checks (vocabulary, fields) are the
        holder's: the trainer's agent workers validate the steps they produce."""
        layout = self._shard_layout(model_chunks)
        return self.shards.decide(rows, layout, mode=mode, num_microbatches=num_microbatches, only=only, weigh=weigh)

    def _shard_layout(self, model_chunks: list) -> ShardLayout:
        """What a shard decision needs of this model and layout, after the checks that refuse the
        model (raised before any collective)."""
        gpt = unwrap(model_chunks[0])
        layout = self._layout(model_chunks)
        cfg = gpt.config
        if getattr(cfg, "mtp_num_layers", None):
            # MTP heads reuse the output layer inside GPTModel, which the plugin bypasses.
            raise UnsupportedLayoutError("multi-token prediction (mtp_num_layers) is not supported by the plugin")
        check_model_contract(gpt)  # a host-built model: the fix named before the first forward
        if cfg.pipeline_model_parallel_size > 1 and not cfg.variable_seq_lengths and layout.vpp == 1:
            # Packed micro-batches differ in length; fixed-shape p2p would fail mid-schedule.
            raise UnsupportedLayoutError(
                "pipeline parallelism needs config.variable_seq_lengths=True (Megatron-LM: --variable-seq-lengths): "
                "packed micro-batches have different lengths"
            )
        return ShardLayout(
            dp=layout.dp,
            cp=layout.cp,
            pp=cfg.pipeline_model_parallel_size,
            vpp=layout.vpp,
            align=alignment_for(cfg.tensor_model_parallel_size, cfg.sequence_parallel, layout.cp),
        )

    def _pack(self, model_chunks: list, shard: "MinibatchShard", *, mode: str) -> MinibatchInputs:
        """Pack this rank's shard into micro-batches (and split them over CP)."""
        self._algo()
        gpt = unwrap(model_chunks[0])
        layout = self._layout(model_chunks)
        dp, dp_rank, cp, cp_rank, chunks = layout.dp, layout.dp_rank, layout.cp, layout.cp_rank, layout.vpp
        cfg, batch, decision = gpt.config, shard.batch, shard.decision
        if (decision.dp_size, decision.dp_rank) != (dp, dp_rank):
            raise HostLoopMismatchError(
                f"a shard for data-parallel rank {decision.dp_rank} of {decision.dp_size} reached rank {dp_rank} of {dp}"
            )
        align = alignment_for(cfg.tensor_model_parallel_size, cfg.sequence_parallel, cp)
        fields = {}
        if mode == TRAIN:
            for name in ("weights", "advantages", "old_logprobs", "ref_logprobs"):
                if name in batch.token_fields:
                    fields[name] = batch.token_fields[name].float()
            if decision.rollout_logprobs:
                fields["rollout_logprobs"] = batch.token_fields["rollout_logprobs"].float()
                fields["rollout_logprobs_known"] = batch.rollout_logprobs_known()
        mbs = []
        for i, rows in enumerate(decision.plan):
            mb = pack_rows(
                batch,
                rows,
                align=align,
                pad_token_id=self.pad_token_id,
                max_tokens=self.max_tokens,
                cp=cp,
                pad_to=decision.pad_to,
            )
            mb.fields = {k: v[mb.token_index] for k, v in fields.items()}
            mb.mode, mb.rollout_logprobs_complete = mode, mode == TRAIN and decision.rollout_logprobs_complete
            mb = split_for_context_parallel(mb, cp, cp_rank) if cp > 1 else mb
            mb.metric_share = 1.0 if (i, dp_rank, cp_rank) == (0, 0, 0) else 0.0
            mb.minibatch_rows, mb.minibatch_tokens = decision.data_rows, decision.data_tokens  # router loss normalisers
            mbs.append(mb)
        num_mb = len(mbs)
        for mb in mbs:
            mb.loss_scale = float(decision.trained_tokens) if cfg.calculate_per_token_loss else float(num_mb * dp)
            mb.plan_size = num_mb
        return MinibatchInputs(
            mbs, num_mb, decision.pad_to or max(mb.seq_len for mb in mbs), num_chunks=chunks, shard=shard
        )

    def microbatch_stream(self, minibatches: Iterable[Union[StepBatch, Sequence[Step]]]) -> Iterator:
        """A data iterator for host loops that hand `forward_step` nothing but an iterator and run
        a fixed number of micro-batches per optimizer step (Megatron-LM's `pretrain` with
        `--dataloader-type external`). For each mini-batch (a StepBatch or steps, identical on
        every rank) it yields exactly that many micro-batches: `num_microbatches`, else megatron's
        `get_num_microbatches()`. `forward_step` packs the mini-batch for its model on meeting
        the first; the plan is padded with loss-neutral micro-batches, and a mini-batch that
        needs more is a HostLoopMismatchError naming both counts."""
        for minibatch in minibatches:
            count = self.num_microbatches or host_count()
            if count is None:
                raise ValueError(
                    "microbatch_stream needs a fixed micro-batch count: pass StepwisePlugin(num_microbatches=K) or "
                    "initialise megatron's micro-batch calculator (Megatron-LM's pretrain does)"
                )
            packed: dict = {}
            for index in range(count):
                yield PendingMicroBatch(minibatch, count, index, packed)

    def microbatch_streams(self, minibatches: Iterable[Union[StepBatch, Sequence[Step]]], num_chunks: int) -> tuple:
        """`microbatch_stream` for each of `num_chunks` model chunks (virtual pipeline stages, whose
        schedule takes one data iterator per chunk): one source read once, each mini-batch packed
        once and shared by every chunk."""
        return itertools.tee(self.microbatch_stream(minibatches), num_chunks)

    # ----------------------------------------------------------------- megatron hooks
    def forward_step(
        self, data_iterator, model, checkpoint_activations_microbatch=None, *, return_schedule_plan: bool = False
    ):
        """megatron-core forward step: packed micro-batch -> (output tensor, loss function).

        `checkpoint_activations_microbatch` (passed by megatron's schedules) is left to the model
        config's recompute settings.
        """
        if return_schedule_plan:
            raise UnsupportedLayoutError(
                "forward_step(return_schedule_plan=True) (expert-parallel A2A overlap) is not supported by the plugin"
            )
        mb = next(data_iterator)
        if isinstance(mb, PendingMicroBatch):
            mb = mb.resolve(self, model)
        if not self._in_own_schedule:
            check_host_count(mb.plan_size)
        gpt = unwrap(model)
        device = next(gpt.parameters()).device
        bypass = output_layer_bypassed(gpt) if gpt.post_process else contextlib.nullcontext()
        from megatron_stepwise.mcore.train import routing_replay  # imports megatron-core

        # Routing replay (algo.routing_replay): this chunk's routers take the engine's experts.
        with bypass, self.router_losses.running(self._routed(mb, gpt)), routing_replay.for_microbatch(gpt, mb):
            output = model(
                mb.tokens.to(device), mb.position_ids.to(device), None, packed_seq_params=mb.packed_seq_params(device)
            )
        return output, functools.partial(self._loss_func, mb, gpt)

    def _routed(self, mb: PackedMicroBatch, gpt) -> Optional[RoutedMicroBatch]:
        """What this micro-batch tells the MoE routers (None: a dense model, or log-probs only)."""
        if not hasattr(gpt, "_stepwise_moe"):
            gpt._stepwise_moe = install_router_hooks(gpt)
        if not gpt._stepwise_moe or mb.mode != TRAIN or mb.token_segment is None:
            return None
        if self.router_losses.active:
            check_recompute(gpt.config)
        n = len(mb.rows)
        return RoutedMicroBatch(
            token_segment=mb.token_segment,
            row_tokens=(mb.cu_seqlens[1 : n + 1] - mb.cu_seqlens[:n]).long(),
            minibatch_rows=mb.minibatch_rows,
            minibatch_tokens=mb.minibatch_tokens,
            loss_scale=mb.loss_scale,
        )

    def _loss_func(self, mb: PackedMicroBatch, gpt, output_tensor, non_loss_data: bool = False):
        logprobs, entropy = trained_position_logprobs(
            output_tensor,
            mb.pred_index,
            mb.targets,
            gpt,
            chunk_tokens=self.chunk_tokens,
            with_entropy=mb.mode == TRAIN,
            vocab_size=self._vocab_size(gpt),
            temperature=self.temperature,
        )
        if mb.mode == LOGPROBS:
            data = {"token_index": mb.token_index, "logprobs": logprobs.detach().cpu()}
            return data if non_loss_data else (output_tensor.reshape(-1)[:0].sum(), data)
        return self._train_loss(mb, gpt, output_tensor, logprobs, entropy)

    def _train_loss(self, mb, gpt, output_tensor, logprobs, entropy):
        device = logprobs.device
        f = {k: v.to(device) for k, v in mb.fields.items()}
        old = f.get("old_logprobs")
        inputs = self._loss_inputs(
            logprobs=logprobs,
            old_logprobs=old if old is not None else logprobs.detach(),
            advantages=f["advantages"],
            weights=f["weights"],
            segment_ids=mb.row_ids.to(device),
            rollout_logprobs=f.get("rollout_logprobs") if mb.rollout_logprobs_complete else None,
            ref_logprobs=f.get("ref_logprobs"),
            entropy=entropy,
        )
        partial, metrics = self._policy_loss(inputs, self.loss_config)
        # Exactly 0 with a zero gradient, but it keeps the graph connected to the model output
        # for micro-batches without trained tokens (PP needs a backward through every stage).
        partial = partial + output_tensor.reshape(-1)[:0].sum()
        metrics = dict(metrics, loss=partial)
        metrics["tokens/trained"] = torch.tensor(float(mb.num_trained))
        metrics["tokens/total"] = torch.tensor(float(mb.num_real_tokens))
        reported = self._loss_dict(mb, metrics, device)
        if "rollout_logprobs" in f:
            # |current - rollout| over the trained tokens whose rollout log-prob is known.
            known = f["rollout_logprobs_known"]
            gap = (logprobs.detach() - f["rollout_logprobs"]).abs()
            reported["logprob_gap/train_vs_rollout"] = torch.stack([gap[known].double().sum(), known.double().sum()])
        scaled = partial * mb.loss_scale
        if gpt.config.calculate_per_token_loss:
            return scaled, torch.tensor(mb.num_trained, dtype=torch.int, device=device), reported
        return scaled, reported

    def _loss_dict(self, mb: PackedMicroBatch, metrics: dict, device) -> dict[str, torch.Tensor]:
        """The loss function's metrics in the form Megatron-LM's `train_step` reduces: each a float64
        `[numerator, denominator]` pair that it sums over micro-batches and DP x CP ranks and divides.
        A metric is a sum of micro-batch partials, so its denominator is 1 on exactly one micro-batch
        (`metric_share`) and the logged ratio is the mini-batch total. Max-type metrics (`*_max`)
        cannot be reduced that way: they are reported, as 1-element tensors, only to the plugin's
        own drivers, whose `reduce_metrics` takes their maximum."""
        share = torch.tensor(mb.metric_share, dtype=torch.float64, device=device)
        out = {}
        for name, value in metrics.items():
            value = value.detach().to(device=device, dtype=torch.float64).reshape(())
            if not name.endswith("_max"):
                out[name] = torch.stack([value, share])
            elif self._in_own_schedule:
                out[name] = value.reshape(1)
        return out

    # ----------------------------------------------------------------- reductions
    @staticmethod
    def reduce_metrics(losses: list) -> dict[str, float]:
        """Reduce the loss function's metrics over micro-batches (last stage) and DP x CP ranks the
        way Megatron-LM's `train_step` does (`[numerator, denominator]` pairs: both summed, then
        divided), taking the maximum of 1-element max-type metrics, and share the result with
        every pipeline stage. Identical on every rank."""
        from megatron.core import parallel_state as ps

        if ps.is_pipeline_last_stage(ignore_virtual=True):
            # This rank's micro-batches (pairs summed, maxima maxed), in float64.
            local = combine_metric_partials(
                [{k: v.detach().double().cpu().reshape(-1) for k, v in item.items()} for item in losses]
            )
            combined = {}
            for is_max in (False, True):
                names = sorted(k for k in local if (local[k].numel() == 1) == is_max)
                if not names:
                    continue
                vec = torch.cat([local[k] for k in names])
                if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
                    buf = vec.to(comm_device())
                    op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM
                    dist.all_reduce(buf, op=op, group=ps.get_data_parallel_group(with_context_parallel=True))
                    vec = buf.cpu()
                if is_max:
                    combined.update(zip(names, vec.tolist()))
                else:
                    pairs = vec.reshape(-1, 2)
                    combined.update(zip(names, (pairs[:, 0] / pairs[:, 1]).tolist()))
            payload = [combined]
        else:
            payload = [None]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(
                payload, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
            )
        return payload[0]

    # ----------------------------------------------------------------- drivers
    def _run_schedule(self, model_chunks: list, inputs, *, forward_only: bool) -> list:
        """megatron-core's schedule (pipelined or not) over the prepared micro-batches: the loss
        partials when training, each micro-batch's log-probs when `forward_only`."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if len(model_chunks) != inputs.num_chunks:
            raise UnsupportedLayoutError(
                f"got {len(model_chunks)} model chunks for a plan of {inputs.num_chunks} per rank: pass all of "
                "this rank's chunks (one per virtual pipeline stage)"
            )
        self._in_own_schedule = True
        try:
            return get_forward_backward_func()(
                forward_step_func=self.forward_step,
                data_iterator=inputs.data_iterator(),
                model=model_chunks,
                num_microbatches=inputs.num_microbatches,
                seq_length=inputs.seq_length,
                micro_batch_size=1,
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )
        finally:
            self._in_own_schedule = False

    def train_minibatch(
        self, model_chunks: list, optimizer, steps_or_batch: Union[StepBatch, Sequence[Step]], *, lr_scheduler=None
    ) -> dict[str, float]:
        """One optimizer step on one mini-batch; returns metrics identical on every rank."""
        if unwrap(model_chunks[0]).config.finalize_model_grads_func is None:
            raise RuntimeError(
                "model config has no finalize_model_grads_func: gradients would not be reduced over DP, "
                "sequence-parallel norms or tied embeddings. Set config.finalize_model_grads_func = "
                "megatron.core.distributed.finalize_model_grads (as Megatron-LM's setup does, and "
                "model.build_model_chunks does)."
            )
        inputs = self._prepare(model_chunks, steps_or_batch, mode=TRAIN)
        self.router_losses.clear()
        for chunk in model_chunks:
            chunk.train()
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        optimizer.zero_grad()
        metrics = self.reduce_metrics(self._run_schedule(model_chunks, inputs, forward_only=False))
        metrics.update(self.router_losses.reduce(unwrap(model_chunks[0]).config))
        update_successful, grad_norm, _ = optimizer.step()
        if lr_scheduler is not None and update_successful:
            lr_scheduler.step(increment=1)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_successful"] = float(bool(update_successful))
        metrics["num_microbatches"] = float(inputs.num_microbatches)
        return metrics

    @torch.no_grad()
    def compute_logprobs_flat(
        self, model_chunks: list, steps_or_batch: Union[StepBatch, Sequence[Step], MinibatchShard]
    ) -> torch.Tensor:
        """Forward-only log-probs of every trained token, as a flat [T] float32 tensor aligned
        with the batch's tokens (0 where loss_mask is 0): the whole mini-batch's on every rank,
        or, given this rank's `MinibatchShard`, the shard's on every rank of its model replica."""
        from megatron.core import parallel_state as ps

        shard = steps_or_batch if isinstance(steps_or_batch, MinibatchShard) else None
        batch = shard.batch if shard is not None else self.as_batch(steps_or_batch)
        inputs = self._prepare(model_chunks, shard or batch, mode=LOGPROBS)
        for chunk in model_chunks:
            chunk.eval()
        outputs = self._run_schedule(model_chunks, inputs, forward_only=True)
        for chunk in model_chunks:
            chunk.train()
        flat = torch.zeros(batch.tokens.numel(), dtype=torch.float32)
        # Each trained token is filled by exactly one rank (its DP rank's last stage, TP rank 0,
        # the CP rank holding its predicting position), so SUM all-reduces assemble the batch: over
        # the world for a whole mini-batch, over the replica (TP x CP, then PP) for a shard.
        if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0:
            for item in outputs:
                index = (
                    item["token_index"]
                    if shard is not None
                    else inputs.shard.minibatch_token_index(item["token_index"], batch)
                )
                flat[index] = item["logprobs"].float()
        if dist.is_initialized() and dist.get_world_size() > 1:
            groups = (
                [ps.get_tensor_and_context_parallel_group(), ps.get_pipeline_model_parallel_group()]
                if shard is not None
                else [None]
            )
            buf = flat.to(comm_device())
            for group in groups:
                if group is None or dist.get_world_size(group) > 1:
                    dist.all_reduce(buf, group=group)
            flat = buf.cpu()
        return flat

    def compute_logprobs(
        self, model_chunks: list, steps_or_batch: Union[StepBatch, Sequence[Step]]
    ) -> list[torch.Tensor]:
        """Per-step response-aligned log-probs (0 where loss_mask is 0), e.g. old or reference
        policy log-probs; store them with `batch.set_response_field('old_logprobs', ...)` or
        directly as `batch.token_fields['old_logprobs'] = compute_logprobs_flat(...)`."""
        batch = self.as_batch(steps_or_batch)
        return batch.response_values(self.compute_logprobs_flat(model_chunks, batch))
