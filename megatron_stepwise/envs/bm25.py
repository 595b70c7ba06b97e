"""Okapi BM25 over a small in-memory corpus (enough for a few thousand short documents)."""

from __future__ import annotations

import math
import re
from collections import Counter

_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


class BM25:
    def __init__(self, documents: list[str], k1: float = 1.2, b: float = 0.75):
        self.k1, self.b = k1, b
        self.doc_terms = [Counter(tokenize(d)) for d in documents]
        self.doc_lens = [sum(c.values()) for c in self.doc_terms]
        self.avg_len = sum(self.doc_lens) / max(1, len(self.doc_lens))
        df = Counter(term for terms in self.doc_terms for term in terms)
        n = len(documents)
        # The "+1" inside the log keeps idf positive for terms in more than half the documents.
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def score(self, query: str, index: int) -> float:
        terms, length = self.doc_terms[index], self.doc_lens[index]
        norm = self.k1 * (1 - self.b + self.b * length / self.avg_len)
        total = 0.0
        for t in tokenize(query):
            tf = terms.get(t, 0)
            if tf:
                total += self.idf[t] * tf * (self.k1 + 1) / (tf + norm)
        return total

    def top_k(self, query: str, k: int) -> list[tuple[int, float]]:
        """(document index, score) of the k best documents, best first; ties by index."""
        scored = [(i, self.score(query, i)) for i in range(len(self.doc_terms))]
        scored.sort(key=lambda x: (-x[1], x[0]))
        return scored[:k]
