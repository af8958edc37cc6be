"""
OpenAI's Responses API as chat completions, sans-IO: a C{POST /v1/responses}
body checked and translated into a chat completions body
(L{ResponsesCall.chat}), and a chat completion translated back into a
Response object (L{to_response}).  The stream's events are
L{llmgw.router.api.responses_stream}'s, the items'
L{llmgw.router.api.responses_items}'.

Every engine gets the translation, even one that serves C{/v1/responses}
itself (vLLM): llmgw keeps the stored responses (C{store},
C{previous_response_id}) so that any replica continues them after any
restart, reads usage in one shape, and gives every engine the same items
and tools (docs/responses.md).

Shapes from OpenAI's API reference ("Responses": create, the Response
object, streaming events) and the official Python SDK's types
(C{openai.types.responses.Response}, C{ResponseUsage},
C{ResponseOutputMessage}, C{ResponseFunctionToolCall},
C{ResponseCustomToolCall}, C{ResponseReasoningItem}).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from llmgw.router.api.anthropic import Invalid, json_kind
from llmgw.router.api.fields import MAX_COUNT
from llmgw.router.api.responses_items import (
    CUSTOM_PARAMETER,
    InputItems,
    Tools,
    tool_choice,
    tools,
)
from llmgw.router.api.responses_stream import ResponsesStream, Turn
from llmgw.router.errors import APIError, upstream_failed

RESPONSES_PATH = b"/v1/responses"
_ECHOED = (
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "previous_response_id",
    "reasoning",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_p",
    "truncation",
    "user",
    "prompt_cache_key",
)
_DEFAULTS: dict[str, Any] = {
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "truncation": "disabled",
    "metadata": {},
}


def input_items(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """
    @return: the request's C{input} as items: a string is one user message;
        none (or an empty string) is no items (the API's C{input} is
        optional: a continuation may add only C{instructions}).
    @raise Invalid: neither a string nor an array (param C{input}), or an
        item that is not an object (C{input[2]}).
    """
    value = payload.get("input")
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}] if value else []
    if not isinstance(value, list):
        raise Invalid("input", f"expected a string or an array, got {json_kind(value)}")
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            kind = json_kind(item)
            raise Invalid(f"input[{index}]", f"expected an object, got {kind}")
    return value


def _number(payload: dict[str, Any], name: str, chat: dict[str, Any]) -> None:
    value = payload.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid(name, f"expected a number, got {json_kind(value)}")
    chat[name] = value


def _boolean(payload: dict[str, Any], name: str) -> None:
    value = payload.get(name)
    if value is not None and not isinstance(value, bool):
        raise Invalid(name, f"expected a boolean, got {json_kind(value)}")


def _metadata(value: object) -> None:
    """
    @raise Invalid: C{value} is not the API's metadata: an object of at
        most 16 keys (each up to 64 characters), its values strings of at
        most 512 characters (OpenAI's API reference, "Metadata").
    """
    if value is None:
        return
    if not isinstance(value, dict):
        raise Invalid("metadata", f"expected an object, got {json_kind(value)}")
    if len(value) > 16:
        raise Invalid("metadata", "expected at most 16 keys")
    for key, text in value.items():
        if len(key) > 64:
            raise Invalid("metadata", "expected keys of at most 64 characters")
        if not isinstance(text, str) or len(text) > 512:
            raise Invalid("metadata", "expected strings of at most 512 characters")


def _object(parent: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    value = parent.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Invalid(where, f"expected an object, got {json_kind(value)}")
    return value


def check_fields(payload: dict[str, Any]) -> None:
    """
    Check the fields the translation passes on or echoes, so that a wrong
    type is a 400 naming it rather than a field silently ignored.

    @raise Invalid: C{stream}, C{store}, C{parallel_tool_calls} not a
        boolean; C{metadata}, C{text}, C{text.format}, C{reasoning} not
        objects; C{reasoning.effort} not a string; a C{json_schema} format
        without an object C{schema}; C{previous_response_id} not a string.
    """
    for name in ("stream", "store", "parallel_tool_calls"):
        _boolean(payload, name)
    _metadata(payload.get("metadata"))
    previous = payload.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise Invalid(
            "previous_response_id", f"expected a string, got {json_kind(previous)}"
        )
    effort = _object(payload, "reasoning", "reasoning").get("effort")
    if effort is not None and not isinstance(effort, str):
        raise Invalid("reasoning.effort", f"expected a string, got {json_kind(effort)}")
    form = _object(_object(payload, "text", "text"), "format", "text.format")
    if form and not isinstance(form.get("type"), str):
        raise Invalid("text.format.type", "expected a string")
    if form.get("type") == "json_schema" and not isinstance(form.get("schema"), dict):
        raise Invalid(
            "text.format.schema",
            f"expected an object, got {json_kind(form.get('schema'))}",
        )


def _options(payload: dict[str, Any], chat: dict[str, Any]) -> None:
    """
    The request's sampling, limit and format, as chat completions'.
    """
    _number(payload, "temperature", chat)
    _number(payload, "top_p", chat)
    limit = payload.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise Invalid("max_output_tokens", "expected an integer")
        if not 1 <= limit <= MAX_COUNT:
            raise Invalid("max_output_tokens", f"expected 1 to {MAX_COUNT}")
        chat["max_tokens"] = limit
    if isinstance(payload.get("parallel_tool_calls"), bool):
        chat["parallel_tool_calls"] = payload["parallel_tool_calls"]
    if isinstance(payload.get("user"), str):
        chat["user"] = payload["user"]
    reasoning = payload.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        chat["reasoning_effort"] = reasoning["effort"]
    text = payload.get("text")
    form = text.get("format") if isinstance(text, dict) else None
    if isinstance(form, dict) and form.get("type") == "json_schema":
        schema = {
            k: form[k] for k in ("name", "schema", "strict", "description") if k in form
        }
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(form, dict) and form.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}


class ResponsesCall:
    """
    One Responses API request: its translation for the engine, and what it
    answered, for the client and the store.

    @param payload: the client's body, parsed; its C{model} checked.
    @param response_id: the id its Response takes, C{"resp_..."}.
    @param history: the items of the responses it continues (their inputs
        and outputs, in order), or none.
    @ivar items: the input items the model sees: C{history}, then this
        request's C{input}.
    @ivar tools: the request's tools as the engine sees them.
    @ivar chat: the chat completions body, its model the one the client
        sent.
    @ivar result: the Response object once one is complete (or incomplete),
        else L{None}.
    @raise Invalid: the body has a field llmgw cannot translate, named.
    """

    def __init__(
        self,
        payload: dict[str, Any],
        response_id: str | None = None,
        history: list[dict[str, Any]] | None = None,
    ) -> None:
        self.payload = payload
        self.id = response_id or f"resp_{uuid.uuid4().hex}"
        self.model = str(payload["model"])
        check_fields(payload)
        own = input_items(payload)
        self.items = list(history or []) + own
        self.tools: Tools = tools(payload.get("tools"))
        self.store = payload.get("store") is not False
        self.stream = payload.get("stream") is True
        previous = payload.get("previous_response_id")
        self.previous_response_id = previous if isinstance(previous, str) else None
        self.result: dict[str, Any] | None = None
        self._relay: ResponsesStream | None = None
        self.chat = self._chat(len(history or []))

    def _chat(self, offset: int) -> dict[str, Any]:
        payload = self.payload
        messages = InputItems(self.tools)
        instructions = payload.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise Invalid("instructions", "expected a string")
            messages.messages.append({"role": "system", "content": instructions})
        for index, item in enumerate(self.items):
            number = index - offset
            where = f"input[{number}]" if number >= 0 else "previous_response_id"
            messages.add(item, where)
        if not messages.messages:
            # The engine's 400 would name chat completions' C{messages}.
            raise Invalid("input", "expected at least one input item or instructions")
        chat: dict[str, Any] = {"model": self.model, "messages": messages.messages}
        if self.tools.functions:
            chat["tools"] = self.tools.functions
        choice = tool_choice(payload.get("tool_choice"), self.tools)
        if choice is not None and self.tools.functions:
            chat["tool_choice"] = choice
        _options(payload, chat)
        if self.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return chat

    def turn(self) -> Turn:
        """
        @return: the Response object's fields fixed by the request.
        """
        echoed = {name: self.payload.get(name, _DEFAULTS.get(name)) for name in _ECHOED}
        echoed.update(
            id=self.id,
            object="response",
            model=self.model,
            store=self.store,
            service_tier="default",
        )
        return Turn(echoed, self.tools.names, self._keep)

    def _keep(self, response: dict[str, Any]) -> None:
        self.result = response

    def whole(self, body: bytes, native: bool) -> tuple[bytes, dict[str, Any] | None]:
        """
        @param body: an engine's successful chat completion.
        @param native: unused: every engine gets the translation.
        @return: the Response object for the client and the chat usage for
            the record, or L{None} when it has none.
        @raise APIError: a 502, the answer is not a chat completion.
        """
        try:
            parsed = json.loads(body)
            if not isinstance(parsed, dict):
                raise ValueError("it is not a JSON object")
            response = to_response(parsed, self.turn())
        except ValueError as e:
            raise upstream_failed(f"The replica's answer was refused: {e}.") from None
        usage = parsed.get("usage")
        return json.dumps(response).encode("utf-8"), usage if isinstance(
            usage, dict
        ) else None

    def relay(self, max_event_size: int) -> ResponsesStream:
        """
        @return: the translation of the engine's chat stream.
        """
        self._relay = ResponsesStream(max_event_size, self.turn())
        return self._relay

    def error_event(self, error: APIError) -> bytes:
        """
        @return: C{error} as the last events of a stream already begun:
            C{response.failed} and C{error}, numbered after its events.
        """
        relay = self._relay or ResponsesStream(0, self.turn())
        return relay.fail(error.message, error.code or error.type)


def responses_error(error: APIError) -> APIError:
    """
    @return: an engine's error for the Responses API: one naming chat
        completions' C{messages} (a prompt past the model's context) names
        the Responses API's C{input} instead, its message kept.
    """
    param = error.param
    if param is None or not (param == "messages" or param.startswith("messages.")):
        return error
    return dataclasses.replace(error, param="input")


def to_response(chat: dict[str, Any], turn: Turn) -> dict[str, Any]:
    """
    Translate a chat completion into a Response object.

    @param chat: the engine's answer, parsed.
    @param turn: the request's side of the Response.
    @raise ValueError: C{chat} is not a chat completion.
    """
    choices = chat.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("the answer has no choices")
    choice = choices[0]
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    builder = turn.builder(chat.get("created"))
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        builder.reasoning(reasoning)
    text = message.get("content")
    if isinstance(text, str) and text:
        builder.text(text)
    calls = message.get("tool_calls")
    for index, call in enumerate(calls if isinstance(calls, list) else []):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            if not isinstance(arguments, str):
                # Some engines send the arguments as a JSON object.
                arguments = "" if arguments is None else json.dumps(arguments)
            builder.call(
                str(call.get("id") or f"call_{index}"),
                str(function.get("name") or ""),
                arguments,
            )
    usage = chat.get("usage")
    return builder.finish(
        choice.get("finish_reason"), usage if isinstance(usage, dict) else None
    )


__all__ = [
    "CUSTOM_PARAMETER",
    "RESPONSES_PATH",
    "ResponsesCall",
    "responses_error",
    "to_response",
]
