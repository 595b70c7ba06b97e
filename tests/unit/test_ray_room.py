"""check_room: an actor no live Ray node can hold is refused at once, naming it and the nodes."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from megatron_stepwise.rollout.fleet.ray_room import NoRoomForActor, check_room  # noqa: E402


def _nodes(monkeypatch, nodes):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)


def _node(ip, alive=True, **resources):
    return {"NodeManagerAddress": ip, "Alive": alive, "Resources": resources}


def test_a_lost_node_leaves_no_room_and_the_error_names_actor_and_live_nodes(monkeypatch):
    # The head offers no CPU; the worker node that held the actors is dead.
    _nodes(monkeypatch, [_node("10.0.0.1", CPU=0.0), _node("10.0.0.2", alive=False, CPU=6.0)])
    with pytest.raises(NoRoomForActor) as e:
        check_room("agent worker w-1.1", num_cpus=1)
    msg = str(e.value)
    assert "agent worker w-1.1 needs 1 CPU" in msg and "10.0.0.1: 0 CPU 0 GPU" in msg and "10.0.0.2" not in msg


def test_a_node_with_the_resources_in_total_is_room_even_if_busy(monkeypatch):
    _nodes(monkeypatch, [_node("10.0.0.1", CPU=0.0), _node("10.0.0.2", CPU=6.0, GPU=1.0)])
    check_room("engine 0", num_cpus=1, num_gpus=1)


def test_gpus_count_too(monkeypatch):
    _nodes(monkeypatch, [_node("10.0.0.2", CPU=6.0)])
    with pytest.raises(NoRoomForActor, match="engine 0 needs 1 CPU and 1 GPU"):
        check_room("engine 0", num_cpus=1, num_gpus=1)


def test_without_a_ray_connection_it_asks_nothing(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "nodes", lambda: pytest.fail("asked Ray"))
    check_room("engine 0", num_cpus=100)
