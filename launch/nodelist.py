"""Expand SLURM host lists (`node[01-04,07],gpu3`, `rack[1-2]-n[1-2]`) without scontrol."""

from __future__ import annotations

import re

_GROUP = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    items.append("".join(current))
    return [i.strip() for i in items if i.strip()]


def _expand_range(body: str, text: str) -> list[str]:
    """`01-03,07` -> ["01", "02", "03", "07"] (the start's zero padding is kept)."""
    out = []
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in host list {text!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {part!r} in host list {text!r}")
        width = len(lo)
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def _expand_item(item: str, text: str) -> list[str]:
    match = _GROUP.search(item)
    if not match:
        if "[" in item or "]" in item:
            raise ValueError(f"bad host list entry {item!r} in {text!r}")
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    return [head + value + rest for value in _expand_range(match.group(1), text) for rest in _expand_item(tail, text)]


def expand_nodelist(text: str) -> list[str]:
    """Host names of a SLURM node list, in order; ValueError if it is malformed or empty."""
    hosts = [h for item in _split_top_level(text) for h in _expand_item(item, text)]
    if not hosts:
        raise ValueError(f"empty host list {text!r}")
    return hosts
