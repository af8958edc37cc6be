"""
End to end, routing through a real C{twistd -n llmgw-server} with
C{llmgw sim} engines and the C{openai} client (issue 11): sequential
requests alternate exactly over idle replicas, a replica's speed is
learnt from its answers, and overload answers 429
with C{Retry-After} at the configured depth, then serves again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import Processes, http, sim_stats
from tests.test_e2e_fleet_metrics import until_router_reads

CHAT = "/v1/chat/completions"


def endpoint(replica_id: str, url: str, *models: str) -> str:
    names = ", ".join(f'"{m}"' for m in models)
    return f'[[endpoints]]\nid = "{replica_id}"\nurl = "{url}"\nmodels = [{names}]\n'


class RoutingTests(SynchronousTestCase, Processes):
    timeout = 120

    def client(self, api: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=api + "/v1", api_key="unused", max_retries=0, timeout=30
        )

    def ask(self, client: openai.OpenAI, model: str, tokens: int = 2) -> Any:
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=tokens,
        )

    def test_sequential_alternate(self) -> None:
        """
        40 requests one after another over two idle replicas of a model,
        alternating with another model's on two others: 20 and 20 on each,
        with the load poller reading every engine five times a second.
        """
        urls = {}
        for name, model in (("a", "m1"), ("b", "m1"), ("c", "m2"), ("d", "m2")):
            urls[name] = self.start_sim(model=model)[1]
        config = '[router]\nload_poll_interval = "0.2s"\n\n' + "".join(
            endpoint(n, u, "m1" if n in "ab" else "m2") for n, u in urls.items()
        )
        server, api, _ = self.start_server(config=config)
        client = self.client(api)
        for _ in range(40):
            self.ask(client, "m1")
            self.ask(client, "m2")
        counts = {
            n: sim_stats(u)["requests_by_path"].get(CHAT, 0) for n, u in urls.items()
        }
        self.assertEqual(counts, {"a": 20, "b": 20, "c": 20, "d": 20})

    def test_shared_prompt_sticks(self) -> None:
        """
        Sequential requests sharing a long system prompt all go to one of
        two idle replicas (its owner, within the bound), as do those of one
        session (C{X-Session-ID}); short prompts alternate.
        """
        a = self.start_sim(model="m")[1]
        b = self.start_sim(model="m")[1]
        server, api, _ = self.start_server(
            config=endpoint("a", a, "m") + endpoint("b", b, "m")
        )
        client = self.client(api)
        system = "You answer in verse, briefly and kindly. " * 40

        def counts() -> list[int]:
            return [sim_stats(u)["requests_by_path"].get(CHAT, 0) for u in (a, b)]

        for i in range(8):
            client.chat.completions.create(
                model="m",
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question {i}"},
                ],
                max_tokens=2,
            )
        self.assertEqual(sorted(counts()), [0, 8])
        for _ in range(8):
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_headers={"X-Session-ID": "s-42"},
            )
        self.assertIn(sorted(counts()), ([0, 16], [8, 8]))
        self.ask(client, "m")
        self.ask(client, "m")
        self.assertEqual(sum(counts()), 18)
        self.assertIn(1, [c % 8 for c in counts()])

    def test_slow_replica_learnt(self) -> None:
        """
        Two idle replicas, one four times slower (C{llmgw sim --speed
        0.25}), no weights configured: sequential streamed requests first
        alternate; once each replica has answered a few, the router knows
        their speeds from the answers and the next ten all go to the fast
        one (its score per unit of learnt weight is lower).
        """
        fast = self.start_sim("--itl", "0.01", model="m")[1]
        slow = self.start_sim("--itl", "0.01", "--speed", "0.25", model="m")[1]
        server, api, _ = self.start_server(
            config=endpoint("fast", fast, "m") + endpoint("slow", slow, "m")
        )
        client = self.client(api)

        def counts() -> list[int]:
            return [sim_stats(u)["requests_by_path"].get(CHAT, 0) for u in (fast, slow)]

        def stream() -> None:
            for _ in client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=20,
                stream=True,
            ):
                pass

        for _ in range(12):
            stream()
        learnt = counts()
        # Alternating until the slow replica's samples count (four).
        self.assertGreaterEqual(learnt[1], 4)
        for _ in range(10):
            stream()
        self.assertEqual(counts(), [learnt[0] + 10, learnt[1]])

    def test_ejected_replica_probed_back(self) -> None:
        """
        A replica answering 500 is ejected after C{eject_after} failed
        answers in a row and gets no request during its cooldown; once it
        heals, the first request after the cooldown (the half-open probe)
        brings it back into the rotation.
        """
        a = self.start_sim(model="m")[1]
        b = self.start_sim(model="m")[1]
        config = (
            '[router]\neject_after = 3\neject_base_cooldown = "3s"\n\n'
            + endpoint("a", a, "m")
            + endpoint("b", b, "m")
        )
        server, api, admin = self.start_server(config=config)
        client = self.client(api)
        http("POST", a + "/sim/fault", b'{"status": 500}')
        failures = 0
        for _ in range(6):
            try:
                self.ask(client, "m")
            except openai.InternalServerError:
                failures += 1
        self.assertEqual(failures, 3)
        for _ in range(6):
            self.ask(client, "m")
        self.assertEqual(sim_stats(a)["requests_by_path"][CHAT], 3)
        server.wait_for("replica a ejected for 3s")
        http("POST", a + "/sim/fault", b"{}")
        time.sleep(3.2)
        for _ in range(4):
            self.ask(client, "m")
        server.wait_for("replica a is back in service")
        self.assertEqual(sim_stats(a)["requests_by_path"][CHAT], 3 + 2)
        scrape = http("GET", admin + "/metrics")[2].decode()
        self.assertIn('llmgw_replica_ejections_total{replica="a"} 1.0', scrape)

    def overloaded(
        self, wait: str
    ) -> tuple[str, openai.OpenAI, list[threading.Thread], str]:
        """
        One engine running one request at a time behind a router with
        C{overload_queue_depth = 2}, and five slow requests sent: it queues
        four, and the router has read that.

        @return: the engine's URL, a client, the slow requests' threads,
            the admin URL.
        """
        # Each slow request takes 2 s (10 tokens), so the queue stays over
        # the depth for about 4 s after the engine has queued four: the
        # checks below have seconds to spare on a loaded machine.
        sim, url = self.start_sim("--max-concurrency", "1", "--itl", "0.2", model="m")
        config = (
            "[router]\n"
            'load_poll_interval = "0.2s"\n'
            "overload_queue_depth = 2\n"
            f'overload_wait = "{wait}"\n\n' + endpoint("a", url, "m")
        )
        server, api, admin = self.start_server(config=config)
        client = self.client(api)
        self.ask(client, "m")
        errors: list[BaseException] = []

        def slow() -> None:
            try:
                self.ask(client, "m", tokens=10)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=slow) for _ in range(5)]
        for thread in threads:
            thread.start()

        def join() -> None:
            for thread in threads:
                thread.join(30)

        self.addCleanup(join)
        self.addCleanup(lambda: self.assertEqual(errors, []))
        deadline = time.monotonic() + 10
        while sim_stats(url)["waiting"] < 4:
            self.assertLess(time.monotonic(), deadline, "the engine never queued")
            time.sleep(0.05)
        # The router's own reading shows the queue over the depth.
        until_router_reads(admin, "a", 3)
        return url, client, threads, admin

    def test_overload_429_then_served(self) -> None:
        """
        C{overload_wait = "0s"}: with the engine's queue over the depth, a
        new request gets 429 with C{Retry-After} without reaching the
        engine; once the queue falls, requests are served again.
        """
        url, client, threads, admin = self.overloaded("0s")
        before = sim_stats(url)["requests_total"]
        with self.assertRaises(openai.RateLimitError) as caught:
            self.ask(client, "m")
        self.assertEqual(caught.exception.response.headers.get("retry-after"), "1")
        self.assertEqual(caught.exception.code, "model_overloaded")
        self.assertEqual(sim_stats(url)["requests_total"], before)
        scrape = http("GET", admin + "/metrics")[2].decode()
        self.assertIn('llmgw_overload_total{model="m",outcome="refused"} 1.0', scrape)
        for thread in threads:
            thread.join(30)
        # The engine's queue is empty; after a poll, served again.
        time.sleep(0.5)
        answer = self.ask(client, "m")
        self.assertEqual(answer.choices[0].finish_reason, "length")

    def test_overload_waits(self) -> None:
        """
        C{overload_wait = "20s"}: a new request waits in the router, not in
        the engine, while the queue is over the depth, and is served when
        it falls.
        """
        url, client, threads, admin = self.overloaded("20s")
        before = sim_stats(url)["requests_total"]
        answers: list[Any] = []
        waiter = threading.Thread(target=lambda: answers.append(self.ask(client, "m")))
        waiter.start()
        time.sleep(1.0)
        self.assertEqual(sim_stats(url)["requests_total"], before)
        self.assertEqual(answers, [])
        waiter.join(30)
        self.assertEqual(len(answers), 1)
        self.assertEqual(sim_stats(url)["requests_total"], before + 1)
        scrape = http("GET", admin + "/metrics")[2].decode()
        self.assertIn('llmgw_overload_total{model="m",outcome="waited"} 1.0', scrape)
