"""Real model families as a user's model directory would hold them, and scripted trajectories.

`build_family(name, src, out)` writes a model directory from llama.cpp's real vocabularies and
released chat templates (the folder `STEPWISE_TOKENIZERS_SRC` points at: see the README of the
third-party tokenizers archive): `tokenizer.json` with the instruct model's added tokens at their
ids, `tokenizer_config.json` with its chat template and EOS, and `generation_config.json` with
its `eos_token_id`s. The trainer loads it as any model directory (`model.tokenizer=<dir>`).
Pairings (template -> vocabulary): Qwen2.5 / Qwen3 / Qwen3.5 -> Qwen2's (Qwen3.5 ships a larger
one), Llama-3.1 -> Llama 3's, DeepSeek-R1-Distill-Qwen -> Qwen2's with DeepSeek's tokens (as
that model does), DeepSeek-V3.1 and GLM-4.6 -> Qwen2's with their own special tokens.

`trajectories(family, tokenizer, n, seed)` scripts `n` multi-turn trajectories (seeded): tool
calls in the family's format, tool results (one or several, empty ones), user follow-ups,
`<think>` blocks, endings on the end-of-turn token / a stop string / the length limit, and
non-canonical token ids (a token split in two, as a sampling model may produce).

    python tools/chat_families.py OUT_DIR     # writes every family's directory
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams

QWEN25_ADDED = {  # Qwen2.5's tokenizer_config (id: (token, special))
    151646: ("<|object_ref_start|>", True),
    151647: ("<|object_ref_end|>", True),
    151648: ("<|box_start|>", True),
    151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True),
    151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True),
    151653: ("<|vision_end|>", True),
    151654: ("<|vision_pad|>", True),
    151655: ("<|image_pad|>", True),
    151656: ("<|video_pad|>", True),
    151657: ("<tool_call>", False),
    151658: ("</tool_call>", False),
    151659: ("<|fim_prefix|>", False),
    151660: ("<|fim_middle|>", False),
    151661: ("<|fim_suffix|>", False),
    151662: ("<|fim_pad|>", False),
    151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False),
}
QWEN3_ADDED = {
    **QWEN25_ADDED,
    151665: ("<tool_response>", False),
    151666: ("</tool_response>", False),
    151667: ("<think>", False),
    151668: ("</think>", False),
}
DEEPSEEK_ADDED = {  # DeepSeek-R1-Distill-Qwen renames Qwen's first special tokens
    151643: ("<｜end▁of▁sentence｜>", True),
    151644: ("<｜User｜>", False),
    151645: ("<｜Assistant｜>", False),
    151646: ("<｜begin▁of▁sentence｜>", True),
    151647: ("<|EOT|>", False),
    151648: ("<think>", False),
    151649: ("</think>", False),
    151657: ("<｜tool▁calls▁begin｜>", False),
    151658: ("<｜tool▁calls▁end｜>", False),
    151659: ("<｜tool▁call▁begin｜>", False),
    151660: ("<｜tool▁call▁end｜>", False),
    151661: ("<｜tool▁outputs▁begin｜>", False),
    151662: ("<｜tool▁outputs▁end｜>", False),
    151663: ("<｜tool▁output▁begin｜>", False),
    151664: ("<｜tool▁output▁end｜>", False),
    151665: ("<｜tool▁sep｜>", False),
}
GLM_ADDED = {  # GLM-4.6's special tokens, on Qwen2's free slots
    151646: ("[gMASK]", True),
    151647: ("<sop>", True),
    151648: ("<|system|>", True),
    151649: ("<|user|>", True),
    151650: ("<|assistant|>", True),
    151651: ("<|observation|>", True),
    151652: ("<think>", False),
    151653: ("</think>", False),
    151654: ("<tool_call>", False),
    151655: ("</tool_call>", False),
    151656: ("<arg_key>", False),
    151657: ("</arg_key>", False),
    151658: ("<arg_value>", False),
    151659: ("</arg_value>", False),
    151660: ("<tool_response>", False),
    151661: ("</tool_response>", False),
}
LLAMA31_ADDED = {128008: ("<|eom_id|>", True), 128010: ("<|python_tag|>", True)}


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # file under templates/
    vocab: str  # folder under hf/
    added: dict = field(default_factory=dict)
    eos_token: str = ""
    bos_token: Optional[str] = None
    generation_eos: tuple = ()  # generation_config.json eos_token_id
    tool_format: str = "hermes"  # how the model writes a tool call (scripted replies)
    thinks: bool = False  # replies may open with a <think> block
    think_block: str = "<think>\n{}\n</think>\n\n"  # how a reply opens with its reasoning
    always_thinks: bool = False  # every reply opens with the block (GLM: an empty one without reasoning)


FAMILIES = {
    f.name: f
    for f in [
        Family(
            "qwen2.5-instruct",
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            "qwen2",
            QWEN25_ADDED,
            "<|im_end|>",
            generation_eos=(151645, 151643),
        ),
        Family(
            "qwen3",
            "Qwen-Qwen3-0.6B.jinja",
            "qwen2",
            QWEN3_ADDED,
            "<|im_end|>",
            generation_eos=(151645, 151643),
            thinks=True,
        ),
        Family(
            "qwen3.5",
            "Qwen3.5-4B.jinja",
            "qwen2",
            QWEN3_ADDED,
            "<|im_end|>",
            generation_eos=(151645, 151643),
            tool_format="qwen_xml",
            thinks=True,
        ),
        Family(
            "llama-3.1-instruct",
            "meta-llama-Llama-3.1-8B-Instruct.jinja",
            "llama-bpe",
            LLAMA31_ADDED,
            "<|eot_id|>",
            "<|begin_of_text|>",
            (128001, 128008, 128009),
            tool_format="llama_json",
        ),
        Family(
            "deepseek-r1-distill-qwen",
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
            "qwen2",
            DEEPSEEK_ADDED,
            "<｜end▁of▁sentence｜>",
            "<｜begin▁of▁sentence｜>",
            (151643,),
            tool_format="hermes",
            thinks=True,
        ),
        Family(
            "deepseek-v3.1",
            "deepseek-ai-DeepSeek-V3.1.jinja",
            "qwen2",
            DEEPSEEK_ADDED,
            "<｜end▁of▁sentence｜>",
            "<｜begin▁of▁sentence｜>",
            (151643,),
            tool_format="deepseek",
            thinks=True,
        ),
        Family(
            "glm-4.6",
            "GLM-4.6.jinja",
            "qwen2",
            GLM_ADDED,
            "<|endoftext|>",
            None,
            (151643, 151649, 151651),
            tool_format="glm",
            thinks=True,
            think_block="\n<think>{}</think>\n",
            always_thinks=True,
        ),
    ]
}


def build_family(name: str, src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write family `name`'s model directory under `out` (see the module docstring)."""
    fam, src, out = FAMILIES[name], Path(src), Path(out) / name
    out.mkdir(parents=True, exist_ok=True)
    tok = json.loads((src / "hf" / fam.vocab / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = {t["id"]: t for t in tok["added_tokens"]}
    vocab = tok["model"]["vocab"]
    for i, (content, special) in fam.added.items():
        entry = by_id[i]
        if entry["content"] in vocab:
            del vocab[entry["content"]]
        vocab[content] = i
        entry.update(content=content, special=special)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": fam.eos_token,
        "bos_token": fam.bos_token,
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": (src / "templates" / fam.template).read_text(encoding="utf-8"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": list(fam.generation_eos)}))
    return out


# ---- scripted trajectories ------------------------------------------------------------------

WORDS = (
    "the answer is 42 let me check the weather in Paris first compute sum of squares "
    "données café naïve 東京 😀 x=3.5 def f(): return [1, 2] ok done"
).split()
TOOLS = ["search", "python", "get_weather"]


@dataclass
class Turn:
    """One scripted assistant turn and the environment's answer to it."""

    text: str  # what the model writes (before any cut)
    ending: str  # "eot" (samples the end-of-turn token), "stop_string", "length"
    noncanonical: bool  # the sampled ids split one token in two
    observation: list  # messages the environment answers with ([] on the last turn)
    stop: Optional[str] = None  # the stop string matched ("stop_string" endings)


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def tool_call_text(fam: Family, name: str, args: dict) -> str:
    """A tool call written the way the family's model writes one."""
    if fam.tool_format == "llama_json":
        return json.dumps({"name": name, "parameters": args})
    if fam.tool_format == "qwen_xml":
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if fam.tool_format == "glm":
        params = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
        return f"<tool_call>{name}\n{params}</tool_call>"
    if fam.tool_format == "deepseek":
        return f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args)}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def generation_prompt_thinks(tokenizer: Any) -> Optional[bool]:
    """True when the template's generation prompt opens a reasoning block (`<think>\n`: the model
    continues inside it), False when it opens and closes one (no reasoning), else None."""
    chat = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True).rstrip("\n")
    return True if prompt.endswith("<think>") else False if prompt.endswith("</think>") else None


def trajectory(
    fam: Family, rng: random.Random, noncanonical_share: float = 0.3, prompt_thinks: Optional[bool] = None
) -> tuple[list[dict], list[Turn]]:
    """(the first messages, the scripted turns) of one trajectory; `prompt_thinks` as
    `generation_prompt_thinks` (a model whose prompt opens the reasoning block writes its end)."""
    messages = [{"role": "system", "content": "You are a helpful agent."}] if rng.random() < 0.5 else []
    messages.append({"role": "user", "content": _phrase(rng, rng.randint(3, 12))})
    turns = []
    n = rng.randint(1, 4)
    for k in range(n):
        reasoning = _phrase(rng, rng.randint(2, 10))
        if prompt_thinks:
            think = f"{reasoning}\n</think>\n\n"
        elif prompt_thinks is None and fam.thinks and (fam.always_thinks or rng.random() < 0.5):
            think = fam.think_block.format(reasoning if rng.random() < 0.5 else "")
        else:
            think = ""
        calls = k + 1 < n and rng.random() < 0.7
        body = (
            tool_call_text(fam, rng.choice(TOOLS), {"q": _phrase(rng, rng.randint(1, 4))})
            if calls
            else _phrase(rng, rng.randint(1, 15))
        )
        if calls and rng.random() < 0.3:
            body = _phrase(rng, 3) + "\n" + body
        ending = rng.choices(["eot", "stop_string", "length"], weights=[6, 2, 2])[0]
        stop = None
        if ending == "stop_string":
            stop = "</tool_call>" if calls and "</tool_call>" in body else "."
            body = body if stop != "." else body + "."
        observation: list = []
        if k + 1 < n:
            if calls or rng.random() < 0.5:
                observation = [
                    {"role": "tool", "content": "" if rng.random() < 0.2 else _phrase(rng, rng.randint(1, 8))}
                    for _ in range(rng.choice([1, 1, 2, 3]))
                ]
            else:
                observation = [{"role": "user", "content": _phrase(rng, rng.randint(1, 6))}]
        turns.append(Turn(think + body, ending, rng.random() < noncanonical_share, observation, stop))
    return messages, turns


def sampled_ids(tokenizer: Any, turn: Turn, rng: random.Random, end_ids: list[int]) -> tuple[list[int], str]:
    """(the ids the scripted model samples for `turn`, the finish reason an engine reports)."""
    ids = list(tokenizer(turn.text, add_special_tokens=False)["input_ids"])
    if turn.noncanonical:
        ids = split_one_token(tokenizer, ids, rng)
    if turn.ending == "length":
        return ids[: max(1, rng.randint(len(ids) // 2, max(1, len(ids) - 1)))], "length"
    if turn.ending == "stop_string":
        return ids, "stop"  # the stop string is kept (no_stop_trim), no end-of-turn token
    return ids + [end_ids[0]], "stop"


_VOCABS: dict[int, tuple[dict, set]] = {}


def _vocab(tokenizer: Any) -> tuple[dict, set]:
    """(token -> id, the added and special ids), once per tokenizer (get_vocab takes ~0.5 s)."""
    if id(tokenizer) not in _VOCABS:
        _VOCABS[id(tokenizer)] = (
            tokenizer.get_vocab(),
            set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder),
        )
    return _VOCABS[id(tokenizer)]


def split_one_token(tokenizer: Any, ids: list[int], rng: random.Random) -> list[int]:
    """`ids` with one multi-byte token replaced by two tokens of the vocabulary that spell it."""
    vocab, special = _vocab(tokenizer)
    order = list(range(len(ids)))
    rng.shuffle(order)
    for i in order:
        if ids[i] in special:
            continue
        piece = tokenizer.convert_ids_to_tokens(ids[i])
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in vocab and b in vocab:
                return ids[:i] + [vocab[a], vocab[b]] + ids[i + 1 :]
    return ids


class Scripted:
    """The engine and the environment of scripted trajectories: turn k of trajectory i samples
    `ids[i][k]` and the environment answers `turns[i][k].observation`."""

    def __init__(self, tokenizer, fam, eot, n, seed=0, noncanonical_share=0.3):
        rng = random.Random(f"{seed}/{fam.name}")
        self.first, self.turns, self.ids = [], [], []
        thinks = generation_prompt_thinks(tokenizer)
        for _ in range(n):
            messages, turns = trajectory(fam, rng, noncanonical_share, thinks)
            self.first.append(messages)
            self.turns.append(turns)
            self.ids.append([sampled_ids(tokenizer, t, rng, list(eot.ids)) for t in turns])

    async def generate(self, input_ids, sampling, rid=None, session=None):
        i, k = _where(rid)
        ids, reason = self.ids[i][k]
        return GenerateResult(list(ids), [-1.0] * len(ids), reason, weight_version=0)

    def env(self):
        script = self

        class Env:
            def reset(self, sample):
                self.i, self.k = int(sample["prompt_id"]), 0
                return list(script.first[self.i])

            def step(self, text):
                turns = script.turns[self.i]
                obs = turns[self.k].observation
                self.k += 1
                return list(obs), 0.0, self.k == len(turns), {}

        return Env()


def _where(rid: str) -> tuple[int, int]:
    traj, turn = rid.split("/turn")  # "<prompt_id>#<sample>/turn<k>"
    return int(traj.split("#")[0]), int(turn)


def run_loop(tokenizer, script, eot, context):
    """Steps of every scripted trajectory through the real AgentLoop, by trajectory index."""
    cfg = AgentLoopConfig(
        max_turns=4,
        context=context,
        max_input_length=1 << 20,
        drift_sample_rate=1.0,
        n_samples_per_prompt=1,
        sampling=SamplingParams(max_new_tokens=4096),
        append_eos=eot.append is not None,
        env_timeout_s=120.0,
    )
    ids = list(eot.ids) if eot.append is None else [eot.append] + [i for i in eot.ids if i != eot.append]
    loop = AgentLoop(script, tokenizer, script.env, cfg, eos_token_ids=ids)
    try:
        steps = asyncio.run(loop.rollout([{"prompt_id": str(i)} for i in range(len(script.turns))]))
    finally:
        loop.close()
    by_traj: dict[int, list] = {}
    for s in steps:
        by_traj.setdefault(int(s.trajectory_id.prompt_id), []).append(s)
    return by_traj


if __name__ == "__main__":
    src = os.environ.get("STEPWISE_TOKENIZERS_SRC")
    if len(sys.argv) != 2 or not src:
        sys.exit(
            "usage: STEPWISE_TOKENIZERS_SRC=<extracted llama.cpp-tokenizers> python tools/chat_families.py OUT_DIR"
        )
    for family in FAMILIES:
        print(build_family(family, src, sys.argv[1]))
