"""The buffer of finished trajectory groups in asynchronous training, and its staleness bound.

In async mode the fleet keeps rolling out prompt groups while the trainer trains; `GroupBuffer`
is the bookkeeping between the two: `take(n, V)` returns exactly n whole groups no staler than
`max_staleness`, admission keeps the fleet at most that many optimizer steps ahead, group filters
act at completion, and every started group ends exactly once (`ledger`).

Plain Python (no asyncio, Ray or torch.distributed), so its guarantees are tested against a
simulated clock (tests/unit/test_group_buffer.py). The design, rule by rule: docs/async.md,
"The group buffer".
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from megatron_stepwise.algo.groups import RolloutGroup
    from megatron_stepwise.config.schema import AsyncConfig
    from megatron_stepwise.workers.worker_rows import HeldGroup


@dataclass
class Group:
    """One prompt group on its way from the fleet to an optimizer step: the buffer's bookkeeping
    around it. Once finished, `rollout` is the group itself (an `algo.groups.PromptGroup`)."""

    serial: int  # unique per started group, in start order
    sample: dict[str, Any]  # the dataset sample (its own prompt_id)
    group_id: str  # the prompt_id its trajectories carry; unique among outstanding groups
    start_version: int
    attempt: int = 0  # 0 for a fresh sample, k after k stale re-queues
    # What the rollout produced, once finished: a RolloutGroup (rows through rank 0) or a
    # HeldGroup (rows kept by the agent worker that made them; summary, row table, versions).
    rollout: RolloutGroup | HeldGroup | None = None
    finish_order: int = -1
    # the sample's dataset draw, numbered from the run's start: a re-queued sample keeps it, and the
    # rollout bank matches a recovered group to the draw a resumed run re-issues (workers/rollout_bank.py)
    draw: int = -1

    def rollout_sample(self) -> dict[str, Any]:
        """The sample to roll out: the dataset's, under this group's id."""
        return {**self.sample, "prompt_id": self.group_id}


@dataclass
class BufferCounters:
    started: int = 0
    finished: int = 0
    trained: int = 0
    filtered: int = 0
    stale_dropped: int = 0
    stale_requeued: int = 0
    paced_waits: int = 0  # takes that waited for an old group in flight (stale_policy=pace)
    recovered: int = 0  # groups reused from the rollout bank after a resume instead of rolled out


class GroupBuffer:
    """See the module docstring. All methods are called from one thread (rank 0's event loop)."""

    def __init__(
        self,
        prompts_per_minibatch: int,
        staleness: "AsyncConfig",
        keep_group: Optional[Callable[[RolloutGroup | HeldGroup], bool]] = None,
        base_version: int = 0,
        on_discard: Optional[Callable[[Group], None]] = None,
        draws: int = 0,
    ):
        # Both come from config sections that checked their bounds (data.prompts_per_minibatch, async).
        self.prompts_per_minibatch = prompts_per_minibatch
        self.max_staleness = staleness.max_staleness
        self.stale_policy = staleness.stale_policy
        self.keep_group = keep_group
        self.base_version = base_version
        # Called with every finished group that leaves untrained (filtered, dropped, re-queued):
        # rows a worker holds for it can go.
        self.on_discard = on_discard
        self.counters = BufferCounters()
        self.ledger: dict[int, str] = {}  # serial -> trained | filtered | dropped | requeued
        self._in_flight: dict[int, Group] = {}
        self._ready: list[Group] = []
        self._requeued: deque[tuple[dict[str, Any], int, int]] = deque()  # (sample, attempt, draw)
        self.draws = draws  # samples drawn from the dataset so far (a resume continues the count)
        self._filtered_since_take = 0
        # trajectories per length bucket: finished by the fleet, and trained (fairness, see `metrics`)
        self.generated_by_length: Counter[str] = Counter()
        self.trained_by_length: Counter[str] = Counter()

    # ---- views ------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def outstanding(self) -> int:
        return len(self._in_flight) + len(self._ready)

    def is_stale(self, group: Group, version: int) -> bool:
        return version - group.start_version > self.max_staleness

    def capacity(self, version: int) -> int:
        """Groups that may have been started (trained + outstanding) by fleet version `version`."""
        return (version - self.base_version + self.max_staleness + 1) * self.prompts_per_minibatch

    # ---- producer side ------------------------------------------------------------------------
    def can_start(self, version: int) -> bool:
        if self.stale_policy == "pace" and self.outstanding >= (self.max_staleness + 1) * self.prompts_per_minibatch:
            # Every outstanding group must be trained within max_staleness + 1 steps of n groups;
            # filtered groups free the capacity below without freeing those steps.
            return False
        return self.counters.trained + self.outstanding < self.capacity(version)

    def start(self, version: int, draw: Callable[[], dict[str, Any]]) -> Group:
        """Start a group at fleet version `version`: a re-queued sample first, else `draw()`."""
        if self._requeued:
            sample, attempt, drawn = self._requeued.popleft()
        else:
            sample, attempt, drawn = draw(), 0, self.draws
            self.draws += 1
        return self._begin(version, sample, attempt, drawn)

    def start_recovered(self, version: int, sample: dict[str, Any], draw: int) -> Group:
        """Start a group for a resumed run's pending sample whose rollout the bank kept (`adopt` it)."""
        return self._begin(version, sample, 0, draw)

    def _begin(self, version: int, sample: dict[str, Any], attempt: int, drawn: int) -> Group:
        serial = self.counters.started
        pid = str(sample.get("prompt_id", ""))
        if not pid:
            raise ValueError(f"dataset sample {sample!r:.200} has no 'prompt_id'")
        outstanding_ids = {g.group_id for g in self._in_flight.values()} | {g.group_id for g in self._ready}
        # The same prompt can be in flight twice (a small dataset wraps around): group ids must
        # stay distinct, or two groups would mix in one advantage group.
        group_id = pid if pid not in outstanding_ids else f"{pid}~{serial}"
        group = Group(serial, sample, group_id, start_version=version, attempt=attempt, draw=drawn)
        self._in_flight[serial] = group
        self.counters.started += 1
        return group

    def adopt(
        self, group: Group, rollout: RolloutGroup | HeldGroup, start_version: int, attempt: int, version: int
    ) -> str:
        """A started group (`start`) whose rollout was recovered from the rollout bank: it keeps
        the start version and attempt it was made with, and finishes now as any group does (the
        staleness bound and the group filters apply). Returns `finish`'s outcome."""
        group.start_version, group.attempt = start_version, attempt
        self.counters.recovered += 1
        return self.finish(group.serial, rollout, version)

    def finish(self, serial: int, rollout: RolloutGroup | HeldGroup, version: int) -> str:
        """A group's trajectories all finished (trainer at `version`); returns what became of it:
        "ready", "filtered", "dropped" or "requeued"."""
        group = self._in_flight.pop(serial, None)
        if group is None:
            raise ValueError(f"group {serial} is not in flight (finished twice, or never started)")
        group.rollout = rollout
        group.finish_order = self.counters.finished
        self.counters.finished += 1
        self.generated_by_length.update(length_buckets(rollout))
        if self.is_stale(group, version):
            return self._evict(group)
        if self.keep_group is not None and not self.keep_group(group.rollout):
            self.counters.filtered += 1
            self._filtered_since_take += 1
            self.ledger[serial] = "filtered"
            self._discard(group)
            return "filtered"
        self._ready.append(group)
        return "ready"

    # ---- trainer side -------------------------------------------------------------------------
    def take(self, n: int, version: int) -> Optional[list[Group]]:
        """Exactly `n` ready groups fresh enough for the trainer at `version`, oldest first; or
        None (nothing removed but the stale) when fewer are ready.

        stale_policy=pace: also None while a group in flight would be too stale after this step
        (started at or before `version - max_staleness`): the trainer waits for it rather than
        drop it later, so long trajectories are trained as often as they are generated."""
        if self.stale_policy == "pace" and any(
            version + 1 - g.start_version > self.max_staleness for g in self._in_flight.values()
        ):
            self.counters.paced_waits += 1
            return None
        fresh = []
        for group in self._ready:
            if self.is_stale(group, version):
                self._evict(group)
            else:
                fresh.append(group)
        fresh.sort(key=lambda g: (g.start_version, g.finish_order))
        self._ready = fresh
        if len(fresh) < n:
            return None
        out, self._ready = fresh[:n], fresh[n:]
        for group in out:
            self.ledger[group.serial] = "trained"
            self.trained_by_length.update(length_buckets(group.rollout))
        self.counters.trained += n
        self._filtered_since_take = 0
        return out

    def starved(self, limit: int) -> bool:
        """Filters discarded at least `limit` groups since the last take."""
        return self._filtered_since_take >= limit

    def skip_step(self) -> None:
        """The trainer gave up on a step (see `starved`); start counting filtered groups anew."""
        self._filtered_since_take = 0

    def _evict(self, group: Group) -> str:
        # pace gets here only in corner cases (a start during a weight sync at max_staleness 0, or
        # group filters that freed admission slots early): rolled out again, never lost.
        if self.stale_policy in ("requeue", "pace"):
            self._requeued.append((group.sample, group.attempt + 1, group.draw))
            self.counters.stale_requeued += 1
            outcome = "requeued"
        else:
            self.counters.stale_dropped += 1
            outcome = "dropped"
        self.ledger[group.serial] = outcome
        self._discard(group)
        return outcome

    def _discard(self, group: Group) -> None:
        if self.on_discard is not None:
            self.on_discard(group)

    # ---- metrics and checkpoints --------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out = {f"async/groups_{k}": float(v) for k, v in asdict(self.counters).items()}
        out["async/groups_in_flight"] = float(self.in_flight)
        out["async/groups_ready"] = float(self.ready)
        out["async/groups_requeue_waiting"] = float(len(self._requeued))
        # Fairness: each length bucket's share of the trajectories trained vs generated so far.
        # Dropping stale groups under-trains the long bucket (trained share below generated).
        for name, counts in (("generated_share", self.generated_by_length), ("trained_share", self.trained_by_length)):
            total = sum(counts.values())
            for bucket, n in counts.items():
                out[f"async/{name}/{bucket}"] = n / total
        return out

    def outstanding_groups(self) -> list[Group]:
        """Groups started and not yet ended (in flight or ready), by serial."""
        return sorted([*self._in_flight.values(), *self._ready], key=lambda g: g.serial)

    def pending_samples(self) -> list[dict[str, Any]]:
        """Samples drawn from the dataset but not trained yet (in flight, ready, re-queued): a
        checkpoint stores them so a resumed run rolls them out first (`requeue_samples`)."""
        return [s for s, _, _ in self._requeued] + [g.sample for g in self.outstanding_groups()]

    def pending_draws(self) -> list[int]:
        """The draw of each of `pending_samples`, in the same order."""
        return [d for _, _, d in self._requeued] + [g.draw for g in self.outstanding_groups()]

    def ready_groups(self) -> list[Group]:
        return list(self._ready)

    def requeue_samples(self, samples: list[dict[str, Any]], draws: Optional[list[int]] = None) -> None:
        """Samples to roll out first (a resumed run's pending ones), with their draws when known."""
        if draws is None or len(draws) != len(samples):  # a checkpoint from before draws were saved
            draws = [-1 - k for k in range(len(samples))]  # distinct, and never a dataset draw
        self._requeued.extend((dict(s), 0, d) for s, d in zip(samples, draws))


def length_buckets(rollout: RolloutGroup | HeldGroup) -> list[str]:
    """Each trajectory's length bucket by turns (`turns_1` ... `turns_8`, `turns_9+`), from the
    rollout's summary; none for a rollout that is no prompt group (the buffer takes any value)."""
    turns = rollout.summary().turns if hasattr(rollout, "summary") else []
    return [f"turns_{n}" if n <= 8 else "turns_9+" for n in turns]
