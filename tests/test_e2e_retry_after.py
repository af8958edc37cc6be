"""
Every refusal that asks the client to come back later says when: a
C{Retry-After} on each 429 and 503 llmgw answers by itself, through a
running C{twistd -n llmgw-server}: the activation queue of a catalog model
full, a wait for an activation past C{activation_timeout} (in the server
and through a C{twistd llmgw-router} of a tier), the edge's connection caps
(per client and global).  An activation's C{Retry-After} is computed from
the queue (L{llmgw.router.routing.activation.retry_seconds}), never a fixed
number; a waiting stream's keep-alive comments say where it stands.
"""

from __future__ import annotations

import json
import os
import threading
import time

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.edge_support import EdgeServer, connect, parse_response, read_until_closed
from tests.support import http
from tests.test_e2e_control import MODELS, _Fleet
from tests.test_e2e_tier import spawn_router

CHAT = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}'
STREAM = (
    b'{"model": "chat", "stream": true,'
    b' "messages": [{"role": "user", "content": "hi"}]}'
)


class ActivationQueueTests(_Fleet, SynchronousTestCase):
    """
    A catalog model no node can hold (no agent), one request allowed to
    wait for its activation.
    """

    def test_queue_full_has_retry_after(self) -> None:
        """
        While one request waits for C{chat} to start, the next (plain or
        streamed) gets 503 C{activation_queue_full} with C{Retry-After}.
        """
        config = self.config(MODELS.format(min_replicas=0, idle="60s"), "20s")
        config = config.replace("[router]\n", "[router]\nactivation_queue = 1\n")
        self.start_fleet_server(config)
        url = self.api_url + "/v1/chat/completions"
        headers = {"content-type": "application/json"}
        first = threading.Thread(
            target=http, args=("POST", url, CHAT, headers, 40), daemon=True
        )
        first.start()
        self.addCleanup(first.join, 40)

        def waiting() -> bool:
            models = self.admin("/api/v1/models")["models"]
            return any(
                m["name"] == "chat" and m["waiting_requests"] == 1 for m in models
            )

        # The first request holds the queue's one place before the next is
        # sent (else the next may take it, and wait its 20 s).
        self.until(waiting, 15, "the first request waiting")
        status, answer, body = http("POST", url, CHAT, headers)
        self.assertIn(b"activation_queue_full", body)
        self.assertEqual(status, 503)
        self.assertTrue(answer.get("retry-after", "").isdigit(), answer)
        status, answer, body = http("POST", url, STREAM, headers)
        self.assertEqual(status, 503, body)
        self.assertIn(b"activation_queue_full", body)
        self.assertTrue(answer.get("retry-after", "").isdigit(), answer)


class ActivationTimeoutTests(_Fleet, SynchronousTestCase):
    """
    A catalog model with no node connected: every wait for it times out
    after 2 s.
    """

    def wait_in(self, base_url: str) -> None:
        """
        Through the client API at C{base_url}: a stream's keep-alive
        comments say where the wait stands, and a
        plain request's 503 C{activation_timeout} has C{Retry-After} 2 (no
        estimate and no activation seen yet: what the queue waited), not
        a fixed number.
        """
        status, _, body = http(
            "POST",
            base_url + "/v1/chat/completions",
            STREAM,
            {"content-type": "application/json"},
        )
        self.assertEqual(status, 200, body)
        # The words are the control plane's (Activator.where): one line each.
        self.assertRegex(body, rb"^(: waiting for model chat: [^\n]+\n\n)+data: ")
        self.assertIn(b'"activation_timeout"', body)
        client = openai.OpenAI(
            base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30
        )
        with self.assertRaises(openai.InternalServerError) as raised:
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}]
            )
        self.assertEqual(raised.exception.status_code, 503)
        self.assertEqual(raised.exception.code, "activation_timeout")
        self.assertEqual(raised.exception.response.headers["retry-after"], "2")
        self.assertIn("try again in 2s", raised.exception.message)

    def test_in_the_server(self) -> None:
        """
        The server's own router.
        """
        config = self.config(MODELS.format(min_replicas=0, idle="60s"), "2s")
        self.start_fleet_server(config)
        self.wait_in(self.api_url)

    def test_through_the_tier(self) -> None:
        """
        A router of a tier asks the control plane where the wait stands
        (C{GET /api/v1/models/chat/activate}) and says the same.
        """
        config = self.config(MODELS.format(min_replicas=0, idle="60s"), "2s")
        self.start_fleet_server(config)
        status, _, body = http("GET", self.admin_url + "/api/v1/models/chat/activate")
        self.assertEqual(status, 200, body)
        standing = json.loads(body)
        self.assertEqual(
            (standing["model"], standing["ready"], standing["eta_seconds"]),
            ("chat", False, None),
        )
        self.assertIsInstance(standing["words"], str)
        status, _, body = http("GET", self.admin_url + "/api/v1/models/nope/activate")
        self.assertEqual(status, 404, body)
        self.assertEqual(json.loads(body)["error"]["code"], "not_found")
        router_config = os.path.join(self.dir, "router.toml")
        with open(router_config, "w") as f:
            f.write('[router]\nactivation_timeout = "2s"\n')
            f.write('activation_keepalive = "200ms"\n')
        _, url = spawn_router(
            self, self.admin_url, "router-state", "--config", router_config
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status, _, body = http("GET", url + "/v1/models")
            if status == 200 and b'"chat"' in body:
                break
            time.sleep(0.1)
        self.wait_in(url)


LOADING = MODELS.replace(
    'args = ["--itl", "0.05"]', 'args = ["--itl", "0.05", "--load-seconds", "10"]'
)


class QueueHistoryTests(_Fleet, SynchronousTestCase):
    """
    One node whose engine takes 10 s to load; one request may wait.
    """

    def test_retry_after_from_recent_activations(self) -> None:
        """
        After one activation took about 10 s, a request refused while the
        next activation is under way is told to come back when that one is
        expected done: about 10 s less what the waiting request waited.
        """
        config = self.config(LOADING.format(min_replicas=0, idle="2s"), "40s")
        config = config.replace("[router]\n", "[router]\nactivation_queue = 1\n")
        self.start_fleet_server(config)
        self.start_agent("gpu-01")
        self.until(lambda: self.admin("/api/v1/nodes")["nodes"], 20, "the node")
        url = self.api_url + "/v1/chat/completions"
        headers = {"content-type": "application/json"}
        started = time.monotonic()
        status, _, body = http("POST", url, CHAT, headers, 40)
        took = time.monotonic() - started
        self.assertEqual(status, 200, body)
        self.assertGreater(took, 9.5)
        self.until(lambda: not self.replicas(), 30, "back to zero")
        second = threading.Thread(
            target=http, args=("POST", url, CHAT, headers, 40), daemon=True
        )
        second_at = time.monotonic()
        second.start()
        self.addCleanup(second.join, 40)

        def waiting() -> bool:
            models = self.admin("/api/v1/models")["models"]
            return any(
                m["name"] == "chat" and m["waiting_requests"] == 1 for m in models
            )

        self.until(waiting, 15, "the second request waiting")
        waited = time.monotonic() - second_at
        status, answer, body = http("POST", url, CHAT, headers)
        self.assertEqual(status, 503, body)
        self.assertIn(b"activation_queue_full", body)
        expected = took - waited
        self.assertLess(abs(int(answer["retry-after"]) - expected), 2.5, answer)


class ConnectionCapTests(EdgeServer, SynchronousTestCase):
    """
    An edge with at most two connections per client address, three in all.
    """

    timeout = 60

    def test_caps_have_retry_after(self) -> None:
        """
        A connection past either cap gets its 503 C{too_many_connections}
        with C{Retry-After}, then is closed.
        """
        self.start_edge("max_connections = 3\nmax_connections_per_client = 2")
        held = [connect(self.port, "127.0.0.2") for _ in range(2)]
        for sock in held:
            self.addCleanup(sock.close)
        time.sleep(0.3)
        for source in ("127.0.0.2", "127.0.0.4"):
            if source == "127.0.0.4":
                held.append(connect(self.port, "127.0.0.3"))
                self.addCleanup(held[-1].close)
                time.sleep(0.3)
            late = connect(self.port, source)
            self.addCleanup(late.close)
            data, _, closed = read_until_closed(late, 5.0)
            self.assertTrue(closed, source)
            status, headers, body = parse_response(data)
            self.assertEqual(status, 503, source)
            self.assertEqual(body["error"]["code"], "too_many_connections")
            self.assertTrue(headers.get("retry-after", "").isdigit(), (source, headers))
