"""
Priorities and fair shares under contention (issue 22 item 2).

One C{llmgw sim} replica at a fixed capacity (C{--max-concurrency}
sequences, each C{--ttft} plus C{--itl} per token: L{capacity}) behind
C{twistd -n llmgw-server} with the overload room on
(C{overload_queue_depth = 1}: requests wait in the router once the
engine queues more than one).  Two keys, made through the admin API: a
C{batch} key offering 3x the capacity and an C{interactive} key offering
20 % of it, both streaming, arrivals a Poisson process from a fixed seed
so that every phase sends the same requests at the same times:

    - C{alone}: the interactive key's requests alone on the idle replica;
    - C{fifo}: both keys, C{[router] waiting_order = "fifo"} (the order
      before priorities: first come, first served);
    - C{fair}: both keys, C{waiting_order = "fair"} (priority, then
      weighted fair share).

Reported per phase and key: requests sent, answered, refused (429),
other failures, p50/p95 time to first token (the first SSE event at the
client), answers per second, and the router's own median time from
C{Server-Timing}.  Then the issue's checks: with priorities the
interactive key's p95 TTFT is at most 1.5x its figure alone, FIFO's at
least 3x; the batch key's throughput with priorities at least 90 % of
FIFO's.

The interactive requests ask for few tokens (a chat turn's reply
starts), the batch ones for many: the interactive key's 20 % of the
requests the replica can take per second hold a few percent of its
sequence-seconds.

Run::

    .venv/bin/python bench/fairness_bench.py [--seconds 30] [--json FILE]

Exit status: 0, 1 when a check failed, 2 on a setup error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import openai
from children import BenchError, Children

BIN = os.path.dirname(sys.executable)
MODEL = "bench-model"
TTFT = 1.0
ITL = 0.3
BATCH_TOKENS = 10
CHAT_TOKENS = 1
CONCURRENCY = 60
BATCH_LOAD = 3.0
CHAT_LOAD = 0.2
ROOM = 64
DRAIN = 30.0
"""
Seconds a phase waits, after its last request is sent, for the answers.
"""


def capacity() -> float:
    """
    @return: batch requests per second the replica completes at most:
        its sequences over one batch request's seconds.
    """
    return CONCURRENCY / (TTFT + BATCH_TOKENS * ITL)


def arrivals(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """
    @return: the send times, seconds from the phase's start, of a Poisson
        process at C{rate} per second over C{seconds}.
    """
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


@dataclass
class KeyRow:
    """
    One key's figures in one phase.
    """

    phase: str
    key: str
    sent: int = 0
    answered: int = 0
    refused: int = 0
    failed: int = 0
    ttft_p50: float = float("nan")
    ttft_p95: float = float("nan")
    per_second: float = 0.0
    llmgw_ms_p50: float = float("nan")
    ttfts: list[float] = field(default_factory=list, repr=False)
    own: list[float] = field(default_factory=list, repr=False)

    def close(self, seconds: float) -> None:
        # Those still unanswered after the drain count as failed.
        self.failed = self.sent - self.answered - self.refused
        if self.ttfts:
            ordered = sorted(self.ttfts)
            self.ttft_p50 = statistics.median(ordered)
            self.ttft_p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        if self.own:
            self.llmgw_ms_p50 = statistics.median(self.own)
        self.per_second = self.answered / seconds


async def one(client: openai.AsyncOpenAI, tokens: int, row: KeyRow) -> None:
    """
    One streamed chat completion through the official client; its
    outcome counted in C{row}.
    """
    started = time.monotonic()
    row.sent += 1
    try:
        async with client.chat.completions.with_streaming_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=tokens,
            stream=True,
        ) as answer:
            first = None
            async for line in answer.iter_lines():
                if first is None and line.startswith("data:"):
                    first = time.monotonic() - started
            own = re.search(r"llmgw;dur=([\d.]+)", answer.headers["server-timing"])
            if own is not None:
                row.own.append(float(own[1]))
            if first is not None:
                row.ttfts.append(first)
                row.answered += 1
    except openai.RateLimitError:
        row.refused += 1
    except openai.APIError:
        pass  # counted as failed (L{KeyRow.close})


async def run_phase(
    api: str, phase: str, keys: dict[str, str], plan: dict[str, list[float]]
) -> list[KeyRow]:
    """
    Send C{plan}'s requests (per key name, their send times) and wait for
    their answers (at most L{DRAIN} seconds after the last is sent).
    """
    rows = {name: KeyRow(phase, name) for name in plan}
    clients = {
        name: openai.AsyncOpenAI(
            base_url=api + "/v1", api_key=keys[name], max_retries=0, timeout=DRAIN + 30
        )
        for name in plan
    }
    start = time.monotonic()
    tasks = []
    sends = sorted((t, name) for name, times in plan.items() for t in times)
    for t, name in sends:
        delay = start + t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tokens = BATCH_TOKENS if name == "batch" else CHAT_TOKENS
        tasks.append(asyncio.create_task(one(clients[name], tokens, rows[name])))
    seconds = time.monotonic() - start
    _, pending = await asyncio.wait(tasks, timeout=DRAIN)
    for task in pending:
        task.cancel()
    for client in clients.values():
        await client.close()
    for row in rows.values():
        row.close(seconds)
    return list(rows.values())


def start_llmgw(
    children: Children, tag: str, sim_ports: list[int], order: str = "fair"
) -> tuple[str, str]:
    """
    C{twistd -n llmgw-server} over the sims listening on C{sim_ports} (one
    replica each, as C{[[endpoints]]}) with C{waiting_order = order}.

    @return: the client API's and the admin API's base URLs.
    """
    state = tempfile.mkdtemp(prefix=f"{tag}-", dir=children.directory)
    config = os.path.join(state, "llmgw.toml")
    with open(config, "w") as f:
        f.write(
            'listen = "tcp:0:interface=127.0.0.1"\n'
            'admin_listen = "tcp:0:interface=127.0.0.1"\n'
            "[store]\nrecord_usage = false\n"
            "[router]\n"
            'load_poll_interval = "0.1s"\n'
            "overload_queue_depth = 1\n"
            f"overload_queue_size = {ROOM}\n"
            'overload_wait = "10s"\n'
            f'waiting_order = "{order}"\n'
        )
        for i, port in enumerate(sim_ports):
            f.write(
                f'[[endpoints]]\nid = "sim{i}"\nurl = "http://127.0.0.1:{port}"\n'
                f'models = ["{MODEL}"]\n'
            )
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
    found = server.wait_for(
        r"client API listening on 127\.0\.0\.1:(\d+), admin on 127\.0\.0\.1:(\d+)"
    )
    return f"http://127.0.0.1:{found[1]}", f"http://127.0.0.1:{found[2]}"


def make_keys(admin: str) -> dict[str, str]:
    """
    @return: the secrets of a C{batch} and an C{interactive} key, made
        through the admin API (loopback needs no admin key).
    """
    keys = {}
    for name in ("batch", "interactive"):
        request = urllib.request.Request(
            admin + "/api/v1/keys",
            json.dumps({"name": name, "priority": name}).encode(),
            {"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            keys[name] = json.load(answer)["key"]
    return keys


def phases(directory: str, plan: dict[str, list[float]]) -> list[KeyRow]:
    children = Children(directory, pin=False)
    rows: list[KeyRow] = []
    try:
        sim = children.start(
            "sim",
            "0",
            [
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
                "--max-concurrency",
                str(CONCURRENCY),
            ],
        )
        port = int(sim.wait_for(r"llmgw sim listening on http://127\.0\.0\.1:(\d+)")[1])
        for phase, order, sent in (
            ("alone", "fair", {"interactive": plan["interactive"]}),
            ("fifo", "fifo", plan),
            ("fair", "fair", plan),
        ):
            api, admin = start_llmgw(children, f"llmgw-{phase}", [port], order)
            keys = make_keys(admin)
            t = time.monotonic()
            got = asyncio.run(run_phase(api, phase, keys, sent))
            rows += got
            with urllib.request.urlopen(admin + "/metrics", timeout=10) as m:
                room = [
                    line
                    for line in m.read().decode().splitlines()
                    if line.startswith("llmgw_overload_total")
                ]
            print(f"  {phase}: {time.monotonic() - t:.0f} s; {room}", flush=True)
            children.find(f"llmgw-{phase}").stop()
            time.sleep(TTFT + BATCH_TOKENS * ITL)  # the engine drains
    finally:
        children.stop_all()
    return rows


def checks(rows: list[KeyRow]) -> list[tuple[str, bool]]:
    by = {(r.phase, r.key): r for r in rows}
    alone = by["alone", "interactive"].ttft_p95
    fair = by["fair", "interactive"].ttft_p95
    fifo = by["fifo", "interactive"].ttft_p95
    batch = by["fair", "batch"].per_second / max(by["fifo", "batch"].per_second, 1e-9)
    return [
        (
            f"priorities: interactive p95 TTFT {fair / alone:.2f}x alone (<= 1.5x)",
            fair <= 1.5 * alone,
        ),
        (
            f"FIFO: interactive p95 TTFT {fifo / alone:.2f}x alone (>= 3x)",
            fifo >= 3 * alone,
        ),
        (f"priorities: batch throughput {batch:.0%} of FIFO's (>= 90%)", batch >= 0.9),
    ]


def print_table(rows: list[KeyRow]) -> None:
    print(
        f"{'phase':<6} {'key':<12} {'sent':>5} {'ok':>5} {'429':>5} {'fail':>4}"
        f" {'p50 TTFT ms':>11} {'p95 TTFT ms':>11} {'ok/s':>6} {'llmgw ms p50':>12}"
    )
    for r in rows:
        print(
            f"{r.phase:<6} {r.key:<12} {r.sent:>5} {r.answered:>5} {r.refused:>5}"
            f" {r.failed:>4} {r.ttft_p50 * 1000:>11.0f} {r.ttft_p95 * 1000:>11.0f}"
            f" {r.per_second:>6.1f} {r.llmgw_ms_p50:>12.1f}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--seconds", type=float, default=30.0, help="seconds each phase sends"
    )
    p.add_argument("--seed", type=int, default=22)
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--keep", action="store_true", help="keep the child logs")
    args = p.parse_args()
    cap = capacity()
    rng = random.Random(args.seed)
    plan = {
        "batch": arrivals(BATCH_LOAD * cap, args.seconds, rng),
        "interactive": arrivals(CHAT_LOAD * cap, args.seconds, rng),
    }
    print(
        f"fairness_bench: one replica, capacity {cap:.1f} req/s ({CONCURRENCY}"
        f" sequences of {TTFT:g} s + {BATCH_TOKENS} x {ITL:g} s); batch key"
        f" {BATCH_LOAD:g}x ({len(plan['batch'])} requests), interactive key"
        f" {CHAT_LOAD:.0%} ({len(plan['interactive'])} requests, {CHAT_TOKENS}"
        f" tokens each) over {args.seconds:g} s; room {ROOM};"
        f" load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    directory = tempfile.mkdtemp(prefix="fairness-bench-")
    started = time.monotonic()
    try:
        rows = phases(directory, plan)
    finally:
        if args.keep:
            print(f"child logs kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    print()
    print_table(rows)
    print(
        f"\n{time.monotonic() - started:.0f} s in all;"
        f" load average {os.getloadavg()[0]:.1f}"
    )
    status = 0
    for text, ok in checks(rows):
        print(f"  {'PASS' if ok else 'FAIL'}  {text}")
        status |= not ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 1 if status else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        sys.stderr.write(f"fairness_bench: {e}\n")
        sys.exit(2)
