"""
End to end: C{twistd -n llmgw-server} and C{llmgw sim} as child processes,
talked to over loopback sockets with the official C{openai} client.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import (
    TWISTD,
    Processes,
    closed_port,
    hermetic_env,
    http,
    sim_stats,
)

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about naïve cafés"}]


def client(base_url: str, **kwargs: Any) -> openai.OpenAI:
    """
    The official client, without its own retries (they would hide what the
    gateway answered) and with a bounded timeout.
    """
    return openai.OpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30, **kwargs
    )


def stream_text(chunks: Iterator[Any]) -> tuple[str, list[Any]]:
    """
    @return: the concatenated delta contents and every chunk.
    """
    seen = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in seen if c.choices)
    return text, seen


class RouterEndToEndTests(SynchronousTestCase, Processes):
    """
    The router in front of simulated engines.
    """

    timeout = 120

    def setUp(self) -> None:
        self.sim, self.sim_url = self.start_sim("--itl", "0.001")
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={self.sim_url}=sim-model"
        )
        self.direct = client(self.sim_url)
        self.gateway = client(self.url)

    def test_chat_same_as_engine(self) -> None:
        """
        A non-streamed chat completion through llmgw has the content and
        usage the engine gives when asked directly.
        """
        via = self.gateway.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=12
        )
        direct = self.direct.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=12
        )
        self.assertTrue(via.choices[0].message.content)
        self.assertEqual(
            via.choices[0].message.content, direct.choices[0].message.content
        )
        assert via.usage is not None
        self.assertEqual(via.usage.completion_tokens, 12)
        self.assertEqual(via.usage, direct.usage)

    def test_stream_same_as_engine_without_usage_chunk(self) -> None:
        """
        A streamed chat completion arrives chunk by chunk with the engine's
        text; llmgw asked the engine for usage, but a client that did not
        ask gets no usage-only chunk.
        """
        text, chunks = stream_text(
            self.gateway.chat.completions.create(
                model="sim-model", messages=MESSAGES, max_tokens=16, stream=True
            )
        )
        direct_text, direct_chunks = stream_text(
            self.direct.chat.completions.create(
                model="sim-model", messages=MESSAGES, max_tokens=16, stream=True
            )
        )
        self.assertEqual(text, direct_text)
        self.assertEqual(len(chunks), len(direct_chunks))
        self.assertEqual([c for c in chunks if not c.choices], [])
        self.assertTrue(all(getattr(c, "usage", None) is None for c in chunks))

    def test_stream_usage_when_asked(self) -> None:
        """
        A client that asks for usage in the stream gets the usage chunk.
        """
        text, chunks = stream_text(
            self.gateway.chat.completions.create(
                model="sim-model",
                messages=MESSAGES,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage_chunks = [c for c in chunks if not c.choices]
        self.assertEqual(len(usage_chunks), 1)
        self.assertEqual(usage_chunks[0].usage.completion_tokens, 5)
        self.assertTrue(text)

    def test_usage_counted_however_not_asked(self) -> None:
        """
        Without stream_options, with it null, or with include_usage false,
        the client gets no usage chunk and llmgw still counts the tokens.
        """
        for extra in (b"", b', "stream_options": null', b', "stream_options": {}'):
            status, _, body = http(
                "POST",
                self.url + "/v1/chat/completions",
                b'{"model": "sim-model", "max_tokens": 3, "stream": true,'
                b' "messages": [{"role": "user", "content": "hi"}]' + extra + b"}",
            )
            self.assertEqual(status, 200)
            self.assertNotIn(b'"usage":{', body.replace(b" ", b""))
            self.assertTrue(body.endswith(b"data: [DONE]\n\n"))
        _, _, metrics = http("GET", self.admin_url + "/metrics")
        self.assertIn(
            'llmgw_tokens_total{kind="completion",model="sim-model"} 9.0',
            metrics.decode(),
        )

    def test_completions_embeddings_models(self) -> None:
        """
        Completions, embeddings and the model list answer in OpenAI's shapes.
        """
        completion = self.gateway.completions.create(
            model="sim-model", prompt="Once upon a time", max_tokens=4
        )
        self.assertTrue(completion.choices[0].text)
        embeddings = self.gateway.embeddings.create(
            model="sim-model", input=["one", "two"]
        )
        self.assertEqual(len(embeddings.data), 2)
        self.assertEqual(
            embeddings.data[0].embedding,
            self.direct.embeddings.create(model="sim-model", input=["one"])
            .data[0]
            .embedding,
        )
        models = self.gateway.models.list()
        self.assertEqual([m.id for m in models.data], ["sim-model"])
        self.assertEqual(self.gateway.models.retrieve("sim-model").id, "sim-model")

    def test_unknown_model(self) -> None:
        """
        An unknown model is the client's NotFoundError, code model_not_found,
        and nothing reaches the engine.
        """
        before = sim_stats(self.sim_url)["requests_total"]
        with self.assertRaises(openai.NotFoundError) as raised:
            self.gateway.chat.completions.create(model="nope", messages=MESSAGES)
        self.assertEqual(raised.exception.code, "model_not_found")
        with self.assertRaises(openai.NotFoundError):
            self.gateway.models.retrieve("nope")
        self.assertEqual(sim_stats(self.sim_url)["requests_total"], before)

    def test_malformed_json(self) -> None:
        """
        A body that is not JSON is a 400 error object.
        """
        status, headers, body = http(
            "POST",
            self.url + "/v1/chat/completions",
            b'{"model": "sim-model", "messages": [',
            {"content-type": "application/json"},
        )
        self.assertEqual(status, 400)
        self.assertEqual(headers["content-type"], "application/json")
        error = json.loads(body)["error"]
        self.assertEqual(error["type"], "invalid_request_error")
        self.assertIn("not valid JSON", error["message"])
        self.assertEqual(set(error), {"message", "type", "param", "code"})

    def test_hostile_bodies(self) -> None:
        """
        Bodies that are JSON but not a request, nested past the parser's
        depth, or naming a huge model get 400 or 404 error objects, and the
        server keeps serving.
        """
        cases = [
            (b"[1, 2]", 400, "must be a JSON object"),
            (b'{"messages": []}', 400, "model parameter"),
            (b'{"model": "sim-model", "stream": "yes"}', 400, "'stream'"),
            (b"[" * 100000 + b"]" * 100000, 400, "nested too deeply"),
            (b'{"model": "' + b"m" * 100000 + b'"}', 404, "does not exist"),
            (b"\xff\xfe{}", 400, "not valid JSON"),
        ]
        for body, status, fragment in cases:
            code, headers, answer = http(
                "POST", self.url + "/v1/chat/completions", body
            )
            self.assertEqual(code, status, body[:40])
            error = json.loads(answer)["error"]
            self.assertIn(fragment, error["message"])
            self.assertLess(len(answer), 2000)
        self.assertNotIn("Traceback", self.server.output())
        self.gateway.models.list()
        # A lone surrogate is valid JSON text; llmgw re-encodes a streamed
        # body to add include_usage, and the engine gets it intact.
        for stream in (b"true", b"false"):
            code, _, answer = http(
                "POST",
                self.url + "/v1/chat/completions",
                b'{"model": "sim-model", "max_tokens": 3, "stream": ' + stream + b","
                b' "messages": [{"role": "user", "content": "\\ud800"}]}',
            )
            self.assertEqual(code, 200, answer[:300])

    def test_request_id(self) -> None:
        """
        X-Request-ID is returned as given, or made when absent, and forwarded
        to the engine when it is a UUID.
        """
        response = self.gateway.chat.completions.with_raw_response.create(
            model="sim-model",
            messages=MESSAGES,
            max_tokens=2,
            extra_headers={"X-Request-ID": "trace-42"},
        )
        self.assertEqual(response.headers["x-request-id"], "trace-42")
        # Not a UUID: the engine gets a UUID of its own (llama.cpp's server
        # refuses anything else).
        forwarded = sim_stats(self.sim_url)["last_request_id"]
        self.assertRegex(forwarded, r"^[0-9a-f]{32}$")
        given = "6f1c2a9e-0d4b-4e2a-9a57-3c1f0e8b7d21"
        response = self.gateway.chat.completions.with_raw_response.create(
            model="sim-model",
            messages=MESSAGES,
            max_tokens=2,
            extra_headers={"X-Request-ID": given},
        )
        self.assertEqual(response.headers["x-request-id"], given)
        self.assertEqual(sim_stats(self.sim_url)["last_request_id"], given)
        response = self.gateway.chat.completions.with_raw_response.create(
            model="sim-model", messages=MESSAGES, max_tokens=2
        )
        self.assertRegex(response.headers["x-request-id"], r"^[0-9a-f]{32}$")
        self.assertEqual(
            sim_stats(self.sim_url)["last_request_id"],
            response.headers["x-request-id"],
        )

    def test_disconnect_cancels_upstream(self) -> None:
        """
        A client that goes away mid-stream makes llmgw close the engine's
        connection within a second, so the engine stops generating.
        """
        stream = self.gateway.chat.completions.create(
            model="sim-model",
            messages=MESSAGES,
            max_tokens=2000,
            stream=True,
            extra_body={"llmgw_sim": {"stall_after_chunks": 3, "stall_seconds": 60}},
        )
        received = 0
        for _ in stream:
            received += 1
            if received == 3:
                break
        closed_at = time.time()
        stream.close()
        deadline = time.monotonic() + 5
        stats = sim_stats(self.sim_url)
        while stats["streams_cancelled"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
            stats = sim_stats(self.sim_url)
        self.assertEqual(stats["streams_cancelled"], 1)
        self.assertLess(stats["last_cancel_time"] - closed_at, 1.0)

    def test_byte_writes(self) -> None:
        """
        A stream the engine writes one byte per TCP segment, splitting
        multi-byte characters, arrives intact, with or without the
        usage chunk being hidden.
        """
        expected, _ = stream_text(
            self.direct.chat.completions.create(
                model="sim-model", messages=MESSAGES, max_tokens=8, stream=True
            )
        )
        self.assertNotEqual(
            expected.encode("utf-8").decode("ascii", "ignore"), expected
        )
        for options in (None, {"include_usage": True}):
            text, chunks = stream_text(
                self.gateway.chat.completions.create(
                    model="sim-model",
                    messages=MESSAGES,
                    max_tokens=8,
                    stream=True,
                    extra_body={"llmgw_sim": {"byte_writes": True}},
                    **({"stream_options": options} if options else {}),
                )
            )
            self.assertEqual(text, expected)
            usage_chunks = [c for c in chunks if not c.choices]
            self.assertEqual(len(usage_chunks), 1 if options else 0)

    def test_routing_errors(self) -> None:
        """
        An unknown path is a 404 and a wrong method a 405 with Allow, both
        OpenAI error objects carrying X-Request-ID.
        """
        status, headers, body = http(
            "GET", self.url + "/v1/chat/completion", headers={"X-Request-ID": "r-1"}
        )
        self.assertEqual(status, 404)
        self.assertEqual(headers["x-request-id"], "r-1")
        self.assertEqual(json.loads(body)["error"]["code"], "unknown_url")
        status, headers, body = http("GET", self.url + "/v1/chat/completions")
        self.assertEqual(status, 405)
        self.assertEqual(headers["allow"], "POST")
        self.assertRegex(headers["x-request-id"], r"^[0-9a-f]{32}$")
        self.assertEqual(json.loads(body)["error"]["code"], "method_not_allowed")

    def test_metrics(self) -> None:
        """
        The admin listener serves the traffic metrics.
        """
        self.gateway.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=3
        )
        status, _, body = http("GET", self.admin_url + "/metrics")
        self.assertEqual(status, 200)
        self.assertIn(
            'llmgw_requests_total{model="sim-model",status="200"} 1.0', body.decode()
        )
        self.assertIn(
            'llmgw_tokens_total{kind="completion",model="sim-model"} 3.0',
            body.decode(),
        )


class DeadlineTests(SynchronousTestCase, Processes):
    """
    Phase deadlines, each with its own error.
    """

    timeout = 60

    def setUp(self) -> None:
        self.sim, self.sim_url = self.start_sim("--itl", "0.001")
        self.server, self.url, _ = self.start_server(
            "--endpoint",
            f"sim-0={self.sim_url}=sim-model",
            config='[router]\nfirst_byte_timeout = "1s"\nidle_timeout = "1s"\n'
            'max_body_size = "4KiB"\n',
        )
        self.gateway = client(self.url)

    def test_first_byte_stall(self) -> None:
        """
        An engine silent past first_byte_timeout gives a 504 whose code names
        the phase, and its connection is closed.
        """
        started = time.monotonic()
        with self.assertRaises(openai.APIStatusError) as raised:
            self.gateway.chat.completions.create(
                model="sim-model",
                messages=MESSAGES,
                extra_body={"llmgw_sim": {"stall_before_first_byte": 60}},
            )
        self.assertEqual(raised.exception.status_code, 504)
        self.assertEqual(raised.exception.code, "first_byte_timeout")
        self.assertLess(time.monotonic() - started, 5)

    def test_mid_stream_stall(self) -> None:
        """
        An engine silent mid-stream past idle_timeout ends the stream with an
        SSE error event, which the client raises, after the chunks so far.
        """
        stream = self.gateway.chat.completions.create(
            model="sim-model",
            messages=MESSAGES,
            max_tokens=50,
            stream=True,
            extra_body={"llmgw_sim": {"stall_after_chunks": 4, "stall_seconds": 60}},
        )
        received = []
        with self.assertRaises(openai.APIError) as raised:
            for chunk in stream:
                received.append(chunk)
        self.assertEqual(len(received), 4)
        self.assertIn("next chunk", raised.exception.message)
        self.assertEqual(raised.exception.code, "idle_timeout")

    def test_body_too_large(self) -> None:
        """
        A body over max_body_size is a 413 error object, and the engine
        never sees it.
        """
        with self.assertRaises(openai.APIStatusError) as raised:
            self.gateway.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "x" * 5000}],
            )
        self.assertEqual(raised.exception.status_code, 413)
        self.assertEqual(raised.exception.code, "request_too_large")
        self.assertEqual(sim_stats(self.sim_url)["requests_total"], 0)


class BalancingTests(SynchronousTestCase, Processes):
    """
    Several replicas: failures skipped, load shared.
    """

    timeout = 120

    def test_refusing_replica(self) -> None:
        """
        With one replica refusing connections, every request succeeds on the
        other, and the refusing one is ejected after its first refusal.
        """
        _, sim_url = self.start_sim()
        dead = f"http://127.0.0.1:{closed_port()}"
        _, url, admin_url = self.start_server(
            "--endpoint",
            f"dead={dead}=sim-model",
            "--endpoint",
            f"live={sim_url}=sim-model",
        )
        gateway = client(url)
        for _ in range(20):
            result = gateway.chat.completions.create(
                model="sim-model", messages=MESSAGES, max_tokens=2
            )
            self.assertTrue(result.choices[0].message.content)
        self.assertEqual(sim_stats(sim_url)["requests_total"], 20)
        _, _, metrics = http("GET", admin_url + "/metrics")
        # Ejected for the cooldown after the first refusal: one connect
        # error and one retry, not one per request.
        self.assertIn(
            'llmgw_upstream_errors_total{kind="connect"} 1.0', metrics.decode()
        )
        self.assertIn('llmgw_retries_total{model="sim-model"} 1.0', metrics.decode())

    def test_connect_timeout(self) -> None:
        """
        A replica that never completes the TCP handshake costs
        connect_timeout: alone it gives a 504 coded connect_timeout; beside
        a live replica, the request is retried there and succeeds.
        """
        blackhole = socket.socket()
        self.addCleanup(blackhole.close)
        blackhole.bind(("127.0.0.1", 0))
        # A full accept queue: Linux drops further SYNs, so connecting hangs.
        blackhole.listen(0)
        port = blackhole.getsockname()[1]
        for _ in range(3):
            filler = socket.socket()
            self.addCleanup(filler.close)
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        config = '[router]\nconnect_timeout = "500ms"\n'
        _, alone_url, _ = self.start_server(
            "--endpoint", f"hole=http://127.0.0.1:{port}=sim-model", config=config
        )
        started = time.monotonic()
        with self.assertRaises(openai.APIStatusError) as raised:
            client(alone_url).chat.completions.create(
                model="sim-model", messages=MESSAGES
            )
        self.assertEqual(raised.exception.status_code, 504)
        self.assertEqual(raised.exception.code, "connect_timeout")
        self.assertLess(time.monotonic() - started, 5)

        _, sim_url = self.start_sim()
        _, url, _ = self.start_server(
            "--endpoint",
            f"hole=http://127.0.0.1:{port}=sim-model",
            "--endpoint",
            f"live={sim_url}=sim-model",
            config=config,
        )
        for _ in range(4):
            client(url).chat.completions.create(
                model="sim-model", messages=MESSAGES, max_tokens=2
            )
        self.assertEqual(sim_stats(sim_url)["requests_total"], 4)

    def test_retry_on_503(self) -> None:
        """
        A replica answering 503 before the first byte is skipped for another.
        """
        _, busy_url = self.start_sim("--fault", "status=503")
        _, sim_url = self.start_sim()
        _, url, _ = self.start_server(
            "--endpoint",
            f"busy={busy_url}=sim-model",
            "--endpoint",
            f"live={sim_url}=sim-model",
        )
        gateway = client(url)
        for _ in range(10):
            gateway.chat.completions.create(
                model="sim-model", messages=MESSAGES, max_tokens=2
            )
        self.assertEqual(sim_stats(sim_url)["requests_total"], 10)

    def test_even_split(self) -> None:
        """
        200 concurrent requests over two equal replicas split within 45-55 %.
        """
        _, a_url = self.start_sim("--ttft", "0.05", "--itl", "0.005")
        _, b_url = self.start_sim("--ttft", "0.05", "--itl", "0.005")
        _, url, _ = self.start_server(
            "--endpoint", f"a={a_url}=sim-model", "--endpoint", f"b={b_url}=sim-model"
        )

        async def burst() -> None:
            gateway = openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60
            )
            try:
                results = await asyncio.gather(
                    *(
                        gateway.chat.completions.create(
                            model="sim-model", messages=MESSAGES, max_tokens=8
                        )
                        for _ in range(200)
                    )
                )
            finally:
                await gateway.close()
            assert all(r.choices[0].message.content for r in results)

        asyncio.run(burst())
        a = sim_stats(a_url)["requests_total"]
        b = sim_stats(b_url)["requests_total"]
        self.assertEqual(a + b, 200)
        self.assertTrue(90 <= a <= 110, f"split {a}/{b}")


class StartupTests(SynchronousTestCase, Processes):
    """
    What an operator sees when the configuration is wrong.
    """

    timeout = 60

    def run_server(self, *args: str, config: str | None = None) -> tuple[int, str]:
        # Its own state directory and admin port, not the defaults that a
        # server the user runs (make run) holds.
        argv = [
            TWISTD,
            "-n",
            "--pidfile=",
            "llmgw-server",
            "--state-dir",
            tempfile.mkdtemp(prefix="llmgw-state-"),
            "--admin-listen",
            "tcp:0:interface=127.0.0.1",
            *args,
        ]
        if config is not None:
            path = tempfile.mktemp(suffix=".toml")
            with open(path, "w") as f:
                f.write(config)
            self.addCleanup(os.remove, path)
            argv += ["--config", path]
        done = subprocess.run(
            argv, capture_output=True, timeout=30, text=True, env=hermetic_env()
        )
        return done.returncode, done.stdout + done.stderr

    def assertOneLineError(self, output: str, *fragments: str) -> None:
        self.assertNotIn("Traceback", output)
        lines = output.strip().splitlines()
        self.assertEqual(len(lines), 1, output)
        for fragment in fragments:
            self.assertIn(fragment, lines[0])

    def test_config_errors(self) -> None:
        """
        An unknown key, a bad duration, a bad URL and a missing field each
        exit non-zero with one line naming the key and the value.
        """
        endpoint = (
            '[[endpoints]]\nid = "a"\nurl = "http://127.0.0.1:1"\nmodels = ["m"]\n'
        )
        cases = [
            ("colour = 1\n" + endpoint, ["colour", "unknown key"]),
            (
                '[router]\nidle_timeout = "5x"\n' + endpoint,
                ["router.idle_timeout", "'5x'"],
            ),
            (
                '[[endpoints]]\nid = "a"\nurl = "ftp:/x"\nmodels = ["m"]\n',
                ["endpoints[0].url", "'ftp:/x'"],
            ),
            (
                '[[endpoints]]\nid = "a"\nmodels = ["m"]\n',
                ["endpoints[0].url", "missing"],
            ),
            ("listen = \n", ["not valid TOML"]),
        ]
        for config, fragments in cases:
            code, output = self.run_server(config=config)
            self.assertNotEqual(code, 0, config)
            self.assertOneLineError(output, *fragments)

    def test_nothing_to_serve(self) -> None:
        """
        No replica at all is an error that says what to add.
        """
        code, output = self.run_server()
        self.assertNotEqual(code, 0)
        self.assertOneLineError(
            output, "nothing to serve", "--endpoint", "[[endpoints]]"
        )

    def test_bad_endpoint_flag_and_port_in_use(self) -> None:
        """
        A malformed --endpoint and a listener that cannot bind are one line
        each, not a traceback or a process that serves nothing.
        """
        code, output = self.run_server("--endpoint", "just-a-name")
        self.assertNotEqual(code, 0)
        self.assertOneLineError(output, "--endpoint", "just-a-name")
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            code, output = self.run_server(
                "--endpoint",
                "a=http://127.0.0.1:1=m",
                "--listen",
                f"tcp:{port}:interface=127.0.0.1",
            )
        self.assertNotEqual(code, 0)
        self.assertNotIn("Traceback", output)
        self.assertIn(f"cannot listen on 'tcp:{port}", output)

    def test_flag_overrides_file(self) -> None:
        """
        --endpoint replaces the file's endpoints.
        """
        _, sim_url = self.start_sim(model="from-flag")
        _, url, _ = self.start_server(
            "--endpoint",
            f"flag={sim_url}=from-flag",
            config='[[endpoints]]\nid = "file"\nurl = "http://127.0.0.1:1"\n'
            'models = ["from-file"]\n',
        )
        self.assertEqual([m.id for m in client(url).models.list().data], ["from-flag"])


class TLSTests(SynchronousTestCase, Processes):
    """
    The client listener over TLS through an ssl: endpoint string.
    """

    timeout = 60

    def test_tls_offers_h2(self) -> None:
        """
        An ssl: listener negotiates HTTP/2 over ALPN and serves over it.
        """
        import h2.config
        import h2.connection
        import h2.events

        from llmgw.cli.certs import init_ca, issue_server

        directory = tempfile.mkdtemp()
        ca = init_ca(directory)
        cert = issue_server(directory, ["127.0.0.1"])
        key = os.path.join(directory, "server-key.pem")
        _, sim_url = self.start_sim()
        _, url, _ = self.start_server(
            "--endpoint",
            f"s={sim_url}=sim-model",
            "--listen",
            f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={cert}",
        )
        port = int(url.rsplit(":", 1)[1])
        context = ssl.create_default_context(cafile=ca)
        context.set_alpn_protocols(["h2", "http/1.1"])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                self.assertEqual(tls.selected_alpn_protocol(), "h2")
                connection = h2.connection.H2Connection(
                    h2.config.H2Configuration(client_side=True)
                )
                connection.initiate_connection()
                connection.send_headers(
                    1,
                    [
                        (":method", "GET"),
                        (":path", "/v1/models"),
                        (":authority", "127.0.0.1"),
                        (":scheme", "https"),
                    ],
                    end_stream=True,
                )
                tls.sendall(connection.data_to_send())
                body = b""
                status = None
                ended = False
                while not ended:
                    data = tls.recv(65536)
                    self.assertTrue(data, "connection closed")
                    for event in connection.receive_data(data):
                        if isinstance(event, h2.events.ResponseReceived):
                            status = dict(event.headers)[b":status"]
                        elif isinstance(event, h2.events.DataReceived):
                            body += event.data
                        elif isinstance(event, h2.events.StreamEnded):
                            ended = True
                    tls.sendall(connection.data_to_send())
        self.assertEqual(status, b"200")
        self.assertEqual(json.loads(body)["data"][0]["id"], "sim-model")


class ShutdownTests(SynchronousTestCase, Processes):
    """
    Stopping the server.
    """

    timeout = 60

    def test_sigterm_drains_streams(self) -> None:
        """
        On SIGTERM the server stops accepting connections, lets a stream in
        flight run to its end, then exits as a process stopped by SIGTERM,
        without error.
        """
        _, sim_url = self.start_sim("--itl", "0.05")
        server, url, _ = self.start_server("--endpoint", f"s={sim_url}=sim-model")
        port = int(url.rsplit(":", 1)[1])
        stream = client(url).chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=40, stream=True
        )
        chunks = [next(iter(stream))]
        server.popen.send_signal(signal.SIGTERM)
        server.wait_for("draining: waiting up to")
        with self.assertRaises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        chunks.extend(stream)
        self.assertEqual(
            len([c for c in chunks if c.choices and c.choices[0].delta.content]), 40
        )
        # twistd ends by re-raising the signal it stopped on, as a process
        # killed by it would (systemd counts that as a clean stop).
        self.assertEqual(server.popen.wait(10), -signal.SIGTERM)
        self.assertNotIn("Traceback", server.output())


class MisbehavingEngineTests(SynchronousTestCase, Processes):
    """
    Engines that answer badly (tests/fake_upstream.py), and clients that
    send what a gateway must survive.  Each case was found by trying to
    break llmgw.
    """

    timeout = 90

    def setUp(self) -> None:
        from tests.fake_upstream import FakeUpstream

        self.fake = FakeUpstream()
        self.addCleanup(self.fake.stop)
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint",
            f"fake={self.fake.url}=m",
            config='[router]\nmax_event_size = "1MiB"\nmax_response_size = "1MiB"\n'
            'idle_timeout = "20s"\n',
        )
        self.gateway = client(self.url)

    def create(self, mode: str, stream: bool, **extra: Any) -> Any:
        return self.gateway.chat.completions.create(
            model="m",
            messages=MESSAGES,
            stream=stream,
            extra_body={"mode": mode, **extra},
        )

    def test_cut_mid_event(self) -> None:
        """
        A stream whose connection closes cleanly in the middle of an event
        ends with an error event the client can read, after the whole
        events before it, with or without the usage chunk hidden.
        """
        for options in ({}, {"stream_options": {"include_usage": True}}):
            stream = self.gateway.chat.completions.create(
                model="m",
                messages=MESSAGES,
                stream=True,
                extra_body={"mode": "partial_then_drop"},
                **options,
            )
            received = []
            with self.assertRaises(openai.APIError) as raised:
                for chunk in stream:
                    received.append(chunk)
            self.assertEqual(len(received), 1)
            self.assertIn("middle of an event", raised.exception.message)

    def test_event_too_large(self) -> None:
        """
        An event line longer than max_event_size ends the stream with an
        error event instead of growing in memory (and in CPU time).
        """
        stream = self.create("long_line", True, pieces=64)
        with self.assertRaises(openai.APIError) as raised:
            for _ in stream:
                pass
        self.assertIn("max_event_size", raised.exception.message)

    def test_answer_too_large(self) -> None:
        """
        A whole answer over max_response_size is a 502, not an unbounded
        buffer.
        """
        with self.assertRaises(openai.APIStatusError) as raised:
            self.create("big_json", False, size=2 * 1024 * 1024)
        self.assertEqual(raised.exception.status_code, 502)
        self.assertIn("max_response_size", raised.exception.message)

    def test_engine_errors_in_openai_shape(self) -> None:
        """
        Engine errors reach the client as OpenAI error objects: 4xx with the
        engine's message and Retry-After kept, 5xx and 503 without the
        engine's text (it held a traceback and an address), 3xx as a 502.
        """
        with self.assertRaises(openai.BadRequestError) as bad:
            self.create("e400_detail", False)
        self.assertEqual(bad.exception.body["message"], "Field required: messages")  # type: ignore[index]
        with self.assertRaises(openai.BadRequestError) as vllm:
            self.create("e400_vllm", False)
        self.assertEqual(vllm.exception.body["message"], "max_tokens is too large")  # type: ignore[index]
        self.assertEqual(vllm.exception.body["type"], "BadRequestError")  # type: ignore[index]
        self.assertIsNone(vllm.exception.code)
        with self.assertRaises(openai.RateLimitError) as limited:
            self.create("e429", False)
        self.assertEqual(limited.exception.response.headers["retry-after"], "7")
        with self.assertRaises(openai.APIStatusError) as unavailable:
            self.create("e503_traceback", False)
        self.assertEqual(unavailable.exception.status_code, 503)
        self.assertNotIn("10.1.2.3", unavailable.exception.response.text)
        self.assertNotIn("Traceback", unavailable.exception.response.text)
        with self.assertRaises(openai.APIStatusError) as moved:
            self.create("e302", False)
        self.assertEqual(moved.exception.status_code, 502)
        self.assertIn("Traceback", self.server.output())  # logged for the operator

    def test_slow_reader_holds_back_engine(self) -> None:
        """
        A client that stops reading makes llmgw stop reading the engine,
        instead of buffering everything the engine sends.
        """
        port = int(self.url.rsplit(":", 1)[1])
        body = json.dumps(
            {"model": "m", "messages": MESSAGES, "stream": True, "mode": "flood"}
        ).encode()
        with socket.create_connection(("127.0.0.1", port)) as lazy:
            lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            lazy.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            time.sleep(3)
            sent = self.fake.flood_sent
        # The flood is 3000 x 600 events, about 130 MB; held back, only
        # what the socket buffers take gets through.
        self.assertLess(sent, 20 * 1024 * 1024)

    def test_hostile_names_in_logs(self) -> None:
        """
        A 1 MiB model name, and one with a newline and a lone surrogate, are
        logged cut short and escaped; a lone surrogate in a streamed body
        does not break the request.
        """
        before = len(self.server.output())
        with self.assertRaises(openai.NotFoundError):
            self.gateway.chat.completions.create(model="A" * 1024 * 1024, messages=[])
        # The openai client cannot encode a lone surrogate: JSON escapes can.
        status, _, _ = http(
            "POST", self.url + "/v1/chat/completions", b'{"model": "x\\ny\\ud800"}'
        )
        self.assertEqual(status, 404)
        status, _, body = http(
            "POST",
            self.url + "/v1/chat/completions",
            b'{"model": "m", "stream": true, "mode": "e400_detail",'
            b' "messages": [{"role": "user", "content": "\\ud800"}]}',
        )
        self.assertEqual(status, 400, body)
        time.sleep(0.5)
        logged = self.server.output()[before:]
        self.assertLess(len(logged), 5000)
        self.assertIn("model=AAAA", logged)
        self.assertIn("model=x\\ny\\ud800 ", logged)
        self.assertNotIn("Traceback", logged)

    def test_odd_paths(self) -> None:
        """
        Doubled slashes and a path that is not UTF-8 are OpenAI 404 and 400
        errors, not HTML.
        """
        for path, status in (("//v1//models", 404), ("/v1/models/%ED%A0%80", 400)):
            code, headers, body = http("GET", self.url + path)
            self.assertEqual(code, status, path)
            self.assertEqual(headers["content-type"], "application/json")
            self.assertIn("error", json.loads(body))
        self.assertNotIn("Traceback", self.server.output())


class ClosedBeforeAnswerTests(SynchronousTestCase, Processes):
    """
    A replica that closes the connection with the request on it and not a
    byte of an answer.  The fake engine weighs 1000 times the simulator,
    so it is always tried first.
    """

    timeout = 60

    def setUp(self) -> None:
        from tests.fake_upstream import FakeUpstream

        self.fake = FakeUpstream()
        self.addCleanup(self.fake.stop)
        _, self.sim_url = self.start_sim(model="m")
        _, url, _ = self.start_server(
            config=(
                f'[[endpoints]]\nid = "fake"\nurl = "{self.fake.url}"\n'
                'models = ["m"]\nweight = 1000\n'
                f'[[endpoints]]\nid = "sim"\nurl = "{self.sim_url}"\nmodels = ["m"]\n'
            )
        )
        self.gateway = client(url)

    def ask(self, mode: str) -> Any:
        return self.gateway.chat.completions.create(
            model="m", messages=MESSAGES, extra_body={"mode": mode}
        )

    def test_pooled_connection_retried(self) -> None:
        """
        On a connection taken from the pool (the engine may have closed it
        while idle), the request goes to another replica, once.
        """
        self.assertEqual(self.ask("ok").choices[0].message.content, "ok")
        answer = self.ask("close_without_answer")
        self.assertTrue(answer.choices[0].message.content)
        self.assertEqual(self.fake.closed_without_answer, 1)
        self.assertEqual(sim_stats(self.sim_url)["requests_total"], 1)

    def test_new_connection_not_retried(self) -> None:
        """
        On a new connection the engine had the whole request: not sent to
        another engine (a prompt that crashes engines must not crash them
        all); 502, and the replica sits out its cooldown.
        """
        with self.assertRaises(openai.APIStatusError) as raised:
            self.ask("close_without_answer")
        self.assertEqual(raised.exception.status_code, 502)
        self.assertEqual(self.fake.closed_without_answer, 1)
        self.assertEqual(sim_stats(self.sim_url)["requests_total"], 0)
        # Ejected: the next request goes to the simulator.
        self.assertTrue(self.ask("ok").choices[0].message.content)
        self.assertEqual(self.fake.answered, 0)
