"""Read back what the optional loggers wrote, with the loggers' own formats and readers.

- TensorBoard: tensorboard's `EventAccumulator` over `<run_dir>/tensorboard`.
- W&B (offline): the run's `run-<id>.wandb` file under `<run_dir>/wandb/offline-run-*`. It is
  a LevelDB-style log of `wandb_internal_pb2.Record` protobufs (wandb's own datastore format;
  wandb >= 0.2x no longer ships a Python reader, so the 30 lines below are one): a 7-byte header
  (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte header
  (crc32c, length, type: full / first / middle / last).
"""

from __future__ import annotations

import glob
import json
import os
import struct

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_scalars(run_dir: str) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar in the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    # The logger writes float64 tensor summaries of the scalars plugin (new_style=True).
    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    out = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    for tag in acc.Tags()["tensors"]:
        out[tag] = {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
    return out


def _wandb_records(path: str):
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B datastore file")
    pos, parts = _HEADER, []
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # block trailer: zero padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        parts.append(chunk)
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def wandb_offline_history(run_dir: str) -> list[dict]:
    """The rows logged with `run.log(...)` of the single offline run under `<run_dir>/wandb`."""
    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    if len(files) != 1:
        raise AssertionError(f"expected one offline W&B run under {run_dir}/wandb, found {files}")
    rows = []
    for record in _wandb_records(files[0]):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows
