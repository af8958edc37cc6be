"""
What polling engine load costs the server: CPU of C{twistd -n llmgw-server}
with N static replicas (default 200) whose C{/metrics} it reads every
second, against the same server with polling off (C{load_poll_interval =
"0s"}), in the same run.

The replicas are one child process (C{--serve}) listening on N loopback
ports, each answering C{GET /metrics} with the page C{llmgw sim} serves
(L{llmgw.sim.metrics.SimMetrics}: vLLM's names, histograms included) and
counting the requests, so the run also checks that every replica was
polled about once a second.

    .venv/bin/python bench/load_poll_bench.py [--replicas 200] [--duration 30]

Prints one line per configuration and the difference, in percent of one
core; exit status 1 when the polls counted fall short of 90% of
replicas x seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from children import BenchError, Children

BIN = os.path.dirname(sys.executable)


def serve(count: int) -> None:
    """
    The replicas' process: C{count} ports, one page, a count of GETs per
    port on C{GET /count} of the first port.
    """
    from twisted.internet import reactor
    from twisted.web.resource import Resource
    from twisted.web.server import Request, Site

    from llmgw.sim.metrics import SimMetrics

    class Load:
        running = 3
        waiting = 1

    page = SimMetrics("m", 8, Load()).render()
    counts: dict[int, int] = {}

    class Page(Resource):
        isLeaf = True

        def __init__(self, port: int) -> None:
            super().__init__()
            self.port = port

        def render_GET(self, request: Request) -> bytes:
            if request.path == b"/count":
                return json.dumps(counts).encode()
            counts[self.port] = counts.get(self.port, 0) + 1
            return page

    ports = []
    for index in range(count):
        site = Site(Page(index))
        site.log = lambda request: None  # type: ignore[method-assign]
        listening = reactor.listenTCP(0, site, interface="127.0.0.1")  # type: ignore[attr-defined]
        ports.append(listening.getHost().port)
    print("ports " + ",".join(map(str, ports)), flush=True)
    reactor.run()  # type: ignore[attr-defined]


def polls(first_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{first_port}/count") as f:
        return sum(json.load(f).values())


def run(
    replicas: int, duration: float, interval: str, folder: str
) -> tuple[float, int]:
    """
    @return: the server's CPU in percent of one core over C{duration}
        seconds, and the polls the replicas counted meanwhile.
    """
    children = Children(folder, pin=False)
    try:
        engines = children.start(
            "replicas", "0", [sys.executable, __file__, "--serve", str(replicas)]
        )
        ports = [
            int(p) for p in engines.wait_for(r"ports ([\d,]+)").group(1).split(",")
        ]
        config = os.path.join(folder, f"server-{interval}.toml")
        with open(config, "w") as f:
            f.write(f'[router]\nload_poll_interval = "{interval}"\n')
            for index, port in enumerate(ports):
                f.write(
                    f'[[endpoints]]\nid = "r{index}"\n'
                    f'url = "http://127.0.0.1:{port}"\nmodels = ["m"]\n'
                )
        server = children.start(
            "server",
            "0",
            [
                os.path.join(BIN, "twistd"),
                "-n",
                "--pidfile=",
                "llmgw-server",
                "--config",
                config,
                "--listen",
                "tcp:0:interface=127.0.0.1",
                "--admin-listen",
                "tcp:0:interface=127.0.0.1",
                "--state-dir",
                os.path.join(folder, f"state-{interval}"),
            ],
        )
        server.wait_for(r"client API listening")
        time.sleep(3.0)
        cpu0, polls0, t0 = server.cpu_seconds(), polls(ports[0]), time.monotonic()
        time.sleep(duration)
        cpu1, polls1, t1 = server.cpu_seconds(), polls(ports[0]), time.monotonic()
        return 100.0 * (cpu1 - cpu0) / (t1 - t0), polls1 - polls0
    finally:
        children.stop_all()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=200)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    folder = tempfile.mkdtemp(prefix="llmgw-load-bench-")
    sys.stderr.write(f"logs in {folder}\n")
    try:
        off, _ = run(args.replicas, args.duration, "0s", folder)
        on, counted = run(args.replicas, args.duration, "1s", folder)
    except BenchError as e:
        sys.stderr.write(f"load_poll_bench: {e}\n")
        return 1
    expected = args.replicas * args.duration
    print(f"polling off: server CPU {off:.2f}% of a core")
    print(
        f"polling {args.replicas} replicas each 1s: server CPU {on:.2f}% of a core,"
        f" {counted} polls in {args.duration:g}s ({counted / expected:.0%} of expected)"
    )
    per_poll_ms = (on - off) * 10 / max(counted / args.duration, 1)
    print(
        f"cost of polling: {on - off:.2f}% of a core"
        f" ({per_poll_ms:.3f} ms CPU per poll)"
    )
    return 0 if counted >= 0.9 * expected else 1


if __name__ == "__main__":
    sys.exit(main())
