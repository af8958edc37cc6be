"""
Reading the report of C{wrk --latency} (wrk's C{src/wrk.c} prints it).
"""

from __future__ import annotations

import re

from children import BenchError

_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _wrk_latency(output: str, percent: str) -> float:
    match = re.search(
        rf"^\s*{percent}(?:\.0+)?%\s+([\d.]+)(us|ms|s|m)\s*$", output, re.M
    )
    if match is None:
        raise BenchError(f"wrk printed no {percent}% latency:\n{output}")
    return float(match[1]) * _UNITS[match[2]]


def parse_wrk(output: str) -> dict[str, float]:
    """
    The figures of C{wrk --latency}'s report.

    @return: C{requests}, C{requests_per_s}, C{p50_ms}, C{p99_ms},
        C{non_2xx}, C{socket_errors}.
    @raise BenchError: no C{Requests/sec} line.
    """
    rate = re.search(r"^Requests/sec:\s+([\d.]+)", output, re.M)
    total = re.search(r"^\s*(\d+) requests in", output, re.M)
    if rate is None or total is None:
        raise BenchError(f"cannot read wrk's report:\n{output}")
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    return {
        "requests": int(total[1]),
        "requests_per_s": float(rate[1]),
        "p50_ms": _wrk_latency(output, "50"),
        "p99_ms": _wrk_latency(output, "99"),
        "non_2xx": int(non_2xx[1]) if non_2xx else 0,
        "socket_errors": sum(int(n) for n in errors.groups()) if errors else 0,
    }
