"""Rows that stay in the agent workers: the hand-off in which rank 0 moves no token data.

With agent workers and `rollout.handoff: workers` (synchronous training), a worker validates and
prepares (advantages, merge) each group it rolls out and keeps the prepared rows; the driver
gets a `HeldGroup`: the group's summary (filters, metrics), its `RowTable` (lengths and counts,
no token) and the name of the worker holding it. Rank 0 decides the mini-batches and every DP
rank's rows from those alone (`loop/rounds.py` `decide_round`, holder `RowsInWorkers`) and sends each replica a `RemoteShard`: its
decision plus which rows to fetch from which worker. The replica's lowest rank fetches them
through Ray (`RowFetcher`) and cuts its shard; the rows travel worker -> rank, once. A holder
that died, or answers nothing within `rollout.agent_worker_timeout_s`, is `RowsLost`: the
synchronous source then rolls its groups out again and the round is handed off anew.

Asynchronous training holds rows the same way, one group at a time: each group is held under its
own key (the async group's serial), its `HeldGroup` also carries the staleness summary
(`TokenVersions`: trained tokens per weight version), and a group's rows are dropped on their
own (`HeldRows.drop`) once trained, filtered or evicted. With `async.rollout_bank` the worker
also writes the group's bank file where the rows are (the `HoldRequest` carries its `BankTicket`;
the `HeldGroup` returns the `BankFile`), and after a resume it adopts a banked group: reads its
file and holds its rows as if it had rolled it out (`HeldRows.adopt`).
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from megatron_stepwise.algo.groups import GroupSummary, RolloutGroup
from megatron_stepwise.algo.prepare import add_counts
from megatron_stepwise.algo.rows import RowTable
from megatron_stepwise.algo.validate import validate_steps
from megatron_stepwise.fault_injection import before_fetch
from megatron_stepwise.rollout.fleet.ray_nodes import ask_actor_node
from megatron_stepwise.rundir.bank_files import BankFile
from megatron_stepwise.steps import Step, StepBatch
from megatron_stepwise.workers.rollout_bank import BankedGroup, BankTicket, bank_rollout, with_group_id

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from megatron_stepwise.algo.shards import ShardDecision

Payload = TypeVar("Payload")  # a hand-off's payload: a round whose `shards` may name rows to fetch

NAMESPACE = "megatron_stepwise"  # the Ray namespace the agent workers are named in


class RowsLost(RuntimeError):
    """Rows a replica must fetch are gone: `lost` names the workers that held them."""

    def __init__(self, message: str, lost: list[str]):
        super().__init__(message)
        self.lost = lost


@dataclass(frozen=True)
class HoldRequest:
    """Asks a worker to prepare and keep the groups of one round (`key`: the iteration in
    synchronous training, the group's serial in asynchronous training) with `prepare`:
    `algo.prepare.prepare_rows` with the run's settings bound (`sources.bind_prepare`)."""

    key: int
    prepare: Callable[..., tuple[StepBatch, dict[str, Any]]]
    vocab_size: Optional[int]
    bank: Optional[BankTicket] = None  # async.rollout_bank: the one group's bank file is written here


@dataclass
class TokenVersions:
    """A group's staleness summary: its trained tokens (loss_mask 1) counted by the weight
    version that produced them, and per trajectory the newest minus the oldest of those versions.
    What the staleness metrics need, without a token: an agent worker holding the group's rows
    sends this instead (`HeldGroup.versions`). Steps without recorded versions are left out.

    >>> from megatron_stepwise.steps import TrajectoryID
    >>> t0 = [Step(TrajectoryID("p", 0), [1], [5, 6], [1, 1], weight_versions=[3, 4], is_last_step=True)]
    >>> t1 = [Step(TrajectoryID("p", 1), [1], [7], [1], weight_versions=[4], is_last_step=True)]
    >>> v = TokenVersions.of([t0, t1])
    >>> v.tokens, v.spreads, dict(v.staleness(5))
    ({3: 1, 4: 2}, [1, 0], {2: 1, 1: 2})
    """

    tokens: dict[int, int] = field(default_factory=dict)  # weight version -> trained tokens
    spreads: list[int] = field(default_factory=list)  # per trajectory with versions

    @classmethod
    def of(cls, trajectories: list[list[Step]]) -> "TokenVersions":
        """The summary of a group's trajectories (`RolloutGroup.trajectories`)."""
        tokens: Counter[int] = Counter()
        spreads = []
        for trajectory in trajectories:
            trained = [v for s in trajectory for v in _trained_versions(s)]
            tokens.update(trained)
            if trained:
                spreads.append(max(trained) - min(trained))
        return cls(dict(tokens), spreads)

    def staleness(self, version: int) -> Counter[int]:
        """Trained tokens by `version - the version that produced them`."""
        out: Counter[int] = Counter()
        for v, n in self.tokens.items():
            out[version - v] += n
        return out


def _trained_versions(step) -> list[int]:
    """The weight versions of the step's trained tokens (none where it recorded none)."""
    return [] if step.weight_versions is None else step.weight_versions[step.loss_mask.bool()].tolist()


@dataclass
class HeldGroup:
    """A group whose rows a worker keeps: what the driver decides on (a `PromptGroup`: its id and
    summary), with the rows' table and where they are.

    >>> from megatron_stepwise.algo.prepare import prepare_rows
    >>> from megatron_stepwise.steps import TrajectoryID
    >>> one = lambda k: [Step(TrajectoryID("p", k), [1, 2], [3], [1], reward=k, is_last_step=True)]
    >>> group = RolloutGroup("p", [one(0), one(1)])
    >>> held = HeldRows().keep(group, HoldRequest(7, prepare_rows, None), holder="agent_worker_0")
    >>> held.prompt_id, held.summary().rewards, held.rows.lengths.tolist(), (held.holder, held.key)
    ('p', [0.0, 1.0], [3, 3], ('agent_worker_0', 7))
    """

    group: GroupSummary  # the summary: outcomes, turns, lengths
    rows: RowTable
    counts: dict[str, Any]  # `prepare`'s counts of this group
    holder: str  # the worker's Ray actor name
    key: int = 0  # the HoldRequest's key: (key, prompt id) names the rows on their holder
    versions: TokenVersions = field(default_factory=TokenVersions)  # the staleness summary
    bank: Optional[BankFile] = None  # its rollout bank file, written by the holder

    # A `PromptGroup`: its outcomes are its summary's.
    @property
    def prompt_id(self) -> str:
        return self.group.prompt_id

    def summary(self) -> GroupSummary:
        return self.group


def bank_held(groups: list[RolloutGroup], request: HoldRequest) -> list[Optional[BankFile]]:
    """Worker side: the bank files of groups it is about to hold, written before the driver hears
    of them (a kill from then on keeps them); None where there is no ticket or the write failed."""
    if request.bank is None or len(groups) != 1:  # a ticket names one group (async: one per call)
        return [None] * len(groups)
    return [bank_rollout(request.bank, groups[0])]


def hold_group(group: RolloutGroup, request: HoldRequest) -> tuple[StepBatch, dict[str, Any]]:
    """Worker side: validate one group where it was made and prepare its rows."""
    validate_steps(group.steps, vocab_size=request.vocab_size)
    return request.prepare([group])


class HeldRows:
    """Worker side: the prepared rows of the groups it holds, by (round, prompt id)."""

    def __init__(self):
        self.batches: dict[tuple[int, str], StepBatch] = {}

    def keep(
        self, group: RolloutGroup, request: HoldRequest, holder: str, bank: Optional[BankFile] = None
    ) -> HeldGroup:
        batch, counts = hold_group(group, request)
        self.batches[(request.key, group.prompt_id)] = batch
        versions = TokenVersions.of(group.trajectories)
        return HeldGroup(group.summary(), RowTable.of(batch), counts, holder, request.key, versions, bank)

    def adopt(self, banked: BankedGroup, group_id: str, request: HoldRequest, holder: str) -> HeldGroup:
        """A resumed run's banked group (`rollout_bank.read_group`: its checksum checked), held as if
        this worker had rolled it out, under `group_id`. Its file stays: still the group's bank file."""
        written = BankFile(banked.path.name, banked.newest_version)
        return self.keep(with_group_id(banked.rollout, group_id), request, holder, written)

    def take(self, runs: list[tuple[int, str, list[int]]]) -> StepBatch:
        """The rows asked for (runs of (key, prompt id, rows)), in order, narrowed for the wire."""
        try:
            parts = [self.batches[(key, prompt_id)].select(rows) for key, prompt_id, rows in runs]
        except KeyError as e:
            key, prompt_id = e.args[0]
            raise KeyError(f"this agent worker holds no rows of prompt group {prompt_id!r} in round {key}") from None
        return StepBatch.concat(parts).for_wire()

    def release(self, key: int) -> None:
        """Drop every group held under `key` or an earlier one (a synchronous round)."""
        for k in [k for k in self.batches if k[0] <= key]:
            del self.batches[k]

    def drop(self, groups: list[tuple[int, str]]) -> None:
        """Drop these groups, by (key, prompt id) (asynchronous training: one group at a time)."""
        for k in groups:
            self.batches.pop(tuple(k), None)


@dataclass
class RemoteShard:
    """One DP rank's decision and where its rows are: `fetch` turns it into the shard."""

    decision: ShardDecision
    key: int  # the round (iteration) it belongs to, for messages
    pieces: list[tuple[str, list[tuple[int, str, list[int]]]]]  # (worker, runs of (key, prompt id, rows))
    order: list[int]  # the decision's rows as positions in the fetched pieces, concatenated
    ray_address: str
    ray_auth_mode: Optional[str] = None  # RAY_AUTH_MODE of rank 0's Ray: a joining process must use the same

    @property
    def num_rows(self) -> int:
        return len(self.order)


@dataclass
class RowsInWorkers:
    """The agent workers hold the rows: a mini-batch of `HeldGroup`s is held as it is
    (`loop/rounds.py`'s holder; `key`: the round, for messages)."""

    key: int
    ray_address: str

    @classmethod
    def here(cls, key: int) -> "RowsInWorkers":
        """Holding the rows of round `key` in the agent workers of this process's Ray cluster."""
        import ray

        return cls(key, ray.get_runtime_context().gcs_address)

    def hold(self, groups: list[HeldGroup]) -> tuple[Optional[HeldMinibatch], dict[str, Any]]:
        """(the mini-batch's held rows, None when no row has a trained token), `prepare`'s counts."""
        rows = RowTable.concat([g.rows for g in groups])
        counts = add_counts(g.counts for g in groups)
        if int(rows.trained.sum()) == 0:
            return None, counts
        return HeldMinibatch(groups, rows, self.key, self.ray_address), counts


@dataclass
class HeldMinibatch:
    """A mini-batch of groups whose rows the workers keep, as rank 0 decides on it: its row table
    and `cut`, which names a DP rank's rows on their holders (`algo.shards.PreparedRows`, the rows
    on rank 0, has the same two)."""

    groups: list[HeldGroup]
    rows: RowTable
    key: int
    ray_address: str

    def cut(self, decision: ShardDecision) -> RemoteShard:
        where = [(g, j) for g in self.groups for j in range(g.rows.num_rows)]
        wanted: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
        position = []
        for r in decision.rows:
            group, j = where[r]
            position.append((group.holder, len(wanted[group.holder])))
            wanted[group.holder].append((group.key, group.prompt_id, j))
        base, at = {}, 0
        for holder, rows in wanted.items():
            base[holder] = at
            at += len(rows)
        pieces = [(holder, _runs(rows)) for holder, rows in wanted.items()]
        order = [base[h] + k for h, k in position]
        return RemoteShard(decision, self.key, pieces, order, self.ray_address, os.environ.get("RAY_AUTH_MODE"))


def _runs(rows: list[tuple[int, str, int]]) -> list[tuple[int, str, list[int]]]:
    """Consecutive rows of one group as one run: one `select` per run on the worker."""
    runs: list[tuple[int, str, list[int]]] = []
    for key, prompt_id, j in rows:
        if runs and runs[-1][:2] == (key, prompt_id):
            runs[-1][2].append(j)
        else:
            runs.append((key, prompt_id, [j]))
    return runs


@dataclass
class RowFetcher:
    """A training rank's side: fetch a RemoteShard's rows from the workers that hold them."""

    timeout_s: float = 300.0  # rollout.agent_worker_timeout_s: the longest a fetch waits on a worker
    bytes_fetched: int = 0
    seconds: float = 0.0
    _actors: dict[str, ActorHandle] = field(default_factory=dict)
    _nodes: dict[str, ObjectRef] = field(default_factory=dict)  # worker name -> its node's address, asked once

    def resolve(self, payload: Payload) -> Payload:
        """A round with every RemoteShard fetched and cut (other shards as they are)."""
        shards = getattr(payload, "shards", None)
        if not shards or not any(isinstance(m, RemoteShard) for m in shards):
            return payload
        payload.shards = [self.fetch(m) if isinstance(m, RemoteShard) else m for m in shards]
        return payload

    def fetch(self, remote: RemoteShard):
        before_fetch(remote.key)  # test fault injection (fault_injection.py): a no-op unless its variable is set
        start = time.perf_counter()
        self._connect(remote.ray_address, remote.ray_auth_mode)
        holders = [holder for holder, _ in remote.pieces]
        try:
            refs = [self._actor(holder).take.remote(runs) for holder, runs in remote.pieces]
        except ValueError as e:  # ray.get_actor: no actor of that name (it died and Ray forgot it)
            raise RowsLost(f"the rows of round {remote.key}: {e}", holders) from None
        parts = self._gather(holders, refs, remote.key)
        self.bytes_fetched += sum(_nbytes(p) for p in parts)
        batch = StepBatch.concat([p.from_wire() for p in parts]).select(remote.order)
        self.seconds += time.perf_counter() - start
        return remote.decision.cut(batch)

    def _gather(self, holders: list[str], refs: list, key: int) -> list:
        """Every worker's piece, waiting at most `timeout_s` in all; RowsLost names the workers
        that are dead or did not answer in time (a frozen worker answers nothing, ever)."""
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        ready_set = set(ready)
        parts, lost, why = [], [], []
        for holder, ref in zip(holders, refs):
            worker = f"agent worker {holder}{self._node_of(holder)}"
            if ref not in ready_set:
                lost.append(holder)
                why.append(f"{worker} did not answer within {self.timeout_s:g} s (rollout.agent_worker_timeout_s)")
                continue
            try:
                parts.append(ray.get(ref))
            except ray.exceptions.ActorUnavailableError as e:  # unreachable (e.g. its node's network down)
                lost.append(holder)
                why.append(f"{worker} could not be reached ({_ray_reason(e)})")
            except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as e:  # killed for memory too
                lost.append(holder)
                why.append(f"{worker} died ({_ray_reason(e)})")
        if lost:
            self._actors = {k: v for k, v in self._actors.items() if k not in lost}
            self._nodes = {k: v for k, v in self._nodes.items() if k not in lost}
            raise RowsLost(f"fetching the rows of round {key}: {'; '.join(why)}", lost)
        return parts

    def _node_of(self, holder: str) -> str:
        """' on ADDRESS': the holder's node, if its answer to `_actor`'s question has come (no wait)."""
        import ray

        asked = self._nodes.get(holder)
        if asked is None or not ray.wait([asked], timeout=0)[0]:
            return ""
        try:
            return f" on {ray.get(asked)}"
        except ray.exceptions.RayError:
            return ""

    def _connect(self, address: str, auth_mode: Optional[str]) -> None:
        import ray

        if not ray.is_initialized():
            if auth_mode and os.environ.get("RAY_AUTH_MODE") != auth_mode:
                # The token itself: RAY_AUTH_TOKEN, or ~/.ray/auth_token on this node. Ray reads the
                # mode once per process; re-read it, as Ray's own token set-up does.
                os.environ["RAY_AUTH_MODE"] = auth_mode
                from ray._raylet import Config

                Config.initialize("")
            from megatron_stepwise.rollout.fleet.ray_start import quiet_ray_token_notice

            quiet_ray_token_notice()
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False)

    def _actor(self, name: str):
        if name not in self._actors:
            import ray

            self._actors[name] = ray.get_actor(name, namespace=NAMESPACE)
            # where it runs, asked once and never waited for: a lost worker's message names its node
            self._nodes[name] = ask_actor_node(self._actors[name])
        return self._actors[name]


def _ray_reason(e: Exception) -> str:
    """A Ray actor error in one line: its type and Ray's reason (an ActorDiedError's first line is
    generic, the fields of the actor follow, then why, e.g. its node died)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    fields = ("class_name:", "actor_id:", "pid:", "name:", "namespace:", "ip:")
    reason = [line for line in lines[1:] if not line.startswith(fields)] or lines[:1]
    return type(e).__name__ + (f": {reason[0]}" if reason else "")


def _nbytes(batch: StepBatch) -> int:
    tensors = [batch.tokens, batch.offsets, batch.prompt_lens, *batch.token_fields.values(), *batch.row_fields.values()]
    return sum(t.numel() * t.element_size() for t in tensors)
