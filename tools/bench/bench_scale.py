"""The rollout side at scale, host work only: agent workers -> hand-off -> prepare -> plan.

An engine that answers instantly (a fixed 32-token reply, no model) inside each agent process,
so every second measured is host work: the agent loop (chat template, tokenizer, environment,
step assembly), the transfer of finished groups, and rank 0's decision (validate, metrics,
prompt mini-batches, prefix merge + advantages, micro-batch plan, one shard per DP rank).
Workload: `--prompts` x `--samples` trajectories of `--turns` turns of the echo environment with
the `tiny_bpe` tokenizer (default 512 x 8 x 5 = 20,480 turns).

Printed side by side in one run (no asserts):
- before: the agent loop in the driver process, then the old hand-off (every `Step` pickled and
  broadcast to every rank, each rank validating, splitting and preparing the whole rollout);
- after: the same rollout by 1 and by 2 agent workers (Ray actors), then rank 0's decision and
  the per-DP-rank shards;
- CPU ms per turn inside one agent worker; turns/s of 2 workers vs 1;
- a reply's groups to the driver: one batch per group vs packed (`pack_groups`);
- bytes a rank receives at DP 1/2/4, and the sending side's seconds per step;
- rows left in the workers (`rollout.handoff: workers`): the workers validate and prepare their
  groups, rank 0 decides from row tables and sends manifests, each DP rank fetches its rows from
  the workers: rank 0's bytes and seconds, each rank's bytes;
- asynchronous training (one group a worker call, one optimizer step per `--prompts-per-minibatch`
  groups): bytes through rank 0 per iteration, rows through rank 0 (`rollout.handoff: driver`) vs
  kept in the workers: the groups' replies in, and what rank 0 sends the other DP ranks.

    python tools/bench/bench_scale.py                 # 512 x 8 x 5
    python tools/bench/bench_scale.py --quick         # 64 x 8 x 5
"""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

TOOLS, ROOT = Path(__file__).resolve().parent, Path(__file__).resolve().parents[2]
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from harness import add_seed_and_out, bench_parser, config, run_args, script_main  # noqa: E402
from instant_engine import InstantEngine  # noqa: E402

REPLY_TOKENS = 32


def _instant_worker_class():
    from megatron_stepwise.workers.agent_workers import AgentWorker

    class InstantWorker(AgentWorker):
        """An agent worker whose turns go to an in-process instant engine; it reports its CPU time."""

        def __init__(self, cfg, max_concurrency, name=""):
            super().__init__(cfg, max_concurrency, name)
            self.agent.generator = InstantEngine(self.agent.tokenizer, REPLY_TOKENS)

        def cpu_seconds(self) -> float:
            return time.process_time()

    return InstantWorker


class _NoFleet:
    """The workers' generator is in-process: the fleet only has to answer their bookkeeping."""

    def engine_table(self):
        return []

    def report_dead(self, index, incarnation):
        raise AssertionError("the instant engine never dies")

    def add_request_counts(self, counts):
        pass


def _config(args):
    from megatron_stepwise.config import load_config

    return load_config(
        Path(__file__).resolve().parents[2] / "configs/tiny_cpu.yaml",
        [
            "model.tokenizer=tiny_bpe",
            f"rollout.max_turns={args.turns}",
            f"rollout.max_new_tokens={REPLY_TOKENS}",
            "rollout.max_input_length=4096",
            f"rollout.context={args.context}",
            f"data.samples_per_prompt={args.samples}",
            f"data.prompts_per_iteration={args.prompts}",
            f"data.prompts_per_minibatch={args.prompts_per_minibatch}",
            f"rollout.max_concurrency={args.concurrency}",
            "data.max_tokens_per_microbatch=16384",
            f"env.dataset_options.num_turns={args.turns}",
            f"env.dataset_options.num_prompts={args.prompts}",
            "rollout.agent_worker_cpus=0.5",
        ],
        world_size=1,
    )


def _samples(cfg, args) -> list[dict]:
    from megatron_stepwise.envs.echo import echo_dataset

    return echo_dataset(args.prompts, num_turns=args.turns, seed=args.seed)


def _in_process(cfg, samples) -> tuple[list, float, float]:
    """The agent loop in this process (today's default): (steps, wall s, CPU s)."""
    from megatron_stepwise.compose import components

    tok = components.load_tokenizer(cfg)
    agent = components.build_agent_loop(cfg, InstantEngine(tok, REPLY_TOKENS), tok)
    asyncio.run(agent.rollout(samples[:8]))  # warm-up: template compilation, first allocations
    t, c = time.perf_counter(), time.process_time()
    steps = asyncio.run(agent.rollout(samples, seed=1))
    return steps, time.perf_counter() - t, time.process_time() - c


def _workers(cfg, samples, n: int, held: Optional[Callable] = None) -> dict[str, Any]:
    """The same rollout by `n` agent workers: wall seconds, the driver's CPU, the workers' CPU.
    With `held(groups)`, the workers keep each group's prepared rows and `held` runs on the
    summaries while the workers are alive (rank 0's decision, the replicas' fetches)."""
    import ray

    from megatron_stepwise.algo.prepare import prepare_rows
    from megatron_stepwise.loop.sources import bind_prepare
    from megatron_stepwise.workers.agent_workers import AgentWorkers
    from megatron_stepwise.workers.worker_rows import NAMESPACE, HoldRequest

    worker_cls = ray.remote(_instant_worker_class())

    # The workers import this file's worker class and the instant engine: tools/ on their path, even
    # in a Ray started before this ran (the test suite starts one per session).
    env = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}

    def spawn(cfg, index, concurrency, name):
        return worker_cls.options(
            num_cpus=cfg.rollout.agent_worker_cpus,
            max_concurrency=1000,
            name=name,
            namespace=NAMESPACE,
            runtime_env=env,
        ).remote(cfg, concurrency, name)

    hold = HoldRequest(1, bind_prepare(cfg, prepare_rows), cfg_vocab(cfg)) if held else None
    loop = asyncio.new_event_loop()
    workers = AgentWorkers(cfg, _NoFleet(), n, spawn=spawn)
    try:
        loop.run_until_complete(workers.wait_ready())
        loop.run_until_complete(workers.rollout(samples[: 8 * n]))  # warm-up
        before = ray.get([w.handle.cpu_seconds.remote() for w in workers.workers])
        t, c = time.perf_counter(), time.process_time()
        groups = loop.run_until_complete(workers.rollout_groups(samples, seed=1, hold=hold))
        wall, driver_cpu = time.perf_counter() - t, time.process_time() - c
        after = ray.get([w.handle.cpu_seconds.remote() for w in workers.workers])
        decided = held(groups) if held else None
    finally:
        workers.close()
        loop.close()
    return {
        "groups": groups,
        "wall": wall,
        "driver_cpu": driver_cpu,
        "held": decided,
        "worker_cpu": [b - a for a, b in zip(before, after)],
    }


def _decide(rows, dp: int, max_tokens: int) -> list:
    """The plugin's `decide_shards` without a model: the planner's rows per DP rank, with the
    reduction's denominators."""
    from megatron_stepwise.algo.planner import plan_microbatches
    from megatron_stepwise.algo.reductions import row_denominators
    from megatron_stepwise.algo.shards import ShardDecision, shard_rows

    plan = plan_microbatches(rows.lengths.tolist(), dp_size=dp, max_tokens=max_tokens)
    denominators = row_denominators(rows, "token_mean")
    out = []
    for rank, micros in enumerate(plan):
        mine, local = shard_rows(micros)
        index = torch.as_tensor(mine, dtype=torch.long)
        out.append(
            ShardDecision(
                local,
                mine,
                rank,
                dp,
                trained_tokens=int(rows.trained.sum()),
                data_rows=0,
                data_tokens=0,
                tokens=0,
                rollout_logprobs=True,
                rollout_logprobs_complete=True,
                traj_index=rows.traj_index[index],
                group_index=rows.group_index[index],
                denominators=denominators[index],
            )
        )
    return out


def _held_handoff(cfg, dp_sizes=(1, 2, 4)) -> Callable:
    """Rows left in the workers: rank 0 decides from the groups' row tables and pickles one small
    manifest per DP rank; each DP rank fetches its rows from the workers (here one after the
    other, from this process)."""
    import ray

    from megatron_stepwise.loop.rounds import decide_round
    from megatron_stepwise.metrics.core import rollout_metrics
    from megatron_stepwise.workers.worker_rows import RowFetcher, RowsInWorkers

    def run(groups) -> dict[str, Any]:
        out: dict[str, Any] = {}
        t = time.process_time()
        rollout_metrics(groups)
        k = cfg.data.prompts_per_minibatch
        minibatches = [groups[i : i + k] for i in range(0, len(groups), k)]
        out["split_cpu"] = time.process_time() - t
        address = ray.get_runtime_context().gcs_address
        for dp in dp_sizes:
            t = time.process_time()
            decide = functools.partial(_decide, dp=dp, max_tokens=cfg.data.max_tokens_per_microbatch)
            rounds = decide_round(minibatches, RowsInWorkers(1, address), decide=decide, dp_size=dp)
            shards = [[r.shards[i] for r in rounds] for i in range(len(minibatches))]
            decision = time.process_time() - t
            t = time.process_time()
            blobs = [pickle.dumps([s[rank] for s in shards], protocol=5) for rank in range(dp)]
            send = time.process_time() - t
            fetched, fetch_wall = [], []
            for rank in range(dp):
                fetcher = RowFetcher()
                t = time.perf_counter()
                for shard in pickle.loads(blobs[rank]):
                    fetcher.fetch(shard)
                fetch_wall.append(time.perf_counter() - t)
                fetched.append(fetcher.bytes_fetched)
            out[f"dp{dp}"] = {
                "decision_cpu": decision,
                "send_cpu": send,
                "manifest_bytes": [len(b) for b in blobs],
                "bytes_fetched_per_rank": fetched,
                "fetch_wall_per_rank": fetch_wall,
            }
        return out

    return run


def _async_bytes(cfg, groups: list, held: list, dp_sizes=(1, 2, 4)) -> dict[str, Any]:
    """Bytes through rank 0 in one asynchronous iteration, side by side: each group arrives in its
    own worker reply (rows, or a HeldGroup's summary), and each optimizer step of
    `prompts_per_minibatch` groups leaves rank 0 as one payload per DP rank (the shards' rows, or
    manifests); rank 0 is DP rank 0's leader, so it sends the others'."""
    import ray

    from megatron_stepwise.loop.rounds import decide_round
    from megatron_stepwise.loop.sources import bind_prepare
    from megatron_stepwise.rollout.fleet.engine_router import RequestCounters
    from megatron_stepwise.workers.agent_workers import WorkerReply
    from megatron_stepwise.workers.worker_rows import RowsInWorkers

    def reply_bytes(gs) -> int:
        return sum(len(pickle.dumps(WorkerReply([g], [], RequestCounters()), protocol=5)) for g in gs)

    k = cfg.data.prompts_per_minibatch
    prepare = bind_prepare(cfg)
    address = ray.get_runtime_context().gcs_address if ray.is_initialized() else ""
    out: dict[str, Any] = {"steps": len(groups) // k}
    out["driver_in"], out["workers_in"] = reply_bytes(groups), reply_bytes(held)
    for dp in dp_sizes:
        driver_out = workers_out = 0
        decide = functools.partial(_decide, dp=dp, max_tokens=cfg.data.max_tokens_per_microbatch)
        for i in range(0, len(groups) - k + 1, k):
            batch, _ = prepare(groups[i : i + k])
            shards = _shard(batch, dp, cfg.data.max_tokens_per_microbatch)
            driver_out += sum(len(pickle.dumps(shards[r], protocol=5)) for r in range(1, dp))
            manifests = [
                r.shards[0]
                for r in decide_round([held[i : i + k]], RowsInWorkers(1, address), decide=decide, dp_size=dp)
            ]
            workers_out += sum(len(pickle.dumps(manifests[r], protocol=5)) for r in range(1, dp))
        out[f"dp{dp}"] = {"driver_out": driver_out, "workers_out": workers_out}
    return out


def _group_transfer(steps, groups_per_reply: int = 8) -> dict[str, Any]:
    """A reply's groups as one batch per group vs packed into one (`pack_groups`, what the workers
    send): pickle + unpickle CPU per step, side by side."""
    from megatron_stepwise.algo.groups import groups_of, pack_groups, unpack_groups

    groups = groups_of(steps)
    replies = [groups[i : i + groups_per_reply] for i in range(0, len(groups), groups_per_reply)]

    def cpu(fn) -> float:
        t = time.process_time()
        for reply in replies:
            fn(reply)
        return 1e3 * (time.process_time() - t) / len(steps)

    per_group = cpu(lambda reply: pickle.loads(pickle.dumps(reply, protocol=5)))
    packed = cpu(lambda reply: unpack_groups(pickle.loads(pickle.dumps(pack_groups(reply), protocol=5))))
    return {"groups_per_reply": groups_per_reply, "per_group_ms_per_step": per_group, "packed_ms_per_step": packed}


def _old_handoff(steps, cfg) -> dict[str, float]:
    """Before: every Step pickled once and unpickled by every rank, which then validates, splits
    and prepares the whole rollout."""
    from megatron_stepwise.algo.batching import prompt_minibatches
    from megatron_stepwise.algo.groups import groups_of
    from megatron_stepwise.algo.validate import validate_steps
    from megatron_stepwise.loop.sources import bind_prepare

    t = time.process_time()
    blob = pickle.dumps(steps, protocol=pickle.HIGHEST_PROTOCOL)
    send = time.process_time() - t
    t = time.process_time()
    received = pickle.loads(blob)
    receive = time.process_time() - t
    t = time.process_time()
    validate_steps(received, vocab_size=cfg_vocab(cfg))
    prepare = bind_prepare(cfg)
    for mb in prompt_minibatches(received, cfg.data.prompts_per_minibatch):
        prepare(groups_of(mb))
    every_rank = time.process_time() - t
    return {"send_cpu": send, "receive_cpu": receive, "every_rank_cpu": every_rank, "bytes_per_rank": len(blob)}


def cfg_vocab(cfg) -> int:
    from megatron_stepwise.compose import components

    return len(components.load_tokenizer(cfg))


def _shard(batch, dp: int, max_tokens: int) -> list:
    """The plugin's per-DP cut (`plan_shards`) without a model: the planner's rows per rank, as
    the `MinibatchShard`s rank 0 sends (their wire form included)."""
    from megatron_stepwise.algo.planner import plan_microbatches
    from megatron_stepwise.algo.rows import RowTable
    from megatron_stepwise.algo.shards import MinibatchShard, ShardDecision, shard_rows

    table = RowTable.of(batch)
    plan = plan_microbatches(batch.lengths.tolist(), dp_size=dp, max_tokens=max_tokens)
    shards = []
    for rank, micros in enumerate(plan):
        rows, local = shard_rows(micros)
        shards.append(
            MinibatchShard(
                ShardDecision(
                    local,
                    rows,
                    rank,
                    dp,
                    trained_tokens=0,
                    data_rows=0,
                    data_tokens=0,
                    tokens=0,
                    rollout_logprobs=True,
                    rollout_logprobs_complete=True,
                    traj_index=table.traj_index[rows],
                    group_index=table.group_index[rows],
                ),
                batch.select(rows),
            )
        )
    return shards


def _new_handoff(steps, cfg, dp_sizes=(1, 2, 4)) -> dict[str, Any]:
    """After: rank 0 decides once (validate, metrics, mini-batches, prepare, plan, shards) and
    pickles one payload per DP rank; a rank receives and unpickles only its own."""
    from megatron_stepwise.algo.batching import prompt_minibatches
    from megatron_stepwise.algo.groups import groups_of
    from megatron_stepwise.algo.validate import validate_steps
    from megatron_stepwise.loop.sources import bind_prepare
    from megatron_stepwise.metrics.core import rollout_metrics

    out: dict[str, Any] = {}
    t = time.process_time()
    validate_steps(steps, vocab_size=cfg_vocab(cfg))
    rollout_metrics(groups_of(steps))
    minibatches = prompt_minibatches(steps, cfg.data.prompts_per_minibatch)
    out["validate_split_cpu"] = time.process_time() - t
    t = time.process_time()
    prepare = bind_prepare(cfg)
    batches = [prepare(groups_of(mb))[0] for mb in minibatches]
    out["prepare_cpu"] = time.process_time() - t
    for dp in dp_sizes:
        t = time.process_time()
        shards = [_shard(b, dp, cfg.data.max_tokens_per_microbatch) for b in batches]
        plan = time.process_time() - t
        t = time.process_time()
        blobs = [pickle.dumps([s[rank] for s in shards], protocol=5) for rank in range(dp)]
        send = time.process_time() - t
        t = time.process_time()
        pickle.loads(blobs[-1])
        receive = time.process_time() - t
        out[f"dp{dp}"] = {
            "plan_cpu": plan,
            "send_cpu": send,
            "receive_cpu": receive,
            "bytes_per_rank": [len(b) for b in blobs],
        }
    return out


def run(quick: bool = False, **options) -> dict[str, Any]:
    from megatron_stepwise.rollout.fleet.ray_start import ensure_ray

    args = run_args(parse_args, quick, options)
    cfg = _config(args)
    samples = _samples(cfg, args)
    print(
        f"workload: {args.prompts} prompts x {args.samples} samples x {args.turns} turns, "
        f"{REPLY_TOKENS}-token replies, context={args.context}, tiny_bpe, echo"
    )

    steps, wall, cpu = _in_process(cfg, samples)
    turns = len(steps)
    result: dict[str, Any] = {"config": config(args), "turns": turns}
    result["in_process"] = {
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_ms_per_turn": 1e3 * cpu / turns,
        "turns_per_s": turns / wall,
    }
    print(f"\nin the driver process: {turns} turns in {wall:.2f} s wall, {1e3 * cpu / turns:.3f} ms CPU per turn")

    # the agent workers import this file's worker class and the instant engine
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(TOOLS), os.environ.get("PYTHONPATH")) if p)
    ensure_ray(num_cpus=4)
    for n in (1, 2):
        w = _workers(cfg, samples, n)
        w2_groups = w["groups"]
        w["steps"] = [s for g in w["groups"] for s in g.steps]
        assert len(w["steps"]) == turns
        result[f"workers{n}"] = {
            "wall_s": w["wall"],
            "turns_per_s": turns / w["wall"],
            "driver_cpu_ms_per_turn": 1e3 * w["driver_cpu"] / turns,
            "worker_cpu_ms_per_turn": 1e3 * sum(w["worker_cpu"]) / turns,
        }
        print(
            f"{n} agent worker(s): {turns / w['wall']:.0f} turns/s, worker CPU "
            f"{1e3 * sum(w['worker_cpu']) / turns:.3f} ms per turn, driver CPU "
            f"{1e3 * w['driver_cpu'] / turns:.3f} ms per turn"
        )
    result["workers_2_vs_1"] = result["workers2"]["turns_per_s"] / result["workers1"]["turns_per_s"]
    print(f"2 workers vs 1: {result['workers_2_vs_1']:.2f}x turns per second ({os.cpu_count()} cores)")

    result["group_transfer"] = g = _group_transfer(steps)
    print(
        f"groups worker -> driver, pickle + unpickle: one batch per group {g['per_group_ms_per_step']:.4f} ms/step, "
        f"a reply's groups packed {g['packed_ms_per_step']:.4f} ms/step ({g['groups_per_reply']} groups a reply)"
    )

    old, new = _old_handoff(steps, cfg), _new_handoff(steps, cfg)
    result["handoff_before"], result["handoff_after"] = old, new
    print(f"\nhand-off of {turns} steps")
    print(
        f"  before: pickle every Step {1e3 * old['send_cpu'] / turns:.3f} ms/step, {old['bytes_per_rank'] / 1e6:.1f} MB "
        f"to every rank, each rank unpickles ({1e3 * old['receive_cpu'] / turns:.3f} ms/step) and validates + "
        f"prepares all ({old['every_rank_cpu']:.2f} s)"
    )
    print(
        f"  after: rank 0 validates + splits {new['validate_split_cpu']:.2f} s, prepares {new['prepare_cpu']:.2f} s once"
    )
    for dp in (1, 2, 4):
        d = new[f"dp{dp}"]
        per_rank = d["bytes_per_rank"]
        print(
            f"    DP{dp}: plan + shards {d['plan_cpu']:.2f} s, send {1e3 * d['send_cpu'] / turns:.4f} ms/step, "
            f"bytes per rank {min(per_rank) / 1e6:.2f}-{max(per_rank) / 1e6:.2f} MB "
            f"({sum(per_rank) / dp / per_rank_whole(new):.3f} of DP1)"
        )

    w = _workers(cfg, samples, 2, held=_held_handoff(cfg))
    held = w["held"]
    result["held"] = {
        "wall_s": w["wall"],
        "driver_cpu_ms_per_turn": 1e3 * w["driver_cpu"] / turns,
        "worker_cpu_ms_per_turn": 1e3 * sum(w["worker_cpu"]) / turns,
        **held,
    }
    print(
        f"  rows left in the workers (rollout.handoff=workers): 2 workers roll out, validate and prepare: "
        f"{turns / w['wall']:.0f} turns/s, driver CPU {1e3 * w['driver_cpu'] / turns:.3f} ms per turn "
        f"(summaries and row tables in, no token); metrics + split {held['split_cpu']:.2f} s"
    )
    for dp in (1, 2, 4):
        d = held[f"dp{dp}"]
        fetched = d["bytes_fetched_per_rank"]
        print(
            f"    DP{dp}: decision {d['decision_cpu']:.2f} s, manifests {1e3 * d['send_cpu'] / turns:.4f} ms/step, "
            f"{max(d['manifest_bytes']) / 1e3:.0f} kB per rank from rank 0; each rank fetches "
            f"{min(fetched) / 1e6:.2f}-{max(fetched) / 1e6:.2f} MB from the workers "
            f"({sum(fetched) / dp / sum(held['dp1']['bytes_fetched_per_rank']):.3f} of DP1) in "
            f"{max(d['fetch_wall_per_rank']):.2f} s"
        )
    a = result["async_bytes"] = _async_bytes(cfg, w2_groups, w["groups"])
    print(
        f"\nasync training, bytes through rank 0 per iteration ({a['steps']} optimizer steps of "
        f"{cfg.data.prompts_per_minibatch} groups, one group a worker reply):\n"
        f"  {'':<26}{'rows through rank 0':>22}{'rows kept in the workers':>28}\n"
        f"  {'in, from the workers':<26}{a['driver_in'] / 1e6:>19.2f} MB{a['workers_in'] / 1e6:>25.2f} MB"
    )
    for dp in (1, 2, 4):
        d = a[f"dp{dp}"]
        print(
            f"  {f'out, to DP ranks 1-{dp - 1}' if dp > 1 else 'out (DP1: none)':<26}"
            f"{d['driver_out'] / 1e6:>19.2f} MB{d['workers_out'] / 1e6:>25.3f} MB  (DP{dp})"
        )
    result["host_seconds_held"] = held_s = (
        w["wall"]
        + held["split_cpu"]
        + held["dp4"]["decision_cpu"]
        + held["dp4"]["send_cpu"]
        + max(held["dp4"]["fetch_wall_per_rank"])
    )

    before = wall + old["send_cpu"] + old["receive_cpu"] + old["every_rank_cpu"]
    after = (
        result["workers2"]["wall_s"]
        + new["validate_split_cpu"]
        + new["prepare_cpu"]
        + new["dp4"]["plan_cpu"]
        + new["dp4"]["send_cpu"]
        + new["dp4"]["receive_cpu"]
    )
    result["host_seconds_before"], result["host_seconds_after"] = before, after
    print(
        f"\nhost seconds per iteration (rollout + hand-off + prepare/plan), DP4: before {before:.1f} s "
        f"(in-process loop, pickled Steps), after {after:.1f} s (2 agent workers, shards through rank 0), "
        f"{held_s:.1f} s (2 agent workers, rows fetched from the workers; the DP ranks fetch in parallel)"
    )
    return result


def per_rank_whole(new: dict) -> float:
    return float(sum(new["dp1"]["bytes_per_rank"]))


def parse_args(argv: Optional[list[str]] = None):
    p = bench_parser(__doc__, "64 prompts instead of 512")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--prompts-per-minibatch", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--context", choices=("retokenize", "tokens"), default="retokenize")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts = 64
    return args


if __name__ == "__main__":
    script_main(parse_args, run)
