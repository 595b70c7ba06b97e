"""The rollout bank (`async.rollout_bank`): finished prompt groups not yet trained, kept in the run
directory so that a run resumed after a kill trains them instead of rolling their prompts out again.

Each finished group is written to `<run_dir>/rollout_bank/draw_<d>.<sha256>.parquet` before it
enters the group buffer, by whoever has its rows: the agent worker that holds them (rows kept in
the workers, the default with agent workers: `write_group` in the worker, which returns a
`BankFile` with the group's `HeldGroup`), else rank 0 (`RolloutBank.put`). The run directory is
shared storage on a cluster, as for checkpoints. Rank 0 only records which file belongs to which
draw (`RolloutBank.record`) and deletes files. A file holds the rows in the columnar format of the
rollout dumps (`dumps.rows_table`), the group's sample, start version and attempt in its metadata,
and the SHA-256 of the whole file in its name, so a torn or damaged file is recognised, warned
about, counted and never trained. `d` is the sample's dataset draw (`Group.draw`, counted from the
run's start and saved in the checkpoint): what ties a banked group to the prompt a resumed run
issues again.

"Not yet trained" is relative to the checkpoint a resume starts from (docs/async.md, "Rollout
bank"). A checkpoint saves the draws in flight, ready or re-queued (`pending`) and the number of
draws so far (`draws`). Resuming from it, a banked group is

- reused in place of its pending sample when its draw is pending (it finished before or after
  the checkpoint; trained after it or not, that training was lost with the kill);
- reused when the dataset re-issues its draw, for draws made after the checkpoint: the dataset
  resumes at the saved position, so the prompt comes up again, and the banked group is trained
  instead of a fresh rollout of it; the data position and the bank never disagree;
- discarded (counted) when a token came from weights newer than the checkpoint's: those weights
  died with the kill, so its staleness means nothing to the resumed policy;
- pruned when its draw is older and not pending: trained before the checkpoint.

A reused group keeps its start version and weight versions, and the group buffer's staleness bound
and stale policy treat it as any finished group. Rank 0 reads the bank on a resume; with rows kept
in the workers an agent worker adopts each reused group (it reads the file again and holds the
rows: `read_group`), else the group joins the buffer with its rows on rank 0. The bank is pruned at every checkpoint (it keeps
the groups outstanding then) and, between checkpoints, a trained group's file is deleted at once
unless the last checkpoint lists its draw as pending: only those help a resume from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from megatron_stepwise.algo.groups import RolloutGroup
from megatron_stepwise.rundir.dumps import Captured, batch_from_rows, rows_table
from megatron_stepwise.rundir.paths import BANK, RunDir
from megatron_stepwise.rundir.run_files import write_path
from megatron_stepwise.steps import StepBatch, TrajectoryID

log = logging.getLogger(__name__)

BANK_DIR = BANK
META_KEY = b"megatron_stepwise.rollout_bank"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class BankTicket:
    """What a group's bank file records besides its rows, for whoever writes it (rank 0, or the
    agent worker that keeps the rows: sent along with the group's `HoldRequest`). Names one group."""

    run_dir: str
    draw: int
    sample: dict[str, Any]
    group_id: str
    start_version: int
    attempt: int


@dataclass(frozen=True)
class BankFile:
    """A written bank file as rank 0 records it: its name (draw and checksum) and the newest weight
    version among its tokens (what decides whether a resume may reuse it)."""

    name: str
    newest_version: int

    @property
    def draw(self) -> int:
        return _parse_name(self.name)[0]


@dataclass
class BankedGroup:
    """One finished group as the bank keeps it."""

    draw: int
    sample: dict[str, Any]
    group_id: str
    start_version: int
    attempt: int
    end_version: int  # no token is newer (what `newest_version` falls back on for a step without versions)
    rollout: RolloutGroup
    path: Optional[Path] = None  # its file, once read back

    @classmethod
    def of(cls, ticket: BankTicket, rollout: RolloutGroup, end_version: int) -> "BankedGroup":
        return cls(
            ticket.draw, ticket.sample, ticket.group_id, ticket.start_version, ticket.attempt, end_version, rollout
        )

    @property
    def newest_version(self) -> int:
        """The newest weight version among its tokens (`end_version` when some step has none)."""
        newest = -1
        for step in self.rollout.steps:
            if step.weight_versions is None:
                return self.end_version
            if step.weight_versions.numel():
                newest = max(newest, int(step.weight_versions.max()))
        return newest if newest >= 0 else self.end_version


def encode(group: BankedGroup) -> bytes:
    """The group as Parquet bytes: the dump's row columns, its identity in the file metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    batch = StepBatch.from_groups([group.rollout.trajectories], keep_metadata=True)
    table, experts_shape = rows_table([Captured(batch, batch.metadata or [])])
    meta = {
        "version": FORMAT_VERSION,
        "draw": group.draw,
        "sample": group.sample,
        "group_id": group.group_id,
        "start_version": group.start_version,
        "attempt": group.attempt,
        "end_version": group.end_version,
        "lengths": [len(t) for t in group.rollout.trajectories],
        "routed_experts_shape": experts_shape,
    }
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta, default=str).encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def decode(data: bytes) -> BankedGroup:
    """`encode`'s bytes back as the group, its steps exactly as they were written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(pa.BufferReader(data))
    meta = json.loads((table.schema.metadata or {})[META_KEY])
    cols = table.to_pydict()
    batch, _ = batch_from_rows(cols, list(range(table.num_rows)), meta["routed_experts_shape"])
    batch.metadata = [json.loads(info) for info in cols["info"]]
    steps = batch.to_steps(copy=False)
    trajectories, start = [], 0
    for n in meta["lengths"]:
        trajectories.append(steps[start : start + n])
        start += n
    return BankedGroup(
        draw=int(meta["draw"]),
        sample=meta["sample"],
        group_id=str(meta["group_id"]),
        start_version=int(meta["start_version"]),
        attempt=int(meta["attempt"]),
        end_version=int(meta["end_version"]),
        rollout=RolloutGroup(str(meta["group_id"]), trajectories),
    )


def write_group(run_dir: str | Path, group: BankedGroup) -> BankFile:
    """Write one group's file (atomic: a temporary file, then a rename). Raises OSError, ValueError
    or TypeError when it cannot."""
    data = encode(group)
    name = _file_name(group.draw, data)
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # a worker may write before rank 0 made it
    write_path(RunDir(run_dir).rollout_bank / name, data, base=run_dir)
    return BankFile(name, group.newest_version)


def read_group(path: str | Path) -> BankedGroup:
    """A bank file read back, checked against the checksum and draw its name carries; ValueError
    (or OSError) names what is wrong with a damaged or missing file."""
    path = Path(path)
    parsed = _parse_name(path.name)
    if parsed is None:
        raise ValueError(f"{path.name} is not a rollout bank file name")
    draw, checksum = parsed
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != checksum:
        raise ValueError(f"sha256 {actual[:12]}..., the name says {checksum[:12]}...")
    try:
        group = decode(data)
    except Exception as e:  # noqa: BLE001 - any format damage: one message naming it
        raise ValueError(f"unreadable: {type(e).__name__}: {e}") from None
    if group.draw != draw:
        raise ValueError(f"it holds draw {group.draw}")
    group.path = path
    return group


def bank_rollout(ticket: BankTicket, rollout: RolloutGroup) -> Optional[BankFile]:
    """Worker side: write a finished group where its rows are; a failure warns (once per process)
    and returns None, and training goes on with the group unbanked."""
    group = BankedGroup.of(ticket, rollout, end_version=ticket.start_version)
    global _warned_unwritable
    try:
        return write_group(ticket.run_dir, group)
    except (OSError, ValueError, TypeError) as e:
        if not _warned_unwritable:
            _warned_unwritable = True
            log.warning("rollout bank: cannot write to %s (%s); finished groups go unbanked", ticket.run_dir, e)
        return None


_warned_unwritable = False  # one warning per process for failed writes


def with_group_id(rollout: RolloutGroup, group_id: str) -> RolloutGroup:
    """The rollout under another group id (a recovered group's old id may be taken in the resumed run:
    two groups under one id would share an advantage baseline)."""
    if rollout.prompt_id == group_id:
        return rollout

    trajectories = [
        [dataclasses.replace(s, trajectory_id=TrajectoryID(group_id, s.trajectory_id.sample_index)) for s in t]
        for t in rollout.trajectories
    ]
    return RolloutGroup(group_id, trajectories)


def _file_name(draw: int, data: bytes) -> str:
    return f"draw_{draw}.{hashlib.sha256(data).hexdigest()}.parquet"


def _parse_name(name: str) -> Optional[tuple[int, str]]:
    """(draw, checksum) of a bank file name, or None for any other name."""
    parts = name.split(".")
    if len(parts) != 3 or parts[2] != "parquet" or not parts[0].startswith("draw_") or len(parts[1]) != 64:
        return None
    try:
        return int(parts[0][len("draw_") :]), parts[1]
    except ValueError:
        return None


@dataclass
class Recovery:
    """What a resumed run reuses: by draw, the groups of its pending samples and of the draws its
    dataset will issue again."""

    pending: dict[int, BankedGroup] = field(default_factory=dict)
    reissued: dict[int, BankedGroup] = field(default_factory=dict)


class RolloutBank:
    """Rank 0's side of the bank: which file holds which draw, pruning, and the resume. `put` and
    `record` may run in a helper thread; everything else runs while the event loop is idle."""

    def __init__(self, run_dir: str | Path):
        # absolute: file names go to agent workers, whose working directory is not rank 0's
        self.run_dir = Path(run_dir).absolute()
        self.dir = RunDir(self.run_dir).rollout_bank
        self.discarded = 0  # banked groups not reused: damaged, or from weights a resume lost
        self._files: dict[int, Path] = {}
        self._newest: dict[int, int] = {}  # draw -> newest weight version of its tokens
        self._lock = threading.Lock()
        self._write_failed = False
        self._reissued: dict[int, BankedGroup] = {}
        # the last checkpoint's pending draws and weight version: a trained group whose file helps a
        # resume from it stays until the next checkpoint
        self._resume_draws: set[int] = set()
        self._resume_version = -1

    @property
    def held(self) -> int:
        return len(self._files)

    def ticket(self, draw: int, sample: dict[str, Any], group_id: str, start_version: int, attempt: int):
        """What the agent worker holding the group's rows needs to write its file (on a cluster the
        run directory is shared storage)."""
        return BankTicket(str(self.run_dir), draw, sample, group_id, start_version, attempt)

    # ---- writing ------------------------------------------------------------------------------
    def put(self, group: BankedGroup) -> None:
        """Write a finished group whose rows came to rank 0 (and `record` it). A failed write warns
        once and leaves the group unbanked: training goes on."""
        try:
            written = write_group(self.run_dir, group)
        except (OSError, ValueError, TypeError) as e:
            self._warn_unbanked(f"cannot write {self.dir} ({e})")
            return
        self.record(written)

    def record(self, written: Optional[BankFile], draw: Optional[int] = None) -> None:
        """A group's file was written (by rank 0, or by the agent worker holding its rows); it
        replaces an earlier file of its draw (a re-queued or regenerated attempt). None: the
        writer could not write it (`draw`, when given, loses an earlier file)."""
        if written is None:
            self._warn_unbanked("an agent worker could not write a finished group's file (see its log)")
            if draw is not None:
                self.drop(draw)
            return
        path = self.dir / written.name
        with self._lock:
            old = self._files.get(written.draw)
            self._files[written.draw] = path
            self._newest[written.draw] = written.newest_version
        if old is not None and old != path:
            _unlink(old)

    def _warn_unbanked(self, why: str) -> None:
        if not self._write_failed:
            log.warning("rollout bank: %s; finished groups go unbanked", why)
            self._write_failed = True

    def drop(self, draw: int) -> None:
        with self._lock:
            path = self._files.pop(draw, None)
            self._newest.pop(draw, None)
        if path is not None:
            _unlink(path)

    def clear(self) -> None:
        """A fresh run: nothing banked by an earlier run in this directory is reused."""
        for path in self._listing(remove_partial=True):
            _unlink(path)
        with self._lock:
            self._files.clear()
            self._newest.clear()

    # ---- the trainer's side -------------------------------------------------------------------
    def trained(self, draws: Iterable[int]) -> None:
        """Groups just trained: their files go, except those a resume from the last checkpoint reuses."""
        for draw in draws:
            if draw in self._resume_draws and self._newest.get(draw, self._resume_version + 1) <= self._resume_version:
                continue
            self.drop(draw)

    def checkpointed(self, outstanding: Iterable[int], pending: Iterable[int], version: int) -> None:
        """A checkpoint was saved at `version` with these pending draws: keep only the files of the
        groups outstanding now (and of re-issued draws not reached yet). Files nobody recorded (an
        agent worker that wrote one and died before answering) go too, once their draw is done."""
        keep = set(outstanding) | set(self._reissued)
        with self._lock:
            gone = [d for d in self._files if d not in keep]
        for draw in gone:
            self.drop(draw)
        for path in self._listing(remove_partial=False):
            if _parse_name(path.name)[0] not in keep:
                _unlink(path)
        self._resume_draws, self._resume_version = set(pending), version

    # ---- resuming -----------------------------------------------------------------------------
    def recover(self, pending: Sequence[tuple[dict[str, Any], int]], next_draw: int, version: int) -> Recovery:
        """Read the bank on a resume from a checkpoint at weight `version` whose pending samples
        are `pending` ((sample, draw) pairs) and whose dataset made `next_draw` draws; sort every
        banked group (module docstring). Damaged files and unusable groups are deleted."""
        by_draw = {draw: sample for sample, draw in pending}
        recovery = Recovery()
        lost = []
        for group in self._read_all():
            if group.newest_version > version:
                lost.append(group)
            elif group.draw in by_draw and _prompt_id(by_draw[group.draw]) == _prompt_id(group.sample):
                recovery.pending[group.draw] = group
            elif group.draw in by_draw:
                self.discard(group, f"its prompt is not the pending sample's ({_prompt_id(by_draw[group.draw])!r})")
            elif group.draw >= next_draw:
                recovery.reissued[group.draw] = group
            else:
                self.drop(group.draw)  # trained before the checkpoint
        if lost:
            log.warning(
                "rollout bank: %d group(s) discarded: made by weights newer than the checkpoint's "
                "(version %d), which the kill lost",
                len(lost),
                version,
            )
            for group in lost:
                self.discarded += 1
                self.drop(group.draw)
        self._reissued = dict(recovery.reissued)
        self._resume_draws, self._resume_version = set(by_draw), version
        return recovery

    def claim(self, draw: int, sample: dict[str, Any]) -> Optional[BankedGroup]:
        """The banked group of a draw the resumed dataset just re-issued (`sample`), if any."""
        group = self._reissued.pop(draw, None)
        if group is None:
            return None
        if _prompt_id(group.sample) != _prompt_id(sample):
            self.discard(group, f"the dataset re-issued another prompt for its draw ({_prompt_id(sample)!r})")
            return None
        return group

    def discard(self, group: BankedGroup, why: str) -> None:
        """A banked group not reused (warned about, counted, its file deleted): its prompt is rolled
        out again, or was trained already."""
        log.warning("rollout bank: group %r (draw %d) discarded: %s", group.group_id, group.draw, why)
        self.discarded += 1
        self.drop(group.draw)

    def _listing(self, remove_partial: bool) -> list[Path]:
        """The bank's files. `remove_partial`: half-written temporary files of a killed write are
        removed (only while no writer runs: at the start of a run)."""
        try:
            names = sorted(self.dir.iterdir())
        except FileNotFoundError:
            return []
        for path in names:
            if remove_partial and path.name.startswith(".draw_") and path.name.endswith(".tmp"):
                _unlink(path)
        return [p for p in names if _parse_name(p.name) is not None]

    def _read_all(self) -> list[BankedGroup]:
        """Every intact banked group (one per draw: the latest attempt); damaged files are
        deleted, warned about and counted."""
        groups: dict[int, BankedGroup] = {}
        for path in self._listing(remove_partial=True):
            try:
                group = read_group(path)
            except (OSError, ValueError) as e:  # any damage: the file is not trained, the run goes on
                log.warning("rollout bank: %s is damaged (%s); ignored, its prompt is rolled out again", path, e)
                self.discarded += 1
                _unlink(path)
                continue
            draw = group.draw
            older = groups.get(draw)
            if older is not None and older.attempt > group.attempt:
                _unlink(path)
                continue
            if older is not None:
                _unlink(self._files[draw])
            groups[draw] = group
            self._files[draw] = path
            self._newest[draw] = group.newest_version
        return list(groups.values())


def _prompt_id(sample: dict[str, Any]) -> str:
    return str(sample.get("prompt_id", ""))


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
