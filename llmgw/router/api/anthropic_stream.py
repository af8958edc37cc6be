"""
The Messages API's event stream, sans-IO: a chat completions stream in,
Anthropic's events out (L{MessagesStream}), or a native Messages API stream
passed on with its usage read (L{NativeStream}).  Both have the stream
relay's interface (L{llmgw.router.upstream.relay.UsageFilter}: C{feed}, C{end},
C{usage}, C{done}).

The order is the one Anthropic's API reference ("Streaming Messages") gives
and the official SDK's accumulator enforces: C{message_start}; per content
block C{content_block_start}, C{content_block_delta}s (C{thinking_delta} and a
last C{signature_delta}, C{text_delta}, C{input_json_delta}),
C{content_block_stop}; C{message_delta} with
C{stop_reason} and the usage; C{message_stop}.  Every event names its type
in an C{event:} field: the SDK skips events without one.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from llmgw.router.upstream.relay import StreamCut
from llmgw.router.upstream.sse import SSEParser, engine_count

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
"""
Chat completions' C{finish_reason} to the Messages API's C{stop_reason}.
"""


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    """
    @return: one event, C{event: <kind>} and its JSON data.
    """
    return b"event: %s\ndata: %s\n\n" % (
        kind.encode("ascii"),
        json.dumps(payload).encode("utf-8"),
    )


def stop_reason(
    choice: dict[str, Any], stops: tuple[str, ...]
) -> tuple[str, str | None]:
    """
    @return: a chat choice's C{stop_reason} and C{stop_sequence}: the
        sequence when the engine says which one matched (vLLM's
        C{stop_reason}).
    """
    matched = choice.get("stop_reason")
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return STOP_REASONS.get(str(choice.get("finish_reason")), "end_turn"), None


def reasoning_of(message: dict[str, Any]) -> str:
    """
    @param message: a chat completion's C{message}, or a stream chunk's
        C{delta}.
    @return: the engine's reasoning in it, or C{""}: vLLM's reasoning
        parsers give C{reasoning} (0.32; C{reasoning_content} before, as
        llama.cpp's server still does).
    """
    for name in ("reasoning", "reasoning_content"):
        value = message.get(name)
        if isinstance(value, str) and value:
            return value
    return ""


def signature() -> str:
    """
    @return: a C{thinking} block's C{signature}: clients keep it and send it
        back with the block; llmgw leaves thinking out of the history it
        translates, so it is only unique (as vLLM's route makes it).
    """
    return uuid.uuid4().hex


def anthropic_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """
    @param usage: a chat completion's C{usage}, or L{None}.
    @return: the Messages API's C{usage}: C{input_tokens} not read from
        the cache, C{output_tokens}, and C{cache_read_input_tokens} when
        the engine reports cached tokens (C{prompt_tokens_details}).
    """
    usage = usage or {}
    prompt = engine_count(usage.get("prompt_tokens")) or 0
    details = usage.get("prompt_tokens_details")
    cached = engine_count(
        details.get("cached_tokens") if isinstance(details, dict) else None
    )
    out: dict[str, Any] = {
        "input_tokens": prompt - (cached or 0),
        "output_tokens": engine_count(usage.get("completion_tokens")) or 0,
    }
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    return out


_INPUT = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def chat_usage(usage: object) -> dict[str, Any] | None:
    """
    @param usage: a Messages API C{usage}, or anything.
    @return: its counts as a chat completion's C{usage}, for the request's
        record: C{prompt_tokens} the input read from the cache, written to
        it and neither, C{completion_tokens} the output; L{None} when it
        has no counts.
    """
    if not isinstance(usage, dict):
        return None
    counts = {
        k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)
    }
    if "input_tokens" not in counts and "output_tokens" not in counts:
        return None
    return {
        "prompt_tokens": sum(counts.get(k, 0) for k in _INPUT),
        "completion_tokens": counts.get("output_tokens", 0),
    }


class MessagesStream:
    """
    A chat completions stream (asked with C{include_usage}) translated into
    the Messages API's events, fed in pieces of any size.

    @param max_event_size: bytes an upstream event may grow to.
    @param model: the model name the client sent.
    @param stops: the request's C{stop_sequences}.
    @param thinking: whether the engine's reasoning deltas become a
        C{thinking} block (C{thinking_delta}s, then a C{signature_delta}
        before its C{content_block_stop}), or are dropped.
    @ivar usage: the chat stream's usage, once its usage chunk came.
    @ivar done: whether C{message_stop} was written.
    @ivar finished: whether a C{finish_reason} came.
    """

    def __init__(
        self,
        max_event_size: int,
        model: str,
        stops: tuple[str, ...] = (),
        thinking: bool = True,
    ):
        self._parser = SSEParser(max_event_size)
        self._model = model
        self._stops = stops
        self._thinking = thinking
        self._reasoning: int | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.finished = False
        self._started = False
        self._open: int | None = None
        self._text: int | None = None
        self._tools: dict[int, int] = {}
        self._blocks = 0
        self._called = False
        self._reason: tuple[str, str | None] = ("end_turn", None)

    def feed(self, data: bytes) -> bytes:
        """
        @return: the events to write now, possibly none.
        @raise llmgw.router.upstream.sse.EventTooLarge: an upstream event passed
            C{max_event_size}.
        """
        out: list[bytes] = []
        for event in self._parser.feed(data):
            if not self.done:
                self._chunk(event.data, out)
        return b"".join(out)

    def end(self) -> bytes:
        """
        The upstream stream ended.

        @return: the last events: the message's end, when a choice
            finished and no C{[DONE]} came.
        @raise StreamCut: it ended before a choice finished.
        """
        if self.done:
            return b""
        if self.finished:
            out: list[bytes] = []
            self._finish(out)
            return b"".join(out)
        raise StreamCut(
            "The replica's stream ended before its answer was complete"
            " (no finish_reason)."
        )

    def _chunk(self, data: bytes, out: list[bytes]) -> None:
        if data == b"[DONE]":
            self._finish(out)
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        error = chunk.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            out.append(
                sse(
                    "error",
                    {
                        "type": "error",
                        "error": {"type": "api_error", "message": str(message)[:1000]},
                    },
                )
            )
            self.done = True
            return
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not self._started:
            self._start(chunk, out)
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice, out)

    def _start(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        self._started = True
        message: dict[str, Any] = {
            "id": f"msg_{chunk.get('id') or 'llmgw'}",
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # The chat stream's counts come at its end: message_delta
            # carries them (the SDK takes input_tokens from there too).
            "usage": anthropic_usage(self.usage),
        }
        out.append(sse("message_start", {"type": "message_start", "message": message}))

    def _choice(self, choice: dict[str, Any], out: list[bytes]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            reasoning = reasoning_of(delta) if self._thinking else ""
            if reasoning:
                if self._reasoning is None or self._open != self._reasoning:
                    self._reasoning = self._begin(
                        {"type": "thinking", "thinking": "", "signature": ""}, out
                    )
                self._delta(
                    self._reasoning,
                    {"type": "thinking_delta", "thinking": reasoning},
                    out,
                )
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self._text is None or self._open != self._text:
                    self._text = self._begin({"type": "text", "text": ""}, out)
                self._delta(self._text, {"type": "text_delta", "text": text}, out)
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                if isinstance(call, dict):
                    self._tool_call(call, out)
        if choice.get("finish_reason") is not None:
            self.finished = True
            self._reason = stop_reason(choice, self._stops)

    def _tool_call(self, call: dict[str, Any], out: list[bytes]) -> None:
        index = call.get("index", 0)
        index = index if isinstance(index, int) else 0
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        block = self._tools.get(index)
        if block is None:
            self._called = True
            block = self._tools[index] = self._begin(
                {
                    "type": "tool_use",
                    "id": call.get("id") or f"toolu_{index}",
                    "name": function.get("name") or "",
                    "input": {},
                },
                out,
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            self._delta(
                block, {"type": "input_json_delta", "partial_json": arguments}, out
            )

    def _begin(self, block: dict[str, Any], out: list[bytes]) -> int:
        self._close(out)
        index = self._open = self._blocks
        self._blocks += 1
        out.append(
            sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        return index

    def _delta(self, index: int, delta: dict[str, Any], out: list[bytes]) -> None:
        out.append(
            sse(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
        )

    def _close(self, out: list[bytes]) -> None:
        if self._open is not None and self._open == self._reasoning:
            self._delta(
                self._open, {"type": "signature_delta", "signature": signature()}, out
            )
        if self._open is not None:
            out.append(
                sse(
                    "content_block_stop",
                    {"type": "content_block_stop", "index": self._open},
                )
            )
            self._open = None

    def _finish(self, out: list[bytes]) -> None:
        if not self._started:
            self._start({}, out)
        self._close(out)
        reason, sequence = self._reason
        if self._called:
            reason = "tool_use"
        out.append(
            sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": anthropic_usage(self.usage),
                },
            )
        )
        out.append(sse("message_stop", {"type": "message_stop"}))
        self.done = True


class NativeStream:
    """
    An engine's own Messages API stream, passed on event by event (whole
    events only, so that a cut can end with a clean error event), its usage
    read from C{message_start} and C{message_delta}.

    @ivar usage: the counts so far as a chat completion's C{usage}, or
        L{None}.
    @ivar done: whether C{message_stop} came.
    """

    def __init__(self, max_event_size: int) -> None:
        self._parser = SSEParser(max_event_size)
        self._counts: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.done = False

    @property
    def finished(self) -> bool:
        """
        Whether the engine finished its answer: its C{message_stop} came.
        """
        return self.done

    def feed(self, data: bytes) -> bytes:
        """
        @return: the whole events in C{data} and before it, written again.
        """
        out = []
        for event in self._parser.feed(data):
            kind = event.event or b"message"
            lines = b"".join(
                b"data: " + line + b"\n" for line in event.data.split(b"\n")
            )
            out.append(b"event: " + kind + b"\n" + lines + b"\n")
            self._watch(kind, event.data)
        return b"".join(out)

    def _watch(self, kind: bytes, data: bytes) -> None:
        if kind == b"message_stop":
            self.done = True
        if kind not in (b"message_start", b"message_delta"):
            return
        try:
            payload = json.loads(data)
        except ValueError:
            return
        if not isinstance(payload, dict):
            return
        if kind == b"message_start" and isinstance(payload.get("message"), dict):
            payload = payload["message"]
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self._counts.update((k, v) for k, v in usage.items() if isinstance(v, int))
            self.usage = chat_usage(self._counts)

    def end(self) -> bytes:
        """
        @raise StreamCut: the stream ended before C{message_stop}.
        """
        if self.done:
            return b""
        raise StreamCut("The replica's stream ended before its message_stop.")
