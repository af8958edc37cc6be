"""
Routing policies side by side, on replicas of unequal speed with prefix
caches (issue 11 item 6).

Four C{llmgw sim} replicas of one model, two fast and two three times
slower (C{--speed}), each with a KV capacity in tokens (requests beyond it
wait) and an LRU prefix cache smaller than the shared prompts together
(C{--prefill-per-token}: a cache hit saves prefill).  The workload
(L{routing_workload}): 200 multi-turn chat sessions over 10 system prompts
of 1,000 to 2,000 tokens, sessions starting as a Poisson process at a rate
that offers 70% of the replicas' capacity, capacity computed from the
simulator's parameters with no cache hit (slots: the KV capacity over the
mean request's tokens, or C{--max-concurrency}; service: ttft, prefill of
the whole prompt and the answer's tokens, over the speed).

Each policy gets the same requests at the same times against fresh
replicas (restarted, caches empty):

    - llmgw (C{twistd llmgw-server}, static C{[[endpoints]]}) with
      C{[router] balance} = C{round_robin}, C{least_in_flight}, C{load},
      and C{load} with C{prefix_affinity = true};
    - vLLM's router (C{vllm-router}, from the C{bench} extra:
      C{pip install -e '.[bench]'}) with C{--policy} C{round_robin},
      C{power_of_two} and C{cache_aware}.

Reported per policy: p50/p95/p99 time to first token (the first SSE event
at the client), throughput (answers and their tokens per second completed
while requests were being sent: the window from the first request sent to
the last),
the prefix cache hit rate (tokens, from the replicas' counters) and each
replica's share of requests and mean queue.  Then the issue's checks:
llmgw load-aware + prefix has p95 TTFT at least 2x better than round robin,
better than least in flight, no worse than the best vLLM router policy,
and throughput no lower than any.

Run::

    .venv/bin/python bench/routing_bench.py [--sessions 200] [--load 0.7]
        [--policies llmgw-rr,llmgw-lif,...] [--json results.json]

Exit status: 0, 1 when requests failed or a check failed, 2 on a setup
error.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from children import BenchError, Children
from routing_workload import (
    Outcome,
    Sampler,
    Session,
    Shape,
    get_json,
    make_sessions,
    run_sessions,
)

BIN = os.path.dirname(sys.executable)
MODEL = "bench-model"


@dataclass(frozen=True)
class Replica:
    """
    One simulator's settings.
    """

    name: str
    speed: float


REPLICAS = (
    Replica("fast-1", 1.0),
    Replica("fast-2", 1.0),
    Replica("slow-1", 1 / 3),
    Replica("slow-2", 1 / 3),
)
TTFT = 0.01
ITL = 0.01
PREFILL_PER_TOKEN = 0.0002
"""
Seconds per uncached prompt token at speed 1: a 1,500-token system prompt
costs 0.3 s of prefill on a fast replica, 0.9 s on a slow one.
"""
KV_CAPACITY = 8192
"""
Tokens per replica: about four of the workload's requests run at once.
"""
PREFIX_CACHE_TOKENS = 6144
"""
Tokens of prefix cache per replica: about four of the ten system prompts,
so a policy that spreads every prompt over every replica thrashes it.
"""
MAX_CONCURRENCY = 64

POLICIES: dict[str, tuple[str, dict[str, object]]] = {
    "llmgw-round-robin": (
        "llmgw",
        {"balance": "round_robin", "prefix_affinity": False},
    ),
    "llmgw-least-in-flight": (
        "llmgw",
        {"balance": "least_in_flight", "prefix_affinity": False},
    ),
    "llmgw-load": ("llmgw", {"balance": "load", "prefix_affinity": False}),
    "llmgw-load+prefix": ("llmgw", {"balance": "load", "prefix_affinity": True}),
    "llmgw-load+prefix+weights": (
        "llmgw",
        {"balance": "load", "prefix_affinity": True, "weights": True},
    ),
    "vllm-round-robin": ("vllm-router", {"policy": "round_robin"}),
    "vllm-power-of-two": ("vllm-router", {"policy": "power_of_two"}),
    "vllm-cache-aware": ("vllm-router", {"policy": "cache_aware"}),
}
"""
Policy name: the router and its settings.  C{weights}: each endpoint's
C{weight} is its replica's speed (what an operator who knows the hardware
declares); otherwise every weight is 1 and the routers know only what they
observe.
"""
DEFAULT_POLICIES = [p for p in POLICIES if p != "llmgw-load+prefix+weights"]


def capacity(shape: Shape, mean_prompt: float) -> float:
    """
    Requests per second the replicas serve together with no cache hit.

    @param mean_prompt: the workload's mean prompt length, tokens.
    """
    kv = mean_prompt + shape.max_tokens
    slots = min(MAX_CONCURRENCY, max(1, int(KV_CAPACITY // kv)))
    service = TTFT + mean_prompt * PREFILL_PER_TOKEN + (shape.max_tokens - 1) * ITL
    return sum(slots * r.speed / service for r in REPLICAS)


def start_replicas(children: Children, tag: str) -> list[int]:
    """
    Start the four simulators; their ports.
    """
    started = []
    for r in REPLICAS:
        argv = [
            os.path.join(BIN, "llmgw"),
            "sim",
            "--port",
            "0",
            "--model",
            MODEL,
            "--ttft",
            str(TTFT),
            "--itl",
            str(ITL),
            "--prefill-per-token",
            str(PREFILL_PER_TOKEN),
            "--speed",
            repr(r.speed),
            "--kv-capacity",
            str(KV_CAPACITY),
            "--prefix-cache-tokens",
            str(PREFIX_CACHE_TOKENS),
            "--max-concurrency",
            str(MAX_CONCURRENCY),
        ]
        started.append(children.start(f"{tag}-{r.name}", "0", argv))
    pattern = r"llmgw sim listening on http://127\.0\.0\.1:(\d+)"
    return [int(c.wait_for(pattern)[1]) for c in started]


def _toml(value: object) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


def start_llmgw(
    children: Children, tag: str, ports: list[int], keys: dict[str, object]
) -> int:
    """
    C{twistd llmgw-server} over the replicas with C{keys} in C{[router]}.
    """
    state = tempfile.mkdtemp(prefix=f"{tag}-", dir=children.directory)
    router = {k: v for k, v in keys.items() if k != "weights"}
    lines = [
        'listen = "tcp:0:interface=127.0.0.1"',
        'admin_listen = "tcp:0:interface=127.0.0.1"',
        "[store]",
        "record_usage = false",
        "[router]",
        *(f"{k} = {_toml(v)}" for k, v in router.items()),
    ]
    for r, port in zip(REPLICAS, ports, strict=True):
        lines += [
            "[[endpoints]]",
            f'id = "{r.name}"',
            f'url = "http://127.0.0.1:{port}"',
            f'models = ["{MODEL}"]',
            f"weight = {r.speed if keys.get('weights') else 1.0!r}",
        ]
    config = os.path.join(state, "llmgw.toml")
    with open(config, "w") as f:
        f.write("\n".join(lines) + "\n")
    server = children.start(
        tag,
        "0",
        [
            os.path.join(BIN, "twistd"),
            "-n",
            "--pidfile=",
            "llmgw-server",
            "--config",
            config,
            "--state-dir",
            state,
        ],
    )
    return int(server.wait_for(r"client API listening on 127\.0\.0\.1:(\d+)")[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def find_vllm_router() -> str | None:
    """
    The C{vllm-router} launcher beside this Python, else on C{PATH}.
    """
    here = os.path.join(BIN, "vllm-router")
    return here if os.path.exists(here) else shutil.which("vllm-router")


def start_vllm_router(
    children: Children, tag: str, ports: list[int], policy: str, binary: str
) -> int:
    """
    vLLM's router over the replicas with C{--policy policy}.
    """
    port = _free_port()
    router = children.start(
        tag,
        "0",
        [
            binary,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            policy,
            "--log-level",
            "warning",
            "--worker-urls",
            *(f"http://127.0.0.1:{p}" for p in ports),
        ],
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return port
        except OSError:
            pass
        if router.popen.poll() is not None:
            raise BenchError(f"{tag} exited:\n{router.output()[-2000:]}")
        time.sleep(0.2)
    raise BenchError(f"{tag}: not healthy in 60 s")


@dataclass
class Row:
    """
    One policy's figures; times in seconds.
    """

    policy: str
    requests: int
    failed: int
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    answers_per_s: float
    tokens_per_s: float
    hit_rate: float
    shares: list[float]
    mean_waiting: list[float]
    error: str = ""


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(
    policy: str,
    outcomes: list[Outcome],
    stats: list[dict[str, object]],
    sampler: Sampler,
    max_tokens: int,
) -> Row:
    """
    One policy's row from its outcomes and the replicas' counters.
    """
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    # Throughput over the window in which requests were being sent: a
    # policy that keeps up completes them as they come; one that falls
    # behind holds the difference in its queues when the window closes.
    # (Over the whole run, every policy ends up serving every request.)
    start = min(o.sent for o in outcomes) if outcomes else 0.0
    last = max(o.sent for o in outcomes) if outcomes else 0.0
    done = [o for o in ok if o.sent + (o.latency or 0.0) <= last]
    span = last - start if last > start else float("nan")
    served = [float(s["requests_total"]) for s in stats]  # type: ignore[arg-type]
    total = sum(served) or 1.0
    queries = sum(float(s["prefix_cache_queries"]) for s in stats)  # type: ignore[arg-type]
    hits = sum(float(s["prefix_cache_hits"]) for s in stats)  # type: ignore[arg-type]
    return Row(
        policy=policy,
        requests=len(outcomes),
        failed=len(outcomes) - len(ok),
        ttft_p50=_pct(ttfts, 0.50),
        ttft_p95=_pct(ttfts, 0.95),
        ttft_p99=_pct(ttfts, 0.99),
        answers_per_s=len(done) / span,
        tokens_per_s=len(done) * max_tokens / span,
        hit_rate=hits / queries if queries else 0.0,
        shares=[s / total for s in served],
        mean_waiting=[statistics.fmean(w) if w else 0.0 for w in sampler.waiting],
    )


def run_policy(
    policy: str,
    sessions: list[Session],
    shape: Shape,
    directory: str,
    vllm_router: str | None,
) -> Row:
    """
    Fresh replicas, the router under test, the whole workload; then stop.
    """
    kind, keys = POLICIES[policy]
    if kind == "vllm-router" and vllm_router is None:
        return _missing(policy, "vllm-router not installed: pip install -e '.[bench]'")
    children = Children(directory, pin=False)
    try:
        ports = start_replicas(children, policy)
        if kind == "llmgw":
            port = start_llmgw(children, policy, ports, keys)
        else:
            assert vllm_router is not None
            port = start_vllm_router(
                children, policy, ports, str(keys["policy"]), vllm_router
            )
        outcomes, sampler = run_sessions(port, sessions, ports)

        async def all_stats() -> list[dict[str, object]]:
            return [await get_json("127.0.0.1", p, "/sim/stats") for p in ports]

        try:
            stats = asyncio.run(all_stats())
        except OSError as e:
            dead = [
                f"{c.name} exited {c.popen.returncode}: {c.output()[-300:]!r}"
                for c in children.all()
                if c.popen.poll() is not None
            ]
            raise BenchError(f"replica counters unreadable ({e}); {dead}") from None
        return summarize(policy, outcomes, stats, sampler, shape.max_tokens)
    except BenchError as e:
        sys.stderr.write(f"routing_bench: {policy}: {e}\n")
        return _missing(policy, str(e).splitlines()[0][:200])
    finally:
        children.stop_all()


def _missing(policy: str, why: str) -> Row:
    nan = float("nan")
    return Row(policy, 0, 0, nan, nan, nan, nan, nan, nan, [], [], error=why)


def checks(rows: dict[str, Row]) -> list[tuple[str, bool | None]]:
    """
    The issue's Done-when checks; None where a row is missing.
    """
    best = rows.get("llmgw-load+prefix")
    rows = {n: r for n, r in rows.items() if n != "llmgw-load+prefix+weights"}
    out: list[tuple[str, bool | None]] = []

    def have(*names: str) -> bool:
        return all(n in rows and not rows[n].error for n in names)

    if best is None or best.error:
        return [("llmgw-load+prefix ran", False)]
    if have("llmgw-round-robin"):
        rr = rows["llmgw-round-robin"].ttft_p95
        out.append(
            (
                f"p95 TTFT >= 2x better than round robin ({rr / best.ttft_p95:.1f}x)",
                rr >= 2 * best.ttft_p95,
            )
        )
    if have("llmgw-least-in-flight"):
        lif = rows["llmgw-least-in-flight"].ttft_p95
        out.append(
            (
                f"p95 TTFT better than least in flight ({lif / best.ttft_p95:.2f}x)",
                best.ttft_p95 < lif,
            )
        )
    vllm = [r for n, r in rows.items() if n.startswith("vllm-") and not r.error]
    if vllm:
        top = min(vllm, key=lambda r: r.ttft_p95)
        out.append(
            (
                f"p95 TTFT no worse than the best vLLM router policy, {top.policy} "
                f"({top.ttft_p95 / best.ttft_p95:.2f}x)",
                best.ttft_p95 <= top.ttft_p95,
            )
        )
    else:
        out.append(("vLLM router policies ran", None))
    others = [r for r in rows.values() if r is not best and not r.error]
    if others:
        most = max(others, key=lambda r: r.answers_per_s)
        out.append(
            (
                f"throughput no lower than any ({best.answers_per_s:.2f}/s vs "
                f"{most.policy} {most.answers_per_s:.2f}/s)",
                best.answers_per_s >= most.answers_per_s,
            )
        )
    return out


def _ms(x: float) -> str:
    return "   n/a" if math.isnan(x) else f"{x * 1000:6.0f}"


def print_table(rows: list[Row]) -> None:
    """
    The figures, one line per policy.
    """
    names = " ".join(f"{r.name:>6}" for r in REPLICAS)
    print(
        f"{'policy':<24}{'reqs':>5}{'fail':>5} {'p50':>6} {'p95':>6} {'p99':>6} "
        f"{'ans/s':>6} {'tok/s':>6} {'hit%':>5}  {names}  {names}"
    )
    for r in rows:
        if r.error:
            print(f"{r.policy:<24} not run: {r.error}")
            continue
        shares = " ".join(f"{s * 100:6.0f}" for s in r.shares)
        queues = " ".join(f"{w:6.1f}" for w in r.mean_waiting)
        print(
            f"{r.policy:<24}{r.requests:>5}{r.failed:>5} {_ms(r.ttft_p50)} "
            f"{_ms(r.ttft_p95)} {_ms(r.ttft_p99)} {r.answers_per_s:6.2f} "
            f"{r.tokens_per_s:6.0f} {r.hit_rate * 100:5.1f}  {shares}  {queues}"
        )
    print(
        "TTFT p50/p95/p99 in ms at the client; hit%: prefix cache tokens hit over"
        " tokens queried; then each replica's share of requests (%), then its"
        " mean queue (vllm:num_requests_waiting, sampled each second)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--load", type=float, default=0.7, help="offered load over capacity")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated, of {', '.join(POLICIES)}",
    )
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--keep", action="store_true", help="keep the child logs")
    args = p.parse_args()
    policies = [x for x in args.policies.split(",") if x]
    unknown = [x for x in policies if x not in POLICIES]
    if unknown:
        p.error(f"unknown policies {unknown}; known: {list(POLICIES)}")
    shape = Shape(sessions=args.sessions, turns=args.turns)
    probe = make_sessions(shape, MODEL, 1.0, args.seed)
    prompts = [t.prompt_tokens for s in probe for t in s.turns]
    cap = capacity(shape, statistics.fmean(prompts))
    rate = args.load * cap
    sessions = make_sessions(shape, MODEL, rate / shape.turns, args.seed)
    print(
        f"routing_bench: {len(REPLICAS)} replicas (speeds "
        f"{', '.join(f'{r.speed:.2f}' for r in REPLICAS)}), capacity {cap:.1f} req/s "
        f"with no cache hit; offering {rate:.1f} req/s ({args.load:.0%}): "
        f"{shape.sessions} sessions x {shape.turns} turns over {shape.prompts} system "
        f"prompts, mean prompt {statistics.fmean(prompts):.0f} tokens; sessions start "
        f"over {sessions[-1].start:.0f} s; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    vllm_router = find_vllm_router()
    directory = tempfile.mkdtemp(prefix="routing-bench-")
    rows: dict[str, Row] = {}
    started = time.monotonic()
    try:
        for policy in policies:
            t = time.monotonic()
            rows[policy] = run_policy(policy, sessions, shape, directory, vllm_router)
            r = rows[policy]
            took = time.monotonic() - t
            print(
                f"  {policy}: {took:.0f} s, p95 TTFT {_ms(r.ttft_p95)} ms"
                + (f" ({r.error})" if r.error else ""),
                flush=True,
            )
    finally:
        if args.keep:
            print(f"child logs kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    print()
    print_table(list(rows.values()))
    print(
        f"\n{time.monotonic() - started:.0f} s in all; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    failed = any(r.failed for r in rows.values())
    status = 0
    for text, ok in checks(rows):
        print(f"  {'PASS' if ok else 'n/a ' if ok is None else 'FAIL'}  {text}")
        status |= ok is False
    if failed:
        print("  FAIL  requests failed (see the fail column)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows.values()], f, indent=1)
    return 1 if failed or status else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        sys.stderr.write(f"routing_bench: {e}\n")
        sys.exit(2)
