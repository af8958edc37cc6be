"""
Throughput and latency of llmgw against the floor of its stack.

In one run, against one C{llmgw sim} with no added latency, measures
requests/s and p50/p99 latency of non-streaming and streaming (16 content
chunks) chat completions at 32 connections, for three targets:

    - C{direct}: the simulator itself;
    - C{llmgw}: C{twistd llmgw-server} in front of it;
    - C{minimal-proxy}: C{bench/minimal_proxy.py} in front of it, the least a
      Twisted reverse proxy does.

The proxy under test runs on core 0; the simulator and the load generator
(C{wrk}, else C{bench/pyload.py}) share core 1.  Targets run in alternating
order over several rounds; each figure reported is the median over rounds.
The ratios llmgw / minimal-proxy are the result: absolute figures move with
the machine and its neighbours.

Run::

    .venv/bin/python bench/router_bench.py [--rounds 3] [--duration 10]
        [--json results.json]

Exit status: 0, or 1 when any request failed (non-2xx, socket errors) or a
check failed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from children import BenchError, Children
from wrk import parse_wrk

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
MODEL = "bench-model"
CONNECTIONS = 32
TOKENS = 16
PATH = "/v1/chat/completions"
TARGETS = ("direct", "llmgw", "llmgw-auth", "minimal-proxy")
"""
llmgw runs with usage records off and no keys; llmgw-auth, the same
server, with a key required on every request (limits set, so they are
checked) and every request recorded in its SQLite store.  With
C{--baseline-tree}, C{llmgw-baseline} is llmgw as that other checkout has
it (an earlier commit, say), run the same way as C{llmgw}.
"""
BASELINE = "llmgw-baseline"
KINDS = ("non-streaming", "streaming")
WARMUP = 2.0
"""
Seconds of load before each timed run, not measured.
"""

PROXY_CORE = "0"
LOAD_CORE = "1"


def chat_body(stream: bool) -> bytes:
    """
    The request every target gets: C{TOKENS} completion tokens.
    """
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": TOKENS,
            "stream": stream,
        }
    ).encode("utf-8")


def start_targets(children: Children, baseline_tree: str | None) -> dict[str, int]:
    """
    Start the simulator, llmgw and the minimal proxy, and llmgw from
    C{baseline_tree} when given.

    @param baseline_tree: a checkout of llmgw whose C{llmgw} package and
        twistd plugin come first on the baseline server's C{PYTHONPATH}
        (this virtual environment's libraries serve both).
    @return: each target's port on 127.0.0.1.
    """
    sim = children.start(
        "sim",
        LOAD_CORE,
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
    sim_port = int(sim.wait_for(r"llmgw sim listening on http://127\.0\.0\.1:(\d+)")[1])
    upstream = f"http://127.0.0.1:{sim_port}"
    # In the run's folder, removed with it.
    state = tempfile.mkdtemp(prefix="state-", dir=children.directory)
    off = os.path.join(state, "off.toml")
    with open(off, "w") as f:
        f.write("[store]\nrecord_usage = false\n")
    common = [
        os.path.join(BIN, "twistd"),
        "-n",
        "--pidfile=",
        "llmgw-server",
        "--listen",
        "tcp:0:interface=127.0.0.1",
        "--admin-listen",
        "tcp:0:interface=127.0.0.1",
        "--endpoint",
        f"sim={upstream}={MODEL}",
    ]
    llmgw = children.start(
        "llmgw", PROXY_CORE, [*common, "--config", off, "--state-dir", state + "/off"]
    )
    auth = children.start(
        "llmgw-auth", PROXY_CORE, [*common, "--state-dir", state + "/on"]
    )
    ports: dict[str, int] = {}
    if baseline_tree is not None:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(baseline_tree))
        baseline = children.start(
            BASELINE,
            PROXY_CORE,
            [*common, "--config", off, "--state-dir", state + "/baseline"],
            env=env,
        )
        ports[BASELINE] = int(
            baseline.wait_for(r"client API listening on 127\.0\.0\.1:(\d+)")[1]
        )
    minimal = children.start(
        "minimal-proxy",
        PROXY_CORE,
        [
            sys.executable,
            os.path.join(HERE, "minimal_proxy.py"),
            "--port",
            "0",
            "--upstream",
            upstream,
        ],
    )
    llmgw_port = int(llmgw.wait_for(r"client API listening on 127\.0\.0\.1:(\d+)")[1])
    auth_match = auth.wait_for(
        r"client API listening on 127\.0\.0\.1:(\d+), admin on 127\.0\.0\.1:(\d+)"
    )
    made = subprocess.run(
        [
            os.path.join(BIN, "llmgw"),
            "ctl",
            "--admin-url",
            f"http://127.0.0.1:{auth_match[2]}",
            "--json",
            "keys",
            "create",
            "--name",
            "bench",
            "--rpm",
            "1000000000",
            "--tpm",
            "1000000000000",
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    AUTH["llmgw-auth"] = "Bearer " + json.loads(made.stdout)["key"]
    minimal_port = int(
        minimal.wait_for(r"minimal proxy listening on 127\.0\.0\.1:(\d+)")[1]
    )
    ports.update(
        {
            "direct": sim_port,
            "llmgw": llmgw_port,
            "llmgw-auth": int(auth_match[1]),
            "minimal-proxy": minimal_port,
        }
    )
    return ports


AUTH: dict[str, str] = {}
"""
The Authorization header per target that needs one.
"""


def post(port: int, body: bytes, auth: str = "") -> tuple[int, str, bytes]:
    """
    One POST to C{PATH} on 127.0.0.1.

    @return: status, content type and the whole (de-chunked) body.
    """
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = auth
    try:
        connection.request("POST", PATH, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.getheader("content-type", ""), response.read()
    finally:
        connection.close()


def check_target(target: str, port: int) -> None:
    """
    One request of each kind: a 200 with C{TOKENS} completion tokens, and a
    200 event stream of C{TOKENS} content chunks ending in C{data: [DONE]}.

    @raise BenchError: otherwise.
    """
    auth = AUTH.get(target, "")
    if auth and post(port, chat_body(stream=False))[0] != 401:
        raise BenchError(f"{target}: a request without a key was not refused")
    status, content_type, body = post(port, chat_body(stream=False), auth)
    if status != 200:
        raise BenchError(f"{target}: non-streaming status {status}: {body[:300]!r}")
    usage = json.loads(body).get("usage") or {}
    if usage.get("completion_tokens") != TOKENS:
        raise BenchError(f"{target}: non-streaming usage {usage}, not {TOKENS} tokens")

    status, content_type, body = post(port, chat_body(stream=True), auth)
    if status != 200:
        raise BenchError(f"{target}: streaming status {status}: {body[:300]!r}")
    if not content_type.startswith("text/event-stream"):
        raise BenchError(f"{target}: streaming content type {content_type!r}")
    data = [
        line[len("data: ") :]
        for line in body.decode("utf-8").split("\n")
        if line.startswith("data: ")
    ]
    if not data or data[-1].strip() != "[DONE]":
        raise BenchError(f"{target}: stream does not end in data: [DONE]")
    chunks = 0
    for event in data[:-1]:
        for choice in json.loads(event).get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                chunks += 1
    if chunks != TOKENS:
        raise BenchError(f"{target}: {chunks} content chunks, not {TOKENS}")


@dataclass
class Run:
    """
    One timed run of one target and kind.  Latencies in milliseconds.
    """

    target: str
    kind: str
    round: int
    requests: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    cpu_ms_per_request: float


def load(
    children: Children,
    loadgen: str,
    port: int,
    stream: bool,
    duration: float,
    auth: str = "",
) -> dict[str, float]:
    """
    Load 127.0.0.1:C{port} with C{CONNECTIONS} connections for C{duration}
    seconds, the load generator on C{LOAD_CORE}.
    """
    url = f"http://127.0.0.1:{port}{PATH}"
    body = chat_body(stream)
    env = dict(os.environ)
    if auth:
        env["BENCH_AUTH"] = auth
    if loadgen == "wrk":
        argv = [
            "wrk",
            "-t1",
            f"-c{CONNECTIONS}",
            f"-d{duration:g}s",
            "--latency",
            "-s",
            os.path.join(HERE, "post.lua"),
            url,
        ]
        env["BENCH_BODY"] = body.decode("utf-8")
    else:
        argv = [
            sys.executable,
            os.path.join(HERE, "pyload.py"),
            "--url",
            url,
            "--connections",
            str(CONNECTIONS),
            "--duration",
            f"{duration:g}",
            "--body",
            body.decode("utf-8"),
        ]
    try:
        result = subprocess.run(
            children.pinned(LOAD_CORE, argv),
            capture_output=True,
            env=env,
            timeout=duration + 60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{argv[0]} ran past {duration + 60:g} s") from None
    output = result.stdout.decode("utf-8", "replace")
    if result.returncode != 0:
        raise BenchError(
            f"{argv[0]} exited with {result.returncode}:\n{output}"
            + result.stderr.decode("utf-8", "replace")
        )
    if loadgen == "wrk":
        return parse_wrk(output)
    figures: dict[str, float] = json.loads(output.strip().splitlines()[-1])
    figures["socket_errors"] = figures.pop("errors")
    return figures


def _median(runs: list[Run], name: str) -> float:
    return float(statistics.median(getattr(run, name) for run in runs))


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    """
    Per target and kind: medians over rounds, errors summed.
    """
    rows = []
    for target in (*TARGETS, BASELINE):
        for kind in KINDS:
            mine = [r for r in runs if r.target == target and r.kind == kind]
            if not mine:
                continue
            rows.append(
                {
                    "target": target,
                    "kind": kind,
                    "rounds": len(mine),
                    "requests_per_s": _median(mine, "requests_per_s"),
                    "p50_ms": _median(mine, "p50_ms"),
                    "p99_ms": _median(mine, "p99_ms"),
                    "cpu_ms_per_request": _median(mine, "cpu_ms_per_request"),
                    "non_2xx": sum(r.non_2xx for r in mine),
                    "socket_errors": sum(r.socket_errors for r in mine),
                }
            )
    return rows


def ratios(
    rows: list[dict[str, Any]],
    target: str = "llmgw",
    baseline: str = "minimal-proxy",
    figure: str = "requests_per_s",
) -> dict[str, float]:
    """
    C{target} / C{baseline} of a figure (throughput unless told) per kind.
    """
    rate = {(r["target"], r["kind"]): r[figure] for r in rows}
    result = {}
    for kind in KINDS:
        floor = rate.get((baseline, kind))
        ours = rate.get((target, kind))
        if floor and ours is not None:
            result[kind] = ours / floor
    return result


def auth_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """
    llmgw with keys and usage records / llmgw without, per kind.
    """
    return ratios(rows, "llmgw-auth", "llmgw")


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'target':<15}{'kind':<15}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}"
        f"{'non-2xx':>9}{'sock err':>9}{'cpu ms/req':>11}"
    )
    for r in rows:
        print(
            f"{r['target']:<15}{r['kind']:<15}{r['requests_per_s']:>10.1f}"
            f"{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}"
            f"{r['non_2xx']:>9}{r['socket_errors']:>9}"
            f"{r['cpu_ms_per_request']:>11.3f}"
        )


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    # Unwind through the finally blocks that stop the children.
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        description="llmgw vs a minimal Twisted proxy vs the simulator itself."
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument(
        "--duration",
        type=float,
        default=10.0,
        help="seconds per timed run (default 10)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results here")
    p.add_argument(
        "--baseline-tree",
        metavar="DIR",
        help="also run llmgw from this checkout (e.g. a git worktree of an"
        " earlier commit) as target llmgw-baseline, side by side",
    )
    p.add_argument(
        "--loadgen",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="wrk if installed (auto), or bench/pyload.py",
    )
    args = p.parse_args(argv)
    targets = TARGETS
    if args.baseline_tree is not None:
        if not os.path.isfile(os.path.join(args.baseline_tree, "llmgw", "__init__.py")):
            p.error(f"--baseline-tree: no llmgw checkout in {args.baseline_tree!r}")
        targets = (*TARGETS, BASELINE)
    if not 1 <= args.rounds <= 100 or not 0 < args.duration <= 600:
        p.error("--rounds must be 1..100 and --duration 0..600 seconds")
    loadgen = args.loadgen
    if loadgen == "auto":
        loadgen = "wrk" if shutil.which("wrk") else "python"
    if loadgen == "wrk" and not shutil.which("wrk"):
        p.error("wrk is not installed")
    pin = shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= 2
    signal.signal(signal.SIGTERM, _raise_exit)

    notes = [
        f"load generator: {loadgen}, {CONNECTIONS} connections,"
        f" {args.rounds} rounds x {args.duration:g} s, {WARMUP:g} s warm-up each",
        "pinning: proxy under test on core 0; simulator and load generator on"
        " core 1; direct runs share core 1 with the load generator"
        if pin
        else "pinning: OFF (no taskset or fewer than 2 cores): figures are noisier",
    ]
    for note in notes:
        print(note)

    directory = tempfile.mkdtemp(prefix="llmgw-bench-")
    children = Children(directory, pin)
    runs: list[Run] = []
    failed = False
    try:
        ports = start_targets(children, args.baseline_tree)
        for target in targets:
            check_target(target, ports[target])
        print("checks: 200s, 16 content chunks and data: [DONE] through every target")
        for round_ in range(args.rounds):
            order = targets if round_ % 2 == 0 else targets[::-1]
            kinds = KINDS if round_ % 2 == 0 else KINDS[::-1]
            for target in order:
                for kind in kinds:
                    stream = kind == "streaming"
                    auth = AUTH.get(target, "")
                    load(children, loadgen, ports[target], stream, WARMUP, auth)
                    server = children.find("sim" if target == "direct" else target)
                    cpu_before = server.cpu_seconds()
                    figures = load(
                        children, loadgen, ports[target], stream, args.duration, auth
                    )
                    cpu = server.cpu_seconds() - cpu_before
                    run = Run(
                        target=target,
                        kind=kind,
                        round=round_ + 1,
                        requests=int(figures["requests"]),
                        requests_per_s=figures["requests_per_s"],
                        p50_ms=figures["p50_ms"],
                        p99_ms=figures["p99_ms"],
                        non_2xx=int(figures["non_2xx"]),
                        socket_errors=int(figures["socket_errors"]),
                        cpu_ms_per_request=cpu * 1000 / max(1, figures["requests"]),
                    )
                    runs.append(run)
                    print(
                        f"round {run.round} {target:<14} {kind:<14}"
                        f" {run.requests_per_s:9.1f} req/s  p50 {run.p50_ms:7.2f} ms"
                        f"  p99 {run.p99_ms:7.2f} ms"
                        f"  cpu {run.cpu_ms_per_request:6.3f} ms/req"
                        + (f"  NON-2XX {run.non_2xx}" if run.non_2xx else "")
                        + (
                            f"  SOCKET ERRORS {run.socket_errors}"
                            if run.socket_errors
                            else ""
                        ),
                        flush=True,
                    )
        # The load must not have broken anything: check again after it.
        for target in targets:
            check_target(target, ports[target])
    except BenchError as e:
        sys.stderr.write(f"router_bench: FAILED: {e}\n")
        failed = True
    finally:
        children.stop_all()
        if failed or any(r.non_2xx or r.socket_errors for r in runs):
            sys.stderr.write(f"router_bench: child logs kept in {directory}\n")
        else:
            shutil.rmtree(directory, ignore_errors=True)

    rows = summarize(runs)
    result = ratios(rows)
    if rows:
        print()
        print_table(rows)
        print()
        for kind, value in result.items():
            print(f"ratio llmgw/minimal-proxy {kind} throughput: {value:.2f}")
        for kind, value in auth_ratios(rows).items():
            print(
                f"ratio llmgw with keys+usage / without, {kind} throughput: {value:.2f}"
            )
        for kind, value in ratios(rows, BASELINE).items():
            print(f"ratio llmgw-baseline/minimal-proxy {kind} throughput: {value:.2f}")
        for kind, value in ratios(rows, "llmgw", BASELINE).items():
            print(f"ratio llmgw/llmgw-baseline {kind} throughput: {value:.2f}")
        for kind, value in ratios(
            rows, "llmgw", BASELINE, "cpu_ms_per_request"
        ).items():
            print(
                f"ratio llmgw/llmgw-baseline {kind} server CPU per request: {value:.3f}"
            )
    errors = [r for r in rows if r["non_2xx"] or r["socket_errors"]]
    if errors:
        print()
        print("!" * 72)
        for r in errors:
            print(
                f"!!! ERRORS: {r['target']} {r['kind']}: {r['non_2xx']} non-2xx"
                f" responses, {r['socket_errors']} socket errors"
            )
        print("!!! figures from runs with errors are not comparable")
        print("!" * 72)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "notes": notes,
                    "connections": CONNECTIONS,
                    "tokens": TOKENS,
                    "rounds": args.rounds,
                    "duration_s": args.duration,
                    "failed": failed,
                    "summary": rows,
                    "ratios_llmgw_over_minimal_proxy": result,
                    "ratios_auth_usage_on_over_off": auth_ratios(rows),
                    "ratios_baseline_over_minimal_proxy": ratios(rows, BASELINE),
                    "ratios_llmgw_over_baseline": ratios(rows, "llmgw", BASELINE),
                    "ratios_cpu_per_request_llmgw_over_baseline": ratios(
                        rows, "llmgw", BASELINE, "cpu_ms_per_request"
                    ),
                    "runs": [asdict(r) for r in runs],
                },
                f,
                indent=2,
            )
            f.write("\n")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
