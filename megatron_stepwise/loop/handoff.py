"""Rank 0 produces, the training ranks receive: the hand-offs of the loop.

Only global rank 0 drives the rollout fleet and draws prompts. What it produces reaches the
other ranks one of two ways, always with the prompt dataset's position (every rank's checkpoint
must hold the same one) and rank 0's error, if any (raised on every rank: none is left waiting
in a collective):

- `from_driver`: one small object for every rank (decisions, timings);
- `to_ranks`: one payload per data-parallel rank (the mini-batch shards it trains), pickled once
  per DP rank and sent to one rank of that model replica, which broadcasts it to the replica's
  other ranks: each rank receives ~1/DP of the rollout's bytes, and rank 0 sends each byte once.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from megatron_stepwise.errors import RunFailure, UserError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from megatron_stepwise.loop.checkpointer import Stateful

T = TypeVar("T")  # what rank 0 produces: every rank receives it (or its own DP rank's)


class HandedOverUserError(UserError):
    """Rank 0's rollout stopped on bad input (a dataset rewritten during the run, ...): every rank
    raises this, so the run ends with the input error's exit code (2) and one message, not a
    traceback per rank."""


class HandedOverFailure(RunFailure):
    """Rank 0's rollout failed for a named `RunFailure` (its agent workers kept dying): every rank
    raises this, one line each and exit 1."""


def describe(e: BaseException) -> str:
    """'Type: message'. An exception group (an asyncio.TaskGroup's) by its distinct innermost
    errors: its own message ("unhandled errors in a TaskGroup") says nothing of what failed."""
    if isinstance(e, BaseExceptionGroup):
        leaves = list(dict.fromkeys(describe(x) for x in e.exceptions))
        return "; ".join(leaves[:3]) + (f"; and {len(leaves) - 3} more" if len(leaves) > 3 else "")
    return f"{type(e).__name__}: {e}"


def kind_of(e: BaseException) -> str:
    """How the other ranks learn of rank 0's error: "user_error" (a UserError, or an exception
    group, an asyncio.TaskGroup's, of nothing else), "failure" (RunFailures among those), "error"."""
    leaves = list(_leaves(e))
    if all(isinstance(x, UserError) for x in leaves):
        return "user_error"
    if all(isinstance(x, (UserError, RunFailure)) for x in leaves):
        return "failure"
    return "error"


def _leaves(e: BaseException):
    if isinstance(e, BaseExceptionGroup):
        for x in e.exceptions:
            yield from _leaves(x)
    else:
        yield e


def _first_line(e: BaseException) -> str:
    text = str(e)
    return text.splitlines()[0] if text else ""


@contextlib.contextmanager
def _handing_over(what: str, iteration: int):
    """A collective of the hand-off that fails (a rank died, or its node was cut off) ends this rank
    with one line saying what was under way, not gloo's bare socket error."""
    try:
        yield
    except Exception as e:
        raise RuntimeError(
            f"{what} at iteration {iteration}: handing the result to the ranks failed (a rank is gone or cut "
            f"off): {type(e).__name__}: {_first_line(e)}"
        ) from e


class ResolveFailed(RuntimeError):
    """A rank could not resolve its payload (raised on every rank alike). `lost`: what the failing
    ranks found gone (their errors' `lost` attribute, e.g. dead agent workers), which rank 0 may
    make again before handing the round off anew; empty when no rank said."""

    def __init__(self, message: str, lost: list[str]):
        super().__init__(message)
        self.lost = lost


class Handoff:
    """`dataset`: has state_dict()/load_state_dict(); `group`: a CPU (gloo) process group of every
    rank; `dp_rank`: this rank's data-parallel rank (for `to_ranks`); `timeout`: of the groups
    `to_ranks` opens inside each model replica."""

    def __init__(
        self,
        dataset: Stateful,
        group: Optional[ProcessGroup] = None,
        dp_rank: int = 0,
        timeout: Optional[timedelta] = None,
    ):
        self.dataset = dataset
        self.group = group
        self.dp_rank = dp_rank
        self.timeout = timeout  # of the replica groups `to_ranks` creates (default: torch's)
        self.is_driver = dist.get_rank() == 0
        self._replica_info: Optional[tuple] = None
        self.bytes_received = self.bytes_sent = 0  # by this rank through `to_ranks`, since it was built
        self.produce_seconds = 0.0  # rank 0's time inside `produce`; the rest of a hand-off is moving it
        self._produce_error: Optional[BaseException] = None  # rank 0's, in the hand-off under way

    def from_driver(self, produce: Callable[[], T], what: str, iteration: int) -> T:
        """Run `produce` on rank 0 and return its result on every rank."""
        with self._keeping_rank0_error(what, iteration):
            return self._from_driver(produce, what, iteration)

    def _from_driver(self, produce: Callable[[], T], what: str, iteration: int) -> T:
        payload: list[Optional[tuple]] = [None]
        error: Optional[BaseException] = None
        if self.is_driver:
            error, payload[0] = self._run(produce)
        dist.broadcast_object_list(payload, src=0, group=self.group)
        return self._open(payload[0], error, what, iteration)

    def to_ranks(
        self,
        produce: Callable[[], list[T]],
        what: str,
        iteration: int,
        resolve: Optional[Callable[[T], T]] = None,
    ) -> T:
        with self._keeping_rank0_error(what, iteration):
            return self._to_ranks(produce, what, iteration, resolve)

    def _to_ranks(
        self,
        produce: Callable[[], list[T]],
        what: str,
        iteration: int,
        resolve: Optional[Callable[[T], T]] = None,
    ) -> T:
        """Run `produce` on rank 0; it returns one payload per data-parallel rank, and every rank
        returns its own DP rank's. Rank 0 pickles each payload once and sends it to one rank of
        that DP rank's model replica, which broadcasts it to the others. `resolve`, when given,
        is applied by that one rank before the broadcast (it fetches the rows a payload only
        names); a failure there is raised on every rank."""
        _, leaders, groups = self._replicas()
        dp = self.dp_rank
        leader = dist.get_rank() == leaders[dp]
        sizes = torch.zeros(len(leaders), dtype=torch.long)
        error: Optional[BaseException] = None
        if self.is_driver:
            error, (kind, result, state) = self._run(produce)
            if kind == "ok" and len(result) != len(leaders):
                kind, result = "error", f"{what} produced {len(result)} payloads for {len(leaders)} DP ranks"
            per_dp = result if kind == "ok" else [result] * len(leaders)
            blobs = {
                d: bytearray(pickle.dumps((kind, per_dp[d], state), protocol=5))
                for d in range(len(leaders))
                if leaders[d] != 0 or (groups[d] is not None and resolve is None)
            }
            for d, b in blobs.items():
                sizes[d] = len(b)
            mine = (kind, per_dp[dp], state)
        with _handing_over(what, iteration):
            if dist.get_world_size() > 1:
                dist.broadcast(sizes, src=0, group=self.group)
            if self.is_driver:
                sends = [
                    dist.isend(torch.frombuffer(blobs[d], dtype=torch.uint8), dst=leaders[d], group=self.group)
                    for d in range(len(leaders))
                    if leaders[d] != 0
                ]
                for work in sends:
                    work.wait()
                self.bytes_sent += sum(len(blobs[d]) for d in range(len(leaders)) if leaders[d] != 0)
            elif leader:
                buf = torch.empty(int(sizes[dp]), dtype=torch.uint8)
                dist.recv(buf, src=0, group=self.group)
                self.bytes_received += buf.numel()
                mine = pickle.loads(memoryview(buf.numpy()))  # no copy of the bytes
            if resolve is None and groups[dp] is not None:
                # the replica's other ranks get rank 0's bytes from their leader
                raw = None
                if leader:
                    raw = torch.frombuffer(blobs[dp], dtype=torch.uint8) if self.is_driver else buf
                mine = self._share(mine if leader else None, raw, groups[dp], leaders[dp])
        if resolve is None:
            return self._open(mine, error, what, iteration)
        failure = None
        if leader and mine[0] == "ok":
            try:
                mine = ("ok", resolve(mine[1]), mine[2])
            except Exception as e:  # every rank must leave the agreement below, then all raise
                text = f"DP rank {dp} (global rank {dist.get_rank()}): {type(e).__name__}: {e}"
                failure = (text, list(getattr(e, "lost", ())))
                mine = ("error", text, None)
        try:
            if groups[dp] is not None:
                mine = self._share(mine if leader else None, None, groups[dp], leaders[dp])
            self._agree(failure, what, iteration)
        except ResolveFailed:
            raise
        except Exception as e:  # a rank cut off (its node's network down): say what was under way
            told = f"{type(e).__name__}: {_first_line(e)}"
            if failure is None:
                raise RuntimeError(
                    f"{what} at iteration {iteration}: agreeing on the fetched rows failed: {told}"
                ) from e
            # this rank's own failure stays its error, not the collective's timeout that followed it
            raise RuntimeError(
                f"{what} at iteration {iteration}: fetching the rows failed on {failure[0]} "
                f"(and telling the other ranks failed: {told})"
            ) from e
        return self._open(mine, error, what, iteration)

    def _share(self, payload: object, raw: Optional[torch.Tensor], group: ProcessGroup, src: int) -> object:
        """The replica leader's payload on every rank of its replica (`raw`: its pickled bytes,
        when the leader has them already)."""
        size = torch.zeros(1, dtype=torch.long)
        buf = raw
        if dist.get_rank() == src:
            if buf is None:
                buf = torch.frombuffer(bytearray(pickle.dumps(payload, protocol=5)), dtype=torch.uint8)
            size[0] = buf.numel()
        dist.broadcast(size, src=src, group=group)
        if dist.get_rank() != src:
            buf = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=group)
        if dist.get_rank() == src:
            self.bytes_sent += buf.numel() * (dist.get_world_size(group) - 1)
            return payload if payload is not None else pickle.loads(memoryview(buf.numpy()))
        self.bytes_received += buf.numel()
        return pickle.loads(memoryview(buf.numpy()))

    def _agree(self, failure: Optional[tuple[str, list[str]]], what: str, iteration: int) -> None:
        """Every rank raises the same ResolveFailed when any rank failed to resolve its payload."""
        if dist.get_world_size() == 1:
            failures = [failure]
        else:
            failures = [None] * dist.get_world_size()
            dist.all_gather_object(failures, failure, group=self.group)
        failed = [f for f in failures if f is not None]
        if failed:
            lost = sorted({name for _, names in failed for name in names})
            raise ResolveFailed(f"{what} at iteration {iteration}: fetching the rows failed on {failed[0][0]}", lost)

    def _replicas(self) -> tuple[list[int], list[int], list[Optional[ProcessGroup]]]:
        """(each rank's DP rank, each DP rank's leader: its lowest global rank, each DP rank's
        group of ranks when it has more than one), gathered and created once on every rank."""
        if self._replica_info is None:
            dp_of: list[Optional[int]] = [None] * dist.get_world_size()
            dist.all_gather_object(dp_of, self.dp_rank, group=self.group)
            members = [[r for r, d in enumerate(dp_of) if d == k] for k in range(max(dp_of) + 1)]
            # every rank creates every group, in the same order (torch.distributed requires it)
            groups = [dist.new_group(m, backend="gloo", timeout=self.timeout) if len(m) > 1 else None for m in members]
            self._replica_info = (dp_of, [m[0] for m in members], groups)
        return self._replica_info

    @contextlib.contextmanager
    def _keeping_rank0_error(self, what: str, iteration: int):
        """Rank 0's own failure stays the error it raises when telling the other ranks fails too:
        with a rank cut off (its node's network down), the collective's timeout would replace it."""
        self._produce_error = None
        try:
            yield
        except Exception as e:
            error = self._produce_error
            if error is None or e.__cause__ is error or isinstance(e, (HandedOverUserError, HandedOverFailure)):
                raise
            raise RuntimeError(
                f"{what} failed on rank 0 at iteration {iteration}: {describe(error)} "
                f"(and telling the other ranks failed: {type(e).__name__}: {_first_line(e)})"
            ) from error

    def _run(self, produce: Callable[[], object]) -> tuple[Optional[BaseException], tuple]:
        start = time.perf_counter()
        try:
            return None, ("ok", produce(), self.dataset.state_dict())
        except Exception as e:  # every rank must leave the collective, then all raise
            self._produce_error = e
            # As text: the exception itself may not pickle (Ray and HTTP client errors hold
            # locks and sockets), and a failed pickle would leave the other ranks waiting.
            return e, (kind_of(e), describe(e), None)
        finally:
            self.produce_seconds += time.perf_counter() - start

    def _open(self, payload: tuple, error: Optional[BaseException], what: str, iteration: int):
        kind, result, dataset_state = payload
        if kind == "user_error":
            raise HandedOverUserError(f"{what} stopped on rank 0 at iteration {iteration}: {result}") from None
        if kind == "failure":
            raise HandedOverFailure(f"{what} failed on rank 0 at iteration {iteration}: {result}") from None
        if kind == "error":
            raise RuntimeError(f"{what} failed on rank 0 at iteration {iteration}: {result}") from error
        self.dataset.load_state_dict(dataset_state)
        return result
