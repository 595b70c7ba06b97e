"""The rollout bank (`async.rollout_bank`): finished prompt groups not yet trained, kept in the run
directory so that a run resumed after a kill trains them instead of rolling their prompts out again.

Each finished group is written to `<run_dir>/rollout_bank/draw_<d>.<sha256>.parquet` before it
enters the group buffer, by whoever has its rows: the agent worker that holds them (rows kept in
the workers, the default with agent workers: `write_group` in the worker, which returns a
`BankFile` with the group's `HeldGroup`), else rank 0 (`RolloutBank.put`). The run directory is
shared storage on a cluster, as for checkpoints. Rank 0 only records which file belongs to which
draw (`RolloutBank.record`) and deletes files. The file format (names, checksums, columns) is
`rundir/bank_files.py`'s; a torn or damaged file is recognised, warned about, counted and never
trained. A file is also checked as data (`read_group`): another run's file (its run id or config
hash differs), a group without trajectories, rows `algo.validate.validate_steps` refuses (ragged
fields, non-finite values) and rewards beyond MAX_ABS_REWARD are discarded the same way. `d` is
the sample's dataset draw (`Group.draw`, counted from the run's start and saved in the
checkpoint): what ties a banked group to the prompt a resumed run issues again.

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
rows: `read_group`), else the group joins the buffer with its rows on rank 0 (`bank_recovery.py`). The bank is pruned at every checkpoint (it keeps
the groups outstanding then) and, between checkpoints, a trained group's file is deleted at once
unless the last checkpoint lists its draw as pending: only those help a resume from it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from megatron_stepwise.algo.groups import RolloutGroup
from megatron_stepwise.algo.validate import validate_steps
from megatron_stepwise.rundir.bank_files import (
    BankFile,
    decode_steps,
    encode_steps,
    listing,
    parse_name,
    read_file,
    unlink,
    write_file,
)
from megatron_stepwise.rundir.paths import RunDir
from megatron_stepwise.steps import TrajectoryID

log = logging.getLogger(__name__)

# A reward (or turn reward) beyond this is no environment's: a banked group carrying one was tampered
# with, and training on it would swamp every advantage of its batch.
MAX_ABS_REWARD = 1e6


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
    run_id: Optional[str] = None  # the writing run's (its file is never adopted by another run)
    config_hash: Optional[str] = None


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
    run_id: Optional[str] = None  # of the run that banked it
    config_hash: Optional[str] = None

    @classmethod
    def of(cls, ticket: BankTicket, rollout: RolloutGroup, end_version: int) -> "BankedGroup":
        return cls(
            ticket.draw,
            ticket.sample,
            ticket.group_id,
            ticket.start_version,
            ticket.attempt,
            end_version,
            rollout,
            run_id=ticket.run_id,
            config_hash=ticket.config_hash,
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
    """The group as a bank file's bytes (`bank_files.encode_steps`): its steps and its identity."""
    meta = {
        "draw": group.draw,
        "sample": group.sample,
        "group_id": group.group_id,
        "start_version": group.start_version,
        "attempt": group.attempt,
        "end_version": group.end_version,
        "run_id": group.run_id,
        "config_hash": group.config_hash,
    }
    return encode_steps(group.rollout.trajectories, meta)


def decode(data: bytes) -> BankedGroup:
    """`encode`'s bytes back as the group, its steps exactly as they were written."""
    trajectories, meta = decode_steps(data)
    if not isinstance(meta["sample"], dict):
        raise ValueError(f"its sample is a {type(meta['sample']).__name__}, not a dict")
    return BankedGroup(
        draw=_integer(meta, "draw"),
        sample=meta["sample"],
        group_id=str(meta["group_id"]),
        start_version=_integer(meta, "start_version"),
        attempt=_integer(meta, "attempt"),
        end_version=_integer(meta, "end_version"),
        rollout=RolloutGroup(str(meta["group_id"]), trajectories),
        run_id=meta.get("run_id"),
        config_hash=meta.get("config_hash"),
    )


def _integer(meta: dict, key: str) -> int:
    if type(meta[key]) is not int:
        raise ValueError(f"its {key} is {meta[key]!r}, not an integer")
    return meta[key]


def check_rows(group: BankedGroup) -> None:
    """ValueError (StepwiseBatchError) naming the first reason `group`'s rows may not be trained:
    no trajectories, rows `validate_steps` refuses, a reward beyond MAX_ABS_REWARD."""
    if not group.rollout.trajectories:
        raise ValueError("a group with no trajectories")
    steps = group.rollout.steps
    validate_steps(steps)
    for i, step in enumerate(steps):
        for name in ("reward", "turn_reward"):
            value = getattr(step, name)
            if not abs(value) <= MAX_ABS_REWARD:  # NaN included
                raise ValueError(
                    f"step {i}: field {name!r} is {value} (a bank file holds |{name}| <= {MAX_ABS_REWARD:g})"
                )


def write_group(run_dir: str | Path, group: BankedGroup) -> BankFile:
    """Write one group's file (atomic). Raises OSError, ValueError or TypeError when it cannot."""
    return BankFile(write_file(run_dir, group.draw, encode(group)), group.newest_version)


def read_group(path: str | Path) -> BankedGroup:
    """A bank file read back, checked against the checksum and draw its name carries and as rows
    (`check_rows`); ValueError (or OSError) names what is wrong with a damaged, hostile or missing file."""
    path = Path(path)
    draw, data = read_file(path)
    try:
        group = decode(data)
    except Exception as e:  # noqa: BLE001 - any format damage: one message naming it
        raise ValueError(f"unreadable: {type(e).__name__}: {e}") from None
    check_rows(group)
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


@dataclass
class Recovery:
    """What a resumed run reuses: by draw, the groups of its pending samples and of the draws its
    dataset will issue again."""

    pending: dict[int, BankedGroup] = field(default_factory=dict)
    reissued: dict[int, BankedGroup] = field(default_factory=dict)


class RolloutBank:
    """Rank 0's side of the bank: which file holds which draw, pruning, and the resume. `put` and
    `record` may run in a helper thread; everything else runs while the event loop is idle."""

    def __init__(self, run_dir: str | Path, *, run_id: Optional[str] = None, config_hash: Optional[str] = None):
        # absolute: file names go to agent workers, whose working directory is not rank 0's
        self.run_dir = Path(run_dir).absolute()
        self.run_id, self.config_hash = run_id, config_hash  # written in every file, checked on a resume
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
        return BankTicket(
            str(self.run_dir), draw, sample, group_id, start_version, attempt, self.run_id, self.config_hash
        )

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
            unlink(old)

    def _warn_unbanked(self, why: str) -> None:
        if not self._write_failed:
            log.warning("rollout bank: %s; finished groups go unbanked", why)
            self._write_failed = True

    def drop(self, draw: int) -> None:
        with self._lock:
            path = self._files.pop(draw, None)
            self._newest.pop(draw, None)
        if path is not None:
            unlink(path)

    def clear(self) -> None:
        """A fresh run: nothing banked by an earlier run in this directory is reused."""
        for path in listing(self.dir, remove_partial=True):
            unlink(path)
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
        for path in listing(self.dir, remove_partial=False):
            if parse_name(path.name)[0] not in keep:
                unlink(path)
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

    def _read_all(self) -> list[BankedGroup]:
        """Every intact banked group (one per draw: the latest attempt); damaged files are
        deleted, warned about and counted."""
        groups: dict[int, BankedGroup] = {}
        for path in listing(self.dir, remove_partial=True):
            try:
                group = read_group(path)
                self._check_owner(group)
            except Exception as e:  # noqa: BLE001 - any damage or tampering: the file is not trained, the run goes on
                why = str(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {e}"
                log.warning("rollout bank: %s is refused (%s); ignored, its prompt is rolled out again", path, why)
                self.discarded += 1
                unlink(path)
                continue
            draw = group.draw
            older = groups.get(draw)
            if older is not None and older.attempt > group.attempt:
                unlink(path)
                continue
            if older is not None:
                unlink(self._files[draw])
            groups[draw] = group
            self._files[draw] = path
            self._newest[draw] = group.newest_version
        return list(groups.values())

    def _check_owner(self, group: BankedGroup) -> None:
        """ValueError unless this run banked `group` (same run id and config hash)."""
        if (group.run_id, group.config_hash) != (self.run_id, self.config_hash):
            raise ValueError(
                f"written by another run (run_id {group.run_id}, config_hash {group.config_hash}; "
                f"this is run {self.run_id}, config_hash {self.config_hash})"
            )


def _prompt_id(sample: dict[str, Any]) -> str:
    return str(sample.get("prompt_id", ""))
