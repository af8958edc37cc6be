"""
OpenAI's Responses API end to end: C{twistd -n llmgw-server} in front of
C{llmgw sim} (chat completions only: llmgw translates), with keys made by
C{llmgw ctl}, through the official C{openai} SDK (C{responses.create},
C{responses.stream}) and the OpenAI Agents SDK (an agent whose function tool
the sim calls, as its prompt tells it: docs/sim.md); a chat engine that
calls tools in known pieces (L{tests.test_e2e_anthropic.ToolEngine}) for
function calls both ways; two servers on one PostgreSQL database for a
continuation elsewhere.  Usage is read from the server's per-request log
lines, found by the C{X-Request-ID} each request sends, and from C{llmgw ctl
usage}.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests import test_e2e_anthropic as anthropic_e2e
from tests.pg_support import fresh_database
from tests.support import (
    CtlMixin,
    Process,
    Processes,
    http,
    logged_usage,
    sim_stats,
    until_known,
)


def _rid() -> str:
    return str(uuid.uuid4())


class ResponsesThroughSimTests(SynchronousTestCase, Processes, CtlMixin):
    timeout = 120

    def setUp(self) -> None:
        _, self.sim = self.start_sim("--max-tokens", "5", "--itl", "0.01")
        self.state = f"state-{uuid.uuid4().hex[:8]}"
        self.start()
        self.key = self.make_key()

    def start(self) -> None:
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={self.sim}=sim-model", state=self.state
        )

    def make_key(self) -> str:
        made = self.ctl("keys", "create", "--name", f"k{uuid.uuid4().hex[:6]}")
        return made.stdout.splitlines()[0].strip()

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=key or self.key, max_retries=0
        )

    def test_create_and_stream(self) -> None:
        """
        C{responses.create} with a string and with items, and
        C{responses.stream}, answer Response objects whose usage is the
        sim's counts, the same as the usage rows; a length that runs out
        is C{incomplete} (C{max_output_tokens}).
        """
        client = self.client()
        rid = _rid()
        response = client.responses.create(
            model="sim-model",
            input="say hello",
            instructions="be brief",
            max_output_tokens=4,
            extra_headers={"X-Request-ID": rid},
        )
        self.assertTrue(response.id.startswith("resp_"))
        self.assertEqual((response.object, response.model), ("response", "sim-model"))
        self.assertEqual(response.status, "incomplete")
        assert response.incomplete_details is not None
        self.assertEqual(response.incomplete_details.reason, "max_output_tokens")
        self.assertEqual(response.output[0].type, "message")
        self.assertTrue(response.output_text)
        assert response.usage is not None
        self.assertEqual(response.usage.output_tokens, 4)
        self.assertEqual(
            logged_usage(self.server, rid),
            (200, response.usage.input_tokens, response.usage.output_tokens),
        )
        items: Any = [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ]
        rid = _rid()
        with client.responses.stream(
            model="sim-model",
            input=items,
            max_output_tokens=3,
            extra_headers={"X-Request-ID": rid},
        ) as stream:
            events = list(stream)
        # An incomplete Response ends its stream with response.incomplete,
        # not response.completed (the SDK's get_final_response wants one).
        kinds = [event.type for event in events]
        self.assertEqual(kinds[:2], ["response.created", "response.in_progress"])
        self.assertIn("response.output_text.delta", kinds)
        last = events[-1]
        assert last.type == "response.incomplete"
        final = last.response
        self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        assert final.usage is not None
        self.assertEqual(final.usage.output_tokens, 3)
        self.assertTrue(final.output_text)
        self.assertEqual(
            logged_usage(self.server, rid),
            (200, final.usage.input_tokens, final.usage.output_tokens),
        )

    def test_stored_continuation_after_restart(self) -> None:
        """
        A stored response is continued by C{previous_response_id}, its
        items before the new input (more prompt tokens than the input
        alone), streamed and after the server restarts on the same store;
        the key's usage rows hold the engine's counts; another key gets a
        404 naming C{previous_response_id}.
        """
        client = self.client()
        first = client.responses.create(model="sim-model", input="remember 7")
        alone = client.responses.create(model="sim-model", input="which number?")
        assert alone.usage is not None
        rid = _rid()
        with client.responses.stream(
            model="sim-model",
            input="which number?",
            previous_response_id=first.id,
            extra_headers={"X-Request-ID": rid},
        ) as stream:
            last = list(stream)[-1]
        assert last.type == "response.incomplete"
        second = last.response
        assert second.usage is not None
        self.assertGreater(second.usage.input_tokens, alone.usage.input_tokens)
        self.server.stop()
        self.start()
        # The usage rows the stop wrote are the engine's counts, under the key.
        answers = (first.usage, alone.usage, second.usage)
        (row,) = self.ctl_json("usage", "--by", "key")["usage"]
        self.assertEqual(
            (row["requests"], row["prompt_tokens"], row["completion_tokens"]),
            (
                3,
                sum(u.input_tokens for u in answers if u is not None),
                sum(u.output_tokens for u in answers if u is not None),
            ),
        )
        third = self.client().responses.create(
            model="sim-model", input="and now?", previous_response_id=second.id
        )
        assert third.usage is not None
        self.assertGreater(third.usage.input_tokens, second.usage.input_tokens)
        with self.assertRaises(openai.NotFoundError) as missing:
            self.client(self.make_key()).responses.create(
                model="sim-model", input="and now?", previous_response_id=second.id
            )
        body: Any = missing.exception.body
        self.assertEqual(body["param"], "previous_response_id")

    def test_codex_shaped_stream(self) -> None:
        """
        A request shaped as Codex CLI sends it (streamed, not stored,
        developer and user items, function, namespace and hosted tools,
        reasoning, include, prompt_cache_key) streams an answer; not
        stored, it cannot be continued.
        """
        shell: Any = {"type": "function", "name": "shell", "parameters": {}}
        tools: Any = [
            shell,
            {"type": "namespace", "name": "mcp", "description": "x", "tools": [shell]},
            {"type": "web_search"},
        ]
        items: Any = [
            {"type": "message", "role": "developer", "content": "You are Codex."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Say hello"}],
            },
        ]
        stream = self.client().responses.create(
            model="sim-model",
            input=items,
            tools=tools,
            tool_choice="auto",
            parallel_tool_calls=False,
            reasoning={"effort": "medium"},
            include=["reasoning.encrypted_content"],
            prompt_cache_key="session-1",
            store=False,
            stream=True,
        )
        events = list(stream)
        self.assertEqual(events[0].type, "response.created")
        last = events[-1]
        assert last.type == "response.incomplete"
        self.assertTrue(last.response.output_text)
        with self.assertRaises(openai.NotFoundError):
            self.client().responses.create(
                model="sim-model", input="more", previous_response_id=last.response.id
            )

    def test_errors(self) -> None:
        """
        Bad input gets the API's error object naming the field: an unknown
        input item type, a forced hosted tool, a body that is not JSON, an
        unknown C{previous_response_id}.
        """
        client = self.client()
        items: Any = [{"role": "user", "content": "hi"}, {"type": "teleport"}]
        with self.assertRaises(openai.BadRequestError) as bad:
            client.responses.create(model="sim-model", input=items)
        body: Any = bad.exception.body
        self.assertEqual(body["param"], "input[1].type")
        self.assertEqual(body["type"], "invalid_request_error")
        with self.assertRaises(openai.BadRequestError) as forced:
            hosted: Any = {"type": "web_search"}
            client.responses.create(
                model="sim-model",
                input="look it up",
                tools=[hosted],
                tool_choice=hosted,
            )
        body = forced.exception.body
        self.assertEqual(body["param"], "tool_choice")
        status, _, raw = http(
            "POST",
            self.url + "/v1/responses",
            b"{not json",
            {"Authorization": f"Bearer {self.key}"},
        )
        self.assertEqual(status, 400)
        self.assertEqual(
            set(json.loads(raw)["error"]), {"message", "type", "param", "code"}
        )
        with self.assertRaises(openai.NotFoundError) as unknown:
            client.responses.create(
                model="sim-model", input="hi", previous_response_id="resp_nope"
            )
        body = unknown.exception.body
        self.assertEqual(body["param"], "previous_response_id")
        # A lone surrogate, which the store's query cannot encode, and a
        # stream flag that is not a boolean.
        for raw_body, code, param in (
            (
                b'{"model": "sim-model", "input": "hi",'
                b' "previous_response_id": "resp_\\ud800"}',
                404,
                "previous_response_id",
            ),
            (b'{"model": "sim-model", "input": "hi", "stream": "yes"}', 400, "stream"),
        ):
            status, _, raw = http(
                "POST",
                self.url + "/v1/responses",
                raw_body,
                {"Authorization": f"Bearer {self.key}"},
            )
            self.assertEqual((status, json.loads(raw)["error"]["param"]), (code, param))


WEATHER: Any = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


class ResponsesToolTests(SynchronousTestCase, Processes):
    timeout = 60

    def setUp(self) -> None:
        self.engine = anthropic_e2e.ToolEngine()
        self.addCleanup(self.engine.server_close)
        self.addCleanup(self.engine.shutdown)
        self.server, self.url, _ = self.start_server(
            "--endpoint", f"t-0={self.engine.url}=tools"
        )
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0
        )

    def test_function_call_round_trip(self) -> None:
        """
        The engine's tool call reaches the SDK as a C{function_call} item
        (whole and streamed, its arguments in pieces); the SDK's
        C{function_call_output} reaches the engine as a C{tool} message
        answering that call; the usage rows are the engine's counts.
        """
        rid = _rid()
        first = self.client.responses.create(
            model="tools",
            input="weather in Oslo?",
            tools=[WEATHER],
            extra_headers={"X-Request-ID": rid},
        )
        (call,) = first.output
        assert call.type == "function_call"
        self.assertEqual(
            (call.name, json.loads(call.arguments), call.call_id),
            ("weather", {"city": "Oslo"}, "call_7"),
        )
        self.assertEqual(logged_usage(self.server, rid), (200, 21, 8))
        with self.client.responses.stream(
            model="tools", input="weather in Oslo?", tools=[WEATHER]
        ) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
        self.assertEqual(kinds.count("response.function_call_arguments.delta"), 2)
        self.assertEqual(kinds[-1], "response.completed")
        self.assertEqual(streamed.output[0].type, "function_call")
        answer = self.client.responses.create(
            model="tools",
            tools=[WEATHER],
            input=[
                {"role": "user", "content": "weather in Oslo?"},
                call.model_dump(exclude_none=True),  # type: ignore[list-item]
                {
                    "type": "function_call_output",
                    "call_id": call.call_id,
                    "output": "rain, 4 C",
                },
            ],
        )
        self.assertEqual(answer.output_text, "Rainy.")
        sent = self.engine.requests[-1]["messages"]
        self.assertEqual(sent[1]["tool_calls"][0]["id"], "call_7")
        self.assertEqual(
            sent[2], {"role": "tool", "tool_call_id": "call_7", "content": "rain, 4 C"}
        )
        with self.client.responses.stream(
            model="tools", input=[{"role": "user", "content": "hello"}]
        ) as stream:
            text = "".join(
                event.delta
                for event in stream
                if event.type == "response.output_text.delta"
            )
            final = stream.get_final_response()
        self.assertEqual(
            (text, final.output_text, final.status), ("Rainy.",) * 2 + ("completed",)
        )


class AgentsOnSimTests(SynchronousTestCase, Processes, CtlMixin):
    """
    The sim with a reasoning parser, told by its prompt to call a tool
    (docs/sim.md, "sim: call NAME"), behind a server with a key.
    """

    timeout = 60

    def setUp(self) -> None:
        _, sim = self.start_sim("--reasoning-parser", "qwen3", "--itl", "0.001")
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={sim}=sim-model"
        )
        made = self.ctl("keys", "create", "--name", "agent")
        self.key = made.stdout.splitlines()[0].strip()

    def test_reasoning_item(self) -> None:
        """
        The engine's reasoning comes as a C{reasoning} item before the
        message, whole and streamed (C{response.reasoning_text.delta}).
        """
        client = openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.key, max_retries=0
        )
        response = client.responses.create(
            model="sim-model", input="think", max_output_tokens=8
        )
        self.assertEqual(
            [item.type for item in response.output], ["reasoning", "message"]
        )
        with client.responses.stream(
            model="sim-model", input="think", max_output_tokens=8
        ) as stream:
            kinds = {event.type for event in stream}
        self.assertIn("response.reasoning_text.delta", kinds)

    def test_agents_sdk(self) -> None:
        """
        An agent of the OpenAI Agents SDK, on its Responses model with llmgw
        as its default OpenAI client, calls its function tool as the sim's
        prompt line says and ends with the sim's answer quoting the tool's
        result; streamed too (C{Runner.run_streamed}).
        """
        import agents

        seen: list[str] = []

        @agents.function_tool
        def weather(city: str) -> str:
            """The weather in a city."""
            seen.append(city)
            return f"rain in {city}"

        client = openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=self.key, max_retries=0
        )
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_default_openai_api("responses")
        agents.set_tracing_disabled(True)
        agent = agents.Agent(
            name="forecaster",
            instructions="Answer briefly.",
            tools=[weather],
            model="sim-model",
        )
        prompt = 'Weather?\nsim: call weather {"city": "Oslo"}'

        async def both() -> tuple[str, str]:
            # One event loop: the client's connections belong to it.
            whole = await agents.Runner.run(agent, prompt)
            run = agents.Runner.run_streamed(agent, prompt)
            async for _ in run.stream_events():
                pass
            await client.close()
            return str(whole.final_output), str(run.final_output)

        said = "The tool said: rain in Oslo"
        self.assertEqual(asyncio.run(both()), (said, said))
        self.assertEqual(seen, ["Oslo", "Oslo"])


class ContinuedElsewhereTests(SynchronousTestCase, Processes, CtlMixin):
    """
    Two servers on one PostgreSQL database (L{tests.pg_support}), each with
    its own sim replica of one model.
    """

    timeout = 120

    def setUp(self) -> None:
        self.config = f'[store]\nurl = "{fresh_database(self)}"\n'
        self.sims = [self.start_sim("--max-tokens", "5")[1] for _ in range(2)]
        self.servers = [self.start(index) for index in range(2)]
        self.admin_url = self.servers[0][2]

    def start(self, index: int) -> tuple[Process, str, str]:
        endpoint = f"sim-{index}={self.sims[index]}=sim-model"
        started = self.start_server("--endpoint", endpoint, config=self.config)
        started[0].wait_for("store: listening for key changes")
        return started

    def client(self, index: int, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.servers[index][1] + "/v1", api_key=key, max_retries=0
        )

    def key(self) -> str:
        made = self.ctl("keys", "create", "--name", f"k{uuid.uuid4().hex[:6]}")
        key = made.stdout.splitlines()[0].strip()
        # The other server learns the key by PostgreSQL's notification.
        until_known([url for _, url, _ in self.servers], key, seconds=5.0)
        return key

    def test_other_replica_and_restart(self) -> None:
        """
        A response made through the first server (its replica sim-0) is
        continued through the second (sim-1), and again after the second
        restarts; another key gets a 404 for it.
        """
        key = self.key()
        first = self.client(0, key).responses.create(
            model="sim-model", input="remember 7"
        )
        alone = self.client(1, key).responses.create(
            model="sim-model", input="which number?"
        )
        second = self.client(1, key).responses.create(
            model="sim-model", input="which number?", previous_response_id=first.id
        )
        assert alone.usage is not None and second.usage is not None
        self.assertGreater(second.usage.input_tokens, alone.usage.input_tokens)
        self.assertEqual(sim_stats(self.sims[1])["requests_total"], 2)
        self.servers[1][0].stop()
        self.servers[1] = self.start(1)
        third = self.client(1, key).responses.create(
            model="sim-model", input="and now?", previous_response_id=second.id
        )
        assert third.usage is not None
        self.assertGreater(third.usage.input_tokens, second.usage.input_tokens)
        with self.assertRaises(openai.NotFoundError):
            self.client(1, self.key()).responses.create(
                model="sim-model", input="and now?", previous_response_id=second.id
            )
