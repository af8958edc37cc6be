"""
Agent-sized requests end to end: Claude Code's captured first request
(C{max_tokens} 32000, about 12,000 tokens estimated) and the same with a
long tool output in it (about 60,000), streamed through C{twistd -n
llmgw-server} to C{llmgw sim} with a prefill cost (C{--prefill-per-token}):
the key's tokens per minute hold the prompt and not the 32,000 ceiling; the
first-byte deadline waits for a long prompt's prefill; a cold model
activates and then serves one.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.upstream.sse import SSEParser
from llmgw.sim.length import NATURAL_MIN, NATURAL_SPAN
from tests.support import CtlMixin, Processes, http
from tests.test_anthropic_agents import claude_code_request

MODEL = "sim-model"
WORDS = 40_000
"""
Words of tool output added to make the long request: about 50,000 more
tokens by llmgw's estimate (4 bytes a token), 40,000 by the sim's count.
"""
FIRST_BYTE = """
[router]
first_byte_timeout = "1s"
"""
PREFILL = "0.00005"
"""
Sim seconds of prefill a prompt token: the long request's ~47,000 take
about 2.3 s, past the 1 s first-byte timeout and within its scaled value
(about 7.5 s).
"""
COLD = """
[router]
first_byte_timeout = "1s"
[control]
interval = "100ms"
port_range = [{low}, {high}]
[[models]]
name = "{model}"
[[models.profiles]]
name = "cpu"
engine = "sim"
source = "sim"
gpus = 0
args = ["--load-seconds", "1", "--prefill-per-token", "{prefill}"]
"""


def _long(body: dict[str, Any]) -> dict[str, Any]:
    """
    @return: C{body} with a long tool output as a last text block of its
        first user turn.
    """
    first = dict(body["messages"][0])
    output = " ".join(f"line{i % 97}" for i in range(WORDS))
    first["content"] = [*first["content"], {"type": "text", "text": output}]
    return {**body, "messages": [first, *body["messages"][1:]]}


class AgentSizedTests(SynchronousTestCase, Processes, CtlMixin):
    timeout = 120

    def setUp(self) -> None:
        captured = claude_code_request()
        self.path: str = captured["path"]
        self.headers: dict[str, str] = captured["headers"]
        self.body: dict[str, Any] = {**captured["body"], "model": MODEL}

    def serve(self, *sim: str, config: str | None = None) -> None:
        _, url = self.start_sim(*sim)
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={url}={MODEL}", config=config
        )

    def key(self, *args: str) -> str:
        made = self.ctl("keys", "create", "--name", f"k{uuid.uuid4().hex[:6]}", *args)
        return made.stdout.splitlines()[0].strip()

    def post(self, body: dict[str, Any], key: str) -> tuple[int, bytes, float]:
        """
        @return: the status, the body and the seconds it took.
        """
        started = time.monotonic()
        status, _, data = http(
            "POST",
            self.url + self.path,
            json.dumps(body).encode(),
            {**self.headers, "x-api-key": key},
            timeout=60,
        )
        return status, data, time.monotonic() - started

    def assert_whole_stream(self, data: bytes) -> None:
        events = [(e.event, json.loads(e.data)) for e in SSEParser(1 << 20).feed(data)]
        self.assertEqual(events[-1][0], b"message_stop", events[-3:])
        # The sim's answer ends by itself at its natural length, far below
        # the 32,000 asked for, as a model's does.
        self.assertEqual(events[-2][1]["delta"]["stop_reason"], "end_turn")
        output = events[-2][1]["usage"]["output_tokens"]
        self.assertTrue(NATURAL_MIN <= output < NATURAL_MIN + NATURAL_SPAN, output)

    def test_tpm_holds_the_prompt_not_the_ceiling(self) -> None:
        """
        Three of Claude Code's requests at once on a key of 50,000 tokens a
        minute are all admitted: each holds its prompt's estimate and 1,024
        completion tokens while it runs (about 13,400), not its 32,000
        ceiling (about 44,400, which refused the third with a 429).
        """
        # ~7,000 sim tokens of prompt: 1.4 s of prefill keeps them in flight.
        self.serve("--prefill-per-token", "0.0002")
        key = self.key("--tpm", "50000")
        results: list[tuple[int, bytes, float]] = []

        def one() -> None:
            results.append(self.post(self.body, key))

        threads = [threading.Thread(target=one) for _ in range(3)]
        for thread in threads:
            thread.start()
            time.sleep(0.1)
        for thread in threads:
            thread.join(60)
        self.assertEqual(sorted(r[0] for r in results), [200, 200, 200], results)
        for _, data, _ in results:
            self.assert_whole_stream(data)

    def test_first_byte_waits_for_prefill(self) -> None:
        """
        A prompt of about 60,000 estimated tokens whose prefill takes about
        2.3 s is answered whole under a first-byte timeout of 1 s: the
        deadline scales with the prompt (7.5 s here); before, a 504.
        """
        self.serve("--prefill-per-token", PREFILL, config=FIRST_BYTE)
        status, data, took = self.post(_long(self.body), self.key())
        self.assertEqual(status, 200, data[:300])
        self.assertGreater(took, 1.5)
        self.assert_whole_stream(data)

    def test_cold_model_serves_it(self) -> None:
        """
        The long request for a model with no replica waits for its
        activation (a sim that loads for 1 s), then for its prefill, and is
        answered whole.
        """
        low = random.randrange(21000, 32000)
        config = COLD.format(low=low, high=low + 20, model=MODEL, prefill=PREFILL)
        self.server, self.url, self.admin_url = self.start_server(
            "--local", config=config
        )
        status, data, took = self.post(_long(self.body), self.key())
        self.assertEqual(status, 200, data[:300])
        self.assertGreater(took, 2.5)
        self.assert_whole_stream(data)
