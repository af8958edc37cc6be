"""
OpenTelemetry traces from a running C{twistd llmgw-server} in front of an
C{llmgw sim} engine: with C{[tracing] otlp_endpoint} the spans of a
streamed request reach an OTLP/HTTP receiver on loopback (its protobuf
decoded with C{opentelemetry-proto}), and the engine gets the attempt's
W3C C{traceparent} and the client's C{tracestate}; failed attempts, server
errors and a client that left are ERROR spans with the conventions'
C{error.type}; a collector that is down is one warning, counted drops and
a stop that does not wait for it; without C{[tracing]} no exporter thread
runs.
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from twisted.trial.unittest import SynchronousTestCase

from tests.support import Process, Processes, closed_port, http, sim_stats

KEY_SECRET = "sk-never-in-a-span"
PROMPT = "a prompt that no span may hold"


class Receiver:
    """
    An OTLP/HTTP trace receiver on loopback: C{POST /v1/traces} bodies
    decoded as C{ExportTraceServiceRequest}, their spans kept.
    """

    def __init__(self, port: int = 0) -> None:
        self.spans: list[Span] = []
        self.bodies: list[bytes] = []
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                received.bodies.append(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        received.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def wait_for(self, name: str, timeout: float = 20.0) -> Span:
        """
        @return: the first span named C{name}, once it came.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for span in list(self.spans):
                if span.name == name:
                    return span
            time.sleep(0.1)
        raise AssertionError(f"no span {name!r}: {[s.name for s in self.spans]}")


def attributes(span: Span) -> dict[str, Any]:
    """
    @return: a span's attributes as Python values.
    """
    out: dict[str, Any] = {}
    for kv in span.attributes:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


def stream_one(api_url: str) -> str:
    """
    @return: the text of one streamed chat completion.
    """
    client = openai.OpenAI(base_url=api_url + "/v1", api_key=KEY_SECRET, max_retries=0)
    chunks = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=5,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


class TracingTests(Processes, SynchronousTestCase):
    timeout = 120

    def test_streamed_request_traced(self) -> None:
        """
        One streamed request gives a server span with the GenAI attributes
        (the model asked and answered, the tokens, the time to first
        token), an attempt span under it naming the replica, a relay span
        under the attempt, and the engine got the attempt's C{traceparent}:
        same trace id, the attempt's span id.  No prompt or key is in any
        attribute, and the exporter's thread runs.
        """
        receiver = Receiver()
        self.addCleanup(receiver.stop)
        sim, sim_url = self.start_sim("--itl", "0.001", model="m")
        _, api_url, admin_url = self.start_server(
            "--endpoint",
            f"sim={sim_url}=m",
            config=f'[tracing]\notlp_endpoint = "{receiver.url}"\n',
        )
        self.assertTrue(stream_one(api_url))
        server = receiver.wait_for("POST /v1/chat/completions")
        attempt = receiver.wait_for("llmgw.attempt")
        relay = receiver.wait_for("llmgw.relay")
        got = attributes(server)
        self.assertEqual(server.kind, Span.SPAN_KIND_SERVER)
        self.assertEqual(got["gen_ai.operation.name"], "chat")
        self.assertEqual(got["gen_ai.request.model"], "m")
        self.assertEqual(got["gen_ai.response.model"], "m")
        self.assertGreater(got["gen_ai.usage.input_tokens"], 0)
        self.assertEqual(got["gen_ai.usage.output_tokens"], 5)
        self.assertGreater(got["gen_ai.server.time_to_first_token"], 0)
        self.assertEqual(got["http.response.status_code"], 200)
        self.assertEqual(attempt.parent_span_id, server.span_id)
        self.assertEqual(attempt.trace_id, server.trace_id)
        self.assertEqual(attempt.kind, Span.SPAN_KIND_CLIENT)
        self.assertEqual(attributes(attempt)["llmgw.replica"], "sim")
        self.assertEqual(relay.parent_span_id, attempt.span_id)

        traceparent = sim_stats(sim_url)["last_traceparent"]
        version, trace_id, span_id, flags = traceparent.split("-")
        self.assertEqual(
            (version, trace_id, span_id),
            ("00", attempt.trace_id.hex(), attempt.span_id.hex()),
        )
        self.assertTrue(int(flags, 16) & 1, "sampled")
        raw = b"".join(receiver.bodies)
        self.assertNotIn(PROMPT.encode(), raw)
        self.assertNotIn(KEY_SECRET.encode(), raw)
        status, _, threads = http("GET", admin_url + "/debug/threads")
        self.assertEqual(status, 200)
        self.assertIn(b"OtelBatch", threads)

    def test_client_traceparent_continued(self) -> None:
        """
        A client's own C{traceparent} is continued: the server span is its
        child, in its trace.
        """
        receiver = Receiver()
        self.addCleanup(receiver.stop)
        _, sim_url = self.start_sim("--itl", "0.001", model="m")
        _, api_url, _ = self.start_server(
            "--endpoint",
            f"sim={sim_url}=m",
            config=f'[tracing]\notlp_endpoint = "{receiver.url}"\nsample_ratio = 0.0\n',
        )
        trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        status, _, _ = http(
            "POST",
            api_url + "/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
            b' "max_tokens": 2}',
            {
                "content-type": "application/json",
                "traceparent": f"00-{trace_id}-{parent}-01",
            },
        )
        self.assertEqual(status, 200)
        server = receiver.wait_for("POST /v1/chat/completions")
        self.assertEqual(server.trace_id.hex(), trace_id)
        self.assertEqual(server.parent_span_id.hex(), parent)

    def test_off_no_exporter(self) -> None:
        """
        Without C{[tracing]} no exporter thread runs in the server, and the
        engine gets no C{traceparent}.
        """
        _, sim_url = self.start_sim("--itl", "0.001", model="m")
        _, api_url, admin_url = self.start_server("--endpoint", f"sim={sim_url}=m")
        self.assertTrue(stream_one(api_url))
        status, _, threads = http("GET", admin_url + "/debug/threads")
        self.assertEqual(status, 200)
        self.assertIn(b"MainThread", threads)
        self.assertNotIn(b"Otel", threads)
        self.assertIsNone(sim_stats(sim_url)["last_traceparent"])

    def test_activation_wait_span(self) -> None:
        """
        A request for a model with no replica waits for one to start: its
        server span has an C{llmgw.wait} child for the activation, before
        the attempt.
        """
        receiver = Receiver()
        self.addCleanup(receiver.stop)
        low = random.randrange(21000, 32000)
        _, api_url, _ = self.start_server(
            "--local",
            config=f'[tracing]\notlp_endpoint = "{receiver.url}"\n'
            f'[control]\ninterval = "100ms"\nport_range = [{low}, {low + 20}]\n'
            '[[models]]\nname = "m"\n[[models.profiles]]\nname = "cpu"\n'
            'engine = "sim"\nsource = "sim"\ngpus = 0\n',
        )
        self.assertTrue(stream_one(api_url))
        server = receiver.wait_for("POST /v1/chat/completions")
        wait = receiver.wait_for("llmgw.wait")
        attempt = receiver.wait_for("llmgw.attempt")
        self.assertEqual(attributes(wait)["llmgw.wait"], "activation")
        self.assertEqual(wait.parent_span_id, server.span_id)
        self.assertLessEqual(wait.end_time_unix_nano, attempt.start_time_unix_nano)
        self.assertGreater(wait.end_time_unix_nano - wait.start_time_unix_nano, 0)


# Batches leave every 100 ms (the SDK's default is 5 s), for short tests.
QUICK_BATCHES = {"OTEL_BSP_SCHEDULE_DELAY": "100"}

CHAT = (
    b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}'
)


def chat(api_url: str, model: str = "m", headers: dict[str, str] | None = None) -> int:
    """
    @return: the status of one chat completion for C{model}.
    """
    status, _, _ = http(
        "POST",
        api_url + "/v1/chat/completions",
        CHAT % model.encode(),
        {"content-type": "application/json", **(headers or {})},
    )
    return status


def status_of(span: Span) -> int:
    """
    @return: the span's status code (0 unset, 2 error).
    """
    return int(span.status.code)


def dropped(admin_url: str, reason: str) -> float:
    """
    @return: C{llmgw_trace_spans_dropped_total{reason}} on the admin
        listener's C{/metrics}.
    """
    _, _, body = http("GET", admin_url + "/metrics")
    match = re.search(
        rb'llmgw_trace_spans_dropped_total\{reason="%s"\} (\S+)' % reason.encode(),
        body,
    )
    assert match is not None, body[-2000:]
    return float(match.group(1))


def stop_seconds(process: Process) -> float:
    """
    @return: seconds from SIGTERM to the process's exit (SIGKILL past 10).
    """
    began = time.monotonic()
    process.stop(timeout=10)
    return time.monotonic() - began


class Hanging:
    """
    A collector that takes connections and never answers: an export waits
    for its deadline (the SDK's 10 s) or its retries' end.

    @ivar accepted: set once a connection came.
    """

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = threading.Event()
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._take, daemon=True)
        self.thread.start()

    def _take(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(connection)
            self.accepted.set()

    def stop(self) -> None:
        self.listener.close()
        for connection in self.held:
            connection.close()


class TraceRulesTests(Processes, SynchronousTestCase):
    """
    W3C Trace Context and the HTTP semantic conventions, through a real
    server, engine and collector.
    """

    timeout = 120

    def traced_sim(self, itl: str) -> tuple[Receiver, str, str]:
        """
        A server tracing to a new receiver, in front of a sim of model
        C{m} writing a token every C{itl} seconds.

        @return: the receiver, the sim's and the server's client API base
            URLs.
        """
        receiver = Receiver()
        self.addCleanup(receiver.stop)
        _, sim_url = self.start_sim("--itl", itl, model="m")
        _, api_url, _ = self.start_server(
            "--endpoint",
            f"sim={sim_url}=m",
            config=f'[tracing]\notlp_endpoint = "{receiver.url}"\n',
        )
        return receiver, sim_url, api_url

    def test_tracestate_reaches_engine(self) -> None:
        """
        A client's C{tracestate} goes to the engine with the attempt's
        C{traceparent}, which continues the client's trace.
        """
        receiver, sim_url, api_url = self.traced_sim("0.001")
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        status = chat(
            api_url,
            headers={
                "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01",
                "tracestate": "vendor=opaque,other=1",
            },
        )
        self.assertEqual(status, 200)
        stats = sim_stats(sim_url)
        self.assertEqual(stats["last_tracestate"], "vendor=opaque,other=1")
        self.assertEqual(stats["last_traceparent"].split("-")[1], trace_id)

    def test_failures_are_error_spans(self) -> None:
        """
        A replica's 503 and a refused connection make ERROR attempt spans
        with C{error.type} C{503} and C{connection_refused}, and the server
        spans' errors are their 5xx as C{error.type}: no Python class name.
        """
        receiver = Receiver()
        self.addCleanup(receiver.stop)
        _, sim_url = self.start_sim("--fault", "status=503", model="busy")
        _, api_url, _ = self.start_server(
            "--endpoint",
            f"busy={sim_url}=busy",
            "--endpoint",
            f"dead=http://127.0.0.1:{closed_port()}=dead",
            config=f'[tracing]\notlp_endpoint = "{receiver.url}"\n',
        )
        self.assertEqual(chat(api_url, "busy"), 503)
        self.assertEqual(chat(api_url, "dead"), 502)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            attempts = [s for s in receiver.spans if s.name == "llmgw.attempt"]
            servers = [s for s in receiver.spans if s.name.startswith("POST ")]
            if len(attempts) >= 2 and len(servers) >= 2:
                break
            time.sleep(0.1)
        got = {attributes(a)["llmgw.replica"]: a for a in attempts}
        self.assertEqual(attributes(got["busy"])["error.type"], "503")
        self.assertEqual(attributes(got["dead"])["error.type"], "connection_refused")
        for attempt in got.values():
            self.assertEqual(status_of(attempt), 2, "ERROR")
        kinds = sorted(attributes(s)["error.type"] for s in servers)
        self.assertEqual(kinds, ["502", "503"])
        for server in servers:
            self.assertEqual(status_of(server), 2, "ERROR")

    def test_client_left_mid_stream(self) -> None:
        """
        A client that closes its connection mid-stream makes the server
        span ERROR with C{error.type} C{client_disconnected} and the
        status its head said (200), and so the attempt and the relay it
        cut: not C{CancelledError}, and not only a 499.
        """
        receiver, _, api_url = self.traced_sim("0.2")
        port = int(api_url.rsplit(":", 1)[1])
        body = (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
            b' "max_tokens": 50, "stream": true}'
        )
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            got = b""
            while b"data:" not in got:
                chunk = client.recv(4096)
                self.assertTrue(chunk, got)
                got += chunk
        server = receiver.wait_for("POST /v1/chat/completions")
        attempt = receiver.wait_for("llmgw.attempt")
        relay = receiver.wait_for("llmgw.relay")
        self.assertEqual(attributes(server)["http.response.status_code"], 200)
        for span in (server, attempt, relay):
            self.assertEqual(attributes(span)["error.type"], "client_disconnected")
            self.assertEqual(status_of(span), 2, span.name)


class CollectorDownTests(Processes, SynchronousTestCase):
    """
    The exporter's own failures: logged once per outage, counted, and
    never holding a stop.
    """

    timeout = 120

    def test_outage_logged_once_and_counted(self) -> None:
        """
        With the collector down, several failed exports give one warning
        (none of the SDK's lines), the dropped spans are counted on
        C{/metrics}, one line says where spans go at start and one when
        the collector is back; SIGTERM with C{drain_timeout = "1s"} takes
        under 3 s.
        """
        port = closed_port()
        _, sim_url = self.start_sim("--itl", "0.001", model="m")
        server, api_url, admin_url = self.start_server(
            "--endpoint",
            f"sim={sim_url}=m",
            config=f'[router]\ndrain_timeout = "1s"\n'
            f'[tracing]\notlp_endpoint = "http://127.0.0.1:{port}"\n',
            env={**QUICK_BATCHES, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1"},
        )
        server.wait_for(rf"spans go to http://127\.0\.0\.1:{port}/v1/traces")
        self.assertEqual(chat(api_url), 200)
        server.wait_for("spans cannot be exported")
        for _ in range(3):
            self.assertEqual(chat(api_url), 200)
            time.sleep(0.5)
        deadline = time.monotonic() + 10
        while dropped(admin_url, "export_failed") < 4:
            self.assertLess(time.monotonic(), deadline, "dropped spans counted")
            time.sleep(0.2)
        output = server.output()
        self.assertEqual(output.count("spans cannot be exported"), 1, output)
        # The SDK's own lines (Python's logging, printed by twistd as
        # stderr) stay out of the log.
        self.assertNotIn("stderr#", output)

        receiver = Receiver(port)
        self.addCleanup(receiver.stop)
        self.assertEqual(chat(api_url), 200)
        server.wait_for("spans are exported to .* again")
        receiver.wait_for("POST /v1/chat/completions")
        self.assertLess(stop_seconds(server), 3.0)

    def test_stop_not_held_by_a_hanging_collector(self) -> None:
        """
        With an export waiting on a collector that never answers (the
        SDK's deadline is 10 s), SIGTERM with C{drain_timeout = "1s"}
        still exits in under 3 s, saying the spans left were not exported.
        """
        collector = Hanging()
        self.addCleanup(collector.stop)
        _, sim_url = self.start_sim("--itl", "0.001", model="m")
        server, api_url, _ = self.start_server(
            "--endpoint",
            f"sim={sim_url}=m",
            config=f'[router]\ndrain_timeout = "1s"\n'
            f'[tracing]\notlp_endpoint = "{collector.url}"\n',
            env=QUICK_BATCHES,
        )
        self.assertEqual(chat(api_url), 200)
        self.assertTrue(collector.accepted.wait(10), "an export began")
        self.assertEqual(chat(api_url), 200)
        self.assertLess(stop_seconds(server), 3.0)
        self.assertIn("stopped waiting for the collector", server.output())
