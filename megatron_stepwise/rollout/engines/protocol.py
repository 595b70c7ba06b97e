"""The rollout engine protocol: token ids in, token ids + per-token log-probs out.

Every engine (an SGLang server behind `SGLangClient`, the embedded CPU `LocalEngine`, a Ray
fleet of either) speaks this protocol, so the agent loop never knows which one it drives.

Log-prob convention (the same as SGLang 0.5.x's default, see `sglang/srt/layers/sampler.py`):
the reported log-prob of a sampled token is `log_softmax(logits / temperature)[token]` over the
FULL vocabulary, i.e. under the temperature-scaled distribution but *before* top-p / top-k
truncation and renormalisation. With temperature 0 (greedy) it is the raw `log_softmax(logits)`.
The trainer does exactly that: `StepwisePlugin(temperature=T)` (the trainer passes
`rollout.sampling.temperature`) scores every trained token as `log_softmax(logits / T)`, and
training refuses T = 0. An engine that reports no log-probs leaves `Step.rollout_logprobs` None
(unknown), never 0. `Engine.score` (a teacher scoring given tokens, on-policy distillation) reports
log-probs under the same convention; an SGLang server scores prompts only at temperature 1.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Mapping, Optional, Protocol, Union, runtime_checkable

import torch

from megatron_stepwise.options import check_options, option, option_problems, problem_of
from megatron_stepwise.steps import MIN_TEMPERATURE, temperature_problem, top_k_problem

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]

FINISH_REASONS = ("stop", "length", "abort")

# What SGLang generates for a request that leaves out `max_new_tokens` (its SamplingParams).
SGLANG_MAX_NEW_TOKENS = 128


class EngineError(RuntimeError):
    """An engine failed to serve a request (dead, unreachable, or it answered with an error)."""


class NoLiveEngine(EngineError):
    """Every engine a router knows is dead (the fleet may be restarting them)."""


class FleetLost(EngineError):
    """Every engine of the fleet is dead and none could be restarted."""


def engine_loss(error: BaseException) -> Optional[EngineError]:
    """The `FleetLost` (else `NoLiveEngine`) inside `error`, through exception groups, Ray task
    errors and causes: the one line a run that lost its engines ends with; None if there is none."""
    found: list[BaseException] = []
    todo, seen = [error], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if type(e) in (FleetLost, NoLiveEngine):  # not Ray's wrappers, whose text is a traceback
            found.append(e)
        todo += list(getattr(e, "exceptions", ()) or ()) + [getattr(e, "cause", None), e.__cause__]
    return next((e for e in found if isinstance(e, FleetLost)), found[0] if found else None)


class EngineReleasedError(EngineError):
    """A request an engine cannot serve while it has released memory (colocated mode): generation
    while its weights or KV cache are released, a weight load while its weights are. Retrying on
    another engine of the same fleet will not help: they are released together."""


# What `release_memory_occupation` / `resume_memory_occupation` act on: SGLang 0.5.23's tags
# (`sglang/srt/constants.py`, GPU_MEMORY_ALL_TYPES); no tags (None or []) means all of them.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


def memory_tags(tags: Optional[Iterable[str]]) -> tuple[str, ...]:
    """The tags a release/resume request acts on, in `MEMORY_TAGS` order; ValueError names an
    unknown one. None or empty = all, as in SGLang."""
    if tags is None or isinstance(tags, str):
        tags = [tags] if isinstance(tags, str) else []
    tags = list(tags)
    unknown = sorted({t for t in tags if t not in MEMORY_TAGS}, key=str)
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; expected some of {list(MEMORY_TAGS)}")
    return tuple(t for t in MEMORY_TAGS if not tags or t in tags)


@dataclass
class SamplingConfig:
    """Sampling parameters of every rollout turn."""

    # The one declaration of the `rollout.sampling` config section (its docstring is that
    # section's text in docs/config.md), next to the per-request `SamplingParams` it builds
    # (`params`). Stricter than a request: training refuses greedy sampling (it divides by T).

    temperature: float = option(
        1.0,
        "sampling temperature T; the trainer scores tokens as log_softmax(logits / T), as the engine does",
        min=MIN_TEMPERATURE,
    )
    top_p: float = option(1.0, "nucleus sampling mass", gt=0.0, max=1.0)
    top_k: int = option(-1, "top-k sampling; -1 = off")
    stop: list[str] = option([], "strings that end a turn (besides the tokenizer's EOS)")

    def __post_init__(self) -> None:
        check_options(self, "rollout.sampling.")

    def problems(self) -> list[tuple[str, str]]:
        """(key, why) per bad setting: the declared bounds, and top_k's rule."""
        out = option_problems(self)
        if _is_int(self.top_k) and top_k_problem(self.top_k):  # a non-integer is the loader's type error
            out.append(("top_k", top_k_problem(self.top_k)))
        return out

    def params(self, max_new_tokens: int) -> "SamplingParams":
        """Every turn's request settings (`rollout.max_new_tokens` gives `max_new_tokens`)."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=max_new_tokens,
            stop=list(self.stop),
        )


@dataclass
class RetryConfig:
    """The `rollout` keys that say when a turn is retried on another engine and how often a dead
    engine is restarted (read by the fleet and the agent workers' `EngineRouter`)."""

    timeout_s: float = option(120.0, "seconds one turn may take on an engine before it is retried", gt=0.0)
    max_retries: int = option(2, "retries of a failed or timed-out turn on another engine", min=0)
    max_restarts: int = option(3, "restarts of each dead engine before the fleet gives it up", min=0)


@dataclass
class SamplingParams:
    """Per-request sampling settings; field names and meaning follow SGLang's `sampling_params`.

    top_k -1 means "no top-k". temperature 0 means greedy. An experiment's requests are built
    by `SamplingConfig.params` (its defaults and bounds); these defaults serve bare requests
    (HTTP, tests) that leave a field out.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # `rollout.max_new_tokens` (declared here, one default for configs and bare requests; a
    # request may ask for 0: prompt log-probs only)
    max_new_tokens: int = option(256, "tokens generated per turn at most", min=1)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    # Seeds this request's sampler (SGLang's `sampling_seed`): the same request with the same
    # weights draws the same tokens whichever engine serves it, so a resumed run repeats.
    sampling_seed: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # lists only: list() of a dict or a string would take its keys or characters in silence
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"sampling_params.{name} must be a list, got {value!r}")
        self.stop = list(self.stop or [])
        bad = [t for t in self.stop_token_ids or [] if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise ValueError(f"sampling_params.stop_token_ids must be integers, got {bad[0]!r}")
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field.

        Types are checked strictly (a JSON `top_k: 2.0` or `temperature: "1"` is refused): these
        values come from HTTP requests, and one that reached the engine's batched sampler would
        fail every request batched with it, not just its own.
        """
        for key, why in (
            ("temperature", temperature_problem(self.temperature, greedy=True)),
            ("top_k", top_k_problem(self.top_k)),
        ):
            if why:
                raise ValueError(f"sampling_params.{key} {why}")
        why = problem_of(SamplingConfig, "top_p", self.top_p) if _is_number(self.top_p) else "must be a number"
        if why:
            raise ValueError(f"sampling_params.top_p {why}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.sampling_seed is not None and not (
            _is_int(self.sampling_seed) and -(2**63) <= self.sampling_seed < 2**63
        ):
            raise ValueError(f"sampling_params.sampling_seed must be a 64-bit integer, got {self.sampling_seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"sampling_params.stop entries must be non-empty strings, got {s!r}")
        for flag in ("no_stop_trim", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"sampling_params.{flag} must be true or false, got {getattr(self, flag)!r}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON `sampling_params` object of SGLang's /generate."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "SamplingParams":
        if d is not None and not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be a JSON object, got {d!r}")
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params: unsupported field(s) {unknown}; supported: {sorted(known)}")
        if d.get("max_new_tokens") is None:
            d["max_new_tokens"] = SGLANG_MAX_NEW_TOKENS  # a wire request means SGLang's default
        if d.get("top_k") is None:
            d.pop("top_k", None)
        if d.get("stop") is None:
            d.pop("stop", None)
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        return cls(**d)


def checked_score_args(input_ids: Iterable[int], start: Any, temperature: Any) -> list[int]:
    """`Engine.score`'s arguments checked (ValueError naming the bad one); the ids as ints."""
    ids = [int(t) for t in input_ids]
    if not (_is_int(start) and 1 <= start < len(ids)):
        raise ValueError(f"start must be an integer with 1 <= start < len(input_ids) = {len(ids)}, got {start!r}")
    why = temperature_problem(temperature, greedy=False)
    if why:
        raise ValueError(f"temperature {why}")
    return ids


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class GenerateResult:
    """What one generation returns.

    `output_ids` are exactly the sampled tokens (a matched stop token is included, as SGLang does);
    `logprobs[i]` is the log-prob of `output_ids[i]` under the convention in the module docstring.
    `finish_reason` is one of "stop", "length", "abort"; `matched` is the stop token id or stop
    string that ended it (None otherwise). `weight_version` is the policy version at the end of the
    generation; `token_weight_versions` (when the engine reports them) gives it per token, which
    differs only if weights were swapped in place mid-generation.
    `routed_experts` (MoE engines asked for them: SGLang's `return_routed_experts`, the embedded
    engine's `record_routed_experts`): int16 [positions, num_hidden_layers, topk], the experts
    each layer's router chose for positions 0, 1, ... of `input_ids + output_ids`, as far as
    the engine ran them (SGLang: all but the last token); -1 where a layer has no router.
    `cached_tokens`: prompt tokens the engine's prefix cache served (SGLang's meta_info field).
    Provenance (the embedded engine; None when an engine does not report it): `token_forwards[i]`
    is the id of the forward pass whose logits gave `output_ids[i]` and its log-prob;
    `route_forwards` (int64, beside `routed_experts`) the id of the forward pass that computed
    each routed position. A trained token at position q pairs with the route at q - 1: both
    come from one forward when `token_forwards` equals `route_forwards[q - 1]`.
    `abort_reason` (finish_reason "abort" only): "pause" when a pause for a weight update ended
    it, "stale" when the staleness bound dropped it, None otherwise.
    """

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int = 0
    token_weight_versions: Optional[list[int]] = None
    matched: Optional[Union[int, str]] = None
    text: Optional[str] = None
    engine: Optional[str] = None
    routed_experts: Optional[torch.Tensor] = None
    cached_tokens: int = 0
    token_forwards: Optional[list[int]] = None
    route_forwards: Optional[torch.Tensor] = None
    abort_reason: Optional[str] = None

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.logprobs):
            raise EngineError(f"engine returned {len(self.output_ids)} tokens but {len(self.logprobs)} log-probs")
        if self.token_weight_versions is None:
            self.token_weight_versions = [self.weight_version] * len(self.output_ids)
        elif len(self.token_weight_versions) != len(self.output_ids):
            raise EngineError(
                f"engine returned {len(self.output_ids)} tokens but {len(self.token_weight_versions)} weight versions"
            )
        if self.token_forwards is not None and len(self.token_forwards) != len(self.output_ids):
            raise EngineError(
                f"engine returned {len(self.output_ids)} tokens but {len(self.token_forwards)} forward ids"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise EngineError(f"unknown finish_reason {self.finish_reason!r}; expected one of {FINISH_REASONS}")


@runtime_checkable
class Engine(Protocol):
    """One inference engine. All methods are coroutines so they can sit behind HTTP or Ray."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: Optional[str] = None, session: Optional[str] = None
    ) -> GenerateResult:
        """`rid` names the request (for abort); `session` names the conversation it belongs to
        (a fleet routes a session's turns to the same engine for prefix-cache reuse)."""

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """Teacher log-probs of given tokens, from one prefill (nothing generated): one float per
        token of `input_ids[start:]`, the log-prob of `input_ids[i]` given `input_ids[:i]` as
        `log_softmax(logits / temperature)` over the full vocabulary (the rollout convention in the
        module docstring). Needs `1 <= start < len(input_ids)` and a temperature training accepts
        (> 0; `checked_score_args`), else ValueError. Caveat: SGLang 0.5.23 computes prompt
        log-probs from the raw logits (its `InputLogprobProcessor`), so `SGLangClient.score` refuses
        any temperature but 1 (`EngineRequestError`): a teacher served by SGLang scores rollouts
        sampled at temperature 1.0 only."""

    async def update_weights_from_disk(
        self, path: str, weight_version: Optional[int] = None, sample_weights: bool = False
    ) -> Union[int, dict]:
        """Load HF-named safetensors from `path`; returns the new weight version. With
        `sample_weights` (only ever passed by a sampled weight sync) it returns the update's
        answer instead: {"engine", "weight_version", "samples": `weight_checks.samples_of` the
        loaded tensors once applied, "sample_s"}, or {"weight_version", "unverified": True,
        "reason"} from an engine that cannot sample (SGLang). Likewise the other two updates."""

    async def update_weights_from_tensors(
        self, named_tensors: NamedTensors, weight_version: Optional[int] = None, sample_weights: bool = False
    ) -> Union[int, dict]:
        """Load tensors keyed by HF parameter names; returns the new weight version."""

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Join a process group whose rank 0 (the trainer) broadcasts weights."""

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: Optional[int] = None,
        sample_weights: bool = False,
    ) -> Union[int, dict]:
        """Receive the named tensors by broadcast from rank 0 of the group; returns the new version."""

    async def pause(self, mode: str = "retract") -> Optional[int]:
        """Stop making progress on generations; after `resume` they continue ("retract": their KV
        recomputed with the weights loaded meanwhile; "in_place": on the KV they had) or, with
        "abort", end now (abort_reason "pause"). Returns how many it aborted, when known."""

    async def resume(self) -> None: ...

    async def flush_cache(self) -> None:
        """Drop cached prefixes (after a weight update they are stale)."""

    async def abort(self, rid: Optional[str] = None) -> None:
        """Abort one request by id, or all when rid is None; they finish with reason "abort"."""

    async def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Colocated mode: free the memory of `tags` ("weights", "kv_cache", "cuda_graph"; None =
        all) so training can use it. Only when idle (no request in flight). While "weights" or
        "kv_cache" is released, `generate` fails with `EngineReleasedError`; while "weights" is,
        so does a weight update. SGLang's order to come back is: resume "weights" -> update the
        weights -> resume "kv_cache" (the update needs the weights' memory, not the cache's)."""

    async def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Take back the memory of `tags` (None = all); each must have been released."""

    async def health(self) -> bool: ...

    async def weight_version(self) -> int: ...

    async def close(self) -> None: ...
