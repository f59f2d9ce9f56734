"""Printing benchmark results as Markdown tables (pasted as-is into benchmarks/README.md)."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + " |")
