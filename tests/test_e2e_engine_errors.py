"""
An engine's own error answers through a running C{twistd -n llmgw-server}
in front of C{llmgw sim} engines made to fail (C{--fault status=N}, whose
answer is an OpenAI error object, as vLLM's are): the client gets the
engine's status and message; the retry rules hold (a 503 goes to another
replica before the first byte, a 500 is sent once).
"""

from __future__ import annotations

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import Processes, http, sim_stats

CHAT = "/v1/chat/completions"


def endpoint(name: str, url: str, model: str) -> str:
    return f'[[endpoints]]\nid = "{name}"\nurl = "{url}"\nmodels = ["{model}"]\n'


class EngineErrorTests(Processes, SynchronousTestCase):
    timeout = 120

    def ask(self, client: openai.OpenAI, stream: bool = False) -> None:
        answer = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=stream,
        )
        if stream:
            for _ in answer:
                pass

    def client(self, api: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=api + "/v1", api_key="unused", max_retries=0, timeout=30
        )

    def test_engine_500_reaches_the_client(self) -> None:
        """
        An engine answering 500 with its error object: the client gets 500
        (not 502) with the engine's message, type and code, streamed or
        not, and the engine saw each request once; its request is counted
        under status 500.
        """
        _, sim = self.start_sim("--fault", "status=500", model="m")
        _, api, admin = self.start_server(config=endpoint("a", sim, "m"))
        client = self.client(api)
        for stream in (False, True):
            with self.assertRaises(openai.InternalServerError) as raised:
                self.ask(client, stream)
            error = raised.exception
            self.assertEqual(error.status_code, 500, stream)
            self.assertEqual(error.body["message"], "simulated fault: status 500")
            self.assertEqual(error.body["type"], "server_error")
            self.assertEqual(error.code, "llmgw_sim_fault")
        self.assertEqual(sim_stats(sim)["requests_by_path"][CHAT], 2)

        scrape = http("GET", admin + "/metrics")[2].decode()
        self.assertIn('llmgw_requests_total{model="m",status="500"} 2.0', scrape)

    def test_engine_400_and_503_retry(self) -> None:
        """
        A 400 error object reaches the client as the engine sent it; a 503
        is still tried on the other replica (the client gets its 200).
        """
        _, bad = self.start_sim("--fault", "status=400", model="m")
        _, api, _ = self.start_server(config=endpoint("a", bad, "m"))
        with self.assertRaises(openai.BadRequestError) as raised:
            self.ask(self.client(api))
        self.assertEqual(
            raised.exception.body["message"], "simulated fault: status 400"
        )

        _, busy = self.start_sim("--fault", "status=503", model="m")
        _, good = self.start_sim(model="m")
        _, api, _ = self.start_server(
            config=endpoint("busy", busy, "m") + endpoint("good", good, "m")
        )
        client = self.client(api)
        for _ in range(4):
            self.ask(client)
        self.assertEqual(sim_stats(good)["requests_by_path"][CHAT], 4)
