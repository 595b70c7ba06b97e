"""`search`: retrieval QA in the Search-R1 shape over a small shipped corpus.

The model writes `<search>query</search>`; the top-k documents by BM25 come back as the next
user message `<information>Doc 1(Title: ...) text ...</information>`. The episode ends with
`<answer>...</answer>`, rewarded 1 on exact match after normalisation (lowercase, no punctuation,
no articles, collapsed whitespace; as in Search-R1), else 0.
"""

from __future__ import annotations

import re
import string
from functools import lru_cache
from pathlib import Path
from typing import Any

from megatron_stepwise.envs.base import EnvSpec, Message, StepOutput, question_samples, read_jsonl, register_env
from megatron_stepwise.envs.bm25 import BM25

DATA_DIR = Path(__file__).parent / "data"
SYSTEM_PROMPT = (
    "Answer the question. You can search a knowledge base by writing <search>query</search>; "
    "results come back in <information></information>. Give the final answer as <answer>...</answer>."
)
_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


@lru_cache(maxsize=1)
def _corpus() -> tuple[tuple[dict, ...], BM25]:
    docs = read_jsonl(str(DATA_DIR / "search_corpus.jsonl"))
    return docs, BM25([d["title"] + " " + d["text"] for d in docs])


def search(query: str, top_k: int = 3) -> list[dict]:
    docs, index = _corpus()
    return [docs[i] for i, _ in index.top_k(query, top_k)]


class SearchEnv:
    def __init__(self, top_k: int = 3):
        self.top_k = top_k
        self.answer = ""
        self.searches = 0

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        if "question" not in sample or "answer" not in sample:
            raise ValueError(f"search sample {sample.get('prompt_id')!r} needs 'question' and 'answer'")
        self.answer = str(sample["answer"])
        self.searches = 0
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": sample["question"]}]

    def step(self, assistant_text: str) -> StepOutput:
        answer = _ANSWER.search(assistant_text)
        if answer is not None:
            correct = normalize_answer(answer.group(1)) == normalize_answer(self.answer)
            return [], float(correct), True, {"answer": answer.group(1).strip(), "searches": self.searches}
        query = _SEARCH.search(assistant_text)
        if query is not None:
            self.searches += 1
            hits = search(query.group(1), self.top_k)
            body = "\n".join(f"Doc {i + 1}(Title: {d['title']}) {d['text']}" for i, d in enumerate(hits))
            return (
                [{"role": "user", "content": f"<information>{body}</information>"}],
                0.0,
                False,
                {"searches": self.searches},
            )
        hint = "Use <search>query</search> to search or <answer>...</answer> to answer."
        return [{"role": "user", "content": hint}], 0.0, False, {"format_error": True}


def search_dataset(num_prompts: int | None = None, offset: int = 0) -> list[dict]:
    return question_samples(DATA_DIR / "search_questions.jsonl", num_prompts, offset)


register_env(
    EnvSpec(
        name="search",
        factory=SearchEnv,
        dataset=search_dataset,
        tokenizer="tiny_char",
        description="Search-R1-style retrieval QA with BM25 over a shipped corpus; exact-match reward",
    )
)
