import json

import pytest

from megatron_stepwise import Step, TrajectoryID, make_padding_step
from megatron_stepwise.data import PromptDataset
from megatron_stepwise.sample_sources import open_samples
from megatron_stepwise.metrics import MetricsLogger, read_metrics, rollout_metrics, summarize_run
from megatron_stepwise.plot import plot_run


def _traj(pid, k, rewards_last, turns, resp_len=2):
    steps = []
    prompt = [1, 2]
    for t in range(turns):
        last = t == turns - 1
        steps.append(Step(TrajectoryID(pid, k), list(prompt), [5] * resp_len, [1] * resp_len,
                          reward=rewards_last if last else 0.0, is_last_step=last,
                          stop_reason="stop" if last else "stop"))
        prompt = prompt + [5] * resp_len + [9, 9, 9]  # 3 observation tokens per turn
    return steps


def test_rollout_metrics_are_trajectory_level():
    # p: a 4-turn success and a 1-turn failure; q: two 1-turn failures. A per-row mean would be 4/6.
    steps = _traj("p", 0, 1.0, 4) + _traj("p", 1, 0.0, 1) + _traj("q", 0, 0.0, 1) + _traj("q", 1, 0.0, 1)
    steps.append(make_padding_step(0))
    m = rollout_metrics(steps)
    assert m["reward/mean"] == pytest.approx(0.25)
    assert m["reward/pass@1"] == pytest.approx(0.25)
    assert m["reward/pass@2"] == pytest.approx(0.5)  # one of two groups has a success
    assert m["reward/zero_variance_groups"] == pytest.approx(0.5)
    assert m["rollout/trajectories"] == 4 and m["rollout/steps"] == 7
    assert m["rollout/turns_mean"] == pytest.approx(7 / 4)
    assert m["rollout/observation_len_mean"] == pytest.approx(3.0)
    assert m["stop_reason/stop"] == pytest.approx(1.0)


def test_logger_writes_jsonl_truncates_on_resume_and_plots(tmp_path):
    log = MetricsLogger(str(tmp_path))
    for it in range(4):
        log.log(it, {"reward/mean": it / 4, "time/rollout": 1.0})
    log.close()
    assert [r["iteration"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3]
    log = MetricsLogger(str(tmp_path), resume_iteration=2)  # iterations 2, 3 will be re-run
    log.log(2, {"reward/mean": 0.9})
    log.close()
    recs = read_metrics(str(tmp_path))
    assert [r["iteration"] for r in recs] == [0, 1, 2] and recs[-1]["reward/mean"] == 0.9
    png = plot_run(str(tmp_path))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_cli_reports_missing_run(tmp_path, capsys):
    from megatron_stepwise.cli import main

    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_dataset_epochs_resume_and_no_repeats_in_a_draw(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"q": i}) for i in range(5)) + "\n")
    samples = open_samples(str(path))
    assert [s["prompt_id"] for s in samples] == [f"row{i}" for i in range(5)]
    ds = PromptDataset(samples, seed=0)
    draws = [ds.next(3) for _ in range(4)]
    for d in draws:
        assert len({s["prompt_id"] for s in d}) == 3
    ds2 = PromptDataset(samples, seed=0)
    ds2.next(3)
    ds2.next(3)
    state = ds2.state_dict()
    ds3 = PromptDataset(samples, seed=0)
    ds3.load_state_dict(state)
    assert [s["prompt_id"] for s in ds3.next(3)] == [s["prompt_id"] for s in draws[2]]
    with pytest.raises(ValueError, match="prompts_per_iteration=6"):
        ds.next(6)


def test_open_samples_names_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        open_samples(str(path))


def test_run_summary_averages_first_and_last_iterations_and_names_outputs():
    records = [{"iteration": i, "reward/mean": r} for i, r in enumerate([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])]
    records[0]["eval/reward/mean"] = 0.1
    records[4]["eval/reward/mean"] = 0.9
    text = summarize_run(records, "runs/x", window=2)
    assert "done: 6 iterations; reward/mean 0.100 -> 0.900 (mean of the first / last 2)" in text
    assert "eval/reward/mean 0.100 (iteration 0) -> 0.900 (iteration 4)" in text
    assert "runs/x/metrics.jsonl" in text and "megatron-stepwise plot runs/x" in text
    # A short run: the window shrinks so that first and last do not overlap; no eval line.
    short = summarize_run([{"iteration": 0, "reward/mean": 0.5}, {"iteration": 1, "reward/mean": 1.0}], "r")
    assert "reward/mean 0.500 -> 1.000 (mean of the first / last 1)" in short and "eval" not in short
    assert summarize_run([], "r") == "no iteration recorded in r"
