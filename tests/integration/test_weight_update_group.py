"""The distributed weight-update group counts every TP rank of every engine (no Ray needed).

SGLang joins such a group with one rank per TP rank, `rank_offset + tp_rank`, and expects a
`world_size` that counts them all; the embedded engine is a single rank.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
from types import SimpleNamespace

import pytest
import torch

from megatron_stepwise import weight_transport
from megatron_stepwise.hf.presets import tiny_config
from megatron_stepwise.mcore.weights import sync as S
from megatron_stepwise.rollout.engines.sglang import SGLangServerConfig
from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
from megatron_stepwise.rollout.fleet.fleet import RolloutFleet, weight_update_ranks


def local(tp_size: int = 1) -> EngineSpec:
    return EngineSpec(kind="local", model_config={}, tp_size=tp_size)


def sglang(tp_size: int) -> EngineSpec:
    return EngineSpec(kind="sglang", sglang=SGLangServerConfig("model", tp_size=tp_size), tp_size=tp_size)


def http(tp_size: int) -> EngineSpec:
    return EngineSpec(kind="http", url="http://127.0.0.1:30000", tp_size=tp_size)


def test_offsets_follow_each_engines_tp_ranks():
    # trainer = rank 0; local -> 1; sglang tp2 -> 2, 3; http tp4 -> 4..7; local -> 8.
    assert weight_update_ranks([local(), sglang(2), http(4), local()]) == ([1, 2, 4, 8], 9)
    assert weight_update_ranks([sglang(1), sglang(1)]) == ([1, 2], 3)
    assert weight_update_ranks([]) == ([], 1)


def test_the_embedded_engine_is_one_rank_whatever_its_tp_size():
    assert weight_update_ranks([local(tp_size=4), http(2)]) == ([1, 2], 4)


def test_an_sglang_spec_whose_tp_size_disagrees_with_its_server_is_rejected():
    with pytest.raises(ValueError, match=r"EngineSpec.tp_size \(1\) must equal sglang.tp_size \(2\)"):
        EngineSpec(kind="sglang", sglang=SGLangServerConfig("model", tp_size=2))


class FakeEngineHandle:
    """Stands in for a Ray actor handle: `call.remote("init_weights_update_group", ...)` joins the
    group with one gloo rank per TP rank, as an SGLang server does."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.groups: list = []
        self.offset = None
        self.call = SimpleNamespace(remote=self._call)

    def _call(self, method, master_address, master_port, rank_offset, world_size, group_name, backend):
        assert method == "init_weights_update_group" and backend == "gloo"
        self.offset = rank_offset
        return self._join(master_address, master_port, rank_offset, world_size)

    async def _join(self, address, port, rank_offset, world_size):
        loop = asyncio.get_running_loop()
        self.groups = await asyncio.gather(
            *(
                loop.run_in_executor(
                    None, weight_transport.join_group, address, port, rank_offset + tp_rank, world_size, 60
                )
                for tp_rank in range(self.ranks)
            )
        )


def fake_fleet(specs: list[EngineSpec], dead: tuple[int, ...] = ()) -> RolloutFleet:
    """The real fleet's group logic over fake engine handles (no Ray actors)."""
    fleet = RolloutFleet(specs, spawn=lambda spec, index, incarnation: FakeEngineHandle(spec.group_ranks))
    for index in dead:
        fleet.remove_engine(index)
    return fleet


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_weight_sync_opens_a_group_with_every_tp_rank_and_broadcasts_to_all(monkeypatch):
    monkeypatch.setattr(S.dist, "get_rank", lambda: 0)  # WeightSync drives the fleet from global rank 0
    fleet = fake_fleet([sglang(2), local(), http(3), sglang(2)], dead=(3,))
    assert fleet.weight_update_world_size() == 1 + 2 + 1 + 3
    loop = asyncio.new_event_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(16))  # trainer + 6 engine ranks block at once
    syncer = S.WeightSync(
        fleet, "distributed", tiny_config(), loop=loop, master_address="127.0.0.1", master_port=_free_port()
    )
    try:
        group = syncer.open_group()
        assert group.world_size == 7 and syncer.open_group() is group
        assert [fleet.engine(i).offset for i in range(4)] == [1, 3, 4, None]  # the dead engine was not asked

        sent = torch.arange(6, dtype=torch.float32)
        receivers = [g for i in range(4) for g in fleet.engine(i).groups]
        assert sorted(g.rank for g in receivers) == [1, 2, 3, 4, 5, 6]
        buffers = [torch.zeros(6) for _ in receivers]

        async def broadcast_and_receive():
            run = asyncio.get_running_loop().run_in_executor
            await asyncio.gather(
                run(None, weight_transport.broadcast, group, [sent]),
                *(run(None, weight_transport.receive, g, [b]) for g, b in zip(receivers, buffers)),
            )

        loop.run_until_complete(broadcast_and_receive())
        for b in buffers:
            torch.testing.assert_close(b, sent, atol=0, rtol=0)
    finally:
        syncer.close()
        loop.close()
