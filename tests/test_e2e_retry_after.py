"""
Every refusal that asks the client to come back later says when: a
C{Retry-After} on each 429 and 503 llmgw answers by itself, through a
running C{twistd -n llmgw-server}: the activation queue of a catalog model
full, the edge's connection caps (per client and global).
"""

from __future__ import annotations

import threading
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.edge_support import EdgeServer, connect, parse_response, read_until_closed
from tests.support import http
from tests.test_e2e_control import MODELS, _Fleet

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
