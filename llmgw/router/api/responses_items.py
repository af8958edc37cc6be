"""
The Responses API's input items and tools as chat completions' messages and
tools, sans-IO.

Shapes from OpenAI's API reference ("Responses", "Conversation state",
"Function calling") and the official Python SDK's types
(C{openai.types.responses}: C{ResponseInputItemParam}, C{ToolParam},
C{NamespaceToolParam}, C{ToolChoice*}):

  - a message item (C{type} C{message}, or none) of role C{user},
    C{assistant}, C{system} or C{developer} (a system message here), its
    content a string or parts C{input_text}, C{output_text}, C{refusal},
    C{input_image}, C{input_file};
  - C{function_call} and C{custom_tool_call} items, the assistant's
    C{tool_calls}; C{function_call_output} and C{custom_tool_call_output},
    C{tool} messages, matched by C{call_id};
  - C{reasoning} items, left out: a chat model takes no reasoning of an
    earlier turn (vLLM's chat templates drop it too);
  - tools C{function}, C{custom} (freeform input: a function of one string
    parameter, L{CUSTOM_PARAMETER}) and C{namespace}, whose members become
    functions named C{<namespace>__<name>} (L{NAMESPACE_JOIN}): chat
    completions' names allow letters, digits, C{_} and C{-} only;
  - the hosted tools (L{HOSTED_TOOLS}), which the API's own servers run and
    no engine can: left out of what the model sees.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from llmgw.router.api.anthropic import Invalid, json_kind

CUSTOM_PARAMETER = "input"
"""
The one string parameter of a custom tool's function: its call's C{input}.
"""
NAMESPACE_JOIN = "__"
"""
Between a namespace's name and its member's in the function the model sees.
"""
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "computer",
        "computer_use",
        "computer_use_preview",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)
"""
The tool types OpenAI's servers run (search, code, computer use, images, MCP
servers) or whose calls have item types of their own (C{local_shell},
C{shell}, C{apply_patch}, C{tool_search}): llmgw has none of them to run and
no engine emits their calls, so they are left out of what the model sees.
"""
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""
The names chat completions' functions take (OpenAI's function names).
"""
_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}
_ROLES["developer"] = "system"


@dataclass
class Tools:
    """
    A request's tools as the engine sees them.

    @ivar functions: chat completions' C{tools}.
    @ivar names: each function's name to the tool it stands for: its type
        (C{function} or C{custom}), its name and its namespace (or L{None}).
    @ivar hosted: the hosted tools' types left out, in order.
    """

    functions: list[dict[str, Any]] = field(default_factory=list)
    names: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)
    hosted: list[str] = field(default_factory=list)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise Invalid(f"{where}.{name}", f"expected a string, got {json_kind(value)}")
    return value


def _part(part: object, where: str) -> dict[str, Any]:
    """
    @return: a content part as a chat content part.
    @raise Invalid: a part of no type llmgw translates.
    """
    if not isinstance(part, dict):
        raise Invalid(where, f"expected an object, got {json_kind(part)}")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": _string(part, "text", where)}
    if kind == "refusal":
        return {"type": "text", "text": _string(part, "refusal", where)}
    if kind == "input_image":
        url = part.get("image_url") or part.get("file_id")
        if not isinstance(url, str):
            raise Invalid(f"{where}.image_url", "expected a string")
        image: dict[str, Any] = {"url": url}
        if isinstance(part.get("detail"), str):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        file = {
            k: part[k]
            for k in ("file_data", "file_id", "filename")
            if isinstance(part.get(k), str)
        }
        return {"type": "file", "file": file}
    raise Invalid(
        f"{where}.type",
        "expected one of input_text, output_text, refusal, input_image,"
        f" input_file; got {json.dumps(kind)[:50]}",
    )


def _content(content: object, where: str, text_only: bool) -> Any:
    """
    @param text_only: the message's role takes text only (assistant,
        system): the parts' texts are joined.
    @return: a message's content for chat completions.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Invalid(where, f"expected a string or an array, got {json_kind(content)}")
    parts = [_part(part, f"{where}[{i}]") for i, part in enumerate(content)]
    if text_only and all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


class InputItems:
    """
    Input items in order, written into chat messages: a function call joins
    the assistant message before it, as one turn's C{tool_calls}.

    @param tools: the request's tools, for the names of namespaced and
        custom tools' calls.
    @ivar messages: the chat messages so far.
    """

    def __init__(self, tools: Tools) -> None:
        self._tools = tools
        self.messages: list[dict[str, Any]] = []

    def add(self, item: object, where: str) -> None:
        """
        @param where: the item's path for errors, C{input[3]}.
        @raise Invalid: an item of a type llmgw does not translate, or a
            field of the wrong type.
        """
        if not isinstance(item, dict):
            raise Invalid(where, f"expected an object, got {json_kind(item)}")
        ident = item.get("id")
        if ident is not None and not isinstance(ident, str):
            raise Invalid(f"{where}.id", f"expected a string, got {json_kind(ident)}")
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, where)
        elif kind in ("function_call", "custom_tool_call"):
            self._call(item, where, kind == "custom_tool_call")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else None
            if text is None:
                text = _content(output, f"{where}.output", True)
                if not isinstance(text, str):
                    text = json.dumps(output)
            self.messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": text,
                }
            )
        elif kind != "reasoning":
            raise Invalid(
                f"{where}.type",
                "expected one of message, function_call, function_call_output,"
                " custom_tool_call, custom_tool_call_output, reasoning;"
                f" got {json.dumps(kind)[:50]}",
            )

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        chat_role = _ROLES.get(role) if isinstance(role, str) else None
        if chat_role is None:
            raise Invalid(
                f"{where}.role",
                "expected one of user, assistant, system, developer;"
                f" got {json.dumps(role)[:50]}",
            )
        content = _content(item.get("content"), f"{where}.content", chat_role != "user")
        self.messages.append({"role": chat_role, "content": content})

    def _call(self, item: dict[str, Any], where: str, custom: bool) -> None:
        name = _string(item, "name", where)
        namespace = item.get("namespace")
        if isinstance(namespace, str) and namespace:
            name = f"{namespace}{NAMESPACE_JOIN}{name}"
        if custom:
            arguments = json.dumps({CUSTOM_PARAMETER: _string(item, "input", where)})
        else:
            arguments = _string(item, "arguments", where)
        call = {
            "id": _string(item, "call_id", where),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return
        self.messages.append(
            {"role": "assistant", "content": None, "tool_calls": [call]}
        )


def _function(
    tool: dict[str, Any], where: str, namespace: str | None
) -> dict[str, Any]:
    name = _string(tool, "name", where)
    flat = f"{namespace}{NAMESPACE_JOIN}{name}" if namespace else name
    function: dict[str, Any] = {"name": flat}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if tool.get("type") == "custom":
        function["parameters"] = {
            "type": "object",
            "properties": {CUSTOM_PARAMETER: {"type": "string"}},
            "required": [CUSTOM_PARAMETER],
        }
    else:
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise Invalid(f"{where}.parameters", "expected an object")
        function["parameters"] = parameters or {"type": "object", "properties": {}}
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
    return function


def tools(value: object) -> Tools:
    """
    @param value: the request's C{tools}, or L{None}.
    @return: them as the engine sees them.
    @raise Invalid: not an array, or a tool of an unknown type.
    """
    out = Tools()
    if value is None:
        return out
    if not isinstance(value, list):
        raise Invalid("tools", f"expected an array, got {json_kind(value)}")
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise Invalid(where, f"expected an object, got {json_kind(tool)}")
        kind = tool.get("type")
        if kind == "namespace":
            namespace = _string(tool, "name", where)
            members = tool.get("tools")
            if not isinstance(members, list):
                raise Invalid(f"{where}.tools", "expected an array")
            for number, member in enumerate(members):
                _add(out, member, f"{where}.tools[{number}]", namespace)
        elif kind in HOSTED_TOOLS:
            out.hosted.append(str(kind))
        else:
            _add(out, tool, where, None)
    return out


def _add(out: Tools, tool: object, where: str, namespace: str | None) -> None:
    if not isinstance(tool, dict):
        raise Invalid(where, f"expected an object, got {json_kind(tool)}")
    kind = tool.get("type")
    if kind not in ("function", "custom"):
        raise Invalid(
            f"{where}.type",
            "expected function, custom, namespace or a hosted tool;"
            f" got {json.dumps(kind)[:50]}",
        )
    function = _function(tool, where, namespace)
    flat = function["name"]
    if not _NAME.fullmatch(flat):
        raise Invalid(
            f"{where}.name",
            f"the function name {json.dumps(flat)[:80]} is not 1 to 64 letters,"
            " digits, _ or -",
        )
    if flat in out.names:
        raise Invalid(
            f"{where}.name",
            f"the function name {flat} is another tool's too (a namespace's"
            f" members are named <namespace>{NAMESPACE_JOIN}<name>)",
        )
    out.functions.append({"type": "function", "function": function})
    out.names[function["name"]] = (str(kind), str(tool["name"]), namespace)


def tool_choice(value: object, offered: Tools) -> Any:
    """
    @param value: the request's C{tool_choice}, or L{None}.
    @return: chat completions' C{tool_choice}, or L{None} for none.
    @raise Invalid: it forces a hosted tool (which the model does not see,
        param C{tool_choice}), or is of an unknown shape.
    """
    if value is None or value in ("auto", "none"):
        return value
    if value == "required":
        if not offered.functions:
            raise Invalid("tool_choice", "no function or custom tool is offered")
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(value, dict) or not isinstance(kind, str):
        raise Invalid("tool_choice", 'expected "auto", "none", "required" or an object')
    if kind in ("function", "custom"):
        if not offered.functions:
            raise Invalid("tool_choice", "no function or custom tool is offered")
        name = _string(value, "name", "tool_choice")
        known = [flat for flat, tool in offered.names.items() if tool[1] == name]
        if name in offered.names:
            known = [name]
        if not known:
            raise Invalid("tool_choice.name", f"no tool named {name[:64]} is offered")
        return {"type": "function", "function": {"name": known[0]}}
    if kind == "allowed_tools":
        return "required" if value.get("mode") == "required" else "auto"
    raise Invalid(
        "tool_choice",
        f"tool_choice forces the hosted tool {kind[:50]}, which llmgw cannot"
        " run: only function and custom tools are served",
    )
