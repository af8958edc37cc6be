"""
L{llmgw.router.upstream.response_parser} cross-checked against h11 (python-hyper)
as a differential oracle: on generated valid answers, on mutations that
both must refuse, and on random bytes inserted anywhere, the two agree but
where the lists below say why they do not.
"""

from __future__ import annotations

import re

import h11
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from tests.test_response_parser import CHUNKED_HEAD, parse, valid_answers


def h11_outcome(data: bytes) -> tuple[str, int, bytes] | str:
    """
    @return: C{("ok", status, body)} as h11 reads C{data} (the connection
        closed after it), or C{"error"}.
    """
    client = h11.Connection(h11.CLIENT)
    client.send(
        h11.Request(
            method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]
        )
    )
    client.send(h11.EndOfMessage())
    client.receive_data(data)
    client.receive_data(b"")
    status = 0
    body = b""
    try:
        while True:
            event = client.next_event()
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return ("ok", status, body)
            elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return "error"
    except h11.RemoteProtocolError:
        return "error"


def ours(data: bytes) -> tuple[str, int, bytes] | str:
    found = parse([data])
    if found.error is not None or found.end is None:
        return "error"
    assert found.head is not None
    return ("ok", found.head.status, found.body)


# Where llmgw's parser is deliberately stricter than h11, each a mutation
# of a valid answer that h11 accepts and llmgw refuses, and why.
STRICTER_THAN_H11: list[tuple[bytes, bytes, str]] = [
    (b" 200 ", b" 600 ", "status codes above 599 (RFC 9110 section 15)"),
    (b"HTTP/1.1 ", b"HTTP/2.0 ", "an HTTP/2 status line on an HTTP/1 connection"),
    (b"Reason phrase", b"Reason\x01phrase", "a control byte in the reason phrase"),
    (b"Reason phrase", b"Reason\x7fphrase", "DEL in the reason phrase"),
    (
        b"Reason phrase\r\n",
        b"Reason phrase\r\nX-A: \x01\r\n",
        "a control byte in a field value (RFC 9110 5.5)",
    ),
    (b"HTTP/1.1 ", b"HTTP/1.0 ", "Transfer-Encoding in HTTP/1.0 (RFC 9112 6.1)"),
    (b"\r\n0\r\n", b"\r\n0 \r\n", "whitespace after a chunk size with no extension"),
    (b"\r\n0\r\n", b"\r\n0;\x01\r\n", "a chunk extension outside the grammar"),
]

# Where it is looser than h11, and why.
LOOSER_THAN_H11: list[tuple[bytes, bytes, str]] = [
    (b"\r\n0\r\n", b"\r\n0 ;a\r\n", "whitespace before ';' is BWS (RFC 9112 7.1.1)"),
    (b"chunked", b"gzip, chunked", "codings before chunked, left to the reader"),
]

# Mutations of valid answers that both must refuse.
INVALID_MUTATIONS: list[tuple[bytes, bytes]] = [
    (b"\r\n0\r\n", b"XY0\r\n"),
    (b"\r\n0\r\n", b"\n0\r\n"),
    (b"\r\n0\r\n", b"\r\n0x0\r\n"),
    (b"\r\n0\r\n", b"\r\n+0\r\n"),
    (b"\r\n0\r\n", b"\r\n0\n\r\n"),
    (b"Content-Length: ", b"Content-Length: -"),
    (b"Content-Length: ", b"Content-Length: +"),
    (b"Content-Length: ", b"Content-Length: 1_"),
    (b"Content-Length: ", b"Content-Length: 99, "),
    (b" 200 ", b" 101 "),
    (b" 200 ", b" 099 "),
    (b" 200 ", b" 2O0 "),
    (b"Transfer-Encoding", b"Transfer Encoding"),
    (b"Transfer-Encoding", b"Transfer-Encoding "),
    (b"Content-Length", b"Content\x00Length"),
    (b"HTTP/1.1 200", b"\r\nHTTP/1.1 200"),
]


class H11OracleTests(SynchronousTestCase):
    """
    h11 0.16 as the reference: on generated valid answers and on
    mutations of them, llmgw's parser and h11 agree on refusing, or on the
    status and body, but where a list above says why they do not.
    """

    @settings(max_examples=300)
    @given(valid_answers())
    def test_valid_agree(self, answer: tuple[bytes, int, bytes]) -> None:
        data, status, body = answer
        self.assertEqual(ours(data), ("ok", status, body))
        self.assertEqual(h11_outcome(data), ("ok", status, body))

    @settings(max_examples=300)
    @given(valid_answers(), st.sampled_from(INVALID_MUTATIONS))
    def test_invalid_agree(
        self, answer: tuple[bytes, int, bytes], mutation: tuple[bytes, bytes]
    ) -> None:
        data, _, _ = answer
        old, new = mutation
        if old not in data:
            return
        mutated = data.replace(old, new, 1)
        self.assertEqual(ours(mutated), h11_outcome(mutated), mutated)

    @settings(max_examples=200)
    @given(valid_answers(), st.binary(min_size=1, max_size=3), st.integers(0, 400))
    def test_random_bytes_agree(
        self, answer: tuple[bytes, int, bytes], junk: bytes, at: int
    ) -> None:
        """
        Bytes inserted anywhere: both refuse, or both read the same status
        and body, except where the lists above say the parsers differ.
        """
        data, _, _ = answer
        at = min(at, len(data))
        mutated = data[:at] + junk + data[at:]
        mine, theirs = ours(mutated), h11_outcome(mutated)
        if mine == theirs:
            return
        for _, new, _ in STRICTER_THAN_H11 + LOOSER_THAN_H11:
            if new.strip(b"\r\n") in mutated:
                return
        known = _known_difference(mutated)
        self.assertTrue(known, (mutated, mine, theirs))

    def test_stricter_and_looser_than_h11(self) -> None:
        """
        Each listed difference holds as listed.
        """
        base = (
            b"HTTP/1.1 200 Reason phrase\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\nok\r\n0\r\n\r\n"
        )
        for old, new, why in STRICTER_THAN_H11:
            mutated = base.replace(old, new, 1)
            self.assertEqual(ours(mutated), "error", why)
            self.assertNotEqual(h11_outcome(mutated), "error", why)
        for old, new, why in LOOSER_THAN_H11:
            mutated = base.replace(old, new, 1)
            self.assertNotEqual(ours(mutated), "error", why)
            self.assertEqual(h11_outcome(mutated), "error", why)


def _known_difference(data: bytes) -> bool:
    """
    @return: whether C{data} shows a difference the lists above name, as
        found in random insertions (a CTL in the reason phrase or in a field
        value; a bare CR
        that h11 reads as part of a value at the end of a line; a digit
        that makes a status over 599, or HTTP/1.x with x other than 1).
    """
    head = data.split(b"\r\n\r\n", 1)[0].split(b"\n")
    for line in head[1:]:
        name, _, value = line.partition(b":")
        if any((c < 0x20 and c != 0x09) or c == 0x7F for c in value.rstrip(b"\r")):
            return True  # STRICTER_THAN_H11: a CTL in a field value
        if name.lower() == b"transfer-encoding" and value.strip().lower() != b"chunked":
            return True  # LOOSER_THAN_H11: other codings, read until close
    for line in re.split(rb"\r?\n", data):
        if re.fullmatch(rb"[0-9A-Fa-f]{1,20}(?:;.*|[ \t]+)", line, re.S) and (
            "not a chunk size" in (parse([CHUNKED_HEAD + line + b"\r\n"]).error or "")
        ):
            return True  # STRICTER_THAN_H11: a chunk line outside the grammar
    status_line = head[0]
    if any((c < 0x20 and c != 0x09) or c == 0x7F for c in status_line.rstrip(b"\r")):
        return True
    if status_line[:8] != b"HTTP/1.1":
        return True
    parts = status_line.split(b" ")
    return len(parts) > 1 and parts[1].isdigit() and int(parts[1]) > 599
