"""
The cost check of the swap bench (docs/cost.md, L{swap_bench}): once a
policy's server stopped (its GPU meter's last counts written), each
GPU's seconds in the store's C{gpu_time} rows against the run's length
(from its node's registration to the server's stop, wall seconds),
split between the requests' and the idle, beside the GPU-seconds the
usage rows of the requests carry.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from llmgw.store.gpu_time import gpu_time_query, gpu_time_rows, per_gpu

TOLERANCE = 0.01
"""
How far a GPU's seconds may be from the run's length: 1 %.
"""


def gpu_report(database: str, run: float) -> dict[str, Any]:
    """
    @param database: the server's SQLite file.
    @param run: the run's length, wall seconds.
    @return: C{{"run", "gpus": per GPU (L{per_gpu}, with C{"off"} its
        seconds' distance from C{run}, a fraction), "usage_gpu_seconds",
        "usage_cost", "ok"}}: C{ok} when every GPU is within
        L{TOLERANCE}.
    """
    with sqlite3.connect(database) as connection:
        rows = gpu_time_rows(
            connection.execute(gpu_time_query("?"), (0.0, 1e12)).fetchall()
        )
        used, cost = connection.execute(
            "SELECT COALESCE(SUM(gpu_seconds), 0), COALESCE(SUM(cost), 0) FROM usage"
        ).fetchone()
    gpus = per_gpu(rows)
    for gpu in gpus:
        gpu["off"] = (gpu["seconds"] - run) / run if run else 0.0
    return {
        "run": run,
        "gpus": gpus,
        "usage_gpu_seconds": float(used),
        "usage_cost": float(cost),
        "ok": bool(gpus) and all(abs(g["off"]) <= TOLERANCE for g in gpus),
    }


def report_lines(policy: str, report: dict[str, Any]) -> list[str]:
    """
    @return: one line per GPU, and one comparing the requests' GPU-seconds
        in the usage rows with the GPUs' requests' part.
    """
    lines = []
    for g in report["gpus"]:
        states = ", ".join(f"{k} {v:.1f}" for k, v in g["states"].items() if v)
        lines.append(
            f"{policy} GPU {g['node']}:{g['gpu']}: {g['seconds']:.1f} s of a"
            f" {report['run']:.1f} s run ({100 * g['off']:+.2f} %): requests"
            f" {g['requests']:.1f} s, idle {g['idle']:.1f} s ({states});"
            f" cost {g['cost']:.4f} (requests {g['requests_cost']:.4f},"
            f" idle {g['idle_cost']:.4f})"
        )
    served = sum(g["requests"] for g in report["gpus"])
    lines.append(
        f"{policy}: usage rows {report['usage_gpu_seconds']:.1f} GPU-s"
        f" ({report['usage_cost']:.4f}), GPUs' requests' part {served:.1f} GPU-s;"
        f" every GPU within 1 %: {'yes' if report['ok'] else 'NO'}"
    )
    return lines
