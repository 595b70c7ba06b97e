"""The rollout bank's files (rundir/bank_files.py, workers/rollout_bank.py): exact round trip, damage detected by the
checksum, and how a resume sorts banked groups (reused, re-issued, discarded, pruned)."""

import logging

import pytest
import torch

from megatron_stepwise.algo.groups import groups_of
from megatron_stepwise.rundir.paths import BANK
from megatron_stepwise.steps import Step, TrajectoryID
from megatron_stepwise.workers.rollout_bank import (
    BankedGroup,
    RolloutBank,
    decode,
    encode,
    read_group,
    with_group_id,
    write_group,
)


def rollout(pid="p0", version=0, logprobs=True):
    """2 trajectories (1 and 2 turns) with every per-token field a rollout carries."""
    steps = []
    for k, turns in enumerate((1, 2)):
        for t in range(turns):
            last = t == turns - 1
            steps.append(
                Step(
                    TrajectoryID(pid, k),
                    [1, 2, 3 + t],
                    [4 + k, 5, 6],
                    [1, 1, 0],
                    rollout_logprobs=[-0.25, -1.5, 0.0] if logprobs or k == 0 else None,
                    weight_versions=[version, version, version],
                    reward=0.5 * k if last else 0.0,
                    turn_reward=0.125 * t,
                    is_last_step=last,
                    stop_reason="stop" if last else "length",
                    metadata={"turn": t, "env": {"obs": f"turn {t}"}},
                )
            )
    (group,) = groups_of(steps)
    return group


def banked(draw, pid="p0", start_version=0, end_version=None, attempt=0, token_version=None, **kw):
    return BankedGroup(
        draw=draw,
        sample={"prompt_id": pid, "question": f"q{draw}"},
        group_id=pid,
        start_version=start_version,
        attempt=attempt,
        end_version=start_version if end_version is None else end_version,
        rollout=rollout(pid, start_version if token_version is None else token_version, **kw),
    )


def same_steps(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.trajectory_id == y.trajectory_id
        for name in ("prompt_ids", "response_ids", "loss_mask", "weight_versions"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        assert (x.rollout_logprobs is None) == (y.rollout_logprobs is None)
        if x.rollout_logprobs is not None:
            assert torch.equal(x.rollout_logprobs, y.rollout_logprobs)
        assert (x.reward, x.turn_reward, x.is_last_step, x.stop_reason) == (
            y.reward,
            y.turn_reward,
            y.is_last_step,
            y.stop_reason,
        )
        assert x.metadata == y.metadata


def test_a_banked_group_reads_back_exactly():
    group = banked(7, "p3", start_version=2, end_version=4, attempt=1, logprobs=False)
    back = decode(encode(group))
    assert (back.draw, back.sample, back.group_id, back.start_version, back.attempt, back.end_version) == (
        7,
        {"prompt_id": "p3", "question": "q7"},
        "p3",
        2,
        1,
        4,
    )
    assert [len(t) for t in back.rollout.trajectories] == [1, 2]
    same_steps(group.rollout.steps, back.rollout.steps)
    assert back.newest_version == 2


def test_a_renamed_rollout_carries_its_new_group_id_on_every_step():
    renamed = with_group_id(rollout("p1"), "p1~9")
    assert renamed.prompt_id == "p1~9"
    assert {s.trajectory_id for s in renamed.steps} == {TrajectoryID("p1~9", 0), TrajectoryID("p1~9", 1)}


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [_flip_byte, _truncate], ids=["byte-flipped", "torn"])
def test_a_damaged_file_is_never_trained_but_warned_about_and_counted(tmp_path, caplog, damage):
    bank = RolloutBank(tmp_path)
    bank.put(banked(0, "p0"))
    bank.put(banked(1, "p1"))
    damaged = next((tmp_path / BANK).glob("draw_1.*.parquet"))
    damage(damaged)

    resumed = RolloutBank(tmp_path)
    with caplog.at_level(logging.WARNING, logger="megatron_stepwise.workers.rollout_bank"):
        recovery = resumed.recover([({"prompt_id": "p0"}, 0), ({"prompt_id": "p1"}, 1)], next_draw=2, version=0)
    assert list(recovery.pending) == [0] and not recovery.reissued
    assert resumed.discarded == 1
    assert any(f"{damaged} is refused (sha256 " in r.getMessage() for r in caplog.records)
    assert not damaged.exists()  # read once, never again


def test_a_resume_sorts_banked_groups_by_draw_and_weight_version(tmp_path):
    bank = RolloutBank(tmp_path)
    bank.put(banked(1, "p1", start_version=1))  # trained before the checkpoint: pruned
    bank.put(banked(3, "p3", start_version=2))  # pending at the checkpoint: reused
    bank.put(banked(4, "p4", start_version=1, token_version=3))  # pending, but made by newer weights: lost
    bank.put(banked(5, "p0", start_version=2))  # drawn after the checkpoint: reused when re-issued
    bank.put(banked(6, "p1", start_version=2))  # drawn after it, re-issued with another prompt: discarded

    resumed = RolloutBank(tmp_path)
    pending = [({"prompt_id": "p3"}, 3), ({"prompt_id": "p4"}, 4)]
    recovery = resumed.recover(pending, next_draw=5, version=2)
    assert list(recovery.pending) == [3]
    assert sorted(recovery.reissued) == [5, 6]
    assert resumed.discarded == 1  # draw 4
    assert resumed.claim(5, {"prompt_id": "p0"}).group_id == "p0"
    assert resumed.claim(6, {"prompt_id": "p2"}) is None and resumed.discarded == 2
    assert resumed.claim(7, {"prompt_id": "p2"}) is None  # never banked
    assert sorted(p.name.split(".")[0] for p in (tmp_path / BANK).iterdir()) == ["draw_3", "draw_5"]


def test_trained_groups_stay_only_while_the_last_checkpoint_needs_them(tmp_path):
    bank = RolloutBank(tmp_path)
    for draw in range(4):
        bank.put(banked(draw, f"p{draw}", start_version=draw // 2))
    # a checkpoint at version 1 with draws 2 and 3 outstanding (pending)
    bank.checkpointed(outstanding=[2, 3], pending=[2, 3], version=1)
    assert bank.held == 2  # 0 and 1 were trained before it
    bank.put(banked(4, "p4", start_version=2))
    bank.trained([2, 3, 4])  # 2, 3: a resume from the checkpoint trains them again; 4: not pending then
    assert bank.held == 2 and not any((tmp_path / BANK).glob("draw_4.*"))
    bank.checkpointed(outstanding=[], pending=[], version=3)
    assert bank.held == 0 and not any((tmp_path / BANK).iterdir())


def test_a_fresh_run_empties_the_bank_and_a_failed_write_only_warns(tmp_path, caplog):
    bank = RolloutBank(tmp_path)
    bank.put(banked(0))
    RolloutBank(tmp_path).clear()
    assert not any((tmp_path / BANK).iterdir())

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the run directory should be")
    with caplog.at_level(logging.WARNING, logger="megatron_stepwise.workers.rollout_bank"):
        RolloutBank(blocked).put(banked(0))  # no exception: training goes on unbanked
    assert any("cannot write" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_removes_files_nobody_recorded_once_their_draw_is_done(tmp_path):
    # An agent worker wrote the files of draws 5 and 6 and died before answering: rank 0 never
    # recorded them. Draw 5 was rolled out again and trained; draw 6 is still in flight (its new
    # holder may be writing right now), so only draw 5's orphan goes at the checkpoint.
    bank = RolloutBank(tmp_path)
    bank.put(banked(6, "p6"))
    orphan_5 = tmp_path / BANK / write_group(tmp_path, banked(5, "p5")).name
    orphan_6 = tmp_path / BANK / write_group(tmp_path, banked(6, "p6", start_version=1)).name
    bank.checkpointed(outstanding=[6], pending=[6], version=1)
    assert not orphan_5.exists() and orphan_6.exists() and bank.held == 1


def test_a_worker_writes_the_bank_file_of_the_group_it_holds_and_adopts_it_back(tmp_path):
    # Rows kept in the agent workers: the holder writes the file (its ticket came with the hold
    # request), rank 0 records the returned name; after a resume a worker adopts the group from it.
    from megatron_stepwise.algo.prepare import prepare_rows
    from megatron_stepwise.config.schema import ExperimentConfig
    from megatron_stepwise.loop.sources import bind_prepare
    from megatron_stepwise.workers.worker_rows import HeldRows, HoldRequest, bank_held

    run_dir = tmp_path / "run"  # not made yet: a worker may write before rank 0 makes it
    ticket = RolloutBank(run_dir).ticket(3, {"prompt_id": "p3"}, "p3", start_version=1, attempt=0)
    request = HoldRequest(7, bind_prepare(ExperimentConfig(), prepare_rows), 256, ticket)
    group = rollout("p3", version=1)
    (written,) = bank_held([group], request)
    held = HeldRows().keep(group, request, "agent-x-0.0", written)
    assert written is not None and held.bank == written and written.draw == 3 and written.newest_version == 1

    resumed = RolloutBank(run_dir)
    recovery = resumed.recover([({"prompt_id": "p3"}, 3)], next_draw=4, version=1)
    again = HeldRows().adopt(read_group(recovery.pending[3].path), "p3~9", request, "agent-x-1.0")
    assert again.bank == written and again.prompt_id == "p3~9"  # same file, the resumed run's group id
    assert again.rows.num_rows == held.rows.num_rows and again.versions == held.versions
