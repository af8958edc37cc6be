"""
A misbehaving engine for end-to-end tests: a threaded HTTP server on
127.0.0.1 whose answer is chosen by the request body's C{"mode"}, for the
answers C{llmgw sim} is too well-behaved to give.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":'
    b'[{"index":0,"delta":{"content":"ok"}}]}\n\n'
)
FINISH = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":'
    b'[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeUpstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(
        self,
        status: int,
        body: bytes,
        headers: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _chunked(self, pieces: list[bytes]) -> None:
        # A chunked body, ended by its last chunk; the connection stays.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in pieces:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def do_POST(self) -> None:
        self.server.headers_seen.append({k.lower(): v for k, v in self.headers.items()})
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        self.server.received.append((dict(self.headers.items()), raw))
        request = json.loads(raw)
        mode = request.get("mode")
        if mode == "no_done":
            # Finished (finish_reason), then the body ends: no [DONE].
            self._chunked([CHUNK, FINISH])
        elif mode == "done_no_blank":
            # [DONE] without its blank line, then the connection closes.
            self._start_stream()
            self.wfile.write(CHUNK + FINISH + b"data: [DONE]")
        elif mode == "partial_then_drop":
            self._start_stream()
            # No length and no chunking: the body ends when the connection
            # closes, cleanly, in the middle of the second event.
            self.wfile.write(CHUNK + CHUNK[:40])
            self.wfile.flush()
            time.sleep(0.2)
        elif mode == "long_line":
            self._start_stream()
            self.wfile.write(CHUNK + b"data: ")
            piece = b"x" * 65536
            try:
                for _ in range(int(request.get("pieces", 64))):
                    self.wfile.write(piece)
                self.wfile.flush()
                time.sleep(5)
            except OSError:
                pass
        elif mode == "flood":
            # Writes as fast as the connection takes it; records how much
            # went out, so a test can see whether the gateway held back.
            self._start_stream()
            try:
                for _ in range(int(request.get("chunks", 3000))):
                    self.wfile.write(CHUNK * 600)
                    self.server.flood_sent += len(CHUNK) * 600
                if request.get("finish"):
                    self.wfile.write(FINISH + b"data: [DONE]\n\n")
                    self.server.flood_finished = True
            except OSError:
                pass
        elif mode == "usage":
            # The counts the request names, as an engine's usage object,
            # whole or as a stream's last chunk; a pooling route's answer
            # in OpenAI's embeddings shape.
            usage = json.dumps(request["usage"]).encode()
            if self.path in ("/v1/embeddings", "/v1/rerank", "/v1/score"):
                self._send(
                    200,
                    b'{"object":"list","model":"m","data":[{"object":"embedding",'
                    b'"index":0,"embedding":[0.6,0.8]}],"usage":' + usage + b"}",
                )
            elif request.get("stream"):
                self._chunked(
                    [
                        CHUNK,
                        FINISH,
                        b'data: {"id":"c","object":"chat.completion.chunk",'
                        b'"choices":[],"usage":' + usage + b"}\n\n",
                        b"data: [DONE]\n\n",
                    ]
                )
            else:
                self._send(
                    200,
                    b'{"id":"c","object":"chat.completion","model":"m","choices":'
                    b'[{"index":0,"message":{"role":"assistant","content":"ok"},'
                    b'"finish_reason":"stop"}],"usage":' + usage + b"}",
                )
        elif mode == "big_json":
            self._send(200, b'{"pad": "' + b"y" * int(request["size"]) + b'"}')
        elif mode == "e503_traceback":
            self._send(
                503,
                b'{"error": {"message": "Traceback (most recent call last):\\n'
                b' File \\"/opt/engine/secret.py\\" connect 10.1.2.3:5432"}}',
            )
        elif mode == "e500_openai":
            self._send(
                500,
                b'{"error": {"message": "CUDA out of memory on this batch",'
                b' "type": "server_error", "param": null, "code": "engine_oom"}}',
                {"Retry-After": "3"},
            )
        elif mode == "e500_vllm":
            self._send(
                500,
                b'{"object": "error", "message": "CUDA error: illegal memory access",'
                b' "type": "InternalServerError", "param": null, "code": 500}',
                content_type="application/json; charset=utf-8",
            )
        elif mode == "e500_traceback":
            self._send(
                500,
                b'{"error": {"message": "Traceback (most recent call last):\\n'
                b' File \\"/opt/engine/secret.py\\" connect 10.1.2.3:5432",'
                b' "type": "InternalServerError", "code": null}}',
            )
        elif mode == "e500_text":
            self._send(500, b"Internal Server Error", content_type="text/plain")
        elif mode == "e500_html_json":
            # JSON in the body, but the engine says it is HTML: not an
            # error object llmgw can vouch for.
            self._send(500, b'{"error": {"message": "x"}}', content_type="text/html")
        elif mode == "e500_other_json":
            self._send(500, b'{"status": "failed", "detail": 3}')
        elif mode == "e502_openai":
            self._send(
                502,
                b'{"error": {"message": "upstream of the engine failed",'
                b' "type": "server_error"}}',
            )
        elif mode == "e400_detail":
            self._send(400, b'{"detail": "Field required: messages"}')
        elif mode == "e400_vllm":
            self._send(
                400,
                b'{"object": "error", "message": "max_tokens is too large",'
                b' "type": "BadRequestError", "param": null, "code": 400}',
            )
        elif mode == "e429":
            self._send(
                429,
                b'{"error": {"message": "slow down", "type": "rate_limit_error"}}',
                {"Retry-After": "7"},
            )
        elif mode == "ok":
            self.server.answered += 1
            self._send(
                200,
                b'{"id":"x","object":"chat.completion","choices":[{"index":0,'
                b'"message":{"role":"assistant","content":"ok"},'
                b'"finish_reason":"stop"}]}',
            )
        elif mode == "close_without_answer":
            # As an engine killed with the request on its connection.
            self.server.closed_without_answer += 1
            self.close_connection = True
        elif mode == "e302":
            self._send(302, b"", {"Location": "http://127.0.0.1:1/elsewhere"})
        else:
            self._send(400, b'{"error": {"message": "unknown mode"}}')


class FakeUpstream(ThreadingHTTPServer):
    """
    Serve on 127.0.0.1 on a free port in a daemon thread.

    @ivar flood_sent: bytes the C{flood} mode has written so far.
    @ivar flood_finished: whether a C{flood} with C{finish} wrote its end.
    @ivar headers_seen: each request's headers, names in lower case.
    """

    daemon_threads = True
    flood_sent = 0
    flood_finished = False
    closed_without_answer = 0
    answered = 0

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        # The headers and body of each request, in order.
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.headers_seen: list[dict[str, str]] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
