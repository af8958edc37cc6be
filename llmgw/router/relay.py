"""
The stream relay's filter, sans-IO: a replica's event stream in, the bytes to
pass to the client out, whole events only, with the usage read on the way and
the usage-only chunk left out when the client did not ask for it.
"""

from __future__ import annotations

from typing import Any

from llmgw.router.sse import USAGE_OBJECT, SSEParser, usage_of


class StreamCut(Exception):
    """
    The stream ended inside a line: its last event is not whole.
    """


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
    @ivar usage: the last usage object found in the stream, or L{None}.
    """

    __slots__ = ("_parser", "_strip", "_pending", "_base", "usage")

    def __init__(self, max_event_size: int, strip: bool) -> None:
        self._parser = SSEParser(max_event_size)
        self._strip = strip
        # The bytes of events not yet whole, from stream offset _base.
        self._pending = bytearray()
        self._base = 0
        self.usage: dict[str, Any] | None = None

    def feed(self, data: bytes) -> bytes:
        """
        @param data: the next bytes of the stream.
        @return: the bytes to pass on now, possibly empty; C{data} itself
            when it is passed on whole.
        @raise llmgw.router.sse.EventTooLarge: an event passed
            C{max_event_size}.
        """
        pending = self._pending
        parser = self._parser
        if (
            not pending
            and USAGE_OBJECT.search(data) is None
            and parser.skip_whole(data)
        ):
            # Whole events and no usage among them: nothing to read or
            # hide, so no event needs making.
            self._base += len(data)
            return data
        events = parser.feed(data)
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

        @return: the bytes left to pass on: whole lines without the blank
            line after the last event are passed on as the engine sent
            them.
        @raise StreamCut: the stream ended inside a line (a body delimited
            by its connection's close looks complete however it ended).
        """
        pending = self._pending
        if not pending:
            return b""
        if pending[-1] in (0x0A, 0x0D):  # LF, CR
            rest = bytes(pending)
            pending.clear()
            return rest
        raise StreamCut("The replica's stream ended in the middle of an event.")
