"""Weight sync to the fleet and train/inference consistency (tests/sync_worker.py under torchrun).

After each push (tensor, disk, distributed) at TP2, PP2 and TP1, the embedded engine's greedy
log-probs for a sequence equal the plugin's `compute_logprobs` on the same tokens within 1e-4.
"""

from __future__ import annotations

import pytest

from megatron_stepwise.megatron import sync as S
from weights_helpers import check_ok, load_json, run_torchrun

LAYOUTS = ["tp2", "pp2", "tp1"]
MODES = ["tensor", "disk", "distributed"]


def test_bad_modes_are_rejected_by_name():
    with pytest.raises(S.WeightSyncError, match=r"weight_sync.mode must be one of .*got 'nccl'"):
        S.WeightSync(None, "nccl", {})
    with pytest.raises(S.WeightSyncError, match=r"mode='disk' needs a shared directory \(weight_sync.dir\)"):
        S.WeightSync(None, "disk", {})


def test_prune_versions_keeps_the_newest(tmp_path):
    for v in (3, 10, 7, 12):
        S.version_dir(tmp_path, v).mkdir()
    (tmp_path / "v000001.partial").mkdir()  # an export in progress is not a version
    removed = S.prune_versions(tmp_path, keep=2)
    assert [p.name for p in removed] == ["v000003", "v000007"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001.partial", "v000010", "v000012"]


@pytest.fixture(scope="module", params=[pytest.param(0, id="untied"), pytest.param(1, id="tied", marks=pytest.mark.slow)])
def results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("sync")
    check_ok(run_torchrun("sync_worker.py", 2, ["--out", str(out), "--tied", str(request.param)], timeout=600))
    return load_json(out / "results.json"), load_json(out / "weights_listing.json")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_logprobs_equal_megatron_after_a_sync(results, layout, mode):
    r = results[0][f"{layout}/{mode}"]
    assert r["engine_version"] == r["version"]
    assert len(r["engine"]) == len(r["megatron"]) == 8
    gap = max(abs(a - b) for a, b in zip(r["engine"], r["megatron"]))
    assert gap < 1e-4, f"{layout}/{mode}: engine vs megatron log-probs differ by {gap}"
    # Before the push the engine still had the previous weights: the equality is the push's doing.
    stale_gap = max(abs(a - b) for a, b in zip(r["stale_engine"], r["stale_megatron"]))
    assert stale_gap > 1e-2
    assert r["metrics"]["weight_sync/bytes"] > 0 and r["metrics"]["weight_sync/buckets"] > 1


@pytest.mark.distributed
def test_disk_mode_keeps_the_newest_versions(results):
    # Disk pushes were versions 2, 5, 8 (one per layout); keep_versions=2.
    assert results[1] == ["v000005", "v000008"]
