"""Multi-turn traffic for tools/bench/replay_routing.py: a synthetic trace of long agent sessions, and
the turns of recorded rollout dumps.

A trace is a list of `Session`s; each turn is one request: its prompt length, the tokens it
generated, the `max_new_tokens` the router counts, the think time (environment, tool) before the
session's next turn, and the prefix-cache blocks of its prompt + output. A block is `block_tokens`
tokens, named by a key that stands for the whole prefix up to its end (as vLLM's block hashes and
SGLang's radix tree do): two requests share a cached block exactly when they share that prefix.
Only whole blocks are cached.

Synthetic sessions (`synthetic_trace`): GRPO-like groups of `group_size` sessions arrive together
(Poisson arrivals); every prompt starts with one shared system prompt, then the group's task, then
the session's own turns: each turn's prompt is the previous prompt + its response + an
observation (token-in, token-out: it extends exactly). Turns 4-30 (4 + a geometric count),
response, observation, task and think-time lengths log-normal (heavy-tailed), a session ends early
once its prompt would pass `max_context` tokens.

Dumps (`dump_trace`): every trajectory of every `rollouts/iter_*.parquet` of a run directory is a
session, its steps (in turn order) its requests, with the exact prompt and response tokens. All
trajectories of an iteration start together, iterations one after the other; every engine's cache
is flushed between iterations (a weight update empties it). Think times are drawn as for the
synthetic trace (dumps do not record them). A dump of merged trajectories (`data.merge_steps`)
replays one request per trajectory.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

# Block keys of a synthetic session: (owner << OWNER_SHIFT) | block index, owner 0 = the shared
# system prompt, 1 + g = group g's task prompt, FIRST_SESSION + s = session s's own tokens.
OWNER_SHIFT = 24
FIRST_SESSION = 1 << 20


@dataclass
class Turn:
    prompt_tokens: int
    new_tokens: int
    max_new_tokens: int
    think_s: float  # before the session's next turn
    blocks: Sequence[int]  # keys of the whole blocks of prompt + output (the output's last token excluded)
    block_tokens: int = 1

    @property
    def prompt_blocks(self) -> int:
        """Blocks a lookup may match: those wholly inside the prompt."""
        return min(len(self.blocks), self.prompt_tokens // self.block_tokens)


@dataclass
class Session:
    name: str
    start_s: float
    turns: list[Turn] = field(default_factory=list)
    epoch: int = 0  # dumps: the iteration (caches are flushed between epochs)


class SyntheticBlocks:
    """The block keys of a synthetic session's first `n` blocks, made on demand (a long session has
    thousands; a list per turn would hold the whole trace's tokens)."""

    def __init__(self, n: int, block_tokens: int, system: int, task: int, group: int, session: int):
        self.n, self.b = n, block_tokens
        self.system_end, self.task_end = system, system + task
        self.group, self.session = group, session

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> int:
        if k < 0:
            k += self.n
        if not 0 <= k < self.n:
            raise IndexError(k)
        end = (k + 1) * self.b  # a block is the prefix up to its end: owned by its last token's part
        owner = (
            0 if end <= self.system_end else 1 + self.group if end <= self.task_end else FIRST_SESSION + self.session
        )
        return (owner << OWNER_SHIFT) | k

    def __iter__(self):
        return (self[k] for k in range(self.n))


def lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))))


def think_time(rng: random.Random, median_s: float, sigma: float = 1.0) -> float:
    return median_s * math.exp(rng.gauss(0.0, sigma))


def synthetic_trace(
    *,
    sessions: int,
    group_size: int = 8,
    arrival_rate: float = 1.0,  # groups per simulated second
    system_tokens: int = 1024,
    task_median: int = 512,
    response_median: int = 200,
    observation_median: int = 300,
    max_new_tokens: int = 4096,
    max_context: int = 32768,
    think_median_s: float = 1.5,
    block_tokens: int = 64,
    seed: int = 0,
) -> list[Session]:
    rng = random.Random(seed)
    out: list[Session] = []
    t = 0.0
    for g in range(math.ceil(sessions / group_size)):
        t += rng.expovariate(arrival_rate)
        task = lognormal(rng, task_median, 1.0, 32, 8192)
        for _ in range(min(group_size, sessions - len(out))):
            s = len(out)
            turns = min(30, 4 + int(rng.expovariate(1 / 6)))  # 4-30, mean ~10, a long tail
            prompt = system_tokens + task
            session = Session(f"s{s}", t)
            for k in range(turns):
                new = lognormal(rng, response_median, 1.0, 1, max_new_tokens)
                n_blocks = (prompt + new - 1) // block_tokens
                blocks = SyntheticBlocks(n_blocks, block_tokens, system_tokens, task, g, s)
                think = think_time(rng, think_median_s)
                session.turns.append(Turn(prompt, new, max_new_tokens, think, blocks, block_tokens))
                prompt += new + lognormal(rng, observation_median, 1.2, 8, 16384)
                if prompt + max_new_tokens > max_context:
                    break
            out.append(session)
    return out


def chained_blocks(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """Keys of the whole blocks of `tokens`: each the hash of the previous key and its own tokens."""
    keys, prev = [], 0
    for k in range(len(tokens) // block_tokens):
        prev = hash((prev, tuple(tokens[k * block_tokens : (k + 1) * block_tokens])))
        keys.append(prev)
    return keys


def dump_trace(
    run_dir: str | Path,
    *,
    block_tokens: int = 1,
    think_median_s: float = 1.5,
    iteration_gap_s: float = 3600.0,
    seed: int = 0,
) -> list[Session]:
    """Every dumped iteration's trajectories as sessions (see the module docstring)."""
    from megatron_stepwise.rundir.dump_table import DumpError, dumped_iterations
    from megatron_stepwise.rundir.dumps import read_dump

    iterations = dumped_iterations(run_dir)
    if not iterations:
        raise DumpError(f"no rollout dumps in {Path(run_dir) / 'rollouts'} (train with trainer.dump_rollouts=N)")
    rng = random.Random(seed)
    out: list[Session] = []
    for epoch, it in enumerate(iterations):
        dump = read_dump(run_dir, it)
        max_new = int(((dump.meta.get("config") or {}).get("rollout") or {}).get("max_new_tokens") or 0)
        columns = ["prompt_id", "sample_index", "traj_index", "turn", "is_padding", "prompt_ids", "response_ids"]
        rows: dict[tuple, list[tuple[int, list[int], list[int]]]] = {}
        for r in dump.table.select(columns).to_pylist():
            if r["is_padding"]:
                continue
            key = (r["prompt_id"], r["sample_index"], r["traj_index"])
            rows.setdefault(key, []).append((r["turn"] or 0, r["prompt_ids"], r["response_ids"]))
        for key, steps in rows.items():
            session = Session(f"i{it}/{key[0]}/{key[1]}/{key[2]}", epoch * iteration_gap_s, epoch=epoch)
            for _, prompt, response in sorted(steps, key=lambda x: x[0]):
                blocks = chained_blocks(prompt + response[:-1], block_tokens)
                think = think_time(rng, think_median_s)
                turn = Turn(len(prompt), len(response), max(max_new, len(response)), think, blocks, block_tokens)
                session.turns.append(turn)
            out.append(session)
    return out


def describe(trace: list[Session], name: Optional[str] = None) -> dict:
    """The trace's size, for the report."""
    turns = [t for s in trace for t in s.turns]
    prompts = sorted(t.prompt_tokens for t in turns)
    return {
        "name": name,
        "sessions": len(trace),
        "requests": len(turns),
        "turns_per_session_max": max((len(s.turns) for s in trace), default=0),
        "prompt_tokens": sum(prompts),
        "generated_tokens": sum(t.new_tokens for t in turns),
        "prompt_tokens_median": prompts[len(prompts) // 2] if prompts else 0,
        "prompt_tokens_max": prompts[-1] if prompts else 0,
    }
