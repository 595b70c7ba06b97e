"""`calculator`: short word problems solved with a calculator tag, over several turns.

Made for small pretrained chat models (the laptop recipe, configs/smollm2_math_cpu.yaml): the
model writes `<calc>expression</calc>`, the environment answers `Result: N` in the next user
message, and the episode ends when the model writes `<answer>N</answer>` (reward 1 if N is the
problem's answer, else 0) or runs out of turns. A turn with neither tag gets a hint. The
expression is evaluated by a small arithmetic evaluator (numbers, + - * /, parentheses), never
by Python's eval. The opening messages hold one worked example, so a model that follows
instructions uses the tags from the start; what it must learn is which expression a problem needs.

Problems are drawn from six templates with two numbers each (sums, differences, products,
sharing); the held-out evaluation set (`eval_dataset`) has its own seed and no training set holds
any of its questions.
"""

from __future__ import annotations

import ast
import operator
import random
import re
import zlib
from typing import Any

from megatron_stepwise.envs.base import EnvSpec, Message, StepOutput, register_env

SYSTEM_PROMPT = (
    "Solve the problem. To compute, write <calc>expression</calc> and you will get the result. "
    "Then give the final answer as <answer>number</answer>."
)
EXAMPLE: list[Message] = [
    {"role": "user", "content": "A box holds 12 eggs. How many eggs are in 7 boxes?"},
    {"role": "assistant", "content": "<calc>12 * 7</calc>"},
    {"role": "user", "content": "Result: 84"},
    {"role": "assistant", "content": "<answer>84</answer>"},
]
# `vary_example`: the worked example is one of these, by the question, so no operation is the example's.
EXAMPLES: list[list[Message]] = [
    EXAMPLE,
    [
        {"role": "user", "content": "Sam has 45 stamps and gets 28 more. How many stamps does he have?"},
        {"role": "assistant", "content": "<calc>45 + 28</calc>"},
        {"role": "user", "content": "Result: 73"},
        {"role": "assistant", "content": "<answer>73</answer>"},
    ],
    [
        {"role": "user", "content": "A tank holds 90 liters. 34 liters are used. How many liters are left?"},
        {"role": "assistant", "content": "<calc>90 - 34</calc>"},
        {"role": "user", "content": "Result: 56"},
        {"role": "assistant", "content": "<answer>56</answer>"},
    ],
]
HINT = "Write <calc>expression</calc> to compute, or give the final answer as <answer>number</answer>."
_CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION_CHARS = 200


def _apples(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(11, 80), r.randint(11, 80)
    return f"Tom has {a} apples and buys {b} more. How many apples does he have now?", a + b


def _pens(r: random.Random) -> tuple[str, int]:
    a, c = r.randint(3, 19), r.randint(3, 19)
    return f"A pen costs {c} dollars. How many dollars do {a} pens cost?", a * c


def _marbles(r: random.Random) -> tuple[str, int]:
    a, c = r.randint(12, 40), r.randint(3, 9)
    return f"Each of {c} jars holds {a} marbles. How many marbles are there in all?", a * c


def _train(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(120, 400), r.randint(20, 110)
    return f"A train has gone {b} km of a {a} km trip. How many km are left?", a - b


def _cookies(r: random.Random) -> tuple[str, int]:
    each, c = r.randint(3, 15), r.randint(3, 12)
    return f"{each * c} cookies are shared equally among {c} children. How many cookies does each child get?", each


def _shelf(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(30, 99), r.randint(2, 29)
    return f"A shelf has {a} books. {b} books are taken away. How many books are on it now?", a - b


PROBLEMS = (_apples, _pens, _marbles, _train, _cookies, _shelf)


def _number(text: str) -> float | None:
    try:
        return float(text.strip().replace(",", ""))
    except ValueError:
        return None


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression (numbers, + - * /, unary minus, parentheses)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    return value(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval").body)


def _format(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.4g}"


class CalculatorEnv:
    def __init__(self, worked_example: bool = True, vary_example: bool = False):
        self.worked_example = worked_example
        self.vary_example = vary_example
        self.answer = 0.0
        self.calls = 0

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        if "question" not in sample or "answer" not in sample:
            raise ValueError(f"calculator sample {sample.get('prompt_id')!r} needs 'question' and 'answer'")
        self.answer, self.calls = float(sample["answer"]), 0
        example = EXAMPLE if self.worked_example else []
        if self.worked_example and self.vary_example:  # the same example for a question every time
            example = EXAMPLES[zlib.crc32(sample["question"].encode()) % len(EXAMPLES)]
        return [{"role": "system", "content": SYSTEM_PROMPT}, *example, {"role": "user", "content": sample["question"]}]

    def step(self, assistant_text: str) -> StepOutput:
        answer = _ANSWER.search(assistant_text)
        if answer is not None:
            given = _number(answer.group(1))
            correct = given is not None and abs(given - self.answer) < 1e-6
            return [], float(correct), True, {"answer": answer.group(1).strip(), "calls": self.calls}
        calc = _CALC.search(assistant_text)
        if calc is None:
            return [{"role": "user", "content": HINT}], 0.0, False, {"format_error": True, "calls": self.calls}
        self.calls += 1
        try:
            result = f"Result: {_format(evaluate(calc.group(1).split('=')[0]))}"  # "12 * 7 = 84": the left side
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError, RecursionError) as e:
            result = f"Error: {e}" if str(e) else "Error: not an arithmetic expression"
        return [{"role": "user", "content": result}], 0.0, False, {"calls": self.calls}


def _problems(num_prompts: int, seed: int, exclude: frozenset = frozenset()) -> list[dict[str, Any]]:
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < num_prompts:
        question, answer = PROBLEMS[rng.randrange(len(PROBLEMS))](rng)
        if question not in seen:  # no duplicates, and nothing of the held-out set
            seen.add(question)
            out.append({"prompt_id": f"calc-{seed}-{len(out)}", "question": question, "answer": answer})
    return out


EVAL_SEED = -1  # the held-out set's own seed


def calculator_eval_dataset(num_prompts: int = 64, **_: Any) -> list[dict[str, Any]]:
    """The fixed held-out set: the same at every evaluation and every run, never trained on."""
    return _problems(num_prompts, EVAL_SEED)


def calculator_dataset(num_prompts: int = 2048, seed: int = 0) -> list[dict[str, Any]]:
    """Procedurally generated training problems (deterministic per seed), none of the held-out set."""
    if seed == EVAL_SEED:
        raise ValueError(f"calculator: seed {EVAL_SEED} is the held-out set's")
    held_out = frozenset(p["question"] for p in calculator_eval_dataset(256))
    return _problems(num_prompts, seed, held_out)


register_env(
    EnvSpec(
        name="calculator",
        factory=CalculatorEnv,
        dataset=calculator_dataset,
        eval_dataset=calculator_eval_dataset,
        tokenizer=None,
        description="word problems with a <calc> tag and an <answer> tag; made for small pretrained chat models",
        required_fields=("question", "answer"),
    )
)
