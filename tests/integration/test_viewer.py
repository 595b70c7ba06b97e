"""The trajectory viewer (viewer/, `megatron-stepwise view`): its data, and the pages in a real
headless Chromium (Debian's `chromium`; .ci/run installs it where apt-get can): a small iteration,
and one large enough to be paged whose texts try to break out of the page's script."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import make_step, run_launch, stride_decide

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.config import load_config
from megatron_stepwise.loop.rounds import RowsOnRank0, decide_round
from megatron_stepwise.rundir.dump_recorder import DumpRecorder
from megatron_stepwise.rundir.dump_table import dump_path, read_dump_table
from megatron_stepwise.rundir.dumps import write_dump
from megatron_stepwise.viewer.page import APPENDED_EOS, PROMPT, TRAINED, load_decoder, paginate, render

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
    decide_round(
        [groups_of(steps[:9]), groups_of(steps[9:])], RowsOnRank0(recorder=recorder), decide=stride_decide(), dp_size=1
    )
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
        tokenizer="tiny_word",  # what the trainer records (echo's shipped vocabulary)
    )
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i in range(5):
            f.write(
                json.dumps({"iteration": i, "reward/mean": 0.1 * i, "rollout/response_len_mean": 3.0 - 0.1 * i}) + "\n"
            )
    return tmp_path


def _tokens(piece: dict, vocab: dict) -> list[tuple]:
    """A turn piece of the page data as (text, role, id, advantage, engine lp, trainer lp, gap) per token."""
    out = []
    for k, i in enumerate(piece["ids"]):
        r = piece["from"] + k - max(piece["from"], piece["n_delta"])
        fields = (None,) * 4 if r < 0 else (piece["adv"][r], piece["lp"][r], piece["tlp"][r], piece["gap"][r])
        out.append((vocab.get(str(i)), piece["roles"][k], i, *fields))
    return out


def _one_page(run_dir, page_tokens=50_000):
    meta, table = read_dump_table(run_dir)
    decoder = load_decoder(meta)
    pages = [list(page) for _, page in paginate(table, decoder, page_tokens)]
    return meta, decoder, pages


def test_the_page_data_has_every_trajectory_turn_and_token_role(run_dir):
    meta, decoder, pages = _one_page(run_dir)
    assert meta["iteration"] == 4 and len(pages) == 1 and len(pages[0]) == 8
    trajectories = pages[0]
    assert sum(len(t["turns"]) for t in trajectories) == 17
    first = trajectories[0]
    assert first["id"] == "p0#0" and len(first["turns"]) == 3 and first["outcome_reward"] == 0.0
    vocab = {str(i): decoder.text(i) for i in range(20)}
    t0, t1, t2 = (_tokens(u, vocab) for u in first["turns"])
    # turn 0's delta is its whole prompt; turn 1's only the observation that follows turn 0's response
    assert [tok[2] for tok in t0 if tok[1] == PROMPT] == [1, 5, SAY, ZERO, EOS, 1, 6]
    assert [tok[2] for tok in t1 if tok[1] == PROMPT] == [1, 5, 10, SAY, ZERO, EOS, 1, 6]
    assert first["turns"][1]["history_kept"]
    assert [tok[1] for tok in t0 if tok[1] != PROMPT] == [TRAINED, TRAINED, APPENDED_EOS]
    assert [tok[1] for tok in t2 if tok[1] != PROMPT] == [TRAINED, TRAINED]  # a sampled EOS is trained
    response = [tok for tok in t0 if tok[1] != PROMPT]
    assert response[0][0] == "1"  # decoded with the run's tokenizer
    assert response[0][6] == pytest.approx(1e-3, rel=1e-3) and response[2][6] is None
    failed = [t for t in trajectories if t["env_error"]]
    assert [t["id"] for t in failed] == ["p3#1"] and failed[0]["stop_reason"] == "env_error"
    # a smaller page: the same tokens, cut over pages of at most 30, trajectory 0 continued on page 2
    _, _, small = _one_page(run_dir, page_tokens=30)
    assert all(sum(len(u["ids"]) for t in page for u in t["turns"]) <= 30 for page in small)
    ids = lambda pages, tid: [i for p in pages for t in p if t["id"] == tid for u in t["turns"] for i in u["ids"]]  # noqa: E731
    assert ids(small, "p0#0") == ids(pages, "p0#0") and ids(small, "p3#1") == ids(pages, "p3#1")
    assert small[1][0]["id"] == "p0#0" and small[1][0]["turns"][0]["from"] > 0


HOSTILE = "a <!--<script> b </script> c \u2028 d \u2029 e \x00 f </SCRIPT x> g <!-- h"


def test_text_that_tries_to_leave_the_script_element_stays_json():
    data = {"iteration": 1, "name": "run \ud800 lone", "trajectories": [{"env_error": HOSTILE}]}
    html = render(data)
    payload = html[html.index('<script id="data" type="application/json">') :].split(">", 1)[1]
    payload = payload[: payload.index("</script>")]
    assert "<" not in payload and ">" not in payload and payload.isascii()
    back = json.loads(payload)  # what the browser's JSON.parse reads
    assert back["trajectories"] == data["trajectories"] and back["name"] == "run \ufffd lone"


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
    assert 'data-status="rendered"' in html  # the script ran to its end
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


def test_drawing_a_page_loads_no_training_loop_config_engine_or_environment(run_dir):
    """The viewer reads files only (pyproject.toml's "viewer reads files only" contract, at run time)."""
    probe = (
        "import sys\n"
        "from megatron_stepwise.viewer.page import write_pages\n"
        "write_pages(sys.argv[1])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'ray') or "
        "m.split('.')[:2] in [['megatron_stepwise', p] for p in ('loop', 'config', 'mcore', 'rollout', 'envs')]))\n"
    )
    out = run_launch(
        [sys.executable, "-c", probe, str(run_dir)],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert '"8":"say"' in (run_dir / "view" / "iter_0000004.html").read_text()  # decoded from the files alone


def test_view_without_a_dump_is_one_clear_error(tmp_path):
    out = run_launch(
        [sys.executable, "-m", "megatron_stepwise.cli", "view", str(tmp_path)],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "trainer.dump_rollouts" in out.stderr and "Traceback" not in out.stderr


@pytest.fixture
def big_run_dir(tmp_path):
    """An iteration of 180k response tokens (7 trajectories, the last one's turn 60k long: more
    than a browser's call stack takes as spread arguments) whose last trajectory's id and
    environment error hold text that tries to end the page's script."""
    steps = []
    for g in range(6):
        history = [1, 5, SAY, ZERO, EOS, 1, 6]
        for t in range(2):
            resp = [ONE] * 9999 + [EOS]
            steps.append(
                make_step(f"p{g}", 0, prompt=history, resp=resp, last=t == 1, reward=float(g % 2), meta={"turn": t})
            )
            history = history + resp + [1, 5, 10, EOS, 1, 6]
    resp = [ZERO] * 59_998 + [9, 10]  # ends "good no"
    hostile = make_step("p<!--<script>6", 0, prompt=[1, 5, SAY, EOS, 1, 6], resp=resp, reward=1.0, meta={"turn": 0})
    hostile.metadata["error"] = HOSTILE
    steps.append(hostile)
    recorder = DumpRecorder(every=1)
    recorder.begin(2)
    decide_round([groups_of(steps)], RowsOnRank0(recorder=recorder), decide=stride_decide(), dp_size=1)
    config = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml")).to_dict()
    config["name"] = "run \ud800 </script><!--<script>"  # a lone surrogate survives the dump's JSON metadata
    write_dump(
        dump_path(tmp_path, 2), recorder.minibatches, iteration=2, weight_version=2, config=config, train_metrics=[]
    )
    return tmp_path


def _dom(page, tmp_path):
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = run_launch([_chromium(), *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_a_large_hostile_iteration_is_paged_and_every_page_renders_in_headless_chromium(big_run_dir, tmp_path):
    out = run_launch(
        [sys.executable, "-m", "megatron_stepwise.cli", "view", str(big_run_dir)],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    index = big_run_dir / "view" / "iter_0000002.html"
    pages = sorted((big_run_dir / "view" / "iter_0000002_pages").glob("*.html"))
    assert f"wrote {index} (an index of {len(pages)} pages)" in out.stdout and len(pages) == 5
    assert max(p.stat().st_size for p in [index, *pages]) < 4_000_000  # a page holds at most 50k tokens
    html = _dom(index, tmp_path)
    assert 'data-status="rendered"' in html and re.search(r'id="total">7<', html)
    assert len(re.findall(r'<details class="traj"', html)) == 7 and "env error: a &lt;!--&lt;script&gt; b" in html
    assert "run \ufffd &lt;/script&gt;&lt;!--&lt;script&gt;: iteration 2" in html  # the name as text
    # the last page: the rest of the long turn, its environment error as text, the last tokens
    html = _dom(pages[-1], tmp_path)
    assert 'data-status="rendered"' in html and '<div class="panel" id="status"></div>' in html
    last = html[html.index('id="t6"') :]
    assert "p&lt;!--&lt;script&gt;6#0" in last and "continued from token" in last
    assert "env error: a &lt;!--&lt;script&gt; b &lt;/script&gt; c \u2028 d \u2029 e" in last
    assert "f &lt;/SCRIPT x&gt; g &lt;!-- h" in last
    assert re.search(r">good</span><span [^>]*>no</span></div>", last)
