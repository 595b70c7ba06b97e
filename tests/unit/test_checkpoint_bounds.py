"""A checkpoint from elsewhere is data with bounds (issue 58): its index cannot allocate without
bound or change a class, and every file it or its manifest names is a regular file inside it."""

from __future__ import annotations

import os
import pathlib
import pickle
import threading
import time
import tracemalloc

import pytest
import torch

from megatron_stepwise.mcore.weights import restricted_unpickle
from megatron_stepwise.mcore.weights.checkpoint_dir import (
    MANIFEST,
    TRAINER_STATE,
    check_index_paths,
    find_latest,
    verify_checkpoint,
    write_manifest,
)
from megatron_stepwise.mcore.weights.checkpoint_errors import UnsafeCheckpointError
from megatron_stepwise.mcore.weights.restricted_unpickle import load_index


def finishes(fn, deadline_s=10.0):
    """fn() run in a thread: its result or exception, failing (not hanging) past the deadline."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), f"still blocked after {deadline_s}s"
    return box


def saved_checkpoint(root: pathlib.Path) -> pathlib.Path:
    """A real torch.distributed.checkpoint save in iter_0000001/, with our markers and a manifest."""
    import torch.distributed.checkpoint as dcp

    ckpt = root / "iter_0000001"
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt)), no_dist=True)
    (ckpt / "metadata.json").write_text("{}")
    (ckpt / TRAINER_STATE).write_text('{"iteration": 1}')
    write_manifest(ckpt)
    return ckpt


class Allocates:
    """Pickles as `bytearray(2 GiB)`: 40 bytes in the file, 2 GiB in every loading rank."""

    def __reduce__(self):
        return bytearray, (1 << 31,)


def test_an_index_that_allocates_from_a_number_is_refused_fast_and_small(tmp_path):
    ckpt = saved_checkpoint(tmp_path)
    index = load_index(ckpt / ".metadata")
    index.mcore_data = {"padding": "x" * 20_000, "big": Allocates()}  # ~22 KB, as in the issue
    hostile = tmp_path / ".metadata"
    hostile.write_bytes(pickle.dumps(index))
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.bytearray of int \(it allocates without bound\)"):
        load_index(hostile)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 2 and peak < 64 << 20, (elapsed, peak)
    # bytes in the file still make a bytearray: what a protocol 4 pickle of one holds
    (tmp_path / "ok").write_bytes(pickle.dumps(bytearray(b"abc"), protocol=4))
    assert restricted_unpickle.RestrictedUnpickler(open(tmp_path / "ok", "rb"), "ok").load() == bytearray(b"abc")


def test_an_index_larger_than_the_cap_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / ".metadata"
    with open(path, "wb") as f:  # sparse: no disk, but a read would fill the memory
        f.truncate(restricted_unpickle.MAX_INDEX_BYTES + 1)
    with pytest.raises(UnsafeCheckpointError, match=rf"{path} is 1024\.0 MiB, more than the 1024\.0 MiB"):
        load_index(path)


# BUILD onto the class PosixPath: (None, {"__fspath__": PosixPath}) as its slot state.
_BUILD_ONTO_CLASS = b"\x80\x04cpathlib\nPosixPath\nN}\x8c\x0a__fspath__cpathlib\nPosixPath\ns\x86b."
# BUILD onto a function the index may name (torch.serialization._get_layout's __dict__)
_BUILD_ONTO_FUNCTION = b"\x80\x04ctorch.serialization\n_get_layout\n}\x8c\x01xK\x01sb."
# BUILD onto an index dataclass with a list as its state
_BUILD_BAD_STATE = b"\x80\x04ctorch.distributed.checkpoint.metadata\nStorageMeta\n)\x81]b."


@pytest.mark.parametrize(
    "data,named",
    [
        (_BUILD_ONTO_CLASS, "a state set onto the class pathlib.PosixPath"),
        (_BUILD_ONTO_FUNCTION, "a state set onto a builtins.function"),
        (_BUILD_BAD_STATE, "a state of type list for StorageMeta"),
    ],
    ids=["class", "function", "state-type"],
)
def test_build_onto_a_class_or_with_an_unexpected_state_is_refused(tmp_path, data, named):
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    before = dict(vars(pathlib.PosixPath))
    with pytest.raises(UnsafeCheckpointError, match=rf"{path} asks to load {named}"):
        load_index(path)
    assert dict(vars(pathlib.PosixPath)) == before and "__fspath__" not in vars(pathlib.PosixPath)
    assert pathlib.Path("/a") / "b" == pathlib.PosixPath("/a/b")
    assert torch.serialization._get_layout.__dict__.get("x") is None


def test_a_fifo_index_or_common_file_is_refused_not_hung(tmp_path):
    from megatron_stepwise.mcore.weights.safe_dist_load import RestrictedCommonLoadStrategy

    os.mkfifo(tmp_path / ".metadata")
    os.mkfifo(tmp_path / "common.pt")
    got = finishes(lambda: load_index(tmp_path / ".metadata"))
    assert isinstance(got.get("error"), UnsafeCheckpointError)
    assert f"{tmp_path / '.metadata'} is a FIFO, not a regular file" in str(got["error"])
    got = finishes(lambda: RestrictedCommonLoadStrategy().load_common(str(tmp_path)))
    assert isinstance(got.get("error"), UnsafeCheckpointError)
    assert f"{tmp_path / 'common.pt'} is a FIFO" in str(got["error"])


def _retarget(index, relative_path):
    """Every storage item of `index` stored in `relative_path` instead."""
    import dataclasses

    index.storage_data = {k: dataclasses.replace(v, relative_path=relative_path) for k, v in index.storage_data.items()}
    return index


@pytest.mark.parametrize(
    "where,named",
    [
        ("absolute", "is not inside"),
        ("climbs", "is not inside"),
        ("link-out", "leads out of it"),
        ("fifo", "is a FIFO"),
        ("unlisted", f"which {MANIFEST} does not list"),
    ],
)
def test_every_storage_file_of_the_index_is_a_listed_regular_file_inside(tmp_path, where, named):
    ckpt = saved_checkpoint(tmp_path / "ckpts")
    (distcp,) = {v.relative_path for v in load_index(ckpt / ".metadata").storage_data.values()}
    elsewhere = tmp_path / "elsewhere.distcp"
    elsewhere.write_bytes((ckpt / distcp).read_bytes())
    rel = {
        "absolute": str(elsewhere),
        "climbs": "../../elsewhere.distcp",
        "link-out": "linked.distcp",
        "fifo": "fifo.distcp",
        "unlisted": "copy.distcp",
    }[where]
    os.symlink(elsewhere, ckpt / "linked.distcp")
    os.mkfifo(ckpt / "fifo.distcp")
    (ckpt / "copy.distcp").write_bytes(elsewhere.read_bytes())
    index = _retarget(load_index(ckpt / ".metadata"), rel)
    got = finishes(lambda: check_index_paths(index, ckpt, "X/.metadata"))
    assert isinstance(got.get("error"), UnsafeCheckpointError), got
    message = str(got["error"])
    assert f"checkpoint index X/.metadata: item 'w' is stored in {rel!r}" in message or "item 'b'" in message
    assert named in message
    check_index_paths(load_index(ckpt / ".metadata"), ckpt, "X/.metadata")  # the real one passes


def test_an_index_byte_range_past_its_file_is_refused(tmp_path):
    import dataclasses

    ckpt = saved_checkpoint(tmp_path)
    index = load_index(ckpt / ".metadata")
    key = next(iter(index.storage_data))
    index.storage_data[key] = dataclasses.replace(index.storage_data[key], length=1 << 40)
    with pytest.raises(UnsafeCheckpointError, match=r"which the file \(\d+ bytes\) does not hold"):
        check_index_paths(index, ckpt, "X/.metadata")


@pytest.mark.parametrize("entry", ["../outside", "/etc/hostname", "fifo"])
def test_a_manifest_naming_a_file_outside_or_a_fifo_fails_verification_not_hangs(tmp_path, entry):
    import json

    ckpt = saved_checkpoint(tmp_path / "ckpts")
    os.mkfifo(ckpt / "fifo")
    (tmp_path / "ckpts" / "outside").write_text("")
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"][entry] = {"size": 0, "sha256": "0" * 64}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    got = finishes(lambda: verify_checkpoint(ckpt))
    problem, verified = got["value"]
    assert problem is not None and problem.startswith(f"file {entry}: ") and verified
    assert ("not a regular file" if entry == "fifo" else "is not inside") in problem


def test_a_latest_pointer_out_of_the_directory_or_a_fifo_is_ignored(tmp_path):
    ckpt = saved_checkpoint(tmp_path / "ckpts")
    (tmp_path / "ckpts" / "latest").write_text("../../somewhere/iter_0000009\n")
    assert find_latest(tmp_path / "ckpts") == ckpt
    os.unlink(tmp_path / "ckpts" / "latest")
    os.mkfifo(tmp_path / "ckpts" / "latest")
    assert finishes(lambda: find_latest(tmp_path / "ckpts"))["value"] == ckpt
