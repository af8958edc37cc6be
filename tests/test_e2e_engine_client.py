"""
End to end: the router's engine client (L{llmgw.router.upstream.engine_client},
L{llmgw.router.upstream.http1}) as C{twistd -n llmgw-server} wires it, in front of
L{RawEngine}, an engine written on raw sockets that answers exact bytes,
talked to with the official C{openai} client.  What held when tried this
way (chunks split at every byte or many per read, chunk extensions and
trailers, a head split across reads, Content-Length with chunked,
Connection: close, HTTP/1.0, 1xx before the answer, junk after an answer,
a 200 head then nothing, resets mid-stream, a slow reader, 48 streams at
once with some cut) has no test here; what broke has one.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import Process, Processes
from tests.test_e2e_router import MESSAGES, client, stream_text

CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
)
FINISH = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
)
WHOLE = json.dumps(
    {
        "id": "w",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "whole"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
).encode()


def chunked_stream(events: int = 3) -> bytes:
    """
    @return: a 200 answer with an SSE stream of C{events} content events,
        a finish event and C{[DONE]}, chunked, one event per chunk.
    """
    pieces = [CHUNK] * events + [FINISH, b"data: [DONE]\n\n"]
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
        + b"0\r\n\r\n"
    )


def whole_answer() -> bytes:
    """
    @return: a 200 chat completion with a C{Content-Length}.
    """
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(WHOLE), WHOLE)
    )


Answer = Callable[[socket.socket, dict[str, Any]], bool]
"""
Writes an answer to a request (its JSON body given) on the engine's side
of a connection; returns whether the engine keeps the connection.
"""


def answer_ok(conn: socket.socket, request: dict[str, Any]) -> bool:
    time.sleep(min(float(request.get("delay", 0)), 5.0))
    conn.sendall(chunked_stream() if request.get("stream") else whole_answer())
    return True


class RawEngine:
    """
    An engine on 127.0.0.1 that reads HTTP/1.1 requests and answers each
    POST with C{answer} (C{GET}s, the router's C{/metrics} reads, get an
    empty 404).

    @ivar close_kept: when set, a connection that already served a request
        is closed as the next request arrives on it, unanswered: what the
        router sees when it sends on a kept connection the engine has just
        closed for its idleness (the race every keep-alive client meets).
    @ivar requests: the POST bodies received, including unanswered ones.
    @ivar connections: the connections accepted.
    """

    def __init__(self, answer: Answer = answer_ok) -> None:
        self.answer = answer
        self.close_kept = False
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self._stopped = False
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        self._listener.close()
        with self._lock:
            for conn in self._open:
                try:
                    conn.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            with self._lock:
                self.connections += 1
                self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _read_request(self, conn: socket.socket, buffer: bytes) -> tuple[bytes, bytes]:
        """
        @return: the head and body of the next request, and the bytes
            after it; empty when the connection closed first.
        """
        while b"\r\n\r\n" not in buffer:
            data = conn.recv(65536)
            if not data:
                return b"", b""
            buffer += data
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(buffer) < length:
            data = conn.recv(65536)
            if not data:
                return b"", b""
            buffer += data
        return head + b"\r\n\r\n" + buffer[:length], buffer[length:]

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        buffer = b""
        served = 0
        try:
            for _ in range(10_000):
                request, buffer = self._read_request(conn, buffer)
                if not request or self._stopped:
                    return
                head, _, body = request.partition(b"\r\n\r\n")
                if head.startswith(b"GET "):
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                parsed = json.loads(body)
                with self._lock:
                    self.requests.append(parsed)
                if served and self.close_kept:
                    return
                served += 1
                if not self.answer(conn, parsed):
                    return
        except OSError:
            return
        finally:
            conn.close()


class EngineClientTestCase(SynchronousTestCase, Processes):
    """
    C{twistd -n llmgw-server} with one replica, C{fake}, serving model
    C{m}: a L{RawEngine}.
    """

    timeout = 60
    answer: Answer = staticmethod(answer_ok)

    def setUp(self) -> None:
        self.engine = RawEngine(self.answer)
        self.addCleanup(self.engine.stop)
        self.server, self.url, _ = self.start_server(
            "--endpoint",
            f"fake={self.engine.url}=m",
            config='[router]\nfirst_byte_timeout = "5s"\nidle_timeout = "5s"\n',
        )
        self.gateway = client(self.url)

    def ask(self, rid: str, **extra: Any) -> Any:
        return self.gateway.chat.completions.create(
            model="m",
            messages=MESSAGES,
            extra_body=extra,
            extra_headers={"X-Request-ID": rid},
        )

    def ask_stream(self, rid: str, **extra: Any) -> str:
        text, _ = stream_text(
            self.gateway.chat.completions.create(
                model="m",
                messages=MESSAGES,
                stream=True,
                extra_body=extra,
                extra_headers={"X-Request-ID": rid},
            )
        )
        return text

    def record(self, rid: str) -> str:
        """
        @return: the status of request C{rid}'s usage record, from the
            server's log line.
        """
        line = self.server.wait_for(
            rf"request \S+ client_id={rid} .* status=(\d+)", timeout=10
        )
        return line.group(1)

    def assert_no_traceback(self, process: Process) -> None:
        self.assertNotIn("Traceback", process.output())


class KeptConnectionClosedTests(EngineClientTestCase):
    """
    The engine closes a kept connection just as the router sends a request
    on it (uvicorn closes idle connections after 5 s, the engine here after
    any answer): the router retries once and the client loses nothing, also
    when the replica is the model's only one.
    """

    def test_only_replica_whole(self) -> None:
        """
        A whole answer: the request is sent again, on a new connection, and
        answered; its record says 200.
        """
        self.assertEqual(self.ask("warm").choices[0].message.content, "whole")
        self.engine.close_kept = True
        self.assertEqual(self.ask("kept").choices[0].message.content, "whole")
        self.assertEqual(self.record("kept"), "200")
        self.assertEqual(len(self.engine.requests), 3)
        self.assert_no_traceback(self.server)

    def test_only_replica_stream(self) -> None:
        """
        A stream: the same, and the client gets every event.
        """
        self.assertEqual(self.ask_stream("warm"), "okokok")
        self.engine.close_kept = True
        self.assertEqual(self.ask_stream("kept"), "okokok")
        self.assertEqual(self.record("kept"), "200")
        self.assert_no_traceback(self.server)

    def test_every_kept_connection_closed(self) -> None:
        """
        Several kept connections, all closed by the engine: the retry goes
        on a new connection, not on another kept one (which would fail the
        same way and get the replica ejected).
        """
        threads = [
            threading.Thread(
                target=self.ask, args=(f"warm-{i}",), kwargs={"delay": 0.3}
            )
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        self.assertGreater(self.engine.connections, 1)
        self.engine.close_kept = True
        self.assertEqual(self.ask("kept").choices[0].message.content, "whole")
        self.assertEqual(self.record("kept"), "200")
        # Not ejected: the next request is answered too.
        self.engine.close_kept = False
        self.assertEqual(self.ask("after").choices[0].message.content, "whole")
        self.assert_no_traceback(self.server)


def answer_late_end(conn: socket.socket, request: dict[str, Any]) -> bool:
    """
    A stream whose last chunk, the empty one that ends the body, comes
    50 ms after C{[DONE]}: uvicorn writes it apart from the last event.
    """
    answer = chunked_stream()
    conn.sendall(answer[: -len(b"0\r\n\r\n")])
    time.sleep(0.05)
    conn.sendall(b"0\r\n\r\n")
    return True


class LeftAfterDoneTests(EngineClientTestCase):
    """
    The official client closes its connection once it reads C{[DONE]}
    (C{openai._streaming.Stream}), often before the engine's body ended.
    """

    answer = staticmethod(answer_late_end)

    def test_record_says_200(self) -> None:
        """
        The client had the whole stream: its record says 200, not 499
        (client closed request), and the usage counted is the stream's.
        """
        for i in range(3):
            self.assertEqual(self.ask_stream(f"done-{i}"), "okokok")
        for i in range(3):
            self.assertEqual(self.record(f"done-{i}"), "200")
        self.assert_no_traceback(self.server)


def answer_invalid(conn: socket.socket, request: dict[str, Any]) -> bool:
    """
    Asked for C{"invalid": "head"}, a head of 70 KiB (over the router's
    64 KiB); for C{"invalid": "chunk"}, a stream with a chunk size that is
    not hex; for C{"interim"}, a thousand C{103 Early Hints} before a good
    answer; for a name in L{HOLES}, those bytes; else a good answer.
    """
    invalid = request.get("invalid")
    if invalid == "head":
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Big: "
            + b"a" * 70 * 1024
            + b"\r\nContent-Length: 2\r\n\r\n{}"
        )
        return True
    if invalid == "chunk":
        answer = chunked_stream()
        end = answer.index(b"\r\n\r\n") + 4
        conn.sendall(answer[:end] + b"%x\r\n%s\r\nzz\r\n" % (len(CHUNK), CHUNK))
        return True
    if invalid == "interim":
        hint = b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"
        conn.sendall(hint * 1000 + whole_answer())
        return True
    if invalid in HOLES:
        conn.sendall(HOLES[invalid][0])
        return True
    return answer_ok(conn, request)


_CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)

HOLES: dict[str, tuple[bytes, str]] = {
    "xy": (_CHUNKED_HEAD + b"5\r\nhelloXY0\r\n\r\n", "not followed by CRLF"),
    "length": (
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n" + WHOLE,
        "not a Content-Length",
    ),
    "lf": (
        _CHUNKED_HEAD + b"%x\r\n%s\n0\r\n\r\n" % (len(WHOLE), WHOLE),
        "not followed by CRLF",
    ),
    "101": (
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n" + whole_answer(),
        "101 Switching Protocols",
    ),
}
"""
Answers that once passed one of the router's parsers, by name: the bytes
and what the warning says.
"""


class InvalidAnswerTests(EngineClientTestCase):
    """
    Answers the router refuses as not HTTP/1.1: the client is told so,
    not that the replica closed the connection (the router did), and the
    operator finds why in the log.
    """

    answer = staticmethod(answer_invalid)

    def test_head_too_long(self) -> None:
        """
        A head over 64 KiB: a 502 saying the answer was not valid HTTP, a
        warning naming the replica and the reason; the next request is
        served.
        """
        with self.assertRaises(openai.APIStatusError) as raised:
            self.ask("big", invalid="head")
        self.assertEqual(raised.exception.status_code, 502)
        self.assertTrue(
            raised.exception.message.endswith(
                "Replica fake's answer was not valid HTTP/1.1: head longer than"
                " 65536 bytes."
            ),
            raised.exception.message,
        )
        self.assertEqual(self.record("big"), "502")
        self.server.wait_for(r"replica .*127\.0\.0\.1.*head longer than 65536 bytes")
        self.assertEqual(self.ask("next").choices[0].message.content, "whole")
        self.assert_no_traceback(self.server)

    def test_bad_chunk(self) -> None:
        """
        A chunk size that is not hex in a stream already relayed: the
        stream ends with an error event saying the answer was not valid
        HTTP, and the reason is in the log.
        """
        with self.assertRaises(openai.APIError) as raised:
            self.ask_stream("chunk", invalid="chunk")
        self.assertIn("not valid HTTP", raised.exception.message)
        self.assertEqual(self.record("chunk"), "502")
        self.server.wait_for(r"replica .*127\.0\.0\.1.*not a chunk size")
        self.assertEqual(self.ask_stream("next"), "okokok")
        self.assert_no_traceback(self.server)

    def test_framing_holes_refused(self) -> None:
        """
        Chunk data followed by C{XY}, C{Content-Length: -1}, a bare LF after
        chunk data and a C{101}: each a 502 saying the answer was not valid
        HTTP, its record 502, a warning naming the replica and why; the
        next request is served.
        """
        for name, (_, reason) in HOLES.items():
            rid = f"hole-{name}"
            with self.assertRaises(openai.APIStatusError) as raised:
                self.ask(rid, invalid=name)
            self.assertEqual(raised.exception.status_code, 502, name)
            self.assertIn("not valid HTTP", raised.exception.message)
            # What was wrong, without the engine's bytes or its address.
            message = raised.exception.message
            self.assertIn("Replica fake's answer was not valid HTTP/1.1: ", message)
            self.assertIn(reason, message)
            self.assertNotIn("127.0.0.1", raised.exception.message)
            self.assertEqual(self.record(rid), "502")
            self.server.wait_for(
                r"replica .*127\.0\.0\.1.*not valid HTTP/1\.1 \(.*" + re.escape(reason)
            )
            self.assertEqual(
                self.ask(f"after-{name}").choices[0].message.content, "whole"
            )
        self.assert_no_traceback(self.server)

    def test_endless_interim_answers(self) -> None:
        """
        A thousand C{103 Early Hints} before the answer: a 502 naming the
        replica by its id (never its address) and what was wrong, its
        record 502, a warning naming the replica, its address and why; the
        next request is served.
        """
        with self.assertRaises(openai.APIStatusError) as raised:
            self.ask("hints", invalid="interim")
        self.assertEqual(raised.exception.status_code, 502)
        self.assertTrue(
            raised.exception.message.endswith(
                "Replica fake's answer was not valid HTTP/1.1: more than 10"
                " interim (1xx) answers."
            ),
            raised.exception.message,
        )
        self.assertNotIn("127.0.0.1", raised.exception.message)
        self.assertEqual(self.record("hints"), "502")
        # The warning names the request by llmgw's own id, as its request
        # line does (beside the client's).
        own = self.server.wait_for(
            r"request (\S+): replica fake \(http://127\.0\.0\.1:\d+\): its answer"
            r" is not valid HTTP/1\.1 \(more than 10 interim \(1xx\) answers\)"
        ).group(1)
        self.assertIn(f"request {own} client_id=hints ", self.server.output())
        self.assertEqual(self.ask("next").choices[0].message.content, "whole")
        self.assert_no_traceback(self.server)
