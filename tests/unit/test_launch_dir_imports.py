"""Modules a config names import from the directory the command runs in, without PYTHONPATH:
`megatron-stepwise validate configs/x.yaml env.agent=my_agent:solve` from the agent's directory
works, and the processes the command starts (torchrun's ranks, Ray's workers) inherit it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_stepwise.cli.main import import_from_launch_dir, main

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")


def test_an_agent_beside_the_launch_directory_validates_without_pythonpath(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_launch_dir_agent.py").write_text("def solve(sample, base_url, api_key):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["validate", CONFIG, "env.agent=my_launch_dir_agent:solve"]) == 0, capsys.readouterr()
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(tmp_path)]  # what the ranks and workers get


def test_the_launch_directory_goes_last_and_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/opt/mine")
    monkeypatch.setattr(sys, "path", ["/site"])
    import_from_launch_dir()
    import_from_launch_dir()
    assert sys.path == ["/site", str(tmp_path)]  # installed packages keep their precedence
    assert os.environ["PYTHONPATH"] == os.pathsep.join(["/opt/mine", str(tmp_path)])


def test_a_module_that_is_nowhere_is_named_with_both_remedies(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", CONFIG, "env.agent=no_such_agent_module:solve"]) == 2
    err = capsys.readouterr().err
    assert "env.agent" in err and "no_such_agent_module" in err and "run from the directory" in err
