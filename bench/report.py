"""Result rows and the suite's table: what every benchmark returns, and how it is printed.

The bottom of the bench import graph with bench/common.py: it imports no other bench module.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def row(name: str, value: float, unit: str, anchor: str, anchor_value: float, ratio: float | None,
        goal: str | None, met: bool | None, **extra: Any) -> dict[str, Any]:
    """One result: `ratio` is defined per row (see `ratio_means`); `met` is None for info rows."""
    out: dict[str, Any] = {"name": name, "value": value, "unit": unit, "anchor": anchor,
                           "anchor_value": anchor_value, "ratio": ratio, "goal": goal, "met": met}
    out.update(extra)
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def verdict(r: dict[str, Any]) -> str:
    if r.get("met") is None:
        return "-"
    return "met" if r["met"] else "NOT met"


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    headers = ("benchmark", "value", "unit", "anchor (same run)", "anchor", "ratio", "goal", "verdict")
    cells = [(r["name"], _fmt(r["value"]), r["unit"], r["anchor"], _fmt(r["anchor_value"]),
              "-" if r["ratio"] is None else f"{_fmt(r['ratio'])}x", r["goal"] or "-", verdict(r)) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    right = {1, 4, 5}

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    return [line(headers), line(tuple("-" * w for w in widths)), *(line(c) for c in cells)]


def print_table(rows: list[dict[str, Any]], file: Any = None) -> None:
    for text in table_lines(rows):
        print(text, file=file or sys.stdout)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The same table as GitHub markdown (for BENCHMARKS.md)."""
    out = ["| benchmark | value | unit | anchor (same run) | anchor | ratio | goal | verdict |",
           "|---|--:|---|---|--:|--:|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{_fmt(r['ratio'])}x"
        mark = verdict(r)
        out.append(f"| {r['name']} | {_fmt(r['value'])} | {r['unit']} | {r['anchor']} | {_fmt(r['anchor_value'])} | "
                   f"{ratio} | {r['goal'] or '-'} | {'**NOT met**' if mark == 'NOT met' else mark} |")
    return "\n".join(out)


def report(rows: list[dict[str, Any]], json_path: str | None) -> None:
    """Print the rows as the suite's table, and write them as JSON when asked."""
    print_table(rows)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)
