"""
The swap queue by priority (issue 22 item 1 with issue 25 item 3), through
real processes: C{twistd llmgw-server} and C{twistd llmgw-agent} over
mutual TLS, one simulated 80 GB GPU, C{llmgw sim} engines, keys made with
C{llmgw ctl} and the OpenAI client.  While C{a} holds the GPU with a
stream, a C{batch} key asks for C{c} and then an C{interactive} key for
C{b}: when C{a}'s stream ends, C{b} is swapped in first; with
C{waiting_order = "fifo"} the same traffic serves C{c} first; and the same
through the admin API's activate route, as a router of a tier asks.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import CtlMixin, http
from tests.test_e2e_swap import _Swaps, model


class SwapPriorityTests(_Swaps, SynchronousTestCase, CtlMixin):
    def served_order(
        self, order: str, through: Callable[[str, str], None] | None = None
    ) -> list[str]:
        """
        @param through: asks for a model with a priority's name, in place
            of the OpenAI client with that priority's key.
        @return: the models C{c} (asked by the batch key) and C{b} (asked
            by the interactive key once C{c}'s request is held) in the
            order their answers came, with C{waiting_order = order}.
        """
        self.setup_fleet(
            model("a") + model("b") + model("c"),
            router=f'waiting_order = "{order}"\n',
        )
        clients = {}
        for name, priority in (("bulk", "batch"), ("chat", "interactive")):
            made = self.ctl_json(
                "keys", "create", "--name", name, "--priority", priority
            )
            clients[priority] = openai.OpenAI(
                base_url=self.api_url + "/v1",
                api_key=made["key"],
                max_retries=0,
                timeout=60,
            )
        self.client = clients["interactive"]
        self.assertTrue(self.chat("a"))
        thread, seen = self.stream("a", 150)
        self.until(lambda: len(seen["chunks"]) >= 5, 10, "a's stream started")
        answered: list[str] = []
        failed: list[Any] = []

        def ask(name: str, priority: str) -> None:
            try:
                if through is not None:
                    through(name, priority)
                else:
                    clients[priority].chat.completions.create(
                        model=name,
                        messages=[{"role": "user", "content": "hello"}],
                        max_tokens=4,
                    )
                answered.append(name)
            except (openai.APIError, AssertionError) as e:
                failed.append((name, e))

        asks = [
            threading.Thread(target=ask, args=("c", "batch")),
            threading.Thread(target=ask, args=("b", "interactive")),
        ]
        asks[0].start()
        self.server.wait_for("activating model c: a request is waiting")
        asks[1].start()
        for each in (thread, *asks):
            each.join(60)
        self.assertEqual(seen["errors"], [])
        self.assertEqual(len(seen["chunks"]), 150)
        self.assertEqual(failed, [])
        self.assertNotIn("Traceback", self.server.output())
        return answered

    def test_interactive_swapped_in_first(self) -> None:
        """
        The interactive request's model is swapped in before the batch
        request's that waited longer.
        """
        self.assertEqual(self.served_order("fair"), ["b", "c"])

    def test_fifo_oldest_first(self) -> None:
        """
        C{waiting_order = "fifo"}: the batch request, held first, is served
        first.
        """
        self.assertEqual(self.served_order("fifo"), ["c", "b"])

    def test_activate_route(self) -> None:
        """
        The admin API's activate route, as a router of a tier asks it, with
        the waiting request's priority in the body: the interactive one's
        model is ready first.  A priority that is neither a name nor an
        integer is a 400 naming what is expected.
        """

        def activate(name: str, priority: str | int) -> tuple[int, Any]:
            body = json.dumps({"timeout": 30, "priority": priority}).encode()
            url = f"{self.admin_url}/api/v1/models/{name}/activate"
            status, _, answer = http("POST", url, body)
            return status, json.loads(answer)

        def through(name: str, priority: str) -> None:
            status, answer = activate(name, {"batch": 0, "interactive": 2}[priority])
            self.assertEqual((status, answer), (200, {"ready": name}))

        self.assertEqual(self.served_order("fair", through), ["b", "c"])
        for bad in ("urgent", True, 1.5):
            status, answer = activate("c", bad)  # type: ignore[arg-type]
            self.assertEqual(status, 400)
            self.assertIn(
                "expected interactive, standard, batch", answer["error"]["message"]
            )
        # The keys' routes read a priority the same way.
        for refused in ("urgent", True, 1.5, None, [2]):
            body = json.dumps({"name": "k-bad", "priority": refused}).encode()
            status, _, raw = http("POST", f"{self.admin_url}/api/v1/keys", body)
            self.assertEqual(status, 400, refused)
            self.assertRegex(
                json.loads(raw)["error"]["message"],
                "^priority: .*expected (interactive, standard, batch|a name)",
            )
        body = json.dumps({"name": "k-good", "priority": " batch "}).encode()
        status, _, raw = http("POST", f"{self.admin_url}/api/v1/keys", body)
        self.assertEqual((status, json.loads(raw)["priority"]), (201, "batch"))
        body = json.dumps({"timeout": 1, "waited": -1}).encode()
        status, _, raw = http(
            "POST", f"{self.admin_url}/api/v1/models/c/activate", body
        )
        self.assertEqual(status, 400)
        self.assertIn("waited must be", json.loads(raw)["error"]["message"])
        body = json.dumps({"timeout": 0}).encode()
        status, _, raw = http(
            "POST", f"{self.admin_url}/api/v1/models/c/activate", body
        )
        self.assertEqual(status, 400)
        self.assertEqual(
            json.loads(raw)["error"]["message"],
            "timeout must be a number of seconds in (0, 600]",
        )
