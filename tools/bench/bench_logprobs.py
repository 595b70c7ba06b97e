"""Log-probs + entropy at trained positions only vs full logits, forward+backward on CPU.

Workload: one packed micro-batch of T tokens of which a fraction is masked (observations,
prompt glue), i.e. only (1 - masked) x T positions have a trained next token. Both paths
compute the same loss `sum(a * logp + b * entropy)` at the trained positions and its
gradient w.r.t. the hidden states and the output weight:

- full:    logits = hidden @ W^T for all T positions (fp32), log_softmax, gather, entropy;
- trained: select the trained positions' hidden states, then `vocab_parallel_logprobs`
           (chunked, recomputing logits in the backward).

Each (path, masked fraction) runs in its own subprocess so peak memory is that run's own
(growth of the peak RSS over the inputs). Prints measured figures side by side; no asserts.

    python tools/bench/bench_logprobs.py [--tokens 2048 --hidden 512 --vocab 32000 --threads 2]

`--device cuda [--dtype bf16]` runs it on the GPU: hidden states and output weight in that
dtype (both paths take the log-softmax in fp32), steps timed between `torch.cuda.synchronize()`
calls, peak memory = growth of `torch.cuda.max_memory_allocated` over the inputs, in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from harness import bench_parser


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB
    raise KeyError(field)


def _reset_peak_rss() -> None:
    # ru_maxrss survives fork/exec (a child would inherit the parent's peak); VmHWM can be reset.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_case(masked: float, tokens: int, hidden: int, vocab: int, device: str = "cpu", dtype: str = "fp32"):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g)
    w = 0.02 * torch.randn(vocab, hidden, generator=g)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    idx = torch.nonzero(torch.rand(tokens, generator=g) >= masked).flatten()
    a, b = torch.randn(idx.numel(), generator=g), torch.randn(idx.numel(), generator=g)
    if device == "cpu" and dtype == "fp32":  # the CPU figures' exact inputs
        return h.requires_grad_(True), w.requires_grad_(True), targets, idx, a, b
    h, w = (t.to(device=device, dtype=DTYPES[dtype]).requires_grad_(True) for t in (h, w))
    return (h, w, *(t.to(device) for t in (targets, idx, a, b)))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step(path: str, case, chunk: int):
    """One forward+backward; returns the trained positions' log-probs."""
    from megatron_stepwise.mcore.train.logprobs import vocab_parallel_logprobs

    h, w, targets, idx, a, b = case
    h.grad = w.grad = None
    if path == "full":
        logp_all = torch.log_softmax((h @ w.t()).float(), dim=-1)  # the full [tokens, vocab] logits
        lp = logp_all.gather(-1, targets[:, None])[:, 0][idx]
        ent = -(logp_all.exp() * logp_all).sum(-1)[idx]
    else:
        lp, ent = vocab_parallel_logprobs(h.index_select(0, idx), w, targets[idx], chunk_tokens=chunk)
    (a * lp + b * ent).sum().backward()
    return lp.detach()


def peak_memory_child(path: str, masked: float, args) -> None:
    """Runs in its own process: growth of the peak RSS over the inputs during one step."""
    case = make_case(masked, args.tokens, args.hidden, args.vocab, "cpu", args.dtype)
    _reset_peak_rss()
    base = _status_mib("VmRSS")
    step(path, case, args.chunk)
    print(json.dumps({"peak_mib": _status_mib("VmHWM") - base}))


def cuda_peak_mib(path: str, masked: float, args) -> float:
    """GPU: growth of the peak allocated memory over the inputs during one step (in-process)."""
    case = make_case(masked, args.tokens, args.hidden, args.vocab, "cuda", args.dtype)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(path, case, args.chunk)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    del case
    return peak


def timings(masked: float, args) -> tuple[float, float, float, int]:
    """Best-of-reps time of both paths, alternated so background load hits both alike."""
    case = make_case(masked, args.tokens, args.hidden, args.vocab, args.device, args.dtype)
    lp_full, lp_trained = step("full", case, args.chunk), step("trained", case, args.chunk)  # warm-up
    best = {"full": float("inf"), "trained": float("inf")}
    for _ in range(args.reps):
        for path in best:
            _sync(args.device)
            t = time.perf_counter()
            step(path, case, args.chunk)
            _sync(args.device)
            best[path] = min(best[path], time.perf_counter() - t)
    diff = float((lp_full - lp_trained).abs().max()) if lp_full.numel() else 0.0
    return best["full"], best["trained"], diff, int(case[3].numel())


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__, "75%% masked only, best of 2")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunk", type=int, default=512, help="tokens per logits chunk on the trained path")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--masked", type=float, nargs="*", default=[0.0, 0.5, 0.75, 0.9])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="of the hidden states and output weight")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.masked, args.reps = [0.75], 2
    return args


# The suite's shape: a quarter of the CLI's work (both paths scale with tokens x vocab, so the
# ratios hold) and best of 3, to fit its time budget on a busy 2-core machine.
SUITE_ARGS = ["--tokens", "1024", "--vocab", "16000", "--reps", "3"]


def run(quick: bool = False) -> dict:
    """What `tools/bench/suite.py` collects: prints the table, returns the figures."""
    return report(parse_args(SUITE_ARGS + (["--quick"] if quick else [])))


def report(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} threads"
    how = (
        "in-process peak of torch.cuda.max_memory_allocated" if args.device == "cuda" else "a separate process per path"
    )
    print(
        f"{where}: T={args.tokens} tokens per micro-batch, hidden {args.hidden}, "
        f"vocab {args.vocab}, {args.dtype}; forward+backward of log-probs and entropy at the trained positions "
        f"(best of {args.reps}, paths alternated; peak memory from {how})"
    )
    header = (
        f"{'masked':>7} {'trained':>8} | {'full s':>8} {'trained s':>10} {'speed-up':>9} | "
        f"{'full MiB':>9} {'trained MiB':>12} {'mem ratio':>10} | {'max |dlogp|':>11}"
    )
    print(header)
    print("-" * len(header))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    rows = []
    for masked in args.masked:
        peak = {}
        for path in ("full", "trained"):
            if args.device == "cuda":
                peak[path] = cuda_peak_mib(path, masked, args)
                continue
            cmd = [
                sys.executable,
                __file__,
                "--_child",
                path,
                str(masked),
                "--tokens",
                str(args.tokens),
                "--hidden",
                str(args.hidden),
                "--vocab",
                str(args.vocab),
                "--chunk",
                str(args.chunk),
                "--threads",
                str(args.threads),
                "--dtype",
                args.dtype,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            peak[path] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]
        t_full, t_trained, diff, n = timings(masked, args)
        print(
            f"{masked:>7.0%} {n:>8d} | {t_full:>8.3f} {t_trained:>10.3f} {t_full / t_trained:>8.2f}x | "
            f"{peak['full']:>9.0f} {peak['trained']:>12.0f} {peak['full'] / max(peak['trained'], 1e-9):>9.2f}x | "
            f"{diff:>11.2e}"
        )
        rows.append(
            {
                "masked": masked,
                "trained_tokens": n,
                "full_s": t_full,
                "trained_s": t_trained,
                "speedup": t_full / t_trained,
                "full_peak_mib": peak["full"],
                "trained_peak_mib": peak["trained"],
                "max_abs_logprob_diff": diff,
            }
        )
    figures = {}
    for r in rows:
        pct = round(100 * r["masked"])
        figures[f"speedup_at_{pct}pct_masked"] = r["speedup"]
        figures[f"memory_ratio_at_{pct}pct_masked"] = r["full_peak_mib"] / max(r["trained_peak_mib"], 1e-9)
    config = {k: v for k, v in vars(args).items() if k not in ("_child", "out")}
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return {"config": config, "device": device, "rows": rows, "figures": figures}


def main() -> None:
    args = parse_args()
    if args._child:
        torch.set_num_threads(args.threads)
        peak_memory_child(args._child[0], float(args._child[1]), args)
        return
    result = report(args)
    if args.out:
        from harness import write_json

        write_json(result, args.out)


if __name__ == "__main__":
    main()
