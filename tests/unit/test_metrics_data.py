import json

import pytest

from megatron_stepwise import Step, TrajectoryID, make_padding_step
from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.cli.plot import plot_run
from megatron_stepwise.data.files import open_samples
from megatron_stepwise.data.prompts import PromptDataset
from megatron_stepwise.metrics.core import MetricsLogger, rollout_metrics, summarize_run
from megatron_stepwise.rundir.jsonl import read_metrics


def _traj(pid, k, rewards_last, turns, resp_len=2):
    steps = []
    prompt = [1, 2]
    for t in range(turns):
        last = t == turns - 1
        steps.append(
            Step(
                TrajectoryID(pid, k),
                list(prompt),
                [5] * resp_len,
                [1] * resp_len,
                reward=rewards_last if last else 0.0,
                is_last_step=last,
                stop_reason="stop" if last else "stop",
            )
        )
        prompt = prompt + [5] * resp_len + [9, 9, 9]  # 3 observation tokens per turn
    return steps


def test_rollout_metrics_are_trajectory_level():
    # p: a 4-turn success and a 1-turn failure; q: two 1-turn failures. A per-row mean would be 4/6.
    steps = _traj("p", 0, 1.0, 4) + _traj("p", 1, 0.0, 1) + _traj("q", 0, 0.0, 1) + _traj("q", 1, 0.0, 1)
    steps.append(make_padding_step(0))
    m = rollout_metrics(groups_of(steps))
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


def _brute_pass_at_k(successes, k):
    import itertools

    subsets = list(itertools.combinations(successes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_unbiased_estimator_checked_by_enumerating_every_subset():
    from megatron_stepwise.metrics.core import pass_at_k

    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                outcomes = [True] * c + [False] * (n - c)
                assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(outcomes, k)), (n, c, k)


def test_reward_pass_at_k_uses_partial_credit_against_the_threshold():
    # groups of 4 with partial-credit rewards: 0.5 counts as a success only with threshold 0.5
    steps = []
    for k, r in enumerate([0.5, 0.0, 0.0, 0.0]):
        steps += _traj("p", k, r, 1)
    for k, r in enumerate([1.0, 1.0, 0.0, 0.0]):
        steps += _traj("q", k, r, 1)
    groups = groups_of(steps)
    strict, lenient = rollout_metrics(groups), rollout_metrics(groups, success_threshold=0.5)
    assert strict["reward/pass@1"] == pytest.approx((0 + 0.5) / 2)
    assert strict["reward/pass@2"] == pytest.approx((0 + _brute_pass_at_k([1, 1, 0, 0], 2)) / 2)
    assert lenient["reward/pass@2"] == pytest.approx((_brute_pass_at_k([1, 0, 0, 0], 2) + 5 / 6) / 2)
    assert set(k for k in strict if "pass@" in k) == {"reward/pass@1", "reward/pass@2", "reward/pass@4"}


def test_majority_at_k_matches_a_brute_force_vote_over_every_subset():
    import itertools
    import random
    from collections import Counter

    from megatron_stepwise.metrics.core import majority_at_k

    def brute(answers, correct, k):
        scores = []
        for idx in itertools.combinations(range(len(answers)), k):
            votes = Counter(answers[i] for i in idx if answers[i] is not None)
            if not votes:
                scores.append(0.0)
                continue
            top = max(votes.values())
            tied = sorted(a for a, v in votes.items() if v == top)
            good = {answers[i] for i in range(len(answers)) if correct[i]}
            scores.append(sum(a in good for a in tied) / len(tied))
        return sum(scores) / len(scores)

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 7)
        answers = [rng.choice(["3", "4", "5", None]) for _ in range(n)]
        correct = [a == "4" for a in answers]
        for k in range(1, n + 1):
            assert majority_at_k(answers, correct, k) == pytest.approx(brute(answers, correct, k))
    # the hand-counted case: answers 4, 4, 5 (4 is right): maj@3 = 1, maj@1 = 2/3, maj@2 = (1 + 1/2 + 1/2) / 3
    assert majority_at_k(["4", "4", "5"], [True, True, False], 3) == 1.0
    assert majority_at_k(["4", "4", "5"], [True, True, False], 2) == pytest.approx(2 / 3)


def test_plot_has_an_eval_panel_with_every_sets_reward_and_largest_pass_at_k(tmp_path):
    from megatron_stepwise.cli.plot import eval_keys

    records = [
        {
            "iteration": 0,
            "reward/mean": 0.1,
            "eval/reward/mean": 0.2,
            "eval/reward/pass@1": 0.2,
            "eval/reward/pass@4": 0.5,
            "eval/hard/reward/mean": 0.0,
            "eval/hard/reward/pass@8": 0.1,
        },
        {"iteration": 1, "eval/reward/mean": 0.4},
    ]
    assert eval_keys(records) == [
        "eval/hard/reward/mean",
        "eval/reward/mean",
        "eval/hard/reward/pass@8",
        "eval/reward/pass@4",
    ]
    log = MetricsLogger(str(tmp_path))
    for r in records:
        log.log(r["iteration"], {k: v for k, v in r.items() if k != "iteration"})
    log.close()
    assert plot_run(str(tmp_path)).endswith("curves.png")
