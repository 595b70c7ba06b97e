"""A dumped iteration -> the viewer's JSON -> self-contained HTML pages.

Pages hold at most `PAGE_TOKENS` tokens (prompt deltas and responses), so a page stays a few MB
and renders in a browser however large the iteration: an iteration that fits is one file; a
larger one is an index page (every trajectory's summary, the curves, links) and numbered pages
beside it, a trajectory longer than a page continuing on the next one. The dump is walked one
trajectory at a time with numpy slices of its columns, and a page is written as soon as it is
full, so time and memory grow linearly with the tokens and stay small. Token texts go into each
page's vocabulary (id -> text) once, not once per token.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from megatron_stepwise.rundir import dump_trust
from megatron_stepwise.rundir.dump_table import DumpError, read_dump_table
from megatron_stepwise.rundir.jsonl import read_metrics
from megatron_stepwise.rundir.paths import RunDir
from megatron_stepwise.rundir.run_files import write_path

log = logging.getLogger(__name__)

PAGE_TOKENS = 50_000
# roles of a token: prompt or observation (context), trained, an EOS appended with loss 0,
# and context inside a merged row's response (observations and chat glue between turns)
PROMPT, TRAINED, APPENDED_EOS, CONTEXT = "p", "t", "e", "o"
CURVES = {
    "reward": "reward/mean",
    "eval reward": "eval/reward/mean",
    "response length": "rollout/response_len_mean",
    "turns": "rollout/turns_mean",
}


@dataclass
class Decoder:
    """Token id -> text with the run's tokenizer (None: ids only) and its EOS ids."""

    text: Optional[Callable[[int], str]]
    eos: frozenset[int]


# the tokenizer's name in a dump's metadata (None: it names none)
TokenizerSource = Callable[[dict], Optional[str]]


def load_decoder(
    meta: dict, *, trusted: bool = False, source: TokenizerSource = dump_trust.recorded_tokenizer
) -> Decoder:
    """The run's tokenizer as `source` finds it in the dump's metadata (by default what the dump
    and its config name; the CLI also asks an older dump's environment), without running or
    downloading anything it names unless `trusted` (rundir/dump_trust.py); ids alone, with a
    warning saying why, when it does not load."""
    try:
        name = source(meta)
        if name is None:
            raise DumpError("the dump names no tokenizer (no recorded one, no model.tokenizer or model.hf_checkpoint)")
        tok = dump_trust.load_tokenizer(name, trusted=trusted)
    except Exception as e:  # the page is still useful with ids only; say why once
        log.warning("viewer: showing token ids (the run's tokenizer did not load: %s)", e)
        return Decoder(None, frozenset())
    cache: dict[int, str] = {}

    def decode(i: int) -> str:
        if i not in cache:
            cache[i] = tok.decode([i])
        return cache[i]

    eos = frozenset({tok.eos_token_id}) if getattr(tok, "eos_token_id", None) is not None else frozenset()
    return Decoder(decode, eos)


class _ListColumn:
    """A list column of the dump as flat numpy values and offsets: a row is a slice, not a Python list."""

    def __init__(self, table, name: str):
        import pyarrow as pa

        col = table.column(name)
        arr = col.chunk(0) if col.num_chunks == 1 else pa.concat_arrays(col.chunks)
        self.null = arr.is_null().to_numpy(zero_copy_only=False) if len(arr) else np.zeros(0, bool)
        self.offsets = arr.offsets.to_numpy()
        self.values = arr.values.to_numpy(zero_copy_only=False)

    def row(self, i: int) -> Optional[np.ndarray]:
        return None if self.null[i] else self.values[self.offsets[i] : self.offsets[i + 1]]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _response_roles(ids: np.ndarray, mask: np.ndarray, eos: frozenset[int]) -> str:
    trained = mask != 0
    is_eos = np.isin(ids, list(eos)) if eos else np.zeros(len(ids), bool)
    after_trained = np.concatenate([[False], trained[:-1]]) if len(ids) else trained
    last = np.arange(len(ids)) == len(ids) - 1
    appended = ~trained & is_eos & (after_trained | last)  # the EOS added after the fact
    codes = np.full(len(ids), ord(CONTEXT), np.uint8)
    codes[trained] = ord(TRAINED)
    codes[appended] = ord(APPENDED_EOS)
    return codes.tobytes().decode("ascii")


def _rounded(values: np.ndarray, known: Optional[np.ndarray] = None, digits: int = 5) -> list:
    out = np.round(values.astype(np.float64), digits).tolist()
    if known is not None:
        out = [v if k else None for v, k in zip(out, known.tolist())]
    return out


@dataclass
class _Turn:
    """One turn of a trajectory: its prompt delta then its response, as one token sequence."""

    info: dict[str, Any]
    ids: np.ndarray
    n_delta: int
    roles: str
    adv: list
    lp: list
    tlp: list
    gap: list

    def piece(self, a: int, b: int) -> dict[str, Any]:
        """Tokens [a, b) of the sequence, with the response fields of those that are response tokens."""
        r0, r1 = max(a, self.n_delta) - self.n_delta, max(b, self.n_delta) - self.n_delta
        return {
            **self.info,
            "n_delta": self.n_delta,
            "n": len(self.ids),
            "from": a,
            "ids": self.ids[a:b].tolist(),
            "roles": self.roles[a:b],
            "adv": self.adv[r0:r1],
            "lp": self.lp[r0:r1],
            "tlp": self.tlp[r0:r1],
            "gap": self.gap[r0:r1],
        }


class _Rows:
    """The dump's rows grouped into trajectories, each read turn by turn from the columns."""

    COLUMNS = (
        *("minibatch", "row", "prompt_id", "sample_index", "turn", "is_padding"),
        *("reward", "outcome_reward", "stop_reason", "env_error"),
        *("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "rollout_logprobs_known"),
        *("advantages", "trainer_logprobs"),
    )  # not routed experts, info
    LATER_COLUMNS = ("invalid", "prefix_break")  # dumps before them have none

    def __init__(self, table, eos: frozenset[int]):
        self.eos = eos
        small = table.select(
            ["minibatch", "row", "prompt_id", "sample_index", "turn", "is_padding"]
            + ["reward", "outcome_reward", "stop_reason", "env_error"]
            + [c for c in self.LATER_COLUMNS if c in table.column_names]
        ).to_pydict()
        small.setdefault("invalid", [None] * len(small["row"]))
        small.setdefault("prefix_break", [False] * len(small["row"]))
        self.small = small
        self.lists = {
            name: _ListColumn(table, name)
            for name in (
                "prompt_ids",
                "response_ids",
                "loss_mask",
                "rollout_logprobs",
                "rollout_logprobs_known",
                "advantages",
                "trainer_logprobs",
            )
        }
        groups: dict[tuple, list[int]] = {}
        for i, padding in enumerate(small["is_padding"]):
            if not padding:
                groups.setdefault((small["prompt_id"][i], small["sample_index"][i]), []).append(i)
        key = lambda i: (
            small["turn"][i] if small["turn"][i] is not None else 0,
            small["minibatch"][i],
            small["row"][i],
        )  # noqa: E731
        self.groups = [(k, sorted(rows, key=key)) for k, rows in groups.items()]

    def trajectory(self, pid: str, sample: int, rows: list[int]) -> tuple[dict[str, Any], list[_Turn]]:
        s, cols = self.small, self.lists
        turns, previous, max_gap, length = [], np.zeros(0, np.int64), None, 0
        for i in rows:
            prompt, resp = cols["prompt_ids"].row(i), cols["response_ids"].row(i)
            prompt = prompt if prompt is not None else np.zeros(0, np.int64)
            resp = resp if resp is not None else np.zeros(0, np.int64)
            n = len(resp)
            zeros = np.zeros(n, np.float32)
            mask = _or(cols["loss_mask"].row(i), np.zeros(n, np.int8))
            lp_raw = _or(cols["rollout_logprobs"].row(i), zeros)
            known = _or(cols["rollout_logprobs_known"].row(i), np.zeros(n, bool)).astype(bool)
            tlp_raw = cols["trainer_logprobs"].row(i)
            adv = _or(cols["advantages"].row(i), zeros)
            roles = _response_roles(resp, mask, self.eos)
            trained = np.frombuffer(roles.encode("ascii"), np.uint8) == ord(TRAINED)
            if tlp_raw is not None:
                has_gap = trained & known
                gaps = np.abs(lp_raw.astype(np.float64) - tlp_raw.astype(np.float64))
                gap = [float(f"{g:.3g}") if h else None for g, h in zip(gaps.tolist(), has_gap.tolist())]
                if has_gap.any():
                    worst = float(gaps[has_gap].max())
                    max_gap = worst if max_gap is None else max(max_gap, worst)
                tlp = _rounded(tlp_raw)
            else:
                gap, tlp = [None] * n, [None] * n
            start = _common_prefix(previous, prompt)
            info = {
                "turn": s["turn"][i],
                "reward": s["reward"][i],
                "stop_reason": s["stop_reason"][i],
                "env_error": s["env_error"][i],
                "invalid": s["invalid"][i],
                # a context that does not extend the previous turn's (re-tokenised history) starts earlier
                "history_kept": start == len(previous),
                "delta_from": start,
                # a gateway call whose agent changed its context: rendered fresh, a new prefix
                "prefix_break": bool(s["prefix_break"][i]),
            }
            n_delta = len(prompt) - start
            turns.append(
                _Turn(
                    info,
                    np.concatenate([prompt[start:], resp]).astype(np.int64),
                    n_delta,
                    PROMPT * n_delta + roles,
                    _rounded(adv),
                    _rounded(lp_raw, known),
                    tlp,
                    gap,
                )
            )
            previous = np.concatenate([prompt, resp])
            length += n
        last = rows[-1]
        summary = {
            "id": f"{pid}#{sample}",
            "prompt_id": pid,
            "outcome_reward": s["outcome_reward"][last],
            "stop_reason": s["stop_reason"][last],
            "env_error": next((t.info["env_error"] for t in turns if t.info["env_error"]), None),
            "invalid": s["invalid"][last],  # an infrastructure failure: never trained
            "length": length,
            "turn_count": len(turns),
            "prefix_breaks": sum(t.info["prefix_break"] for t in turns),
            "max_gap": max_gap,
        }
        return summary, turns


def _or(value: Optional[np.ndarray], default: np.ndarray) -> np.ndarray:
    return default if value is None else value


def paginate(table, decoder: Decoder, page_tokens: int = PAGE_TOKENS) -> Iterator[tuple[list[dict], list[dict]]]:
    """(trajectory summaries, that page's trajectories with their turn pieces) per page of at most
    `page_tokens` tokens; a summary's `pages` lists the (1-based) pages holding its tokens. The
    summaries of a trajectory cut over pages are complete once its last page is yielded."""
    rows = _Rows(table, decoder.eos)
    page: list[dict] = []
    used, number = 0, 1
    summaries: list[dict] = []
    for (pid, sample), group in rows.groups:
        summary, turns = rows.trajectory(pid, sample, group)
        summary["index"], summary["pages"] = len(summaries), []
        summaries.append(summary)
        total = sum(len(t.ids) for t in turns)
        if used and used + total > page_tokens:  # start it on a fresh page rather than cut it
            yield summaries, page
            page, used, number = [], 0, number + 1
        entry = {**summary, "turns": []}
        page.append(entry)
        summary["pages"].append(number)
        for turn in turns:
            a = 0
            while True:
                b = min(len(turn.ids), a + page_tokens - used)
                entry["turns"].append(turn.piece(a, b))
                used += b - a
                a = b
                if a >= len(turn.ids):
                    break
                yield summaries, page  # the turn goes on on the next page
                page, used, number = [], 0, number + 1
                entry = {**summary, "turns": []}
                page.append(entry)
                summary["pages"].append(number)
    yield summaries, page


def _vocabulary(page: list[dict], decoder: Decoder) -> dict[str, str]:
    if decoder.text is None:
        return {}
    ids = {i for t in page for u in t["turns"] for i in u["ids"]}
    return {str(i): decoder.text(i) for i in sorted(ids)}


_SURROGATE = re.compile("[\ud800-\udfff]")


def _clean(value: Any) -> Any:
    """NaN and infinities as null (JSON has neither); a lone UTF-16 surrogate (possible in the
    dump's JSON metadata) as U+FFFD, as a browser decoding it would show it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        if _SURROGATE.search(value) is None:
            return value
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")  # pairs join, lone ones go
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def render(data: dict[str, Any]) -> str:
    """One HTML file: the template with the data inlined (no server, no network).

    The JSON is pure ASCII with every <, > and & escaped, so no text (`</script>`, `<!--<script`,
    U+2028, NUL) can end or change the script element that holds it."""
    template = resources.files("megatron_stepwise.viewer").joinpath("template.html").read_text(encoding="utf-8")
    payload = json.dumps(_clean(data), separators=(",", ":"), allow_nan=False, default=str, ensure_ascii=True)
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return template.replace("/*__DATA__*/null", payload, 1)


def _header(run_dir: str | Path, meta: dict) -> dict[str, Any]:
    metrics = read_metrics(str(run_dir)) if RunDir(run_dir).metrics.is_file() else []
    curves = {
        name: [[m["iteration"], m[key]] for m in metrics if isinstance(m.get(key), (int, float))]
        for name, key in CURVES.items()
    }
    config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    return {
        "run_dir": str(run_dir),
        "iteration": meta["iteration"],
        "weight_version": meta.get("weight_version"),
        "name": config.get("name"),
        "curves": {k: v for k, v in curves.items() if v},
        "train_metrics": meta.get("train_metrics") or [],
    }


def default_path(run_dir: str | Path, iteration: int) -> Path:
    return RunDir(run_dir).view(iteration)


def write_pages(
    run_dir: str | Path,
    iteration: Optional[int] = None,
    out: Optional[str | Path] = None,
    *,
    trusted: bool = False,
    page_tokens: int = PAGE_TOKENS,
    tokenizer_source: TokenizerSource = dump_trust.recorded_tokenizer,
) -> tuple[Path, int]:
    """Write the iteration's page (or index and pages); (the page to open, how many token pages).

    Pages go to `out` (default RUN_DIR/view/iter_K.html) and, when there are several, to the
    folder `<out stem>_pages/` beside it; no write follows a symbolic link below RUN_DIR
    (rundir/run_files.py). `tokenizer_source` finds the tokenizer's name in the dump's metadata."""
    meta, table = read_dump_table(run_dir, iteration, columns=_Rows.COLUMNS, optional=_Rows.LATER_COLUMNS)
    decoder = load_decoder(meta, trusted=trusted, source=tokenizer_source)
    header = _header(run_dir, meta)
    index = Path(out) if out else default_path(run_dir, int(meta["iteration"]))
    folder = RunDir.view_pages(index)

    def write(path: Path, data: dict) -> None:
        write_path(path, render(data).encode("ascii"), base=run_dir)

    def part(number: int, page: list[dict], last: bool) -> None:
        nav = {
            "index": os.path.relpath(index, folder),
            "page": number,
            "prev": f"{number - 1:04d}.html" if number > 1 else None,
            "next": None if last else f"{number + 1:04d}.html",
        }
        data = {**header, "curves": {}, "train_metrics": [], "nav": nav, "trajectories": page}
        write(folder / f"{number:04d}.html", {**data, "vocab": _vocabulary(page, decoder)})

    pending: Optional[list[dict]] = None  # written once the next page shows whether it is the last
    count, summaries = 0, []
    for summaries, page in paginate(table, decoder, page_tokens):
        if pending is not None:
            part(count, pending, last=False)
        pending, count = page, count + 1
    if count <= 1:  # the whole iteration in one file
        page = pending or []
        write(index, {**header, "nav": None, "trajectories": page, "vocab": _vocabulary(page, decoder)})
        return index, count
    part(count, pending, last=True)
    pages_href = os.path.relpath(folder, index.parent)
    for s in summaries:
        s["href"] = f"{pages_href}/{s['pages'][0]:04d}.html#t{s['index']}"
    nav = {"pages": [f"{pages_href}/{k:04d}.html" for k in range(1, count + 1)]}
    write(index, {**header, "nav": nav, "trajectories": [{**s, "turns": None} for s in summaries], "vocab": {}})
    return index, count
