"""
What counting limits in Redis costs per admission, against counting them in
the router's memory, in the same run: one key with rpm, tpm and a budget
high enough never to refuse, C{KeyRing.admit} then C{KeyRing.used} per
request, with C{--concurrency} admissions in flight.

Targets:
  - C{memory}: the key ring alone (C{[limits]} unset);
  - C{redis}: the key ring with C{[limits] url} on a throwaway
    C{redis-server} (Debian's package) on loopback, one Lua script round
    trip per admission.

Prints admissions per second and the p50/p99 of one admission's wait, and
the ratio of Redis to memory.  One command, about 20 s:

    .venv/bin/python bench/limits_bench.py [--seconds 5] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet import defer, reactor
from twisted.internet.task import react

from llmgw.router.accounting.auth import KeyRing
from llmgw.router.accounting.limits import RedisLimits


class _NoStore:
    def add_key(self, row: dict[str, Any]) -> Any:
        raise NotImplementedError

    def revoke_key(self, key_id: int, when: float) -> Any:
        raise NotImplementedError


def _ring(limits: RedisLimits | None) -> KeyRing:
    ring = KeyRing(
        _NoStore(), clock=time.monotonic, wall_clock=time.time, limits=limits
    )
    big = 10**12
    ring.load(
        [
            {
                "id": 1,
                "name": "bench",
                "prefix": "sk-bench",
                "hash": "h",
                "models": None,
                "rpm": big,
                "tpm": big,
                "budget_tokens": big,
                "admin": False,
                "created": 0.0,
            }
        ]
    )
    return ring


async def _run(ring: KeyRing, seconds: float, concurrency: int) -> dict[str, float]:
    (key,) = ring.keys()
    waits: list[float] = []
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        while time.monotonic() < deadline:
            began = time.perf_counter()
            admitted = ring.admit(key, ["m"], 40)
            if admitted is not None:
                await admitted
            waits.append(time.perf_counter() - began)
            ring.used(key, 30, 40)
            if admitted is None:
                # Let the reactor turn, as a request would.
                await defer.succeed(None)

    began = time.monotonic()
    if ring.limits is None:
        # Synchronous admissions: one loop, no concurrency to speak of.
        await defer.Deferred.fromCoroutine(worker())
    else:
        await defer.gatherResults(
            [defer.Deferred.fromCoroutine(worker()) for _ in range(concurrency)]
        )
    elapsed = time.monotonic() - began
    waits.sort()
    return {
        "per_s": len(waits) / elapsed,
        "p50_ms": waits[len(waits) // 2] * 1000,
        "p99_ms": waits[int(len(waits) * 0.99)] * 1000,
        "n": len(waits),
    }


async def main(_: Any, args: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.redis_support import RedisServer, require_redis

    server = RedisServer(require_redis())
    server.start()
    limits = RedisLimits(server.url, reactor, threads=8)  # type: ignore[arg-type]
    try:
        memory = await _run(_ring(None), args.seconds, args.concurrency)
        redis = await _run(_ring(limits), args.seconds, args.concurrency)
    finally:
        limits.stop()
        server.stop()
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(f"{'target':8} {'admissions/s':>13} {'p50 ms':>8} {'p99 ms':>8} {'n':>8}")
    for name, r in (("memory", memory), ("redis", redis)):
        print(
            f"{name:8} {r['per_s']:13.0f} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f}"
            f" {r['n']:8.0f}"
        )
    print(
        f"redis / memory admissions per second: {redis['per_s'] / memory['per_s']:.4f}"
        f" ({args.concurrency} in flight against Redis)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    react(main, [parser.parse_args()])
