"""
End to end: balancing and retries across replicas, and engines that
misbehave.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import openai
from openai.types.chat import ChatCompletionStreamOptionsParam
from twisted.trial.unittest import SynchronousTestCase

from tests.support import Processes, closed_port, http, sim_stats
from tests.test_e2e_router import MESSAGES, client


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
        both: tuple[ChatCompletionStreamOptionsParam | openai.Omit, ...] = (
            openai.omit,
            {"include_usage": True},
        )
        for options in both:
            stream = self.gateway.chat.completions.create(
                model="m",
                messages=MESSAGES,
                stream=True,
                extra_body={"mode": "partial_then_drop"},
                stream_options=options,
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
        engine's message and Retry-After kept, 503 without the engine's
        text (it held a traceback and an address), 3xx as a 502.
        """
        with self.assertRaises(openai.BadRequestError) as bad:
            self.create("e400_detail", False)
        self.assertEqual(bad.exception.body["message"], "Field required: messages")
        with self.assertRaises(openai.BadRequestError) as vllm:
            self.create("e400_vllm", False)
        self.assertEqual(vllm.exception.body["message"], "max_tokens is too large")
        self.assertEqual(vllm.exception.body["type"], "BadRequestError")
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

    def test_engine_5xx_error_objects_passed_on(self) -> None:
        """
        An engine's own 5xx error object (OpenAI's shape, older vLLM's
        top-level one) reaches the client with the engine's status, message,
        type, string code and Retry-After, streamed or not, sent once (a
        500 is not retried); a traceback in the message stays in the
        operator's log (the client gets the status and a plain sentence);
        an answer that is no error object (plain text, JSON labelled HTML,
        JSON of another shape) is a 502.
        """
        for stream in (False, True):
            before = len(self.fake.received)
            with self.assertRaises(openai.InternalServerError) as oom:
                self.create("e500_openai", stream)
            self.assertEqual(len(self.fake.received), before + 1)
            error = oom.exception
            self.assertEqual(error.status_code, 500, stream)
            self.assertEqual(error.body["message"], "CUDA out of memory on this batch")
            self.assertEqual(error.body["type"], "server_error")
            self.assertEqual(error.code, "engine_oom")
            self.assertEqual(error.response.headers["retry-after"], "3")
        # Older vLLM's top-level shape; its EngineDeadError answer is not
        # passed on but retried elsewhere (tests/test_e2e_engine_truth.py).
        with self.assertRaises(openai.InternalServerError) as vllm:
            self.create("e500_vllm", False)
        self.assertEqual(vllm.exception.status_code, 500)
        self.assertEqual(
            vllm.exception.body["message"], "CUDA error: illegal memory access"
        )
        self.assertEqual(vllm.exception.body["type"], "InternalServerError")
        self.assertIsNone(vllm.exception.code)
        with self.assertRaises(openai.APIStatusError) as gateway:
            self.create("e502_openai", False)
        self.assertEqual(gateway.exception.status_code, 502)
        self.assertEqual(
            gateway.exception.body["message"], "upstream of the engine failed"
        )
        with self.assertRaises(openai.InternalServerError) as traced:
            self.create("e500_traceback", False)
        self.assertEqual(traced.exception.status_code, 500)
        self.assertEqual(
            traced.exception.body["message"],
            "The replica failed the request with status 500.",
        )
        self.assertNotIn("10.1.2.3", traced.exception.response.text)
        self.assertNotIn("Traceback", traced.exception.response.text)
        self.server.wait_for("secret.py")  # logged for the operator
        for broken in ("e500_text", "e500_html_json", "e500_other_json"):
            with self.assertRaises(openai.APIStatusError) as bad:
                self.create(broken, False)
            self.assertEqual(bad.exception.status_code, 502, broken)
            self.assertEqual(
                bad.exception.body["message"],
                "The replica answered with status 500.",
                broken,
            )

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
