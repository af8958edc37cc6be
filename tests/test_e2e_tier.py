"""
A tier of routers (issue 12 item 2) through real processes: C{twistd
llmgw-router} following a C{twistd llmgw-server}'s admin API (its watch
pushes endpoints and catalog names), activations forwarded to the control
plane, and C{llmgw-server --router-workers 2} surviving a C{kill -9} of a
worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import (
    BIN,
    TWISTD,
    Process,
    Processes,
    hermetic_env,
    http,
    make_certs,
    sim_stats,
    spawn,
)
from tests.test_e2e_control import MODELS, _alive, _Fleet

EXTRA = {
    "name": "extra",
    "min_replicas": 0,
    "profiles": [
        {
            "name": "one",
            "engine": "sim",
            "source": "sim",
            "gpus": 1,
            "gpu_memory_gb": 40,
        }
    ],
}

FOLLOWING = re.compile(r"following the control plane: version (\d+), (\d+) endpoints")


def _endpoint_counts(process: Process) -> list[int]:
    """
    @return: the endpoint count of each state the router logged, in order.
    """
    return [int(m.group(2)) for m in FOLLOWING.finditer(process.output())]


def spawn_router(
    test: Processes, control: str, state: str, *extra: str
) -> tuple[Process, str]:
    """
    Start C{twistd -n llmgw-router} following C{control}, its state in
    C{state} under the test's folder, stopped at the test's end.

    @return: the process and its client API's base URL.
    """
    directory = test._directory()
    process = spawn(
        [
            TWISTD,
            "-n",
            "--pidfile=",
            "llmgw-router",
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--control",
            control,
            "--state-dir",
            os.path.join(directory, state),
            *extra,
        ],
        directory,
        f"router-{time.monotonic_ns()}",
    )
    test.addCleanup(process.stop)  # type: ignore[attr-defined]
    match = process.wait_for(r"llmgw-router: client API listening on [\d.]+:(\d+)")
    return process, f"http://127.0.0.1:{match.group(1)}"


class RouterTierTests(_Fleet, SynchronousTestCase):
    """
    One control plane, one agent, one C{llmgw-router} beside them.
    """

    def start_router(self) -> tuple[Process, openai.OpenAI, str]:
        process, url = spawn_router(self, self.admin_url, "server-state")
        process.wait_for(FOLLOWING.pattern)
        client = openai.OpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        return process, client, url

    def router_models(self, url: str) -> list[str]:
        status, _, body = http("GET", url + "/v1/models")
        self.assertEqual(status, 200, body)
        return [m["id"] for m in json.loads(body)["data"]]

    def within(self, seconds: float, check: Any, what: str) -> float:
        """
        @return: the seconds C{check} took to hold; fails past C{seconds}.
        """
        started = time.monotonic()
        while not check():
            elapsed = time.monotonic() - started
            self.assertLess(elapsed, seconds, f"not within {seconds} s: {what}")
            time.sleep(0.02)
        return time.monotonic() - started

    def test_follows_and_activates(self) -> None:
        """
        The router lists the server's catalog; a model added or removed on
        the server appears or goes on the router within 1 s; a request for
        a min_replicas = 0 model through the router activates it on the
        control plane and succeeds; the replica's endpoint reaches the
        router within 1 s of the server's ready, and leaves it within 1 s
        of a drain.
        """
        self.start_fleet_server(self.config(MODELS.format(min_replicas=0, idle="60s")))
        self.start_agent("gpu-01")
        self.until(lambda: len(self.admin("/api/v1/nodes")["nodes"]) == 1, 20, "node")
        router, client, url = self.start_router()
        self.assertEqual(sorted(self.router_models(url)), ["chat", "chat-alias"])
        self.assertEqual(_endpoint_counts(router), [0])

        # The catalog, pushed.
        status, _, body = http(
            "POST", self.admin_url + "/api/v1/models", json.dumps(EXTRA).encode()
        )
        self.assertEqual(status, 201, body)
        self.within(1.0, lambda: "extra" in self.router_models(url), "model added")
        status, _, body = http("DELETE", self.admin_url + "/api/v1/models/extra")
        self.assertEqual(status, 200, body)
        self.within(1.0, lambda: "extra" not in self.router_models(url), "removed")

        # Activation through the router, and the endpoint it brings.
        answers: list[str] = []
        thread = threading.Thread(
            target=lambda: answers.append(
                client.chat.completions.create(
                    model="chat-alias",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=3,
                )
                .choices[0]
                .message.content
                or ""
            )
        )
        thread.start()
        self.addCleanup(thread.join, 60)
        server_ready = self.until(
            lambda: (
                time.monotonic()
                if any(r["state"] == "ready" for r in self.replicas())
                else None
            ),
            60,
            "a ready replica on the server",
        )
        self.within(
            1.0 - (time.monotonic() - server_ready),
            lambda: 1 in _endpoint_counts(router),
            "the endpoint on the router",
        )
        thread.join(30)
        self.assertEqual(len(answers), 1)
        self.assertTrue(answers[0])
        self.assertIn(
            "activating model chat: a request is waiting", self.server.output()
        )

        # A drain on the server (forced: at once, not replaced first): gone
        # from the router at once.
        (replica,) = self.ready(1)
        seen = len(_endpoint_counts(router))
        status, _, body = http(
            "POST",
            self.admin_url + f"/api/v1/replicas/{replica['id']}/drain",
            b'{"force": true}',
        )
        self.assertEqual(status, 200, body)
        self.within(
            1.0, lambda: 0 in _endpoint_counts(router)[seen:], "endpoint gone on router"
        )


class RouterWorkersTests(Processes, SynchronousTestCase):
    """
    C{llmgw-server --router-workers 2} in front of one simulated engine.
    """

    timeout = 120

    def start_router(self, control: str, *extra: str) -> tuple[Process, str]:
        return spawn_router(self, control, "router-state", *extra)

    def chat(self, url: str, key: str = "") -> int:
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        status, _, _ = http(
            "POST",
            url + "/v1/chat/completions",
            json.dumps(
                {
                    "model": "sim-model",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                }
            ).encode(),
            headers,
        )
        return status

    def test_kill_worker(self) -> None:
        """
        Both workers serve on the server's port; a worker killed with
        SIGKILL is started again while the other serves every request; the
        server's stop stops both.
        """
        _, sim = self.start_sim()
        server, url, _ = self.start_server(
            "--router-workers", "2", "--endpoint", f"e1={sim}=sim-model"
        )
        server.wait_for(r"router worker 2 started")
        pids = {
            int(n): int(p)
            for n, p in re.findall(
                r"router worker (\d) started: pid (\d+)", server.output()
            )
        }
        self.assertEqual(sorted(pids), [1, 2])
        for pid in pids.values():
            server.wait_for(rf"client API listening on [\d.]+:\d+ \(pid {pid}\)")
        server.wait_for(r"(?s)following the control plane.*following the control")
        self.assertEqual([self.chat(url) for _ in range(10)], [200] * 10)

        os.kill(pids[1], signal.SIGKILL)
        # Connections the kernel queued on its socket until it closed at
        # exit are reset; every later one goes to the other worker.  (The
        # socket closes with the last thread, after /proc shows a zombie:
        # wait for the server to reap it.)
        server.wait_for(rf"router worker 1 \(pid {pids[1]}\) ended")
        self.assertEqual([self.chat(url) for _ in range(20)], [200] * 20)
        match = server.wait_for(
            r"router worker 1 started: pid (\d+)\n(?s:.*)"
            r"router worker 1 started: pid (\d+)"
        )
        replacement = int(match.group(2))
        self.assertNotEqual(replacement, pids[1])
        server.wait_for(rf"listening on [\d.]+:\d+ \(pid {replacement}\)")
        self.assertEqual([self.chat(url) for _ in range(10)], [200] * 10)

        # twistd ends by its SIGTERM once its stop is done.
        self.assertIn(server.stop(), (0, -signal.SIGTERM))
        self.assertIn("stopped: store closed", server.output())
        for pid in (replacement, pids[2]):
            self.assertFalse(_alive(pid), f"worker {pid} outlived the server")

    def test_orphaned_workers_exit(self) -> None:
        """
        A server killed with SIGKILL (no stop of its own) leaves no worker
        behind: each sees it gone within about a second and stops.
        """
        _, sim = self.start_sim()
        server, _, _ = self.start_server(
            "--router-workers", "2", "--endpoint", f"e1={sim}=sim-model"
        )
        server.wait_for(r"router worker 2 started")
        pids = [
            int(p)
            for p in re.findall(r"router worker \d started: pid (\d+)", server.output())
        ]
        for pid in pids:
            server.wait_for(rf"client API listening on [\d.]+:\d+ \(pid {pid}\)")
        server.popen.kill()
        server.popen.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual([p for p in pids if _alive(p)], [])

    def test_keys_follow(self) -> None:
        """
        A key made on the server works through every worker within 1 s
        (and the API then needs one); revoked, every worker refuses it
        within 1 s.
        """
        _, sim = self.start_sim()
        server, url, admin = self.start_server(
            "--router-workers", "2", "--endpoint", f"e1={sim}=sim-model"
        )
        server.wait_for(r"(?s)following the control plane.*following the control")
        self.assertEqual(self.chat(url), 200)
        status, _, body = http("POST", admin + "/api/v1/keys", b'{"name": "k1"}')
        self.assertEqual(status, 201, body)
        secret = json.loads(body)["key"]
        # Each round asks ten times on new connections, which the kernel
        # spreads over both workers: the key is followed when every worker
        # agrees, not when the first one does.  The bound is on when a
        # wrongly answered request was sent, not on when its round ended
        # (a round of real requests takes a while on a loaded machine).
        started = time.monotonic()

        def wrong(key: str, expected: int) -> list[float]:
            """
            @return: when each request of a round that did not get
                C{expected} was sent, seconds after C{started}.
            """
            sent = []
            for _ in range(10):
                at = time.monotonic() - started
                if self.chat(url, key) != expected:
                    sent.append(at)
            return sent

        while late := wrong("", 401) + wrong(secret, 200):
            self.assertLess(max(late), 1.0, "key not followed")
            time.sleep(0.02)
        status, _, body = http("POST", admin + "/api/v1/keys/k1/revoke", b"")
        self.assertEqual(status, 200, body)
        started = time.monotonic()
        while late := wrong(secret, 401):
            self.assertLess(max(late), 1.0, "revocation not followed")
            time.sleep(0.02)

    def test_control_over_tls(self) -> None:
        """
        A router follows an admin listener on TLS with --control-ca, and
        refuses one whose certificate it cannot verify.
        """
        directory = self._directory()
        ca = make_certs(directory, "127.0.0.1", [])
        _, sim = self.start_sim()
        _, _, admin = self.start_server(
            "--admin-listen",
            f"ssl:0:interface=127.0.0.1:privateKey={ca}/server-key.pem"
            f":certKey={ca}/server.pem",
            "--endpoint",
            f"e1={sim}=sim-model",
        )
        control = admin.replace("http://", "https://")
        trusted, url = self.start_router(control, "--control-ca", f"{ca}/ca.pem")
        trusted.wait_for(FOLLOWING.pattern)
        self.assertEqual(self.chat(url), 200)
        untrusted, _ = self.start_router(control)
        untrusted.wait_for(r"cannot watch the control plane at https://")
        self.assertNotRegex(untrusted.output(), FOLLOWING.pattern)

    def test_router_settings_apply(self) -> None:
        """
        C{llmgw-router} chooses replicas by its file's C{[router]} table as
        the server does: with C{balance = "round_robin"}, ten requests of
        one long prompt (which prefix affinity, on by default, would keep
        on one replica) alternate between the two replicas.
        """
        directory = self._directory()
        sims = [self.start_sim()[1] for _ in range(2)]
        _, _, admin = self.start_server(
            "--endpoint",
            f"e1={sims[0]}=sim-model",
            "--endpoint",
            f"e2={sims[1]}=sim-model",
        )
        path = os.path.join(directory, "router.toml")
        with open(path, "w") as f:
            f.write('[router]\nbalance = "round_robin"\n')
        process, url = self.start_router(admin, "--config", path)
        process.wait_for(r"following the control plane: version \d+, 2 endpoints")
        before = [sim_stats(s)["requests_total"] for s in sims]
        prompt = "the same long system prompt " * 200
        for _ in range(10):
            status, _, body = http(
                "POST",
                url + "/v1/chat/completions",
                json.dumps(
                    {
                        "model": "sim-model",
                        "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": 2,
                    }
                ).encode(),
                {"content-type": "application/json"},
            )
            self.assertEqual(status, 200, body)
        served = [
            sim_stats(s)["requests_total"] - b
            for s, b in zip(sims, before, strict=True)
        ]
        self.assertEqual(served, [5, 5])


class RouterWorkersKeysTests(Processes, SynchronousTestCase):
    """
    Keys changed on a server with C{--router-workers 2} and its SQLite
    store: both workers, following the server's watch, take the change.
    """

    timeout = 120

    def test_key_update_reaches_workers(self) -> None:
        """
        A key for one model is let use another with keys update: within
        2 s every request for it, on new connections spread over both
        workers, is admitted (before, a worker kept the models it had
        read: 403 for ever).  The 2 s is from C{ctl}'s return to the sending of
        the last request refused.
        """
        _, sim = self.start_sim()
        _, other = self.start_sim(model="other-model")
        server, url, admin = self.start_server(
            "--router-workers",
            "2",
            "--endpoint",
            f"e1={sim}=sim-model",
            "--endpoint",
            f"e2={other}=other-model",
        )
        server.wait_for(r"(?s)following the control plane.*following the control")
        ctl = [os.path.join(BIN, "llmgw"), "ctl", "--admin-url", admin, "--json"]

        def run(*args: str) -> Any:
            done = subprocess.run(
                [*ctl, *args],
                capture_output=True,
                text=True,
                timeout=60,
                env=hermetic_env(),
                stdin=subprocess.DEVNULL,
            )
            self.assertEqual(done.returncode, 0, done.stderr)
            return json.loads(done.stdout)

        key = run("keys", "create", "--name", "app", "--models", "sim-model")["key"]

        def ask(model: str) -> int:
            status, _, _ = http(
                "POST",
                url + "/v1/chat/completions",
                json.dumps(
                    {"model": model, "messages": [{"role": "user", "content": "hi"}]}
                ).encode(),
                {"content-type": "application/json", "authorization": f"Bearer {key}"},
            )
            return status

        # Rounds of ten on new connections, which the kernel spreads over
        # both workers: a key is known when every worker refuses it the
        # model it may not use (a worker that knows no key yet lets every
        # request in).
        deadline = time.monotonic() + 5
        while {ask("other-model") for _ in range(10)} != {403}:
            self.assertLess(time.monotonic(), deadline, "key never known")
            time.sleep(0.1)
        self.assertEqual({ask("sim-model") for _ in range(10)}, {200})
        run("keys", "update", "app", "--models", "sim-model,other-model")
        updated = time.monotonic()
        while late := [
            at
            for at in (time.monotonic() - updated for _ in range(20))
            if ask("other-model") != 200
        ]:
            self.assertLess(max(late), 2.0, "update not taken")
            time.sleep(0.1)
        took = time.monotonic() - updated
        print(f"key update taken by both workers: a round all admitted {took:.2f} s on")
