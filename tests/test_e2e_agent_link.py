"""
The agent link end to end: C{llmgw certs}, C{twistd llmgw-server} and
C{twistd llmgw-agent} as processes over real mutual TLS on loopback:
registering, refusals and backoff, reconnects, robustness.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.wire import agent_pb2 as pb
from llmgw.wire.codec import FrameDecoder
from tests.support import (
    BIN,
    CaseMixin,
    Process,
    Processes,
    free_port,
    hermetic_env,
    http,
    llmgw_certs,
    make_certs,
    spawn_agent,
)

AGENT_CONFIG = """
fabrics = ["ib-a"]
labels = { rack = "r7" }
[[simulated_gpus]]
name = "H200"
memory_gb = 141
[[simulated_gpus]]
name = "H200"
memory_gb = 141
"""


class _Fleet(Processes, CaseMixin):
    """
    A CA, a server certificate and gpu-01's, and twistd llmgw-server
    listening for agents over mutual TLS; agents started on demand.
    """

    timeout = 120

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="llmgw-fleet-")
        self.ca = make_certs(self.dir, "localhost,127.0.0.1", ["gpu-01"])
        self.agent_port = free_port()
        self.server, self.admin_url = self.start_fleet_server()

    def start_fleet_server(self) -> tuple[Process, str]:
        config = (
            f'[agent_tls]\nca = "{self.ca}/ca.pem"\ncert = "{self.ca}/server.pem"\n'
            f'key = "{self.ca}/server-key.pem"\n'
        )
        server, _, admin_url = self.start_server(
            "--agent-listen",
            f"tcp:{self.agent_port}:interface=127.0.0.1",
            config=config,
        )
        server.wait_for(r"agent listener on 127.0.0.1:\d+ \(mutual TLS\)")
        return server, admin_url

    def start_agent(self, node_id: str, tls_dir: str, *extra: str) -> Process:
        process = spawn_agent(
            self.dir, AGENT_CONFIG, self.agent_port, node_id, tls_dir, *extra
        )
        self.addCleanup(process.stop)
        return process

    def assert_backs_off(self, agent: Process) -> None:
        """
        The agent's reconnect delays grow (doubling, jittered) while its
        links are refused.
        """
        pattern = r"Scheduling retry \d+ to connect .* in ([\d.]+) seconds"
        deadline = time.monotonic() + 30
        delays: list[float] = []
        while time.monotonic() < deadline:
            delays = [float(d) for d in re.findall(pattern, agent.output())]
            if len(delays) >= 3:
                break
            time.sleep(0.1)
        self.assertGreaterEqual(len(delays), 3, agent.output()[-2000:])
        # Twisted's backoffPolicy adds up to 1 s of jitter: 1-2 s, then
        # 2-3 s, then 4-5 s.
        self.assertLess(delays[0], 2.01)
        self.assertGreaterEqual(delays[2], 4.0)

    def nodes(self) -> list[dict[str, Any]]:
        status, _, body = http("GET", self.admin_url + "/api/v1/nodes")
        self.assertEqual(status, 200)
        result: list[dict[str, Any]] = json.loads(body)["nodes"]
        return result

    def wait_for_node(self, node_id: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.nodes():
                if node["id"] == node_id and node["connected"]:
                    return node
            time.sleep(0.1)
        raise AssertionError(f"{node_id} never registered:\n{self.server.output()}")


class AgentLinkEndToEndTests(_Fleet, SynchronousTestCase):
    """
    Real processes, real certificates, real TLS.
    """

    def test_node_registers_with_simulated_gpus(self) -> None:
        """
        An agent with certificates from llmgw certs registers over mutual
        TLS; the node is ready in /api/v1/nodes with its simulated GPUs,
        fabrics and labels.  SIGTERM ends the agent within 5 s.
        """
        agent = self.start_agent("gpu-01", os.path.join(self.ca, "agents", "gpu-01"))
        node = self.wait_for_node("gpu-01")
        self.assertEqual(node["state"], "ready")
        self.assertEqual(
            [(g["name"], g["memory_total_mib"], g["simulated"]) for g in node["gpus"]],
            [("H200", 144384, True), ("H200", 144384, True)],
        )
        self.assertEqual((node["fabrics"], node["labels"]), (["ib-a"], {"rack": "r7"}))
        self.assertEqual(node["agent_version"], "0.1.0")
        self.assertRegex(node["last_seen"], r"^\d{4}-\d\d-\d\dT")
        agent.wait_for("no GPUs from NVML on this machine")
        started = time.monotonic()
        agent.popen.send_signal(signal.SIGTERM)
        agent.popen.wait(10)
        self.assertLess(time.monotonic() - started, 5)
        deadline = time.monotonic() + 5
        while self.nodes()[0]["connected"] and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertFalse(self.nodes()[0]["connected"])

    def test_refusals_logged(self) -> None:
        """
        Refused, each with its reason in the server log and no node
        recorded: an agent certificate from another CA, a CN that differs
        from --node-id, no client certificate, plaintext on the TLS port.
        """
        other = os.path.join(self.dir, "other")
        for args in (
            ["init", "--dir", other],
            ["agent", "--dir", other, "--node-id", "gpu-01"],
        ):
            llmgw_certs(*args)
        foreign = os.path.join(other, "agents", "gpu-01")
        # It trusts the real server, so only the server can refuse it.
        with open(os.path.join(self.ca, "ca.pem"), "rb") as src:
            with open(os.path.join(foreign, "ca.pem"), "wb") as dst:
                dst.write(src.read())
        self.start_agent("gpu-01", foreign)
        self.server.wait_for(r"refused agent connection .*certificate verify failed")
        impostor = self.start_agent("gpu-02", os.path.join(self.ca, "agents", "gpu-01"))
        self.server.wait_for(r"certificate CN 'gpu-01' claims to be node 'gpu-02'")
        # The refused agent backs off without a traceback (ClientService's
        # prepareConnection raised NoTransition on each refusal).
        self.assert_backs_off(impostor)
        self.assertNotIn("Traceback", impostor.output())
        context = ssl.create_default_context(cafile=os.path.join(self.ca, "ca.pem"))
        with socket.create_connection(("127.0.0.1", self.agent_port), timeout=5) as raw:
            try:
                with context.wrap_socket(raw, server_hostname="localhost") as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                pass
        self.server.wait_for(r"refused agent connection .*(certificate|alert)")
        count = self.server.output().count("refused agent connection")
        with socket.create_connection(("127.0.0.1", self.agent_port), timeout=5) as raw:
            raw.sendall(b"\x00\x00\x00\x05hello" * 4)
            try:
                raw.recv(100)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        while self.server.output().count("refused agent connection") == count:
            self.assertLess(time.monotonic(), deadline, self.server.output())
            time.sleep(0.1)
        self.assertEqual(self.nodes(), [])

    def test_reconnects_after_server_restart(self) -> None:
        """
        A restarted server needs no visit to the node: the agent dials again
        with backoff and registers.
        """
        self.start_agent("gpu-01", os.path.join(self.ca, "agents", "gpu-01"))
        self.wait_for_node("gpu-01")
        self.server.stop()
        time.sleep(1)
        self.server, self.admin_url = self.start_fleet_server()
        self.assertEqual(self.wait_for_node("gpu-01", timeout=40)["state"], "ready")


class LinkRobustnessTests(_Fleet, SynchronousTestCase):
    """
    What the link survives, and what the agent refuses, with processes.
    """

    def test_agent_refuses_server_of_other_name(self) -> None:
        """
        An agent never connects to a server whose certificate does not
        carry the host it dialled.
        """
        subprocess.run(
            [
                os.path.join(BIN, "llmgw"),
                "certs",
                "server",
                "--dir",
                self.ca,
                "--host",
                "elsewhere.example",
            ],
            check=True,
            timeout=60,
            capture_output=True,
            env=hermetic_env(),
        )
        self.server.stop()
        self.server, self.admin_url = self.start_fleet_server()
        agent = self.start_agent("gpu-01", os.path.join(self.ca, "agents", "gpu-01"))
        # Told once, with the names the certificate holds and the one dialed.
        told = (
            "the server's certificate names elsewhere.example, not 127.0.0.1, the"
            " host this agent dials (--server): dial one of those names, or make"
            " the server's certificate with llmgw certs server --host 127.0.0.1;"
            " retrying"
        )
        agent.wait_for(
            r"\[\S+#warn\] cannot link to the server at 127\.0\.0\.1:\d+: "
            + re.escape(told)
        )
        self.assert_backs_off(agent)
        self.assertEqual(self.nodes(), [])
        self.assertNotIn("registered with llmgw-server", agent.output())
        self.assertEqual(agent.output().count("cannot link to the server"), 1)
        self.assertNotIn("Traceback", agent.output())

    def test_agent_certificate_as_the_servers(self) -> None:
        """
        C{[agent_tls] cert} naming an agent's certificate: the server exits
        at start with status 2 and one line saying what the certificate is
        and how to make the right one, no traceback (before, it started,
        and every agent attempt logged a traceback on the agent).
        """
        self.server.stop()
        agent = os.path.join(self.ca, "agents", "gpu-01")
        config = (
            f'[agent_tls]\nca = "{self.ca}/ca.pem"\ncert = "{agent}/agent.pem"\n'
            f'key = "{agent}/agent-key.pem"\n'
        )
        with self.assertRaises(AssertionError) as raised:
            self.start_server(
                "--agent-listen",
                f"tcp:{self.agent_port}:interface=127.0.0.1",
                config=config,
            )
        output = str(raised.exception)
        self.assertIn("process exited with 2", output)
        self.assertIn(
            "llmgw-server: config error: agent_tls: cannot load the certificates:"
            f" {agent}/agent.pem is a client certificate (extended key usage"
            " clientAuth, CN 'gpu-01': an agent's?), not a server's: agents refuse"
            " it in every handshake; make the server's with llmgw certs server"
            " --host NAME (the names agents dial)\n",
            output,
        )
        self.assertNotIn("Traceback", output)

    def test_bad_frames_close_only_their_connection(self) -> None:
        """
        Over an authenticated TLS connection, a frame over the maximum and
        random garbage each close that connection only: a registered agent
        stays connected and the server keeps answering.  The frame over the
        maximum is told as a refusal (a Refused, code bad_frame) before the
        close.
        """
        self.start_agent("gpu-01", os.path.join(self.ca, "agents", "gpu-01"))
        self.wait_for_node("gpu-01")
        context = ssl.create_default_context(cafile=os.path.join(self.ca, "ca.pem"))
        folder = os.path.join(self.ca, "agents", "gpu-01")
        context.load_cert_chain(
            os.path.join(folder, "agent.pem"), os.path.join(folder, "agent-key.pem")
        )
        told: list[list[pb.ControlMessage]] = []
        for attack in (b"\x7f\xff\xff\xff" + b"x" * 100, os.urandom(4096)):
            with socket.create_connection(
                ("127.0.0.1", self.agent_port), timeout=10
            ) as raw:
                with context.wrap_socket(raw, server_hostname="localhost") as tls:
                    tls.sendall(attack)
                    received = b""
                    try:
                        # Until the server closes it: what it said first.
                        while chunk := tls.recv(100):
                            received += chunk
                    except (ssl.SSLError, ConnectionResetError):
                        pass
                    told.append(
                        [
                            pb.ControlMessage.FromString(frame)
                            for frame in FrameDecoder().feed(received)
                        ]
                    )
        (oversize,) = told[0]
        self.assertEqual(
            (oversize.refused.code, oversize.refused.reason),
            ("bad_frame", "frame of 2147483647 bytes: over the maximum of 4194304"),
        )
        # Garbage is refused one way or another (a bad frame, or a message
        # that is not Register): told, if anything is.
        self.assertLessEqual(len(told[1]), 1)
        self.assertTrue(all(m.HasField("refused") for m in told[1]))
        self.server.wait_for(r"frame of 2147483647 bytes")
        self.assertTrue(self.wait_for_node("gpu-01")["connected"])
        self.assertEqual(http("GET", self.admin_url + "/healthz")[0], 200)

    def test_twenty_agents_not_in_lockstep(self) -> None:
        """
        20 agents whose server goes away retry after delays spread by
        jitter, not all at once; all register again once it is back.
        """
        agents = []
        for i in range(20):
            node = f"n{i:02d}"
            subprocess.run(
                [
                    os.path.join(BIN, "llmgw"),
                    "certs",
                    "agent",
                    "--dir",
                    self.ca,
                    "--node-id",
                    node,
                ],
                check=True,
                timeout=60,
                capture_output=True,
                env=hermetic_env(),
            )
            agents.append(self.start_agent(node, os.path.join(self.ca, "agents", node)))
        deadline = time.monotonic() + 90
        while len([n for n in self.nodes() if n["connected"]]) < 20:
            self.assertLess(time.monotonic(), deadline, "agents did not register")
            time.sleep(0.2)
        self.server.stop()
        delays = []
        for agent in agents:
            match = agent.wait_for(
                r"Scheduling retry 1 to connect .* in ([\d.]+) seconds", timeout=30
            )
            delays.append(float(match.group(1)))
        self.server, self.admin_url = self.start_fleet_server()
        spread = max(delays) - min(delays)
        print(f"first retry delays of 20 agents: {sorted(round(d, 2) for d in delays)}")
        print(f"spread {spread:.2f} s")
        self.assertGreater(spread, 0.3)
        self.assertEqual(len(set(delays)), 20)
        deadline = time.monotonic() + 60
        while len([n for n in self.nodes() if n["connected"]]) < 20:
            self.assertLess(time.monotonic(), deadline, "agents did not come back")
            time.sleep(0.2)
