"""
Claude Code's first request (C{tests/data/claude_code_first_request.json},
captured from Claude Code 2.1.332) replayed end to end: C{twistd -n
llmgw-server} in front of C{llmgw sim --reasoning-parser}, over sockets, as
Claude Code sends it (to C{/v1/messages?beta=true}, its headers, streamed)
and through the official C{anthropic} SDK's beta client, whose stream
accumulator checks the thinking blocks' events.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any

import anthropic
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.upstream.sse import SSEParser
from llmgw.sim.length import NATURAL_MIN, NATURAL_SPAN
from tests.support import CtlMixin, Processes
from tests.test_anthropic_agents import claude_code_request

MODEL = "sim-model"


class ClaudeCodeReplayTests(SynchronousTestCase, Processes, CtlMixin):
    timeout = 120

    def setUp(self) -> None:
        _, sim = self.start_sim("--reasoning-parser", "qwen3")
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={sim}={MODEL}"
        )
        made = self.ctl("keys", "create", "--name", f"k{uuid.uuid4().hex[:6]}")
        self.key = made.stdout.splitlines()[0].strip()
        captured = claude_code_request()
        self.path: str = captured["path"]
        self.headers: dict[str, str] = captured["headers"]
        self.body: dict[str, Any] = {**captured["body"], "model": MODEL}

    def test_as_sent(self) -> None:
        """
        The captured body, C{max_tokens} 32000 and all, posted as Claude
        Code posts it, is answered 200 with a stream of a text block only
        (its thinking is C{display: omitted}), ending in C{message_stop};
        the sim's answer ends by itself (C{end_turn}) at its natural length,
        far below the cap; the usage row holds the engine's counts.
        """
        rid = str(uuid.uuid4())
        request = urllib.request.Request(
            self.url + self.path,
            data=json.dumps(self.body).encode(),
            headers={**self.headers, "x-api-key": self.key, "X-Request-ID": rid},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            self.assertEqual(response.status, 200)
            data = response.read()
        events = [
            (e.event.decode() if e.event else "", json.loads(e.data))
            for e in SSEParser(1 << 20).feed(data)
        ]
        blocks = [
            p["content_block"]["type"] for k, p in events if k == "content_block_start"
        ]
        self.assertEqual(blocks, ["text"])
        self.assertEqual(events[-1][0], "message_stop")
        usage = events[-2][1]["usage"]
        self.assertEqual(events[-2][1]["delta"]["stop_reason"], "end_turn")
        self.assertGreaterEqual(usage["output_tokens"], NATURAL_MIN)
        self.assertLess(usage["output_tokens"], NATURAL_MIN + NATURAL_SPAN)
        match = self.server.wait_for(
            rf"request \S+ client_id={rid} .*status=200"
            r" prompt_tokens=(\d+) completion_tokens=(\d+)"
        )
        self.assertEqual(
            (int(match.group(1)), int(match.group(2))),
            (usage["input_tokens"], usage["output_tokens"]),
        )

    def test_sdk_beta_stream_with_thinking(self) -> None:
        """
        The same request through the SDK's beta client (which posts to
        C{/v1/messages?beta=true} with its C{anthropic-beta} header), its
        thinking shown: the SDK's accumulator builds a thinking block with
        its signature, then the text.
        """
        client = anthropic.Anthropic(base_url=self.url, api_key=self.key, max_retries=0)
        body = dict(self.body)
        for name in ("model", "stream", "max_tokens"):
            del body[name]
        body["thinking"] = {"type": "adaptive", "display": "summarized"}
        with client.beta.messages.stream(
            model=MODEL,
            max_tokens=8,
            betas=self.headers["anthropic-beta"].split(","),
            **body,
        ) as stream:
            final = stream.get_final_message()
        kinds = [block.type for block in final.content]
        self.assertEqual(kinds, ["thinking", "text"])
        thinking = final.content[0]
        assert thinking.type == "thinking"
        self.assertTrue(thinking.thinking)
        self.assertTrue(thinking.signature)
        self.assertEqual(final.usage.output_tokens, 8)
