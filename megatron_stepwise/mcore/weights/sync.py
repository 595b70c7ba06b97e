"""Push the policy's weights to the rollout fleet after an optimizer step.

Three transports, chosen by `weight_sync.mode` (`disk`, `tensor`, `distributed`); in every one
the trainer ranks convert their own weights to HF names (`weights/convert.py`) and only global
rank 0 talks to the fleet. `WeightSync` keeps what lives across pushes (the event loop driving
the fleet, the distributed group). Every push is checked against the trainer's record of what it
sent (`weight_sync.verify`, `sync_verify.py`): in sampled mode each engine answers the update
request itself with its samples of what it loaded (no second request), in full mode a request
after the update compares digests; a mismatch stops the run on every rank, naming the tensor, the
engine and the version.

How each transport moves the buckets: docs/weights.md, 'Weight sync to the fleet' and
'The three sync transports'.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_stepwise import weight_checks, weight_transport
from megatron_stepwise.hf.arch import HFConfig, model_spec
from megatron_stepwise.mcore.runtime.runtime import free_port
from megatron_stepwise.mcore.weights import convert
from megatron_stepwise.mcore.weights.fileops import raise_together
from megatron_stepwise.mcore.weights.sync_verify import (
    PushRecord,
    WeightMismatch,
    judge_samples,
    merge_answers,
    mismatch_message,
    unverified_reasons,
)

log = logging.getLogger(__name__)

MODES = ("disk", "tensor", "distributed")
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


class WeightSyncError(RuntimeError):
    """A weight push that cannot be done as configured (named in the message)."""


def version_dir(root: Any, version: int) -> Path:
    return Path(root) / f"v{int(version):06d}"


def prune_versions(root: Any, keep: int) -> list[Path]:
    """Delete all but the newest `keep` version directories under `root`; returns what went."""
    found = sorted(
        (p for p in Path(root).iterdir() if p.is_dir() and _VERSION_DIR.match(p.name)), key=lambda p: int(p.name[1:])
    )
    removed = found[:-keep] if keep > 0 else found
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


class WeightSync:
    """Weight pushes to one fleet (see module docstring). Create it on every training rank.

    fleet: the `RolloutFleet` on global rank 0 (None on the other ranks).
    hf_config: the HF config the policy was built from (parsed here once).
    loop: the asyncio loop the fleet's coroutines run on (rank 0); a private one if None.
    sync_dir: shared directory for mode="disk" (visible to trainer ranks and engines).
    dtype: dtype sent to the engines (default: the parameters' own).
    verify: "sampled" (default), "full" or "off": how every push is checked on the engines.
    """

    def __init__(
        self,
        fleet: Any,
        mode: str,
        hf_config: HFConfig,
        *,
        loop: Optional[asyncio.AbstractEventLoop] = None,
        bucket_mb: float = 512,
        sync_dir: Optional[Any] = None,
        keep_versions: int = 2,
        dtype: Optional[torch.dtype] = None,
        atomic: bool = True,
        master_address: Optional[str] = None,
        master_port: Optional[int] = None,
        verify: str = "sampled",
    ):
        if mode not in MODES:
            raise WeightSyncError(f"weight_sync.mode must be one of {MODES}, got {mode!r}")
        if verify not in weight_checks.VERIFY_MODES:
            raise WeightSyncError(f"weight_sync.verify must be one of {weight_checks.VERIFY_MODES}, got {verify!r}")
        if mode == "disk" and sync_dir is None:
            raise WeightSyncError("weight_sync.mode='disk' needs a shared directory (weight_sync.dir)")
        if keep_versions < 1:
            raise WeightSyncError(f"keep_versions must be >= 1, got {keep_versions}")
        self.is_driver = dist.get_rank() == 0
        if self.is_driver and fleet is None:
            raise WeightSyncError("global rank 0 drives the fleet: pass it the RolloutFleet")
        self.fleet = fleet if self.is_driver else None
        self.mode, self.model = mode, model_spec(hf_config)
        self.bucket_mb, self.dtype, self.atomic = bucket_mb, dtype, atomic
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        self.keep_versions = keep_versions
        self.master_address, self.master_port = master_address, master_port
        self._own_loop = self.is_driver and loop is None
        self.loop = asyncio.new_event_loop() if self._own_loop else loop
        self._group = None
        self.verify_mode = verify
        self._last: Optional[PushRecord] = None  # the last push's record (rank 0), for `verify`
        self._sent_last: Optional[list] = None  # (name, numel) this rank recorded last push: positioned ahead
        self._unverified_warned: set[str] = set()  # reasons already logged (once each)
        self._sampler_pool: Optional[ThreadPoolExecutor] = None  # samples buckets beside the push

    def _sampler(self) -> ThreadPoolExecutor:
        if self._sampler_pool is None:
            self._sampler_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-sampler")
        return self._sampler_pool

    # ------------------------------------------------------------------------------- API
    def push(self, chunks: list, version: int) -> dict[str, float]:
        """Send the current weights as `version`; collective over all training ranks.

        Returns timing / volume metrics on rank 0 ({} elsewhere)."""
        start = time.perf_counter()
        record = None
        if self.verify_mode != "off":
            record = PushRecord(version, self.verify_mode, self._sampler(), self._sent_last)
        nbytes, buckets, answers = {"disk": self._disk, "tensor": self._tensor, "distributed": self._distributed}[
            self.mode
        ](chunks, int(version), record)
        checked = self._check(record, answers) if record is not None else {}
        if record is not None:
            self._sent_last = record.sent()
        if not self.is_driver:
            return {}
        seconds = time.perf_counter() - start
        metrics = {
            "weight_sync/seconds": seconds,
            "weight_sync/bytes": float(nbytes),
            "weight_sync/buckets": float(buckets),
            "weight_sync/MBps": nbytes / 2**20 / max(seconds, 1e-9),
        }
        if checked:
            metrics.update(checked)
            metrics["weight_sync/verify_share"] = checked["weight_sync/verify_s"] / max(seconds, 1e-9)
        return metrics

    def verify(self) -> dict[str, float]:
        """Check the engines again against the last push's record (collective; on demand, e.g.
        after an engine restart). Raises `WeightMismatch` on every rank; {} when nothing to check."""
        record = self._last if self.is_driver else None
        has_record = [record is not None]
        dist.broadcast_object_list(has_record, src=0)
        if not has_record[0]:
            return {}
        if record is not None:
            record.seconds = 0.0
        return self._check(record, None)

    def close(self) -> None:
        self._group = None
        if self._sampler_pool is not None:
            self._sampler_pool.shutdown(wait=True)
            self._sampler_pool = None
        if self._own_loop and self.loop is not None:
            self.loop.close()
            self.loop = None

    # ------------------------------------------------------------------------------- modes
    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    def _sampled(self, record: Optional[PushRecord]) -> bool:
        """Whether the engines answer this push's update with their samples (sampled mode)."""
        return record is not None and record.mode == "sampled"

    def _update_kwargs(self, record: Optional[PushRecord]) -> dict:
        return {"sample_weights": True} if self._sampled(record) else {}

    def _check(self, record: Optional[PushRecord], answers: Optional[list]) -> dict[str, float]:
        """Judge the push on rank 0: the engines' `answers` to a sampled update compared with
        `record`, or (answers None: full mode, `verify()`) a request asking every engine to compare
        its weights with `record`. Every rank raises `WeightMismatch` if one differs. Collective.
        Returns the verification metrics on rank 0."""
        if record is not None:
            record.finish()
        error = None
        metrics: dict[str, float] = {}
        if self.is_driver:
            self._last = record
            start = time.perf_counter()
            engine_s = 0.0  # the engines' sampling inside the update, which the push waited for
            judged: list = []
            try:
                if answers is None:
                    judged = self._run(self.fleet.verify_weights(record.checks, record.version))
                else:
                    engine_s = max((a.get("sample_s", 0.0) for a in answers), default=0.0)
                    judged = judge_samples(answers, record)
                error = mismatch_message(judged, record.version)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = f"weight sync of version {record.version}: verification failed ({type(e).__name__}: {e})"
            unverified = unverified_reasons(judged)
            new_reasons = [r for r in unverified if r not in self._unverified_warned]
            if new_reasons:
                self._unverified_warned.update(new_reasons)
                log.warning(
                    "weight_sync.verify: %d engine(s) did not check this push (%s); counted in "
                    "weight_sync/unverified_engines (docs/weights.md)",
                    len(unverified),
                    "; ".join(unverified),
                )
            metrics = {
                "weight_sync/verify_s": record.seconds + engine_s + time.perf_counter() - start,
                "weight_sync/verified_tensors": float(len(record.checks)),
                "weight_sync/verified_engines": float(len(judged) - len(unverified)),
                "weight_sync/unverified_engines": float(len(unverified)),
            }
        raise_together(error, WeightMismatch)
        return metrics

    def _disk(self, chunks: list, version: int, record: Optional[PushRecord]) -> tuple[int, int]:
        path = version_dir(self.sync_dir, version)
        convert.export_model(
            chunks,
            path,
            self.model,
            bucket_mb=self.bucket_mb,
            dtype=self.dtype,
            overwrite=True,
            on_bucket=record.add if record is not None else None,
        )
        if record is not None:
            record.sample_held()  # sampled while the records gather and the engines load
            self._gather_records(record)
        if not self.is_driver:
            return 0, 0, None
        index = convert.load_hf_index(path)
        answers = self._run(
            self.fleet.update_weights_from_disk(str(path), weight_version=version, **self._update_kwargs(record))
        )
        prune_versions(self.sync_dir, self.keep_versions)
        return index["metadata"]["total_size"], len(set(index["weight_map"].values())), self._answers(record, answers)

    def _answers(self, record: Optional[PushRecord], answers: Any) -> Optional[list]:
        """The update's answers when they carry the check (sampled mode), else None."""
        return answers if self._sampled(record) else None

    def _gather_records(self, record: PushRecord) -> None:
        """Disk mode, collective: each stage recorded the files it wrote; rank 0 folds them into its
        own record (kept as it is: gathering it to itself would pickle it for nothing; its last
        bucket may still be sampled while the engines load)."""
        if not self.is_driver:
            record.finish()
        parts = [None] * dist.get_world_size() if self.is_driver else None
        mine = (record.checks, record.seconds) if record.checks and not self.is_driver else None
        dist.gather_object(mine, parts, dst=0)
        if self.is_driver:
            record.merge(parts)

    def _tensor(self, chunks: list, version: int, record: Optional[PushRecord]) -> tuple[int, int, Optional[list]]:
        nbytes = buckets = 0
        pending: list = []
        rounds: list = []  # the engines' answers to each update request
        kwargs = self._update_kwargs(record)
        for bucket in convert.stream_hf_buckets(chunks, self.model.arch, bucket_mb=self.bucket_mb, dtype=self.dtype):
            if record is not None:
                record.add(bucket)
            buckets += 1
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if self.atomic:
                pending.extend(bucket)
            else:
                if record is not None:
                    record.sample_held()  # sampled while the engines load it
                rounds.append(
                    self._run(self.fleet.update_weights_from_tensors(bucket, weight_version=version, **kwargs))
                )
        if self.is_driver and self.atomic:
            if record is not None:
                record.sample_held()  # sampled while the engines load
            rounds.append(self._run(self.fleet.update_weights_from_tensors(pending, weight_version=version, **kwargs)))
        return nbytes, buckets, merge_answers(rounds) if self._sampled(record) and self.is_driver else None

    def _distributed(self, chunks: list, version: int, record: Optional[PushRecord]) -> tuple[int, int, Optional[list]]:
        meta = convert.hf_metadata(chunks, self.model.arch, dtype=self.dtype)
        stream = convert.stream_hf_buckets(chunks, self.model.arch, bucket_mb=self.bucket_mb, dtype=self.dtype)
        if not self.is_driver:
            deque(stream, maxlen=0)  # take part in the gathers / sends
            return 0, 0, None
        group = self.open_group()
        names = [name for name, _, _ in meta]
        counts = {"bytes": 0, "buckets": 0}

        def send_all() -> None:
            # Runs in a worker thread: the loop must stay free to drive the engines' receives.
            sent = 0
            for bucket in stream:
                for (name, tensor), expected in zip(bucket, names[sent : sent + len(bucket)]):
                    if name != expected:
                        raise WeightSyncError(f"stream order changed: got {name!r}, announced {expected!r}")
                if record is not None:
                    record.add(bucket)  # first: kept (or sampled) before it is broadcast
                weight_transport.broadcast(group, [t for _, t in bucket])
                sent += len(bucket)
                counts["buckets"] += 1
                counts["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
            if sent != len(names):
                raise WeightSyncError(f"sent {sent} tensors, announced {len(names)}")
            if record is not None:
                record.sample_held()  # sampled while the engines load what they received

        async def both():
            dtypes = [weight_transport.dtype_name(d) for _, _, d in meta]
            update = self.fleet.update_weights_from_distributed(
                names, dtypes, [list(s) for _, s, _ in meta], weight_version=version, **self._update_kwargs(record)
            )
            answers, _ = await asyncio.gather(update, asyncio.get_running_loop().run_in_executor(None, send_all))
            return answers

        answers = self._run(both())
        return counts["bytes"], counts["buckets"], self._answers(record, answers)

    def open_group(self):
        """The weight-update process group of the trainer (rank 0) and every TP rank of every
        live engine; opened on first use (a distributed push opens it itself)."""
        if self._group is not None:
            return self._group
        port = self.master_port or free_port("")  # engines may be remote: any interface
        world_size = self.fleet.weight_update_world_size()  # trainer + every TP rank of every engine
        address = self.master_address or self.fleet.weight_group_address()

        async def both():
            trainer_side = asyncio.get_running_loop().run_in_executor(
                None, weight_transport.open_group, address, port, world_size
            )
            engines = await self.fleet.init_weights_update_group(address, port)
            group = await trainer_side
            if engines != world_size:
                raise WeightSyncError(f"the fleet's weight-update group has {engines} ranks, expected {world_size}")
            return group

        self._group = self._run(both())
        return self._group
