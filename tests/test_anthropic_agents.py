"""
The Messages API as coding agents send it (L{llmgw.router.api.anthropic},
L{llmgw.router.api.anthropic_fields}, L{llmgw.router.api.anthropic_stream}),
pure: Claude Code's first request as captured (C{tests/data/}), every field
of the API translated or left out as docs/anthropic.md says, and the
engine's reasoning as C{thinking} blocks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.api.anthropic import MESSAGES_PATH, Invalid, MessagesCall, to_chat
from llmgw.router.api.anthropic_fields import shows_thinking
from llmgw.router.api.anthropic_stream import MessagesStream
from llmgw.router.upstream.sse import SSEParser

CAPTURE = Path(__file__).parent / "data" / "claude_code_first_request.json"


def claude_code_request() -> dict[str, Any]:
    """
    @return: Claude Code 2.1.332's first request, as captured:
        C{path}, C{headers} and C{body}.
    """
    loaded: dict[str, Any] = json.loads(CAPTURE.read_text("utf-8"))
    return loaded


def _base(**fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


TOOL = {"name": "Bash", "input_schema": {"type": "object"}}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return b"data: " + json.dumps({"id": "c", "choices": [choice]}).encode() + b"\n\n"


REASONING_STREAM = (
    _chunk({"role": "assistant", "content": ""})
    + _chunk({"reasoning": "Let me"})
    + _chunk({"reasoning_content": " think."})
    + _chunk({"content": "Hello"})
    + _chunk({}, "stop")
    + b"data: [DONE]\n\n"
)


def _kinds(out: bytes) -> list[tuple[str, dict[str, Any]]]:
    return [
        (e.event.decode() if e.event else "", json.loads(e.data))
        for e in SSEParser().feed(out)
    ]


class ClaudeCodeRequestTests(SynchronousTestCase):
    def test_first_request_translates(self) -> None:
        """
        Claude Code's first request (system blocks with C{cache_control},
        a C{system} message inside C{messages}, 12 tools one of them
        deferred, adaptive thinking with display omitted,
        C{context_management}, C{output_config}, C{metadata},
        C{max_tokens} 32000) becomes one chat request: one system message
        holding the top-level system text then the inline one, the user
        turn, 11 functions, the effort as C{reasoning_effort}.
        """
        body = claude_code_request()["body"]
        self.assertEqual([m["role"] for m in body["messages"]], ["user", "system"])
        chat = to_chat(body)
        roles = [m["role"] for m in chat["messages"]]
        self.assertEqual(roles, ["system", "user"])
        system = chat["messages"][0]["content"]
        self.assertTrue(system.startswith(body["system"][0]["text"]))
        inline = body["messages"][1]["content"][0]["text"]
        self.assertTrue(system.endswith(inline))
        self.assertEqual(len(body["tools"]), 12)
        names = [t["function"]["name"] for t in chat["tools"]]
        self.assertEqual(len(names), 11)
        self.assertNotIn("DeferredToolPlaceholder", names)
        self.assertEqual(chat["max_tokens"], 32000)
        self.assertEqual(chat["reasoning_effort"], "high")
        self.assertTrue(chat["stream"])
        self.assertIn("device_id", chat["user"])
        self.assertFalse(shows_thinking(body))


class FieldTests(SynchronousTestCase):
    def test_thinking(self) -> None:
        """
        C{thinking} maps as vLLM's own route maps it: C{enabled} to
        C{thinking_token_budget}, C{disabled} to C{reasoning_effort: none}
        (over an effort), C{adaptive} to nothing; thinking blocks are
        shown unless disabled or C{display: omitted}.
        """
        enabled = _base(thinking={"type": "enabled", "budget_tokens": 2048})
        self.assertEqual(to_chat(enabled)["thinking_token_budget"], 2048)
        self.assertTrue(shows_thinking(enabled))
        disabled = _base(thinking={"type": "disabled"}, output_config={"effort": "low"})
        self.assertEqual(to_chat(disabled)["reasoning_effort"], "none")
        self.assertFalse(shows_thinking(disabled))
        adaptive = _base(thinking={"type": "adaptive", "display": "summarized"})
        chat = to_chat(adaptive)
        self.assertNotIn("reasoning_effort", chat)
        self.assertNotIn("thinking_token_budget", chat)
        self.assertTrue(shows_thinking(adaptive))

    def test_output_config_format(self) -> None:
        """
        A JSON schema in C{output_config.format} (or the beta's
        C{output_format}) is chat's C{response_format}.
        """
        schema = {"type": "object", "properties": {"a": {"type": "string"}}}
        for fields in (
            {"output_config": {"format": {"type": "json_schema", "schema": schema}}},
            {"output_format": {"type": "json_schema", "schema": schema}},
        ):
            self.assertEqual(
                to_chat(_base(**fields))["response_format"],
                {
                    "type": "json_schema",
                    "json_schema": {"name": "json_schema", "schema": schema},
                },
            )

    def test_left_out_fields(self) -> None:
        """
        C{context_management}, C{container}, C{service_tier},
        C{inference_geo}, C{cache_control} on blocks and tools, and an
        Anthropic server tool are accepted and change nothing the engine
        sees.
        """
        plain = to_chat(_base(tools=[TOOL]))
        busy = to_chat(
            _base(
                tools=[
                    {**TOOL, "cache_control": {"type": "ephemeral"}},
                    {"type": "web_search_20250305", "name": "web_search"},
                ],
                context_management={"edits": [{"type": "clear_thinking_20251015"}]},
                container="c1",
                service_tier="auto",
                inference_geo="us",
                speed="fast",
                fallbacks="default",
                cache_control={"type": "ephemeral"},
                thread={"type": "create"},
                diagnostics={"previous_message_id": "msg_1"},
                system=[{"type": "text", "text": "s", "cache_control": {"type": "x"}}],
            )
        )
        del busy["messages"][0]
        self.assertEqual(busy, plain)

    def test_tool_choice_forms(self) -> None:
        """
        C{auto}, C{any}, C{tool}, C{none} and C{disable_parallel_tool_use}
        all translate; forcing a tool the engine is not shown is a 400
        naming C{tool_choice.name}.
        """
        cases: list[tuple[dict[str, Any], Any]] = [
            ({"type": "auto"}, "auto"),
            ({"type": "any"}, "required"),
            ({"type": "none"}, "none"),
            (
                {"type": "tool", "name": "Bash"},
                {"type": "function", "function": {"name": "Bash"}},
            ),
        ]
        for choice, expected in cases:
            chat = to_chat(_base(tools=[TOOL], tool_choice=choice))
            self.assertEqual(chat["tool_choice"], expected)
        chat = to_chat(
            _base(
                tools=[TOOL],
                tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            )
        )
        self.assertIs(chat["parallel_tool_calls"], False)
        with self.assertRaises(Invalid) as caught:
            to_chat(
                _base(
                    tools=[{"type": "web_search_20250305", "name": "web_search"}],
                    tool_choice={"type": "tool", "name": "web_search"},
                )
            )
        self.assertEqual(caught.exception.param, "tool_choice.name")

    def test_deferred_tool_shown_once_referenced(self) -> None:
        """
        A C{defer_loading} tool is left out until a C{tool_reference} in a
        tool result names it; the reference reads as text.
        """
        deferred = {**TOOL, "name": "WebFetch", "defer_loading": True}
        self.assertEqual(
            [
                t["function"]["name"]
                for t in to_chat(_base(tools=[TOOL, deferred]))["tools"]
            ],
            ["Bash"],
        )
        reference = {"type": "tool_reference", "tool_name": "WebFetch"}
        turns = [
            {"role": "user", "content": "fetch it"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [reference]}
                ],
            },
        ]
        chat = to_chat(_base(tools=[TOOL, deferred], messages=turns))
        self.assertEqual(
            [t["function"]["name"] for t in chat["tools"]], ["Bash", "WebFetch"]
        )
        self.assertEqual(
            chat["messages"][-1],
            {"role": "tool", "tool_call_id": "t1", "content": "Tool loaded: WebFetch"},
        )

    def test_documents_and_system_messages(self) -> None:
        """
        Document blocks of every source become parts or text; a C{system}
        message between turns joins the system prompt in order.
        """
        docs = [
            {"type": "document", "source": {"type": "text", "data": "plain"}},
            {
                "type": "document",
                "source": {
                    "type": "content",
                    "content": [{"type": "text", "text": "c"}],
                },
            },
            {
                "type": "document",
                "title": "a.pdf",
                "source": {
                    "type": "base64",
                    "media_type": "application/pdf",
                    "data": "QQ==",
                },
            },
            {"type": "document", "source": {"type": "file", "file_id": "file_1"}},
        ]
        chat = to_chat(
            _base(
                system="first",
                messages=[
                    {"role": "user", "content": docs},
                    {"role": "system", "content": "second"},
                ],
            )
        )
        self.assertEqual(
            chat["messages"],
            [
                {"role": "system", "content": "first\n\nsecond"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "plain"},
                        {"type": "text", "text": "c"},
                        {
                            "type": "file",
                            "file": {
                                "file_data": "data:application/pdf;base64,QQ==",
                                "filename": "a.pdf",
                            },
                        },
                        {"type": "file", "file": {"file_id": "file_1"}},
                    ],
                },
            ],
        )

    def test_refused_fields(self) -> None:
        """
        What cannot be honoured is a 400 naming the field: MCP servers,
        compaction, a thread to continue, a thinking type or budget of the
        wrong shape.
        """
        for fields, param in (
            (
                {"mcp_servers": [{"type": "url", "url": "x", "name": "n"}]},
                "mcp_servers",
            ),
            ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
            ({"compaction": {"type": "auto"}}, "compaction"),
            ({"thread": {"type": "continue"}}, "thread.type"),
            ({"thinking": {"type": "deep"}}, "thinking.type"),
            (
                {"output_config": {"format": {"type": "xml"}}},
                "output_config.format.type",
            ),
        ):
            with self.assertRaises(Invalid) as caught:
                to_chat(_base(**fields))
            self.assertEqual(caught.exception.param, param)


class ThinkingAnswerTests(SynchronousTestCase):
    def test_whole(self) -> None:
        """
        A chat answer's C{reasoning} is a first C{thinking} block with a
        C{signature}; left out when the request omits thinking.
        """
        answer = {
            "id": "c",
            "choices": [
                {
                    "index": 0,
                    "message": {"content": "Hello", "reasoning": "Let me think."},
                    "finish_reason": "stop",
                }
            ],
        }
        call = MessagesCall(b"", MESSAGES_PATH, "m")
        body, _ = call.whole(json.dumps(answer).encode(), False)
        content = json.loads(body)["content"]
        self.assertEqual([b["type"] for b in content], ["thinking", "text"])
        self.assertEqual(content[0]["thinking"], "Let me think.")
        self.assertTrue(content[0]["signature"])
        hidden = MessagesCall(b"", MESSAGES_PATH, "m", thinking=False)
        body, _ = hidden.whole(json.dumps(answer).encode(), False)
        self.assertEqual([b["type"] for b in json.loads(body)["content"]], ["text"])

    def test_stream(self) -> None:
        """
        Reasoning deltas (C{reasoning}, and the older C{reasoning_content})
        stream as a thinking block: C{thinking_delta}s, a
        C{signature_delta}, its stop; then the text block.
        """
        relay = MessagesStream(1 << 20, "m")
        data = REASONING_STREAM
        out = b"".join(relay.feed(data[i : i + 7]) for i in range(0, len(data), 7))
        events = _kinds(out + relay.end())
        self.assertEqual(
            [
                (kind, p.get("delta", p.get("content_block", {})).get("type"))
                for kind, p in events
            ],
            [
                ("message_start", None),
                ("content_block_start", "thinking"),
                ("content_block_delta", "thinking_delta"),
                ("content_block_delta", "thinking_delta"),
                ("content_block_delta", "signature_delta"),
                ("content_block_stop", None),
                ("content_block_start", "text"),
                ("content_block_delta", "text_delta"),
                ("content_block_stop", None),
                ("message_delta", None),
                ("message_stop", None),
            ],
        )
        self.assertEqual(
            events[2][1]["delta"]["thinking"] + events[3][1]["delta"]["thinking"],
            "Let me think.",
        )
        self.assertEqual(events[6][1]["index"], 1)

    def test_stream_omitted(self) -> None:
        """
        With thinking omitted the reasoning deltas are dropped: the text
        block is the first.
        """
        relay = MessagesStream(1 << 20, "m", thinking=False)
        events = _kinds(relay.feed(REASONING_STREAM) + relay.end())
        starts = [
            p["content_block"]["type"] for k, p in events if k == "content_block_start"
        ]
        self.assertEqual(starts, ["text"])
