"""
The incremental SSE parser and the usage reader.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.upstream.sse import Event, SSEParser, usage_of

STREAM = (
    'data: {"choices":[{"delta":{"content":'
    '"caf\u00e9 \u65e5\u672c\u8a9e \U0001f642"}}],"usage":null}\n\n'
    ": keep-alive comment\n\n"
    "event: message\r\n"
    'data: {"choices":[{"delta":{"content":"two"}}]}\r\n'
    "data: second line\r\n\r\n"
    'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\r\r'
    "data: [DONE]\n\n"
).encode("utf-8")

# As engines write it: LF only, mostly one data line per event.
STREAM_LF = (
    b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
    b": comment\n\n"
    b"event: message\ndata: one\ndata: two\n\n"
    b"data: \xe6\x97\xa5\n\n"
    b"id: 7\n\n"
    b"data:no-space\n\n\n"
    b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)


def feed_all(pieces: list[bytes]) -> list[Event]:
    parser = SSEParser()
    events: list[Event] = []
    for piece in pieces:
        events.extend(parser.feed(piece))
    return events


class SSEParserTests(SynchronousTestCase):
    def test_whole(self) -> None:
        """
        Events are dispatched at blank lines with any line ending; comments
        and empty events dispatch nothing; data lines join with LF.
        """
        events = feed_all([STREAM])
        self.assertEqual(len(events), 4)
        self.assertEqual(events[1].event, b"message")
        self.assertEqual(
            events[1].data, b'{"choices":[{"delta":{"content":"two"}}]}\nsecond line'
        )
        self.assertEqual(events[3].data, b"[DONE]")
        self.assertEqual(events[3].end, len(STREAM))
        self.assertEqual(
            json.loads(events[0].data)["choices"][0]["delta"]["content"],
            "caf\u00e9 \u65e5\u672c\u8a9e \U0001f642",
        )

    def test_one_byte_at_a_time(self) -> None:
        """
        Fed one byte at a time, through CRLF pairs and multi-byte characters,
        the parser gives the same events with the same end offsets.
        """
        self.assertEqual(
            feed_all([STREAM[i : i + 1] for i in range(len(STREAM))]),
            feed_all([STREAM]),
        )

    def test_end_offsets_delimit_events(self) -> None:
        """
        Each event's end offset is just past its blank line, so the bytes
        between two ends are exactly one event.
        """
        events = feed_all([STREAM])
        self.assertTrue(STREAM[: events[0].end].endswith(b"\n\n"))
        self.assertTrue(
            STREAM[events[2].end : events[3].end].startswith(b"data: [DONE]")
        )

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=40))
    def test_any_split(self, cuts: list[int]) -> None:
        """
        However the stream is cut, the events are the same.
        """
        points = sorted(set(cuts))
        pieces = [
            STREAM[a:b]
            for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)
        ]
        self.assertEqual(feed_all(pieces), feed_all([STREAM]))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(min_value=0, max_value=len(STREAM_LF)), max_size=12))
    def test_any_split_lf(self, cuts: list[int]) -> None:
        """
        An LF-only stream, where whole-event pieces take the fast path, gives
        the same events however it is cut, and the expected ones.
        """
        points = sorted(set(cuts))
        pieces = [
            STREAM_LF[a:b]
            for a, b in zip([0, *points], [*points, len(STREAM_LF)], strict=True)
        ]
        events = feed_all(pieces)
        self.assertEqual(events, feed_all([STREAM_LF]))
        self.assertEqual(
            [(e.event, e.data) for e in events],
            [
                (None, b'{"choices":[{"delta":{"content":"a"}}],"usage":null}'),
                (b"message", b"one\ntwo"),
                (None, "\u65e5".encode()),
                (None, b"no-space"),
                (None, b'{"choices":[],"usage":{"prompt_tokens":1}}'),
                (None, b"[DONE]"),
            ],
        )
        self.assertEqual(events[-1].end, len(STREAM_LF))


class UsageTests(SynchronousTestCase):
    def test_responses_completed(self) -> None:
        """
        The Responses API's usage, in its response.completed event, is
        found (and is not a usage-only chunk to hide).
        """
        event = json.dumps(
            {
                "type": "response.completed",
                "response": {"usage": {"input_tokens": 9, "output_tokens": 4}},
            }
        ).encode()
        self.assertEqual(
            usage_of(event), ({"input_tokens": 9, "output_tokens": 4}, False)
        )
        other = b'{"type": "response.output_text.delta", "response": {"usage": {}}}'
        self.assertIsNone(usage_of(other))

    def test_usage_only_chunk(self) -> None:
        """
        The chunk with empty choices and a usage object is recognized.
        """
        self.assertEqual(
            usage_of(
                b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
            ),
            ({"prompt_tokens": 3, "completion_tokens": 2}, True),
        )

    def test_usage_with_choices(self) -> None:
        """
        Usage on a chunk that also has choices is read but not usage-only.
        """
        found = usage_of(b'{"choices":[{"delta":{}}], "usage" : {"prompt_tokens":1}}')
        self.assertEqual(found, ({"prompt_tokens": 1}, False))

    def test_no_usage(self) -> None:
        """
        Null usage, no usage, text mentioning usage, and bad JSON read as
        nothing.
        """
        for data in (
            b'{"choices":[{"delta":{"content":"x"}}],"usage":null}',
            b'{"choices":[]}',
            b'{"choices":[{"delta":{"content":"\\"usage\\": {"}}]}',
            b"[DONE]",
            b'{"usage": {',
        ):
            self.assertIsNone(usage_of(data), data)


class LimitTests(SynchronousTestCase):
    def test_long_line_linear(self) -> None:
        """
        A line fed in many pieces is joined once, when it ends: 20 MiB in
        64 KiB pieces parses in well under a second (it took seconds per
        megabyte when every piece re-scanned the line so far).
        """
        import time

        parser = SSEParser(max_event_size=64 * 1024 * 1024)
        piece = b"x" * 65536
        started = time.monotonic()
        self.assertEqual(parser.feed(b"data: "), [])
        for _ in range(320):
            self.assertEqual(parser.feed(piece), [])
        events = parser.feed(b"\n\n")
        self.assertLess(time.monotonic() - started, 5)
        self.assertEqual(len(events[0].data), 320 * 65536)

    def test_event_too_large(self) -> None:
        """
        An event that grows past max_event_size, by one long line or by
        many data lines, raises EventTooLarge.
        """
        from llmgw.router.upstream.sse import EventTooLarge

        parser = SSEParser(max_event_size=1000)
        parser.feed(b"data: " + b"x" * 900)
        self.assertRaises(EventTooLarge, parser.feed, b"y" * 200)
        parser = SSEParser(max_event_size=1000)
        with self.assertRaises(EventTooLarge):
            for _ in range(20):
                parser.feed(b"data: " + b"z" * 90 + b"\n")

    def test_in_event(self) -> None:
        """
        in_event tells whether the bytes so far stop inside an event.
        """
        parser = SSEParser()
        self.assertFalse(parser.in_event)
        parser.feed(b'data: {"a":')
        self.assertTrue(parser.in_event)
        parser.feed(b"1}\n")
        self.assertTrue(parser.in_event)
        parser.feed(b"\n")
        self.assertFalse(parser.in_event)
