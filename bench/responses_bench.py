"""
The cost of a Responses API request translated by llmgw against the chat
completions request it becomes, in one run.

Against one C{llmgw sim} with no added latency, one C{twistd llmgw-server}
(usage records off, no keys) takes, in alternating order over several
rounds, non-streaming and streaming (16 content chunks) requests at 32
connections of two kinds:

    - C{chat}: C{POST /v1/chat/completions}, one user message;
    - C{responses}: C{POST /v1/responses} with the same message as its
      C{input} and C{store: false}, which llmgw translates into that chat
      request and whose answer (or stream) it translates back;
    - C{responses-stored}: the same with C{store: true} (the default): the
      Response is written to the server's SQLite store before it ends.

The ratios responses / chat (throughput, and the server's CPU per request)
are the result; each figure is the median over rounds.

Run::

    .venv/bin/python bench/responses_bench.py [--rounds 3] [--duration 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from children import BenchError, Children

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
MODEL = "bench-model"
CONNECTIONS = 32
TOKENS = 16
WARMUP = 2.0
KINDS = {
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say something."}]},
        "max_tokens",
    ),
    "responses": (
        "/v1/responses",
        {"input": "Say something.", "store": False},
        "max_output_tokens",
    ),
    "responses-stored": (
        "/v1/responses",
        {"input": "Say something."},
        "max_output_tokens",
    ),
}


def body(kind: str, stream: bool) -> str:
    _, fields, limit = KINDS[kind]
    return json.dumps({"model": MODEL, **fields, limit: TOKENS, "stream": stream})


def start(children: Children) -> int:
    """
    @return: the server's client port on 127.0.0.1.
    """
    sim = children.start(
        "sim",
        "1",
        [os.path.join(BIN, "llmgw"), "sim", "--port", "0", "--model", MODEL]
        + ["--ttft", "0", "--itl", "0"],
    )
    port = sim.wait_for(r"llmgw sim listening on http://127\.0\.0\.1:(\d+)")[1]
    state = tempfile.mkdtemp(prefix="state-", dir=children.directory)
    config = os.path.join(state, "off.toml")
    with open(config, "w") as f:
        f.write("[store]\nrecord_usage = false\n")
    server = children.start(
        "llmgw",
        "0",
        [os.path.join(BIN, "twistd"), "-n", "--pidfile=", "llmgw-server"]
        + ["--listen", "tcp:0:interface=127.0.0.1"]
        + ["--admin-listen", "tcp:0:interface=127.0.0.1"]
        + ["--endpoint", f"sim=http://127.0.0.1:{port}={MODEL}"]
        + ["--config", config, "--state-dir", state + "/s"],
    )
    return int(server.wait_for(r"client API listening on 127\.0\.0\.1:(\d+)")[1])


def load(
    children: Children, url: str, payload: str, duration: float
) -> dict[str, float]:
    """
    C{bench/pyload.py} on core 1 against C{url} for C{duration} seconds.
    """
    argv = [sys.executable, os.path.join(HERE, "pyload.py"), "--url", url]
    argv += ["--connections", str(CONNECTIONS), "--duration", f"{duration:g}"]
    argv += ["--body", payload]
    done = subprocess.run(
        children.pinned("1", argv), capture_output=True, timeout=duration + 60
    )
    if done.returncode != 0:
        raise BenchError(f"pyload exited with {done.returncode}: {done.stderr!r}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    if figures["non_2xx"] or figures["errors"]:
        raise BenchError(f"{url}: errors under load: {figures}")
    return figures


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0)
    args = p.parse_args(argv)
    pin = shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= 2
    directory = tempfile.mkdtemp(prefix="llmgw-bench-")
    children = Children(directory, pin)
    rates: dict[tuple[str, bool], list[float]] = {}
    cpu: dict[tuple[str, bool], list[float]] = {}
    try:
        port = start(children)
        server = children.find("llmgw")
        for round_ in range(args.rounds):
            order = list(KINDS) if round_ % 2 == 0 else list(KINDS)[::-1]
            for kind in order:
                for stream in (False, True):
                    url = f"http://127.0.0.1:{port}{KINDS[kind][0]}"
                    load(children, url, body(kind, stream), WARMUP)
                    before = server.cpu_seconds()
                    figures = load(children, url, body(kind, stream), args.duration)
                    used = server.cpu_seconds() - before
                    rates.setdefault((kind, stream), []).append(
                        figures["requests_per_s"]
                    )
                    cpu.setdefault((kind, stream), []).append(
                        used * 1000 / max(1, figures["requests"])
                    )
                    print(
                        f"round {round_ + 1} {kind:<17} stream={stream!s:<5}"
                        f" {figures['requests_per_s']:8.1f} req/s"
                        f"  cpu {cpu[(kind, stream)][-1]:6.3f} ms/req",
                        flush=True,
                    )
    except BenchError as e:
        sys.stderr.write(f"responses_bench: FAILED: {e}\n")
        return 1
    finally:
        children.stop_all()
    print()
    for stream in (False, True):
        chat = statistics.median(rates[("chat", stream)])
        chat_cpu = statistics.median(cpu[("chat", stream)])
        for kind in ("responses", "responses-stored"):
            rate = statistics.median(rates[(kind, stream)])
            used = statistics.median(cpu[(kind, stream)])
            print(
                f"{'streaming' if stream else 'non-streaming':<14} {kind:<17}"
                f" throughput {rate:8.1f} / chat {chat:8.1f} = {rate / chat:.2f};"
                f" server CPU per request {used:.3f} / {chat_cpu:.3f} ms"
                f" = {used / chat_cpu:.2f}"
            )
    shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
