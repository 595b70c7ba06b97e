"""Crash-safe writes used by checkpoints (`latest`) and HF exports."""

from megatron_stepwise.mcore.weights.fileops import fsync_dir, write_atomic


def test_write_atomic_replaces_the_content_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "latest"
    (tmp_path / "latest.tmp").write_text("half-written by a crashed run")
    write_atomic(target, "iter_0000001\n")
    write_atomic(target, "iter_0000002\n")
    assert target.read_text() == "iter_0000002\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    fsync_dir(tmp_path)  # a directory can be flushed (os.open on it works on this platform)
