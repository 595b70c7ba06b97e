"""A resumed run's rollout bank (`async.rollout_bank`): which finished groups it reuses, and how
each comes back, beside the bank itself (`rollout_bank.py`: rank 0's record of the files).

`open_bank` empties the bank of a fresh run; a resumed one reads it and gets, by draw, the banked
groups of its pending samples (the bank keeps those of draws the dataset will re-issue, which the
async source `claim`s as they come up). A reused group then takes the group id it was started with
in the resumed run: with the rows through rank 0 it joins the buffer as it is (`banked_rollout`),
with the rows kept in the workers an agent worker reads its file and holds its rows (`adopt_held`);
if none can, the banked group is discarded and counted, and its prompt rolled out again.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from megatron_stepwise.workers.rollout_bank import BankedGroup, RolloutBank, with_group_id

if TYPE_CHECKING:
    from megatron_stepwise.algo.groups import RolloutGroup
    from megatron_stepwise.workers.worker_rows import HeldGroup, HoldRequest

log = logging.getLogger(__name__)


def open_bank(
    run_dir: str | Path,
    pending: Optional[Sequence[tuple[dict[str, Any], int]]],
    draws: int,
    version: int,
    run_id: Optional[str] = None,
    config_hash: Optional[str] = None,
) -> tuple[RolloutBank, dict[int, BankedGroup]]:
    """Rank 0's bank and, by draw, the banked groups it reuses for its `pending` (sample, draw)
    pairs; `pending` None: a fresh run (or a checkpoint from before the bank), which empties it.
    `draws` and `version`: the checkpoint's dataset draws so far and weight version. `run_id` and
    `config_hash` go into every file it writes; a file with others is another run's, never reused."""
    bank = RolloutBank(run_dir, run_id=run_id, config_hash=config_hash)
    if pending is None:
        bank.clear()
        return bank, {}
    recovery = bank.recover(list(pending), draws, version)
    if recovery.pending or recovery.reissued:
        log.info(
            "rollout bank: %d finished group(s) of pending prompts recovered, %d more held for "
            "prompts the dataset issues again",
            len(recovery.pending),
            len(recovery.reissued),
        )
    return bank, recovery.pending


def banked_rollout(banked: BankedGroup, group_id: str) -> RolloutGroup:
    """Rows through rank 0: the banked rollout, under the id its group was started with."""
    return with_group_id(banked.rollout, group_id)


async def adopt_held(agent, bank: RolloutBank, banked: BankedGroup, group_id: str, hold: HoldRequest):
    """Rows kept in the workers: an agent worker reads the group's bank file and holds its rows
    under `group_id` (its `HeldGroup`). None when none can (the file went bad since rank 0 read it,
    or the worker died): the banked group is discarded and counted."""
    try:
        held: HeldGroup = await agent.adopt(str(banked.path), group_id, hold)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a lost banked group costs one rollout, not the run
        bank.discard(banked, f"no agent worker could adopt it ({type(e).__name__}: {e})")
        return None
    return held
