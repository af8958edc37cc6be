"""
Tests for the simulator playing an agent's model: the natural end of an
answer (L{llmgw.sim.length}) and the scripted tool calls
(L{llmgw.sim.script}), through the real L{SimSite} under a L{Clock}.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from llmgw.sim.engine import SimConfig, Simulator
from llmgw.sim.length import (
    NATURAL_MIN,
    NATURAL_SPAN,
    Length,
    answer_length,
    natural_length,
)
from llmgw.sim.script import QUOTE_CHARS
from llmgw.sim.web import SimSite
from tests.sim_support import dechunk, event_json

BASH = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]

CALL_LINE = 'sim: call bash {"command": "echo MARK-1"}'


class _Sim:
    """
    A simulator site fed whole requests, one connection each, under a clock
    that is run to the end of each answer.
    """

    def __init__(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.sim = Simulator(SimConfig(models=("m",), itl=0.001), self.clock)
        self.site = SimSite(self.sim)

    def post(
        self,
        body: dict[str, Any],
        path: str = "/v1/chat/completions",
        method: str = "POST",
    ) -> bytes:
        transport = StringTransport()
        channel = self.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 4000))
        channel.makeConnection(transport)
        data = json.dumps({"model": "m", **body}).encode() if body else b""
        channel.dataReceived(
            f"{method} {path} HTTP/1.1\r\nHost: sim\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        for _ in range(2000):
            self.clock.advance(0.01)
        raw: bytes = transport.value()
        head, _, rest = raw.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            rest, done = dechunk(rest)
            assert done
        return rest

    def answer(self, body: dict[str, Any]) -> Any:
        return json.loads(self.post({**body, "stream": False}))

    def chunks(self, body: dict[str, Any]) -> list[Any]:
        events = [
            e + b"\n\n" for e in self.post({**body, "stream": True}).split(b"\n\n") if e
        ]
        assert events[-1] == b"data: [DONE]\n\n"
        return [event_json(e) for e in events[:-1]]


def _user(text: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "you are an agent"},
        {"role": "user", "content": text},
    ]


class NaturalLengthTests(SynchronousTestCase):
    """
    An answer ends by itself at a length derived from its prompt, unless
    the cap comes first or C{ignore_eos} forces the cap.
    """

    def test_rule(self) -> None:
        """
        The natural length is deterministic and within its range; below the
        cap the answer stops there, otherwise it is the cap; C{ignore_eos}
        gives the cap and C{min_tokens} a floor.
        """
        lengths = {natural_length(f"prompt {i}".encode()) for i in range(300)}
        self.assertGreaterEqual(min(lengths), NATURAL_MIN)
        self.assertLess(max(lengths), NATURAL_MIN + NATURAL_SPAN)
        self.assertGreater(len(lengths), 100)
        n = natural_length(b"hello")
        self.assertEqual(natural_length(b"hello"), n)
        self.assertEqual(answer_length(b"hello", 32000), Length(n, "stop"))
        self.assertEqual(answer_length(b"hello", n - 1), Length(n - 1, "length"))
        self.assertEqual(answer_length(b"hello", 16), Length(16, "length"))
        self.assertEqual(
            answer_length(b"hello", 32000, ignore_eos=True), Length(32000, "length")
        )
        self.assertEqual(
            answer_length(b"hello", 32000, min_tokens=n + 5), Length(n + 5, "stop")
        )

    def test_through_the_site(self) -> None:
        """
        An agent's C{max_tokens} of 32,000 gets the natural length with
        C{finish_reason} C{stop}, streamed or not, counted under
        C{finished_reason="stop"}; C{ignore_eos} and C{min_tokens} force
        the length as vLLM does; C{min_tokens} above C{max_tokens} is a
        400 naming it.
        """
        sim = _Sim()
        messages = _user("hello there")
        prompt = b"you are an agent hello there"
        n = natural_length(prompt)
        whole = sim.answer({"messages": messages, "max_tokens": 32000})
        self.assertEqual(whole["choices"][0]["finish_reason"], "stop")
        self.assertEqual(whole["usage"]["completion_tokens"], n)
        chunks = sim.chunks(
            {
                "messages": messages,
                "max_tokens": 32000,
                "stream_options": {"include_usage": True},
            }
        )
        self.assertEqual(chunks[-2]["choices"][0]["finish_reason"], "stop")
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], n)
        forced = sim.answer(
            {"messages": messages, "max_tokens": 600, "ignore_eos": True}
        )
        self.assertEqual(forced["choices"][0]["finish_reason"], "length")
        self.assertEqual(forced["usage"]["completion_tokens"], 600)
        floor = sim.answer({"messages": messages, "max_tokens": 600, "min_tokens": 590})
        self.assertEqual(
            (floor["choices"][0]["finish_reason"], floor["usage"]["completion_tokens"]),
            ("stop", 590),
        )
        short = sim.answer({"messages": messages, "max_tokens": 5})
        self.assertEqual(short["choices"][0]["finish_reason"], "length")
        bad = sim.answer({"messages": messages, "max_tokens": 5, "min_tokens": 6})
        self.assertEqual(bad["error"]["param"], "min_tokens")
        metrics = sim.post({}, "/metrics", method="GET")
        for reason, count in (("stop", 3), ("length", 2)):
            self.assertIn(
                f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
                f'model_name="m"}} {count}.0'.encode(),
                metrics,
            )


class ScriptTests(SynchronousTestCase):
    """
    A C{sim: call} line makes a tool call; the tool's result makes a text
    that quotes it.
    """

    def test_tool_call_whole(self) -> None:
        """
        A call of an offered tool comes as C{message.tool_calls}, with the
        line's arguments, C{content} null and C{finish_reason}
        C{tool_calls}.
        """
        answer = _Sim().answer(
            {"messages": _user("please\n" + CALL_LINE + "\nthanks"), "tools": BASH}
        )
        choice = answer["choices"][0]
        self.assertEqual(choice["finish_reason"], "tool_calls")
        self.assertIsNone(choice["message"]["content"])
        (call,) = choice["message"]["tool_calls"]
        self.assertEqual(call["type"], "function")
        self.assertTrue(call["id"].startswith("chatcmpl-tool-"))
        self.assertEqual(call["function"]["name"], "bash")
        self.assertEqual(
            json.loads(call["function"]["arguments"]), {"command": "echo MARK-1"}
        )
        self.assertGreater(answer["usage"]["completion_tokens"], 1)

    def test_tool_call_streamed(self) -> None:
        """
        Streamed as vLLM's tool parsers stream it: the id, type and name in
        one delta, then the arguments in pieces, one token each, then the
        finish reason and usage.
        """
        chunks = _Sim().chunks(
            {
                "messages": _user(CALL_LINE),
                "tools": BASH,
                "stream_options": {"include_usage": True},
            }
        )
        self.assertEqual(chunks[0]["choices"][0]["delta"]["role"], "assistant")
        calls = [
            c["choices"][0]["delta"]["tool_calls"][0]
            for c in chunks
            if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
        ]
        self.assertEqual(calls[0]["function"], {"name": "bash"})
        self.assertEqual(calls[0]["index"], 0)
        self.assertEqual(calls[0]["type"], "function")
        self.assertTrue(all("id" not in c and c["index"] == 0 for c in calls[1:]))
        arguments = "".join(c["function"]["arguments"] for c in calls[1:])
        self.assertEqual(json.loads(arguments), {"command": "echo MARK-1"})
        self.assertEqual(chunks[-2]["choices"][0]["finish_reason"], "tool_calls")
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], len(calls))

    def test_tool_result_is_quoted(self) -> None:
        """
        After the assistant's call, the tool's result (a string or text
        parts) is quoted, its first C{QUOTE_CHARS} characters, with
        C{finish_reason} C{stop}, streamed or not.
        """
        long = "MARK-1\n" + "x" * 1000
        messages = [
            *_user(CALL_LINE),
            {"role": "assistant", "content": None, "tool_calls": []},
            {
                "role": "tool",
                "tool_call_id": "chatcmpl-tool-sim-1",
                "content": [{"type": "text", "text": long}],
            },
        ]
        sim = _Sim()
        answer = sim.answer({"messages": messages, "tools": BASH})
        text = answer["choices"][0]["message"]["content"]
        self.assertEqual(text, "The tool said: " + long[:QUOTE_CHARS])
        self.assertEqual(answer["choices"][0]["finish_reason"], "stop")
        chunks = sim.chunks({"messages": messages, "tools": BASH})
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        self.assertEqual(streamed, text)
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "stop")

    def test_no_such_tool(self) -> None:
        """
        A call of a tool the request does not offer, or with arguments that
        are not a JSON object, is a text saying so; a prompt without the
        line gets the usual generated text.
        """
        sim = _Sim()
        none = sim.answer({"messages": _user("sim: call grep {}"), "tools": BASH})
        self.assertEqual(
            none["choices"][0]["message"]["content"],
            "sim: this request offers no tool named grep.",
        )
        self.assertEqual(none["choices"][0]["finish_reason"], "stop")
        bad = sim.answer({"messages": _user("sim: call bash {nope}"), "tools": BASH})
        self.assertIn("not a JSON object", bad["choices"][0]["message"]["content"])
        plain = sim.answer({"messages": _user("hello"), "tools": BASH, "max_tokens": 3})
        self.assertNotIn("tool_calls", plain["choices"][0]["message"])
        self.assertEqual(plain["usage"]["completion_tokens"], 3)
