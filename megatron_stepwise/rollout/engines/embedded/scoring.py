"""The embedded engine's `score`: log-probs of given tokens, requests batched into padded forwards.

No KV cache and no prefix cache: the teacher's forward is independent of whatever the running
batch holds, so scoring between two decode steps leaves the generations in flight unchanged.
Requests that arrive while one forward runs wait and go together in the next (`ScoreBatcher`):
rows right-padded to the longest, an attention mask over the padding, each row's log-probs read
at its own positions (a causal model's logits at a position see only the tokens before it, so
the padding after a row changes nothing of it).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch


@dataclass
class ScoreRequest:
    ids: list[int]
    start: int
    temperature: float
    future: asyncio.Future = field(repr=False)


def score_rows(model: torch.nn.Module, rows: list[tuple[list[int], int, float]], pad_id: int = 0) -> list[list[float]]:
    """For each (ids, start, temperature) row: `log_softmax(logits / temperature)[ids[i]]` given
    `ids[:i]`, for each i >= start, in float32 over the full vocabulary (the rollout log-prob
    convention, `protocol.py`); all rows in one right-padded forward."""
    longest = max(len(ids) for ids, _, _ in rows)
    tokens = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for r, (ids, _, _) in enumerate(rows):
        tokens[r, : len(ids)], mask[r, : len(ids)] = torch.tensor(ids), 1
    first = min(start for _, start, _ in rows)
    extra = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        # the lm_head only from the first position whose logits give a scored token on
        extra["logits_to_keep"] = longest - first + 1
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=mask, use_cache=False, **extra).logits
    offset = longest - logits.shape[1]  # logits[:, j] is position offset + j
    out = []
    for r, (ids, start, temperature) in enumerate(rows):
        at = logits[r, start - 1 - offset : len(ids) - 1 - offset].float()
        logp = torch.log_softmax(at / temperature, -1)
        out.append(logp.gather(-1, tokens[r, start : len(ids), None])[:, 0].tolist())
    return out


class ScoreBatcher:
    """Queues score requests; one drain task runs them in padded batches (at most `max_tokens`
    positions, at most `max_padding` of them padding) through `run(rows)` (the engine's model
    thread, between decode steps)."""

    def __init__(
        self,
        run: Callable[[list[tuple[list[int], int, float]]], Awaitable[list[list[float]]]],
        max_tokens: int = 16384,
        max_padding: float = 0.1,
    ):
        self.run, self.max_tokens, self.max_padding = run, max_tokens, max_padding
        self.pending: list[ScoreRequest] = []
        self._drain: asyncio.Task | None = None
        self.forwards = 0  # padded forwards run so far (a test and the bench read it)

    async def score(self, ids: list[int], start: int, temperature: float) -> list[float]:
        request = ScoreRequest(ids, start, temperature, asyncio.get_running_loop().create_future())
        self.pending.append(request)
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_task(self._run_pending())
        return await request.future

    def _take(self) -> list[ScoreRequest]:
        """The longest waiting request and those of nearly its length: a padded batch within
        max_tokens that wastes at most `max_padding` of its positions on padding (on a CPU a
        forward costs what its positions do, so padding is pure loss; on a GPU batching wins)."""
        self.pending.sort(key=lambda r: -len(r.ids))
        longest, used, n = len(self.pending[0].ids), 0, 0
        for r in self.pending:
            if n and (
                longest * (n + 1) > self.max_tokens or longest * (n + 1) > (used + len(r.ids)) / (1 - self.max_padding)
            ):
                break
            used, n = used + len(r.ids), n + 1
        batch, self.pending = self.pending[:n], self.pending[n:]
        return batch

    async def _run_pending(self) -> None:
        while self.pending:
            batch = self._take()
            try:
                results = await self.run([(r.ids, r.start, r.temperature) for r in batch])
            except BaseException as e:  # every request of the batch gets the failure, none hangs
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            self.forwards += 1
            for r, values in zip(batch, results):
                if not r.future.done():
                    r.future.set_result(values)
