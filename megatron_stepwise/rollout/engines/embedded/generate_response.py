"""The JSON of one /generate answer, as SGLang 0.5.x writes it (`meta_info` and its fields)."""

from __future__ import annotations

from typing import Any, Optional

from megatron_stepwise.rollout.engines.protocol import GenerateResult
from megatron_stepwise.rollout.engines.routed_experts import encode as encode_routed


def finish_reason_json(result: GenerateResult) -> dict[str, Any]:
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.matched}
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.output_ids)}
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def version_spans(versions: list[int]) -> list[dict[str, Any]]:
    """Per-token versions -> SGLang's `meta_info.weight_versions` spans ([start, end))."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def generate_response(
    rid: str,
    prompt_len: int,
    result: GenerateResult,
    return_logprob: bool,
    return_routed_experts: bool = False,
    token_text=None,
    input_token_logprobs: Optional[list] = None,
) -> dict:
    """One prompt's answer; `input_token_logprobs`: its prompt log-prob entries
    (`prompt_logprobs.py`), which SGLang sends, empty when none were asked for, with every
    `return_logprob` answer."""
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": prompt_len,
        "completion_tokens": len(result.output_ids),
        "finish_reason": finish_reason_json(result),
        "weight_version": str(result.weight_version),
        "weight_versions": version_spans(result.token_weight_versions or []),
        "cached_tokens": result.cached_tokens,
    }
    if return_logprob:
        text = token_text or (lambda t: None)  # return_text_in_logprobs: each token's text
        meta["output_token_logprobs"] = [[lp, t, text(t)] for lp, t in zip(result.logprobs, result.output_ids)]
        meta["input_token_logprobs"] = list(input_token_logprobs or [])
    if return_routed_experts:
        # SGLang's contract: positions [0, prompt + output - 1), base64 of int32 [positions, layers, topk]
        routed = result.routed_experts
        meta["routed_experts"] = encode_routed(routed[: max(0, prompt_len + len(result.output_ids) - 1)])
    return {"text": result.text or "", "output_ids": list(result.output_ids), "meta_info": meta}
