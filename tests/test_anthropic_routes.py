"""
The Messages API's routes in process (L{treq.testing.StubTreq}): keys in
C{x-api-key}, the translation to a replica that speaks chat completions and
the forwarding to one that speaks the Messages API, errors in Anthropic's
shape, usage records, and media estimated per item.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.api.app import Router
from llmgw.router.api.prepare import MEDIA_ITEM_TOKENS, prepare, prepare_messages
from llmgw.router.errors import APIError
from llmgw.router.interfaces import Endpoint
from llmgw.router.routing.balancer import Balancer
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import RouterMetrics
from tests.exchange_fakes import FakeAgent, FakeResponse
from tests.test_router import FakeAuth, Records
from tests.typing_support import Response, stub_treq

CHAT_ANSWER = (
    b'{"id":"c1","object":"chat.completion","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"Hi there"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2}}'
)
REQUEST = {
    "model": "m",
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "Hello"}],
}


class MessagesRouteTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.agent = FakeAgent()
        self.balancer = Balancer(self.clock, 10.0)
        self.balancer.set_endpoints([Endpoint("r1", "http://a:1", ("m", "hidden"))])
        self.auth = FakeAuth()
        self.sink = Records()
        self.router = Router(
            self.clock,
            self.balancer,
            self.agent,
            RouterConfig(),
            RouterMetrics(CollectorRegistry()),
            self.sink,
            wall_clock=lambda: 1234.5,
            auth=self.auth,
        )
        self.stub = stub_treq(self.router.resource())

    def post(
        self,
        payload: dict[str, Any] | bytes,
        path: str = "/v1/messages",
        headers: dict[bytes, list[bytes]] | None = None,
    ) -> Deferred[Response]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        d = self.stub.post(
            "http://gw" + path,
            data=body,
            headers=headers
            if headers is not None
            else {
                b"x-api-key": [b"sk-good"],
                b"anthropic-version": [b"2023-06-01"],
            },
        )
        self.stub.flush()
        return d

    def answer(self, code: int, body: bytes, kind: bytes = b"application/json") -> None:
        response = FakeResponse(code, kind)
        self.agent.sent[-1].answer.callback(response)
        response.write(body)
        response.end()
        self.stub.flush()

    def read(self, d: Deferred[Response]) -> tuple[int, Any, Response]:
        response = self.successResultOf(d)
        body = self.successResultOf(self.stub.content(response))
        return response.code, json.loads(body), response

    def test_translated_message(self) -> None:
        """
        A message for a replica without the Messages API goes to its chat
        completions, translated; the answer is a message naming the model
        sent; the record has the engine's counts and the key in
        C{x-api-key} is charged them.
        """
        d = self.post(REQUEST)
        (sent,) = self.agent.sent
        self.assertEqual(sent.uri, b"http://a:1/v1/chat/completions")
        self.assertEqual(
            json.loads(sent.body),
            {
                "model": "m",
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 16,
            },
        )
        self.answer(200, CHAT_ANSWER)
        code, message, _ = self.read(d)
        self.assertEqual(code, 200)
        self.assertEqual(
            (
                message["type"],
                message["content"],
                message["stop_reason"],
                message["usage"],
            ),
            (
                "message",
                [{"type": "text", "text": "Hi there"}],
                "end_turn",
                {"input_tokens": 9, "output_tokens": 2},
            ),
        )
        (record,) = self.sink.records
        self.assertEqual(
            (
                record.status,
                record.prompt_tokens,
                record.completion_tokens,
                record.key_id,
            ),
            (200, 9, 2, 7),
        )
        self.assertFalse(record.usage_estimated)
        self.assertEqual(self.auth.used_calls[0][0], 11)

    def test_bearer_key_and_count_tokens(self) -> None:
        """
        C{Authorization: Bearer} works as well; a count is the prompt
        tokens of a one-token chat completion.
        """
        d = self.post(
            {"model": "m", "messages": [{"role": "user", "content": "Hello"}]},
            "/v1/messages/count_tokens",
            {b"authorization": [b"Bearer sk-good"]},
        )
        self.assertEqual(json.loads(self.agent.sent[0].body)["max_tokens"], 1)
        self.answer(200, CHAT_ANSWER)
        self.assertEqual(self.read(d)[:2], (200, {"input_tokens": 9}))

    def test_native_forwarded_as_is(self) -> None:
        """
        To a replica that serves the Messages API the request goes as it
        came, to the same path, and its answer comes back as it is, its
        usage recorded.
        """
        self.balancer.set_endpoints(
            [Endpoint("r2", "http://b:2", ("m",), messages=True)]
        )
        body = json.dumps(REQUEST).encode()
        d = self.post(body)
        (sent,) = self.agent.sent
        self.assertEqual((sent.uri, sent.body), (b"http://b:2/v1/messages", body))
        native = b'{"type":"message","content":[],"usage":{"input_tokens":5,"output_tokens":3}}'  # noqa: E501
        self.answer(200, native)
        self.assertEqual(self.read(d)[1], json.loads(native))
        (record,) = self.sink.records
        self.assertEqual((record.prompt_tokens, record.completion_tokens), (5, 3))

    def test_stream_translated(self) -> None:
        """
        A stream from a chat replica reaches the client as the Messages
        API's events, and its record has the usage chunk's counts.
        """
        d = self.post({**REQUEST, "stream": True})
        sent = json.loads(self.agent.sent[0].body)
        self.assertEqual(sent["stream_options"], {"include_usage": True})
        self.answer(
            200,
            b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'  # noqa: E501
            b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'  # noqa: E501
            b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1}}\n\n'  # noqa: E501
            b"data: [DONE]\n\n",
            b"text/event-stream",
        )
        response = self.successResultOf(d)
        text = self.successResultOf(self.stub.content(response))
        kinds = [line[7:] for line in text.split(b"\n") if line.startswith(b"event: ")]
        self.assertEqual(
            kinds,
            [
                b"message_start",
                b"content_block_start",
                b"content_block_delta",
                b"content_block_stop",
                b"message_delta",
                b"message_stop",
            ],
        )
        self.assertIn(b'"stop_reason": "max_tokens"', text)
        (record,) = self.sink.records
        self.assertEqual((record.prompt_tokens, record.completion_tokens), (4, 1))

    def _error(self, d: Deferred[Response]) -> tuple[int, str, str, Response]:
        code, body, response = self.read(d)
        self.assertEqual(body["type"], "error")
        return code, body["error"]["type"], body["error"]["message"], response

    def test_errors_in_anthropic_shape(self) -> None:
        """
        No key, a refused model, a rate limit (with C{Retry-After}), a
        malformed body (naming the field), an unknown model, a replica's
        4xx and a wrong method are answered in Anthropic's shape.
        """
        no_key = self._error(self.post(REQUEST, headers={}))
        self.assertEqual(no_key[:2], (401, "authentication_error"))
        bad = self._error(
            self.post({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        )
        self.assertEqual(
            bad[:3], (400, "invalid_request_error", "max_tokens: Field required")
        )
        # No message at all: Anthropic's own 400, not an engine left to
        # generate from nothing.
        empty = self._error(self.post({"model": "m", "max_tokens": 5, "messages": []}))
        self.assertEqual(
            empty[:3],
            (
                400,
                "invalid_request_error",
                "messages: at least one message is required",
            ),
        )
        # Nor a conversation of system turns only, or of a user turn of no
        # blocks: the engine would see none.
        for turns in (
            [{"role": "system", "content": "hi"}],
            [{"role": "user", "content": []}],
        ):
            nothing = self._error(
                self.post({"model": "m", "max_tokens": 5, "messages": turns})
            )
            self.assertEqual(
                nothing[:3],
                (
                    400,
                    "invalid_request_error",
                    "messages: at least one user or assistant message is required",
                ),
            )
        self.assertEqual(
            self._error(self.post({**REQUEST, "model": "x"}))[:2],
            (404, "not_found_error"),
        )
        self.auth.refuse = APIError(
            403, "not yours", "invalid_request_error", "model_not_allowed", "model"
        )
        self.assertEqual(self._error(self.post(REQUEST))[:2], (403, "permission_error"))
        self.auth.refuse = APIError(
            429, "slow", "tokens", "rate_limit_exceeded", retry_after=7
        )
        limited = self._error(self.post(REQUEST))
        self.assertEqual(limited[:2], (429, "rate_limit_error"))
        self.assertEqual(limited[3].headers.getRawHeaders(b"retry-after"), [b"7"])
        self.auth.refuse = None
        d = self.post(REQUEST)
        self.answer(
            400, b'{"error": {"message": "too long", "type": "BadRequestError"}}'
        )
        self.assertEqual(self._error(d)[:3], (400, "invalid_request_error", "too long"))
        d = self.stub.get("http://gw/v1/messages")
        self.stub.flush()
        self.assertEqual(self._error(d)[:2], (405, "invalid_request_error"))
        self.assertEqual(
            [r.status for r in self.sink.records],
            [401, 400, 400, 400, 400, 404, 403, 429, 400],
        )

    def test_unavailable_is_overloaded(self) -> None:
        """
        A replica's 503 (overloaded, not ready) reaches the client as
        C{overloaded_error}, status 529, with C{Retry-After}.
        """
        d = self.post(REQUEST)
        response = FakeResponse(503, b"application/json")
        response.headers.addRawHeader(b"retry-after", b"3")
        self.agent.sent[-1].answer.callback(response)
        response.write(b'{"error": {"message": "busy"}}')
        response.end()
        self.stub.flush()
        code, kind, _, answer = self._error(d)
        self.assertEqual((code, kind), (529, "overloaded_error"))
        self.assertEqual(answer.headers.getRawHeaders(b"retry-after"), [b"3"])
        self.assertEqual([r.status for r in self.sink.records], [529])


IMAGE = "data:image/png;base64," + "A" * (3 * 1024 * 1024)


class MediaEstimateTests(SynchronousTestCase):
    def test_openai_image_counted_per_item(self) -> None:
        """
        A chat request carrying a 3 MiB inline image is estimated as its
        text plus L{MEDIA_ITEM_TOKENS}, not as its bytes.
        """
        payload = {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {"type": "image_url", "image_url": {"url": IMAGE}},
                        {
                            "type": "input_audio",
                            "input_audio": {"data": "B" * 4000, "format": "wav"},
                        },
                        {"type": "file", "file": {"file_data": "C" * 4000}},
                    ],
                }
            ],
        }
        body = json.dumps(payload).encode()
        prepared = prepare(body, b"/v1/chat/completions", lambda m: True, lambda m: m)
        text = len(body) - len(IMAGE) - 8000
        self.assertEqual(prepared.estimate, text // 4 + 3 * MEDIA_ITEM_TOKENS)
        self.assertLess(prepared.estimate, 5000)

    def test_anthropic_image_counted_per_item(self) -> None:
        """
        The same image as an Anthropic image block is one item too.
        """
        payload = {
            **REQUEST,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": IMAGE.split(",", 1)[1],
                            },
                        },
                    ],
                }
            ],
        }
        prepared = prepare_messages(
            json.dumps(payload).encode(), b"/v1/messages", lambda m: True, lambda m: m
        )
        self.assertLess(prepared.estimate, MEDIA_ITEM_TOKENS + 100)
        self.assertGreater(prepared.estimate, MEDIA_ITEM_TOKENS)
