"""``python -m benchmarks serve --rounds N``: the configurations run N times, interleaved, and what
is reported of them.

Round r (from 0) runs the configurations rotated by r (A B C, then B C A, then C A B, ...), each
server fresh, so a drift of the machine's load over the minutes of the runs falls on every
configuration in every position. Every comparison (``serve.ratios``: the targets, the P/D rows,
the verified hits') is computed within each round, between runs minutes apart, and reported as
the median of those paired values with their range (``paired``), judged on the median; a count
(blocks verified, mismatches) as the total over the rounds, met only where every round met it.
A configuration's figures: each round's row and their median row (``median_row``; errors: the
total).
"""

from __future__ import annotations

import re
from statistics import median
from typing import Any, Callable

Row = dict[str, Any]
OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": lambda v, b: v >= b, "<=": lambda v, b: v <= b, "|x| <=": lambda v, b: abs(v) <= b,
    "==": lambda v, b: v == b, ">": lambda v, b: v > b}


def order(configs: list[str], r: int) -> list[str]:
    """The configurations of round ``r`` (from 0): rotated by ``r``."""
    k = r % len(configs) if configs else 0
    return configs[k:] + configs[:k]


def table(results: list[Row], configs: list[str]) -> list[Row]:
    """Per concurrency and configuration (in ``configs``' order): each round's row, then their median row."""
    out = []
    for level in dict.fromkeys(r["concurrency"] for r in results):
        for config in configs:
            rows = sorted((r for r in results if r["config"] == config and r["concurrency"] == level),
                          key=lambda r: r["round"])
            out += [*rows, median_row(rows)] if rows else []
    return out


def _median(values: list[Any]) -> Any:
    if not values:
        return None
    m = median(values)
    if all(isinstance(v, int) for v in values) and m == int(m):
        return int(m)
    return round(float(m), 4)


def median_row(rows: list[Row]) -> Row:
    """The median over the rounds that ran (a failed run's row has no figures) of each figure;
    per-tier figures per key; errors summed over every round; every round's TTFTs together."""
    out: Row = {}
    ran = [r for r in rows if r.get("throughput_req_s") is not None] or rows
    for k in dict.fromkeys(k for r in rows for k in r):
        values = [r[k] for r in (rows if k in ("errors", "error_samples") else ran) if r.get(k) is not None]
        if k == "round":
            out[k] = "median"
        elif k == "errors":
            out[k] = sum(values)
        elif k == "ttft_ms":
            out[k] = [x for v in values for x in v]
        elif k == "error_samples":
            out[k] = sorted({x for v in values for x in v})[:3]
        elif values and all(isinstance(v, dict) for v in values):
            keys = dict.fromkeys(x for v in values for x in v)
            out[k] = {x: _median([v.get(x, 0) for v in values]) for x in keys}
        elif values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[k] = _median(values)
        else:
            out[k] = values[0] if values else None
    out["rounds"] = len(rows)
    return out


def _key(check: Row) -> tuple[Any, ...]:
    """A comparison across rounds: its name without the figures of its round (a recompute bound's)."""
    return check["config"], check["concurrency"], re.sub(r"\(\d[^)]*\)", "(...)", check["target"])


def judge(value: Any, bound: Any, op: str) -> bool | None:
    return None if value is None or bound is None else OPS[op](value, bound)


def paired(results: list[Row], compare: Callable[[list[Row]], list[Row]]) -> list[Row]:
    """``compare`` (rows of one round -> comparisons) per round, then per comparison: ``value``
    the median of the rounds' values (or the total of a count), ``rounds`` each round's value
    (None where a round has none), ``min`` and ``max``; the name, bound and note of the round
    nearest the median; ``met`` judged on ``value``."""
    numbers = sorted({r["round"] for r in results})
    groups: dict[tuple[Any, ...], dict[int, Row]] = {}
    for n in numbers:
        for c in compare([r for r in results if r["round"] == n]):
            groups.setdefault(_key(c), {})[n] = c
    out = []
    for by_round in groups.values():
        checks = list(by_round.values())
        values = [c["value"] for c in checks if c["value"] is not None]
        count = bool(values) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        value = sum(values) if count else _median(values)
        row = dict(min(checks, key=lambda c: abs(c["value"] - value) if c["value"] is not None and not count
                       else float("inf")))
        row.update(value=value, rounds=[by_round[n]["value"] if n in by_round else None for n in numbers],
                   min=min(values, default=None), max=max(values, default=None), count=count)
        for k in ("expected", "verified_share"):
            if k in row:
                row[k] = _median([c[k] for c in checks if c.get(k) is not None])
        judged = [c["met"] for c in checks if c["met"] is not None]
        if not judged:
            row["met"] = None
        elif count:
            row["met"] = all(judged)
        else:
            op = row.get("op") or ("<=" if "TTFT" in row["target"] else ">=")
            row["met"] = judge(value, row["bound"], op)
        out.append(row)
    return out


def span(check: Row, fmt: Callable[[Any], str]) -> str:
    """What a check line adds for a comparison over rounds (none for one run)."""
    if "rounds" not in check:
        return ""
    n = sum(v is not None for v in check["rounds"])
    if check["min"] is None:
        return ""
    if check["count"]:
        return f" [total of {n} rounds, per round {fmt(check['min'])}..{fmt(check['max'])}]"
    return f" [median of {n} paired rounds, {fmt(check['min'])}..{fmt(check['max'])}]"
