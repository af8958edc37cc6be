"""
The Responses API's checks of the request's fields
(L{llmgw.router.api.responses}, L{llmgw.router.api.responses_items},
L{llmgw.router.api.responses_state}): a field of the wrong type, a tool
name that collides, an implausible C{previous_response_id} are refused
naming the field, in the API's own error shape, not silently ignored.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.api.responses import responses_error, to_response
from llmgw.router.api.responses_state import Conversations
from llmgw.router.errors import APIError
from llmgw.router.interfaces import KeptResponse
from tests.test_responses import WEATHER, _call, _invalid, _Request, _Store


class FieldCheckTests(SynchronousTestCase):
    """
    Fields of the wrong type are 400s naming them, not silently ignored.
    """

    def assertParam(self, payload: dict[str, Any], param: str) -> None:
        self.assertEqual(_invalid(**payload).param, param, payload)

    def test_previous_response_id(self) -> None:
        """
        A C{previous_response_id} that is not a string is refused.
        """
        for value in (5, ["a"]):
            self.assertParam({"previous_response_id": value}, "previous_response_id")

    def test_flags(self) -> None:
        """
        C{stream}, C{store} and C{parallel_tool_calls} take booleans only.
        """
        for name in ("stream", "store", "parallel_tool_calls"):
            for value in ("yes", 1):
                self.assertParam({name: value}, name)

    def test_metadata(self) -> None:
        """
        C{metadata} is an object of at most 16 keys and string values of at
        most 512 characters.
        """
        for value in (
            "x",
            [1],
            {"a": 1},
            {"a": "x" * 513},
            {str(n): "v" for n in range(17)},
        ):
            self.assertParam({"metadata": value}, "metadata")
        _call(metadata={"a": "b"})

    def test_text_and_reasoning(self) -> None:
        """
        C{text}, C{text.format}, C{reasoning}, C{reasoning.effort} of the
        wrong type, and a C{json_schema} format without an object schema,
        are refused naming the field.
        """
        cases: list[tuple[dict[str, Any], str]] = [
            ({"text": "json"}, "text"),
            ({"text": {"format": "json"}}, "text.format"),
            ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
            (
                {"text": {"format": {"type": "json_schema", "schema": "x"}}},
                "text.format.schema",
            ),
            ({"reasoning": "high"}, "reasoning"),
            ({"reasoning": {"effort": 3}}, "reasoning.effort"),
        ]
        for payload, param in cases:
            self.assertParam(payload, param)

    def test_tool_names(self) -> None:
        """
        Two tools whose flattened names are the same, and a name chat
        completions does not allow, are refused naming the later tool's
        name.
        """

        def space(name: str, member: str) -> dict[str, Any]:
            return {
                "type": "namespace",
                "name": name,
                "tools": [WEATHER | {"name": member}],
            }

        self.assertParam(
            {"tools": [WEATHER | {"name": "a__f"}, space("a", "f")]},
            "tools[1].tools[0].name",
        )
        self.assertParam(
            {"tools": [space("a", "b__c"), space("a__b", "c")]},
            "tools[1].tools[0].name",
        )
        self.assertParam({"tools": [WEATHER, WEATHER]}, "tools[1].name")
        self.assertParam({"tools": [WEATHER | {"name": "a b"}]}, "tools[0].name")
        self.assertParam({"tools": [WEATHER | {"name": "x" * 65}]}, "tools[0].name")

    def test_tool_choice(self) -> None:
        """
        Forcing a tool not offered names C{tool_choice.name}; forcing a
        function, or C{required}, with no client tools names C{tool_choice}.
        """
        forced = {"type": "function", "name": "nope"}
        offered = {"tools": [WEATHER], "tool_choice": forced}
        self.assertParam(offered, "tool_choice.name")
        for tools in ([], [{"type": "web_search"}]):
            for choice in (forced, "required"):
                self.assertParam({"tools": tools, "tool_choice": choice}, "tool_choice")

    def test_input(self) -> None:
        """
        No input (and nothing else for the model) names C{input}; an item
        that is not an object names it; an item's C{id} must be a string.
        """
        empty: list[object] = [None, [], ""]
        for value in empty:
            invalid = _invalid(input=value)
            self.assertEqual(invalid.param, "input")
        for bad in (5, "hi"):
            invalid = _invalid(input=[bad])
            self.assertEqual(invalid.param, "input[0]")
            self.assertIn("expected an object", invalid.message)
        item = {"role": "user", "content": "a", "id": 5}
        self.assertParam({"input": [item]}, "input[0].id")

    def test_object_arguments(self) -> None:
        """
        A tool call whose C{arguments} came as a JSON object is given as
        that object's JSON text.
        """
        call = {"id": "c", "type": "function"}
        call["function"] = {"name": "weather", "arguments": {"city": "Oslo"}}  # type: ignore[assignment]
        chat = {"choices": [{"message": {"tool_calls": [call]}, "finish_reason": "x"}]}
        response = to_response(chat, _call(tools=[WEATHER]).turn())
        self.assertEqual(
            json.loads(response["output"][0]["arguments"]), {"city": "Oslo"}
        )

    def test_implausible_previous_id(self) -> None:
        """
        A C{previous_response_id} llmgw could not have made (a lone
        surrogate, too long) is unknown without asking the store.
        """
        asked: list[str] = []

        class Asked(_Store):
            def get(
                self, response_id: str, key_id: int | None
            ) -> Deferred[KeptResponse | None]:
                # SQLite's query could not encode a lone surrogate.
                response_id.encode("utf-8")
                asked.append(response_id)
                return succeed(None)

        conversations = Conversations(Asked(), lambda: 0.0)
        for previous in ("resp_\ud800", "resp_" + "a" * 300):
            body = json.dumps({"model": "m", "previous_response_id": previous})
            request: Any = _Request(body.encode())
            failure = self.failureResultOf(
                Deferred.fromCoroutine(conversations.history(request, None)),
                APIError,
            )
            self.assertEqual(failure.value.status, 404)
            failure.value.message.encode("utf-8")
        self.assertEqual(asked, [])

    def test_engine_error_names_input(self) -> None:
        """
        An engine's error naming chat completions' C{messages} (a prompt
        too long) names C{input} for the Responses API, its message kept;
        another is left as it is.
        """
        long = APIError(400, "too long", "invalid_request_error", None, "messages")
        mapped = responses_error(long)
        self.assertEqual((mapped.param, mapped.message), ("input", "too long"))
        other = APIError(400, "bad", "invalid_request_error", None, "temperature")
        self.assertIs(responses_error(other), other)
