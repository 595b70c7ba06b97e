"""Push the policy's weights to the rollout fleet after an optimizer step.

Three transports, chosen by `weight_sync.mode` (`disk`, `tensor`, `distributed`); in every one
the trainer ranks convert their own weights to HF names (`weights/convert.py`) and only global
rank 0 talks to the fleet. `WeightSync` keeps what lives across pushes (the event loop driving
the fleet, the distributed group).

How each transport moves the buckets: docs/weights.md, 'Weight sync to the fleet' and
'The three sync transports'.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_stepwise import weight_transport
from megatron_stepwise.mcore.runtime.runtime import free_port
from megatron_stepwise.mcore.weights import convert

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
    hf_config: the HF config the policy was built from.
    loop: the asyncio loop the fleet's coroutines run on (rank 0); a private one if None.
    sync_dir: shared directory for mode="disk" (visible to trainer ranks and engines).
    dtype: dtype sent to the engines (default: the parameters' own).
    """

    def __init__(
        self,
        fleet: Any,
        mode: str,
        hf_config: Any,
        *,
        loop: Optional[asyncio.AbstractEventLoop] = None,
        bucket_mb: float = 512,
        sync_dir: Optional[Any] = None,
        keep_versions: int = 2,
        dtype: Optional[torch.dtype] = None,
        atomic: bool = True,
        master_address: Optional[str] = None,
        master_port: Optional[int] = None,
    ):
        if mode not in MODES:
            raise WeightSyncError(f"weight_sync.mode must be one of {MODES}, got {mode!r}")
        if mode == "disk" and sync_dir is None:
            raise WeightSyncError("weight_sync.mode='disk' needs a shared directory (weight_sync.dir)")
        if keep_versions < 1:
            raise WeightSyncError(f"keep_versions must be >= 1, got {keep_versions}")
        self.is_driver = dist.get_rank() == 0
        if self.is_driver and fleet is None:
            raise WeightSyncError("global rank 0 drives the fleet: pass it the RolloutFleet")
        self.fleet = fleet if self.is_driver else None
        self.mode, self.hf_config = mode, hf_config
        self.bucket_mb, self.dtype, self.atomic = bucket_mb, dtype, atomic
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        self.keep_versions = keep_versions
        self.master_address, self.master_port = master_address, master_port
        self._own_loop = self.is_driver and loop is None
        self.loop = asyncio.new_event_loop() if self._own_loop else loop
        self._group = None

    # ------------------------------------------------------------------------------- API
    def push(self, chunks: list, version: int) -> dict[str, float]:
        """Send the current weights as `version`; collective over all training ranks.

        Returns timing / volume metrics on rank 0 ({} elsewhere)."""
        start = time.perf_counter()
        nbytes, buckets = {"disk": self._disk, "tensor": self._tensor, "distributed": self._distributed}[self.mode](
            chunks, int(version)
        )
        if not self.is_driver:
            return {}
        seconds = time.perf_counter() - start
        return {
            "weight_sync/seconds": seconds,
            "weight_sync/bytes": float(nbytes),
            "weight_sync/buckets": float(buckets),
            "weight_sync/MBps": nbytes / 2**20 / max(seconds, 1e-9),
        }

    def close(self) -> None:
        self._group = None
        if self._own_loop and self.loop is not None:
            self.loop.close()
            self.loop = None

    # ------------------------------------------------------------------------------- modes
    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    def _disk(self, chunks: list, version: int) -> tuple[int, int]:
        path = version_dir(self.sync_dir, version)
        convert.export_hf(chunks, path, self.hf_config, bucket_mb=self.bucket_mb, dtype=self.dtype, overwrite=True)
        if not self.is_driver:
            return 0, 0
        index = convert.load_hf_index(path)
        self._run(self.fleet.update_weights_from_disk(str(path), weight_version=version))
        prune_versions(self.sync_dir, self.keep_versions)
        return index["metadata"]["total_size"], len(set(index["weight_map"].values()))

    def _tensor(self, chunks: list, version: int) -> tuple[int, int]:
        nbytes = buckets = 0
        pending: list = []
        for bucket in convert.stream_hf_buckets(chunks, self.hf_config, bucket_mb=self.bucket_mb, dtype=self.dtype):
            buckets += 1
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if self.atomic:
                pending.extend(bucket)
            else:
                self._run(self.fleet.update_weights_from_tensors(bucket, weight_version=version))
        if self.is_driver and self.atomic:
            self._run(self.fleet.update_weights_from_tensors(pending, weight_version=version))
        return nbytes, buckets

    def _distributed(self, chunks: list, version: int) -> tuple[int, int]:
        meta = convert.hf_metadata(chunks, self.hf_config, dtype=self.dtype)
        stream = convert.stream_hf_buckets(chunks, self.hf_config, bucket_mb=self.bucket_mb, dtype=self.dtype)
        if not self.is_driver:
            deque(stream, maxlen=0)  # take part in the gathers / sends
            return 0, 0
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
                weight_transport.broadcast(group, [t for _, t in bucket])
                sent += len(bucket)
                counts["buckets"] += 1
                counts["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
            if sent != len(names):
                raise WeightSyncError(f"sent {sent} tensors, announced {len(names)}")

        async def both():
            dtypes = [weight_transport.dtype_name(d) for _, _, d in meta]
            update = self.fleet.update_weights_from_distributed(
                names, dtypes, [list(s) for _, s, _ in meta], weight_version=version
            )
            await asyncio.gather(update, asyncio.get_running_loop().run_in_executor(None, send_all))

        self._run(both())
        return counts["bytes"], counts["buckets"]

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
