"""Every key of metrics.jsonl: its unit, what one value is over, and what it means.

`megatron-stepwise config metrics --markdown` renders this table as docs/metrics.md, and a test
checks a real run's metrics.jsonl against it, so a new key cannot go undocumented. A key is a
pattern: `<reason>`, `<env>`, `<set>` stand for one path segment, `<k>` for a number, and
`[<set>/]` for an optional eval-set segment. "over" says what one value averages or counts:
token, step (one turn's row), trajectory, group (one prompt's trajectories), mini-batch
(one optimizer step; averaged over the iteration's), iteration, or run (cumulative).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class MetricKey:
    pattern: str
    unit: str
    over: str
    meaning: str
    section: str


_T = [  # (pattern, unit, over, meaning)
    (
        "Rewards (trajectory level: a trajectory counts once, however many turns)",
        [
            ("reward/mean", "reward", "trajectory", "mean outcome reward of the iteration's trajectories"),
            ("reward/std", "reward", "trajectory", "standard deviation of the outcome rewards"),
            ("reward/max", "reward", "trajectory", "largest outcome reward"),
            ("reward/min", "reward", "trajectory", "smallest outcome reward"),
            (
                "reward/pass@<k>",
                "fraction",
                "group",
                "unbiased pass@k (1 - C(n-c,k)/C(n,k)), a success being a reward >= "
                "eval.success_threshold; k = 1, 2, 4, ... up to the group size",
            ),
            (
                "reward/zero_variance_groups",
                "fraction",
                "group",
                "groups whose trajectories all got the same reward (no learning signal)",
            ),
            (
                "reward/env/<env>",
                "reward",
                "trajectory",
                "mean outcome reward of the trajectories of one environment (when steps record their env)",
            ),
            (
                "stop_reason/<reason>",
                "fraction",
                "trajectory",
                "share of trajectories that ended this way: stop, length, max_turns, context_limit, env_error, abort",
            ),
        ],
    ),
    (
        "Rollout",
        [
            ("rollout/trajectories", "count", "iteration", "trajectories rolled out"),
            (
                "rollout/invalid_share",
                "fraction",
                "trajectory",
                "trajectories marked invalid (env error, aborted request, env's info['invalid']): never "
                "trained, outside reward/* and pass@k",
            ),
            ("rollout/steps", "count", "iteration", "steps (turns) rolled out"),
            ("rollout/turns_mean", "turns", "trajectory", "mean turns per trajectory"),
            ("rollout/turns_max", "turns", "trajectory", "most turns of a trajectory"),
            ("rollout/response_len_mean", "tokens", "step", "mean tokens sampled per turn"),
            ("rollout/response_len_max", "tokens", "step", "most tokens sampled in one turn"),
            ("rollout/prompt_len_mean", "tokens", "step", "mean prompt length of a turn"),
            ("rollout/prompt_len_max", "tokens", "step", "longest prompt of a turn"),
            (
                "rollout/observation_len_mean",
                "tokens",
                "step",
                "mean tokens added between two turns (observation and chat glue)",
            ),
            ("rollout/trainable_tokens", "tokens", "iteration", "sampled tokens with loss_mask 1"),
            (
                "rollout/retokenize_drift_rate",
                "fraction",
                "step",
                "turn boundaries where re-tokenising the chat lost the sampled ids (measured steps only)",
            ),
            (
                "rollout/sampling_rounds",
                "count",
                "iteration",
                "rollout rounds taken (more than 1 with dynamic sampling)",
            ),
            ("perf/rollout_tokens_per_s", "tokens/s", "iteration", "generated tokens per second of rollout time"),
        ],
    ),
    (
        "Batches, groups and advantages",
        [
            ("advantages/num_trajectories", "count", "iteration", "trajectories given advantages"),
            ("advantages/num_groups", "count", "iteration", "prompt groups given advantages"),
            ("advantages/singleton_groups", "count", "iteration", "groups of one trajectory (no group baseline)"),
            ("advantages/zero_variance_groups", "count", "iteration", "groups of 2+ whose rewards are all equal"),
            (
                "advantages/invalid_trajectories",
                "count",
                "iteration",
                "invalid trajectories left out of group statistics (zero advantage, no trained token)",
            ),
            ("filter/groups_in", "count", "iteration", "groups before the group filters"),
            ("filter/groups_trained", "count", "iteration", "groups after the group filters"),
            (
                "filter/groups_dropped_zero_variance",
                "count",
                "iteration",
                "groups dropped by algo.filters.zero_variance",
            ),
            ("batch/rows_before_merge", "count", "iteration", "step rows before the prefix merge"),
            ("batch/rows_after_merge", "count", "iteration", "rows after the prefix merge (data.merge_steps)"),
            ("batch/tokens_before_merge", "tokens", "iteration", "tokens before the prefix merge"),
            ("batch/tokens_after_merge", "tokens", "iteration", "tokens after the prefix merge"),
            (
                "batch/broken_prefixes",
                "count",
                "iteration",
                "turn boundaries the merge could not join (the next prompt does not extend the last)",
            ),
        ],
    ),
    (
        "Second models: distillation teacher and LLM judge (docs/distill.md)",
        [
            (
                "teacher/requests",
                "count",
                "iteration",
                "teacher scoring requests (one per prefix chain of a trajectory)",
            ),
            (
                "teacher/scored_tokens",
                "tokens",
                "iteration",
                "tokens the teacher scored (trained ones and the observations between them)",
            ),
            (
                "teacher/score_s",
                "seconds",
                "iteration",
                "summed latency of the teacher's scoring requests (they overlap the rollout)",
            ),
            (
                "teacher/failures",
                "count",
                "iteration",
                "trajectories the teacher could not score (refused or failed): invalid, never trained",
            ),
            ("distill/tokens", "tokens", "iteration", "trained tokens given a distillation advantage"),
            (
                "distill/reverse_kl",
                "nats",
                "token",
                "mean rollout minus teacher log-prob over trained tokens: reverse KL(policy || teacher), one sample",
            ),
            ("distill/reverse_kl_sum", "nats", "iteration", "the sum behind distill/reverse_kl"),
            (
                "distill/advantage_share",
                "fraction",
                "token",
                "the distillation term's share of the advantage's summed magnitude (1 with estimator opd alone)",
            ),
            (
                "distill/opd_abs_sum",
                "advantage",
                "iteration",
                "summed |opd_coef x (teacher - rollout log-prob)| over trained tokens",
            ),
            (
                "distill/advantage_abs_sum",
                "advantage",
                "iteration",
                "summed |advantage| over trained tokens (the share's denominator)",
            ),
            (
                "judge/calls",
                "count",
                "iteration",
                "judge model requests (one per trajectory, or per turn with env.judge.reward: turn)",
            ),
            (
                "judge/unparsable",
                "count",
                "iteration",
                "judge answers env.judge.parser could not read: their trajectories are invalid",
            ),
        ],
    ),
    (
        "Training (per optimizer step, averaged over the iteration's mini-batches)",
        [
            ("train/loss", "loss", "mini-batch", "total loss (policy + KL + entropy + router terms)"),
            ("train/pg_loss", "loss", "mini-batch", "policy-gradient loss"),
            ("train/kl", "nats", "token", "KL estimate to the reference policy (algo.loss.kl_coef > 0)"),
            ("train/entropy", "nats", "token", "policy entropy at trained positions"),
            ("train/entropy_ratio", "ratio", "iteration", "train/entropy over the run's first (< 0.3 warns: collapse)"),
            ("train/clipfrac_low", "fraction", "token", "trained tokens whose ratio was clipped below"),
            ("train/clipfrac_high", "fraction", "token", "trained tokens whose ratio was clipped above"),
            ("train/clipfrac_dual", "fraction", "token", "trained tokens hit by the dual clip"),
            ("train/tis_weight_mean", "ratio", "token", "mean truncated importance weight (algo.loss.tis)"),
            ("train/tis_weight_max", "ratio", "token", "largest truncated importance weight"),
            ("train/tis_capped_frac", "fraction", "token", "trained tokens whose importance weight hit tis_cap"),
            ("train/icepop_masked_frac", "fraction", "token", "tokens IcePop masked out"),
            ("train/logprob_gap", "nats", "token", "mean |trainer - rollout| log-prob of the trained tokens"),
            ("train/logprob_gap_max", "nats", "token", "largest |trainer - rollout| log-prob gap"),
            (
                "train/logprob_gap/train_vs_rollout",
                "nats",
                "token",
                "the gap against the policy that trains the mini-batch (moved after the first one)",
            ),
            ("train/loss_weight_sum", "weight", "mini-batch", "sum of the per-token loss weights (the normaliser)"),
            ("train/num_tokens", "tokens", "mini-batch", "tokens in the loss"),
            ("train/tokens/trained", "tokens", "mini-batch", "tokens with loss_mask 1"),
            ("train/tokens/total", "tokens", "mini-batch", "real tokens in the packed micro-batches"),
            ("train/num_microbatches", "count", "mini-batch", "packed micro-batches of a data-parallel rank"),
            ("train/grad_norm", "norm", "mini-batch", "gradient norm before clipping"),
            ("train/update_successful", "fraction", "mini-batch", "optimizer steps taken (not skipped for inf/NaN)"),
            ("train/moe/aux_loss", "loss", "mini-batch", "MoE load-balancing loss"),
            ("train/moe/z_loss", "loss", "mini-batch", "MoE router z-loss"),
            ("train/moe/expert_load_max", "fraction", "mini-batch", "largest share of tokens routed to one expert"),
            ("train/moe/expert_load_min", "fraction", "mini-batch", "smallest share of tokens routed to one expert"),
            ("train/optimizer_steps", "count", "iteration", "optimizer steps taken"),
            ("train/skipped_steps", "count", "iteration", "rounds without a trainable mini-batch"),
            ("train/lr", "learning rate", "iteration", "learning rate after the iteration"),
            ("perf/train_tokens_per_s", "tokens/s", "iteration", "trained tokens per second of training time"),
        ],
    ),
    (
        "Weights and the fleet",
        [
            ("weight_version", "version", "iteration", "weight version the engines hold after the iteration"),
            ("weight_sync/seconds", "s", "iteration", "time of one weight push"),
            ("weight_sync/bytes", "bytes", "iteration", "bytes pushed"),
            ("weight_sync/buckets", "count", "iteration", "buckets streamed"),
            ("weight_sync/MBps", "MB/s", "iteration", "push throughput"),
            (
                "weight_sync/verify_s",
                "s",
                "iteration",
                "checking the push (weight_sync.verify): the trainer's sampling waits, the engines' sampling "
                "inside the update, the comparison (full: the engines' digest request)",
            ),
            ("weight_sync/verify_share", "fraction", "iteration", "weight_sync/verify_s over weight_sync/seconds"),
            ("weight_sync/verified_tensors", "count", "iteration", "tensors checked on every engine"),
            ("weight_sync/verified_engines", "count", "iteration", "engines that checked the push"),
            (
                "weight_sync/unverified_engines",
                "count",
                "iteration",
                "engines that did not check the push (SGLang servers; an engine that died during the update)",
            ),
            ("fleet/alive_engines", "count", "iteration", "engines up"),
            ("fleet/weight_version", "version", "iteration", "weight version the fleet reports"),
            ("fleet/requests", "count", "run", "generation (and teacher scoring) requests so far"),
            ("fleet/generated_tokens", "tokens", "run", "tokens generated so far"),
            ("fleet/scored_tokens", "tokens", "run", "tokens a teacher scored so far (`score` requests)"),
            ("fleet/prompt_tokens", "tokens", "run", "prompt tokens sent so far"),
            ("fleet/cached_tokens", "tokens", "run", "prompt tokens the engines' prefix caches served so far"),
            ("fleet/retries", "count", "run", "turns retried on another engine"),
            ("fleet/timeouts", "count", "run", "turns that timed out"),
            ("fleet/engine_failures", "count", "run", "engine failures seen"),
            ("fleet/restarts", "count", "run", "engines restarted"),
            ("fleet/removed_engines", "count", "run", "engines given up on"),
            (
                "fleet/frozen_engines",
                "count",
                "run",
                "engines that did not answer a weight update within weight_sync.engine_timeout_s (restarted)",
            ),
            ("fleet/repins", "count", "run", "turns of a session served on another engine than its previous turn"),
            ("fleet/weight_updates", "count", "run", "weight updates applied"),
            (
                "fleet/aborted_by_update",
                "count",
                "run",
                "requests a weight update's pause ended: 0 unless the fleet pauses with mode abort (paused turns continue)",
            ),
            (
                "fleet/dropped_stale",
                "count",
                "run",
                "requests an update dropped because they started more than async.max_staleness versions before it",
            ),
            ("agents/workers", "count", "iteration", "agent worker actors (rollout.agent_workers)"),
            ("gateway/calls", "count", "iteration", "env.agent: model calls the gateway served (each one step)"),
            (
                "rollout/prefix_breaks",
                "count",
                "iteration",
                "env.agent: calls that did not continue their trajectory's last call (history dropped, "
                "edited or summarised; rendered fresh, docs/gateway.md)",
            ),
            (
                "gateway/ignored_sampling",
                "count",
                "iteration",
                "env.agent: client temperature/top_p/top_k values ignored (env.client_sampling=ignore)",
            ),
            ("gateway/retries_answered", "count", "iteration", "env.agent: retried requests answered from the first"),
            ("gateway/refused", "count", "iteration", "env.agent: calls answered with an error (bad input, caps)"),
            (
                "gateway/agent_errors",
                "count",
                "iteration",
                "env.agent / env.agent_command: trajectories whose agent raised (or exited nonzero), timed out or "
                "yielded no reward (invalid)",
            ),
            ("agents/worker_restarts", "count", "run", "agent workers restarted"),
            ("agents/reissued_groups", "count", "run", "prompt groups re-issued after a worker died"),
            (
                "agents/regenerated_groups",
                "count",
                "run",
                "prompt groups rolled out again because the worker holding their rows died or froze",
            ),
            (
                "agents/rows_held",
                "flag",
                "iteration",
                "1 when each replica fetched its rows from the agent workers "
                "(rollout.handoff=workers), 0 when they went through rank 0",
            ),
            (
                "handoff/rows_fetched_bytes",
                "bytes",
                "iteration",
                "bytes of rows rank 0's replica fetched from the agent workers (its share of the round; "
                "the other replicas fetch theirs alike)",
            ),
            (
                "handoff/rank0_bytes_sent",
                "bytes",
                "iteration",
                "async: bytes rank 0 sent the other ranks' replicas (their shards' rows, or manifests "
                "when the agent workers keep the rows)",
            ),
        ],
    ),
    (
        "Asynchronous training (async.enabled)",
        [
            (
                "async/token_staleness_mean",
                "versions",
                "token",
                "weight versions between a trained token's and the trainer's",
            ),
            ("async/token_staleness_min", "versions", "token", "least token staleness"),
            ("async/token_staleness_max", "versions", "token", "most token staleness"),
            ("async/group_staleness_mean", "versions", "group", "mean staleness of a trained group"),
            ("async/group_staleness_max", "versions", "group", "most staleness of a trained group"),
            (
                "async/trajectories_spanning_versions",
                "fraction",
                "trajectory",
                "trajectories whose tokens come from several weight versions",
            ),
            ("async/trajectory_version_spread_max", "versions", "trajectory", "most versions one trajectory spans"),
            ("async/requeued_groups", "count", "iteration", "groups re-queued as too stale"),
            ("async/groups_in_flight", "count", "iteration", "groups being rolled out at the iteration's end"),
            ("async/groups_ready", "count", "iteration", "finished groups waiting to be trained"),
            ("async/groups_requeue_waiting", "count", "iteration", "groups waiting to be re-issued"),
            ("async/groups_started", "count", "run", "groups whose rollout started"),
            ("async/groups_finished", "count", "run", "groups whose trajectories all finished"),
            ("async/groups_trained", "count", "run", "groups trained"),
            ("async/groups_filtered", "count", "run", "finished groups dropped by the group filters"),
            ("async/groups_stale_dropped", "count", "run", "groups dropped as too stale (async.stale_policy=drop)"),
            (
                "async/groups_stale_requeued",
                "count",
                "run",
                "groups re-queued as too stale (async.stale_policy=requeue)",
            ),
            (
                "async/groups_paced_waits",
                "count",
                "run",
                "takes that waited for an old group in flight (async.stale_policy=pace)",
            ),
            (
                "async/groups_recovered",
                "count",
                "run",
                "groups a resumed run took from the rollout bank instead of rolling them out again",
            ),
            (
                "async/bank_groups_discarded",
                "count",
                "run",
                "banked groups a resume could not reuse: a damaged file, or tokens from weights the kill lost",
            ),
            (
                "async/generated_share/turns_<n>",
                "fraction",
                "trajectory",
                "share of the trajectories generated so far with n turns (9+ in one bucket)",
            ),
            (
                "async/trained_share/turns_<n>",
                "fraction",
                "trajectory",
                "share of the trajectories trained so far with n turns: below generated_share = under-trained",
            ),
            ("async/token_staleness/<k>", "fraction", "token", "share of the trained tokens k versions stale"),
        ],
    ),
    (
        "Evaluation (eval/ for the default set, eval/<set>/ for eval.sets)",
        [
            ("eval/[<set>/]reward/mean", "reward", "trajectory", "mean outcome reward on the eval prompts"),
            ("eval/[<set>/]reward/std", "reward", "trajectory", "standard deviation of the eval rewards"),
            ("eval/[<set>/]reward/max", "reward", "trajectory", "largest eval reward"),
            ("eval/[<set>/]reward/min", "reward", "trajectory", "smallest eval reward"),
            (
                "eval/[<set>/]reward/pass@<k>",
                "fraction",
                "group",
                "unbiased pass@k over eval.samples_per_prompt samples",
            ),
            (
                "eval/[<set>/]reward/maj@<k>",
                "fraction",
                "group",
                "maj@k (cons@k): expected correctness of the majority answer of k samples",
            ),
            (
                "eval/[<set>/]reward/zero_variance_groups",
                "fraction",
                "group",
                "eval groups whose rewards are all equal",
            ),
            ("eval/[<set>/]reward/env/<env>", "reward", "trajectory", "mean eval reward per environment"),
            ("eval/[<set>/]rollout/turns_mean", "turns", "trajectory", "mean turns of an eval trajectory"),
            ("eval/[<set>/]rollout/turns_max", "turns", "trajectory", "most turns of an eval trajectory"),
            ("eval/[<set>/]stop_reason/<reason>", "fraction", "trajectory", "how eval trajectories ended"),
            ("eval/[<set>/]prompts", "count", "group", "eval prompts with a valid trajectory"),
            ("eval/[<set>/]rollout/invalid_share", "fraction", "trajectory", "eval trajectories marked invalid"),
        ],
    ),
    (
        "Time (seconds of the iteration)",
        [
            ("time/iteration", "s", "iteration", "the whole iteration"),
            ("time/rollout", "s", "iteration", "rollout (sync) or waiting for finished groups (async)"),
            ("time/prepare", "s", "iteration", "merge, advantages, batches and shard plans on rank 0"),
            ("time/old_logprobs", "s", "iteration", "old-policy and reference log-probs"),
            ("time/train", "s", "iteration", "forward, backward and optimizer steps"),
            ("time/weight_sync", "s", "iteration", "pushing the weights to the fleet"),
            (
                "time/checkpoint",
                "s",
                "iteration",
                "saving the checkpoint that followed the previous iteration (a line is written before "
                "its own iteration's checkpoint, so a kill between the two loses no line)",
            ),
            ("time/eval", "s", "iteration", "evaluation"),
            ("time/engine_release", "s", "iteration", "colocated engines releasing their memory"),
            ("time/engine_resume", "s", "iteration", "colocated engines taking their memory back"),
            ("time/dump", "s", "iteration", "the trainer's log-probs for a rollout dump (trainer.dump_rollouts)"),
        ],
    ),
    (
        "Time budget (parts add up to budget/wall; docs/inspect.md)",
        [
            ("budget/generation", "s", "iteration", "some generation in flight"),
            ("budget/environment", "s", "iteration", "environment calls in flight, no generation"),
            (
                "budget/host",
                "s",
                "iteration",
                "the rest of producing the round on rank 0: agent-loop host work, prepare, planning, writing a dump",
            ),
            ("budget/handoff", "s", "iteration", "sending and receiving the round's shards"),
            ("budget/train", "s", "iteration", "old log-probs, forward, backward and optimizer steps"),
            ("budget/weight_push", "s", "iteration", "pushing the weights to the fleet"),
            ("budget/idle", "s", "iteration", "wall time no part holds (metrics, logging, waits)"),
            ("budget/wall", "s", "iteration", "the iteration's wall time the parts add up to"),
            (
                "perf/tokens_per_s_per_gpu",
                "tokens/s",
                "iteration",
                "trained tokens per second of wall time per device, training ranks and rollout GPUs counted",
            ),
        ],
    ),
]

METRIC_KEYS = [MetricKey(p, u, o, m, section) for section, rows in _T for p, u, o, m in rows]


def _regex(pattern: str) -> re.Pattern:
    out = re.escape(pattern)
    out = out.replace(re.escape("[<set>/]"), "(?:[^/]+/)?")
    out = out.replace(re.escape("<k>"), r"\d+")
    out = re.sub(re.escape("<") + r"[a-z]+" + re.escape(">"), "[^/]+", out)
    return re.compile(f"^{out}$")


_COMPILED = [(_regex(k.pattern), k) for k in METRIC_KEYS]


def describe(key: str) -> MetricKey | None:
    """The documented entry a metrics.jsonl key falls under (exact patterns first), or None."""
    matches = [k for rx, k in _COMPILED if rx.match(key)]
    return min(matches, key=lambda k: ("<" in k.pattern, len(k.pattern))) if matches else None


def render_markdown() -> str:
    lines = [
        "# Metrics reference",
        "",
        "<!-- generated by `megatron-stepwise config metrics --markdown`; do not edit -->",
        "",
        "Every key of `<run_dir>/metrics.jsonl` (one JSON line per iteration; TensorBoard and W&B get the same "
        "keys). `<k>` is a number, `<reason>`, `<env>`, `<set>` one name, `[<set>/]` an optional eval-set "
        "name. **over** says what one value is taken over: token, step (one turn's row), trajectory, group "
        "(one prompt's trajectories), mini-batch (one optimizer step, averaged over the iteration's), "
        "iteration, or run (cumulative since the start).",
        "",
    ]
    section = None
    for k in METRIC_KEYS:
        if k.section != section:
            section = k.section
            lines += ["", f"## {section}", "", "| key | unit | over | meaning |", "|---|---|---|---|"]
        lines.append(f"| `{k.pattern}` | {k.unit} | {k.over} | {k.meaning} |")
    return "\n".join(lines) + "\n"


def render_text() -> str:
    return "\n".join(f"{k.pattern:44s} {k.unit:12s} {k.over:11s} {k.meaning}" for k in METRIC_KEYS) + "\n"
