"""The trajectory viewer (viewer/, `megatron-stepwise view`): its data, and the page in a real
headless Chromium (Debian's `chromium`; .ci/run installs it where apt-get can)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import make_step, run_launch

from megatron_stepwise.config import load_config
from megatron_stepwise.loop.dumps import DumpRecorder, dump_path, write_dump
from megatron_stepwise.loop.sources import split_round
from megatron_stepwise.loop.training_batch import PrepareOptions
from megatron_stepwise.viewer.page import APPENDED_EOS, PROMPT, TRAINED, build_data, render

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOS = 2  # <|im_end|> of the echo environment's tiny_word vocabulary
SAY, ZERO, ONE = 8, 11, 12


def _trajectory(pid, k, reward, *, turns=2, error=False):
    """`turns` turns of "say 0"; every turn but the last stops at max_new_tokens (EOS appended)."""
    steps, history = [], [1, 5, SAY, ZERO, EOS, 1, 6]
    for t in range(turns):
        last = t == turns - 1
        resp, mask = ([ZERO, EOS], [1, 1]) if last else ([ONE, ONE, EOS], [1, 1, 0])
        step = make_step(
            pid,
            k,
            prompt=history,
            resp=resp,
            mask=mask,
            last=last,
            reward=reward if last else 0.0,
            lp=[-0.5] * len(resp),
            versions=[4] * len(resp),
            meta={"turn": t},
            stop=("env_error" if error else "stop") if last else "length",
        )
        if error and last:
            step.metadata["error"] = "TimeoutError: env call took too long"
        steps.append(step)
        history = history + resp + [1, 5, 10, SAY, ZERO, EOS, 1, 6]
    return steps


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with one dump (2 mini-batches, 8 trajectories, 19 turns) and 5 metrics lines."""
    steps = []
    for g, pid in enumerate(["p0", "p1", "p2", "p3"]):
        for k in range(2):
            steps += _trajectory(pid, k, reward=float(k), turns=3 if (g, k) == (0, 0) else 2, error=(g, k) == (3, 1))
    recorder = DumpRecorder(every=1)
    recorder.begin(4)
    split_round([steps[:9], steps[9:]], {}, options=PrepareOptions(), dp_size=1, shard=lambda b: [b], recorder=recorder)
    for cap in recorder.minibatches:  # a trainer that disagrees with the engine by 1e-3 on trained tokens
        cap.trainer_logprobs = cap.batch.token_fields["rollout_logprobs"] + 1e-3 * (
            cap.batch.token_fields["loss_mask"] != 0
        )
    config = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml")).to_dict()
    write_dump(
        dump_path(tmp_path, 4),
        recorder.minibatches,
        iteration=4,
        weight_version=4,
        config=config,
        train_metrics=[{"loss": 0.25, "grad_norm": 1.5}] * 2,
    )
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i in range(5):
            f.write(
                json.dumps({"iteration": i, "reward/mean": 0.1 * i, "rollout/response_len_mean": 3.0 - 0.1 * i}) + "\n"
            )
    return tmp_path


def test_the_page_data_has_every_trajectory_turn_and_token_role(run_dir):
    data = build_data(run_dir)
    assert data["iteration"] == 4 and len(data["trajectories"]) == 8
    assert sum(len(t["turns"]) for t in data["trajectories"]) == 17
    first = data["trajectories"][0]
    assert first["id"] == "p0#0" and len(first["turns"]) == 3 and first["outcome_reward"] == 0.0
    t0, t1 = first["turns"][:2]
    # turn 0's delta is its whole prompt; turn 1's only the observation that follows turn 0's response
    assert [tok[2] for tok in t0["delta"]] == [1, 5, SAY, ZERO, EOS, 1, 6]
    assert [tok[2] for tok in t1["delta"]] == [1, 5, 10, SAY, ZERO, EOS, 1, 6] and t1["history_kept"]
    assert {tok[1] for tok in t1["delta"]} == {PROMPT}
    assert [tok[1] for tok in t0["response"]] == [TRAINED, TRAINED, APPENDED_EOS]
    assert [tok[1] for tok in first["turns"][2]["response"]] == [TRAINED, TRAINED]  # a sampled EOS is trained
    assert t0["response"][0][0] == "1"  # decoded with the run's tokenizer
    assert t0["response"][0][6] == pytest.approx(1e-3, rel=1e-3) and t0["response"][2][6] is None
    failed = [t for t in data["trajectories"] if t["env_error"]]
    assert [t["id"] for t in failed] == ["p3#1"] and failed[0]["stop_reason"] == "env_error"
    assert data["curves"]["reward"][-1] == [4, pytest.approx(0.4)]
    html = render(data)
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html


def _chromium():
    for name in (os.environ.get("MEGATRON_STEPWISE_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(
    _chromium() is None,
    reason="needs Debian's chromium (apt-get install chromium; .ci/run installs "
    "it where apt-get can): runs in CI and on the dev VM",
)
def test_the_page_renders_in_headless_chromium_with_every_trajectory_and_a_screenshot(run_dir, tmp_path):
    out = run_launch(
        [sys.executable, "-m", "megatron_stepwise.cli", "view", str(run_dir), "--out", str(tmp_path / "page.html")],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "page.html").as_uri()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--window-size=1400,900",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = run_launch([_chromium(), *flags, "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    # rendered by the page's script (the file itself holds only JSON): 8 trajectories, 17 turns
    assert len(re.findall(r'<details class="traj"', html)) == 8
    assert len(re.findall(r'<div class="turn"', html)) == 17
    assert re.search(r'id="shown">8<', html) and re.search(r'id="total">8<', html)
    assert len(re.findall(r'class="tok r-e"', html)) == 9 + 1  # 9 appended EOS, plus the legend's
    assert "env error: TimeoutError" in html and html.count("<svg") == 2
    # the filters, set from the link: only the trajectory whose environment failed, then rewards >= 1
    for fragment, shown in (("err=yes", 1), ("rmin=1", 4), ("stop=env_error&err=no", 0)):
        dom = run_launch(
            [_chromium(), *flags, "--dump-dom", f"{page}#{fragment}"], capture_output=True, text=True, timeout=120
        )
        assert re.search(rf'id="shown">{shown}<', dom.stdout), fragment
        assert len(re.findall(r'<details class="traj" [^>]*style="display: none;"', dom.stdout)) == 8 - shown
    shot = tmp_path / "viewer.png"
    result = subprocess.run([_chromium(), *flags, f"--screenshot={shot}", page], capture_output=True, timeout=120)
    assert result.returncode == 0 and shot.stat().st_size > 10_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_view_without_a_dump_is_one_clear_error(tmp_path):
    out = run_launch(
        [sys.executable, "-m", "megatron_stepwise.cli", "view", str(tmp_path)],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "trainer.dump_rollouts" in out.stderr and "Traceback" not in out.stderr
