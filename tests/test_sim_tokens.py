"""
The simulator's tokenizer routes, context length and model card
(L{llmgw.sim.tokens}) through the real site, as vLLM 0.32 answers them
(its C{entrypoints/serve/tokenize} protocol, C{renderers/params.py} and
model card); L{tests.test_e2e_vllm_sim} compares them with a real vLLM.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.sim.engine import SimConfig, Simulator
from llmgw.sim.web import SimSite
from tests.test_sim_site import _Conn


class TokensTests(SynchronousTestCase):
    def post(self, path: str, body: object, max_model_len: int = 8) -> tuple[int, Any]:
        sim = Simulator(SimConfig(models=("m",), max_model_len=max_model_len), Clock())
        conn = _Conn(SimSite(sim))
        data = json.dumps(body).encode()
        method = "GET" if body is None else "POST"
        conn.channel.dataReceived(
            f"{method} {path} HTTP/1.1\r\nHost: sim\r\n"
            f"Content-Length: {len(data) if body is not None else 0}\r\n\r\n".encode()
            + (data if body is not None else b"")
        )
        sim.clock.advance(10)  # type: ignore[attr-defined]
        head, answer, done = conn.head_body()
        self.assertTrue(done, head)
        return int(head.split(b" ", 2)[1]), json.loads(answer)

    def test_tokenize_detokenize(self) -> None:
        """
        C{/tokenize} counts the words, with ids and the context length;
        C{/detokenize} gives text back; a model not served is a 404.
        """
        status, body = self.post("/tokenize", {"model": "m", "prompt": "a b c"})
        self.assertEqual((status, body["count"], body["max_model_len"]), (200, 3, 8))
        self.assertEqual(len(body["tokens"]), 3)
        self.assertIsNone(body["token_strs"])
        chat = {"messages": [{"role": "user", "content": "x y"}]}
        self.assertEqual(self.post("/tokenize", chat)[1]["count"], 2)
        status, body = self.post("/detokenize", {"model": "m", "tokens": [1, 2]})
        self.assertEqual(status, 200)
        self.assertIsInstance(body["prompt"], str)
        self.assertEqual(self.post("/tokenize", {"model": "x", "prompt": "a"})[0], 404)
        self.assertEqual(self.post("/detokenize", {"tokens": ["a"]})[0], 400)

    def test_context_length(self) -> None:
        """
        With C{--max-model-len}, C{max_tokens} over it and then a prompt
        over it are vLLM's 400s, naming the length and the parameter; 0
        sets no limit.
        """
        long = {"model": "m", "prompt": " ".join("w" * 9), "max_tokens": 1}
        status, body = self.post("/v1/completions", long)
        self.assertEqual((status, body["error"]["param"]), (400, "input_tokens"))
        self.assertIn("maximum context length is 8 tokens", body["error"]["message"])
        many = {"model": "m", "prompt": "w", "max_tokens": 9}
        status, body = self.post("/v1/completions", many)
        self.assertEqual((status, body["error"]["param"]), (400, "max_tokens"))
        self.assertEqual(self.post("/v1/completions", long, max_model_len=0)[0], 200)

    def test_model_card(self) -> None:
        """
        C{/v1/models} lists vLLM's card fields, the context length among
        them.
        """
        status, body = self.post("/v1/models", None)
        (card,) = body["data"]
        self.assertEqual((status, card["root"], card["max_model_len"]), (200, "m", 8))
        self.assertIsNone(card["parent"])
        self.assertEqual(card["permission"][0]["object"], "model_permission")
