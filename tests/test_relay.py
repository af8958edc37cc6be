"""
The stream relay's usage filter, fed whole, chunk by chunk and one byte at a
time.
"""

from __future__ import annotations

import re

from hypothesis import example, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.upstream.relay import StreamCut, UsageFilter
from llmgw.router.upstream.sse import EventTooLarge

COMMENT = b": c\n\n"
CHUNK = b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
USAGE_ONLY = (
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
)
DONE = b"data: [DONE]\n\n"
STREAM = CHUNK + CHUNK + USAGE_ONLY + DONE
# Odd line endings and comments: the general path.
MIXED = (
    b": comment\r\n\r\n"
    + CHUNK.replace(b"\n", b"\r\n")
    + USAGE_ONLY.replace(b"\n\n", b"\r\r")
    + DONE
)
MIXED_STRIPPED = b": comment\r\n\r\n" + CHUNK.replace(b"\n", b"\r\n") + DONE


def relay(pieces: list[bytes], strip: bool) -> tuple[bytes, UsageFilter]:
    usage_filter = UsageFilter(1024 * 1024, strip)
    out = b"".join(usage_filter.feed(piece) for piece in pieces)
    return out + usage_filter.end(), usage_filter


def cuttings(stream: bytes) -> dict[str, list[bytes]]:
    """
    @return: C{stream} cut whole, one byte at a time, in pieces of 7
        bytes, and after each blank line (as engines write).
    """
    parts = stream.split(b"\n\n")
    events = [part + b"\n\n" for part in parts[:-1]] + [parts[-1]]
    return {
        "whole": [stream],
        "bytes": [stream[i : i + 1] for i in range(len(stream))],
        "sevens": [stream[i : i + 7] for i in range(0, len(stream), 7)],
        "events": events,
    }


class UsageFilterTests(SynchronousTestCase):
    def test_strip(self) -> None:
        """
        With strip on, the usage-only chunk is left out and its usage kept,
        however the stream is cut.
        """
        for stream, expected in (
            (STREAM, CHUNK + CHUNK + DONE),
            (MIXED, MIXED_STRIPPED),
        ):
            for how, pieces in cuttings(stream).items():
                out, usage_filter = relay(pieces, strip=True)
                self.assertEqual(out, expected, how)
                self.assertEqual(
                    usage_filter.usage,
                    {"prompt_tokens": 3, "completion_tokens": 2},
                    how,
                )

    def test_keep(self) -> None:
        """
        With strip off, every byte passes, and the usage is read.
        """
        for stream in (STREAM, MIXED):
            for how, pieces in cuttings(stream).items():
                out, usage_filter = relay(pieces, strip=False)
                self.assertEqual(out, stream, how)
                self.assertEqual(
                    usage_filter.usage, {"prompt_tokens": 3, "completion_tokens": 2}
                )

    def test_whole_events_only(self) -> None:
        """
        Bytes of an event come out only once the event is whole.
        """
        usage_filter = UsageFilter(1024, strip=True)
        self.assertEqual(usage_filter.feed(CHUNK[:10]), b"")
        self.assertEqual(usage_filter.feed(CHUNK[10:] + CHUNK[:5]), CHUNK)
        self.assertEqual(usage_filter.feed(CHUNK[5:]), CHUNK)

    def test_fast_path_no_copy(self) -> None:
        """
        A piece of whole events without usage comes out as the same object;
        one with a usage object that stays comes out whole too.
        """
        usage_filter = UsageFilter(1024, strip=True)
        piece = CHUNK + CHUNK
        self.assertIs(usage_filter.feed(piece), piece)
        kept = UsageFilter(1024, strip=False)
        piece = CHUNK + USAGE_ONLY
        self.assertIs(kept.feed(piece), piece)
        self.assertIsNotNone(kept.usage)

    def test_usage_in_chunk_with_choices(self) -> None:
        """
        A usage object on a chunk with choices is read and the chunk kept.
        """
        chunk = b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":1}}\n\n'
        for how, pieces in cuttings(chunk + DONE).items():
            out, usage_filter = relay(pieces, strip=True)
            self.assertEqual(out, chunk + DONE, how)
            self.assertEqual(usage_filter.usage, {"prompt_tokens": 1})

    def test_end_whole_lines(self) -> None:
        """
        A stream that ends after whole lines, without the blank line, passes
        them on at the end.
        """
        usage_filter = UsageFilter(1024, strip=False)
        self.assertEqual(usage_filter.feed(CHUNK + b"data: x\n"), CHUNK)
        self.assertEqual(usage_filter.end(), b"data: x\n")
        self.assertEqual(usage_filter.end(), b"")

    def test_end_cut(self) -> None:
        """
        A stream that ends inside a line is cut: L{UsageFilter.end} raises,
        and what came before the event passed.
        """
        for how, pieces in cuttings(CHUNK + b'data: {"cho').items():
            usage_filter = UsageFilter(1024, strip=False)
            out = b"".join(usage_filter.feed(piece) for piece in pieces)
            self.assertEqual(out, CHUNK, how)
            self.assertRaises(StreamCut, usage_filter.end)

    def test_event_too_large(self) -> None:
        """
        An event past the limit raises the parser's L{EventTooLarge}.
        """
        usage_filter = UsageFilter(100, strip=False)
        self.assertRaises(EventTooLarge, usage_filter.feed, b"data: " + b"x" * 200)


FINISH = b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"usage":null}\n\n'


def relay_completion(pieces: list[bytes], strip: bool) -> bytes | StreamCut:
    usage_filter = UsageFilter(1024 * 1024, strip, completion=True)
    out = b"".join(usage_filter.feed(piece) for piece in pieces)
    try:
        return out + usage_filter.end()
    except StreamCut as cut:
        return cut


class CompletionEndTests(SynchronousTestCase):
    def test_endings(self) -> None:
        """
        A chat or completions stream ends with exactly one C{[DONE]}: the
        replica's own, one whose blank line never came, or one added after
        a clean end once a choice finished; a stream cut inside a line or
        ended before any choice finished ends with L{StreamCut}, after the
        whole events.  However the stream is cut into pieces.
        """
        cut_mid = "The replica's stream ended in the middle of an event."
        unfinished = "The replica's stream ended before its answer was complete"
        table: list[tuple[bytes, bool, bytes | tuple[str, bytes]]] = [
            # stream, strip, what the client gets (or the cut: message, rest)
            (CHUNK + FINISH + DONE, False, CHUNK + FINISH + DONE),
            (CHUNK + FINISH, False, CHUNK + FINISH + DONE),
            (CHUNK + FINISH + b"data: [DONE]", False, CHUNK + FINISH + DONE),
            (CHUNK + FINISH + b"data: [DONE]\n", False, CHUNK + FINISH + DONE),
            (
                CHUNK + FINISH + b"data:[DONE]\r",
                False,
                CHUNK + FINISH + b"data:[DONE]\r\n\n",
            ),
            (CHUNK + FINISH + USAGE_ONLY, True, CHUNK + FINISH + DONE),
            (CHUNK + FINISH + USAGE_ONLY[:-1], True, CHUNK + FINISH + DONE),
            (CHUNK + FINISH + USAGE_ONLY, False, CHUNK + FINISH + USAGE_ONLY + DONE),
            (CHUNK + FINISH[:-1], False, CHUNK + FINISH + DONE),
            (
                CHUNK + FINISH + b": bye\n\n",
                False,
                CHUNK + FINISH + b": bye\n\n" + DONE,
            ),
            (CHUNK + DONE, False, CHUNK + DONE),
            # A comment after [DONE], in the same piece or not: still one.
            (
                CHUNK + FINISH + DONE + b": bye\n\n",
                False,
                CHUNK + FINISH + DONE + b": bye\n\n",
            ),
            (CHUNK + DONE + b": bye\n\n", False, CHUNK + DONE + b": bye\n\n"),
            (CHUNK + FINISH + b'data: {"cho', False, (cut_mid, b"")),
            (CHUNK + b"data: [DON", False, (cut_mid, b"")),
            (CHUNK + CHUNK, False, (unfinished, b"")),
            (CHUNK + CHUNK[:-1], False, (unfinished, CHUNK)),
            # Generated text that reads like an ending is not one.
            (
                b'data: {"choices":[{"delta":{"content":"\\"finish_reason\\":\\"x'
                b' data: [DONE]"}}]}\n\n',
                False,
                (unfinished, b""),
            ),
        ]
        for stream, strip, expected in table:
            for how, pieces in cuttings(stream).items():
                got = relay_completion(pieces, strip)
                if isinstance(expected, bytes):
                    self.assertEqual(got, expected, (stream, how))
                else:
                    assert isinstance(got, StreamCut), (stream, how, got)
                    self.assertTrue(str(got).startswith(expected[0]), (stream, got))
                    self.assertEqual(got.rest, expected[1], (stream, how))

    def test_usage_of_last_event(self) -> None:
        """
        The usage of a last event whose blank line never came is read.
        """
        usage_filter = UsageFilter(1024, strip=True, completion=True)
        usage_filter.feed(FINISH + USAGE_ONLY[:-1])
        self.assertEqual(usage_filter.end(), DONE)
        self.assertEqual(
            usage_filter.usage, {"prompt_tokens": 3, "completion_tokens": 2}
        )


class UsageFilterPropertyTests(SynchronousTestCase):
    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(st.sampled_from([CHUNK, USAGE_ONLY, DONE, COMMENT]), max_size=8),
        st.lists(st.integers(min_value=0, max_value=400), max_size=10),
        st.booleans(),
    )
    # Found by this test in a full run: comments that end one read, the
    # stripped chunk in the next.
    @example([CHUNK, COMMENT, USAGE_ONLY], [len(CHUNK + COMMENT)], True)
    def test_cut_anywhere(
        self, events: list[bytes], cuts: list[int], strip: bool
    ) -> None:
        """
        However a stream of whole events is cut, the events passed on and
        the usage found are those of the whole stream fed at once.  Only
        comments may differ when stripping: those since the event before a
        usage-only chunk are left out with it when they come in the same
        read, and passed on when a read ended with them (the filter passes
        a read of whole events on at once).
        """
        stream = b"".join(events)
        points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
        pieces = [stream[a:b] for a, b in zip(points, points[1:], strict=False)]
        cut, cut_filter = relay(pieces, strip)
        whole, whole_filter = relay([stream], strip)
        self.assertEqual(cut_filter.usage, whole_filter.usage)
        if not strip:
            self.assertEqual((cut, whole), (stream, stream))
            return
        left_out = re.compile(
            rb"(?:" + re.escape(COMMENT) + rb")*" + re.escape(USAGE_ONLY)
        )
        self.assertEqual(whole, left_out.sub(b"", stream))
        self.assertEqual(cut.replace(COMMENT, b""), whole.replace(COMMENT, b""))
