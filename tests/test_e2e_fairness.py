"""
End to end, priorities and Server-Timing through a real
C{twistd -n llmgw-server}, a C{llmgw sim} engine running one request at a
time, keys made with C{llmgw ctl}, and the C{openai} client (issue 22): a
C{batch} key fills the overload room; an C{interactive} key's request
then takes the place of the batch key's newest (refused with
C{Retry-After}) and is served before the batch requests that waited
longer; with C{waiting_order = "fifo"} the same traffic refuses the
interactive request instead.  Every answer carries C{Server-Timing}.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import CtlMixin, Processes, http, sim_stats
from tests.test_e2e_fleet_metrics import until_router_reads

CHAT: list[Any] = [{"role": "user", "content": "hello"}]


class PriorityTests(SynchronousTestCase, Processes, CtlMixin):
    timeout = 120

    def start(self, order: str) -> tuple[str, openai.OpenAI, openai.OpenAI]:
        """
        One engine running one request at a time behind a router whose
        overload room holds two, ordered by C{order}; a batch key and an
        interactive key.

        @return: the engine's URL, the batch and the interactive clients.
        """
        _, url = self.start_sim("--max-concurrency", "1", "--itl", "0.2", model="m")
        config = (
            "[router]\n"
            'load_poll_interval = "0.2s"\n'
            "overload_queue_depth = 1\n"
            "overload_queue_size = 2\n"
            'overload_wait = "30s"\n'
            f'waiting_order = "{order}"\n\n'
            f'[[endpoints]]\nid = "a"\nurl = "{url}"\nmodels = ["m"]\n'
        )
        _, api, self.admin_url = self.start_server(config=config)
        keys = {}
        for name, priority in (("bulk", "batch"), ("chat", "interactive")):
            made = self.ctl_json(
                "keys", "create", "--name", name, "--priority", priority
            )
            self.assertEqual(made["priority"], priority)
            keys[name] = made["key"]
        listed = {k["name"]: k for k in self.ctl_json("keys")["keys"]}
        self.assertEqual(listed["bulk"]["priority"], "batch")
        bulk, chat = (
            openai.OpenAI(
                base_url=api + "/v1", api_key=keys[n], max_retries=0, timeout=60
            )
            for n in ("bulk", "chat")
        )
        return url, bulk, chat

    def traffic(self, order: str) -> tuple[list[tuple[str, float]], dict[str, Any]]:
        """
        Five batch requests (one running, two waiting in the engine, two
        in the router's room), then one interactive request.

        @return: when each request ended, C{(name, clock time)} in the
            order they ended, and per name C{"ok"} or the error.
        """
        url, bulk, chat = self.start(order)
        ended: list[tuple[str, float]] = []
        outcome: dict[str, Any] = {}

        def ask(name: str, client: openai.OpenAI) -> None:
            try:
                client.chat.completions.create(model="m", messages=CHAT, max_tokens=10)
                outcome[name] = "ok"
            except openai.APIStatusError as e:
                outcome[name] = e
            ended.append((name, time.monotonic()))

        threads = []
        for n in range(5):
            threads.append(threading.Thread(target=ask, args=(f"b{n}", bulk)))
            threads[-1].start()
            if n == 2:
                # The engine's queue is over the depth, and the router saw it.
                deadline = time.monotonic() + 10
                while sim_stats(url)["waiting"] < 2:
                    self.assertLess(time.monotonic(), deadline)
                    time.sleep(0.05)
                until_router_reads(self.admin_url, "a", 2)
            else:
                time.sleep(0.1)
        threads.append(threading.Thread(target=ask, args=("i", chat)))
        threads[-1].start()
        for thread in threads:
            thread.join(60)
        return ended, outcome

    def test_interactive_first(self) -> None:
        """
        Priorities: the interactive request takes the newest batch
        request's place in the full room (that one gets 429 with
        C{Retry-After}) and is served before the batch requests that
        waited in the room before it.
        """
        ended, outcome = self.traffic("fair")
        self.assertEqual(outcome["i"], "ok")
        refused = outcome["b4"]
        self.assertIsInstance(refused, openai.RateLimitError)
        self.assertEqual(refused.code, "model_overloaded")
        self.assertGreaterEqual(int(refused.response.headers["retry-after"]), 1)
        order = [name for name, _ in ended if outcome[name] == "ok"]
        self.assertLess(order.index("i"), order.index("b3"))

    def test_fifo_refuses_newcomer(self) -> None:
        """
        C{waiting_order = "fifo"}: the same traffic refuses the
        interactive request, the room being full of batch requests.
        """
        ended, outcome = self.traffic("fifo")
        self.assertIsInstance(outcome["i"], openai.RateLimitError)
        self.assertEqual(outcome["b4"], "ok")


class ServerTimingTests(SynchronousTestCase, Processes):
    timeout = 60

    def test_every_answer(self) -> None:
        """
        A whole answer, a stream and an error each carry C{Server-Timing};
        a replica's part (the sim's C{--ttft} 0.3 s) is the replica's, not
        the router's.
        """
        _, url = self.start_sim("--ttft", "0.3", "--max-tokens", "2", model="m")
        _, api, _ = self.start_server("--endpoint", f"a={url}=m")
        client = openai.OpenAI(base_url=api + "/v1", api_key="x", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="m", messages=CHAT)
        llmgw, replica = timings(raw.headers["server-timing"])
        self.assertGreaterEqual(replica, 300)
        self.assertLess(llmgw, 100)
        with client.chat.completions.with_streaming_response.create(
            model="m", messages=CHAT, stream=True
        ) as stream:
            llmgw, replica = timings(stream.headers["server-timing"])
            self.assertGreaterEqual(replica, 300)
            self.assertLess(llmgw, 100)
            list(stream.iter_lines())
        status, headers, _ = http(
            "POST",
            api + "/v1/chat/completions",
            b'{"model": "none", "messages": []}',
            {"content-type": "application/json"},
        )
        self.assertEqual(status, 404)
        self.assertRegex(headers["server-timing"], r"^llmgw;dur=[\d.]+$")


class CandidatesTests(SynchronousTestCase, Processes):
    timeout = 60

    def test_asked_with_header(self) -> None:
        """
        A request sent with C{X-LLMGW-Explain: 1} gets the two replicas
        weighed, with their scores, in its JSON log line, the one chosen
        the one that answered; a request without the header gets none.
        """
        urls = [self.start_sim("--max-tokens", "2", model="m")[1] for _ in range(2)]
        server, api, _ = self.start_server(
            "--endpoint",
            f"a={urls[0]}=m",
            "--endpoint",
            f"b={urls[1]}=m",
            "--log-format",
            "json",
        )
        client = openai.OpenAI(base_url=api + "/v1", api_key="x", max_retries=0)
        asked = client.chat.completions.with_raw_response.create(
            model="m", messages=CHAT, extra_headers={"X-LLMGW-Explain": "1"}
        )
        plain = client.chat.completions.with_raw_response.create(
            model="m", messages=CHAT
        )
        lines: dict[str, Any] = {}
        deadline = time.monotonic() + 10
        wanted = {asked.headers["x-request-id"], plain.headers["x-request-id"]}
        while set(lines) != wanted:
            self.assertLess(time.monotonic(), deadline, "no request log lines")
            for line in server.output().splitlines():
                event = json.loads(line)
                if event.get("request_id") in wanted:
                    lines[event["request_id"]] = event
            time.sleep(0.1)
        event = lines[asked.headers["x-request-id"]]
        found = {c["replica"]: c for c in event["candidates"]}
        self.assertEqual(set(found), {"a", "b"})
        chosen = [c["replica"] for c in found.values() if c["chosen"]]
        self.assertEqual(chosen, [event["replica"]])
        for c in found.values():
            self.assertEqual(c["in_flight"], 0)  # before it was sent
            self.assertEqual(c["speed"], 1.0)
            self.assertFalse(c["ejected"])
            self.assertIsInstance(c["score"], float)
        self.assertNotIn("candidates", lines[plain.headers["x-request-id"]])


def timings(value: str) -> tuple[float, float]:
    """
    @return: the C{llmgw} and C{replica} durations of a C{Server-Timing}
        value, milliseconds.
    """
    found = dict(re.findall(r"(\w+);dur=([\d.]+)", value))
    return float(found["llmgw"]), float(found["replica"])
