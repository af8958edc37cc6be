"""
The GPU time the control plane's meter counted (L{llmgw.control.meter},
docs/cost.md): per hour, GPU, model and state, the seconds, the seconds
apportioned to requests (C{busy}) and their price.  The row type and the
SQL both engines share, and the sums the usage report and the swap bench
read of them (pure).

A leaf, as the whole store: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

HOUR = 3600.0
"""
Seconds in one row's hour: rows are kept per UTC hour, from the epoch.
"""

STATES = ("starting", "awake", "asleep", "free")
"""
What a GPU's second was: held by a replica starting (or waking), awake,
asleep, or held by none.
"""


@dataclass(frozen=True)
class GpuTimeRow:
    """
    One row of the C{gpu_time} table, or what a meter adds to it.

    @ivar hour: the start of its UTC hour, POSIX seconds.
    @ivar node: the node's id.
    @ivar gpu: the GPU's index on its node.
    @ivar gpu_name: its model name, as its agent reports it.
    @ivar model: the model whose replica held it; C{""} for none.
    @ivar state: one of L{STATES}.
    @ivar seconds: GPU-seconds: a shared GPU's second counts each holder's
        share, and the rest as C{free}.
    @ivar busy: of those, the seconds apportioned to requests (awake
        with a request in flight).
    @ivar cost: the price of C{seconds}.
    @ivar busy_cost: the price of C{busy}.
    """

    hour: float
    node: str
    gpu: int
    gpu_name: str
    model: str
    state: str
    seconds: float
    busy: float = 0.0
    cost: float = 0.0
    busy_cost: float = 0.0


GPU_TIME_COLUMNS = (
    "hour, node, gpu, gpu_name, model, state, seconds, busy, cost, busy_cost"
)


def gpu_time_upsert(p: str) -> str:
    """
    @param p: the engine's parameter mark, C{?} or C{%s}.
    @return: the statement adding one row's seconds and cost to its
        hour's (two writes of the meter add up, never replace).
    """
    marks = ",".join([p] * 10)
    return (
        f"INSERT INTO gpu_time ({GPU_TIME_COLUMNS}) VALUES ({marks})"
        " ON CONFLICT (hour, node, gpu, model, state) DO UPDATE SET"
        " seconds = gpu_time.seconds + excluded.seconds,"
        " busy = gpu_time.busy + excluded.busy,"
        " cost = gpu_time.cost + excluded.cost,"
        " busy_cost = gpu_time.busy_cost + excluded.busy_cost,"
        " gpu_name = excluded.gpu_name"
    )


def gpu_time_query(p: str) -> str:
    """
    @return: the rows whose hour starts in C{[since, until)}, taking
        C{(since, until)}.
    """
    return (
        f"SELECT {GPU_TIME_COLUMNS} FROM gpu_time"
        f" WHERE hour >= {p} AND hour < {p} ORDER BY hour, node, gpu, model, state"
    )


def gpu_time_values(row: GpuTimeRow) -> tuple[Any, ...]:
    """
    @return: the values of L{GPU_TIME_COLUMNS} for one row.
    """
    return (
        row.hour,
        row.node,
        row.gpu,
        row.gpu_name,
        row.model,
        row.state,
        row.seconds,
        row.busy,
        row.cost,
        row.busy_cost,
    )


def gpu_time_rows(rows: Iterable[Sequence[Any]]) -> list[GpuTimeRow]:
    """
    @return: the rows L{gpu_time_query} read.
    """
    return [
        GpuTimeRow(
            float(r[0]),
            str(r[1]),
            int(r[2]),
            str(r[3]),
            str(r[4]),
            str(r[5]),
            float(r[6]),
            float(r[7]),
            float(r[8]),
            float(r[9]),
        )
        for r in rows
    ]


def per_gpu(rows: Iterable[GpuTimeRow]) -> list[dict[str, Any]]:
    """
    @return: per GPU (by node and index), its seconds in all and by state,
        the seconds apportioned to requests and the rest (idle), and the
        same priced: C{{"node", "gpu", "gpu_name", "seconds", "states":
        {state: seconds}, "requests", "idle", "cost", "requests_cost",
        "idle_cost"}}, ordered by node and index.
    """
    gpus: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        gpu = gpus.setdefault(
            (row.node, row.gpu),
            {
                "node": row.node,
                "gpu": row.gpu,
                "gpu_name": row.gpu_name,
                "seconds": 0.0,
                "states": dict.fromkeys(STATES, 0.0),
                "requests": 0.0,
                "cost": 0.0,
                "requests_cost": 0.0,
            },
        )
        gpu["seconds"] += row.seconds
        gpu["states"][row.state] = gpu["states"].get(row.state, 0.0) + row.seconds
        gpu["requests"] += row.busy
        gpu["cost"] += row.cost
        gpu["requests_cost"] += row.busy_cost
    for gpu in gpus.values():
        gpu["idle"] = gpu["seconds"] - gpu["requests"]
        gpu["idle_cost"] = gpu["cost"] - gpu["requests_cost"]
    return [gpus[k] for k in sorted(gpus)]


def idle_by_day(rows: Iterable[GpuTimeRow]) -> dict[float, tuple[float, float]]:
    """
    @return: per UTC day start (POSIX seconds), the GPU-seconds no request
        was given (starting, asleep, awake with none in flight, held by
        none) and their price.
    """
    days: dict[float, tuple[float, float]] = {}
    for row in rows:
        day = (row.hour // 86400.0) * 86400.0
        seconds, cost = days.get(day, (0.0, 0.0))
        days[day] = (seconds + row.seconds - row.busy, cost + row.cost - row.busy_cost)
    return days


def idle_rows(by: str, rows: Iterable[GpuTimeRow]) -> list[dict[str, Any]]:
    """
    The usage report's idle row (docs/cost.md): the GPU time no request
    was given, and its price.

    @param by: the report's grouping: C{"day"} gives one row per UTC day
        with GPU time (C{"day"} its start, POSIX seconds); C{"key"} or
        C{"model"} one row for the whole range.
    @return: C{{"day"?, "gpu_seconds", "cost"}} rows.
    """
    days = idle_by_day(rows)
    if by == "day":
        return [
            {"day": day, "gpu_seconds": seconds, "cost": cost}
            for day, (seconds, cost) in sorted(days.items())
        ]
    return [
        {
            "gpu_seconds": sum(s for s, _ in days.values()),
            "cost": sum(c for _, c in days.values()),
        }
    ]
