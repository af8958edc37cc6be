"""
Anthropic's Messages API as chat completions, sans-IO: a C{POST /v1/messages}
(or C{/v1/messages/count_tokens}) body checked and translated into a chat
completions body, and a chat completion translated back into a message, for
engines that do not serve the Messages API themselves (llama-cpp-python, the
simulator).  The stream's events are L{llmgw.router.api.anthropic_stream}'s.

Shapes from Anthropic's API reference ("Messages", "Count tokens") and the
official Python SDK's types: content blocks C{text}, C{image} (C{source} of
type C{base64} or C{url}), C{document}, C{tool_use} and C{tool_result};
C{system} a string or text blocks; C{tools} of C{name}, C{description},
C{input_schema}; C{tool_choice} of type C{auto}, C{any}, C{tool}, C{none}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llmgw.router.api.anthropic_fields import Invalid as Invalid
from llmgw.router.api.anthropic_fields import json_kind as json_kind
from llmgw.router.api.anthropic_fields import (
    options,
    sampling,
    string,
    tools,
)
from llmgw.router.api.anthropic_stream import (
    MessagesStream,
    NativeStream,
    anthropic_usage,
    chat_usage,
    reasoning_of,
    signature,
    stop_reason,
)
from llmgw.router.errors import upstream_failed

MESSAGES_PATH = b"/v1/messages"
COUNT_TOKENS_PATH = b"/v1/messages/count_tokens"
MESSAGES_PATHS = frozenset({MESSAGES_PATH, COUNT_TOKENS_PATH})
"""
The Messages API's paths, served on the client port and, to engines that
serve them (L{llmgw.router.interfaces.Endpoint.messages}), forwarded as
they are.
"""
CHAT_PATH = b"/v1/chat/completions"
"""
Where a translated request goes.
"""


def _text_of(value: object, where: str) -> str:
    """
    @return: a string, or the text blocks of a list joined by newlines.
    @raise Invalid: neither.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, block in enumerate(value):
            at = f"{where}.{index}"
            if not isinstance(block, dict) or block.get("type") != "text":
                raise Invalid(at, "expected a text block")
            texts.append(string(block, "text", at))
        return "\n".join(texts)
    raise Invalid(where, f"expected a string or an array, got {json_kind(value)}")


def _image_url(source: object, where: str) -> str:
    """
    @return: an image or document source as a URL: a C{data:} URL for
        C{base64}, the URL itself for C{url}.
    """
    if not isinstance(source, dict):
        raise Invalid(f"{where}.source", f"expected an object, got {json_kind(source)}")
    kind = source.get("type")
    if kind == "base64":
        media = string(source, "media_type", f"{where}.source")
        data = string(source, "data", f"{where}.source")
        return f"data:{media};base64,{data}"
    if kind == "url":
        return string(source, "url", f"{where}.source")
    raise Invalid(f"{where}.source.type", 'expected "base64" or "url"')


def _part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """
    @return: a user content block as a chat content part.
    @raise Invalid: a block of another type.
    """
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": string(block, "text", where)}
    if kind == "image":
        return {
            "type": "image_url",
            "image_url": {"url": _image_url(block.get("source"), where)},
        }
    if kind == "document":
        source = block.get("source")
        kind = source.get("type") if isinstance(source, dict) else None
        if kind == "text":
            assert isinstance(source, dict)
            return {"type": "text", "text": string(source, "data", f"{where}.source")}
        if kind == "content":
            assert isinstance(source, dict)
            text = _text_of(source.get("content"), f"{where}.source.content")
            return {"type": "text", "text": text}
        if kind == "file":
            assert isinstance(source, dict)
            file_id = string(source, "file_id", f"{where}.source")
            return {"type": "file", "file": {"file_id": file_id}}
        url = _image_url(source, where)
        file: dict[str, Any] = (
            {"file_data": url} if url.startswith("data:") else {"file_id": url}
        )
        if isinstance(block.get("title"), str):
            file["filename"] = block["title"]
        return {"type": "file", "file": file}
    raise Invalid(
        f"{where}.type",
        "expected one of text, image, document, tool_use, tool_result;"
        f" got {json.dumps(kind)[:50]}",
    )


def _tool_result(
    block: dict[str, Any], where: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """
    @return: a C{tool_result} block as a chat C{tool} message, and the
        image parts of its content (a tool message holds text only: they
        go in the user message that follows).
    """
    call_id = string(block, "tool_use_id", where)
    content = block.get("content", "")
    images: list[dict[str, Any]] = []
    if isinstance(content, list):
        texts = []
        for index, item in enumerate(content):
            at = f"{where}.content.{index}"
            if not isinstance(item, dict):
                raise Invalid(at, f"expected an object, got {json_kind(item)}")
            if item.get("type") == "tool_reference":
                # A tool search's answer: the tool joins the request's
                # tools (anthropic_fields.referenced_tools).
                texts.append(f"Tool loaded: {string(item, 'tool_name', at)}")
                continue
            part = _part(item, at)
            if part["type"] == "text":
                texts.append(part["text"])
            else:
                images.append(part)
        text = "\n".join(texts)
    elif isinstance(content, str):
        text = content
    else:
        raise Invalid(
            f"{where}.content",
            f"expected a string or an array, got {json_kind(content)}",
        )
    if block.get("is_error") is True and text:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}, images


def _user(content: object, where: str) -> list[dict[str, Any]]:
    """
    @return: a user turn as chat messages: its tool results first, as
        C{tool} messages answering the assistant's calls, then the rest.
    """
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise Invalid(
            f"{where}.content",
            f"expected a string or an array, got {json_kind(content)}",
        )
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.content.{index}"
        if not isinstance(block, dict):
            raise Invalid(at, f"expected an object, got {json_kind(block)}")
        if block.get("type") == "tool_result":
            message, images = _tool_result(block, at)
            tools.append(message)
            parts.extend(images)
        else:
            parts.append(_part(block, at))
    if parts:
        tools.append({"role": "user", "content": parts})
    return tools


def _assistant(content: object, where: str) -> dict[str, Any]:
    """
    @return: an assistant turn as one chat message: its text, and its
        C{tool_use} blocks as C{tool_calls} (thinking blocks left out).
    """
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise Invalid(
            f"{where}.content",
            f"expected a string or an array, got {json_kind(content)}",
        )
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.content.{index}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(string(block, "text", at))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise Invalid(
                    f"{at}.input", f"expected an object, got {json_kind(arguments)}"
                )
            calls.append(
                {
                    "id": string(block, "id", at),
                    "type": "function",
                    "function": {
                        "name": string(block, "name", at),
                        "arguments": json.dumps(arguments),
                    },
                }
            )
        elif kind not in ("thinking", "redacted_thinking"):
            raise Invalid(f"{at}.type", "expected one of text, tool_use, thinking")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    messages = payload.get("messages")
    if not isinstance(messages, list):
        raise Invalid(
            "messages",
            f"expected an array, got {json_kind(messages)}"
            if "messages" in payload
            else "Field required",
        )
    chat: list[dict[str, Any]] = []
    system = payload.get("system")
    prompts = [] if system is None else [_text_of(system, "system")]
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if not isinstance(message, dict):
            raise Invalid(where, f"expected an object, got {json_kind(message)}")
        role = message.get("role")
        if role == "user":
            chat.extend(_user(message.get("content"), where))
        elif role == "assistant":
            chat.append(_assistant(message.get("content"), where))
        elif role == "system":
            # Claude Code's per-turn reminders: many chat templates take a
            # system message first only, so each joins the system prompt,
            # in order (what vLLM's route does for such templates).
            prompts.append(_text_of(message.get("content"), f"{where}.content"))
        else:
            raise Invalid(
                f"{where}.role",
                'expected "user", "assistant" or "system",'
                f" got {json.dumps(role)[:50]}",
            )
    if not chat:
        # Anthropic's own 400 for no message; with system turns only, or
        # a user turn of no blocks, there is no conversation either: an
        # engine would generate from the system prompt alone, or from an
        # empty chat on llama-cpp-python.
        raise Invalid(
            "messages",
            "at least one user or assistant message is required"
            if messages
            else "at least one message is required",
        )
    if prompts:
        chat.insert(0, {"role": "system", "content": "\n\n".join(prompts)})
    return chat


def _count(payload: dict[str, Any], name: str, required: bool) -> int | None:
    value = payload.get(name)
    if value is None and not required:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= 2**31 - 1
    ):
        if name not in payload:
            raise Invalid(name, "Field required")
        raise Invalid(
            name,
            f"expected an integer from 1 to {2**31 - 1}, got {json.dumps(value)[:50]}",
        )
    return value


def to_chat(payload: dict[str, Any], counting: bool = False) -> dict[str, Any]:
    """
    Translate a Messages API request into a chat completions request.

    @param payload: the client's body, parsed; its C{model} checked.
    @param counting: a C{count_tokens} request: no C{max_tokens} is
        needed, and the chat asks for one token (its usage counts the
        prompt).
    @return: the chat completions body, a stream asking for its usage
        (C{stream_options.include_usage}).
    @raise Invalid: a field the translation relies on is missing or of
        the wrong type, named.
    """
    chat: dict[str, Any] = {"model": payload["model"], "messages": _messages(payload)}
    chat["max_tokens"] = 1 if counting else _count(payload, "max_tokens", True)
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise Invalid("stream", f"expected a boolean, got {json_kind(stream)}")
    if stream and not counting:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    if not counting:
        sampling(payload, chat)
    tools(payload, chat)
    options(payload, chat, counting)
    return chat


def _tool_use(call: dict[str, Any], index: int) -> dict[str, Any]:
    function: dict[str, Any] = call.get("function") or {}
    if not isinstance(function, dict):
        function = {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, ValueError):
        arguments = {}
    return {
        "type": "tool_use",
        "id": call.get("id") or f"toolu_{index}",
        "name": function.get("name") or "",
        "input": arguments if isinstance(arguments, dict) else {},
    }


def to_message(
    chat: dict[str, Any],
    model: str,
    stops: tuple[str, ...] = (),
    thinking: bool = True,
) -> dict[str, Any]:
    """
    Translate a chat completion into a message.

    @param chat: the engine's answer, parsed.
    @param model: the model name the client sent.
    @param stops: the request's C{stop_sequences}.
    @param thinking: whether the engine's reasoning (C{reasoning}, or
        C{reasoning_content} before vLLM 0.32) becomes a first
        C{thinking} block, with a C{signature} as clients expect one.
    @raise ValueError: C{chat} is not a chat completion.
    """
    choices = chat.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("the answer has no choices")
    choice = choices[0]
    message: dict[str, Any] = choice.get("message") or {}
    if not isinstance(message, dict):
        message = {}
    content: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if thinking and reasoning:
        content.append(
            {"type": "thinking", "thinking": reasoning, "signature": signature()}
        )
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls")
    for index, call in enumerate(calls if isinstance(calls, list) else []):
        if isinstance(call, dict):
            content.append(_tool_use(call, index))
    reason, sequence = stop_reason(choice, stops)
    if any(block["type"] == "tool_use" for block in content):
        reason = "tool_use"
    return {
        "id": f"msg_{chat.get('id') or 'llmgw'}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": anthropic_usage(
            chat.get("usage") if isinstance(chat.get("usage"), dict) else None
        ),
    }


@dataclass(frozen=True)
class MessagesCall:
    """
    A Messages API request, both ways it can be sent: as it is, to an
    engine that serves the API, or translated (L{llmgw.router.api.prepare.Prepared}'s
    C{body} is the chat completions body then).

    @ivar native_body: the client's body, its model the catalog name.
    @ivar native_path: L{MESSAGES_PATH} or L{COUNT_TOKENS_PATH}.
    @ivar model: the model name the client sent (answers name it).
    @ivar stops: the request's C{stop_sequences}.
    @ivar thinking: whether the engine's reasoning is answered as
        C{thinking} blocks (L{llmgw.router.api.anthropic_fields.shows_thinking}).
    """

    native_body: bytes
    native_path: bytes
    model: str
    stops: tuple[str, ...] = ()
    thinking: bool = True

    @property
    def counting(self) -> bool:
        """
        Whether this is a C{count_tokens} request.
        """
        return self.native_path == COUNT_TOKENS_PATH

    def whole(self, body: bytes, native: bool) -> tuple[bytes, dict[str, Any] | None]:
        """
        @param body: an engine's successful whole answer.
        @param native: whether it came from the Messages API itself.
        @return: the answer for the client and the usage for the record
            (a chat completion's C{usage}), or L{None} when it has none.
        @raise APIError: a 502, the answer is not JSON of the expected
            shape.
        """
        try:
            return self._whole(body, native)
        except ValueError as e:
            raise upstream_failed(f"The replica's answer was refused: {e}.") from None

    def _whole(self, body: bytes, native: bool) -> tuple[bytes, dict[str, Any] | None]:
        parsed = json.loads(body)
        if not isinstance(parsed, dict):
            raise ValueError("it is not a JSON object")
        if native:
            if self.counting:
                count = parsed.get("input_tokens")
                return body, chat_usage({"input_tokens": count}) if isinstance(
                    count, int
                ) else None
            return body, chat_usage(parsed.get("usage"))
        usage = parsed.get("usage") if isinstance(parsed.get("usage"), dict) else None
        if self.counting:
            answer: dict[str, Any] = {
                "input_tokens": (usage or {}).get("prompt_tokens", 0)
            }
        else:
            answer = to_message(parsed, self.model, self.stops, self.thinking)
        return json.dumps(answer).encode("utf-8"), usage

    def relay(self, max_event_size: int, native: bool) -> MessagesStream | NativeStream:
        """
        @return: the stream's relay: a translation of a chat stream, or a
            watch on a native one (its usage read, its events passed on).
        """
        if native:
            return NativeStream(max_event_size)
        return MessagesStream(max_event_size, self.model, self.stops, self.thinking)
