"""
End to end, the hostile-client suite over HTTP/1.1: slow headers (issue 13
case 6), an oversized request line and header (case 7), request smuggling,
a slow body, idle keep-alive connections and the connection caps, each
against a real C{twistd -n llmgw-server} while a well-behaved client keeps
being served.  Latencies are printed for the record and asserted loosely
(two shared cores).
"""

from __future__ import annotations

import re
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.edge_support import (
    P99_BOUND,
    EdgeServer,
    connect,
    parse_response,
    read_until_closed,
)

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"


class SlowClientTests(SynchronousTestCase, EdgeServer):
    """
    Clients that send too slowly are cut by a deadline, with an answer.
    """

    timeout = 60

    def test_header_lines_drip(self) -> None:
        """
        Issue 13 case 6: a client that sends one header line every 5 s
        (each line pushed Twisted's idle timeout back, so it kept the
        connection for ever) is answered 408 with an OpenAI error object
        once the default header deadline of 10 s from its first byte
        passes, then closed; a normal client is served meanwhile.
        """
        self.start_edge()
        sock = connect(self.port)
        self.addCleanup(sock.close)
        start = time.monotonic()
        sock.sendall(HEAD)
        data = b""
        closed = False
        lines = 0
        while time.monotonic() - start < 16 and not closed:
            self.normal.run(20, 1.0)
            chunk, _, closed = read_until_closed(sock, 4.0)
            data += chunk
            if not closed:
                lines += 1
                try:
                    sock.sendall(b"X-Drip-%d: 1\r\n" % lines)
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
        elapsed = time.monotonic() - start
        self.assertTrue(closed, f"still open after {elapsed:.1f}s")
        self.assertGreater(elapsed, 9.0)
        self.assertLess(elapsed, 14.0)
        status, headers, body = parse_response(data)
        self.assertEqual(status, 408)
        self.assertEqual(headers["content-type"], "application/json")
        self.assertEqual(body["error"]["code"], "header_timeout")
        self.assertLess(self.normal.p99(), P99_BOUND)
        self.note("slow header lines")

    def test_slow_body(self) -> None:
        """
        A body sent slower than C{min_body_rate} over a window is answered
        408 and closed; a normal client is served meanwhile.
        """
        self.start_edge('min_body_rate = "1KiB"\nbody_rate_window = "1s"')
        socks = []
        for _ in range(20):
            sock = connect(self.port)
            self.addCleanup(sock.close)
            sock.sendall(HEAD + b"Content-Length: 100000\r\n\r\n{")
            socks.append(sock)
        start = time.monotonic()
        self.normal.run(50, 1.0)
        for sock in socks:
            try:
                sock.sendall(b" " * 100)
            except (BrokenPipeError, ConnectionResetError):
                pass
        for sock in socks:
            data, _, closed = read_until_closed(sock, 5.0)
            self.assertTrue(closed)
            status, _, body = parse_response(data)
            self.assertEqual(status, 408)
            self.assertEqual(body["error"]["code"], "body_timeout")
        self.assertLess(time.monotonic() - start, 5.0)
        self.normal.run(10, 2.0)
        self.assertLess(self.normal.p99(), P99_BOUND)
        self.note("slow bodies")

    def test_idle_keepalive_closed(self) -> None:
        """
        A keep-alive connection idle for C{keepalive_timeout} after an
        answer, or one that never sends a byte, is closed without an answer.
        """
        self.start_edge('keepalive_timeout = "1s"')
        used = connect(self.port)
        self.addCleanup(used.close)
        silent = connect(self.port)
        self.addCleanup(silent.close)
        used.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        answer = used.recv(65536)
        self.assertTrue(answer.startswith(b"HTTP/1.1 200"), answer)
        for sock in (used, silent):
            data, elapsed, closed = read_until_closed(sock, 4.0)
            self.assertTrue(closed)
            self.assertEqual(data, b"")
            self.assertLess(elapsed, 3.0)


class OversizeTests(SynchronousTestCase, EdgeServer):
    """
    Requests too large or ambiguous to read get a clear error answer.
    """

    timeout = 60

    def setUp(self) -> None:
        self.start_edge()

    def exchange(self, request: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
        sock = connect(self.port)
        self.addCleanup(sock.close)
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _, closed = read_until_closed(sock, 5.0)
        self.assertTrue(closed)
        self.normal.request()
        return parse_response(data)

    def test_long_request_line(self) -> None:
        """
        Issue 13 case 7: a request line of 100 KB is answered 414 with an
        OpenAI error object (the connection was closed with no answer).
        """
        status, headers, body = self.exchange(
            b"GET /v1/models?" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        self.assertEqual(status, 414)
        self.assertEqual(headers["connection"], "close")
        self.assertEqual(body["error"]["code"], "uri_too_long")  # type: ignore[index]
        self.assertIn("16384", body["error"]["message"])  # type: ignore[index]

    def test_large_header(self) -> None:
        """
        Issue 13 case 7: a header of 200 KB, or many small ones over the
        total, is answered 431 with an OpenAI error object.
        """
        sock = connect(self.port)
        self.addCleanup(sock.close)
        try:
            sock.sendall(HEAD + b"X-Big: " + b"b" * 200_000 + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _, _ = read_until_closed(sock, 5.0)
        # RFC 6585's phrase (twisted.web's table has none: it was "Error").
        self.assertTrue(
            data.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            data[:80],
        )
        status, _, body = parse_response(data)
        self.assertEqual(status, 431)
        self.assertEqual(
            body["error"]["code"],
            "request_header_fields_too_large",
        )
        many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(400))
        status, _, _ = self.exchange(HEAD + many + b"\r\n")
        self.assertEqual(status, 431)

    def test_smuggling(self) -> None:
        """
        A request with both Content-Length and Transfer-Encoding, in either
        order, is refused 400 with an OpenAI error object and its body is
        never taken for a second request.
        """
        body = b'{"model": "sim-model", "messages": []}'
        smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        for framing in (
            b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(body),
            b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n" % len(body),
        ):
            status, _, error = self.exchange(
                HEAD + framing + b"\r\n0\r\n\r\n" + smuggled
            )
            self.assertEqual(status, 400)
            self.assertEqual(error["error"]["code"], "invalid_framing")  # type: ignore[index]


class ConnectionCapTests(SynchronousTestCase, EdgeServer):
    """
    The caps on open connections, globally and per client address.
    """

    timeout = 60

    def test_per_client_and_global_caps(self) -> None:
        """
        Past C{max_connections_per_client} from one address, new
        connections from it get 503 and are closed, while another address
        is served; past C{max_connections} every new one is; one log line
        says so per 10 s, not one per connection.
        """
        self.start_edge("max_connections = 60\nmax_connections_per_client = 40")
        held = []
        for _ in range(40):
            held.append(connect(self.port, "127.0.0.2"))
            self.addCleanup(held[-1].close)
        refused = []
        for _ in range(5):
            sock = connect(self.port, "127.0.0.2")
            self.addCleanup(sock.close)
            refused.append(sock)
        self.normal.run(20, 5.0)
        for sock in refused:
            data, _, closed = read_until_closed(sock, 5.0)
            self.assertTrue(closed)
            status, _, body = parse_response(data)
            self.assertEqual(status, 503)
            self.assertEqual(body["error"]["code"], "too_many_connections")
        for _ in range(19):
            held.append(connect(self.port, "127.0.0.3"))
            self.addCleanup(held[-1].close)
        # 40 + 19 + the normal client's: at the global cap.
        late = connect(self.port, "127.0.0.4")
        self.addCleanup(late.close)
        data, _, closed = read_until_closed(late, 5.0)
        self.assertTrue(closed)
        self.assertEqual(parse_response(data)[0], 503)
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 5
        while True:
            try:
                self.normal.close()
                self.normal._connection = None
                self.normal.request()
                break
            except (AssertionError, OSError):
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.1)
        lines = re.findall("connection cap reached", self.server.output())
        self.assertEqual(len(lines), 1, self.server.output()[-2000:])
