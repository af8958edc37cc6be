"""
Anthropic's Messages API translated to and from chat completions
(L{llmgw.router.api.anthropic}, L{llmgw.router.api.anthropic_stream}), pure.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.api.anthropic import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    Invalid,
    MessagesCall,
    to_chat,
    to_message,
)
from llmgw.router.api.anthropic_stream import MessagesStream, NativeStream, chat_usage
from llmgw.router.errors import APIError, anthropic_error, anthropic_event
from llmgw.router.upstream.relay import StreamCut
from llmgw.router.upstream.sse import SSEParser


def _events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """
    @return: the events of a Messages API stream, each its C{event} field
        and its data parsed (the data's C{type} checked against it).
    """
    out = []
    for event in SSEParser().feed(data):
        assert event.event is not None, event
        payload = json.loads(event.data)
        assert payload["type"] == event.event.decode(), event
        out.append((event.event.decode(), payload))
    return out


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"id": "c1", "object": "chat.completion.chunk", "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


USAGE = (
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":12,'
    b'"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
)


class RequestTests(SynchronousTestCase):
    def test_conversation_with_tools_and_image(self) -> None:
        """
        The system prompt becomes the first message; an image block becomes
        an C{image_url} part with a data URL; an assistant's C{tool_use}
        becomes its C{tool_calls} (input as JSON arguments); a user's
        C{tool_result} becomes a C{tool} message before the rest of that
        turn; tools, C{tool_choice}, stop sequences and the stream's usage
        request are mapped.
        """
        payload = {
            "model": "m",
            "max_tokens": 20,
            "system": [{"type": "text", "text": "be brief"}],
            "stream": True,
            "stop_sequences": ["END"],
            "tools": [
                {
                    "name": "weather",
                    "description": "the weather",
                    "input_schema": {"type": "object"},
                }
            ],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": "AAAA",
                            },
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "checking"},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "rain"}],
                        },
                        {"type": "text", "text": "and tomorrow?"},
                    ],
                },
            ],
        }
        chat = to_chat(payload)
        self.assertEqual(
            chat["messages"],
            [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,AAAA"},
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": "checking",
                    "tool_calls": [
                        {
                            "id": "toolu_1",
                            "type": "function",
                            "function": {
                                "name": "weather",
                                "arguments": '{"city": "Oslo"}',
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "and tomorrow?"}],
                },
            ],
        )
        self.assertEqual(
            chat["tools"],
            [
                {
                    "type": "function",
                    "function": {
                        "name": "weather",
                        "description": "the weather",
                        "parameters": {"type": "object"},
                    },
                }
            ],
        )
        self.assertEqual(
            (chat["tool_choice"], chat["parallel_tool_calls"]), ("required", False)
        )
        self.assertEqual(
            (chat["max_tokens"], chat["stop"], chat["stream_options"]),
            (20, ["END"], {"include_usage": True}),
        )

    def test_count_tokens_asks_one_token(self) -> None:
        """
        A C{count_tokens} request needs no C{max_tokens}; its translation
        asks for one token and no stream.
        """
        chat = to_chat(
            {
                "model": "m",
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
            counting=True,
        )
        self.assertEqual(
            chat,
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
            },
        )

    def test_faults_name_the_field(self) -> None:
        """
        A missing or ill-typed field is refused naming its dotted path.
        """
        user = [{"role": "user", "content": "hi"}]
        cases: list[tuple[dict[str, Any], str]] = [
            ({"model": "m", "messages": user}, "max_tokens"),
            ({"model": "m", "max_tokens": "9", "messages": user}, "max_tokens"),
            ({"model": "m", "max_tokens": 9}, "messages"),
            (
                {"model": "m", "max_tokens": 9, "messages": [{"role": "bot"}]},
                "messages.0.role",
            ),
            (
                {
                    "model": "m",
                    "max_tokens": 9,
                    "messages": [{"role": "user", "content": [{"type": "video"}]}],
                },
                "messages.0.content.0.type",
            ),
            (
                {"model": "m", "max_tokens": 9, "messages": user, "tools": [{}]},
                "tools.0.name",
            ),
        ]
        for payload, param in cases:
            with self.assertRaises(Invalid) as caught:
                to_chat(payload)
            self.assertEqual(caught.exception.param, param)
            self.assertTrue(caught.exception.message.startswith(param + ": "))


class AnswerTests(SynchronousTestCase):
    def test_tool_calls_become_tool_use(self) -> None:
        """
        A chat completion's text and tool calls become a text block and
        C{tool_use} blocks (arguments parsed); its stop reason is
        C{tool_use}; its usage splits the cached tokens out of the input.
        """
        chat = {
            "id": "c9",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "content": "let me see",
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {
                                    "name": "weather",
                                    "arguments": '{"city": "Oslo"}',
                                },
                            }
                        ],
                    },
                }
            ],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 6},
            },
        }
        self.assertEqual(
            to_message(chat, "alias"),
            {
                "id": "msg_c9",
                "type": "message",
                "role": "assistant",
                "model": "alias",
                "content": [
                    {"type": "text", "text": "let me see"},
                    {
                        "type": "tool_use",
                        "id": "call_1",
                        "name": "weather",
                        "input": {"city": "Oslo"},
                    },
                ],
                "stop_reason": "tool_use",
                "stop_sequence": None,
                "usage": {
                    "input_tokens": 4,
                    "output_tokens": 5,
                    "cache_read_input_tokens": 6,
                },
            },
        )

    def test_stop_reasons(self) -> None:
        """
        C{length} is C{max_tokens}, C{stop} is C{end_turn}, and a stop
        sequence vLLM names (C{stop_reason}) is C{stop_sequence}.
        """
        message = {"role": "assistant", "content": "x"}
        reasons = [
            to_message({"choices": [{"message": message, **choice}]}, "m", ("END",))
            for choice in (
                {"finish_reason": "length"},
                {"finish_reason": "stop"},
                {"finish_reason": "stop", "stop_reason": "END"},
            )
        ]
        self.assertEqual(
            [(r["stop_reason"], r["stop_sequence"]) for r in reasons],
            [("max_tokens", None), ("end_turn", None), ("stop_sequence", "END")],
        )

    def test_whole_answers_and_their_usage(self) -> None:
        """
        A translated answer comes back as a message, its usage the chat
        completion's; a count comes back as C{input_tokens}; a native
        answer passes as it is, its usage read in chat terms (input, cache
        reads and writes together); a broken answer is a 502.
        """
        chat = b'{"id":"c","choices":[{"message":{"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":7,"completion_tokens":2}}'  # noqa: E501
        call = MessagesCall(b"{}", MESSAGES_PATH, "m")
        body, usage = call.whole(chat, native=False)
        self.assertEqual(json.loads(body)["content"], [{"type": "text", "text": "hi"}])
        self.assertEqual(usage, {"prompt_tokens": 7, "completion_tokens": 2})
        count = MessagesCall(b"{}", COUNT_TOKENS_PATH, "m")
        self.assertEqual(json.loads(count.whole(chat, False)[0]), {"input_tokens": 7})
        native = b'{"type":"message","usage":{"input_tokens":3,"cache_read_input_tokens":5,"output_tokens":2}}'  # noqa: E501
        self.assertEqual(
            call.whole(native, True),
            (native, {"prompt_tokens": 8, "completion_tokens": 2}),
        )
        self.assertEqual(
            count.whole(b'{"input_tokens": 11}', True)[1],
            {"prompt_tokens": 11, "completion_tokens": 0},
        )
        with self.assertRaises(APIError) as caught:
            call.whole(b"[]", False)
        self.assertEqual(caught.exception.status, 502)
        self.assertIsNone(chat_usage({"type": "x"}))


class StreamTests(SynchronousTestCase):
    def _stream(self) -> bytes:
        return (
            _chunk({"role": "assistant", "content": ""})
            + _chunk({"content": "Hel"})
            + _chunk({"content": "lo"})
            + _chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"ci'},
                        }
                    ]
                }
            )
            + _chunk(
                {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]}
            )
            + _chunk({}, "tool_calls")
            + USAGE
            + b"data: [DONE]\n\n"
        )

    def test_event_order_fed_byte_by_byte(self) -> None:
        """
        A chat stream with text and a tool call, fed one byte at a time,
        becomes C{message_start}, a text block, a C{tool_use} block with
        its JSON in pieces, C{message_delta} with the stop reason and the
        usage, C{message_stop}; each event names its type.
        """
        relay = MessagesStream(1 << 20, "m")
        data = self._stream()
        out = b"".join(relay.feed(data[i : i + 1]) for i in range(len(data)))
        out += relay.end()
        events = _events(out)
        self.assertEqual(
            [kind for kind, _ in events],
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ],
        )
        self.assertEqual(events[0][1]["message"]["model"], "m")
        self.assertEqual(
            events[5][1]["content_block"],
            {"type": "tool_use", "id": "call_1", "name": "weather", "input": {}},
        )
        self.assertEqual(
            "".join(e[1]["delta"]["partial_json"] for e in events[6:8]),
            '{"city": 1}',
        )
        self.assertEqual(
            events[9][1],
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {
                    "input_tokens": 8,
                    "output_tokens": 3,
                    "cache_read_input_tokens": 4,
                },
            },
        )
        self.assertTrue(relay.done)
        self.assertEqual(relay.usage["prompt_tokens"] if relay.usage else None, 12)

    def test_finished_without_done(self) -> None:
        """
        A stream whose choice finished but that ended without C{[DONE]}
        gets its message's end; one that ended before any finish is cut.
        """
        relay = MessagesStream(1 << 20, "m")
        relay.feed(_chunk({"content": "x"}, "length"))
        kinds = [kind for kind, _ in _events(relay.end())]
        self.assertEqual(kinds, ["content_block_stop", "message_delta", "message_stop"])
        cut = MessagesStream(1 << 20, "m")
        cut.feed(_chunk({"content": "x"}))
        self.assertRaises(StreamCut, cut.end)
        self.assertFalse(cut.done)

    def test_engine_error_event(self) -> None:
        """
        An error object in the chat stream becomes an C{error} event, the
        stream's last.
        """
        relay = MessagesStream(1 << 20, "m")
        out = relay.feed(b'data: {"error": {"message": "boom"}}\n\n')
        out += relay.feed(_chunk({"content": "late"}))
        self.assertEqual(
            _events(out),
            [
                (
                    "error",
                    {
                        "type": "error",
                        "error": {"type": "api_error", "message": "boom"},
                    },
                )
            ],
        )

    def test_native_stream_usage(self) -> None:
        """
        A native stream passes as it came (whole events); its usage is
        C{message_start}'s input and C{message_delta}'s output together.
        """
        data = (
            b'event: message_start\ndata: {"type":"message_start","message":'
            b'{"usage":{"input_tokens":9,"output_tokens":1}}}\n\n'
            b'event: message_delta\ndata: {"type":"message_delta","usage":'
            b'{"output_tokens":4}}\n\n'
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
        )
        relay = NativeStream(1 << 20)
        out = b"".join(relay.feed(data[i : i + 7]) for i in range(0, len(data), 7))
        self.assertEqual(out + relay.end(), data)
        self.assertEqual(relay.usage, {"prompt_tokens": 9, "completion_tokens": 4})
        cut = NativeStream(1 << 20)
        cut.feed(data[:60])
        self.assertRaises(StreamCut, cut.end)


class ErrorShapeTests(SynchronousTestCase):
    def test_types_by_status(self) -> None:
        """
        Each error takes Anthropic's type for its status; 503s and the
        overload room's refusals are C{overloaded_error} 529; a 400's
        message names its field.
        """
        cases = [
            (APIError(400, "bad", "invalid_request_error", param="max_tokens"), 400),
            (APIError(401, "who", "invalid_request_error"), 401),
            (APIError(403, "no", "invalid_request_error"), 403),
            (APIError(404, "gone", "invalid_request_error"), 404),
            (APIError(429, "slow", "tokens", "rate_limit_exceeded"), 429),
            (APIError(429, "full", "rate_limit_error", "model_overloaded"), 529),
            (APIError(503, "none", "service_unavailable_error"), 529),
            (APIError(500, "oops", "api_error"), 500),
            (APIError(502, "broke", "upstream_error"), 502),
        ]
        shapes = [anthropic_error(error) for error, _ in cases]
        self.assertEqual([s for s, _ in shapes], [status for _, status in cases])
        self.assertEqual(
            [json.loads(body)["error"]["type"] for _, body in shapes],
            [
                "invalid_request_error",
                "authentication_error",
                "permission_error",
                "not_found_error",
                "rate_limit_error",
                "overloaded_error",
                "overloaded_error",
                "api_error",
                "api_error",
            ],
        )
        self.assertEqual(
            json.loads(shapes[0][1]),
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "max_tokens: bad",
                },
            },
        )
        self.assertEqual(
            _events(anthropic_event(cases[7][0])),
            [
                (
                    "error",
                    {
                        "type": "error",
                        "error": {"type": "api_error", "message": "oops"},
                    },
                )
            ],
        )
