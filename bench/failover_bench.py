"""
Failover time of a standby control plane: two C{twistd -n llmgw-server}
processes on one throwaway PostgreSQL (L{tests.pg_support}, their
C{[store] url}), one
C{twistd -n llmgw-agent} given both addresses, one C{llmgw sim} replica
ready.  Each round kills the leader with SIGKILL and measures, from the
kill:

  - C{leads}: the standby logs that it holds the leader lock (its log
    polled every 20 ms);
  - C{served}: then, a chat completion through the standby's client API
    succeeds again (polled every 50 ms, 2 s per try);

then starts the killed server again (it stands by) for the next round.
The engine's pid is checked unchanged after every round (adopted, never
started twice).

    .venv/bin/python bench/failover_bench.py [--kills 3]

Prints one line per kill and the medians; the target is C{served} within
C{lost_after} (60 s by default; 6 s here).  Needs Debian's C{postgresql}
package.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from llmgw.server.engine_keys import SECRET_FILE
from tests.pg_support import PostgresServer, require_postgres
from tests.support import (
    TWISTD,
    Process,
    free_port,
    make_certs,
    spawn,
    spawn_agent,
)

CONFIG = """
[agent_tls]
ca = "{ca}/ca.pem"
cert = "{ca}/server.pem"
key = "{ca}/server-key.pem"
[control]
unreachable_after = "3s"
lost_after = "6s"
startup_grace = "4s"
interval = "250ms"
port_range = [{first}, {last}]
[store]
url = "{url}"
[[models]]
name = "chat"
min_replicas = 1
[[models.profiles]]
name = "one"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 40
"""

AGENT = """
address = "127.0.0.1"
[[simulated_gpus]]
name = "H200"
memory_gb = 141
"""


def chat(api: str, timeout: float = 2.0) -> bool:
    """
    @return: whether one chat completion through C{api} succeeded.
    """
    body = json.dumps(
        {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    request = urllib.request.Request(
        api + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def replicas(admin: str) -> list[dict[str, object]]:
    with urllib.request.urlopen(admin + "/api/v1/replicas", timeout=5) as response:
        found: list[dict[str, object]] = json.load(response)["replicas"]
        return found


class Server:
    def __init__(self, folder: str, name: str, config: str, agent_port: int) -> None:
        self.folder, self.name = folder, name
        self.config, self.agent_port = config, agent_port
        self.process: Process | None = None
        self.api = self.admin = ""

    def start(self) -> None:
        self.process = spawn(
            [
                TWISTD,
                "-n",
                "--pidfile=",
                "llmgw-server",
                "--config",
                self.config,
                "--listen",
                "tcp:0:interface=127.0.0.1",
                "--admin-listen",
                "tcp:0:interface=127.0.0.1",
                "--agent-listen",
                f"tcp:{self.agent_port}:interface=127.0.0.1",
                "--state-dir",
                os.path.join(self.folder, self.name),
            ],
            self.folder,
            f"{self.name}-{time.monotonic_ns()}",
        )
        match = self.process.wait_for(
            r"client API listening on [\d.]+:(\d+), admin on [\d.]+:(\d+)"
        )
        self.api = f"http://127.0.0.1:{match.group(1)}"
        self.admin = f"http://127.0.0.1:{match.group(2)}"

    def leads(self) -> bool:
        assert self.process is not None
        return "leading: holds the leader lock" in self.process.output()


def run(kills: int) -> list[tuple[float, float]]:
    folder = tempfile.mkdtemp(prefix="llmgw-failover-")
    postgres = PostgresServer(require_postgres())
    processes: list[Process] = []
    # The engine's pid, once known.
    engines: list[int] = []
    try:
        postgres.start()
        url = postgres.create_database("llmgw")
        ca = make_certs(folder, "127.0.0.1", ["gpu-01"])
        first = 21000 + os.getpid() % 9000
        config = os.path.join(folder, "server.toml")
        with open(config, "w") as f:
            f.write(CONFIG.format(ca=ca, url=url, first=first, last=first + 20))
        secret = secrets.token_hex(32)
        servers = []
        for name in ("a", "b"):
            os.makedirs(os.path.join(folder, name), mode=0o700)
            with open(os.path.join(folder, name, SECRET_FILE), "w") as f:
                f.write(secret + "\n")
            servers.append(Server(folder, name, config, free_port()))
        for server in servers:
            server.start()
            assert server.process is not None
            processes.append(server.process)
            deadline = time.monotonic() + 10
            while server is servers[0] and not server.leads():
                if time.monotonic() > deadline:
                    raise SystemExit("the first server does not lead")
                time.sleep(0.05)
        agent = spawn_agent(
            folder,
            AGENT,
            servers[0].agent_port,
            "gpu-01",
            os.path.join(ca, "agents", "gpu-01"),
            "--server",
            f"127.0.0.1:{servers[1].agent_port}",
        )
        processes.append(agent)
        deadline = time.monotonic() + 60
        while not chat(servers[0].api):
            if time.monotonic() > deadline:
                raise SystemExit("no replica ready within 60 s")
            time.sleep(0.2)
        (replica,) = replicas(servers[0].admin)
        pid = replica["shards"][0]["pid"]  # type: ignore[index]
        engines.append(pid)
        results = []
        for round_ in range(kills):
            leader = next(s for s in servers if s.leads())
            standby = next(s for s in servers if s is not leader)
            assert leader.process is not None
            leader.process.popen.send_signal(signal.SIGKILL)
            leader.process.popen.wait(10)
            killed = time.monotonic()
            # The lock first (a request to a standby waits), then requests.
            while not standby.leads():
                if time.monotonic() - killed > 30:
                    raise SystemExit(f"round {round_ + 1}: no leader within 30 s")
                time.sleep(0.02)
            leads = time.monotonic() - killed
            while not chat(standby.api):
                if time.monotonic() - killed > 30:
                    raise SystemExit(f"round {round_ + 1}: not served within 30 s")
                time.sleep(0.05)
            served = time.monotonic() - killed
            (replica,) = replicas(standby.admin)
            same = replica["shards"][0]["pid"] == pid  # type: ignore[index]
            print(
                f"kill {round_ + 1}: leads {leads:.2f}s, served {served:.2f}s,"
                f" engine pid {'unchanged' if same else 'CHANGED'}",
                flush=True,
            )
            if not same:
                raise SystemExit("an engine was started twice")
            results.append((leads, served))
            leader.start()
            assert leader.process is not None
            processes.append(leader.process)
            leader.process.wait_for("standby: leader chosen")
            # Let the restarted standby's first tries pass.
            time.sleep(1.5)
        return results
    finally:
        for process in reversed(processes):
            process.stop()
        # An agent leaves its engines running when it stops (a restarted
        # agent adopts them): the bench's own engine goes with the bench.
        for engine in engines:
            try:
                os.kill(engine, signal.SIGTERM)
            except OSError:
                pass
        postgres.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3)
    args = parser.parse_args()
    results = run(args.kills)
    leads = statistics.median(r[0] for r in results)
    served = statistics.median(r[1] for r in results)
    load = os.getloadavg()[0]
    print(
        f"failover over {len(results)} kills: median leads {leads:.2f}s,"
        f" served again {served:.2f}s (lost_after 6s); load average {load:.1f}"
    )


if __name__ == "__main__":
    main()
