"""
Anthropic's Messages API end to end: C{twistd -n llmgw-server} in front of
C{llmgw sim} (chat completions only: llmgw translates), with keys made by
C{llmgw ctl}, through the official C{anthropic} SDK; and a chat engine that
calls tools (L{ToolEngine}: the sim never does) for tool use both ways.
Usage is read from the server's per-request log lines, found by the
C{X-Request-ID} each request sends.
"""

from __future__ import annotations

import base64
import json
import re
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anthropic
import openai
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.api.prepare import MEDIA_ITEM_TOKENS
from tests.support import CtlMixin, Processes, logged_usage

HELLO: list[Any] = [{"role": "user", "content": "say hello"}]
ROBOT: Any = [{"role": "robot", "content": "hi"}]
IMAGE = base64.b64encode(b"\x89PNG" + b"\0" * (3 * 1024 * 1024 - 4)).decode()
"""
A 3 MiB image, base64 (4 MiB): estimated as its bytes it would be about
1,050,000 tokens.
"""


def _rid() -> str:
    return str(uuid.uuid4())


class MessagesThroughSimTests(SynchronousTestCase, Processes, CtlMixin):
    timeout = 120

    def setUp(self) -> None:
        _, sim = self.start_sim("--max-tokens", "5", "--itl", "0.05")
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={sim}=sim-model,other-model"
        )
        self.key = self.make_key("--tpm", "50000")

    def make_key(self, *args: str) -> str:
        made = self.ctl("keys", "create", "--name", f"k{uuid.uuid4().hex[:6]}", *args)
        return made.stdout.splitlines()[0].strip()

    def client(self, key: str | None = None) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.url, api_key=key or self.key, max_retries=0
        )

    def test_plain_stream_and_count(self) -> None:
        """
        C{messages.create}, C{messages.stream} and C{count_tokens} work;
        each usage row equals the counts the SDK got (the sim's).
        """
        client = self.client()
        rid = _rid()
        message = client.messages.create(
            model="sim-model",
            max_tokens=5,
            messages=HELLO,
            extra_headers={"X-Request-ID": rid},
        )
        self.assertEqual((message.type, message.role), ("message", "assistant"))
        self.assertEqual(message.model, "sim-model")
        self.assertEqual(message.stop_reason, "max_tokens")
        self.assertTrue(message.content[0].type == "text" and message.content[0].text)
        usage = message.usage
        self.assertEqual(
            logged_usage(self.server, rid),
            (200, usage.input_tokens, usage.output_tokens),
        )
        rid = _rid()
        with client.messages.stream(
            model="sim-model",
            max_tokens=4,
            system="be brief",
            messages=HELLO,
            extra_headers={"X-Request-ID": rid},
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        self.assertEqual(final.content[0].type, "text")
        self.assertEqual(text, getattr(final.content[0], "text", None))
        self.assertEqual(
            (final.stop_reason, final.usage.output_tokens), ("max_tokens", 4)
        )
        self.assertGreater(final.usage.input_tokens, 0)
        self.assertEqual(
            logged_usage(self.server, rid),
            (200, final.usage.input_tokens, final.usage.output_tokens),
        )
        counted = client.messages.count_tokens(model="sim-model", messages=HELLO)
        self.assertEqual(counted.input_tokens, usage.input_tokens)

    def test_errors(self) -> None:
        """
        A key without the model gets C{permission_error}; a key past its
        rpm C{rate_limit_error} with C{Retry-After}; a malformed body
        C{invalid_request_error} naming the field; a bad key
        C{authentication_error}.
        """
        other = self.client(self.make_key("--models", "other-model"))
        with self.assertRaises(anthropic.PermissionDeniedError) as denied:
            other.messages.create(model="sim-model", max_tokens=5, messages=HELLO)
        self.assertEqual(denied.exception.body["error"]["type"], "permission_error")
        slow = self.client(self.make_key("--rpm", "1"))
        slow.messages.create(model="sim-model", max_tokens=2, messages=HELLO)
        with self.assertRaises(anthropic.RateLimitError) as limited:
            slow.messages.create(model="sim-model", max_tokens=2, messages=HELLO)
        self.assertTrue(limited.exception.response.headers.get("retry-after"))
        self.assertEqual(limited.exception.body["error"]["type"], "rate_limit_error")
        with self.assertRaises(anthropic.BadRequestError) as bad:
            self.client().messages.create(
                model="sim-model",
                max_tokens=5,
                messages=ROBOT,
            )
        self.assertEqual(
            bad.exception.body["error"]["type"],
            "invalid_request_error",
        )
        self.assertIn("messages.0.role", bad.exception.message)
        with self.assertRaises(anthropic.AuthenticationError):
            self.client("sk-wrong").messages.create(
                model="sim-model", max_tokens=5, messages=HELLO
            )

    def test_image_stream_left_early(self) -> None:
        """
        A stream carrying a 3 MiB inline image (Anthropic's image block,
        then OpenAI's image_url part) holds its text's estimate plus
        L{MEDIA_ITEM_TOKENS} against the key's tpm of 50,000: a two-word
        request on the same key is admitted while it runs; left early, it
        is charged no more than that estimate for its prompt.
        """
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": IMAGE},
        }
        content = [{"type": "text", "text": "what is this"}, image]
        turns: Any = [{"role": "user", "content": content}]
        rid = _rid()
        with self.client().messages.stream(
            model="sim-model",
            max_tokens=200,
            messages=turns,
            extra_headers={"X-Request-ID": rid},
        ) as stream:
            next(iter(stream.text_stream))
            reply = self.client().messages.create(
                model="sim-model", max_tokens=2, messages=HELLO
            )
            self.assertEqual(reply.type, "message")
        status, prompt, _ = logged_usage(self.server, rid)
        self.assertEqual(status, 499)
        self.assertLessEqual(prompt, 200 + MEDIA_ITEM_TOKENS)
        self.assertGreaterEqual(prompt, MEDIA_ITEM_TOKENS)
        chat = openai.OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0)
        part = {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + IMAGE},
        }
        chat_turns: Any = [
            {"role": "user", "content": [{"type": "text", "text": "what"}, part]}
        ]
        rid = _rid()
        cut: Any = chat.chat.completions.create(
            model="sim-model",
            max_tokens=200,
            stream=True,
            messages=chat_turns,
            extra_headers={"X-Request-ID": rid},
        )
        next(iter(cut))
        two = chat.chat.completions.create(
            model="sim-model", max_tokens=2, messages=HELLO
        )
        self.assertTrue(two.choices)
        cut.close()
        status, prompt, _ = logged_usage(self.server, rid)
        self.assertEqual(status, 499)
        self.assertLessEqual(prompt, 200 + MEDIA_ITEM_TOKENS)


class _ToolHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ToolEngine

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        request = json.loads(self.rfile.read(length))
        self.server.requests.append(request)
        usage = {"prompt_tokens": 21, "completion_tokens": 8}
        if request.get("tools") and request["messages"][-1]["role"] != "tool":
            call = {
                "id": "call_7",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
            }
            message: dict[str, Any] = {
                "role": "assistant",
                "content": None,
                "tool_calls": [call],
            }
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": "Rainy."}, "stop"
        if not request.get("stream"):
            body = {
                "id": "t1",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
            }
            self._send(json.dumps(body).encode(), "application/json")
            return
        chunks: list[dict[str, Any]] = []
        if message.get("tool_calls"):
            first = {
                "index": 0,
                "id": "call_7",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"ci'},
            }
            chunks += [
                {"tool_calls": [first]},
                {
                    "tool_calls": [
                        {"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}
                    ]
                },
            ]
        else:
            chunks += [{"content": "Rainy."}]
        events: list[Any] = [
            {"id": "t1", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
            for d in chunks
        ]
        events.append(
            {
                "id": "t1",
                "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
            }
        )
        events.append({"id": "t1", "choices": [], "usage": usage})
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        self._send(data + b"data: [DONE]\n\n", "text/event-stream")

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class ToolEngine(ThreadingHTTPServer):
    """
    A chat completions engine on 127.0.0.1 that calls the tool C{weather}
    when the request offers tools and the last message is not a tool's
    answer, and answers C{"Rainy."} otherwise.

    @ivar requests: the bodies it received, parsed.
    """

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # llmgw closing its kept connection at the end is no error.
        if not isinstance(sys.exc_info()[1], ConnectionResetError):
            super().handle_error(request, client_address)

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ToolHandler)
        self.requests: list[dict[str, Any]] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


WEATHER: Any = {
    "name": "weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


class ToolUseTests(SynchronousTestCase, Processes):
    timeout = 60

    def setUp(self) -> None:
        self.engine = ToolEngine()
        self.addCleanup(self.engine.server_close)
        self.addCleanup(self.engine.shutdown)
        self.server, url, _ = self.start_server(
            "--endpoint", f"t-0={self.engine.url}=tools"
        )
        self.client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)

    def test_tool_round_trip(self) -> None:
        """
        The engine's tool call reaches the SDK as a C{tool_use} block
        (whole and streamed, its JSON in pieces), and the SDK's
        C{tool_result} reaches the engine as a C{tool} message answering
        that call; the usage rows are the engine's counts.
        """
        rid = _rid()
        first = self.client.messages.create(
            model="tools",
            max_tokens=50,
            tools=[WEATHER],
            messages=[{"role": "user", "content": "weather in Oslo?"}],
            extra_headers={"X-Request-ID": rid},
        )
        (use,) = first.content
        assert use.type == "tool_use"
        self.assertEqual(
            (use.name, use.input, first.stop_reason),
            ("weather", {"city": "Oslo"}, "tool_use"),
        )
        self.assertEqual(logged_usage(self.server, rid), (200, 21, 8))
        self.assertEqual(
            self.engine.requests[0]["tools"][0]["function"]["name"], "weather"
        )
        with self.client.messages.stream(
            model="tools",
            max_tokens=50,
            tools=[WEATHER],
            messages=[{"role": "user", "content": "weather in Oslo?"}],
        ) as stream:
            streamed = stream.get_final_message()
        self.assertEqual([b.type for b in streamed.content], ["tool_use"])
        self.assertEqual(getattr(streamed.content[0], "input", None), {"city": "Oslo"})
        self.assertEqual(
            (streamed.stop_reason, streamed.usage.output_tokens), ("tool_use", 8)
        )
        answer = self.client.messages.create(
            model="tools",
            max_tokens=50,
            tools=[WEATHER],
            messages=[
                {"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": first.content},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": use.id,
                            "content": "rain, 4 C",
                        }
                    ],
                },
            ],
        )
        self.assertEqual(getattr(answer.content[0], "text", None), "Rainy.")
        sent = self.engine.requests[-1]["messages"]
        self.assertEqual(sent[1]["tool_calls"][0]["id"], "call_7")
        self.assertEqual(
            sent[2], {"role": "tool", "tool_call_id": "call_7", "content": "rain, 4 C"}
        )
        self.assertTrue(re.fullmatch(r"msg_t1", answer.id))
