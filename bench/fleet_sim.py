"""
A fleet simulation (issue 12 item 7): many agents (simulated GPUs, no
engines) against one C{twistd -n llmgw-server}, over mutual TLS on
loopback with certificates made as C{llmgw certs} makes them.  Measures
the server's CPU and memory while the agents send heartbeats (every 5 s,
the interval the server's Welcome names), and the time to have every
agent registered again after the server restarts.

    .venv/bin/python bench/fleet_sim.py [--agents 1000] [--gpus 8]
        [--window 60]

The agents are one child process (C{--simulate}): one link per agent,
each a L{ClientService} with the real agent's backoff
(L{llmgw.agent.service.AgentService}: 0.5 s doubling to 30 s, jittered),
sending the Register an agent sends (its GPUs, no shards), then a
Heartbeat per interval with each GPU's memory used, and answering any
command with an ok result.  The server's CPU is read from
C{/proc/PID/stat} (user + system ticks) over C{--window} seconds once all
have registered and a few heartbeats went by; its memory is C{VmRSS} and
C{VmHWM} from C{/proc/PID/status}.

Targets: 1,000 agents under 10% of a core and 200 MB.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from children import BenchError, Child, Children

BIN = os.path.dirname(sys.executable)


def simulate(port: int, ca: str, count: int, gpus: int) -> None:
    """
    The agents' process: C{count} links to 127.0.0.1:C{port}.  Prints
    C{welcomed N at T} (T: POSIX seconds) each time the count of agents
    welcomed since the last link loss reaches C{count}.
    """
    from twisted.application.internet import ClientService, backoffPolicy
    from twisted.internet import reactor
    from twisted.internet.endpoints import SSL4ClientEndpoint
    from twisted.internet.protocol import Factory, connectionDone
    from twisted.internet.task import LoopingCall
    from twisted.python.failure import Failure

    from llmgw.wire import agent_pb2 as pb
    from llmgw.wire.protocol import MessageStream
    from llmgw.wire.tls import client_options

    welcomed: set[str] = set()

    def report() -> None:
        if len(welcomed) == count:
            print(f"welcomed {count} at {time.time():.3f}", flush=True)

    class SimAgent(MessageStream[pb.ControlMessage]):
        def __init__(self, node: int) -> None:
            super().__init__(pb.ControlMessage)
            self.node = node
            self.node_id = f"sim-{node:04d}"
            self.beat: LoopingCall | None = None
            self.rng = random.Random(node)

        def connectionMade(self) -> None:
            register = pb.Register(
                node_id=self.node_id,
                agent_version="fleet-sim",
                address=f"10.{self.node // 250}.{self.node % 250}.1",
                cpus=64,
                memory_bytes=512 << 30,
                gpus=[
                    pb.Gpu(
                        index=i,
                        uuid=f"GPU-{self.node:04d}-{i}",
                        name="H100",
                        memory_total_mib=80 * 1024,
                        simulated=True,
                    )
                    for i in range(gpus)
                ],
                max_frame_size=self._max,
            )
            self.send(pb.AgentMessage(register=register))

        def message_received(self, message: pb.ControlMessage) -> None:
            kind = message.WhichOneof("kind")
            if kind == "welcome":
                welcomed.add(self.node_id)
                report()
                if self.beat is None:
                    self.beat = LoopingCall(self.heartbeat)
                    self.beat.start(
                        message.welcome.heartbeat_interval_seconds or 5, now=False
                    )
                return
            if kind is None:
                return
            command = getattr(message, kind)
            result = pb.CommandResult(command_id=command.command_id, ok=True)
            self.send(pb.AgentMessage(command_result=result))

        def heartbeat(self) -> None:
            # Idle GPUs: the memory a driver holds, a little noise.
            usage = [
                pb.GpuUsage(index=i, memory_used_mib=500 + self.rng.randrange(4))
                for i in range(gpus)
            ]
            self.send(pb.AgentMessage(heartbeat=pb.Heartbeat(gpus=usage)))

        def connectionLost(self, reason: Failure = connectionDone) -> None:
            if self.beat is not None and self.beat.running:
                self.beat.stop()
            self.beat = None
            welcomed.discard(self.node_id)

    class SimFactory(Factory):
        def __init__(self, node: int) -> None:
            self.node = node

        def buildProtocol(self, addr: Any) -> SimAgent:
            protocol = SimAgent(self.node)
            protocol.factory = self
            return protocol

    def start(node: int) -> None:
        folder = os.path.join(ca, "agents", f"sim-{node:04d}")
        options = client_options(
            "127.0.0.1",
            os.path.join(folder, "ca.pem"),
            os.path.join(folder, "agent.pem"),
            os.path.join(folder, "agent-key.pem"),
        )
        endpoint = SSL4ClientEndpoint(reactor, "127.0.0.1", port, options)
        service = ClientService(
            endpoint,
            SimFactory(node),
            retryPolicy=backoffPolicy(initialDelay=0.5, maxDelay=30.0, factor=2.0),
        )
        service.startService()

    # Agents come up over a second or two, as a fleet booting does.
    for node in range(count):
        reactor.callLater(node * 0.002, start, node)
    print(f"simulating {count} agents", flush=True)
    reactor.run()


def memory_mb(pid: int) -> tuple[float, float]:
    """
    @return: C{VmRSS} and C{VmHWM} (peak) of process C{pid}, MB (10^6
        bytes), from C{/proc/PID/status}.
    """
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024 / 1e6
    return found["VmRSS"], found["VmHWM"]


def _server_argv(folder: str, config: str, agent_port: int) -> list[str]:
    return [
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
        "--agent-listen",
        f"tcp:{agent_port}:interface=127.0.0.1",
        "--state-dir",
        os.path.join(folder, "server-state"),
    ]


def _welcomed(sim: Child, after: int, timeout: float) -> float:
    """
    Wait for the simulator's C{after}+1-th C{welcomed} line.

    @return: its POSIX seconds.
    @raise BenchError: not within C{timeout} seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [ln for ln in sim.output().splitlines() if ln.startswith("welcomed ")]
        if len(lines) > after:
            return float(lines[after].rsplit(" ", 1)[1])
        if sim.popen.poll() is not None:
            raise BenchError("simulator exited:\n" + sim.output()[-3000:])
        time.sleep(0.1)
    raise BenchError(
        f"not every agent welcomed in {timeout:g}s:\n" + sim.output()[-2000:]
    )


def run(agents: int, gpus: int, window: float, folder: str) -> dict[str, float]:
    ca = os.path.join(folder, "ca")
    env = dict(os.environ)
    llmgw = os.path.join(BIN, "llmgw")
    for args in (["init", "--dir", ca], ["server", "--dir", ca, "--host", "127.0.0.1"]):
        subprocess.run(
            [llmgw, "certs", *args], check=True, capture_output=True, env=env
        )
    # The agents' certificates: what `llmgw certs agent` runs, in process
    # (a thousand commands would take minutes).
    from llmgw.wire.certs import issue_agent

    began = time.monotonic()
    for node in range(agents):
        issue_agent(ca, f"sim-{node:04d}")
    sys.stderr.write(
        f"{agents} agent certificates in {time.monotonic() - began:.1f}s\n"
    )
    config = os.path.join(folder, "server.toml")
    with open(config, "w") as f:
        f.write(
            f'[agent_tls]\nca = "{ca}/ca.pem"\ncert = "{ca}/server.pem"\n'
            f'key = "{ca}/server-key.pem"\n'
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        agent_port = int(s.getsockname()[1])
    children = Children(folder, pin=False)
    try:
        server = children.start("server", "0", _server_argv(folder, config, agent_port))
        server.wait_for(r"client API listening")
        sim = children.start(
            "agents",
            "0",
            [
                sys.executable,
                __file__,
                "--simulate",
                str(agent_port),
                ca,
                str(agents),
                str(gpus),
            ],
        )
        began, cpu_began = time.time(), server.cpu_seconds()
        first = _welcomed(sim, 0, 300)
        connect = first - began
        connect_cpu = server.cpu_seconds() - cpu_began
        # A few heartbeats by every agent before measuring.
        time.sleep(12)
        cpu0, t0 = server.cpu_seconds(), time.monotonic()
        time.sleep(window)
        cpu1, t1 = server.cpu_seconds(), time.monotonic()
        rss, peak = memory_mb(server.popen.pid)
        cpu = 100.0 * (cpu1 - cpu0) / (t1 - t0)
        # Restart: SIGTERM, then the same command on the same state.
        server.stop()
        restarted = time.time()
        again = children.start(
            "server-2", "0", _server_argv(folder, config, agent_port)
        )
        again.wait_for(r"client API listening")
        listening = time.time() - restarted
        back = _welcomed(sim, 1, 300) - restarted
        # Everything it did since it started: start-up and registrations.
        back_cpu = again.cpu_seconds()
        rss2, _ = memory_mb(again.popen.pid)
    finally:
        children.stop_all()
    return {
        "connect_s": connect,
        "connect_cpu_s": connect_cpu,
        "restart_cpu_s": back_cpu,
        "cpu_percent": cpu,
        "rss_mb": rss,
        "peak_mb": peak,
        "restart_listening_s": listening,
        "restart_all_s": back,
        "rss_after_restart_mb": rss2,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--simulate", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.simulate:
        port, ca, count, gpus = args.simulate
        simulate(int(port), ca, int(count), int(gpus))
        return 0
    folder = tempfile.mkdtemp(prefix="llmgw-fleet-sim-")
    sys.stderr.write(f"logs in {folder}\n")
    try:
        result = run(args.agents, args.gpus, args.window, folder)
    except BenchError as e:
        sys.stderr.write(f"fleet_sim: {e}\n")
        return 1
    load = os.getloadavg()
    cpu, rss = result["cpu_percent"], result["rss_mb"]
    print(f"{args.agents} agents of {args.gpus} GPUs, heartbeats every 5 s")
    print(
        f"  all registered {result['connect_s']:.1f}s after the simulator started"
        f" (server CPU meanwhile {result['connect_cpu_s']:.1f}s; the rest: the"
        " simulator's own handshakes, a busy machine)"
    )
    print(
        f"  server CPU over {args.window:g}s: {cpu:.2f}% of a core"
        f" ({cpu / args.agents * 1000:.2f}% per 1,000 agents)"
    )
    print(
        f"  server memory: RSS {rss:.0f} MB, peak {result['peak_mb']:.0f} MB"
        f" ({rss / args.agents * 1000:.0f} KB per agent, base included)"
    )
    print(
        f"  after a restart: listening in {result['restart_listening_s']:.1f}s,"
        f" every agent registered again in {result['restart_all_s']:.1f}s"
        f" (server CPU from its start {result['restart_cpu_s']:.1f}s;"
        f" RSS then {result['rss_after_restart_mb']:.0f} MB)"
    )
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    met = cpu < 10 and rss < 200
    print(
        "targets (1,000 agents: under 10% of a core and 200 MB):"
        f" {'met' if met else 'NOT met'}"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
