"""
The admin listener's profiling pages on a running C{twistd llmgw-server}
with an C{llmgw sim} engine under load: a CPU profile that names llmgw's
own functions, a heap summary, every thread's stack and the reactor's
delayed calls; none of them on the client listener.
"""

from __future__ import annotations

import json
import re
import threading
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.support import Processes, http

PATHS = ("/debug/profile?seconds=1", "/debug/heap", "/debug/threads", "/debug/delayed")


class ProfilingTests(Processes, SynchronousTestCase):
    timeout = 120

    def setUp(self) -> None:
        _, sim_url = self.start_sim("--itl", "0.001", model="m")
        self.server, self.api_url, self.admin_url = self.start_server(
            "--endpoint", f"sim={sim_url}=m"
        )

    def load(self, stop: threading.Event, done: list[int]) -> None:
        body = json.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "stream": True,
            }
        ).encode()
        while not stop.is_set():
            status, _, _ = http(
                "POST",
                self.api_url + "/v1/chat/completions",
                body,
                {"content-type": "application/json"},
            )
            done.append(status)

    def test_profile_under_load(self) -> None:
        """
        A 2 s profile taken while clients stream completions is text that
        names the router's modules; the heap summary (after a first call
        that starts tracing), the threads' stacks and the delayed calls
        answer too; C{seconds} out of range is a 400.
        """
        stop = threading.Event()
        done: list[int] = []
        workers = [
            threading.Thread(target=self.load, args=(stop, done)) for _ in range(4)
        ]
        for worker in workers:
            worker.start()
        try:
            time.sleep(0.5)
            status, headers, body = http(
                "GET", self.admin_url + "/debug/profile?seconds=2"
            )
        finally:
            stop.set()
            for worker in workers:
                worker.join(30)
        self.assertEqual(status, 200, body[:2000])
        self.assertTrue(headers["content-type"].startswith("text/plain"))
        text = body.decode("utf-8")
        self.assertGreater(len(done), 10)
        self.assertEqual(set(done), {200})
        self.assertRegex(text, r"llmgw[/.]router[/.]\w+")

        status, _, body = http("GET", self.admin_url + "/debug/heap")
        self.assertEqual(status, 200)
        self.assertIn(b"tracemalloc started", body)
        status, _, body = http("GET", self.admin_url + "/debug/heap")
        self.assertEqual(status, 200)
        self.assertRegex(body.decode(), r"traced: [\d.]+ MiB")
        self.assertEqual(http("GET", self.admin_url + "/debug/heap?stop=1")[0], 200)

        status, _, body = http("GET", self.admin_url + "/debug/threads")
        self.assertEqual(status, 200)
        self.assertIn(b"MainThread", body)
        self.assertIn(b"twisted", body)

        status, _, body = http("GET", self.admin_url + "/debug/delayed")
        self.assertEqual(status, 200)
        self.assertTrue(re.match(rb"\d+ delayed calls", body), body[:200])

        status, _, _ = http("GET", self.admin_url + "/debug/profile?seconds=0")
        self.assertEqual(status, 400)

    def test_not_on_client_listener(self) -> None:
        """
        The client listener answers 404 on every profiling path; under
        C{/admin} it sends to the login form.
        """
        for path in PATHS:
            status, _, _ = http("GET", self.api_url + path)
            self.assertEqual(status, 404, path)
            # Without a session, the login form (after its 303).
            status, _, body = http("GET", self.api_url + "/admin" + path)
            self.assertEqual(status, 200, path)
            self.assertIn(b"Admin API key", body, path)
