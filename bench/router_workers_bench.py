"""
Throughput of C{llmgw-server --router-workers 2} against C{--router-workers
1} on this machine (issue 12 item 2; target: at least 1.6x).

In one run, against two replicas, two servers run side by side,
C{workers-1} and C{workers-2}, each serving the client API from that many
C{llmgw-router} children on one port (C{SO_REUSEPORT}).  C{wrk} (2
threads, 64 connections, non-streaming chat completions of 16 tokens)
loads each in turn, in alternating order over several rounds; each figure
is the median over rounds, and the result is the ratio workers-2 /
workers-1 of requests per second.  Nothing is pinned: the routers, the
replicas and C{wrk} share the machine's cores, as they would on a server
of this size; what the replicas and the load generator take is not the
routers', so the ratio is below what two cores of routing alone would
give.  Usage records are off (as in C{bench/router_bench.py}'s C{llmgw}
target).

The replicas (C{--upstream}): C{static} (the default), two C{nginx}
processes (Debian's C{nginx-light}, one worker each) answering a fixed
chat completion (L{static_upstream}), so that the figure is the routers'
own; or C{sim}, two C{llmgw sim} engines with no added latency, whose
Python CPU then competes with the routers'.  Each run also reads every
process's CPU from C{/proc} (the server, each router worker, each
replica; C{wrk}'s from its rusage) and prints it in microseconds per
request, to show where the cores go.

Run::

    .venv/bin/python bench/router_workers_bench.py [--rounds 3] [--duration 10]
        [--upstream static|sim] [--json results.json]

Exit status: 0, or 1 when a request failed (non-2xx, socket errors), a
server did not come up or nginx is missing (C{--upstream static}).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from types import FrameType

from children import BenchError, Children
from router_bench import chat_body, post
from static_upstream import start_static
from wrk import parse_wrk

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
MODEL = "bench-model"
CONNECTIONS = 64
THREADS = 2
WARMUP = 2.0
"""
Seconds of load before each timed run, not measured.
"""
TARGET_RATIO = 1.6
WORKERS = (1, 2)


def start(children: Children, upstream: str) -> dict[int, int]:
    """
    Start two replicas (C{upstream}: C{"static"} or C{"sim"}) and one
    server per entry of L{WORKERS}.

    @return: each server's client port on 127.0.0.1, by worker count.
    @raise BenchError: a process did not come up; nginx is missing.
    """
    urls = []
    for n in range(2):
        if upstream == "static":
            urls.append(start_static(children, f"upstream-{n}", MODEL)[1])
            continue
        sim = children.start(
            f"upstream-{n}",
            "",
            [
                os.path.join(BIN, "llmgw"),
                "sim",
                "--port",
                "0",
                "--model",
                MODEL,
                "--ttft",
                "0",
                "--itl",
                "0",
            ],
        )
        urls.append(
            sim.wait_for(r"llmgw sim listening on (http://127\.0\.0\.1:\d+)")[1]
        )
    state = tempfile.mkdtemp(prefix="state-", dir=children.directory)
    off = os.path.join(state, "off.toml")
    with open(off, "w") as f:
        f.write("[store]\nrecord_usage = false\n")
    ports = {}
    for workers in WORKERS:
        argv = [
            os.path.join(BIN, "twistd"),
            "-n",
            "--pidfile=",
            "llmgw-server",
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--admin-listen",
            "tcp:0:interface=127.0.0.1",
            "--config",
            off,
            "--state-dir",
            os.path.join(state, f"w{workers}"),
            "--router-workers",
            str(workers),
        ]
        for n, url in enumerate(urls):
            argv += ["--endpoint", f"sim{n}={url}={MODEL}"]
        server = children.start(f"workers-{workers}", "", argv)
        ports[workers] = int(
            server.wait_for(r"client API listening on 127\.0\.0\.1:(\d+), admin")[1]
        )
        pattern = r"(?s)" + ".*".join(["following the control plane"] * workers)
        server.wait_for(pattern)
    return ports


def check(port: int) -> None:
    """
    @raise BenchError: a chat completion through C{port} failed.
    """
    deadline = time.monotonic() + 10
    while True:
        status, _, body = post(port, chat_body(False))
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"port {port}: HTTP {status}: {body[:300]!r}")
        time.sleep(0.2)


def cpu_of(pid: int) -> float:
    """
    @return: user and system CPU seconds process C{pid} has used so far
        (C{/proc/PID/stat} fields 14 and 15); 0 when it is gone.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_of(pid: int) -> list[int]:
    """
    @return: the pids whose parent is C{pid} (field 4 of C{/proc/*/stat}).
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return sorted(found)


def processes(children: Children, workers: int) -> dict[str, int]:
    """
    The processes whose CPU counts for the server with C{workers} router
    workers: that server, its router children, and the replicas.

    @return: pid by name (C{server}, C{router-N}, C{upstream-N}).
    """
    server = children.find(f"workers-{workers}")
    pids = {"server": server.popen.pid}
    for n, pid in enumerate(children_of(server.popen.pid)):
        pids[f"router-{n}"] = pid
    for child in children.all():
        if child.name.startswith("upstream-"):
            pids[child.name] = child.popen.pid
    return pids


def wrk_cpu() -> float:
    """
    @return: CPU seconds used so far by this process's waited-for children
        (only C{wrk} is waited for while the bench runs).
    """
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load(port: int, duration: float) -> dict[str, float]:
    """
    Load 127.0.0.1:C{port} with C{wrk} for C{duration} seconds.
    """
    argv = [
        "wrk",
        f"-t{THREADS}",
        f"-c{CONNECTIONS}",
        f"-d{duration:g}s",
        "--latency",
        "-s",
        os.path.join(HERE, "post.lua"),
        f"http://127.0.0.1:{port}/v1/chat/completions",
    ]
    env = dict(os.environ, BENCH_BODY=chat_body(False).decode("utf-8"))
    try:
        result = subprocess.run(
            argv, capture_output=True, env=env, timeout=duration + 60, check=False
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"wrk ran past {duration + 60:g} s") from None
    output = result.stdout.decode("utf-8", "replace")
    if result.returncode != 0:
        raise BenchError(f"wrk exited with {result.returncode}:\n{output}")
    return parse_wrk(output)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(1)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="--router-workers 2 against 1.")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument(
        "--duration", type=float, default=10.0, help="seconds per run (default 10)"
    )
    p.add_argument(
        "--upstream",
        choices=("static", "sim"),
        default="static",
        help="replicas: nginx with a fixed answer (static, the default)"
        " or llmgw sim engines",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results here")
    args = p.parse_args(argv)
    if not 1 <= args.rounds <= 100 or not 0 < args.duration <= 600:
        p.error("--rounds must be 1..100 and --duration 0..600 seconds")
    if not shutil.which("wrk"):
        p.error("wrk is not installed (Debian's wrk package)")
    signal.signal(signal.SIGTERM, _raise_exit)
    print(
        f"wrk: {THREADS} threads, {CONNECTIONS} connections, {args.rounds} rounds"
        f" x {args.duration:g} s, {WARMUP:g} s warm-up each; {os.cpu_count()} cores;"
        f" upstream {args.upstream};"
        f" load average before: {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    children = Children(tempfile.mkdtemp(prefix="llmgw-bench-"), False)
    rates: dict[int, list[float]] = {w: [] for w in WORKERS}
    rows = []
    cpu: dict[int, dict[str, list[float]]] = {w: {} for w in WORKERS}
    failed = False
    try:
        ports = start(children, args.upstream)
        for port in ports.values():
            check(port)
        for round_ in range(args.rounds):
            order = WORKERS if round_ % 2 == 0 else WORKERS[::-1]
            for workers in order:
                load(ports[workers], WARMUP)
                pids = processes(children, workers)
                before = {name: cpu_of(pid) for name, pid in pids.items()}
                wrk_before = wrk_cpu()
                figures = load(ports[workers], args.duration)
                used = {name: cpu_of(pid) - before[name] for name, pid in pids.items()}
                used["wrk"] = wrk_cpu() - wrk_before
                per_request = {
                    name: 1e6 * seconds / max(1, figures["requests"])
                    for name, seconds in used.items()
                }
                for name, us in per_request.items():
                    cpu[workers].setdefault(name, []).append(us)
                bad = int(figures["non_2xx"] + figures["socket_errors"])
                failed = failed or bad > 0
                rates[workers].append(figures["requests_per_s"])
                rows.append(
                    {
                        "round": round_ + 1,
                        "workers": workers,
                        **figures,
                        "cpu_us_per_request": per_request,
                        "cpu_s": used,
                    }
                )
                print(
                    f"round {round_ + 1} workers-{workers}"
                    f" {figures['requests_per_s']:9.1f} req/s"
                    f"  p50 {figures['p50_ms']:7.2f} ms"
                    f"  p99 {figures['p99_ms']:7.2f} ms"
                    + (f"  FAILED {bad}" if bad else ""),
                    flush=True,
                )
                print(
                    "    CPU us/request: "
                    + "  ".join(f"{n} {us:.0f}" for n, us in per_request.items())
                    + f"  (busy cores {sum(used.values()) / args.duration:.2f})",
                    flush=True,
                )
    except BenchError as e:
        sys.stderr.write(f"router_workers_bench: {e}\n")
        return 1
    finally:
        children.stop_all()
    medians = {w: statistics.median(r) for w, r in rates.items()}
    ratio = medians[2] / medians[1]
    print("\nsummary (median over rounds):")
    for workers in WORKERS:
        shares = {n: statistics.median(v) for n, v in cpu[workers].items()}
        print(
            f"  workers-{workers}: {medians[workers]:9.1f} req/s;"
            f" CPU us/request {sum(shares.values()):.0f}: "
            + "  ".join(f"{n} {us:.0f}" for n, us in shares.items())
        )
    verdict = "meets" if ratio >= TARGET_RATIO else "below"
    print(
        f"  workers-2 / workers-1: {ratio:.2f}x ({verdict} the {TARGET_RATIO}x target);"
        f" load average after: {os.getloadavg()[0]:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "upstream": args.upstream,
                    "runs": rows,
                    "medians": medians,
                    "ratio": ratio,
                },
                f,
                indent=2,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
