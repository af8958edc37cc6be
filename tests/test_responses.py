"""
The Responses API's translation, sans-IO (L{llmgw.router.api.responses},
L{llmgw.router.api.responses_items}, L{llmgw.router.api.responses_stream}),
its preparation (L{llmgw.router.api.prepare.prepare_responses}) and its
stored state (L{llmgw.router.api.responses_state}); every Response and event
checked against the official SDK's types.
"""

from __future__ import annotations

import io
import json
from typing import Any

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.api.anthropic import Invalid
from llmgw.router.api.prepare import Refused, prepare_responses
from llmgw.router.api.responses import ResponsesCall
from llmgw.router.api.responses_state import Conversations
from llmgw.router.errors import APIError
from llmgw.router.interfaces import KeptResponse
from llmgw.router.upstream.relay import StreamCut

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _call(**payload: Any) -> ResponsesCall:
    return ResponsesCall({"model": "m", "input": "hi", **payload})


def _invalid(**payload: Any) -> Invalid:
    try:
        _call(**payload)
    except Invalid as invalid:
        return invalid
    raise AssertionError("no Invalid raised")


WEATHER = {
    "type": "function",
    "name": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
PATCH = {"type": "custom", "name": "patch", "description": "Apply a patch."}
SHELL = {
    "type": "namespace",
    "name": "shell",
    "description": "Run commands.",
    "tools": [{"type": "function", "name": "run", "parameters": {"type": "object"}}],
}


class RequestTests(SynchronousTestCase):
    def test_string_input_and_instructions(self) -> None:
        """
        A string is one user message; C{instructions} go first, as a
        system message; options become chat completions' own.
        """
        chat = _call(
            instructions="be brief",
            max_output_tokens=7,
            temperature=0.5,
            top_p=0.9,
            user="u1",
            reasoning={"effort": "low"},
            parallel_tool_calls=False,
            text={"format": {"type": "json_schema", "name": "x", "schema": {}}},
            stream=True,
        ).chat
        self.assertEqual(
            chat["messages"],
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
            ],
        )
        self.assertEqual(
            (chat["max_tokens"], chat["temperature"], chat["top_p"], chat["user"]),
            (7, 0.5, 0.9, "u1"),
        )
        self.assertEqual(chat["reasoning_effort"], "low")
        self.assertIs(chat["parallel_tool_calls"], False)
        self.assertEqual(
            chat["response_format"],
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        )
        self.assertEqual(chat["stream_options"], {"include_usage": True})

    def test_items(self) -> None:
        """
        Messages of every role and part, a function call joining the
        assistant's message, its output a tool message, reasoning left out.
        """
        items = [
            {"role": "developer", "content": "rules"},
            {"role": "system", "content": [{"type": "input_text", "text": "more"}]},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AA"},
                ],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "message",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "ok ", "annotations": []},
                    {"type": "refusal", "refusal": "no"},
                ],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "weather",
                "arguments": '{"city":"Oslo"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        ]
        messages = _call(input=items, tools=[WEATHER]).chat["messages"]
        self.assertEqual(
            [m["role"] for m in messages],
            ["system", "system", "user", "assistant", "tool"],
        )
        self.assertEqual(messages[1]["content"], "more")
        self.assertEqual(messages[2]["content"][1]["type"], "image_url")
        self.assertEqual(messages[3]["content"], "ok no")
        self.assertEqual(messages[3]["tool_calls"][0]["id"], "c1")
        self.assertEqual(
            messages[4], {"role": "tool", "tool_call_id": "c1", "content": "rain"}
        )

    def test_tools(self) -> None:
        """
        Function, custom and namespace tools become functions (a custom
        tool's of one string parameter, a namespace's members named with
        it); hosted tools are left out.
        """
        call = _call(
            tools=[WEATHER, PATCH, SHELL, {"type": "web_search"}],
            tool_choice={"type": "function", "name": "run"},
        )
        names = [t["function"]["name"] for t in call.chat["tools"]]
        self.assertEqual(names, ["weather", "patch", "shell__run"])
        self.assertEqual(
            call.chat["tools"][1]["function"]["parameters"]["required"], ["input"]
        )
        self.assertEqual(call.tools.hosted, ["web_search"])
        self.assertEqual(call.chat["tool_choice"]["function"]["name"], "shell__run")

    def test_custom_and_namespaced_calls_in_input(self) -> None:
        """
        A custom tool's call and a namespaced function's call in the input
        reach the engine as the functions it was offered.
        """
        items = [
            {
                "type": "custom_tool_call",
                "call_id": "c1",
                "name": "patch",
                "input": "x",
            },
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "run",
                "namespace": "shell",
                "arguments": "{}",
            },
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
        ]
        messages = _call(input=items, tools=[PATCH, SHELL]).chat["messages"]
        calls = messages[0]["tool_calls"]
        self.assertEqual(
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
            [("patch", '{"input": "x"}'), ("shell__run", "{}")],
        )
        self.assertEqual(messages[1]["role"], "tool")

    def test_no_input(self) -> None:
        """
        C{input} is optional: without it the model sees what came before
        (here the instructions).
        """
        payload = {"model": "m", "instructions": "greet"}
        self.assertEqual(
            ResponsesCall(payload).chat["messages"],
            [{"role": "system", "content": "greet"}],
        )

    def test_errors_name_the_field(self) -> None:
        """
        An unknown item type, role or part, a forced hosted tool, a tool
        of an unknown type and a bad input are refused naming the field.
        """
        cases: list[tuple[dict[str, Any], str]] = [
            (
                {"input": [{"role": "user", "content": "a"}] * 3 + [{"type": "x"}]},
                "input[3].type",
            ),
            ({"input": [{"role": "robot", "content": "a"}]}, "input[0].role"),
            (
                {"input": [{"role": "user", "content": [{"type": "video"}]}]},
                "input[0].content[0].type",
            ),
            ({"input": 5}, "input"),
            (
                {
                    "tools": [{"type": "web_search"}],
                    "tool_choice": {"type": "web_search"},
                },
                "tool_choice",
            ),
            ({"tools": [{"type": "teleport"}]}, "tools[0].type"),
            ({"max_output_tokens": "many"}, "max_output_tokens"),
            ({"temperature": "hot"}, "temperature"),
        ]
        for payload, param in cases:
            self.assertEqual(_invalid(**payload).param, param, payload)

    def test_prepare(self) -> None:
        """
        A body that is not JSON is a 400; the engine's body is the chat
        translation under the catalog name; an unknown model is a 404.
        """
        knows, resolve = (
            (lambda m: m in ("m", "alias")),
            (lambda m: "m" if m == "alias" else None),
        )
        with self.assertRaises(Refused) as bad:
            prepare_responses(b"{nope", b"/v1/responses", knows, resolve)
        self.assertEqual(bad.exception.error.status, 400)
        prepared = prepare_responses(
            b'{"model": "alias", "input": "hi", "max_output_tokens": 9}',
            b"/v1/responses",
            knows,
            resolve,
            history=[{"role": "user", "content": "before"}],
        )
        body = json.loads(prepared.body)
        self.assertEqual((body["model"], prepared.max_tokens), ("m", 9))
        self.assertEqual([m["content"] for m in body["messages"]], ["before", "hi"])
        assert prepared.responses is not None
        self.assertEqual(prepared.responses.model, "alias")
        with self.assertRaises(Refused) as unknown:
            prepare_responses(b'{"model": "x", "input": "hi"}', b"/", knows, resolve)
        self.assertEqual(unknown.exception.error.status, 404)
        with self.assertRaises(Refused) as item:
            prepare_responses(
                b'{"model": "m", "input": [{"type": "x"}]}', b"/", knows, resolve
            )
        self.assertEqual(item.exception.error.param, "input[0].type")


CHAT = {
    "id": "c1",
    "created": 1700000000,
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "reasoning_content": "think",
                "content": "Hello",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "patch", "arguments": '{"input": "+x"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "shell__run", "arguments": "{}"},
                    },
                ],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 3},
    },
}


class AnswerTests(SynchronousTestCase):
    def test_whole(self) -> None:
        """
        A chat completion becomes a Response the SDK parses: a reasoning
        item, a message, a custom tool call with its input, a namespaced
        function call; usage with its details; kept for the store.
        """
        call = _call(tools=[PATCH, SHELL], metadata={"a": "b"})
        body, usage = call.whole(json.dumps(CHAT).encode(), False)
        self.assertEqual(usage, CHAT["usage"])
        response = Response.model_validate(json.loads(body))
        self.assertEqual(response.id, call.id)
        self.assertEqual(
            [item.type for item in response.output],
            ["reasoning", "message", "custom_tool_call", "function_call"],
        )
        self.assertEqual(response.output_text, "Hello")
        custom, function = response.output[2], response.output[3]
        assert custom.type == "custom_tool_call" and function.type == "function_call"
        self.assertEqual((custom.input, custom.call_id), ("+x", "call_1"))
        self.assertEqual((function.name, function.namespace), ("run", "shell"))
        assert response.usage is not None
        self.assertEqual(
            (response.usage.input_tokens, response.usage.total_tokens), (10, 14)
        )
        self.assertEqual(response.usage.input_tokens_details.cached_tokens, 3)
        self.assertEqual(
            (response.status, response.metadata), ("completed", {"a": "b"})
        )
        self.assertEqual(call.result, json.loads(body))

    def test_length_is_incomplete(self) -> None:
        """
        A completion cut by its length is an incomplete Response.
        """
        chat = {"choices": [{"message": {"content": "Hel"}, "finish_reason": "length"}]}
        body, _ = _call().whole(json.dumps(chat).encode(), False)
        response = json.loads(body)
        self.assertEqual(response["status"], "incomplete")
        self.assertEqual(
            response["incomplete_details"], {"reason": "max_output_tokens"}
        )
        self.assertEqual(response["output"][0]["status"], "incomplete")

    def test_not_a_completion(self) -> None:
        """
        An answer that is not a chat completion is a 502.
        """
        with self.assertRaises(APIError) as refused:
            _call().whole(b"[1]", False)
        self.assertEqual(refused.exception.status, 502)


def _chunks(*deltas: dict[str, Any], finish: str = "stop") -> bytes:
    events: list[Any] = [
        {"id": "c", "created": 5, "choices": [{"index": 0, "delta": d}]} for d in deltas
    ]
    events.append(
        {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    )
    events.append(
        {
            "id": "c",
            "choices": [],
            "usage": {"prompt_tokens": 6, "completion_tokens": 2},
        }
    )
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def _events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for block in data.split(b"\n\n"):
        if block:
            kind, line = block.split(b"\n")
            event = json.loads(line[len(b"data: ") :])
            assert kind == b"event: " + event["type"].encode()
            EVENTS.validate_python(event)
            out.append(event)
    return out


class StreamTests(SynchronousTestCase):
    def test_text_and_call_byte_by_byte(self) -> None:
        """
        A chat stream fed one byte at a time becomes the Responses API's
        events in order, numbered from 0, each valid for the SDK; its
        completed Response is kept, with the stream's usage.
        """
        call = _call(tools=[WEATHER], stream=True)
        relay = call.relay(65536)
        data = (
            _chunks(
                {"reasoning_content": "hm"},
                {"content": "He"},
                {"content": "llo"},
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "k1",
                            "function": {"name": "weather", "arguments": '{"ci'},
                        }
                    ]
                },
                {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":1}'}}]},
                finish="tool_calls",
            )
            + b"data: [DONE]\n\n"
        )
        out = b"".join(relay.feed(data[i : i + 1]) for i in range(len(data)))
        out += relay.end()
        events = _events(out)
        self.assertEqual(
            [e["sequence_number"] for e in events], list(range(len(events)))
        )
        kinds = [e["type"] for e in events]
        self.assertEqual(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ],
        )
        final = events[-1]["response"]
        self.assertEqual(final["output"][2]["arguments"], '{"city":1}')
        self.assertEqual(final["usage"]["total_tokens"], 8)
        self.assertEqual((relay.done, (relay.usage or {})["prompt_tokens"]), (True, 6))
        self.assertEqual(call.result, final)

    def test_custom_tool_and_length(self) -> None:
        """
        A custom tool's call ends with its input whole; a stream cut by
        its length ends with C{response.incomplete}.
        """
        call = _call(tools=[PATCH], stream=True)
        relay = call.relay(65536)
        data = _chunks(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "k",
                        "function": {"name": "patch", "arguments": '{"input": "+a"}'},
                    }
                ]
            },
            finish="length",
        )
        events = _events(relay.feed(data) + relay.end())
        self.assertIn(
            "response.custom_tool_call_input.done", [e["type"] for e in events]
        )
        last = events[-1]
        self.assertEqual(last["type"], "response.incomplete")
        self.assertEqual(last["response"]["output"][0]["input"], "+a")
        self.assertEqual(last["response"]["output"][0]["status"], "incomplete")

    def test_failures(self) -> None:
        """
        A stream cut before its end raises L{StreamCut}, and the error
        that follows is C{response.failed} then C{error}, numbered on; an
        engine's error chunk ends the stream the same way.
        """
        call = _call(stream=True)
        relay = call.relay(65536)
        first = _events(
            relay.feed(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
        )
        with self.assertRaises(StreamCut):
            relay.end()
        rest = _events(call.error_event(APIError(502, "cut", "api_error")))
        self.assertEqual([e["type"] for e in rest], ["response.failed", "error"])
        self.assertEqual(rest[0]["sequence_number"], len(first))
        self.assertIsNone(call.result)
        other = _call(stream=True).relay(65536)
        events = _events(other.feed(b'data: {"error": {"message": "boom"}}\n\n'))
        self.assertEqual(
            [e["type"] for e in events],
            ["response.created", "response.in_progress", "response.failed", "error"],
        )
        self.assertTrue(other.done)


class _Store:
    def __init__(self) -> None:
        self.kept: dict[str, KeptResponse] = {}

    def put(self, kept: KeptResponse) -> Deferred[None]:
        self.kept[kept.id] = kept
        return succeed(None)

    def get(
        self, response_id: str, key_id: int | None
    ) -> Deferred[KeptResponse | None]:
        kept = self.kept.get(response_id)
        return succeed(kept if kept is not None and kept.key_id == key_id else None)

    def delete(self, response_id: str, key_id: int | None) -> Deferred[bool]:
        kept = self.kept.get(response_id)
        if kept is None or kept.key_id != key_id:
            return succeed(False)
        del self.kept[response_id]
        return succeed(True)


class _Request:
    def __init__(self, body: bytes) -> None:
        self.content = io.BytesIO(body)


class _Key:
    def __init__(self, id: int) -> None:
        self.id = id


class StateTests(SynchronousTestCase):
    def test_keep_and_continue(self) -> None:
        """
        A completed response asked to be kept is kept under its key with
        the items the model saw; a continuation by the same key gets its
        input and output items; another key's or an unknown id is a 404
        naming C{previous_response_id}; C{store: false} keeps nothing.
        """
        store = _Store()
        conversations = Conversations(store, lambda: 42.0)
        prepared = prepare_responses(
            b'{"model": "m", "input": "hi"}',
            b"/v1/responses",
            lambda m: True,
            lambda m: None,
        )
        assert prepared.responses is not None
        prepared.responses.whole(json.dumps(CHAT).encode(), False)
        key: Any = _Key(7)
        self.successResultOf(Deferred.fromCoroutine(conversations.keep(prepared, key)))
        kept = store.kept[prepared.responses.id]
        self.assertEqual((kept.key_id, kept.created_at, kept.model), (7, 42.0, "m"))
        self.assertEqual(kept.input_items[0]["content"], "hi")
        body = json.dumps({"model": "m", "previous_response_id": kept.id}).encode()
        request: Any = _Request(body)
        history = self.successResultOf(
            Deferred.fromCoroutine(conversations.history(request, key))
        )
        self.assertEqual(history, kept.input_items + kept.output_items)
        others: list[Any] = [_Key(8), None]
        for other in others:
            request = _Request(body)
            failure = self.failureResultOf(
                Deferred.fromCoroutine(conversations.history(request, other)),
                APIError,
            )
            self.assertEqual(
                (failure.value.status, failure.value.param),
                (404, "previous_response_id"),
            )
        unstored = prepare_responses(
            b'{"model": "m", "input": "hi", "store": false}',
            b"/v1/responses",
            lambda m: True,
            lambda m: None,
        )
        assert unstored.responses is not None
        unstored.responses.whole(json.dumps(CHAT).encode(), False)
        self.successResultOf(Deferred.fromCoroutine(conversations.keep(unstored, key)))
        self.assertNotIn(unstored.responses.id, store.kept)
