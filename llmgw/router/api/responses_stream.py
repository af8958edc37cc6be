"""
The Responses API's answer, sans-IO: a chat completion's pieces (reasoning,
text, tool calls) made into output items (L{Output}), whole or as the
Responses API's event stream (L{ResponsesStream}, with the stream relay's
interface: C{feed}, C{end}, C{usage}, C{done}).

The events and their order are those of OpenAI's API reference ("Streaming
events") and the official Python SDK's types and stream accumulator
(C{openai.lib.streaming.responses}): C{response.created},
C{response.in_progress}; per output item C{response.output_item.added},
its content part's C{response.content_part.added}, the deltas
(C{response.output_text.delta}, C{response.reasoning_text.delta},
C{response.function_call_arguments.delta},
C{response.custom_tool_call_input.delta}) and their C{.done},
C{response.content_part.done}, C{response.output_item.done}; then
C{response.completed} (or C{response.incomplete} when the length ran
out) with the usage.  A failure ends the stream with C{response.failed}
and C{error}.  Every event carries C{sequence_number}, from 0.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw.router.api.responses_items import CUSTOM_PARAMETER
from llmgw.router.upstream.relay import StreamCut
from llmgw.router.upstream.sse import SSEParser, engine_count

Event = tuple[str, dict[str, Any]]


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """
    @param usage: a chat completion's C{usage}, or L{None}.
    @return: the Response's C{usage}: input, output and total tokens, the
        cached input and the reasoning output in their details.
    """
    usage = usage or {}

    def count(value: object) -> int:
        return engine_count(value) or 0

    prompt, completion = (
        count(usage.get("prompt_tokens")),
        count(usage.get("completion_tokens")),
    )
    prompt_details = usage.get("prompt_tokens_details")
    output_details = usage.get("completion_tokens_details")
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": count(
                prompt_details.get("cached_tokens")
                if isinstance(prompt_details, dict)
                else 0
            ),
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": count(
                output_details.get("reasoning_tokens")
                if isinstance(output_details, dict)
                else 0
            )
        },
        "total_tokens": prompt + completion,
    }


def _status(reason: object) -> str:
    """
    @param reason: a chat completion's C{finish_reason}.
    @return: the status of the answer's last output item.
    """
    return "incomplete" if reason in ("length", "content_filter") else "completed"


@dataclass(frozen=True)
class Turn:
    """
    The request's side of a Response.

    @ivar fields: the Response object's fields the request fixes (its id,
        model, and the parameters echoed).
    @ivar names: each function the model sees to the tool it stands for:
        type, name, namespace.
    @ivar keep: called with the Response once complete or incomplete.
    """

    fields: dict[str, Any]
    names: dict[str, tuple[str, str, str | None]]
    keep: Callable[[dict[str, Any]], None]

    def builder(self, created: object) -> Output:
        """
        @param created: the chat completion's C{created}, POSIX seconds.
        """
        return Output(self, created)


class Output:
    """
    A Response's output items as they come, each opened, added to and
    closed; each step returns the events a stream writes for it.

    @ivar items: the output items, those still open included.
    """

    def __init__(self, turn: Turn, created: object) -> None:
        self._turn = turn
        self.created = created if isinstance(created, (int, float)) else 0
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        # A custom tool's arguments as the model writes them, by item id.
        self._raw: dict[str, str] = {}

    def date(self, created: object) -> None:
        """
        @param created: when the engine began the answer, POSIX seconds
            (a stream's first chunk's C{created}), or anything else to keep
            the date.
        """
        if isinstance(created, (int, float)):
            self.created = created

    def response(self, status: str, **more: Any) -> dict[str, Any]:
        """
        @return: the Response object as it stands, of C{status}.
        """
        response: dict[str, Any] = {
            **self._turn.fields,
            "created_at": self.created,
            "status": status,
            "output": [dict(item) for item in self.items],
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }
        response.update(more)
        return response

    def _begin(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[Event]:
        events = self.close()
        self._open = item
        index = len(self.items)
        self.items.append(item)
        events.append(
            ("response.output_item.added", {"output_index": index, "item": dict(item)})
        )
        if part is not None:
            item["content"] = [part]
            events.append(
                (
                    "response.content_part.added",
                    {
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "part": dict(part),
                    },
                )
            )
        return events

    def reasoning(self, delta: str) -> list[Event]:
        """
        @return: the events of C{delta}, more of the reasoning.
        """
        events: list[Event] = []
        if self._open is None or self._open["type"] != "reasoning":
            events = self._begin(
                {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": []},
                {"type": "reasoning_text", "text": ""},
            )
        return events + self._grow("response.reasoning_text.delta", delta)

    def text(self, delta: str) -> list[Event]:
        """
        @return: the events of C{delta}, more of the answer's text.
        """
        events: list[Event] = []
        if self._open is None or self._open["type"] != "message":
            events = self._begin(
                {
                    "id": f"msg_{uuid.uuid4().hex}",
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                },
                {"type": "output_text", "text": "", "annotations": []},
            )
        return events + self._grow("response.output_text.delta", delta)

    def _grow(self, kind: str, delta: str) -> list[Event]:
        assert self._open is not None
        part = self._open["content"][0]
        part["text"] += delta
        event = {
            "item_id": self._open["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "delta": delta,
        }
        if kind == "response.output_text.delta":
            event["logprobs"] = []
        return [(kind, event)] if delta else []

    def call(
        self, call_id: str, name: str, arguments: str, index: int = -1
    ) -> list[Event]:
        """
        A tool call begun (C{index} new) or continued.

        @param index: the call's index in the chat stream, or -1 for a
            whole call.
        @return: its events.
        """
        item = self._calls.get(index) if index >= 0 else None
        events: list[Event] = []
        if item is None:
            kind, tool, namespace = self._turn.names.get(name, ("function", name, None))
            item = {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "custom_tool_call" if kind == "custom" else "function_call",
                "status": "in_progress",
                "call_id": call_id or f"call_{uuid.uuid4().hex[:24]}",
                "name": tool,
            }
            item["input" if kind == "custom" else "arguments"] = ""
            if namespace is not None:
                item["namespace"] = namespace
            events = self._begin(item, None)
            if index >= 0:
                self._calls[index] = item
        self._raw[item["id"]] = self._raw.get(item["id"], "") + arguments
        if arguments and item["type"] == "function_call":
            item["arguments"] += arguments
            output = self.items.index(item)
            events.append(
                (
                    "response.function_call_arguments.delta",
                    {"item_id": item["id"], "output_index": output, "delta": arguments},
                )
            )
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """
        @param status: the item's status: C{incomplete} for the last one of
            an answer cut short.
        @return: the events that close the open item, if one is.
        """
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        events: list[Event] = []
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                done = (
                    "response.output_text.done",
                    {"text": part["text"], "logprobs": []},
                )
            else:
                done = ("response.reasoning_text.done", {"text": part["text"]})
            events.append((done[0], {**at, "content_index": 0, **done[1]}))
            events.append(
                ("response.content_part.done", {**at, "content_index": 0, "part": part})
            )
        elif item["type"] == "custom_tool_call":
            events += self._custom_input(item, at)
        else:
            events.append(
                (
                    "response.function_call_arguments.done",
                    {**at, "name": item["name"], "arguments": item["arguments"]},
                )
            )
        item["status"] = status
        events.append(
            ("response.output_item.done", {"output_index": index, "item": item})
        )
        return events

    def _custom_input(self, item: dict[str, Any], at: dict[str, Any]) -> list[Event]:
        # The model wrote {"input": "..."}: only whole, it is the input.
        text = self._raw.get(item["id"], "")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        value = parsed.get(CUSTOM_PARAMETER) if isinstance(parsed, dict) else None
        item["input"] = value if isinstance(value, str) else text
        return [
            ("response.custom_tool_call_input.delta", {**at, "delta": item["input"]}),
            ("response.custom_tool_call_input.done", {**at, "input": item["input"]}),
        ]

    def finish(self, reason: object, usage: dict[str, Any] | None) -> dict[str, Any]:
        """
        Close the open item and end the Response.

        @param reason: the chat completion's C{finish_reason}.
        @return: the Response, C{completed}, or C{incomplete} when the
            length ran out (C{max_output_tokens}) or the engine's filter
            stopped it (C{content_filter}); kept (L{Turn.keep}).
        """
        self.close(_status(reason))
        if reason in ("length", "content_filter"):
            why = "max_output_tokens" if reason == "length" else "content_filter"
            response = self.response("incomplete", incomplete_details={"reason": why})
        else:
            response = self.response("completed")
        response["usage"] = response_usage(usage)
        self._turn.keep(response)
        return response


class ResponsesStream:
    """
    A chat completions stream (asked with C{include_usage}) translated into
    the Responses API's events, fed in pieces of any size.

    @param max_event_size: bytes an upstream event may grow to.
    @param turn: the request's side of the Response.
    @ivar usage: the chat stream's usage, once its usage chunk came.
    @ivar done: whether the Response's last event was written.
    @ivar finished: whether a C{finish_reason} came.
    """

    def __init__(self, max_event_size: int, turn: Turn) -> None:
        self._parser = SSEParser(max(max_event_size, 1))
        self._output = turn.builder(None)
        self._sequence = 0
        self._started = False
        self._reason: object = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.finished = False

    def _write(self, events: list[Event]) -> bytes:
        out = []
        for kind, payload in events:
            data = {"type": kind, "sequence_number": self._sequence, **payload}
            self._sequence += 1
            out.append(
                b"event: %s\ndata: %s\n\n"
                % (kind.encode("ascii"), json.dumps(data).encode("utf-8"))
            )
        return b"".join(out)

    def _start(self, created: object) -> list[Event]:
        self._started = True
        self._output.date(created)
        response = self._output.response("in_progress")
        return [
            ("response.created", {"response": response}),
            ("response.in_progress", {"response": response}),
        ]

    def feed(self, data: bytes) -> bytes:
        """
        @return: the events to write now, possibly none.
        @raise llmgw.router.upstream.sse.EventTooLarge: an upstream event
            passed C{max_event_size}.
        """
        events: list[Event] = []
        for event in self._parser.feed(data):
            if self.done:
                break
            if event.data == b"[DONE]":
                return self._write(events) + self._finish()
            try:
                chunk = json.loads(event.data)
            except ValueError:
                continue
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error") is not None:
                error = chunk["error"]
                message = error.get("message") if isinstance(error, dict) else error
                return self._write(events) + self.fail(str(message)[:1000])
            events += self._chunk(chunk)
        return self._write(events)

    def _chunk(self, chunk: dict[str, Any]) -> list[Event]:
        events = [] if self._started else self._start(chunk.get("created"))
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                events += self._output.reasoning(reasoning)
            text = delta.get("content")
            if isinstance(text, str) and text:
                events += self._output.text(text)
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finished = True
                self._reason = choice["finish_reason"]
        return events

    def _call(self, call: object) -> list[Event]:
        if not isinstance(call, dict):
            return []
        index = call.get("index", 0)
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        arguments = function.get("arguments")
        return self._output.call(
            str(call.get("id") or ""),
            str(function.get("name") or ""),
            arguments if isinstance(arguments, str) else "",
            index if isinstance(index, int) and index >= 0 else 0,
        )

    def _finish(self) -> bytes:
        events = [] if self._started else self._start(None)
        events += self._output.close(_status(self._reason))
        response = self._output.finish(self._reason, self.usage)
        kind = (
            "response.incomplete"
            if response["status"] == "incomplete"
            else "response.completed"
        )
        events.append((kind, {"response": response}))
        self.done = True
        return self._write(events)

    def end(self) -> bytes:
        """
        The upstream stream ended.

        @return: the last events, when a choice finished and no C{[DONE]}
            came.
        @raise StreamCut: it ended before a choice finished.
        """
        if self.done:
            return b""
        if self.finished:
            return self._finish()
        raise StreamCut(
            "The replica's stream ended before its answer was complete"
            " (no finish_reason)."
        )

    def fail(self, message: str, code: str | None = None) -> bytes:
        """
        @return: the stream's last events for a failure: the Response
            C{failed} (begun first if it was not), then C{error}.
        """
        if self.done:
            return b""
        events = [] if self._started else self._start(None)
        response = self._output.response(
            "failed", error={"code": "server_error", "message": message}
        )
        events.append(("response.failed", {"response": response}))
        events.append(("error", {"code": code, "message": message, "param": None}))
        self.done = True
        return self._write(events)
