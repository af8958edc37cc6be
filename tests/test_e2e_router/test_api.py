"""
End to end: the OpenAI API in front of one simulated engine, and its
deadlines.
"""

from __future__ import annotations

import json
import time

import openai
from openai.types.chat import ChatCompletionStreamOptionsParam
from twisted.trial.unittest import SynchronousTestCase

from tests.support import Processes, http, sim_stats
from tests.test_e2e_router import MESSAGES, client, stream_text


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
        both: tuple[ChatCompletionStreamOptionsParam | None, ...] = (
            None,
            {"include_usage": True},
        )
        for options in both:
            text, chunks = stream_text(
                self.gateway.chat.completions.create(
                    model="sim-model",
                    messages=MESSAGES,
                    max_tokens=8,
                    stream=True,
                    extra_body={"llmgw_sim": {"byte_writes": True}},
                    stream_options=options if options else openai.omit,
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
