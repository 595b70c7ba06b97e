"""The fields of SGLang's /generate request (`GenerateReqInput`) as the embedded server treats them.

Every field of the pinned SGLang's `GenerateReqInput` (tests/integration/test_sglang_contract.py reads them
from the wheel) is in exactly one table: honoured by the server; a hint or label that cannot
change the result here (ignored, but type-checked); or one the embedded engine cannot carry out
(refused with a 400 naming it when set to anything but SGLang's default, never silently
dropped). `model` is added by sglang-router to every request it forwards. Anything else is
refused by name, so a misspelt field is an error rather than a silent no-op.
"""

from __future__ import annotations

from typing import Any

# Read by rollout/engines/embedded/server.py.
HONOURED = {
    "rid",
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "stream",
    "logprob_start_len",
    "return_text_in_logprobs",
    "return_routed_experts",
    "routed_experts_start_len",
}

# Hints, labels and routing metadata: field -> the JSON type SGLang declares for it.
IGNORED = {
    "model": "str",  # added by sglang-router
    "session_id": "str",
    "log_metrics": "bool",
    "no_logs": "bool",
    "background": "bool",
    "return_bytes": "bool",
    "priority": "int",
    "custom_labels": "dict",
    "extra_key": "str_or_list",
    "cache_salt": "str_or_list",
    "routing_key": "str",
    "conversation_id": "str",
    "routed_dp_rank": "int",
    "data_parallel_rank": "int",
    "disagg_prefill_dp_rank": "int",
    "http_worker_ipc": "str",
    "external_trace_header": "dict",
    "received_time": "number",
    "kv_hints": "any",
    "bootstrap_host": "any",
    "bootstrap_port": "any",
    "bootstrap_room": "any",
    "bootstrap_pair_key": "any",
    "decode_tp_size": "any",
}

# Inputs or outputs the embedded engine does not have (multimodal, LoRA, hidden states, top
# log-probs, sessions...): accepted only at SGLang's default (absent, null, false, 0, empty).
UNSUPPORTED = {
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "mm_hashes",
    "mm_content_hashes",
    "use_audio_in_video",
    "video_config",
    "watermark",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64",
    "return_hidden_states",
    "return_indexer_topk",
    "return_entropy",
    "return_prompt_token_ids",
    "modalities",
    "session_params",
    "lora_path",
    "lora_id",
    "custom_logit_processor",
    "positional_embed_overrides",
    "require_reasoning",
    "max_thinking_tokens",
    "need_wait_for_mm_inputs",
    "num_items_assigned",
    "encoder_urls",
    "max_dynamic_patch",
    "min_dynamic_patch",
    "image_max_dynamic_patch",
    "video_max_dynamic_patch",
    "images_config",
    "mm_processor_kwargs",
    "multi_item_delimiter_indices",
    "token_indices_to_pool",
}

KNOWN = HONOURED | set(IGNORED) | UNSUPPORTED

_TYPES = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "dict": lambda v: isinstance(v, dict),
    "str_or_list": lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "any": lambda v: True,
}


def is_default(value: Any) -> bool:
    """SGLang's default for a field: absent/null, false, 0 or an empty (or all-default) list/dict."""
    if isinstance(value, list):
        return all(is_default(v) for v in value)
    return value is None or value is False or value == 0 or value == {} or value == ""


def check_generate_fields(body: dict) -> None:
    """Raise ValueError naming the first field the embedded engine must refuse."""
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise ValueError(f"/generate: unknown field(s) {unknown} (not in SGLang's GenerateReqInput)")
    for name, kind in IGNORED.items():
        value = body.get(name)
        if value is not None and not _TYPES[kind](value):
            raise ValueError(f"/generate: {name} must be {kind.replace('_', ' ')}, got {value!r}")
    for name in sorted(UNSUPPORTED & set(body)):
        if not is_default(body[name]):
            raise ValueError(f"/generate: {name}={body[name]!r} is not supported by the embedded engine")
