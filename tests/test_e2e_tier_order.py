"""
Priorities across a tier of routers (issue 37 item 6), through real
processes: C{twistd llmgw-server} and C{twistd llmgw-agent} over mutual
TLS, a cold C{llmgw sim} model serving one request at a time, two C{twistd
llmgw-router}s following the server, keys made with C{llmgw ctl} and the
OpenAI client.  A C{batch} request held on one router and an
C{interactive} request held later on the other: the interactive one gets
the starting replica's first place (the server lets the held requests go
in the fleet's order, L{llmgw.control.runtime.ModelCatalog.release}); and
past the fleet's bound on held requests the batch one is refused, not the
interactive one (the lowest priority's newest, whichever router holds it,
L{llmgw.control.runtime.ModelCatalog.activate}).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import CtlMixin, http
from tests.test_e2e_control import _Fleet
from tests.test_e2e_tier import FOLLOWING, spawn_router

COLD = """
[[models]]
name = "chat"
min_replicas = 0
max_replicas = 1
idle_timeout = "60s"
[[models.profiles]]
name = "one-h200"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 40
args = ["--max-concurrency", "1", "--itl", "0.05", "--load-seconds", "3"]
"""
"""
One model, none of it running: an engine that takes 3 s to load, then
answers one request at a time (20 tokens in about 1 s).
"""


class TierOrderTests(_Fleet, SynchronousTestCase, CtlMixin):
    timeout = 120

    def two_routers(self) -> tuple[dict[str, str], list[str]]:
        """
        With the server started: its agent registered, a key of each of
        the priorities C{batch} and C{interactive}, and two llmgw-router
        daemons following the server.

        @return: the keys by priority, and the routers' base URLs.
        """
        self.start_agent("gpu-01")
        self.until(lambda: len(self.admin("/api/v1/nodes")["nodes"]) == 1, 20, "node")
        keys = {
            priority: self.ctl_json(
                "keys", "create", "--name", priority, "--priority", priority
            )["key"]
            for priority in ("batch", "interactive")
        }
        urls = []
        for _ in range(2):
            router, url = spawn_router(self, self.admin_url, "server-state")
            router.wait_for(FOLLOWING.pattern)
            urls.append(url)
        return keys, urls

    def test_interactive_first_across_routers(self) -> None:
        """
        A batch request held on router A for a cold model, then an
        interactive request held on router B for the same model: once the
        replica is ready, the interactive one is served first (it ends
        first on an engine that runs one request at a time), and both are
        served.
        """
        self.start_fleet_server(self.config(COLD, activation_timeout="60s"))
        keys, urls = self.two_routers()
        ended: list[str] = []
        failed: list[Any] = []

        def ask(url: str, priority: str) -> None:
            client = openai.OpenAI(
                base_url=url + "/v1", api_key=keys[priority], max_retries=0, timeout=60
            )
            try:
                client.chat.completions.create(
                    model="chat",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=20,
                )
                ended.append(priority)
            except openai.APIError as e:
                failed.append((priority, e))

        asks = [
            threading.Thread(target=ask, args=(urls[0], "batch")),
            threading.Thread(target=ask, args=(urls[1], "interactive")),
        ]
        asks[0].start()
        self.server.wait_for("activating model chat: a request is waiting")
        time.sleep(0.5)
        asks[1].start()
        for thread in asks:
            thread.join(60)
        self.assertEqual(failed, [])
        self.assertEqual(self.replicas()[0]["state"], "ready")
        self.assertEqual(ended, ["interactive", "batch"])

    def test_lowest_priority_refused_across_routers(self) -> None:
        """
        With C{[router] activation_queue = 1} on the server (the fleet's
        bound; the routers keep their own default of 256), for one cold
        model: a batch request held on router A, then a batch request on
        the server's own client API, then an interactive request on router
        B.  The server's is refused at once (the newest of the lowest
        priority), A's when B's comes, each as a router's full queue
        refuses (503 C{activation_queue_full} with C{Retry-After}); B's
        is served, and the server counts two refusals.
        """
        config = self.config(COLD, activation_timeout="60s")
        self.start_fleet_server(
            config.replace("[router]\n", "[router]\nactivation_queue = 1\n", 1)
        )
        keys, urls = self.two_routers()
        outcomes: dict[str, object] = {}

        def ask(where: str, url: str, priority: str) -> None:
            client = openai.OpenAI(
                base_url=url + "/v1", api_key=keys[priority], max_retries=0, timeout=60
            )
            try:
                client.chat.completions.create(
                    model="chat",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=5,
                )
                outcomes[where] = "served"
            except openai.APIStatusError as e:
                after = e.response.headers.get("retry-after", "")
                outcomes[where] = (e.status_code, e.code, after.isdigit())
            except openai.APIError as e:
                outcomes[where] = repr(e)

        held = threading.Thread(target=ask, args=("A", urls[0], "batch"))
        held.start()
        self.server.wait_for("activating model chat: a request is waiting")
        ask("server", self.api_url, "batch")
        chat = threading.Thread(target=ask, args=("B", urls[1], "interactive"))
        chat.start()
        for thread in (held, chat):
            thread.join(60)
        refused = (503, "activation_queue_full", True)
        self.assertEqual(
            outcomes, {"server": refused, "A": refused, "B": "served"}, outcomes
        )
        _, _, body = http("GET", self.admin_url + "/metrics")
        self.assertIn(
            b'llmgw_activations_refused_total{model="chat"} 2.0', body.splitlines()
        )
