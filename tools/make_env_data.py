"""Regenerates the small data sets shipped in megatron_stepwise/envs/data/ (deterministic).

- math_problems.jsonl: 50 arithmetic word problems with integer answers (tool-use math env).
- search_corpus.jsonl: 100 short documents about a fictional world (retrieval env), so a model
  cannot answer from memorised facts and must search.
- search_questions.jsonl: 50 questions answerable from exactly one document.

    python tools/make_env_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "megatron_stepwise" / "envs" / "data"
NAMES = ["Ada", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Juno", "Kofi", "Lena"]


def math_problems(rng: random.Random, n: int = 50) -> list[dict]:
    def p1():
        name, a, b = rng.choice(NAMES), rng.randint(120, 900), rng.randint(40, 700)
        return f"{name} has {a} stamps and buys {b} more. How many stamps does {name} have now?", a + b

    def p2():
        a, b = rng.randint(12, 98), rng.randint(13, 87)
        return f"A crate holds {a} bottles. How many bottles are in {b} crates?", a * b

    def p3():
        name, a = rng.choice(NAMES), rng.randint(500, 2000)
        b = rng.randint(100, a - 1)
        return f"{name} had {a} dollars and spent {b} dollars. How many dollars are left?", a - b

    def p4():
        b, q = rng.randint(3, 24), rng.randint(11, 95)
        return f"{b * q} marbles are shared equally among {b} children. How many marbles does each child get?", q

    def p5():
        a, b, c = rng.randint(40, 140), rng.randint(3, 12), rng.randint(15, 95)
        return (
            f"A train travels {a} km per hour for {b} hours and then {c} km more. How many km did it travel?",
            a * b + c,
        )

    def p6():
        a, b, c = rng.randint(12, 60), rng.randint(7, 30), rng.randint(100, 400)
        return (
            f"A shop sells {a} lamps a day for {b} days, then receives {c} returned lamps. "
            f"What is the net number of lamps sold?"
        ), a * b - c

    makers = [p1, p2, p3, p4, p5, p6]
    out = []
    for i in range(n):
        question, answer = makers[i % len(makers)]()
        out.append({"id": f"math-{i}", "question": question, "answer": str(answer)})
    return out


SYLLABLES = ["ka", "lor", "ven", "mi", "dra", "tho", "sel", "qua", "ri", "bel", "nor", "ash", "ul", "ten", "zo", "fra"]
ANIMALS = ["heron", "lynx", "otter", "ibex", "falcon", "badger", "marten", "crane", "stag", "viper", "owl", "bison"]


def _word(rng: random.Random, used: set, parts: int = 2) -> str:
    while True:
        w = "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()
        if w not in used:
            used.add(w)
            return w


def search_world(rng: random.Random, countries: int = 25) -> tuple[list[dict], list[dict]]:
    used: set = set()
    docs, questions = [], []
    for c in range(countries):
        country = _word(rng, used, 3)
        capital = _word(rng, used, 2)
        river = _word(rng, used, 2)
        founder = f"{rng.choice(NAMES)} {_word(rng, used, 2)}"
        year = rng.randint(1100, 1900)
        animal = rng.choice(ANIMALS)
        facts = [
            (
                "capital",
                f"{country} is a small nation in the northern hills. Its capital city is {capital}, "
                f"known for its stone bridges.",
            ),
            ("river", f"The {river} river rises in the mountains and flows through {country} before reaching the sea."),
            ("founder", f"{country} was founded in the year {year} by {founder}, who united the valley clans."),
            ("animal", f"The national animal of {country} is the {animal}, which appears on its flag."),
        ]
        for kind, text in facts:
            docs.append({"id": f"doc-{len(docs)}", "title": f"{country} ({kind})", "text": text})
        qa = {
            "capital": (f"What is the capital city of {country}?", capital),
            "river": (f"Which river flows through {country}?", river),
            "founder": (f"Who founded {country}?", founder),
            "animal": (f"What is the national animal of {country}?", animal),
        }
        for kind in rng.sample(sorted(qa), 2):
            q, a = qa[kind]
            questions.append(
                {
                    "id": f"search-{len(questions)}",
                    "question": q,
                    "answer": a,
                    "doc_id": f"doc-{len(docs) - 4 + ['capital', 'river', 'founder', 'animal'].index(kind)}",
                }
            )
    return docs, questions


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    write_jsonl(OUT / "math_problems.jsonl", math_problems(random.Random(0)))
    docs, questions = search_world(random.Random(1))
    write_jsonl(OUT / "search_corpus.jsonl", docs)
    write_jsonl(OUT / "search_questions.jsonl", questions)
