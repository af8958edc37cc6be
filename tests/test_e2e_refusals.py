"""
Refusals told where they happen (issue 20, findings 1 to 3), with
C{twistd llmgw-server} and C{twistd llmgw-agent} processes over mutual TLS
on loopback, simulated GPUs and C{llmgw sim} engines
(L{tests.test_e2e_control}'s fleet): an agent with another node's
certificate, a second agent for a node whose link is alive, and two
agents on one state directory, each told on the node, naming what the
operator must fix.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.support import Process, llmgw_certs, spawn_agent
from tests.test_e2e_control import AGENT_CONFIG, MODELS, _alive, _Fleet

# The warning an agent logs for a refusal (llmgw.agent.link).
REFUSED = r"the server at \S+ refused this agent: "

# A node without GPUs: the impostor of finding 2.
NO_GPUS = 'address = "127.0.0.1"\n'


class _Refusals(_Fleet):
    def agent_as(
        self, node_id: str, certificate_of: str, state: str, config: str = NO_GPUS
    ) -> Process:
        """
        Start an agent claiming C{node_id} with C{certificate_of}'s
        certificate, its state in C{state} (under the test's folder).
        """
        process = spawn_agent(
            self.dir,
            config.replace("{address}", "127.0.0.1"),
            self.agent_port,
            node_id,
            os.path.join(self.ca, "agents", certificate_of),
            "--state-dir",
            os.path.join(self.dir, state),
        )
        self.addCleanup(process.stop)
        return process

    def node(self, node_id: str) -> dict[str, Any] | None:
        for node in self.admin("/api/v1/nodes")["nodes"]:
            if node["id"] == node_id:
                result: dict[str, Any] = node
                return result
        return None

    def retries(self, agent: Process, count: int, timeout: float = 30) -> list[float]:
        """
        Wait for C{count} scheduled reconnects of C{agent}.

        @return: their delays, seconds.
        """
        pattern = r"Scheduling retry \d+ to connect .* in ([\d.]+) seconds"
        deadline = time.monotonic() + timeout
        while True:
            delays = [float(d) for d in re.findall(pattern, agent.output())]
            if len(delays) >= count or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.assertGreaterEqual(len(delays), count, agent.output()[-3000:])
        return delays


class RefusalsToldEndToEndTests(_Refusals, SynchronousTestCase):
    def test_other_nodes_certificate(self) -> None:
        """
        Finding 1: an agent started as gpu-02 with gpu-01's certificate
        logs the server's reason within 5 s of its start, at warning
        level, naming the certificate's CN and the node id it claimed;
        once, however many times it is refused again; its delays between
        attempts grow.
        """
        self.start_fleet_server(self.config(""))
        started = time.monotonic()
        agent = self.agent_as("gpu-02", "gpu-01", "state-impostor")
        line = re.escape(
            "certificate CN 'gpu-01' claims to be node 'gpu-02' (certificate"
            " 'gpu-01', node id 'gpu-02'); check --tls-dir and --node-id"
        )
        match = agent.wait_for(r"\[(\S+)#(\w+)\] " + REFUSED + line, timeout=5)
        seconds = time.monotonic() - started
        print(
            "agent with gpu-01's certificate as gpu-02: the reason logged"
            f" {seconds:.2f}s after its start"
        )
        self.assertEqual(match.group(2), "warn")
        self.assertLess(seconds, 5)
        delays = self.retries(agent, 3)
        self.assertLess(delays[0], 2.01)
        self.assertGreaterEqual(delays[2], 4.0)
        self.assertEqual(len(re.findall(REFUSED, agent.output())), 1, agent.output())
        self.assertIn("refused (certificate_mismatch)", agent.output())
        self.assertNotIn("Traceback", agent.output())
        self.assertIsNone(self.node("gpu-02"))

    def test_handshake_refusals(self) -> None:
        """
        Finding 1's siblings the server cannot send a message for, its TLS
        handshake failing: an agent whose certificate another CA signed is
        told, once, that the server refused its certificate; one whose
        ca.pem is another CA's, that it does not trust the server's.
        """
        self.start_fleet_server(self.config(""))
        other = os.path.join(self.dir, "other")
        llmgw_certs("init", "--dir", other)
        llmgw_certs("agent", "--dir", other, "--node-id", "gpu-01")
        foreign = os.path.join(other, "agents", "gpu-01")
        distrusting = os.path.join(self.dir, "distrusting")
        shutil.copytree(os.path.join(self.ca, "agents", "gpu-02"), distrusting)
        shutil.copy(os.path.join(other, "ca.pem"), distrusting)
        # It trusts the real server: only the server can refuse it.
        shutil.copy(os.path.join(self.ca, "ca.pem"), foreign)
        cases = (
            (
                "gpu-01",
                foreign,
                "the server refused this agent's certificate in the TLS handshake"
                " (tlsv1 alert unknown ca): is it from the fleet's CA? check"
                " --tls-dir; retrying",
            ),
            (
                "gpu-02",
                distrusting,
                "this agent does not trust the server's certificate (certificate"
                " verify failed): ca.pem in --tls-dir must be the fleet's CA;"
                " retrying",
            ),
        )
        for node, folder, told in cases:
            agent = spawn_agent(
                self.dir,
                NO_GPUS,
                self.agent_port,
                node,
                folder,
                "--state-dir",
                os.path.join(self.dir, f"state-{node}-tls"),
            )
            self.addCleanup(agent.stop)
            agent.wait_for(
                r"\[\S+#warn\] cannot link to the server at \S+: " + re.escape(told),
                timeout=10,
            )
            self.retries(agent, 3)
            self.assertEqual(
                agent.output().count("cannot link to the server"), 1, agent.output()
            )
        self.assertEqual(self.admin("/api/v1/nodes")["nodes"], [])

    def test_second_agent_for_a_live_node(self) -> None:
        """
        Finding 2: while gpu-01's agent runs a ready replica, a second
        agent for gpu-01 (its certificate, no GPUs, its own state
        directory) is refused, told why, and never replaces the link: for
        5 s of its retries, sampled every 100 ms, gpu-01 keeps its two GPUs
        and its link, the replica stays ready, and every request served
        through the router succeeds.
        """
        self.start_fleet_server(self.config(MODELS.format(min_replicas=1, idle="0s")))
        real = self.start_agent("gpu-01")
        (replica,) = self.ready(1)
        impostor = self.agent_as("gpu-01", "gpu-01", "state-impostor")
        impostor.wait_for(
            REFUSED
            + re.escape("node 'gpu-01' is linked to another agent, from 127.0.0.1:")
            + r"\d+, heard [\d.]+s ago: one agent per node id; this one may take"
            r" over once that link is silent for 3s \(certificate 'gpu-01', node id"
            r" 'gpu-01'\); is another agent running with this node id\? retrying",
            timeout=15,
        )
        deadline = time.monotonic() + 5
        samples = served = 0
        while time.monotonic() < deadline:
            node = self.node("gpu-01")
            assert node is not None
            self.assertEqual((node["connected"], len(node["gpus"])), (True, 2), node)
            (now,) = self.replicas()
            self.assertEqual((now["id"], now["state"]), (replica["id"], "ready"))
            if samples % 5 == 0:
                self.assertTrue(self.chat())
                served += 1
            samples += 1
            time.sleep(0.1)
        self.retries(impostor, 3)
        print(f"impostor refused: {samples} samples, {served} requests served")
        self.assertEqual(len(re.findall(REFUSED, impostor.output())), 1)
        self.assertNotIn("agent gpu-01 disconnected", self.server.output())
        self.assertNotIn("refused", real.output())
        self.assertTrue(_alive(replica["shards"][0]["pid"]))

    def test_silent_link_taken_over(self) -> None:
        """
        Finding 2's other side: once gpu-01's link has been silent for
        unreachable_after (its agent stopped with SIGSTOP), another agent
        for gpu-01 takes it over; the first agent, woken, is told it was
        replaced, and is then refused while the new link is alive.
        """
        config = self.config("").replace(
            'unreachable_after = "3s"\nlost_after = "6s"',
            # Heartbeats every 2 s, the silent link aborted after 12 s:
            # a second agent finds it between 6 and 12 s of silence.
            'unreachable_after = "6s"\nlost_after = "30s"',
        )
        self.start_fleet_server(config)
        first = self.start_agent("gpu-01")
        self.until(lambda: self.node("gpu-01"), 30, "gpu-01 registered")
        first.popen.send_signal(signal.SIGSTOP)
        self.addCleanup(first.popen.send_signal, signal.SIGCONT)
        self.until(
            lambda: (self.node("gpu-01") or {}).get("state") == "unreachable",
            15,
            "gpu-01 unreachable",
        )
        second = self.agent_as("gpu-01", "gpu-01", "state-second")
        second.wait_for("registered with llmgw-server", timeout=15)
        self.server.wait_for(
            r"agent gpu-01 from 127\.0\.0\.1:\d+ takes over from the link from"
            r" 127\.0\.0\.1:\d+, silent for [\d.]+s"
        )
        node = self.node("gpu-01")
        assert node is not None
        self.assertEqual((node["connected"], node["gpus"]), (True, []))
        first.popen.send_signal(signal.SIGCONT)
        first.wait_for(
            REFUSED + r"node 'gpu-01' was silent for [\d.]+s: another agent took"
            r" over \(certificate 'gpu-01', node id 'gpu-01'\); retrying"
        )
        first.wait_for(REFUSED + re.escape("node 'gpu-01' is linked to another agent"))
        node = self.node("gpu-01")
        assert node is not None
        self.assertEqual(node["gpus"], [])


class StateDirectoryEndToEndTests(_Refusals, SynchronousTestCase):
    def test_second_agent_on_one_state_directory(self) -> None:
        """
        Finding 3: a second agent (gpu-02, its own valid certificate) on
        gpu-01's state directory, while gpu-01's agent runs a ready
        replica, exits at once with status 2 and one line naming the
        folder and the first agent's pid; the engine keeps running and
        serving, gpu-02 never registers.
        """
        self.start_fleet_server(self.config(MODELS.format(min_replicas=1, idle="0s")))
        first = self.start_agent("gpu-01")
        (replica,) = self.ready(1)
        folder = os.path.join(self.dir, "state-gpu-01")
        started = time.monotonic()
        second = self.agent_as("gpu-02", "gpu-02", "state-gpu-01", AGENT_CONFIG)
        status = second.popen.wait(15)
        seconds = time.monotonic() - started
        print(
            f"second agent on one state directory: exited {status} after {seconds:.2f}s"
        )
        self.assertEqual(status, 2)
        self.assertEqual(
            second.output(),
            f"llmgw-agent: config error: state_dir: {folder!r} is in use by"
            f" llmgw-agent pid {first.popen.pid}: one agent per state directory"
            " (give this one its own --state-dir)\n",
        )
        self.assertTrue(_alive(replica["shards"][0]["pid"]))
        self.assertTrue(self.chat())
        (now,) = self.replicas()
        self.assertEqual((now["id"], now["state"]), (replica["id"], "ready"))
        self.assertIsNone(self.node("gpu-02"))

    def test_local_server_and_agent_on_one_state_directory(self) -> None:
        """
        The same for C{llmgw-server --local}, whose agent keeps its state
        in C{STATE_DIR/agent} (C{llmgw-agent}'s default state directory
        under the default C{~/.local/state/llmgw}): an agent there holds
        it, and a C{--local} server on C{STATE_DIR} exits at once with one
        line naming the folder and the agent's pid; with the server
        running, an agent on that folder exits the same way naming the
        server.
        """
        state = os.path.join(self.dir, "local-state")
        folder = os.path.join(state, "agent")
        agent = self.agent_as("gpu-01", "gpu-01", "local-state/agent")
        agent.wait_for("dialing")
        models = MODELS.format(min_replicas=0, idle="0s")
        local = self.config(models).split("[router]", 1)[1]
        with self.assertRaises(AssertionError) as raised:
            self.start_server(
                "--local", "--state-dir", state, config="[router]" + local
            )
        output = str(raised.exception)
        # Status 2, as every other state directory in use (docs/server.md).
        self.assertIn("process exited with 2", output)
        self.assertIn(
            f"llmgw-server: config error: state_dir: {folder!r} is in use by"
            f" llmgw-agent pid"
            f" {agent.popen.pid}: one agent per state directory",
            output,
        )
        self.assertNotIn("Traceback", output)
        agent.stop()
        server, _, _ = self.start_server(
            "--local", "--state-dir", state, config="[router]" + local
        )
        second = self.agent_as("gpu-01", "gpu-01", "local-state/agent")
        self.assertEqual(second.popen.wait(15), 2)
        self.assertEqual(
            second.output(),
            f"llmgw-agent: config error: state_dir: {folder!r} is in use by"
            f" llmgw-server --local pid {server.popen.pid}: one agent per state"
            " directory (give this one its own --state-dir)\n",
        )
