"""The trainer's side of "every weight sync verified": record what a push sent, judge the answers.

`PushRecord` takes each bucket as it is sent (on whichever rank holds it), sampling it on a
helper thread beside the transfer, and keeps a `weight_checks.TensorCheck` per tensor. In
sampled mode each engine answers the update request itself with its samples of what it loaded;
`judge_samples` compares them with the record (`merge_answers` joins the answers of a push sent
in several requests). `mismatch_message` turns the engines' answers into the one error that
stops the run, naming the tensor, the engine and the weight version.
The protocol and its cost: docs/weights.md, 'Every sync verified'.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Executor, Future
from typing import Any, Iterable, Optional

import torch

from megatron_stepwise import weight_checks

MAX_NAMED = 3  # tensors named per engine in the error; the rest are counted


class WeightMismatch(RuntimeError):
    """An engine holds other weights than the trainer sent (named in the message)."""


HOLD_MB = 1024  # CPU buckets a push keeps for sampling while the engines load, at most


class PushRecord:
    """The checks of one push's tensors (those this rank sent) and the seconds the push spent on
    them.

    With a `sampler` (a one-thread executor) CPU buckets are sampled off the push's path: `add`
    keeps each bucket (up to `hold_mb` of them) and returns, and the push calls `sample_held`
    when it starts waiting for the engines, so that the sampling thread works while they load
    and the push's own thread (idle then) does not compete with it for the GIL. Past `hold_mb`
    a bucket is sampled as it comes, beside the push, one in flight. `finish` waits for all of
    it before the record is compared or sent. `seconds` counts what the push waited for."""

    def __init__(
        self,
        version: int,
        mode: str,
        sampler: Optional[Executor] = None,
        expected: Optional[list[tuple[str, int]]] = None,
        hold_mb: float = HOLD_MB,
    ):
        if mode not in weight_checks.VERIFY_MODES or mode == "off":
            raise ValueError(f"weight_sync.verify must be 'sampled' or 'full' to record a push, got {mode!r}")
        self.version, self.mode = int(version), mode
        self.checks = weight_checks.Checks()
        self.seconds = 0.0
        self._sampler = sampler if mode == "sampled" else None  # full hashes whole buckets: kept in line
        self._futures: list[Future] = []  # the sampling thread's work, in the order the buckets came
        self._held: list = []  # CPU buckets kept until `sample_held`
        self._held_bytes, self._hold_bytes = 0, int(hold_mb * 2**20)
        self._positions = weight_checks.Positions(version)
        if self._sampler is not None and expected:
            # the tensors of the last push, most likely this one's too: positioned while the first bucket converts
            names, numels = zip(*expected)
            self._sampler.submit(self._positions.prepare, list(names), list(numels))

    def sent(self) -> list[tuple[str, int]]:
        """(name, element count) of every tensor recorded: the next push's `expected`."""
        return [(name, math.prod(c.shape)) for name, c in self.checks.items()]

    def add(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        start = time.perf_counter()
        bucket = list(bucket)
        with weight_checks.plain_torch():  # a training rank's CPU mode would see every `numel()`
            on_cpu = all(t.is_cpu for _, t in bucket)
            nbytes = sum(t.nbytes for _, t in bucket)
        if self._sampler is None or not on_cpu:
            # (GPU buckets are sampled in line: cheap there, and no stream to order against)
            self._collect()
            self.checks.update(self._sample([bucket]))
        else:
            if self._held_bytes + nbytes > self._hold_bytes:  # over the budget: sampled now, one in flight
                self.sample_held()
                self._collect()
                self._futures.append(self._sampler.submit(self._sample, [bucket]))
            else:
                self._held.append(bucket)
                self._held_bytes += nbytes
        self.seconds += time.perf_counter() - start

    def sample_held(self) -> None:
        """Hand the kept buckets to the sampling thread (the push calls it as it starts waiting for
        the engines). Safe from any thread of the push."""
        if self._held:
            held, self._held, self._held_bytes = self._held, [], 0
            self._futures.append(self._sampler.submit(self._sample, held))

    def finish(self) -> None:
        """Wait for every bucket to be sampled (before the record is compared or sent)."""
        start = time.perf_counter()
        self.sample_held()
        self._collect()
        self.seconds += time.perf_counter() - start

    def _sample(self, buckets: list) -> dict:
        out: dict = {}
        for bucket in buckets:
            out.update(weight_checks.checks_of(bucket, self.version, self.mode, self._positions))
        return out

    def _collect(self) -> None:
        while self._futures:
            self.checks.update(self._futures.pop(0).result())

    def merge(self, others: Iterable[Optional[tuple[dict, float]]]) -> None:
        """Fold in other ranks' (checks, seconds) (disk mode: each stage records its own files)."""
        for other in others:
            if other is not None:
                checks, seconds = other
                self.checks.update(checks)
                self.seconds = max(self.seconds, seconds)  # stages record in parallel


def merge_answers(rounds: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One answer per engine from the answers of several update requests of one push (tensor
    mode, `atomic: false`: a request per bucket): their samples joined, the last version held;
    unverified if any request was."""
    merged: dict[int, dict[str, Any]] = {}
    for answers in rounds:
        for a in answers:
            into = merged.get(a["index"])
            if into is None:
                merged[a["index"]] = into = {**a}
                if a.get("samples") is not None:
                    into["samples"] = weight_checks.Checks(a["samples"])
                continue
            if a.get("unverified"):
                into.update(unverified=True, reason=a.get("reason", ""))
            if a.get("samples") is not None and into.get("samples") is not None:
                into["samples"].update(a["samples"])
            into["sample_s"] = into.get("sample_s", 0.0) + a.get("sample_s", 0.0)
            if "weight_version" in a:
                into["weight_version"] = a["weight_version"]
    return [merged[i] for i in sorted(merged)]


def judge_samples(answers: list[dict[str, Any]], record: PushRecord) -> list[dict[str, Any]]:
    """The engines' update answers as verification answers ({"index", "engine", "weight_version",
    "problems": {tensor: why}}): each engine's samples compared with the record. Unverified
    answers pass through; an answer that claims to be verified but carries no samples is a problem.
    (The caller times it: `WeightSync` counts it in `weight_sync/verify_s` beside `record.seconds`.)"""
    record.finish()
    out = []
    for a in answers:
        if a.get("unverified"):
            out.append(a)
            continue
        samples = a.get("samples")
        if samples is None:
            problems = {"(samples)": "the engine's answer to the update carries no samples"}
        else:
            problems = weight_checks.compare_samples(samples, record.checks, record.version)
        out.append({k: v for k, v in a.items() if k != "samples"} | {"problems": problems})
    return out


def unverified_reasons(answers: list[dict[str, Any]]) -> list[str]:
    """Why engines did not verify a push, one line per engine (an SGLang server, an engine that
    died during the update)."""
    return [
        f"engine {a['index']}: {a.get('reason') or 'cannot check its weights'}" for a in answers if a.get("unverified")
    ]


def mismatch_message(answers: list[dict[str, Any]], version: int) -> Optional[str]:
    """The error for engines whose weights differ from what was sent at `version` (None if none)."""
    lines = []
    for a in answers:
        if a.get("unverified"):
            continue
        who = f"engine {a['index']} ({a.get('engine', '?')})"
        problems = dict(a.get("problems") or {})
        if int(a.get("weight_version", version)) != int(version):
            problems = {"(weight version)": f"the engine reports version {a['weight_version']}", **problems}
        if not problems:
            continue
        named = "; ".join(f"{name}: {why}" for name, why in list(problems.items())[:MAX_NAMED])
        more = f"; and {len(problems) - MAX_NAMED} more tensors" if len(problems) > MAX_NAMED else ""
        lines.append(f"{who} holds {len(problems)} tensor(s) other than sent: {named}{more}")
    if not lines:
        return None
    return f"weight sync of version {version} verified wrong: " + " | ".join(lines)
