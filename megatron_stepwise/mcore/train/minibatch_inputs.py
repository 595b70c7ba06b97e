"""What the plugin hands a megatron-core schedule for one mini-batch: the packed micro-batches
(`MinibatchInputs`), the micro-batches a host loop's data iterator yields before the model is known
(`PendingMicroBatch`), and the check that the host loop's micro-batch count is the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Union

from megatron_stepwise.algo.shards import TRAIN, HostLoopMismatchError, MinibatchShard
from megatron_stepwise.mcore.train.packing import PackedMicroBatch


@dataclass
class MinibatchInputs:
    """What a megatron loop passes to `get_forward_backward_func()` for one mini-batch."""

    microbatches: list[PackedMicroBatch]
    num_microbatches: int
    seq_length: int  # longest packed micro-batch (PP shapes are exchanged per micro-batch anyway)
    num_chunks: int = 1  # model chunks per rank (virtual pipeline stages)
    shard: Optional[MinibatchShard] = None  # what was packed

    def data_iterator(self) -> Union[Iterator[PackedMicroBatch], list[Iterator[PackedMicroBatch]]]:
        """The schedule's `data_iterator`: under virtual pipeline parallelism, one iterator per
        model chunk (every chunk needs each micro-batch's packing, the first its tokens, the last
        its loss inputs)."""
        if self.num_chunks == 1:
            return iter(self.microbatches)
        return [iter(self.microbatches) for _ in range(self.num_chunks)]


def host_count() -> Optional[int]:
    """megatron's `get_num_microbatches()` when its calculator is set up (Megatron-LM's pretrain
    does), else None: the caller passes the count to the schedule itself."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    try:
        return get_num_microbatches()
    except AttributeError:
        return None


def check_host_count(plan_size: int) -> None:
    """The schedule of a host loop with a micro-batch calculator runs `get_num_microbatches()`
    micro-batches: it must be the plan's count, or mini-batches would straddle optimizer steps
    silently."""
    host = host_count()
    if host is not None and host != plan_size:
        raise HostLoopMismatchError(
            f"the training loop runs get_num_microbatches()={host} micro-batches per step, but the plugin planned "
            f"{plan_size} for this mini-batch: pass StepwisePlugin(num_microbatches={host}) (or prepare_minibatch("
            f"num_microbatches={host})) so every mini-batch is exactly one optimizer step"
        )


class PendingMicroBatch:
    """Micro-batch `index` of a mini-batch that is packed when `forward_step` first meets it: only
    then is the model (layout, vocabulary) known to a loop that hands out just a data iterator."""

    def __init__(self, minibatch, count: int, index: int, packed: dict):
        self.minibatch, self.count, self.index, self._packed = minibatch, count, index, packed

    def resolve(self, plugin, model) -> PackedMicroBatch:
        """This micro-batch, packed for `model` by `plugin` (the StepwisePlugin) on first use."""
        if "inputs" not in self._packed:
            self._packed["inputs"] = plugin._prepare([model], self.minibatch, mode=TRAIN, num_microbatches=self.count)
        return self._packed["inputs"].microbatches[self.index]
