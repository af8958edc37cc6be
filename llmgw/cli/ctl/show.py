"""
How C{llmgw ctl} prints: aligned tables, times, sizes, costs.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence


def cell(value: object) -> str:
    """
    @return: C{value} as a table shows it: C{-} for nothing, yes/no, floats
        without trailing zeros, lists comma-separated.
    """
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    if isinstance(value, (list, tuple)):
        return ",".join(cell(v) for v in value) or "-"
    return str(value)


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """
    @return: C{rows} under C{header}, columns aligned, two spaces apart.
    """
    cells = [list(header)] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in cells
    ]
    return "\n".join(lines) + "\n"


def when(seconds: float | None) -> str | None:
    """
    @param seconds: POSIX seconds, or L{None}.
    @return: the local time, to the second, or L{None}.
    """
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def size(count: int) -> str:
    """
    @param count: bytes.
    @return: in B, KiB, MiB or GiB, one decimal above bytes.
    """
    amount = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{count} B"


def money(value: float | None) -> str | None:
    """
    @return: a cost to the millionth (a request's is often under a
        cent), or L{None}.
    """
    return None if value is None else f"{value:.6f}"
