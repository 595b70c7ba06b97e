"""A dumped iteration -> the viewer's JSON -> one self-contained HTML page."""

from __future__ import annotations

import json
import logging
import math
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_stepwise.loop.dumps import read_dump
from megatron_stepwise.metrics.core import read_metrics

log = logging.getLogger(__name__)

# roles of a token: prompt or observation (context), trained, an EOS appended with loss 0,
# and context inside a merged row's response (observations and chat glue between turns)
PROMPT, TRAINED, APPENDED_EOS, CONTEXT = "p", "t", "e", "o"
CURVES = {
    "reward": "reward/mean",
    "eval reward": "eval/reward/mean",
    "response length": "rollout/response_len_mean",
    "turns": "rollout/turns_mean",
}


def _decoder(config: dict) -> tuple[Callable[[int], str], set[int]]:
    """Token id -> its text with the run's tokenizer, and the EOS ids; ids alone when it cannot load."""
    try:
        from megatron_stepwise.config import config_from_dict
        from megatron_stepwise.loop import components

        tok = components.load_tokenizer(config_from_dict(config, world_size=1))
    except Exception as e:  # the page is still useful with ids only; say why once
        log.warning("viewer: showing token ids (the run's tokenizer did not load: %s)", e)
        return (lambda i: f"<{i}>"), set()
    cache: dict[int, str] = {}

    def decode(i: int) -> str:
        if i not in cache:
            cache[i] = tok.decode([i])
        return cache[i]

    eos = {tok.eos_token_id} if getattr(tok, "eos_token_id", None) is not None else set()
    return decode, eos


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _response_roles(ids: list[int], mask: list[int], eos: set[int]) -> list[str]:
    roles = []
    for k, (i, m) in enumerate(zip(ids, mask)):
        if m:
            roles.append(TRAINED)
        elif i in eos and k > 0 and mask[k - 1]:  # right after sampled tokens: the EOS added after the fact
            roles.append(APPENDED_EOS)
        elif i in eos and k == len(ids) - 1 and not any(mask[k + 1 :]):
            roles.append(APPENDED_EOS)
        else:
            roles.append(CONTEXT)
    return roles


def _round(x: Optional[float], digits: int = 5) -> Optional[float]:
    return None if x is None else round(float(x), digits)


def build_data(run_dir: str | Path, iteration: Optional[int] = None) -> dict[str, Any]:
    """The page's data: trajectories of the dumped iteration with their turns and tokens, and curves."""
    dump = read_dump(run_dir, iteration)
    decode, eos = _decoder(dump.meta.get("config") or {})
    rows = dump.table.to_pylist()
    by_traj: dict[tuple, list[dict]] = {}
    for r in rows:
        if not r["is_padding"]:
            by_traj.setdefault((r["prompt_id"], r["sample_index"]), []).append(r)
    trajectories = []
    for (pid, sample), turns_rows in by_traj.items():
        turns_rows.sort(key=lambda r: (r["turn"] if r["turn"] is not None else 0, r["minibatch"], r["row"]))
        turns, previous, gaps = [], [], []
        for r in turns_rows:
            prompt = r["prompt_ids"]
            start = _common_prefix(previous, prompt)
            resp, mask = r["response_ids"], r["loss_mask"]
            lps, known = r["rollout_logprobs"], r["rollout_logprobs_known"]
            tlps, advs = r["trainer_logprobs"] or [None] * len(resp), r["advantages"] or [0.0] * len(resp)
            response = []
            for k, role in enumerate(_response_roles(resp, mask, eos)):
                lp = lps[k] if known[k] else None
                gap = abs(lp - tlps[k]) if role == TRAINED and lp is not None and tlps[k] is not None else None
                if gap is not None:
                    gaps.append(gap)
                response.append(
                    [
                        decode(resp[k]),
                        role,
                        resp[k],
                        _round(advs[k]),
                        _round(lp),
                        _round(tlps[k]),
                        None if gap is None else float(f"{gap:.3g}"),
                    ]
                )
            turns.append(
                {
                    "turn": r["turn"],
                    "reward": r["reward"],
                    "stop_reason": r["stop_reason"],
                    "env_error": r["env_error"],
                    # a context that does not extend the previous turn's (re-tokenised history) starts earlier
                    "history_kept": start == len(previous),
                    "delta_from": start,
                    "delta": [[decode(i), PROMPT, i] for i in prompt[start:]],
                    "response": response,
                }
            )
            previous = prompt + resp
        last = turns_rows[-1]
        trajectories.append(
            {
                "id": f"{pid}#{sample}",
                "prompt_id": pid,
                "outcome_reward": last["outcome_reward"],
                "stop_reason": last["stop_reason"],
                "env_error": next((t["env_error"] for t in turns if t["env_error"]), None),
                "length": sum(len(r["response_ids"]) for r in turns_rows),
                "turns": turns,
                "max_gap": max(gaps) if gaps else None,
            }
        )
    metrics = read_metrics(str(run_dir)) if (Path(run_dir) / "metrics.jsonl").is_file() else []
    curves = {
        name: [[m["iteration"], m[key]] for m in metrics if isinstance(m.get(key), (int, float))]
        for name, key in CURVES.items()
    }
    return {
        "run_dir": str(run_dir),
        "iteration": dump.iteration,
        "weight_version": dump.meta.get("weight_version"),
        "name": (dump.meta.get("config") or {}).get("name"),
        "trajectories": trajectories,
        "curves": {k: v for k, v in curves.items() if v},
        "train_metrics": dump.meta.get("train_metrics") or [],
    }


def _finite(value: Any) -> Any:
    """NaN and infinities as null (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def render(data: dict[str, Any]) -> str:
    """One HTML file: the template with the data inlined (no server, no network)."""
    template = resources.files("megatron_stepwise.viewer").joinpath("template.html").read_text(encoding="utf-8")
    # "</" inside a <script> would end it early
    payload = json.dumps(_finite(data), separators=(",", ":"), allow_nan=False, default=str).replace("</", "<\\/")
    return template.replace("/*__DATA__*/null", payload, 1)


def write_page(run_dir: str | Path, iteration: Optional[int], out: Optional[str | Path] = None) -> Path:
    data = build_data(run_dir, iteration)
    path = Path(out) if out else Path(run_dir) / "view" / f"iter_{data['iteration']:07d}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(data), encoding="utf-8")
    return path
