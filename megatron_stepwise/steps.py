"""The step-wise data model: one `Step` per turn of a multi-turn trajectory.

Steps are the public currency between the rollout side (which emits them) and the
training side (which consumes them). Token fields are stored as 1-D torch tensors so the
heavy paths never loop over tokens in Python; `StepBatch` is the columnar form (flat token
tensors + row offsets) those paths work on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from megatron_stepwise.errors import UserError
from megatron_stepwise.step_structure import step_structure

TokenSeq = Union[Sequence[int], torch.Tensor]
FloatSeq = Union[Sequence[float], torch.Tensor]

PAD_PROMPT_PREFIX = "__pad__"

#: `Step.metadata` key of an invalid trajectory's last step: why it is invalid (see `Step`).
INVALID = "invalid"

#: `Step.metadata` key of a gateway call: True when its prompt does not extend the previous call's
#: (the agent dropped, summarised or edited its context), so it was rendered fresh.
PREFIX_BREAK = "prefix_break"

# The smallest non-zero sampling temperature: below it `logits / T` overflows (1e-300 gives inf,
# then NaN probabilities). SGLang itself treats T < 1e-6 as greedy.
MIN_TEMPERATURE = 1e-4


def temperature_problem(value: Any, *, greedy: bool) -> Optional[str]:
    """Why `value` is no sampling temperature, or None: a finite T >= MIN_TEMPERATURE, or 0
    (greedy) where `greedy` allows it. Training scores log_softmax(logits / T), so never 0 there."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value >= MIN_TEMPERATURE or (greedy and value == 0)):
        return None
    return f"must be {'0 (greedy) or ' if greedy else ''}a finite number >= {MIN_TEMPERATURE} (got {value!r})"


def top_k_problem(value: Any) -> Optional[str]:
    """Why `value` is no top-k, or None: -1 (off) or >= 1, SGLang's rule."""
    if isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value >= 1):
        return None
    return f"must be -1 (off) or >= 1 (got {value!r})"


class StepwiseBatchError(UserError, ValueError):
    """A malformed step-wise batch. The message names the step index and the field."""


@dataclass(frozen=True, order=True)
class TrajectoryID:
    """Identifies one sampled trajectory: the prompt it answers and which sample it is."""

    prompt_id: str
    sample_index: int

    def __str__(self) -> str:
        return f"{self.prompt_id}#{self.sample_index}"


def _as_tensor(value: Any, dtype: torch.dtype, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dtype != dtype:
            t = t.to(dtype)
    else:
        try:
            t = torch.tensor(list(value), dtype=dtype)
        except (TypeError, ValueError, RuntimeError) as e:
            raise StepwiseBatchError(f"field {name!r}: cannot convert to a {dtype} tensor: {e}") from None
    if t.dim() != 1:
        raise StepwiseBatchError(f"field {name!r}: expected a 1-D sequence, got shape {tuple(t.shape)}")
    return t


#: dtype of `Step.routed_experts` (expert ids < 32768; -1 = not reported by the engine).
ROUTED_EXPERTS_DTYPE = torch.int16
UNKNOWN_EXPERT = -1


def _as_routed_experts(value: Any) -> torch.Tensor:
    """`routed_experts` as an int16 [tokens, layers, topk] tensor."""
    t = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.dim() != 3:
        raise StepwiseBatchError(
            f"field 'routed_experts': expected a [tokens, layers, topk] tensor, got shape {tuple(t.shape)}"
        )
    if t.is_floating_point() or t.dtype == torch.bool:
        raise StepwiseBatchError(f"field 'routed_experts': expected integer expert ids, got {t.dtype}")
    if t.numel() and (int(t.max()) > torch.iinfo(ROUTED_EXPERTS_DTYPE).max or int(t.min()) < UNKNOWN_EXPERT):
        raise StepwiseBatchError("field 'routed_experts': expert ids must be in [-1, 32767] (-1 = unknown)")
    return t.to(ROUTED_EXPERTS_DTYPE)


@dataclass
class Step:
    """One turn of a trajectory, as one training sample.

    - `prompt_ids`: the prompt the engine received for this turn: the chat so far with the
      generation prompt, re-tokenised or extended from the sampled ids (`rollout.context`).
    - `response_ids`: only the tokens generated in this turn (observations go to the next prompt).
    - `loss_mask`: 1 on tokens the engine sampled, 0 elsewhere (e.g. an EOS appended after the fact).
    - `rollout_logprobs`: the engine's log-prob of each response token, `log_softmax(logits / T)`
      at the sampling temperature T; None when the engine reported none (unknown, never 0).
    - `reward`: the trajectory's outcome reward is the reward of its last step.
    - `turn_reward`: the reward the environment gave for this turn alone (0 if it gives none).
      Turn-level estimators (docs/credit.md) credit each turn with the rewards from it on; the
      outcome stays the total, so the last turn's own share is taken as `reward` minus the
      turn rewards of the earlier steps.
    - `weight_versions`: per response token, the policy weight version that produced it (optional).
    - `routed_experts`: MoE routing replay (optional): int16 [len(prompt) + len(response),
      num_hidden_layers, topk], the experts the engine's router chose for every token of the
      row in each decoder layer (SGLang's layout), -1 where the engine did not report them (e.g.
      the last sampled token, which the engine never runs through the model).
    - `route_forwards` / `logprob_forwards`: provenance (optional, the embedded engine reports
      it): per prompt + response position, the id of the engine's forward pass that computed its
      route; per response token, the id of the forward pass whose logits gave its log-prob; -1
      unknown (an appended EOS, a position not run). A sampled token at row position q pairs
      with the route at q - 1: `algo/route_pairing.py` checks that they come from one forward.
    - `teacher_logprobs`: on-policy distillation (optional): per response token, the teacher's
      log-prob of it given exactly the context this step's prompt and earlier response tokens
      gave the policy, `log_softmax(teacher_logits / T)` at the rollout temperature T
      (rollout/teacher.py). None where no teacher scored the step.
    - `is_padding`: a loss-neutral row that fills a batch to a DP multiple (`make_padding_step`);
      it never enters advantages, metrics or loss denominators.
    - `metadata["invalid"]` (on the last step): why the trajectory is invalid, an infrastructure
      failure rather than a wrong answer (an environment crash or timeout, an aborted request, an
      environment's own `info["invalid"]`). Its reward means nothing: it is never trained and
      stays out of group means and stds, reward metrics and pass@k, but it is kept, counted and
      dumped (`invalid_reason`).

    >>> turn = Step(TrajectoryID("q7", 0), prompt_ids=[1, 2, 3], response_ids=[4, 5], loss_mask=[1, 1],
    ...             rollout_logprobs=[-0.1, -0.7], reward=1.0, is_last_step=True)
    >>> turn.num_tokens, turn.num_trainable, str(turn.trajectory_id), turn.response_ids
    (5, 2, 'q7#0', tensor([4, 5]))
    """

    trajectory_id: TrajectoryID
    prompt_ids: TokenSeq
    response_ids: TokenSeq
    loss_mask: TokenSeq
    rollout_logprobs: Optional[FloatSeq] = None
    reward: float = 0.0
    is_last_step: bool = False
    turn_reward: float = 0.0
    stop_reason: str = "stop"
    weight_versions: Optional[TokenSeq] = None
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: Optional[torch.Tensor] = None
    is_padding: bool = False
    route_forwards: Optional[TokenSeq] = None
    logprob_forwards: Optional[TokenSeq] = None
    teacher_logprobs: Optional[FloatSeq] = None

    @property
    def invalid_reason(self) -> Optional[str]:
        """Why this (last) step's trajectory is invalid, or None when it is valid."""
        reason = self.metadata.get(INVALID)
        return str(reason) if reason else None

    def __post_init__(self) -> None:
        if not isinstance(self.trajectory_id, TrajectoryID):
            raise StepwiseBatchError(
                f"field 'trajectory_id': expected TrajectoryID, got {type(self.trajectory_id).__name__}"
            )
        self.prompt_ids = _as_tensor(self.prompt_ids, torch.long, "prompt_ids")
        self.response_ids = _as_tensor(self.response_ids, torch.long, "response_ids")
        self.loss_mask = _as_tensor(self.loss_mask, torch.long, "loss_mask")
        if self.rollout_logprobs is not None:
            self.rollout_logprobs = _as_tensor(self.rollout_logprobs, torch.float32, "rollout_logprobs")
        if self.weight_versions is not None:
            self.weight_versions = _as_tensor(self.weight_versions, torch.long, "weight_versions")
        if self.teacher_logprobs is not None:
            self.teacher_logprobs = _as_tensor(self.teacher_logprobs, torch.float32, "teacher_logprobs")
        if self.routed_experts is not None:
            self.routed_experts = _as_routed_experts(self.routed_experts)
        if self.route_forwards is not None:
            self.route_forwards = _as_tensor(self.route_forwards, torch.long, "route_forwards")
        if self.logprob_forwards is not None:
            self.logprob_forwards = _as_tensor(self.logprob_forwards, torch.long, "logprob_forwards")
        self.reward = float(self.reward)
        self.turn_reward = float(self.turn_reward)
        self.is_last_step = bool(self.is_last_step)

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.numel() + self.response_ids.numel())

    @property
    def num_trainable(self) -> int:
        return int(self.loss_mask.sum())


def make_padding_step(index: int, prompt_ids: Optional[TokenSeq] = None) -> Step:
    """A loss-neutral row used to fill a batch to a DP multiple.

    is_padding True, loss_mask all 0, is_last_step True, and a trajectory id of its own
    (`__pad__<index>`, so it forms no group with any other row).
    """
    prompt = torch.as_tensor(prompt_ids if prompt_ids is not None else [0], dtype=torch.long)
    return Step(
        trajectory_id=TrajectoryID(f"{PAD_PROMPT_PREFIX}{index}", 0),
        prompt_ids=prompt,
        response_ids=torch.zeros(0, dtype=torch.long),
        loss_mask=torch.zeros(0, dtype=torch.long),
        rollout_logprobs=torch.zeros(0, dtype=torch.float32),
        reward=0.0,
        is_last_step=True,
        stop_reason="padding",
        is_padding=True,
    )


@dataclass
class StepBatch:
    """Columnar form of a list of steps.

    Row r is `prompt + response` of step r, stored at `tokens[offsets[r]:offsets[r+1]]`;
    the first `prompt_lens[r]` of those are prompt. Per-token fields (`token_fields`) are
    aligned with `tokens` and hold 0 at prompt positions. Per-row fields (`row_fields`)
    have one entry per row.

    token_fields always has: loss_mask (long), rollout_logprobs (float32) and
    rollout_logprobs_known (bool): True on the response tokens of steps that carry rollout
    log-probs. Where it is False the value of rollout_logprobs means nothing (it is 0): a known
    log-prob of 0 (probability 1) and an unknown one are different things.
    Optional token fields: weight_versions (long), when every step carries them; routed_experts
    (int16 [T, layers, topk], prompt positions included, -1 = unknown), route_forwards (long,
    prompt positions included) and logprob_forwards (long, -1 at prompt positions), when any step
    does (-1 = unknown in the rows of steps without them).
    row_fields always has: traj_index, group_index (long; dense ids in order of first
    appearance), is_last (bool), reward (float64), turn_reward (float64), is_padding (bool).
    `metadata` holds each step's metadata dict (turn, env info, drift...) when the batch
    carries steps between processes (agent workers, the hand-off); None in training batches.

    >>> a = Step(TrajectoryID("q", 0), [1, 2], [3, 4], [1, 1], is_last_step=True)
    >>> b = Step(TrajectoryID("q", 1), [1, 2], [5], [1], is_last_step=True)
    >>> batch = StepBatch.from_groups([[[a], [b]]])  # group q: two trajectories of one turn each
    >>> batch.tokens.tolist(), batch.offsets.tolist(), batch.prompt_lens.tolist()
    ([1, 2, 3, 4, 1, 2, 5], [0, 4, 7], [2, 2])
    >>> batch.token_fields["loss_mask"].tolist(), batch.row_fields["traj_index"].tolist()
    ([0, 0, 1, 1, 0, 0, 1], [0, 1])
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    prompt_lens: torch.Tensor
    token_fields: dict[str, torch.Tensor]
    row_fields: dict[str, torch.Tensor]
    trajectory_ids: list[TrajectoryID]
    stop_reasons: list[str]
    metadata: Optional[list[dict[str, Any]]] = None

    @property
    def num_rows(self) -> int:
        return int(self.offsets.numel() - 1)

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def response_lens(self) -> torch.Tensor:
        return self.lengths - self.prompt_lens

    def row_slice(self, r: int) -> slice:
        return slice(int(self.offsets[r]), int(self.offsets[r + 1]))

    def response_slice(self, r: int) -> slice:
        return slice(int(self.offsets[r] + self.prompt_lens[r]), int(self.offsets[r + 1]))

    def rollout_logprobs_known(self) -> torch.Tensor:
        """bool [T]: where `token_fields['rollout_logprobs']` holds a real engine log-prob."""
        known = self.token_fields.get("rollout_logprobs_known")
        return known if known is not None else torch.zeros(self.tokens.numel(), dtype=torch.bool)

    def first_row_without_rollout_logprobs(self) -> Optional[int]:
        """The first step with a trained token whose rollout log-prob is unknown, or None."""
        missing = (self.token_fields["loss_mask"] != 0) & ~self.rollout_logprobs_known()
        if not bool(missing.any()):
            return None
        i = int(torch.nonzero(missing)[0])
        return int(torch.searchsorted(self.offsets, torch.tensor(i), right=True)) - 1

    def row_of_token(self) -> torch.Tensor:
        """Row index of every token (long [T])."""
        return torch.repeat_interleave(torch.arange(self.num_rows), self.lengths)

    def set_response_field(self, name: str, values: Sequence[torch.Tensor], dtype=torch.float32) -> None:
        """Store per-step, response-aligned tensors (e.g. advantages) as `self.token_fields[name]`,
        with 0 at prompt positions."""
        if len(values) != self.num_rows:
            raise StepwiseBatchError(f"field {name!r}: got {len(values)} tensors for {self.num_rows} steps")
        resp = self.response_lens
        for r, v in enumerate(values):
            if v.numel() != int(resp[r]):
                raise StepwiseBatchError(
                    f"step {r}: field {name!r} has {v.numel()} values for {int(resp[r])} response tokens"
                )
        out = torch.zeros(self.tokens.numel(), dtype=dtype)
        if values:
            resp_start = self.offsets[:-1] + self.prompt_lens
            idx = torch.repeat_interleave(resp_start, resp) + (
                torch.arange(int(resp.sum())) - torch.repeat_interleave(torch.cumsum(resp, 0) - resp, resp)
            )
            out[idx] = torch.cat([v.detach().to(dtype).flatten() for v in values])
        self.token_fields[name] = out

    def response_values(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Split a flat per-token tensor of this batch into per-step response-aligned tensors."""
        return [flat[self.response_slice(r)].clone() for r in range(self.num_rows)]

    @classmethod
    def from_steps(cls, steps: Sequence[Step], keep_metadata: bool = False) -> "StepBatch":
        """The batch of a flat list of steps (the plugin API's input): its trajectories and groups
        are derived here, once (`step_structure`), numbered in order of first appearance."""
        structure = step_structure(steps)
        return cls._of_rows(steps, structure.traj_of_step, structure.group_of_step, keep_metadata)

    @classmethod
    def from_groups(cls, groups: Sequence[Sequence[Sequence[Step]]], keep_metadata: bool = False) -> "StepBatch":
        """The batch of whole prompt groups, group after group: each group its trajectories, each
        trajectory its rows (a `RolloutGroup`'s `trajectories`, or their merged rows). The groups
        already know their structure, so nothing is derived: traj_index and group_index number
        the trajectories and the (non-empty) groups in the order given (the class's example)."""
        trajectories = [(g, rows) for g, group in enumerate([g for g in groups if g]) for rows in group]
        steps = [s for _, rows in trajectories for s in rows]
        traj_of_step = [t for t, (_, rows) in enumerate(trajectories) for _ in rows]
        group_of_step = [g for g, rows in trajectories for _ in rows]
        return cls._of_rows(steps, traj_of_step, group_of_step, keep_metadata)

    @classmethod
    def _of_rows(
        cls, steps: Sequence[Step], traj_of_step: list[int], group_of_step: list[int], keep_metadata: bool
    ) -> "StepBatch":
        """The columns of `steps`, whose trajectory and group ids are given."""
        n = len(steps)
        prompt_lens = torch.tensor([s.prompt_ids.numel() for s in steps], dtype=torch.long)
        resp_lens = torch.tensor([s.response_ids.numel() for s in steps], dtype=torch.long)
        lengths = prompt_lens + resp_lens
        offsets = torch.zeros(n + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        pieces: list[torch.Tensor] = []
        for s in steps:
            pieces.append(s.prompt_ids)
            pieces.append(s.response_ids)
        tokens = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)

        def spread(get, dtype) -> torch.Tensor:
            parts = []
            for s, pl in zip(steps, prompt_lens.tolist()):
                parts.append(torch.zeros(pl, dtype=dtype))
                parts.append(get(s))
            return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)

        token_fields = {
            "loss_mask": spread(lambda s: s.loss_mask, torch.long),
            "rollout_logprobs": spread(
                lambda s: (
                    s.rollout_logprobs
                    if s.rollout_logprobs is not None
                    else torch.zeros(s.response_ids.numel(), dtype=torch.float32)
                ),
                torch.float32,
            ),
            "rollout_logprobs_known": spread(
                lambda s: torch.full((s.response_ids.numel(),), s.rollout_logprobs is not None), torch.bool
            ),
        }
        if n and all(s.weight_versions is not None for s in steps):
            token_fields["weight_versions"] = spread(lambda s: s.weight_versions, torch.long)
        routed = _routed_experts_field(steps)
        if routed is not None:
            token_fields["routed_experts"] = routed
        if any(s.route_forwards is not None for s in steps):
            token_fields["route_forwards"] = torch.cat(
                [s.route_forwards if s.route_forwards is not None else _unknown(s.num_tokens) for s in steps]
            )
        if any(s.teacher_logprobs is not None for s in steps):  # NaN: a row no teacher scored
            token_fields["teacher_logprobs"] = spread(
                lambda s: s.teacher_logprobs if s.teacher_logprobs is not None else _unscored(s), torch.float32
            )
        if any(s.logprob_forwards is not None for s in steps):
            token_fields["logprob_forwards"] = torch.cat(
                [
                    torch.cat([_unknown(s.prompt_ids.numel()), _response_or_unknown(s.logprob_forwards, s)])
                    for s in steps
                ]
            )

        row_fields = {
            "traj_index": torch.tensor(traj_of_step, dtype=torch.long),
            "group_index": torch.tensor(group_of_step, dtype=torch.long),
            "is_last": torch.tensor([s.is_last_step for s in steps], dtype=torch.bool),
            "reward": torch.tensor([s.reward for s in steps], dtype=torch.float64),
            "turn_reward": torch.tensor([s.turn_reward for s in steps], dtype=torch.float64),
            "is_padding": torch.tensor([s.is_padding for s in steps], dtype=torch.bool),
        }
        return cls(
            tokens=tokens,
            offsets=offsets,
            prompt_lens=prompt_lens,
            token_fields=token_fields,
            row_fields=row_fields,
            trajectory_ids=[s.trajectory_id for s in steps],
            stop_reasons=[s.stop_reason for s in steps],
            metadata=[s.metadata for s in steps] if keep_metadata else None,
        )

    def to_steps(self, copy: bool = True) -> list[Step]:
        """The rows as Steps; `copy=False` gives views of this batch's tensors (cheaper, for a
        batch nothing else will modify, e.g. one just received from another process)."""
        own = (lambda t: t.clone()) if copy else (lambda t: t)
        offsets, plens = self.offsets.tolist(), self.prompt_lens.tolist()
        versions = self.token_fields.get("weight_versions")
        routed = self.token_fields.get("routed_experts")
        route_fw, logprob_fw = self.token_fields.get("route_forwards"), self.token_fields.get("logprob_forwards")
        teacher = self.token_fields.get("teacher_logprobs")
        # per row: does every response token carry a known rollout log-prob?
        unknown = torch.zeros(self.tokens.numel() + 1, dtype=torch.long)
        torch.cumsum((~self.rollout_logprobs_known()).long(), 0, out=unknown[1:])
        unknown = unknown.tolist()
        rewards, lasts = self.row_fields["reward"].tolist(), self.row_fields["is_last"].tolist()
        turn_rewards = (
            self.row_fields["turn_reward"].tolist() if "turn_reward" in self.row_fields else [0.0] * self.num_rows
        )
        paddings = self.row_fields["is_padding"].tolist()
        steps = []
        for r in range(self.num_rows):
            start, mid, end = offsets[r], offsets[r] + plens[r], offsets[r + 1]
            has_logprobs = unknown[end] == unknown[mid]
            steps.append(
                Step(
                    trajectory_id=self.trajectory_ids[r],
                    prompt_ids=own(self.tokens[start:mid]),
                    response_ids=own(self.tokens[mid:end]),
                    loss_mask=own(self.token_fields["loss_mask"][mid:end]),
                    rollout_logprobs=own(self.token_fields["rollout_logprobs"][mid:end]) if has_logprobs else None,
                    reward=rewards[r],
                    is_last_step=lasts[r],
                    turn_reward=turn_rewards[r],
                    stop_reason=self.stop_reasons[r],
                    weight_versions=None if versions is None else own(versions[mid:end]),
                    routed_experts=None if routed is None else own(routed[start:end]),
                    route_forwards=None if route_fw is None else own(route_fw[start:end]),
                    logprob_forwards=None if logprob_fw is None else own(logprob_fw[mid:end]),
                    teacher_logprobs=_scored(teacher, mid, end, own),
                    metadata=dict(self.metadata[r]) if self.metadata is not None else {},
                    is_padding=paddings[r],
                )
            )
        return steps

    # Between processes, integer columns travel narrowed (token ids < 2^31, masks 0/1): 22 bytes
    # a token instead of 37 for a prepared batch.
    _WIRE = {"loss_mask": torch.int8, "weight_versions": torch.int32}

    def for_wire(self) -> "StepBatch":
        narrow = {k: v.to(self._WIRE[k]) if k in self._WIRE else v for k, v in self.token_fields.items()}
        return dataclasses.replace(self, tokens=self.tokens.to(torch.int32), token_fields=narrow)

    def from_wire(self) -> "StepBatch":
        wide = {k: v.long() if k in self._WIRE else v for k, v in self.token_fields.items()}
        return dataclasses.replace(self, tokens=self.tokens.long(), token_fields=wide)

    @classmethod
    def concat(cls, batches: Sequence["StepBatch"]) -> "StepBatch":
        """The rows of several batches, one batch after the other. Trajectory and group ids are
        renumbered in order, as `from_steps` numbers a flat list; a token field only some batches
        have is dropped, except `routed_experts`, which is -1 (unknown) where a batch lacks it."""
        if not batches:
            raise StepwiseBatchError("no batch to concatenate")
        lengths = torch.cat([b.lengths for b in batches])
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        names = set.intersection(*(set(b.token_fields) for b in batches))
        token_fields = {
            k: torch.cat([b.token_fields[k] for b in batches]) for k in batches[0].token_fields if k in names
        }
        for key in ("route_forwards", "logprob_forwards"):  # provenance: unknown where a batch lacks it
            if any(key in b.token_fields for b in batches):
                token_fields[key] = torch.cat([b.token_fields.get(key, _unknown(b.tokens.numel())) for b in batches])
        if any("teacher_logprobs" in b.token_fields for b in batches):  # NaN where a batch has no teacher
            token_fields["teacher_logprobs"] = torch.cat(
                [b.token_fields.get("teacher_logprobs", torch.full((b.tokens.numel(),), math.nan)) for b in batches]
            )
        routed = [b.token_fields.get("routed_experts") for b in batches]
        shape = next((tuple(r.shape[1:]) for r in routed if r is not None), None)
        if shape is not None:
            token_fields["routed_experts"] = torch.cat(
                [
                    r
                    if r is not None
                    else torch.full((b.tokens.numel(), *shape), UNKNOWN_EXPERT, dtype=ROUTED_EXPERTS_DTYPE)
                    for r, b in zip(routed, batches)
                ]
            )
        row_fields = {k: torch.cat([b.row_fields[k] for b in batches]) for k in batches[0].row_fields}
        for key in ("traj_index", "group_index"):
            parts, base = [], 0
            for b in batches:
                ids = b.row_fields[key]
                parts.append(ids + base)
                base += int(ids.max()) + 1 if ids.numel() else 0
            row_fields[key] = torch.cat(parts)
        metadata = None
        if all(b.metadata is not None for b in batches):
            metadata = [m for b in batches for m in b.metadata]
        return cls(
            tokens=torch.cat([b.tokens for b in batches]),
            offsets=offsets,
            prompt_lens=torch.cat([b.prompt_lens for b in batches]),
            token_fields=token_fields,
            row_fields=row_fields,
            trajectory_ids=[t for b in batches for t in b.trajectory_ids],
            stop_reasons=[r for b in batches for r in b.stop_reasons],
            metadata=metadata,
        )

    def select(self, rows: Iterable[int]) -> "StepBatch":
        """A new batch holding the given rows, in the given order."""
        rows = torch.as_tensor(list(rows), dtype=torch.long)
        lengths = self.lengths[rows]
        offsets = torch.zeros(rows.numel() + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        # Gather token positions of the selected rows without a per-token Python loop.
        starts = self.offsets[:-1][rows]
        base = torch.repeat_interleave(starts - offsets[:-1], lengths)
        idx = base + torch.arange(int(offsets[-1]))
        return StepBatch(
            tokens=self.tokens[idx],
            offsets=offsets,
            prompt_lens=self.prompt_lens[rows],
            token_fields={k: v[idx] for k, v in self.token_fields.items()},
            row_fields={k: v[rows] for k, v in self.row_fields.items()},
            trajectory_ids=[self.trajectory_ids[i] for i in rows.tolist()],
            stop_reasons=[self.stop_reasons[i] for i in rows.tolist()],
            metadata=None if self.metadata is None else [self.metadata[i] for i in rows.tolist()],
        )


def _routed_experts_field(steps: Sequence[Step]) -> Optional[torch.Tensor]:
    """The batch's `routed_experts` token field when any step carries them (all of one
    [layers, topk] shape); the rows of steps without them (padding steps, an engine that
    did not report) are -1, unknown: the trainer's routers choose there."""
    carried = [s.routed_experts for s in steps if s.routed_experts is not None]
    if not carried:
        return None
    shapes = {tuple(r.shape[1:]) for r in carried}
    if len(shapes) != 1:
        raise StepwiseBatchError(f"field 'routed_experts': steps disagree on [layers, topk]: {sorted(shapes)}")
    shape = shapes.pop()
    return torch.cat(
        [
            s.routed_experts
            if s.routed_experts is not None
            else torch.full((s.num_tokens, *shape), UNKNOWN_EXPERT, dtype=ROUTED_EXPERTS_DTYPE)
            for s in steps
        ]
    )


def _unknown(n: int) -> torch.Tensor:
    """n unknown forward ids (provenance fields)."""
    return torch.full((n,), -1, dtype=torch.long)


def _response_or_unknown(values: Optional[torch.Tensor], step: Step) -> torch.Tensor:
    return values if values is not None else _unknown(step.response_ids.numel())


def _unscored(step: Step) -> torch.Tensor:
    """A response no teacher scored, in a batch's `teacher_logprobs` column."""
    return torch.full((step.response_ids.numel(),), math.nan, dtype=torch.float32)


def _scored(column: Optional[torch.Tensor], mid: int, end: int, own) -> Optional[torch.Tensor]:
    """A row's teacher log-probs from the batch column, None where no teacher scored it (NaN)."""
    if column is None or end == mid or bool(torch.isnan(column[mid]).item()):
        return None
    return own(column[mid:end])
