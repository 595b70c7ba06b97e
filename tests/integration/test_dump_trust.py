"""`view` and `replay` on a run directory from someone else (rundir/dump_trust.py, offline/dump_trust.py, rundir/run_files.py):
they import no module the dump's config names, download nothing, never run a tokenizer's own
code (even with 'y' typed at transformers' prompt), and refuse to write through links planted in
the run directory; `--trust-dump-code` imports the named modules when the user asks."""

import http.server
import json
import os
import shutil
import sys
import threading

import pytest
from helpers import make_step, run_launch, stride_decide

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.config import load_config
from megatron_stepwise.hf.tokenizers import tokenizer_dir
from megatron_stepwise.loop.rounds import RowsOnRank0, decide_round
from megatron_stepwise.rundir.dump_recorder import DumpRecorder
from megatron_stepwise.rundir.dump_table import dump_path
from megatron_stepwise.rundir.dumps import write_dump

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOS, SAY, ZERO, ONE = 2, 8, 11, 12


def _mark(workdir) -> str:
    """Module code that leaves RAN_<module> in `workdir` when imported (transformers imports a
    tokenizer's code from a copy in its modules cache, so the path is absolute)."""
    return f"from pathlib import Path\nPath({str(workdir)!r}, 'RAN_' + __name__.split('.')[-1]).touch()\n"


def _write_dump(run_dir, *, tokenizer="tiny_word", **config_changes):
    """Iteration 0 of a tiny_cpu run (4 trajectories of one turn), its config changed as given
    (`section__key=value`); `tokenizer` is what the trainer recorded (None: an older dump)."""
    steps = [
        make_step(f"p{g}", k, prompt=[1, 5, SAY, ZERO, EOS, 1, 6], resp=[ZERO, EOS], reward=float(k), lp=[-0.5, -0.5])
        for g in range(2)
        for k in range(2)
    ]
    recorder = DumpRecorder(every=1)
    recorder.begin(0)
    decide_round([groups_of(steps)], RowsOnRank0(recorder=recorder), decide=stride_decide(), dp_size=1)
    config = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml")).to_dict()
    for key, value in config_changes.items():
        section, name = key.split("__")
        config[section][name] = value
    write_dump(
        dump_path(run_dir, 0),
        recorder.minibatches,
        iteration=0,
        weight_version=0,
        config=config,
        train_metrics=[{"loss": 0.0, "grad_norm": 0.0}],
        tokenizer=tokenizer,
    )


@pytest.fixture
def workdir(tmp_path):
    """The directory the commands run in (on sys.path with `python -m`), holding modules that
    leave a RAN_<module> file when imported, and the run directory."""
    (tmp_path / "evil_mod.py").write_text(_mark(tmp_path))
    (tmp_path / "evil_env.py").write_text(_mark(tmp_path) + "class EvilEnv:\n    tokenizer = 'tiny_word'\n")
    (tmp_path / "run").mkdir()
    return tmp_path


def _cli(workdir, *args, env=None, stdin=None):
    env = dict(env or os.environ, PYTHONPATH=ROOT, HF_MODULES_CACHE=str(workdir / "hf_modules"))
    env.pop("HF_HUB_OFFLINE", None)
    return run_launch(
        [sys.executable, "-m", "megatron_stepwise.cli", *args],
        cwd=workdir,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _ran(workdir) -> list[str]:
    return sorted(p.name for p in workdir.rglob("RAN_*"))


def test_view_imports_no_module_the_dump_names(workdir):
    _write_dump(workdir / "run", trainer__imports=["evil_mod"], env__name="evil_env:EvilEnv")
    out = _cli(workdir, "view", "run")
    assert out.returncode == 0, out.stderr
    assert _ran(workdir) == []
    page = (workdir / "run" / "view" / "iter_0000000.html").read_text()
    assert '"8":"say"' in page  # decoded with the tokenizer the dump records, no module needed


def test_view_of_an_older_dump_names_the_flag_and_imports_only_with_it(workdir):
    _write_dump(workdir / "run", tokenizer=None, env__name="evil_env:EvilEnv")
    out = _cli(workdir, "view", "run")
    assert out.returncode == 0, out.stderr
    assert _ran(workdir) == [] and "--trust-dump-code" in out.stderr and "env.name='evil_env:EvilEnv'" in out.stderr
    out = _cli(workdir, "view", "run", "--trust-dump-code")
    assert out.returncode == 0, out.stderr
    assert _ran(workdir) == ["RAN_evil_env"]
    assert '"8":"say"' in (workdir / "run" / "view" / "iter_0000000.html").read_text()


def test_view_never_runs_a_tokenizer_directorys_code_even_after_a_yes(workdir):
    evil = workdir / "evil_tokenizer"
    shutil.copytree(tokenizer_dir("tiny_word"), evil)
    config = json.loads((evil / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil_tok.EvilTokenizer", None]})
    (evil / "tokenizer_config.json").write_text(json.dumps(config))
    (evil / "evil_tok.py").write_text(
        _mark(workdir)
        + "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    _write_dump(workdir / "run", tokenizer=str(evil), model__tokenizer=str(evil))
    out = _cli(workdir, "view", "run", stdin="y\n" * 5)  # what a user answering transformers' prompt types
    assert out.returncode == 0, out.stderr
    assert _ran(workdir) == [] and "Do you wish to run the custom code" not in out.stdout + out.stderr
    assert "never run" in out.stderr  # the page shows ids, and says why


class _Hub(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        _Hub.requests.append(self.path)
        self.send_error(404)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_view_downloads_nothing_the_dump_names(workdir):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _write_dump(
            workdir / "run",
            tokenizer="nobody-org/never-cached",
            model__tokenizer="nobody-org/never-cached",
            model__allow_download=True,
        )
        env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}", HF_HOME=str(workdir / "hf"))
        _Hub.requests.clear()
        out = _cli(workdir, "view", "run", env=env)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0, out.stderr
    assert _Hub.requests == [] and "--trust-dump-code" in out.stderr


@pytest.mark.parametrize("link", ["view", "view/iter_0000000.html"])
def test_view_refuses_to_write_through_a_link_planted_in_the_run_directory(workdir, link):
    _write_dump(workdir / "run")
    outside = workdir / "outside"
    outside.mkdir()
    (outside / "iter_0000000.html").write_text("precious")
    planted = workdir / "run" / link
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(outside if link == "view" else outside / "iter_0000000.html")
    out = _cli(workdir, "view", "run")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: run/{link} is a symbolic link (to {outside}" in out.stderr
    assert [p.name for p in outside.iterdir()] == ["iter_0000000.html"]
    assert (outside / "iter_0000000.html").read_text() == "precious"


@pytest.mark.timeout(600)  # two single-process replays of a tiny model
def test_replay_imports_no_module_the_dump_names_and_writes_no_link(workdir):
    _write_dump(workdir / "run", trainer__imports=["evil_mod"], env__name="evil_env:EvilEnv")
    outside = workdir / "outside"
    outside.mkdir()
    (workdir / "run" / "replay").symlink_to(outside)
    args = ("replay", "run", "launch.nproc_per_node=1", "--iteration", "0")
    out = _cli(workdir, *args)
    assert out.returncode == 2 and "error: run/replay is a symbolic link" in out.stderr, out.stderr
    assert list(outside.iterdir()) == [] and _ran(workdir) == []
    (workdir / "run" / "replay").unlink()
    out = _cli(workdir, *args)
    assert out.returncode == 0, out.stderr
    assert _ran(workdir) == []
    report = json.loads((workdir / "run" / "replay" / "iter_0000000.json").read_text())
    assert report["iteration"] == 0 and len(report["steps"]) == 1
