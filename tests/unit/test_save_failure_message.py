"""A failed checkpoint save names why: a full disk is named even when torch's zip writer hides ENOSPC."""

import errno
import os
import shutil
from collections import namedtuple

from megatron_stepwise.mcore.weights import dist_checkpoint as C
from megatron_stepwise.mcore.weights.checkpoint_dir import checkpoint_name

Usage = namedtuple("Usage", "total used free")
ZIP_WRITER = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def _message(tmp_path, monkeypatch, error, free):
    (tmp_path / checkpoint_name(1)).mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(1 << 30, (1 << 30) - free, free))
    return C._save_failure(error, tmp_path / checkpoint_name(2))


def test_a_zip_writer_error_on_a_full_disk_says_no_space(tmp_path, monkeypatch):
    msg = _message(tmp_path, monkeypatch, ZIP_WRITER, free=4096)
    assert f"iteration 2) in checkpoint.dir {tmp_path}: {os.strerror(errno.ENOSPC)}." in msg
    assert "free space there or set checkpoint.dir to a larger disk" in msg


def test_the_same_error_with_room_left_is_reported_as_it_is(tmp_path, monkeypatch):
    msg = _message(tmp_path, monkeypatch, ZIP_WRITER, free=10 << 30)
    assert "RuntimeError: Worker failure" in msg and os.strerror(errno.ENOSPC) not in msg
    assert "fix the directory, then resume" in msg
