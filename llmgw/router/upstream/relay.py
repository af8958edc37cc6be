"""
The stream relay's filter, sans-IO: a replica's event stream in, the bytes to
pass to the client out, whole events only, with the usage read on the way and
the usage-only chunk left out when the client did not ask for it; and the
usage of a whole answer (L{answer_usage}).
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmgw.router.upstream.sse import USAGE_OBJECT, Event, SSEParser, usage_of

DONE = b"data: [DONE]\n\n"
"""
The event that ends a chat or completions stream (OpenAI API reference,
C{stream}: "terminated by a C{data: [DONE]} message").
"""
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')
"""
A choice's non-null C{finish_reason}, in raw stream bytes: the engine
finished that choice.  Unescaped quotes cannot occur inside a JSON string,
so generated text cannot fake it.
"""


def answer_usage(body: bytes) -> dict[str, Any] | None:
    """
    @param body: a whole JSON answer of an engine.
    @return: its C{usage} object, or L{None} when it has none (or is no
        JSON object).
    """
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    usage = parsed.get("usage") if isinstance(parsed, dict) else None
    return usage if isinstance(usage, dict) else None


class StreamCut(Exception):
    """
    The stream ended before it was complete: inside a line (its last event is
    not whole), or, for a chat or completions stream, before any choice
    finished.

    @ivar rest: whole events still to pass on before the error.
    """

    def __init__(self, message: str, rest: bytes = b"") -> None:
        super().__init__(message)
        self.rest = rest


class UsageFilter:
    """
    Feed it the replica's stream with L{feed} as it arrives, in pieces of
    any size, and call L{end} when it ends.

    Only whole events come out: the bytes of an event still arriving wait
    here until it ends.  So a stream that breaks mid-event can end with a
    clean error event, not with half an event the client cannot parse, and
    the usage-only chunk can be left out.  Engines write whole events: a
    piece made of whole events and holding no usage object comes out as it
    went in, without a copy.

    @param max_event_size: bytes an event may grow to.
    @param strip: leave out the usage-only chunk (the router asked for
        usage the client did not).
    @param completion: a chat or completions stream, which ends with
        L{DONE}: see L{end}.
    @ivar usage: the last usage object found in the stream, or L{None}.
    @ivar finished: whether a choice's C{finish_reason} came (only watched
        for a C{completion} stream).
    @ivar done: whether the last event so far was C{[DONE]}.
    """

    __slots__ = (
        "_parser",
        "_strip",
        "_completion",
        "_pending",
        "_base",
        "usage",
        "finished",
        "done",
    )

    def __init__(self, max_event_size: int, strip: bool, completion: bool = False):
        self._parser = SSEParser(max_event_size)
        self._strip = strip
        self._completion = completion
        # The bytes of events not yet whole, from stream offset _base.
        self._pending = bytearray()
        self._base = 0
        self.usage: dict[str, Any] | None = None
        self.finished = False
        self.done = False

    def _watch(self, events: list[Event]) -> None:
        # A completion stream's ending: what the events say of it.
        for event in events:
            if not self.finished and _FINISHED.search(event.data):
                self.finished = True
        if events:
            self.done = events[-1].data == b"[DONE]"

    def feed(self, data: bytes) -> bytes:
        """
        @param data: the next bytes of the stream.
        @return: the bytes to pass on now, possibly empty; C{data} itself
            when it is passed on whole.
        @raise llmgw.router.upstream.sse.EventTooLarge: an event passed
            C{max_event_size}.
        """
        pending = self._pending
        parser = self._parser
        completion = self._completion
        if (
            not pending
            and USAGE_OBJECT.search(data) is None
            # A [DONE] anywhere in the piece (a comment may follow it in
            # the same read) is looked at as an event: see _watch.
            and not (completion and b"[DONE]" in data)
            and parser.skip_whole(data)
        ):
            # Whole events and no usage among them: nothing to read or
            # hide, so no event needs making.
            if completion:
                if not self.finished and _FINISHED.search(data) is not None:
                    self.finished = True
                if self.done and b"data" in data:
                    self.done = False
            self._base += len(data)
            return data
        events = parser.feed(data)
        if completion:
            self._watch(events)
        base = self._base
        strip = self._strip
        if not pending and events and events[-1].end == base + len(data):
            for event in events:
                found = usage_of(event.data)
                if found is not None:
                    self.usage = found[0]
                    if strip and found[1]:
                        break
            else:
                self._base += len(data)
                return data
        pending.extend(data)
        out: list[bytes] = []
        emit_from = 0
        event_start = 0
        for event in events:
            event_end = event.end - base
            found = usage_of(event.data)
            if found is not None:
                self.usage = found[0]
                if strip and found[1]:
                    if event_start > emit_from:
                        out.append(bytes(pending[emit_from:event_start]))
                    emit_from = event_end
            event_start = event_end
        if event_start > emit_from:
            out.append(bytes(pending[emit_from:event_start]))
        del pending[:event_start]
        self._base += event_start
        return b"".join(out)

    def end(self) -> bytes:
        """
        The stream ended.

        A chat or completions stream (C{completion}) ends with exactly one
        L{DONE}: the replica's own (also a last C{data: [DONE]} line whose
        blank line never came), or one added when the replica ended cleanly
        without it after a choice finished.  Its last event, when its blank
        line never came, is completed.

        @return: the bytes left to pass on: whole lines without the blank
            line after the last event are passed on as the engine sent
            them (completed with a blank line for a completion stream).
        @raise StreamCut: the stream ended inside a line (a body delimited
            by its connection's close looks complete however it ended), or a
            completion stream ended with no C{[DONE]} and no choice
            finished.
        """
        if self._completion:
            return self._end_completion()
        pending = self._pending
        if not pending:
            return b""
        if pending[-1] in (0x0A, 0x0D):  # LF, CR
            rest = bytes(pending)
            pending.clear()
            return rest
        raise StreamCut("The replica's stream ended in the middle of an event.")

    def _end_completion(self) -> bytes:
        pending = self._pending
        rest = b""
        if pending:
            in_line = pending[-1] not in (0x0A, 0x0D)  # LF, CR
            if self._parser.in_event:
                # The blank line that did not come, so the last event
                # dispatches: through feed, which reads its usage and
                # hides it as for any other event.
                rest = self.feed(b"\n" if pending[-1] == 0x0A else b"\n\n")
            if in_line and not self.done:
                raise StreamCut("The replica's stream ended in the middle of an event.")
            # Comments and blank lines after the last event.
            rest += bytes(pending)
            pending.clear()
        if self.done:
            return rest
        if self.finished:
            return rest + DONE
        raise StreamCut(
            "The replica's stream ended before its answer was complete"
            " (no finish_reason and no [DONE]).",
            rest,
        )
