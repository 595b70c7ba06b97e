"""The embedded engine's prefix cache: finished requests' KV, reused by later requests.

A multi-turn trajectory sends each turn's prompt as the previous turn's prompt + response + an
observation (token mode extends it exactly; re-tokenise mode mostly does), so the KV of the
previous turn covers most of the next prompt. When a request finishes, the engine keeps the KV
of every token it ran (prompt + output but the last sampled token, which was never fed back) on
the CPU; a new request prefills only the part after its longest common prefix with a stored
entry. The store is LRU, bounded by a token budget; an entry that a newer one extends is dropped
(a trajectory keeps one entry, its latest turn). Entries hold values computed by one set of
weights: the engine clears the store on every weight load, on `flush_cache` and when its
"kv_cache" memory is released.

The lookup compares the prompt with every entry (one vectorised comparison each): fine for
the few hundred entries an embedded CPU engine holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Entry:
    tokens: torch.Tensor  # int64 [n]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [kv_heads, n, head_dim]
    routed: Optional[torch.Tensor] = None  # int16 [n, layers, topk] when the engine records routed experts
    route_forwards: Optional[torch.Tensor] = None  # int64 [n]: the forward pass that computed each route

    def __len__(self) -> int:
        return int(self.tokens.numel())


class PrefixCache:
    """LRU store of KV entries bounded by `max_tokens` tokens in all (0 disables it)."""

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"prefix cache budget must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.tokens = 0
        self._next = 0
        self.prompt_tokens = 0  # prompt tokens of the requests prefilled (counted once per request)
        self.cached_tokens = 0  # of which served from the cache
        self.evicted_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def lookup(self, ids: list[int], limit: int) -> tuple[Optional[Entry], int]:
        """The entry sharing the longest prefix with `ids` and that prefix's length (at most
        `limit`); (None, 0) when none shares a token. The entry becomes the most recently used."""
        best_key, best = self._longest(ids, limit)
        if best_key is None:
            return None, 0
        self.entries.move_to_end(best_key)
        return self.entries[best_key], best

    def match_length(self, ids: list[int], limit: int) -> int:
        """How many tokens of `ids` (at most `limit`) a lookup would serve; changes nothing."""
        return self._longest(ids, limit)[1]

    def _longest(self, ids: list[int], limit: int) -> tuple[Optional[int], int]:
        if not self.entries or limit <= 0:
            return None, 0
        query = torch.tensor(ids[:limit], dtype=torch.int64)
        best_key, best = None, 0
        for key, e in self.entries.items():
            m = min(len(e), len(query))
            if m <= best or e.tokens[0] != query[0]:
                continue
            n = int((e.tokens[:m] == query[:m]).cumprod(0).sum())
            if n > best:
                best_key, best = key, n
        return best_key, best

    def insert(
        self,
        tokens: list[int],
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        routed: Optional[torch.Tensor] = None,
        route_forwards: Optional[torch.Tensor] = None,
    ) -> None:
        n = len(tokens)
        if not self.enabled or n == 0 or n > self.max_tokens:
            return
        t = torch.tensor(tokens, dtype=torch.int64)
        for key in [k for k, e in self.entries.items() if len(e) <= n and torch.equal(e.tokens, t[: len(e)])]:
            self._drop(key)  # covered by the new entry
        self._next += 1
        self.entries[self._next] = Entry(t, kv, routed, route_forwards)
        self.tokens += n
        while self.tokens > self.max_tokens:
            self.evicted_tokens += len(self.entries[next(iter(self.entries))])
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        self.tokens -= len(self.entries.pop(key))

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def stats(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "entries": len(self.entries),
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.prompt_tokens - self.cached_tokens,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "evicted_tokens": self.evicted_tokens,
        }
