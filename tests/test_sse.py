"""
The incremental SSE parser and the usage reader.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.sse import Event, SSEParser, usage_of

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


class UsageTests(SynchronousTestCase):
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
