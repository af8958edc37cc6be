"""
An incremental parser for server-sent events, sans-IO.

Bytes go in as they arrive, in pieces of any size: an event, a line, a
C{\\r\\n} pair or a UTF-8 character may be split anywhere.  Complete events come
out, each with the stream offset just past its end so that a caller relaying
the bytes can drop one event without re-buffering the others.

Line endings and fields follow the WHATWG HTML standard, section 9.2
("Server-sent events", "Interpreting an event stream"): lines end in CRLF, LF
or CR; a blank line dispatches the event; C{data} fields are joined with LF;
lines starting with a colon are comments.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

_LINE_END = re.compile(rb"\r\n|\r|\n")


class Event(NamedTuple):
    """
    One dispatched event (a tuple: one is made per chunk of every stream).

    @ivar event: the C{event} field, or L{None} for the default type.
    @ivar data: the C{data} fields joined by LF, as raw UTF-8 bytes.
    @ivar end: offset in the whole stream, in bytes, just past the blank line
        that dispatched this event.
    """

    event: bytes | None
    data: bytes
    end: int


class EventTooLarge(Exception):
    """
    An event grew past the parser's C{max_event_size} before it ended.
    """


class SSEParser:
    """
    Feed it bytes with L{feed}; it returns the events completed by them.

    @param max_event_size: bytes an event may grow to (its unfinished line
        and its data lines so far) before L{feed} raises L{EventTooLarge}:
        without a bound, a stream that never ends its line would grow
        without limit.
    """

    __slots__ = (
        "_partial",
        "_partial_size",
        "_offset",
        "_data",
        "_data_size",
        "_event",
        "_has_data",
        "_max",
    )

    def __init__(self, max_event_size: int = 16 * 1024 * 1024) -> None:
        # The unfinished line, in pieces: joined only once a line ending
        # arrives, so a long line costs linear time, not quadratic.
        self._partial: list[bytes] = []
        self._partial_size = 0
        self._offset = 0
        self._data: list[bytes] = []
        self._data_size = 0
        self._event: bytes | None = None
        self._has_data = False
        self._max = max_event_size

    @property
    def in_event(self) -> bool:
        """
        Whether bytes fed so far end inside an event (an unfinished line, or
        fields not yet dispatched).
        """
        return bool(self._partial) or self._has_data or self._event is not None

    def feed(self, chunk: bytes) -> list[Event]:
        """
        @param chunk: the next bytes of the stream, possibly empty.
        @return: the events whose blank line is complete with C{chunk}, in
            order.  A CR that ends the bytes so far waits for the next
            piece: it may be the first half of a CRLF, and an event's end
            offset must not depend on where the stream was cut.
        @raise EventTooLarge: the current event passed C{max_event_size}.
        """
        pieces = self._partial
        if self._is_whole(chunk):
            return self._whole_events(chunk)
        if (
            b"\n" not in chunk
            and b"\r" not in chunk[:-1]
            and not (pieces and pieces[-1][-1:] == b"\r")
        ):
            # No line ends here (a CR at the very end waits anyway).
            self._offset += len(chunk)
            if chunk:
                pieces.append(chunk)
                self._partial_size += len(chunk)
                self._check_size()
            return []
        partial = b"".join(pieces) if pieces else b""
        buffer = partial + chunk if partial else chunk
        # buffer[0] is at stream offset base.
        base = self._offset - len(partial)
        self._offset += len(chunk)
        limit = len(buffer)
        if limit and buffer[limit - 1] == 0x0D:
            limit -= 1
        events: list[Event] = []
        position = 0
        for match in _LINE_END.finditer(buffer, 0, limit):
            line = buffer[position : match.start()]
            position = match.end()
            if line:
                self._field(line)
            elif self._has_data:
                events.append(
                    Event(self._event, b"\n".join(self._data), base + position)
                )
                self._data = []
                self._data_size = 0
                self._event = None
                self._has_data = False
            else:
                self._event = None
        rest = buffer[position:]
        self._partial = [rest] if rest else []
        self._partial_size = len(rest)
        self._check_size()
        return events

    def _check_size(self) -> None:
        if self._data_size + self._partial_size > self._max:
            raise EventTooLarge(f"an event grew past max_event_size, {self._max} bytes")

    def _is_whole(self, chunk: bytes) -> bool:
        # Whole events with LF endings and one blank line between them,
        # starting where no event is under way: as engines write.
        return (
            not self._partial
            and not self._has_data
            and self._event is None
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
            and b"\n\n\n" not in chunk
        )

    def skip_whole(self, chunk: bytes) -> bool:
        """
        Account for C{chunk} without making its events, when it is made of
        whole events (LF line endings, as engines write them); for a caller
        that found by other means it needs none of them.

        @return: whether C{chunk} was taken; if not, pass it to L{feed}.
        """
        if not self._is_whole(chunk):
            return False
        self._offset += len(chunk)
        return True

    def _whole_events(self, chunk: bytes) -> list[Event]:
        # The common case, as engines write: whole events, LF endings, one
        # blank line between events.  Same result as the general path.
        events: list[Event] = []
        end = self._offset
        self._offset += len(chunk)
        for block in chunk[:-2].split(b"\n\n"):
            end += len(block) + 2
            if block[:6] == b"data: " and b"\n" not in block:
                events.append(Event(None, block[6:], end))
                continue
            for line in block.split(b"\n"):
                if line:
                    self._field(line)
            if self._has_data:
                events.append(Event(self._event, b"\n".join(self._data), end))
                self._data = []
                self._data_size = 0
                self._has_data = False
            self._event = None
        return events

    def _field(self, line: bytes) -> None:
        if line[0] == 0x3A:  # ":" starts a comment
            return
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
            self._data_size += len(value) + 1
            self._has_data = True
        elif name == b"event":
            self._event = value


_OBJECT_VALUE = re.compile(rb"\s*:\s*\{")
USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
"""
Finds a usage object in raw stream bytes, without parsing them.
"""


MAX_COUNT = 2**31 - 1
"""
The most tokens one request's count may say: far past any context length,
far below what the store's 64-bit integers and the sums of a key's usage
can hold.
"""


def engine_count(value: object) -> int | None:
    """
    @param value: a token count as an engine's usage object gave it.
    @return: it, when it is an integer from 0 to L{MAX_COUNT}; else
        L{None} (absent, or no count: negative, a float, a string, a
        boolean, 10**30).  A record with such a count is estimated as if
        none came: a broken engine must stop neither the counters nor the
        store's writes.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if 0 <= value <= MAX_COUNT:
            return value
    return None


def usage_of(data: bytes) -> tuple[dict[str, Any], bool] | None:
    """
    Read token usage from one event's data, when it carries any.

    Chunks of an OpenAI stream with C{include_usage} carry C{"usage": null},
    except the last, whose C{choices} is empty and whose C{usage} is an
    object (OpenAI API reference, C{stream_options}).  The JSON is parsed
    only when a usage object is present.

    @return: C{(usage, usage_only)}, C{usage_only} true when the event has no
        choices (the chunk added for usage alone), or L{None}.
    """
    at = data.find(b'"usage"')
    if at < 0 or _OBJECT_VALUE.match(data, at + 7) is None:
        return None
    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    if not isinstance(chunk, dict):
        return None
    usage = chunk.get("usage")
    if not isinstance(usage, dict):
        # The Responses API: the usage comes in the response.completed
        # event's response.
        response = chunk.get("response")
        if chunk.get("type") != "response.completed" or not isinstance(response, dict):
            return None
        usage = response.get("usage")
        if not isinstance(usage, dict):
            return None
        return usage, False
    return usage, chunk.get("choices") == []
