"""
Tests for L{llmgw.sim}: the simulator on a real port on 127.0.0.1, ending
with the C{llmgw sim} child process and the official C{openai} client.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import treq
from twisted.internet import reactor as _reactor
from twisted.internet.defer import (
    Deferred,
    ensureDeferred,
)
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ClientFactory, ProcessProtocol, Protocol
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from llmgw.sim.api import (
    completion_text,
)
from llmgw.sim.engine import (
    SimConfig,
    Simulator,
)
from llmgw.sim.web import SimSite
from tests.sim_support import chat_body, dechunk
from tests.support import BIN, Processes, free_port, spawn

reactor: Any = _reactor


# ---------------------------------------------------------------------------
# A real listening port


async def _wait_for(
    predicate: Callable[[], bool], timeout: float = 10.0, step: float = 0.01
) -> None:
    waited = 0.0
    while not predicate():
        if waited > timeout:
            raise AssertionError("condition not reached")
        await deferLater(reactor, step, lambda: None)
        waited += step


class _Raw(Protocol):
    """
    A raw HTTP client: sends one request, collects bytes, optionally aborts
    once C{abort_after} bytes arrived.
    """

    def __init__(self, request: bytes, abort_after: int | None = None) -> None:
        self.request = request
        self.abort_after = abort_after
        self.data = b""
        self.done: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        if self.abort_after is not None and len(self.data) >= self.abort_after:
            self.abort_after = None
            assert self.transport is not None
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.done.callback(self.data)


class ListeningTests(TestCase):
    """
    The simulator on a real port, through treq and raw sockets.
    """

    timeout = 30

    def setUp(self) -> None:
        self.start()

    def start(self, **config: Any) -> None:
        self.sim = Simulator(SimConfig(models=("m", "other"), **config), reactor)
        self.port = reactor.listenTCP(0, SimSite(self.sim), interface="127.0.0.1")
        self.base = f"http://127.0.0.1:{self.port.getHost().port}"
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.stopped = False
        self.addCleanup(self.stop)

    async def _stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        await self.pool.closeCachedConnections()
        await _wait_for(lambda: self.sim.stats.connections_open == 0)
        await self.port.stopListening()

    def stop(self) -> Deferred[None]:
        return ensureDeferred(self._stop())

    async def post(self, path: str, body: object) -> tuple[int, Any]:
        response = await treq.post(
            self.base + path, json=body, pool=self.pool, unbuffered=True
        )
        return response.code, await response.json()

    async def get(self, path: str) -> tuple[int, bytes]:
        response = await treq.get(self.base + path, pool=self.pool)
        return response.code, await response.content()

    async def raw(self, request: bytes, abort_after: int | None = None) -> bytes:
        proto = _Raw(request, abort_after)
        factory = ClientFactory.forProtocol(lambda: proto)
        reactor.connectTCP("127.0.0.1", self.port.getHost().port, factory)
        return await proto.done

    def test_chat_non_stream(self) -> Deferred[None]:
        async def go() -> None:
            code, answer = await self.post(
                "/v1/chat/completions",
                {"model": "m", "messages": [{"role": "user", "content": "hi there"}]},
            )
            self.assertEqual(code, 200)
            self.assertEqual(answer["object"], "chat.completion")
            self.assertEqual(answer["model"], "m")
            message = answer["choices"][0]["message"]
            self.assertEqual(message["role"], "assistant")
            self.assertEqual(message["content"], completion_text(b"hi there", 16))
            self.assertEqual(answer["choices"][0]["finish_reason"], "length")
            self.assertEqual(
                answer["usage"],
                {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18},
            )

        return ensureDeferred(go())

    def test_stream_with_usage(self) -> Deferred[None]:
        """
        A streamed chat, parsed as SSE: role chunk, tokens, finish chunk,
        usage-only chunk, [DONE]; every other chunk has usage null.
        """

        async def go() -> None:
            response = await treq.post(
                self.base + "/v1/chat/completions",
                json=chat_body(
                    5, model="other", stream_options={"include_usage": True}
                ),
                pool=self.pool,
                unbuffered=True,
            )
            self.assertEqual(
                response.headers.getRawHeaders(b"content-type"), [b"text/event-stream"]
            )
            self.assertEqual(
                response.headers.getRawHeaders(b"cache-control"), [b"no-cache"]
            )
            body = await response.content()
            events = body.split(b"\n\n")
            self.assertEqual(events[-2:], [b"data: [DONE]", b""])
            chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
            self.assertEqual(
                chunks[0]["choices"][0]["delta"], {"role": "assistant", "content": ""}
            )
            self.assertEqual(
                "".join(
                    c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]
                ),
                completion_text(b"hello", 5),
            )
            self.assertEqual(chunks[-2]["choices"][0]["finish_reason"], "length")
            self.assertEqual(chunks[-1]["choices"], [])
            self.assertEqual(
                chunks[-1]["usage"],
                {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6},
            )
            self.assertTrue(all(c["usage"] is None for c in chunks[:-1]))
            self.assertTrue(all(c["model"] == "other" for c in chunks))
            self.assertTrue(all(c["object"] == "chat.completion.chunk" for c in chunks))
            self.assertEqual(len({c["id"] for c in chunks}), 1)

        return ensureDeferred(go())

    def test_embeddings_models_health(self) -> Deferred[None]:
        async def go() -> None:
            code, answer = await self.post(
                "/v1/embeddings", {"model": "m", "input": ["a", "b c"]}
            )
            self.assertEqual(code, 200)
            self.assertEqual(answer["object"], "list")
            self.assertEqual([d["index"] for d in answer["data"]], [0, 1])
            self.assertEqual(len(answer["data"][0]["embedding"]), 16)
            # vLLM's usage names a completion count of 0 (its UsageInfo).
            self.assertEqual(
                answer["usage"],
                {"prompt_tokens": 3, "total_tokens": 3, "completion_tokens": 0},
            )
            code, body = await self.get("/v1/models")
            models = json.loads(body)
            self.assertEqual([m["id"] for m in models["data"]], ["m", "other"])
            self.assertEqual(models["data"][0]["owned_by"], "llmgw-sim")
            code, body = await self.get("/health")
            self.assertEqual(code, 200)

        return ensureDeferred(go())

    def test_errors(self) -> Deferred[None]:
        """
        Unknown model: 404 model_not_found; bad JSON: 400; a status fault:
        that status; an unknown fault key: 400 naming it.
        """

        async def go() -> None:
            code, answer = await self.post(
                "/v1/chat/completions", chat_body(1, model="nope", stream=False)
            )
            self.assertEqual(code, 404)
            self.assertEqual(answer["error"]["code"], "model_not_found")
            self.assertEqual(set(answer["error"]), {"message", "type", "param", "code"})
            response = await treq.post(
                self.base + "/v1/completions", data=b"{nope", pool=self.pool
            )
            self.assertEqual(response.code, 400)
            self.assertIn("error", await response.json())
            code, answer = await self.post(
                "/v1/chat/completions", chat_body(1, llmgw_sim={"status": 503})
            )
            self.assertEqual(code, 503)
            self.assertEqual(answer["error"]["type"], "server_error")
            code, answer = await self.post(
                "/v1/chat/completions", chat_body(1, llmgw_sim={"frobnicate": 1})
            )
            self.assertEqual(code, 400)
            self.assertIn("frobnicate", answer["error"]["message"])
            code, answer = await self.post("/sim/fault", {"frobnicate": 1})
            self.assertEqual(code, 400)
            self.assertEqual(self.sim.stats.streams_started, 0)

        return ensureDeferred(go())

    def test_drop_after_chunks(self) -> Deferred[None]:
        """
        The client sees the connection end after N events, unfinished.
        """

        async def go() -> None:
            body = json.dumps(
                chat_body(10, llmgw_sim={"drop_after_chunks": 3})
            ).encode()
            data = await self.raw(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            _, _, rest = data.partition(b"\r\n\r\n")
            payload, complete = dechunk(rest)
            self.assertFalse(complete)
            self.assertEqual(payload.count(b"data: "), 3)
            self.assertEqual(self.sim.stats.streams_dropped, 1)
            self.assertEqual(self.sim.scheduler.running, 0)

        return ensureDeferred(go())

    def test_client_disconnect_counted(self) -> Deferred[None]:
        """
        A client leaving mid-stream is counted in streams_cancelled, with
        last_cancel_time, and frees its slot.
        """

        async def go() -> None:
            await self.stop()
            self.start(itl=0.02)
            body = json.dumps(chat_body(10_000)).encode()
            before = reactor.seconds()
            await self.raw(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body,
                abort_after=1000,
            )
            await _wait_for(lambda: self.sim.stats.streams_cancelled == 1)
            code, raw = await self.get("/sim/stats")
            stats = json.loads(raw)
            self.assertEqual(stats["streams_started"], 1)
            self.assertEqual(stats["streams_completed"], 0)
            self.assertEqual(stats["running"], 0)
            self.assertGreaterEqual(stats["last_cancel_time"], before)
            code, raw = await self.post("/sim/stats/reset", {})
            self.assertEqual(raw["streams_cancelled"], 0)
            self.assertIsNone(raw["last_cancel_time"])

        return ensureDeferred(go())

    def test_queueing_visible(self) -> Deferred[None]:
        """
        With one slot, a second request waits, as /sim/stats and /metrics
        show, and runs when the first ends.
        """

        async def go() -> None:
            await self.stop()
            self.start(itl=0.02, max_concurrency=1)
            # The first runs 2 s, so that the second is still waiting when
            # looked at on a loaded machine.
            first = ensureDeferred(
                self.post(
                    "/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 100}
                )
            )
            second = ensureDeferred(
                self.post(
                    "/v1/completions", {"model": "m", "prompt": "b", "max_tokens": 2}
                )
            )
            await _wait_for(lambda: self.sim.scheduler.waiting == 1)
            code, raw = await self.get("/sim/stats")
            stats = json.loads(raw)
            self.assertEqual((stats["running"], stats["waiting"]), (1, 1))
            code, metrics = await self.get("/metrics")
            self.assertIn(
                b'vllm:num_requests_running{engine="0",model_name="m"} 1.0', metrics
            )
            self.assertIn(
                b'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0', metrics
            )
            self.assertIn(
                b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.0', metrics
            )
            (c1, _), (c2, a2) = await first, await second
            self.assertEqual((c1, c2), (200, 200))
            self.assertEqual(a2["choices"][0]["text"], completion_text(b"b", 2))
            code, metrics = await self.get("/metrics")
            self.assertIn(
                b"vllm:request_success_total"
                b'{engine="0",finished_reason="length",model_name="m"} 2.0',
                metrics,
            )
            # 100 + 2 tokens.
            self.assertIn(
                b'vllm:generation_tokens_total{engine="0",model_name="m"} 102.0',
                metrics,
            )
            self.assertIn(b"vllm:e2e_request_latency_seconds_count", metrics)
            self.assertIn(b"vllm:time_to_first_token_seconds_count", metrics)
            self.assertIn(b"vllm:inter_token_latency_seconds_count", metrics)
            self.assertIn(b"vllm:prompt_tokens_total", metrics)

        return ensureDeferred(go())

    def test_byte_writes_split_characters(self) -> Deferred[None]:
        """
        Under byte_writes the stream arrives in many pieces, some splitting
        a UTF-8 character, and still decodes to the completion.
        """

        async def go() -> None:
            response = await treq.post(
                self.base + "/v1/chat/completions",
                json=chat_body(6, llmgw_sim={"byte_writes": True}),
                pool=self.pool,
                unbuffered=True,
            )
            pieces: list[bytes] = []
            await treq.collect(response, pieces.append)
            body = b"".join(pieces)
            self.assertGreater(len(pieces), 10)
            text = "".join(
                json.loads(e.removeprefix(b"data: "))["choices"][0]["delta"].get(
                    "content", ""
                )
                for e in body.split(b"\n\n")[:-2]
            )
            self.assertEqual(text, completion_text(b"hello", 6))
            self.assertTrue(any(len(t.encode()) > len(t) for t in text))

        return ensureDeferred(go())


class _Child(ProcessProtocol):
    def __init__(self) -> None:
        self.out = b""
        self.err = b""
        self.listening: Deferred[str] = Deferred()
        self.ended: Deferred[BaseException] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.out += data
        if b"\n" in self.out and not self.listening.called:
            self.listening.callback(self.out.split(b"\n", 1)[0].decode())

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def processEnded(self, reason: Failure) -> None:
        if not self.listening.called:
            self.listening.errback(reason)
        assert reason.value is not None
        self.ended.callback(reason.value)


class ChildProcessTests(TestCase):
    """
    C{llmgw sim} as a user runs it, driven by the official openai client.
    """

    timeout = 60

    def test_openai_client_against_child(self) -> Deferred[None]:
        async def go() -> None:
            child = _Child()
            env = dict(os.environ)
            env["PYTHONUNBUFFERED"] = "1"
            process = reactor.spawnProcess(
                child,
                sys.executable,
                [
                    sys.executable,
                    "-m",
                    "llmgw.cli.main",
                    "sim",
                    "--port",
                    "0",
                    "--model",
                    "m",
                ],
                env=env,
            )
            try:
                line = await child.listening
                prefix = "llmgw sim listening on "
                self.assertTrue(line.startswith(prefix), line)
                url = line[len(prefix) :]

                def call() -> tuple[str, list[str]]:
                    from openai import OpenAI

                    client = OpenAI(
                        base_url=url + "/v1", api_key="x", max_retries=0, timeout=10
                    )
                    try:
                        whole = client.chat.completions.create(
                            model="m",
                            messages=[{"role": "user", "content": "hello"}],
                            max_tokens=4,
                        )
                        pieces = []
                        for chunk in client.chat.completions.create(
                            model="m",
                            messages=[{"role": "user", "content": "hello"}],
                            max_tokens=4,
                            stream=True,
                            extra_body={"llmgw_sim": {"byte_writes": True}},
                        ):
                            if chunk.choices and chunk.choices[0].delta.content:
                                pieces.append(chunk.choices[0].delta.content)
                        return whole.choices[0].message.content or "", pieces
                    finally:
                        client.close()

                whole, pieces = await deferToThread(call)
                self.assertEqual(whole, completion_text(b"hello", 4))
                self.assertEqual("".join(pieces), whole)
            finally:
                if process.pid is not None:
                    process.signalProcess("TERM")
                reason = await child.ended
            self.assertIsInstance(reason, (ProcessDone, ProcessTerminated))
            self.assertEqual(getattr(reason, "exitCode", None), 0, child.err)

        return ensureDeferred(go())


class LoadSecondsTests(Processes, TestCase):
    """
    C{--load-seconds}: the port stays closed while the simulator
    "loads", as a real engine's does until its weights are in.
    """

    timeout = 30

    def test_port_closed_while_loading(self) -> None:
        port = free_port()
        started = time.monotonic()
        process = spawn(
            [
                os.path.join(BIN, "llmgw"),
                "sim",
                "--port",
                str(port),
                "--model",
                "m",
                "--load-seconds",
                "1.5",
            ],
            self._directory(),
            "sim-load",
        )
        self.addCleanup(process.stop)
        time.sleep(0.5)
        with self.assertRaises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        process.wait_for("llmgw sim listening on")
        self.assertGreaterEqual(time.monotonic() - started, 1.5)
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
