"""Prompt dataset: samples drawn in order, reshuffled each epoch, with a resumable position.

The samples come from `data.files.open_samples` (files) or an environment's shipped set."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class DatasetPosition:
    epoch: int = 0
    index: int = 0


class PromptDataset:
    """Draws `n` samples at a time; each epoch is a fresh permutation (seeded by seed + epoch)."""

    def __init__(self, samples: Sequence[dict[str, Any]], *, seed: int, shuffle: bool = True):
        if not len(samples):
            raise ValueError("the prompt dataset is empty")
        if isinstance(samples, list):
            ids = [str(s.get("prompt_id", "")) for s in samples]
            if len(set(ids)) != len(ids) or not all(ids):
                raise ValueError("every sample needs a unique, non-empty 'prompt_id'")
        # Any other Sequence (data.files: Arrow columns, indexed JSONL) checked its ids
        # when it was opened and is kept as is: samples become dicts only when drawn.
        self.samples = samples
        self.seed = seed
        self.shuffle = shuffle
        self.position = DatasetPosition()
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[dict[str, Any]]:
        """The next n samples; a prompt never repeats inside one draw (n <= dataset size)."""
        if n > len(self.samples):
            raise ValueError(f"data.prompts_per_iteration={n} exceeds the dataset size ({len(self.samples)} prompts)")
        out = []
        for _ in range(n):
            if self.position.index == len(self.samples):
                self.position = DatasetPosition(self.position.epoch + 1, 0)
                self._order = self._permutation(self.position.epoch)
            out.append(self.samples[self._order[self.position.index]])
            self.position.index += 1
        ids = [s["prompt_id"] for s in out]
        if len(set(ids)) != len(ids):  # an epoch boundary inside the draw repeated a prompt
            seen, unique = set(), []
            for s in out:
                if s["prompt_id"] not in seen:
                    seen.add(s["prompt_id"])
                    unique.append(s)
            out = unique + self.next(n - len(unique))
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.position.epoch, "index": self.position.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = DatasetPosition(int(state["epoch"]), int(state["index"]))
        self._order = self._permutation(self.position.epoch)
