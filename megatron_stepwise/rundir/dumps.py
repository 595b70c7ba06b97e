"""Rollout dumps on disk: every `trainer.dump_rollouts` iterations, what the trainer trained, one Parquet file.

`RunDir.dump(42)` (`RUN_DIR/rollouts/iter_0000042.parquet`) holds one row per trained row (step, or merged
trajectory) of iteration 42: its mini-batch, ids, tokens, loss mask, rollout log-probs and
their weight versions, reward, outcome reward, advantages, stop reason, environment info,
routed experts and the provenance of routes and log-probs (the engine's forward-pass ids, when
present; `replay` checks their pairing first) and the trainer's own log-probs of the trained tokens with the
weights that trained the row. The file's metadata holds the resolved config, the weight version
and each optimizer step's train metrics. `read_dump` rebuilds the exact `StepBatch` of every
mini-batch (bit for bit), which is what `replay` trains on; the viewer reads the rows alone
(`read_dump_table`, rundir/dump_table.py, without torch).
Rank 0 captures the prepared mini-batches as it prepares them (`loop/rounds.py` `RowsOnRank0`, rundir/dump_recorder.py `DumpRecorder`); writing
happens after the iteration. This module only reads and writes files, so the viewer and
`replay` read dumps without the training loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

# reading a dump's table needs no torch (the viewer): dump_table.py; its names are the dump's API here too
from megatron_stepwise.rundir.dump_table import (
    FORMAT_VERSION,
    META_KEY,
    read_dump_table,
)
from megatron_stepwise.steps import INVALID, PREFIX_BREAK, ROUTED_EXPERTS_DTYPE, StepBatch, TrajectoryID

# Token fields a prepared mini-batch carries; all but routed_experts are 0 at prompt positions.
RESPONSE_FIELDS = {
    "loss_mask": torch.long,
    "rollout_logprobs": torch.float32,
    "rollout_logprobs_known": torch.bool,
    "advantages": torch.float32,
    "weight_versions": torch.long,
}


@dataclass
class Captured:
    """One prepared mini-batch as trained, with each row's step metadata (env info, turn...)."""

    batch: StepBatch
    metadata: list[dict[str, Any]]
    trainer_logprobs: Optional[torch.Tensor] = None  # flat [T], aligned with batch.tokens


def _jsonable(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return str(value)


def write_dump(
    path: str | Path,
    minibatches: Sequence[Captured],
    *,
    iteration: int,
    weight_version: int,
    config: dict,
    train_metrics: Sequence[dict[str, float]],
    epochs: int = 1,
    tokenizer: Optional[str] = None,
) -> Path:
    """One Parquet file, one row per trained row of every mini-batch (atomic: temp file + rename)."""
    import pyarrow.parquet as pq

    table, experts_shape = rows_table(minibatches)
    meta = {
        "version": FORMAT_VERSION,
        "iteration": iteration,
        "weight_version": weight_version,
        "epochs": epochs,
        "minibatches": len(minibatches),
        "routed_experts_shape": experts_shape,
        "train_metrics": list(train_metrics),
        "config": _jsonable(config),
        # what the token ids decode with, so `view` needs no module the config names (rundir/dump_trust.py)
        "tokenizer": tokenizer,
    }
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(path)
    return path


def rows_table(minibatches: Sequence[Captured]) -> tuple[Any, Optional[list[int]]]:
    """The dump's columns: one row per row of every mini-batch (pyarrow Table), and the shape of a
    token's routed experts (None without them). `batch_from_rows` turns rows back into a batch;
    the rollout bank (bank_files.py) stores groups in the same format."""
    import pyarrow as pa

    cols: dict[str, list] = {
        k: []
        for k in (
            "minibatch",
            "row",
            "prompt_id",
            "sample_index",
            "traj_index",
            "group_index",
            "turn",
            "is_last",
            "is_padding",
            "reward",
            "turn_reward",
            "outcome_reward",
            "stop_reason",
            "env_error",
            "invalid",
            "prefix_break",
            "prompt_ids",
            "response_ids",
            *RESPONSE_FIELDS,
            "trainer_logprobs",
            "routed_experts",
            "route_forwards",
            "logprob_forwards",
            "info",
        )
    }
    experts_shape = None
    for m, cap in enumerate(minibatches):
        b = cap.batch
        outcome = _outcome_rewards(b)
        routed = b.token_fields.get("routed_experts")
        route_fw, logprob_fw = b.token_fields.get("route_forwards"), b.token_fields.get("logprob_forwards")
        if routed is not None:
            experts_shape = list(routed.shape[1:])
        for r in range(b.num_rows):
            row, resp = b.row_slice(r), b.response_slice(r)
            meta = cap.metadata[r] if r < len(cap.metadata) else {}
            tid = b.trajectory_ids[r]
            cols["minibatch"].append(m)
            cols["row"].append(r)
            cols["prompt_id"].append(tid.prompt_id)
            cols["sample_index"].append(tid.sample_index)
            cols["traj_index"].append(int(b.row_fields["traj_index"][r]))
            cols["group_index"].append(int(b.row_fields["group_index"][r]))
            cols["turn"].append(meta.get("turn") if isinstance(meta.get("turn"), int) else None)
            cols["is_last"].append(bool(b.row_fields["is_last"][r]))
            cols["is_padding"].append(bool(b.row_fields["is_padding"][r]))
            cols["reward"].append(float(b.row_fields["reward"][r]))
            cols["turn_reward"].append(float(b.row_fields["turn_reward"][r]) if "turn_reward" in b.row_fields else 0.0)
            cols["outcome_reward"].append(outcome[r])
            cols["stop_reason"].append(b.stop_reasons[r])
            cols["env_error"].append(meta.get("error"))
            cols["invalid"].append(str(meta[INVALID]) if meta.get(INVALID) else None)  # never trained (Step)
            cols["prefix_break"].append(bool(meta.get(PREFIX_BREAK)))  # a gateway call that started afresh
            cols["prompt_ids"].append(b.tokens[row][: int(b.prompt_lens[r])].tolist())
            cols["response_ids"].append(b.tokens[resp].tolist())
            for name in RESPONSE_FIELDS:
                t = b.token_fields.get(name)
                cols[name].append(None if t is None else t[resp].tolist())
            lp = cap.trainer_logprobs
            cols["trainer_logprobs"].append(None if lp is None else lp[resp].tolist())
            cols["routed_experts"].append(None if routed is None else routed[row].reshape(-1).tolist())
            cols["route_forwards"].append(None if route_fw is None else route_fw[row].tolist())
            cols["logprob_forwards"].append(None if logprob_fw is None else logprob_fw[resp].tolist())
            cols["info"].append(json.dumps(_jsonable(meta)))
    types = {
        "minibatch": pa.int32(),
        "row": pa.int32(),
        "sample_index": pa.int64(),
        "traj_index": pa.int64(),
        "group_index": pa.int64(),
        "turn": pa.int32(),
        "reward": pa.float64(),
        "turn_reward": pa.float64(),
        "outcome_reward": pa.float64(),
        "prompt_ids": pa.list_(pa.int64()),
        "response_ids": pa.list_(pa.int64()),
        "loss_mask": pa.list_(pa.int8()),
        "rollout_logprobs": pa.list_(pa.float32()),
        "rollout_logprobs_known": pa.list_(pa.bool_()),
        "advantages": pa.list_(pa.float32()),
        "weight_versions": pa.list_(pa.int64()),
        "trainer_logprobs": pa.list_(pa.float32()),
        "routed_experts": pa.list_(pa.int16()),
        "route_forwards": pa.list_(pa.int64()),
        "logprob_forwards": pa.list_(pa.int64()),
        "env_error": pa.string(),
        "invalid": pa.string(),
        "stop_reason": pa.string(),
        "prompt_id": pa.string(),
        "info": pa.string(),
        "is_last": pa.bool_(),
        "is_padding": pa.bool_(),
        "prefix_break": pa.bool_(),
    }
    return pa.table({k: pa.array(v, type=types[k]) for k, v in cols.items()}), experts_shape


def _outcome_rewards(b: StepBatch) -> list[float]:
    """Each row's trajectory outcome: the reward of the trajectory's last step in this batch."""
    last = {
        int(t): float(r)
        for t, r, is_last in zip(
            b.row_fields["traj_index"].tolist(), b.row_fields["reward"].tolist(), b.row_fields["is_last"].tolist()
        )
        if is_last
    }
    return [last.get(int(t), float("nan")) for t in b.row_fields["traj_index"].tolist()]


@dataclass
class Dump:
    """A dump read back: its metadata, its rows (pyarrow Table) and each mini-batch's `StepBatch`."""

    meta: dict[str, Any]
    table: Any
    minibatches: list[StepBatch]
    trainer_logprobs: list[Optional[torch.Tensor]]

    @property
    def iteration(self) -> int:
        return int(self.meta["iteration"])


def read_dump(run_dir: str | Path, iteration: Optional[int] = None) -> Dump:
    """The dump of `iteration` (default: the last one dumped), its mini-batches rebuilt exactly."""
    meta, table = read_dump_table(run_dir, iteration)
    cols = table.to_pydict()
    batches, logprobs = [], []
    for m in range(int(meta["minibatches"])):
        rows = [i for i, v in enumerate(cols["minibatch"]) if v == m]
        batch, lp = batch_from_rows(cols, rows, meta.get("routed_experts_shape"))
        batches.append(batch)
        logprobs.append(lp)
    return Dump(meta, table, batches, logprobs)


def batch_from_rows(cols: dict[str, list], rows: list[int], experts_shape) -> tuple[StepBatch, Optional[torch.Tensor]]:
    """`rows` of a `rows_table` (as `to_pydict()` columns) rebuilt exactly as a StepBatch, and the
    trainer's log-probs of their tokens when the table has them."""
    prompt_lens = torch.tensor([len(cols["prompt_ids"][i]) for i in rows], dtype=torch.long)
    resp_lens = torch.tensor([len(cols["response_ids"][i]) for i in rows], dtype=torch.long)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    torch.cumsum(prompt_lens + resp_lens, 0, out=offsets[1:])
    tokens = torch.tensor([t for i in rows for t in cols["prompt_ids"][i] + cols["response_ids"][i]], dtype=torch.long)

    def spread(name: str, dtype) -> Optional[torch.Tensor]:
        if any(cols[name][i] is None for i in rows) or not rows:
            return None
        out = torch.zeros(int(offsets[-1]), dtype=dtype)
        for k, i in enumerate(rows):
            start = int(offsets[k] + prompt_lens[k])
            out[start : int(offsets[k + 1])] = torch.tensor(cols[name][i], dtype=dtype)
        return out

    token_fields = {name: t for name, dtype in RESPONSE_FIELDS.items() if (t := spread(name, dtype)) is not None}
    if experts_shape and all(cols["routed_experts"][i] is not None for i in rows):
        flat = [e for i in rows for e in cols["routed_experts"][i]]
        token_fields["routed_experts"] = torch.tensor(flat, dtype=ROUTED_EXPERTS_DTYPE).reshape(-1, *experts_shape)
    if rows and all(cols.get("route_forwards", [None] * (max(rows) + 1))[i] is not None for i in rows):
        token_fields["route_forwards"] = torch.tensor(
            [f for i in rows for f in cols["route_forwards"][i]], dtype=torch.long
        )
    if rows and all(cols.get("logprob_forwards", [None] * (max(rows) + 1))[i] is not None for i in rows):
        token_fields["logprob_forwards"] = torch.tensor(
            [f for i in rows for f in [-1] * len(cols["prompt_ids"][i]) + cols["logprob_forwards"][i]],
            dtype=torch.long,
        )
    row_fields = {
        "traj_index": torch.tensor([cols["traj_index"][i] for i in rows], dtype=torch.long),
        "group_index": torch.tensor([cols["group_index"][i] for i in rows], dtype=torch.long),
        "is_last": torch.tensor([cols["is_last"][i] for i in rows], dtype=torch.bool),
        "reward": torch.tensor([cols["reward"][i] for i in rows], dtype=torch.float64),
        "turn_reward": torch.tensor([cols["turn_reward"][i] for i in rows], dtype=torch.float64),
        "is_padding": torch.tensor([cols["is_padding"][i] for i in rows], dtype=torch.bool),
    }
    batch = StepBatch(
        tokens=tokens,
        offsets=offsets,
        prompt_lens=prompt_lens,
        token_fields=token_fields,
        row_fields=row_fields,
        trajectory_ids=[TrajectoryID(cols["prompt_id"][i], int(cols["sample_index"][i])) for i in rows],
        stop_reasons=[cols["stop_reason"][i] for i in rows],
    )
    return batch, spread("trainer_logprobs", torch.float32)
