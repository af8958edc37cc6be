"""
Batch work on what the fleet leaves idle (docs/batches.md, "Batch work and
interactive traffic").

A sim fleet (C{--replicas} C{llmgw sim} replicas of one model, each
C{--max-concurrency} sequences of C{TTFT} plus C{ITL} per token, served
as C{[[endpoints]]}) behind C{twistd -n llmgw-server} with the fairness
bench's router (the overload room on, load read every 0.1 s) and its
interactive load: an C{interactive} key offering 20 % of the fleet's
capacity (L{chat_rate}) in one-token streamed chat turns, Poisson arrivals from a fixed
seed, the same requests at the same times in every phase.  A batch is a
JSONL file of chat completions of C{BATCH_TOKENS} tokens each, uploaded
with the official client's C{files.create} and run with
C{batches.create}, by a C{batch} key; its progress is read with
C{batches.retrieve} (C{request_counts.completed}) every
L{POLL} seconds.  Three phases, in one run, each on a fresh server over
the same sims:

    - C{alone}: the interactive key alone on the idle fleet;
    - C{batch}: the batch alone, once it runs at full pace (after
      L{WARMUP} seconds), for as long as a phase sends: the capacity
      the batch can take of an idle fleet;
    - C{both}: the batch started, then after L{WARMUP} seconds the
      interactive key's requests, as in C{alone}.

Reported per phase: the interactive key's requests sent, answered,
refused and failed, their p50 and p95 time to first token (the first SSE
event at the client); the batch's lines completed over the window, per
second.  Then the issue's two checks:

    - the interactive key's p95 time to first token in C{both} is at most
      1.2 times its figure in C{alone};
    - the batch used at least 80 % of the capacity the interactive load
      leaves.  Capacity is counted in sequence-seconds per second (a line
      holds a sequence L{LINE_SECONDS}, an interactive request
      L{CHAT_SECONDS}): what the batch used alone
      (C{batch}: its lines per second times a line's seconds) less what
      the interactive requests hold in C{both} (their answers per second
      times theirs) is the capacity they leave it; the batch's lines per
      second in C{both} times a line's seconds over that is its share.

The batch is sized to outlast a phase (L{lines_for}) and cancelled at its
end; the engines drain before the next phase.

Run::

    .venv/bin/python bench/batch_bench.py [--seconds 30] [--replicas 2]
        [--json FILE]

Exit status: 0, 1 when a check failed, 2 on a setup error.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import openai
from children import BenchError, Children
from fairness_bench import (
    CHAT_LOAD,
    CHAT_TOKENS,
    ITL,
    MODEL,
    TTFT,
    KeyRow,
    arrivals,
    make_keys,
    one,
    start_llmgw,
)

BIN = os.path.dirname(sys.executable)
CONCURRENCY = 30
"""
Sequences per sim: two make the fairness bench's one replica of 60, so
that its interactive load is the same, and the runner's 64 lines in
flight at most are more than the room gives, which it measures.
"""
BATCH_TOKENS = 10
WARMUP = 10.0
"""
Seconds a batch runs before its window opens: the room fills the fleet
from the engines' readings, a few polls.
"""
POLL = 0.5
"""
Seconds between two readings of the batch's progress.
"""
DRAIN = 30.0
"""
Seconds a phase waits, after its last interactive request is sent, for
their answers.
"""
LINE_SECONDS = TTFT + (BATCH_TOKENS - 1) * ITL
CHAT_SECONDS = TTFT + (CHAT_TOKENS - 1) * ITL
"""
Seconds a line and an interactive request hold a sequence: the sim sends
its first token C{TTFT} after admission and each next one C{ITL} later
(L{llmgw.sim.exchange}; 3.7 s and 1.0 s measured with curl).
"""


def capacity(replicas: int) -> float:
    """
    @return: batch lines per second the fleet completes at most: its
        sequences over one line's seconds.
    """
    return replicas * CONCURRENCY / LINE_SECONDS


def chat_rate(replicas: int) -> float:
    """
    @return: the interactive key's requests per second: the fairness
        bench's share of the fleet's capacity, counted as it counts it
        (its sequences over C{TTFT} + C{BATCH_TOKENS} x C{ITL}), so that
        two sims of 30 get its load.
    """
    return CHAT_LOAD * replicas * CONCURRENCY / (TTFT + BATCH_TOKENS * ITL)


def lines_for(replicas: int, seconds: float) -> int:
    """
    @return: lines enough that a batch at the fleet's full capacity does
        not finish within C{WARMUP} + C{seconds} + its drain.
    """
    return math.ceil(1.5 * capacity(replicas) * (WARMUP + seconds + DRAIN))


def batch_file(count: int) -> bytes:
    """
    @return: a batch's input file: C{count} chat completions in OpenAI's
        batch JSONL shape, each with its C{custom_id}.
    """
    lines = []
    for n in range(count):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"line {n}"}],
            "max_tokens": BATCH_TOKENS,
        }
        line = {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": body,
        }
        lines.append(json.dumps(line))
    return ("\n".join(lines) + "\n").encode()


@dataclass
class BatchRow:
    """
    A batch's progress over one phase's window.

    @ivar completed: lines completed within the window.
    @ivar seconds: the window's length.
    @ivar per_second: lines completed per second in it.
    @ivar failed: lines failed by the end of the window.
    """

    phase: str
    completed: int = 0
    seconds: float = 0.0
    per_second: float = 0.0
    failed: int = 0


class Batch:
    """
    One batch through the Batches API: uploaded, created, its counts read
    every L{POLL} seconds, cancelled at the end.
    """

    def __init__(self, client: openai.AsyncOpenAI, count: int) -> None:
        self.client = client
        self.count = count
        self.id = ""
        self.completed = 0
        self.failed = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        upload = await self.client.files.create(
            file=("bench.jsonl", io.BytesIO(batch_file(self.count))), purpose="batch"
        )
        batch = await self.client.batches.create(
            input_file_id=upload.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        self.id = batch.id
        self._task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            batch = await self.client.batches.retrieve(self.id)
            counts = batch.request_counts
            if counts is not None:
                self.completed, self.failed = counts.completed, counts.failed
            if batch.status in ("failed", "expired", "cancelled", "completed"):
                return
            await asyncio.sleep(POLL)

    async def window(self, phase: str, seconds: float) -> BatchRow:
        """
        @return: the lines it completes over the next C{seconds}.
        """
        start, at = self.completed, time.monotonic()
        await asyncio.sleep(seconds)
        took = time.monotonic() - at
        done = self.completed - start
        return BatchRow(phase, done, took, done / took, self.failed)

    async def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.id:
            await self.client.batches.cancel(self.id)


async def interactive(
    api: str, key: str, plan: list[float], phase: str
) -> tuple[KeyRow, float]:
    """
    Send the interactive key's requests at C{plan}'s times (seconds from
    now) and wait for their answers (at most L{DRAIN} seconds after the
    last is sent).

    @return: the key's figures, and the seconds the sending took.
    """
    row = KeyRow(phase, "interactive")
    client = openai.AsyncOpenAI(
        base_url=api + "/v1", api_key=key, max_retries=0, timeout=DRAIN + 30
    )
    start = time.monotonic()
    tasks = []
    for t in plan:
        delay = start + t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(client, CHAT_TOKENS, row)))
    seconds = time.monotonic() - start
    _, pending = await asyncio.wait(tasks, timeout=DRAIN)
    for task in pending:
        task.cancel()
    await client.close()
    row.close(seconds)
    return row, seconds


async def run_phase(
    api: str, phase: str, keys: dict[str, str], plan: list[float], args: Any
) -> tuple[KeyRow | None, BatchRow | None]:
    """
    One phase (the module's docstring): C{alone}, C{batch} or C{both}.
    """
    if phase == "alone":
        row, _ = await interactive(api, keys["interactive"], plan, phase)
        return row, None
    client = openai.AsyncOpenAI(
        base_url=api + "/v1", api_key=keys["batch"], max_retries=2, timeout=60
    )
    batch = Batch(client, lines_for(args.replicas, args.seconds))
    await batch.start()
    try:
        await asyncio.sleep(WARMUP)
        if phase == "batch":
            return None, await batch.window(phase, args.seconds)
        window = asyncio.create_task(batch.window(phase, args.seconds))
        row, _ = await interactive(api, keys["interactive"], plan, phase)
        return row, await window
    finally:
        await batch.cancel()
        await client.close()


def start_sims(children: Children, replicas: int) -> list[int]:
    """
    @return: the ports of C{replicas} sims of the fleet.
    """
    ports = []
    for i in range(replicas):
        sim = children.start(
            f"sim{i}",
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
        found = sim.wait_for(r"llmgw sim listening on http://127\.0\.0\.1:(\d+)")
        ports.append(int(found[1]))
    return ports


def phases(
    directory: str, plan: list[float], args: Any
) -> tuple[list[KeyRow], list[BatchRow]]:
    children = Children(directory, pin=False)
    keyrows: list[KeyRow] = []
    batchrows: list[BatchRow] = []
    try:
        ports = start_sims(children, args.replicas)
        for phase in ("alone", "batch", "both"):
            api, admin = start_llmgw(children, f"llmgw-{phase}", ports)
            keys = make_keys(admin)
            t = time.monotonic()
            row, batch = asyncio.run(run_phase(api, phase, keys, plan, args))
            keyrows += [row] if row is not None else []
            batchrows += [batch] if batch is not None else []
            print(f"  {phase}: {time.monotonic() - t:.0f} s", flush=True)
            children.find(f"llmgw-{phase}").stop()
            time.sleep(LINE_SECONDS + 1)  # the engines drain
    finally:
        children.stop_all()
    return keyrows, batchrows


def checks(keyrows: list[KeyRow], batchrows: list[BatchRow]) -> list[tuple[str, bool]]:
    """
    @return: the issue's two checks (the module's docstring), in words and
        whether each passed.
    """
    keys = {r.phase: r for r in keyrows}
    batches = {r.phase: r for r in batchrows}
    ratio = keys["both"].ttft_p95 / keys["alone"].ttft_p95
    alone_used = batches["batch"].per_second * LINE_SECONDS
    chat_used = keys["both"].per_second * CHAT_SECONDS
    left = alone_used - chat_used
    used = batches["both"].per_second * LINE_SECONDS
    share = used / left if left > 0 else 0.0
    return [
        (
            f"interactive p95 TTFT with the batch {ratio:.2f}x alone (<= 1.2x)",
            ratio <= 1.2,
        ),
        (
            f"batch used {used:.1f} of the {left:.1f} sequences the interactive"
            f" load leaves ({alone_used:.1f} alone less {chat_used:.1f}):"
            f" {share:.0%} (>= 80%)",
            share >= 0.8,
        ),
    ]


def print_tables(keyrows: list[KeyRow], batchrows: list[BatchRow]) -> None:
    print(
        f"{'phase':<6} {'sent':>5} {'ok':>5} {'429':>5} {'fail':>4}"
        f" {'p50 TTFT ms':>11} {'p95 TTFT ms':>11} {'ok/s':>6}"
    )
    for r in keyrows:
        print(
            f"{r.phase:<6} {r.sent:>5} {r.answered:>5} {r.refused:>5} {r.failed:>4}"
            f" {r.ttft_p50 * 1000:>11.0f} {r.ttft_p95 * 1000:>11.0f}"
            f" {r.per_second:>6.1f}"
        )
    print(f"\n{'phase':<6} {'lines':>6} {'s':>6} {'lines/s':>8} {'failed':>6}")
    for b in batchrows:
        print(
            f"{b.phase:<6} {b.completed:>6} {b.seconds:>6.1f} {b.per_second:>8.2f}"
            f" {b.failed:>6}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--seconds", type=float, default=30.0, help="seconds each phase sends"
    )
    p.add_argument("--replicas", type=int, default=2, help="sims in the fleet")
    p.add_argument("--seed", type=int, default=22)
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--keep", action="store_true", help="keep the child logs")
    args = p.parse_args()
    cap = capacity(args.replicas)
    plan = arrivals(chat_rate(args.replicas), args.seconds, random.Random(args.seed))
    print(
        f"batch_bench: {args.replicas} replicas, capacity {cap:.1f} lines/s"
        f" ({args.replicas} x {CONCURRENCY} sequences, a line {LINE_SECONDS:g} s);"
        " interactive key"
        f" {CHAT_LOAD:.0%} ({len(plan)} requests) over {args.seconds:g} s;"
        f" batches of {lines_for(args.replicas, args.seconds)} lines;"
        f" load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    directory = tempfile.mkdtemp(prefix="batch-bench-")
    started = time.monotonic()
    try:
        keyrows, batchrows = phases(directory, plan, args)
    finally:
        if args.keep:
            print(f"child logs kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    print()
    print_tables(keyrows, batchrows)
    print(
        f"\n{time.monotonic() - started:.0f} s in all;"
        f" load average {os.getloadavg()[0]:.1f}"
    )
    status = 0
    for text, ok in checks(keyrows, batchrows):
        print(f"  {'PASS' if ok else 'FAIL'}  {text}")
        status |= not ok
    if args.json:
        with open(args.json, "w") as f:
            rows = [asdict(r) for r in keyrows] + [asdict(b) for b in batchrows]
            json.dump(rows, f, indent=1)
    return 1 if status else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        sys.stderr.write(f"batch_bench: {e}\n")
        sys.exit(2)
