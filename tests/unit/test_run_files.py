"""Writes under a run directory never follow a symbolic link planted below it (rundir/run_files.py)."""

import os

import pytest

from megatron_stepwise.rundir.run_files import UnsafePathError, write_path, write_under


def test_a_write_creates_the_folders_and_replaces_the_file_leaving_no_temporary(tmp_path):
    write_under(tmp_path, "view/pages/0001.html", b"one")
    write_under(tmp_path, "view/pages/0001.html", b"two")
    assert (tmp_path / "view/pages/0001.html").read_bytes() == b"two"
    assert os.listdir(tmp_path / "view/pages") == ["0001.html"]


@pytest.mark.parametrize("planted", ["view", "view/pages", "view/pages/0001.html"])
def test_a_link_anywhere_below_the_run_directory_is_refused_by_name(tmp_path, planted):
    run, outside = tmp_path / "run", tmp_path / "outside"
    (outside / "pages").mkdir(parents=True)
    (outside / "0001.html").write_text("precious")
    (outside / "pages" / "0001.html").write_text("precious")
    link = run / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside if planted == "view" else outside / planted.split("/", 1)[1].replace("pages/", ""))
    with pytest.raises(UnsafePathError, match=f"^{link} is a symbolic link"):
        write_under(run, "view/pages/0001.html", b"overwritten?")
    assert (outside / "0001.html").read_text() == "precious" and (
        outside / "pages" / "0001.html"
    ).read_text() == "precious"


def test_the_run_directory_itself_may_be_a_link_and_a_path_outside_it_is_the_users(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "real")
    write_path(tmp_path / "run" / "replay" / "iter_0000001.json", b"{}", base=tmp_path / "run")
    assert (tmp_path / "real" / "replay" / "iter_0000001.json").read_bytes() == b"{}"
    write_path(tmp_path / "elsewhere" / "report.json", b"[]", base=tmp_path / "run")  # e.g. --out
    assert (tmp_path / "elsewhere" / "report.json").read_bytes() == b"[]"
    with pytest.raises(ValueError, match="not a path inside"):
        write_under(tmp_path / "run", "../escape.json", b"")
