"""
The Messages API's request fields beside the conversation, sans-IO: tools
and C{tool_choice}, sampling, C{thinking}, C{output_config},
C{context_management}, C{metadata} and the fields only Anthropic's own
service acts on, each translated into chat completions, or read and left
out with the meaning docs/anthropic.md gives it.  Only what would change the
answer's meaning and cannot be honoured is refused (L{Invalid}, a 400
naming the field).

The translations of C{thinking} and C{output_config} are vLLM's own (its
Messages API route, C{vllm/entrypoints/anthropic/serving.py}, 0.32):
C{disabled} asks C{reasoning_effort: "none"}, C{enabled} asks
C{thinking_token_budget} of C{budget_tokens}, C{adaptive} pins nothing;
C{output_config.effort} is C{reasoning_effort} and a C{json_schema} format
is C{response_format}.  Engines without those fields ignore them.
"""

from __future__ import annotations

import json
from typing import Any

PLAIN_TOOL_TYPES = frozenset({"custom"})
"""
C{tools} entries the client runs from their C{input_schema}; the others
(C{web_search_20250305}, C{bash_20250124}, ...) are Anthropic's own tools,
which only its service runs or describes.
"""


class Invalid(Exception):
    """
    The body is not a Messages API request llmgw can serve.

    @ivar message: what is wrong, naming the field (C{messages.0.content}).
    @ivar param: the field's path, dotted.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = f"{param}: {message}"


def json_kind(value: object) -> str:
    """
    @return: a JSON value's kind for an error message: C{"null"},
        C{"a boolean"}, C{"a number"}, C{"a string"}, C{"an array"} or
        C{"an object"}.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def string(block: dict[str, Any], name: str, where: str) -> str:
    """
    @return: C{block[name]}.
    @raise Invalid: it is not a string, named C{where.name}.
    """
    value = block.get(name)
    if not isinstance(value, str):
        raise Invalid(f"{where}.{name}", f"expected a string, got {json_kind(value)}")
    return value


def _object(payload: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = payload.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Invalid(name, f"expected an object, got {json_kind(value)}")
    return value


def referenced_tools(messages: object) -> frozenset[str]:
    """
    @return: the names of the C{tool_reference} blocks in the tool results
        of C{messages} (what a tool search answered): the deferred tools
        (C{defer_loading}) the model has been shown.
    """
    names = set()
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            inner = block.get("content") if isinstance(block, dict) else None
            for item in inner if isinstance(inner, list) else ():
                if isinstance(item, dict) and item.get("type") == "tool_reference":
                    if isinstance(item.get("tool_name"), str):
                        names.add(item["tool_name"])
    return frozenset(names)


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": string(tool, "name", where)}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise Invalid(
            f"{where}.input_schema", f"expected an object, got {json_kind(schema)}"
        )
    function["parameters"] = schema
    return {"type": "function", "function": function}


def tools(payload: dict[str, Any], chat: dict[str, Any]) -> None:
    """
    Translate C{tools} and C{tool_choice} into C{chat}.

    Client tools become functions (C{cache_control}, C{strict},
    C{input_examples} left out); Anthropic's own tools (L{PLAIN_TOOL_TYPES}
    aside) and deferred tools (C{defer_loading}) no C{tool_reference} has
    shown are left out of what the model sees, as Anthropic leaves a
    deferred tool out of the prompt.

    @raise Invalid: a malformed tool, or a C{tool_choice} that forces a
        tool left out (the answer could not honour it).
    """
    offered: set[str] = set()
    entries = payload.get("tools")
    if entries is not None:
        if not isinstance(entries, list):
            raise Invalid("tools", f"expected an array, got {json_kind(entries)}")
        shown = referenced_tools(payload.get("messages"))
        functions = []
        for index, tool in enumerate(entries):
            where = f"tools.{index}"
            if not isinstance(tool, dict):
                raise Invalid(where, f"expected an object, got {json_kind(tool)}")
            if tool.get("type", "custom") not in PLAIN_TOOL_TYPES:
                continue
            function = _function(tool, where)
            name = function["function"]["name"]
            if tool.get("defer_loading") is True and name not in shown:
                continue
            offered.add(name)
            functions.append(function)
        if functions:
            chat["tools"] = functions
    _tool_choice(payload, chat, offered)


def _tool_choice(
    payload: dict[str, Any], chat: dict[str, Any], offered: set[str]
) -> None:
    choice = payload.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        assert isinstance(choice, dict)
        name = string(choice, "name", "tool_choice")
        if name not in offered:
            raise Invalid(
                "tool_choice.name",
                f"{json.dumps(name)[:50]} is not a client tool (input_schema)"
                " of this request; llmgw cannot force another",
            )
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind in ("auto", "any", "none"):
        if kind == "any" and not offered:
            raise Invalid("tool_choice.type", '"any" needs a client tool to call')
        if "tools" in chat:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                kind
            ]
    else:
        raise Invalid("tool_choice.type", 'expected "auto", "any", "tool" or "none"')
    assert isinstance(choice, dict)
    if choice.get("disable_parallel_tool_use") is True and "tools" in chat:
        chat["parallel_tool_calls"] = False


def sampling(payload: dict[str, Any], chat: dict[str, Any]) -> None:
    """
    Translate C{temperature}, C{top_p}, C{top_k}, C{stop_sequences} and
    C{metadata.user_id} (chat's C{user}) into C{chat}.
    """
    for name in ("temperature", "top_p", "top_k"):
        value = payload.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Invalid(name, f"expected a number, got {json_kind(value)}")
        chat[name] = value
    stops = payload.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise Invalid("stop_sequences", "expected an array of strings")
        if stops:
            chat["stop"] = stops
    metadata = payload.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"][:256]


def _thinking(payload: dict[str, Any], chat: dict[str, Any]) -> None:
    thinking = _object(payload, "thinking")
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind == "disabled":
        chat["reasoning_effort"] = "none"
    elif kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise Invalid(
                "thinking.budget_tokens",
                f"expected a positive integer, got {json.dumps(budget)[:50]}",
            )
        chat["thinking_token_budget"] = budget
    elif kind != "adaptive":
        raise Invalid("thinking.type", 'expected "enabled", "adaptive" or "disabled"')
    display = thinking.get("display")
    if display is not None and display not in ("summarized", "omitted"):
        raise Invalid("thinking.display", 'expected "summarized" or "omitted"')


def shows_thinking(payload: dict[str, Any]) -> bool:
    """
    @return: whether the answer carries the engine's reasoning as
        C{thinking} blocks: not when C{thinking} is C{disabled} or its
        C{display} is C{omitted}.
    """
    thinking = payload.get("thinking")
    if not isinstance(thinking, dict):
        return True
    return thinking.get("type") != "disabled" and thinking.get("display") != "omitted"


def _output_config(payload: dict[str, Any], chat: dict[str, Any]) -> None:
    config = _object(payload, "output_config") or {}
    effort = config.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise Invalid(
                "output_config.effort", f"expected a string, got {json_kind(effort)}"
            )
        chat["reasoning_effort"] = effort
    # The structured outputs beta sent the format as "output_format".
    for where, holder in (("output_config", config), ("", payload)):
        name = f"{where}.format" if where else "output_format"
        form = holder.get("format" if where else "output_format")
        if form is None:
            continue
        if not isinstance(form, dict) or form.get("type") != "json_schema":
            raise Invalid(f"{name}.type", 'expected "json_schema"')
        schema = form.get("schema")
        if not isinstance(schema, dict):
            raise Invalid(
                f"{name}.schema", f"expected an object, got {json_kind(schema)}"
            )
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "json_schema", "schema": schema},
        }


def options(
    payload: dict[str, Any], chat: dict[str, Any], counting: bool = False
) -> None:
    """
    Translate C{output_config} and C{thinking} (in that order, as vLLM's:
    C{disabled} wins over an effort) into C{chat}; check the fields llmgw
    reads and leaves out (C{context_management}, C{container},
    C{service_tier}, C{inference_geo}, C{speed}, C{fallbacks}, a top-level
    C{cache_control}, ...: docs/anthropic.md says what each means here).

    @param counting: a C{count_tokens} request, which Anthropic's API
        answers for the messages as sent whatever C{compaction} says.
    @raise Invalid: an ill-typed field; C{mcp_servers} (tools llmgw cannot
        run), C{compaction} (a summary llmgw does not make) or a C{thread}
        to continue (state llmgw does not keep): each answer would mean
        something else.
    """
    _output_config(payload, chat)
    _thinking(payload, chat)
    _object(payload, "context_management")
    if payload.get("mcp_servers"):
        raise Invalid(
            "mcp_servers", "MCP servers are run by Anthropic's service, not by llmgw"
        )
    if payload.get("compaction") is not None and not counting:
        raise Invalid(
            "compaction", "llmgw does not summarize conversations; send the messages"
        )
    thread = _object(payload, "thread")
    if thread is not None and thread.get("type") != "create":
        raise Invalid(
            "thread.type",
            "llmgw keeps no conversation state; send the whole conversation",
        )
