"""Groups end to end: every group-shaped object offers one protocol (its prompt id and summary), a
flat list's trajectories and groups are derived in one place (`step_structure.step_structure`), once per
plugin API call, and a rollout that is groups is never flattened and regrouped."""

import ast
from pathlib import Path

import pytest
import torch
from helpers import make_step, stride_decide
from source_ast import parse_python

import megatron_stepwise.step_structure as structure_module
import megatron_stepwise.steps as steps_module
from megatron_stepwise import compute_advantages
from megatron_stepwise.algo.batching import prompt_minibatches
from megatron_stepwise.algo.groups import GroupSummary, PromptGroup, groups_of, pack_groups, unpack_groups
from megatron_stepwise.algo.merge import merge_steps, merge_trajectories, merge_with_advantages
from megatron_stepwise.algo.prepare import prepare, prepare_rows
from megatron_stepwise.config.schema import AsyncConfig
from megatron_stepwise.loop.evaluation import eval_metrics
from megatron_stepwise.loop.group_buffer import Group, GroupBuffer
from megatron_stepwise.loop.rounds import RowsOnRank0, decide_round
from megatron_stepwise.metrics.core import group_outcomes, rollout_metrics
from megatron_stepwise.steps import INVALID, StepBatch, make_padding_step
from megatron_stepwise.workers.worker_rows import HeldGroup, HeldRows, HoldRequest, TokenVersions

PACKAGE = Path(steps_module.__file__).parent
MEMBERS = sorted(n for n in vars(PromptGroup) if not n.startswith("_"))


def _flat():
    """Group 'a': trajectories of 2, 1 and 3 turns (the last invalid); group 'b': one of 1."""
    out = []
    for k, (turns, reward) in enumerate([(2, 1.0), (1, 0.0), (3, 1.0)]):
        for t in range(turns):
            out.append(make_step("a", k, resp=[5 + t, 6], last=t == turns - 1, reward=reward, versions=[k, k + t]))
    out[-1].metadata[INVALID] = "env_error"
    return out + [make_step("b", 0, resp=[7], reward=0.5)]


def test_every_group_shaped_object_offers_the_prompt_group_protocol():
    group = groups_of(_flat())[0]
    held = HeldRows().keep(group, HoldRequest(1, prepare_rows, None), "w0")
    buffer = GroupBuffer(1, AsyncConfig(max_staleness=1))
    started = buffer.start(0, draw=lambda: {"prompt_id": "a"})
    assert buffer.finish(started.serial, held, 0) == "ready"
    assert MEMBERS == ["prompt_id", "summary"]  # a group's id and its summary: nothing forwarded
    shapes = {"RolloutGroup": group, "GroupSummary": group.summary(), "HeldGroup": held}
    for name, shape in shapes.items():
        assert isinstance(shape, PromptGroup), name
        assert shape.prompt_id == "a" and shape.summary() == group.summary(), name  # the same group
    # The buffer's bookkeeping is no group: once finished, its rollout is.
    assert not isinstance(started, PromptGroup) and started.rollout is held
    assert group.turns == [2, 1, 3] and group.invalid == [None, None, "env_error"]
    assert isinstance(held, HeldGroup) and isinstance(group.summary(), GroupSummary)


def test_no_group_shape_forwards_its_summarys_outcomes():
    """The buffer's Group has no property; a HeldGroup only `prompt_id`, which the protocol asks."""
    properties = {
        cls.__name__: sorted(n for n, v in vars(cls).items() if isinstance(v, property)) for cls in (Group, HeldGroup)
    }
    assert properties == {"Group": [], "HeldGroup": ["prompt_id"]}


class _Counted(structure_module.StepStructure):
    calls = 0

    def __init__(self, *args):
        type(self).calls += 1
        super().__init__(*args)


@pytest.fixture
def derivations(monkeypatch):
    """How many times a flat list's structure is derived (`step_structure` makes a StepStructure)."""
    _Counted.calls = 0
    monkeypatch.setattr(structure_module, "StepStructure", _Counted)

    def count(fn):
        before = _Counted.calls
        fn()
        return _Counted.calls - before

    return count


def test_the_plugin_api_and_every_reader_of_a_flat_list_go_through_step_structure(derivations):
    flat = _flat()[:5] + [make_padding_step(0)] + _flat()[5:]
    # The plugin API takes flat steps: each entry derives their structure exactly once.
    assert derivations(lambda: compute_advantages(flat, "grpo")) == 1
    assert derivations(lambda: StepBatch.from_steps(flat)) == 1
    assert derivations(lambda: groups_of(flat)) == 1
    assert derivations(lambda: merge_steps(flat)) == 1
    assert derivations(lambda: merge_with_advantages(flat, compute_advantages(flat, "grpo"))) == 2
    assert derivations(lambda: prompt_minibatches(flat, 1)) == 1


def test_groups_are_never_flattened_and_regrouped(derivations):
    """Once a rollout is groups (the agent loop makes them; a flat list is grouped once, above),
    nothing on the way to a batch, the metrics or an evaluation derives its structure again."""
    groups = groups_of(_flat())
    trajectories = [t for g in groups for t in g.trajectories]
    held = HeldRows()
    assert derivations(lambda: prepare(groups, estimator="turn_rloo", merge_steps=True)) == 0
    assert derivations(lambda: prepare(groups, estimator="grpo")) == 0
    assert (
        derivations(lambda: decide_round([groups], RowsOnRank0(), decide=stride_decide(1), dp_size=1)) == 0
    )  # rank 0's round
    assert derivations(lambda: StepBatch.from_groups([g.trajectories for g in groups])) == 0
    assert derivations(lambda: merge_trajectories(trajectories)) == 0
    assert derivations(lambda: unpack_groups(pack_groups(groups))) == 0
    assert derivations(lambda: held.keep(groups[0], HoldRequest(1, prepare_rows, None), "w0")) == 0
    assert derivations(lambda: TokenVersions.of(groups[0].trajectories)) == 0
    assert derivations(lambda: rollout_metrics(groups)) == 0
    assert derivations(lambda: group_outcomes(groups)) == 0
    assert derivations(lambda: eval_metrics(groups, _Digits(), success_threshold=1.0)) == 0


class _Digits:
    """A tokenizer's `decode`, enough for maj@k's answers."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_prepare_on_groups_gives_the_plugin_apis_advantages():
    flat = _flat()
    batch, metrics = prepare(groups_of(flat), estimator="rloo")
    expected = compute_advantages(flat, "rloo")
    expected[3:6] = [torch.zeros_like(a) for a in expected[3:6]]  # the invalid trajectory trains nothing
    assert torch.equal(torch.cat(batch.response_values(batch.token_fields["advantages"])), torch.cat(expected))
    assert metrics["advantages/invalid_trajectories"] == 1 and metrics["advantages/num_groups"] == 2
    assert batch.row_fields["traj_index"].tolist() == [0, 0, 1, 2, 2, 2, 3]
    assert batch.row_fields["group_index"].tolist() == [0, 0, 0, 0, 0, 0, 1]


def _functions(path: Path):
    tree = parse_python(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _derives_structure(fn) -> bool:
    """Reads steps' trajectory ids and groups or splits steps by them: a mapping keyed by one,
    two compared, or `is_last_step` tested to find where a trajectory ends."""

    def traj(node) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "trajectory_id" for n in ast.walk(node))

    tests = [n.test for n in ast.walk(fn) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    tests += [c for n in ast.walk(fn) if isinstance(n, ast.comprehension) for c in n.ifs]
    tests += [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("any", "all")]
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("setdefault", "get", "add"):
            if node.args and traj(node.args[0]):
                return True
        if isinstance(node, ast.Subscript) and traj(node.slice):
            return True
        if isinstance(node, ast.Compare) and traj(node.left) and any(traj(c) for c in node.comparators):
            return True
    last_tested = any(isinstance(n, ast.Attribute) and n.attr == "is_last_step" for t in tests for n in ast.walk(t))
    return last_tested and traj(fn)


# Checks, not derivations: they reject a malformed list or group, naming the step, and hand on nothing.
CHECKS = {
    "algo/validate.py:_check_structure",
    "algo/validate.py:_last_step_not_final",
    "algo/groups.py:__post_init__",
    "algo/groups.py:_check_last_steps",
}


def test_trajectory_and_group_structure_is_derived_in_one_place():
    found = {
        f"{path.relative_to(PACKAGE)}:{fn.name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for fn in _functions(path)
        if _derives_structure(fn)
    }
    assert found - CHECKS == {"step_structure.py:step_structure"}  # StepStructure
