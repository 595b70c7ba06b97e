"""The figures the benchmark suite reports, with their targets, and their tables.

Each `Figure` reads one number out of a benchmark's result dict (what its `run(quick)` returned).
A benchmark that is missing, skipped or failed leaves its figures unmeasured; so does a result
without the key. Benchmarks may also return `"figures": {name: number}`, read with `named(...)`:
the convention for benchmarks whose result layout this file does not know.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

Result = dict[str, Any]

_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}


@dataclass(frozen=True)
class Figure:
    benchmark: str  # the suite's benchmark name
    label: str
    extract: Callable[[Result], Optional[float]]
    unit: str = ""  # printed after the value: "x", " s", "%"...
    digits: int = 3
    target: Optional[tuple[str, float]] = None  # (op, threshold); None = reported only

    def value(self, result: Optional[Result]) -> Optional[float]:
        if not result:
            return None
        try:
            v = self.extract(result)
        except (KeyError, IndexError, TypeError, ZeroDivisionError):
            return None
        return None if v is None else float(v)

    def met(self, value: Optional[float]) -> Optional[bool]:
        if self.target is None or value is None:
            return None
        op, threshold = self.target
        return bool(_OPS[op](value, threshold))

    def target_text(self) -> str:
        if self.target is None:
            return "-"
        op, threshold = self.target
        return f"{op} {threshold:g}{self.unit}"

    def format(self, value: Optional[float]) -> str:
        if value is None:
            return "not measured"
        if self.unit == "%":
            return f"{100 * value:.{self.digits}f}%"
        return f"{value:,.{self.digits}f}{self.unit}"


def named(name: str) -> Callable[[Result], Optional[float]]:
    return lambda r: r.get("figures", {}).get(name)


def _layout(r: Result, name: str) -> Result:
    return r["layouts"][name]


def _packed_over_padded(r: Result, rows: str) -> float:
    return _layout(r, "ours_merged")["packed_efficiency"] / _layout(r, rows)["padded_same_micro_efficiency"]


FIGURES: list[Figure] = [
    # 1. padding efficiency (tools/bench/bench_pipeline.py)
    Figure(
        "padding",
        "padding efficiency (real / computed tokens), ours: merged rows, packed",
        lambda r: _layout(r, "ours_merged")["packed_efficiency"],
        target=(">=", 0.97),
    ),
    Figure(
        "padding",
        "ours / pad-to-longest per micro-batch, step-wise rows (efficiency ratio)",
        lambda r: _packed_over_padded(r, "stepwise_unmerged"),
        "x",
        2,
        (">=", 2.0),
    ),
    Figure(
        "padding",
        "ours / pad-to-longest per micro-batch, peers' obs-in-response rows",
        lambda r: _packed_over_padded(r, "obs_in_response"),
        "x",
        2,
    ),
    Figure(
        "padding",
        "ours / pad-to-longest per micro-batch, the same merged rows",
        lambda r: _packed_over_padded(r, "ours_merged"),
        "x",
        2,
    ),
    Figure(
        "padding",
        "ours / pad-to-longest with length-sorted micro-batches, merged rows",
        lambda r: (
            _layout(r, "ours_merged")["packed_efficiency"] / _layout(r, "ours_merged")["padded_sorted_efficiency"]
        ),
        "x",
        3,
    ),
    Figure(
        "padding",
        "computed tokens: peers' obs-in-response padded / ours",
        lambda r: (
            _layout(r, "obs_in_response")["padded_same_micro_tokens"] / _layout(r, "ours_merged")["packed_tokens"]
        ),
        "x",
        2,
    ),
    Figure(
        "padding",
        "max padded sequence length (longest row), ours",
        lambda r: _layout(r, "ours_merged")["longest_padded_row"],
        " tok",
        0,
    ),
    Figure(
        "padding",
        "max padded sequence length (longest row), peers' obs-in-response",
        lambda r: _layout(r, "obs_in_response")["longest_padded_row"],
        " tok",
        0,
    ),
    # 6. DP balance (same run)
    Figure(
        "padding",
        "DP balance max/mean rank cost, ours, dp=8 (worst mini-batch)",
        lambda r: r["dp_balance"]["ours_merged dp=8"]["ours"]["worst"],
        "",
        4,
        ("<=", 1.02),
    ),
    Figure(
        "padding",
        "DP balance max/mean, ours, dp=32 (worst mini-batch)",
        lambda r: r["dp_balance"]["ours_merged dp=32"]["ours"]["worst"],
        "",
        4,
        ("<=", 1.02),
    ),
    Figure(
        "padding",
        "DP balance max/mean, round-robin, dp=8",
        lambda r: r["dp_balance"]["ours_merged dp=8"]["round_robin"]["worst"],
        "",
        4,
    ),
    Figure(
        "padding",
        "DP balance max/mean, sorted greedy on tokens, dp=8",
        lambda r: r["dp_balance"]["ours_merged dp=8"]["sorted_greedy_tokens"]["worst"],
        "",
        4,
    ),
    Figure(
        "padding",
        "DP balance max/mean, sorted greedy on tokens, dp=32",
        lambda r: r["dp_balance"]["ours_merged dp=32"]["sorted_greedy_tokens"]["worst"],
        "",
        4,
    ),
    # 2. merge savings (tools/bench/bench_merge.py)
    Figure(
        "merge",
        "merged tokens / unique tokens, prefix-consistent (worst over T=1..16)",
        lambda r: r["merged_over_unique_max"],
        "",
        3,
        ("<=", 1.05),
    ),
    Figure(
        "merge",
        "contrast: merged / unique with 10% re-tokenisation drift, T=16",
        lambda r: r["by_turns"][-1]["merged_over_unique_with_drift"],
        "",
        3,
    ),
    Figure("merge", "unmerged / merged tokens per trajectory at T=16", lambda r: r["ratio_at_max_turns"], "x", 2),
    Figure(
        "merge",
        "growth exponent k (tokens ~ T^k), unmerged, T=1..16",
        lambda r: r["growth_exponent"]["unmerged"]["all"],
        "",
        2,
    ),
    Figure(
        "merge", "growth exponent k, merged, T=8..16", lambda r: r["growth_exponent"]["merged"]["upper_half"], "", 2
    ),
    # 2b. the agent loop's context modes with the tiny_bpe tokenizer (tools/bench/bench_context.py)
    *[
        Figure(
            "context",
            f"tiny_bpe agent loop, T={t}: merged tokens per trajectory, {mode} mode",
            named(f"merged_tokens_per_traj_{mode}_T{t}"),
            " tok",
            1,
        )
        for t in (4, 8, 16)
        for mode in ("tokens", "retokenize")
    ],
    Figure(
        "context", "retokenize / tokens merged tokens per trajectory, T=16", named("retokenize_over_tokens_T16"), "x", 2
    ),
    Figure(
        "context",
        "tokens mode: merged / unique tokens (worst over T=4, 8, 16)",
        named("tokens_merged_over_unique_max"),
        "",
        3,
    ),
    Figure(
        "context",
        "retokenize mode: merged / unique tokens, T=16",
        named("retokenize_merged_over_unique_max_turns"),
        "",
        3,
    ),
    Figure(
        "context",
        "retokenize mode: measured re-tokenisation drift rate (random tiny policy)",
        named("retokenize_drift_rate"),
        "%",
        1,
    ),
    # 3. trained-positions-only log-probs (tools/bench/bench_logprobs.py)
    Figure(
        "logprobs",
        "trained-positions-only / full logits fwd+bwd speedup, 75% masked (T=1024, V=16k)",
        named("speedup_at_75pct_masked"),
        "x",
        2,
        (">=", 1.5),
    ),
    Figure("logprobs", "same, 90% masked", named("speedup_at_90pct_masked"), "x", 2),
    Figure("logprobs", "same, 0% masked (nothing to skip)", named("speedup_at_0pct_masked"), "x", 2),
    Figure(
        "logprobs",
        "peak memory full / trained-positions-only, 75% masked",
        named("memory_ratio_at_75pct_masked"),
        "x",
        2,
    ),
    # 4. trainer step (tools/bench/bench_trainer_step.py)
    Figure(
        "trainer_step",
        "packed / padded real tokens per second (CPU, plugin train_minibatch)",
        lambda r: r["packed_over_padded_tokens_per_s"],
        "x",
        2,
    ),
    Figure(
        "trainer_step",
        "padded / packed computed tokens (what padding adds)",
        lambda r: r["padded_over_packed_computed_tokens"],
        "x",
        2,
    ),
    Figure(
        "trainer_step",
        "packed real tokens per second",
        lambda r: r["layouts"]["packed"]["real_tokens_per_s"],
        " tok/s",
        0,
    ),
    # 5. host pipeline (tools/bench/bench_host.py)
    Figure(
        "host_pipeline",
        "validate+mini-batch+prepare+plan, 512x8 trajectories (64x8 quick), wall (warm)",
        lambda r: r["seconds"],
        " s",
        3,
        ("<", 1.0),
    ),
    Figure(
        "host_pipeline",
        "same, CPU time of the one thread (warm)",
        lambda r: r["time_s"]["warm_cpu"]["total"],
        " s",
        3,
        ("<", 1.0),
    ),
    Figure(
        "host_pipeline",
        "fraction of the reference GPU time of the iteration (stated assumption)",
        lambda r: r["fraction_of_gpu_time"],
        "%",
        2,
    ),
    # 7. rollout (tools/bench/bench_rollout.py)
    Figure("rollout", "fleet trajectories/s, 2 engines / 1 engine", lambda r: r["fleet_x2_over_x1"], "x", 2),
    Figure("rollout", "fleet x1 trajectories/s", lambda r: r["results"]["fleet x1"]["trajectories/s"], "/s", 1),
    Figure("rollout", "fleet x1 generated tokens/s", lambda r: r["results"]["fleet x1"]["gen tokens/s"], "/s", 0),
    # 8. weight sync (tools/bench/bench_weight_sync.py)
    Figure("weight_sync", "Megatron -> HF conversion only, tiny model", named("convert_MB_per_s_tiny"), " MB/s", 1),
    Figure(
        "weight_sync",
        "conversion + transfer + engine load (tensor push), tiny model",
        named("tensor_MB_per_s_tiny"),
        " MB/s",
        1,
    ),
    Figure(
        "weight_sync", "Megatron -> HF conversion only, ~100M model", named("convert_MB_per_s_qwen2-100m"), " MB/s", 1
    ),
    Figure(
        "weight_sync",
        "conversion + transfer + engine load (tensor push), ~100M model",
        named("tensor_MB_per_s_qwen2-100m"),
        " MB/s",
        1,
    ),
    Figure(
        "weight_sync",
        "same through the distributed push (gloo on CPU), ~100M model",
        named("distributed_MB_per_s_qwen2-100m"),
        " MB/s",
        1,
    ),
    # rollout at scale (tools/bench/bench_turn_cost.py, bench_env_calls.py, bench_scale.py)
    Figure(
        "turn_cost",
        "agent-loop host CPU per turn, retokenize mode",
        named("cpu_ms_per_step_retokenize"),
        " ms",
        3,
        ("<=", 1.0),
    ),
    Figure(
        "turn_cost", "agent-loop host CPU per turn, tokens mode", named("cpu_ms_per_step_tokens"), " ms", 3, ("<=", 1.0)
    ),
    Figure(
        "env_calls",
        "sandboxed math_tool calls/s, env_concurrency 2 / 1",
        lambda r: r["calls_per_s"]["2"] / r["calls_per_s"]["1"],
        "x",
        2,
    ),
    Figure("scale", "turns/s, 2 agent workers / 1", lambda r: r["workers_2_vs_1"], "x", 2, (">=", 1.6)),
    Figure(
        "scale",
        "hand-off, sending side per step (DP4)",
        lambda r: 1e3 * r["handoff_after"]["dp4"]["send_cpu"] / r["turns"],
        " ms",
        4,
        ("<=", 0.05),
    ),
    Figure(
        "scale",
        "bytes received per rank, DP4 / DP1",
        lambda r: max(r["handoff_after"]["dp4"]["bytes_per_rank"]) / max(r["handoff_after"]["dp1"]["bytes_per_rank"]),
        "",
        3,
    ),
    Figure(
        "scale",
        "host seconds per iteration before (in-process loop, pickled Steps)",
        lambda r: r["host_seconds_before"],
        " s",
        1,
    ),
    Figure(
        "scale",
        "host seconds per iteration after (2 agent workers, shards)",
        lambda r: r["host_seconds_after"],
        " s",
        1,
    ),
    # 9. GPU (tools/bench/bench_gpu.py)
    Figure("gpu", "training step tokens/s (packed 4k micro-batches, bf16)", lambda r: r["tokens_per_s"], " tok/s", 0),
    Figure("gpu", "MFU vs measured bf16 matmul peak", lambda r: r["mfu"], "%", 1),
]


def evaluate(benchmarks: dict[str, Result]) -> list[dict[str, Any]]:
    """One row per figure: its value (None if unmeasured), target text and whether it is met."""
    rows = []
    for f in FIGURES:
        entry = benchmarks.get(f.benchmark, {})
        value = f.value(entry.get("result")) if entry.get("status") == "ok" else None
        rows.append(
            {
                "benchmark": f.benchmark,
                "figure": f.label,
                "value": value,
                "display": f.format(value),
                "target": f.target_text(),
                "met": f.met(value),
                "status": entry.get("status", "not run"),
            }
        )
    return rows


def _met_text(row: dict[str, Any]) -> str:
    if row["target"] == "-":
        return "-"
    if row["met"] is None:
        return f"n/a ({row['status']})"
    return "yes" if row["met"] else "NO"


def summary_table(rows: list[dict[str, Any]]) -> str:
    width = max(len(r["figure"]) for r in rows)
    lines = [f"{'benchmark':<14}{'figure':<{width + 2}}{'measured':>16}{'target':>10}   met"]
    for r in rows:
        lines.append(
            f"{r['benchmark']:<14}{r['figure']:<{width + 2}}{r['display']:>16}{r['target']:>10}   {_met_text(r)}"
        )
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], benchmarks: dict[str, Result], *, title: str, preamble: str) -> str:
    out = [
        f"### {title}",
        "",
        preamble,
        "",
        "| Benchmark | Figure | Measured | Target | Met |",
        "|---|---|---:|---:|:---:|",
    ]
    for r in rows:
        target = r["target"].replace("<", "&lt;")
        out.append(f"| {r['benchmark']} | {r['figure']} | {r['display']} | {target} | {_met_text(r)} |")
    notes = [
        f"- `{name}`: {b['status']}: {b.get('message', '')}".rstrip(": ")
        for name, b in benchmarks.items()
        if b.get("status") != "ok"
    ]
    if notes:
        out += ["", "Not measured in this run:", *notes]
    return "\n".join(out) + "\n"
