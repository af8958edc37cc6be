"""
More models than GPUs (issue 25 item 6): one node with 2 simulated GPUs,
4 models that take one GPU each, and a workload that moves between them,
served under each swap policy side by side, the same requests for each.

    .venv/bin/python bench/swap_bench.py [--minutes 10] [--compress 6]
        [--tokens 16] [--policies today,cold,sleep,batch[,in-use]]
        [--json results.json]

The policies, as configuration:

- C{today}: C{[control] evict = false}, no eviction (before issue 25);
- C{cold}: evict the least recently used and stop it, no batching
  (C{swap_max_wait = "0s"}), as Ollama and llama-swap do;
- C{sleep}: evict, the replicas evicted sleep (C{sleep = "weights"}), no
  batching;
- C{batch}: evict, sleep, and swap batching as shipped: a busy model keeps
  its room for up to 30 s of another model's wait (C{swap_max_wait}, its
  default);
- C{in-use} (only when named): C{batch}, and a model used in the last 30 s
  counts as busy for up to 10 s of another model's wait (C{swap_in_use},
  C{swap_max_wait = "10s"}): fewer swaps for a longer wait.

The engines are C{llmgw sim} replicas started by a real C{twistd -n
llmgw-agent} with two C{[[simulated_gpus]]} of 80 GB (each model needs
60 GB, so one model per GPU), under a real C{twistd -n llmgw-server}, over
mutual TLS with certificates made by C{llmgw certs}.  A cold start is
C{--load-seconds} (20 s simulated), a wake C{--wake-seconds} (2 s).

Time is compressed by C{--compress}: every duration (the sim's cold start,
wake, time to first token and between tokens, the workload's gaps, the
server's timeouts) is divided by it, and every figure is multiplied back,
so the report is in simulated seconds.  10 simulated minutes at the
default 6 take 100 s of wall time per policy.

The workload (the same for every policy, from C{--seed}): Poisson arrivals
at C{--rate} requests per simulated second; a "hot" model changes after
an exponential burst (mean C{--burst} simulated seconds) and takes 70 % of
the requests, the rest spread over all four.  Each request is a streamed
chat completion of C{--tokens} tokens (16); its time to first token is
from sending to the first content event.

Reported per policy: time to first token p50, p95, p99 (simulated
seconds, of the requests answered), requests failed (any status but 200,
or a stream without C{[DONE]}), swaps per simulated minute (the server's
C{llmgw_swaps_total} but C{idle_sleep}, or, for C{today}, replicas
started beyond the first two), and GPU-seconds idle: simulated
GPU-seconds in which a GPU held a ready replica with none of its model's
requests outstanding while a request for a model without a ready replica
waited (sampled from the admin API every 0.25 s of wall time).

And the cost check (docs/cost.md, L{cost_check}): once each policy's
server stopped, each GPU's seconds in the meter's rows against the run's
length (from the node's registration to the server's stop, wall
seconds), split between the requests' and the idle, and the requests'
GPU-seconds in the usage rows beside them; the GPUs priced at
L{swap_config.GPU_HOUR} an hour.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from children import BenchError, Children
from cost_check import gpu_report, report_lines
from swap_config import AGENT_CONFIG, MODELS, Shape, server_config

BIN = os.path.dirname(sys.executable)
REQUEST_TIMEOUT = 600.0
"""
Wall seconds one request may take at most, queueing included.
"""

_SLEEP = {"evict": True, "sleep": "weights", "resident": 10.0}

POLICIES: dict[str, dict[str, Any]] = {
    "today": {"evict": False, "sleep": "off", "swap_max_wait": None, "resident": 10.0},
    "cold": {"evict": True, "sleep": "off", "swap_max_wait": 0.0, "resident": 10.0},
    "sleep": {**_SLEEP, "swap_max_wait": 0.0},
    "batch": {**_SLEEP, "swap_max_wait": 30.0},
    "in-use": {**_SLEEP, "swap_max_wait": 10.0, "in_use": 30.0},
}

DEFAULT_POLICIES = ("today", "cold", "sleep", "batch")
"""
Those run unless C{--policies} says otherwise (C{in-use} on request: the
four take under 10 minutes).
"""


def workload(
    seed: int, minutes: float, rate: float, burst: float
) -> list[tuple[float, str]]:
    """
    @return: C{(simulated seconds from the start, model)} per request, in
        order of arrival.
    """
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    now, hot = 0.0, MODELS[0]
    switch = rng.expovariate(1 / burst)
    end = minutes * 60
    while True:
        now += rng.expovariate(rate)
        if now >= end:
            return out
        while now >= switch:
            hot = rng.choice([m for m in MODELS if m != hot])
            switch += rng.expovariate(1 / burst)
        model = hot if rng.random() < 0.7 else rng.choice(MODELS)
        out.append((now, model))


@dataclass
class Outcome:
    """
    What became of one request.
    """

    model: str
    ttft: float | None = None
    failed: str = ""
    done: bool = False


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    idle_gpu_seconds: float = 0.0


async def _stream(
    port: int, model: str, outcome: Outcome, compress: float, shape: Shape
) -> None:
    """
    One streamed chat completion through llmgw; fills C{outcome}.
    """
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": shape.tokens,
            "stream": True,
        }
    ).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        outcome.failed = f"connect: {e}"
        return
    try:
        writer.write(request)
        status_line = await reader.readline()
        status = status_line.split(None, 2)[1:2]
        if status != [b"200"]:
            outcome.failed = status_line.decode(errors="replace").strip()
            return
        async for line in _lines(reader):
            if line.startswith(b"data: [DONE]"):
                outcome.done = True
            elif line.startswith(b"data: ") and outcome.ttft is None:
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.failed = "error event"
                    return
                choices = event.get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    outcome.ttft = (time.monotonic() - start) * compress
        if not outcome.done:
            outcome.failed = "stream ended without [DONE]"
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        outcome.failed = f"{type(e).__name__}: {e}"
    finally:
        writer.close()


async def _lines(reader: asyncio.StreamReader) -> Any:
    """
    The body's lines: the headers skipped, chunked framing undone.
    """
    chunked = False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line:
            chunked = True
    pending = b""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            pending += data[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                break
            pending += data
        *whole, pending = pending.split(b"\n")
        for line in whole:
            yield line.rstrip(b"\r")
    if pending:
        yield pending


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.loads(answer.read())


def _metric_sum(admin: str, name: str, but: str = "") -> float:
    """The sum of C{name}'s samples but those whose labels hold C{but}."""
    with urllib.request.urlopen(admin + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if not but or but not in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _sample(
    admin: str,
    tally: Tally,
    outstanding: dict[str, int],
    stop: asyncio.Event,
    compress: float,
) -> None:
    """
    Every 0.25 s: GPUs holding a ready replica whose model has nothing
    outstanding while a request for a model with no ready replica waits.
    """
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            replicas = (
                await loop.run_in_executor(None, _get, admin + "/api/v1/replicas")
            )["replicas"]
        except (OSError, ValueError):
            replicas = []
        ready = {r["model"]: r for r in replicas if r["state"] == "ready"}
        waiting = any(n and m not in ready for m, n in outstanding.items())
        if waiting:
            idle = sum(
                len(s["gpus"])
                for model, r in ready.items()
                if not outstanding.get(model)
                for s in r["shards"]
            )
            tally.idle_gpu_seconds += idle * 0.25 * compress
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


async def _drive(
    port: int,
    admin: str,
    requests: list[tuple[float, str]],
    compress: float,
    shape: Shape,
) -> Tally:
    tally = Tally()
    outstanding = {m: 0 for m in MODELS}
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(_sample(admin, tally, outstanding, stop, compress))
    start = time.monotonic()

    async def one(at: float, model: str) -> None:
        await asyncio.sleep(max(0.0, start + at / compress - time.monotonic()))
        outcome = Outcome(model)
        tally.outcomes.append(outcome)
        outstanding[model] += 1
        try:
            await asyncio.wait_for(
                _stream(port, model, outcome, compress, shape), REQUEST_TIMEOUT
            )
        except TimeoutError:
            outcome.failed = "timed out"
        finally:
            outstanding[model] -= 1

    await asyncio.gather(*(one(at, model) for at, model in requests))
    stop.set()
    await sampler
    return tally


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _certs(directory: str) -> str:
    ca = os.path.join(directory, "ca")
    llmgw = os.path.join(BIN, "llmgw")
    for args in (
        ["init", "--dir", ca],
        ["server", "--dir", ca, "--host", "127.0.0.1"],
        ["agent", "--dir", ca, "--node-id", "node-1"],
    ):
        subprocess.run([llmgw, "certs", *args], check=True, capture_output=True)
    return ca


def run_policy(
    name: str,
    requests: list[tuple[float, str]],
    compress: float,
    shape: Shape,
    keep: bool,
) -> dict[str, Any]:
    """
    Start a server and an agent with the policy's configuration, send the
    requests, and measure.
    """
    directory = tempfile.mkdtemp(prefix=f"llmgw-swap-{name}-")
    children = Children(directory, pin=False)
    try:
        ca = _certs(directory)
        api, admin, agents = _free_port(), _free_port(), _free_port()
        ports = random.randrange(21000, 30000)
        config = os.path.join(directory, "server.toml")
        with open(config, "w") as f:
            f.write(server_config(ca, POLICIES[name], shape, compress, ports))
        agent_config = os.path.join(directory, "agent.toml")
        with open(agent_config, "w") as f:
            f.write(AGENT_CONFIG)
        twistd = os.path.join(BIN, "twistd")
        server = children.start(
            "server",
            "0",
            [
                twistd,
                "-n",
                "--pidfile=",
                "llmgw-server",
                "--config",
                config,
                "--state-dir",
                os.path.join(directory, "server-state"),
                "--listen",
                f"tcp:{api}:interface=127.0.0.1",
                "--admin-listen",
                f"tcp:{admin}:interface=127.0.0.1",
                "--agent-listen",
                f"tcp:{agents}:interface=127.0.0.1",
            ],
        )
        server.wait_for(r"client API listening")
        agent = children.start(
            "agent",
            "0",
            [
                twistd,
                "-n",
                "--pidfile=",
                "llmgw-agent",
                "--config",
                agent_config,
                "--server",
                f"127.0.0.1:{agents}",
                "--node-id",
                "node-1",
                "--tls-dir",
                os.path.join(ca, "agents", "node-1"),
                "--state-dir",
                os.path.join(directory, "agent-state"),
            ],
        )
        agent.wait_for(r"GPUs \(2 simulated\)")
        admin_url = f"http://127.0.0.1:{admin}"
        deadline = time.monotonic() + 30
        while not _get(admin_url + "/api/v1/nodes")["nodes"]:
            if time.monotonic() > deadline:
                raise BenchError("the agent did not register in 30 s")
            time.sleep(0.05)
        # The meter counts the node's GPUs from its registration.
        registered = started = time.monotonic()
        tally = asyncio.run(_drive(api, admin_url, requests, compress, shape))
        wall = time.monotonic() - started
        # Asleep after idle_timeout is no swap, as cold's idle stops are not.
        swaps = _metric_sum(admin_url, "llmgw_swaps_total", 'reason="idle_sleep"')
        starts = _metric_sum(admin_url, "llmgw_engine_starts_total")
        wakes = _metric_sum(admin_url, "llmgw_engine_wake_seconds_count")
        ended = time.monotonic()
        server.stop()  # its meter's last counts written as it stops
        cost = gpu_report(
            os.path.join(directory, "server-state", "llmgw.db"), ended - registered
        )
    finally:
        children.stop_all()
        _kill_engines(os.path.join(directory, "agent-state", "shards"))
        if not keep:
            subprocess.run(["rm", "-rf", directory], check=False)
    minutes = wall * compress / 60
    ttfts = sorted(
        o.ttft for o in tally.outcomes if o.ttft is not None and not o.failed
    )
    failures: dict[str, int] = {}
    for o in tally.outcomes:
        if o.failed:
            why = re.sub(r"\d+", "N", o.failed)[:60]
            failures[why] = failures.get(why, 0) + 1
    # Without eviction nothing counts swaps; models started beyond the
    # two GPUs' first two are the swaps it made (none: it has none).
    swapped = swaps if POLICIES[name]["evict"] else max(0.0, starts - 2)
    return {
        "policy": name,
        "requests": len(tally.outcomes),
        "failed": sum(failures.values()),
        "failures": failures,
        "ttft_p50": _percentile(ttfts, 0.50),
        "ttft_p95": _percentile(ttfts, 0.95),
        "ttft_p99": _percentile(ttfts, 0.99),
        "swaps_per_minute": swapped / minutes if minutes else 0.0,
        "cold_starts": starts,
        "wakes": wakes,
        "gpu_seconds_idle": tally.idle_gpu_seconds,
        "simulated_minutes": minutes,
        "wall_seconds": wall,
        "cost": cost,
    }


def _kill_engines(folder: str) -> None:
    """
    Kill the engines the agent recorded in C{folder}: they outlive it, as
    llmgw's engines do.
    """
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        try:
            with open(os.path.join(folder, name)) as f:
                os.killpg(int(json.load(f)["pid"]), signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def _percentile(ordered: list[float], fraction: float) -> float:
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))
    return ordered[index]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="simulated minutes")
    p.add_argument("--compress", type=float, default=6.0, help="time compression")
    p.add_argument("--rate", type=float, default=0.5, help="requests per sim second")
    p.add_argument("--burst", type=float, default=60.0, help="mean hot-model seconds")
    p.add_argument("--seed", type=int, default=25)
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"of {', '.join(POLICIES)}",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the logs' folder")
    args = p.parse_args(argv)
    shape = Shape(tokens=args.tokens)
    requests = workload(args.seed, args.minutes, args.rate, args.burst)
    results = []
    for name in args.policies.split(","):
        if name not in POLICIES:
            p.error(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
        print(f"policy {name}: {len(requests)} requests...", file=sys.stderr)
        results.append(run_policy(name, requests, args.compress, shape, args.keep))
    header = (
        f"{'policy':<7} {'requests':>8} {'failed':>6} {'ttft p50':>9} {'p95':>8}"
        f" {'p99':>8} {'swaps/min':>9} {'gpu-s idle':>10}"
    )
    print(header)
    for r in results:
        print(
            f"{r['policy']:<7} {r['requests']:>8} {r['failed']:>6}"
            f" {r['ttft_p50']:>9.2f} {r['ttft_p95']:>8.2f} {r['ttft_p99']:>8.2f}"
            f" {r['swaps_per_minute']:>9.2f} {r['gpu_seconds_idle']:>10.1f}"
        )
    by = {r["policy"]: r for r in results}
    if "batch" in by and "cold" in by:
        batch, cold = by["batch"], by["cold"]
        print(
            f"batch/cold: p95 ttft {batch['ttft_p95'] / cold['ttft_p95']:.2f}x"
            f" (target <= 0.3), swaps/min"
            f" {batch['swaps_per_minute'] / max(cold['swaps_per_minute'], 1e-9):.2f}x"
            f" (target <= 0.5); batch failed {batch['failed']} (target 0)"
        )
    for r in results:
        print("\n".join(report_lines(r["policy"], r["cost"])))
        if r["failures"]:
            print(f"{r['policy']} failures: {r['failures']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
