"""
The fields of a client's request that llmgw checks before any engine sees
it: those a path cannot go without, and the types of those llmgw or every
engine relies on.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.router.api.anthropic import CHAT_PATH, json_kind
from llmgw.router.errors import APIError, bad_request

_COUNTS = ("n", "max_tokens", "max_completion_tokens")
MAX_COUNT = 2**31 - 1
"""
The most a count field may hold: a signed 32-bit integer, as engines'
servers keep them (llama.cpp's C{n_predict} is an C{int32_t});
llama-cpp-python hangs its only worker for minutes on C{max_tokens} of
10**23, so no larger value reaches an engine.
"""


COMPLETIONS_PATH = b"/v1/completions"
REQUIRED_FIELDS: dict[bytes, tuple[str, ...]] = {
    CHAT_PATH: ("messages",),
    COMPLETIONS_PATH: ("prompt", "prompt_embeds"),
}
"""
The field a path's request cannot go without (any one of the names, the
first the one named in the error), as OpenAI's API reference marks them;
C{prompt_embeds} is vLLM's other way to give a completion's prompt.  Only
where an engine would not refuse the request itself: llama-cpp-python's
server defaults C{messages} to C{[]} and C{prompt} to C{""} and generates
from nothing (a chat request without C{messages} ran a 4,092-token
generation, 138 s of one engine's CPU).  Embeddings are left to the
engine, which refuses a request without its input, and whose input has
other names than OpenAI's (vLLM's chat embeddings take C{messages},
llama-server's C{content}).
"""


def _missing_field(payload: dict[str, Any], path: bytes) -> APIError | None:
    """
    @param payload: the parsed body, a JSON object.
    @param path: the request path, such as C{b"/v1/chat/completions"}.
    @return: OpenAI's 400 for a required field absent or null (C{"Missing
        required parameter: 'messages'."}, code C{missing_required_parameter})
        or for a chat's C{messages} an empty array (code C{empty_array});
        L{None} when the request has what L{REQUIRED_FIELDS} asks of its
        path.
    """
    names = REQUIRED_FIELDS.get(path, ())
    if names and all(payload.get(name) is None for name in names):
        return APIError(
            400,
            f"Missing required parameter: '{names[0]}'.",
            "invalid_request_error",
            "missing_required_parameter",
            names[0],
        )
    if path == CHAT_PATH and payload["messages"] == []:
        return APIError(
            400,
            "Invalid 'messages': empty array. Expected an array with minimum"
            " length 1, but got an empty array instead.",
            "invalid_request_error",
            "empty_array",
            "messages",
        )
    return None


def _wrong_type(payload: dict[str, Any], path: bytes) -> tuple[str, str] | None:
    """
    Check the types of the fields llmgw or every engine relies on, and
    nothing stricter: a field that is absent or null is not type-checked
    (which fields a path requires is L{_missing_field}'s), and unknown
    fields pass.  Messages and parameter names follow OpenAI's own 400s
    (C{"Invalid type for 'messages[0].role': ..."} with param
    C{messages.[0].role}).

      - C{messages}: an array of objects, each with a string C{role};
      - C{prompt}, C{prompt_embeds}: a string or an array;
      - C{stream}: a boolean; C{stream_options}: an object;
      - C{n}, C{max_tokens}, C{max_completion_tokens}: integers from 1 up
        to L{MAX_COUNT} (a boolean is not one), as OpenAI and vLLM take
        them; C{max_tokens} 0 only on a completion with C{echo} true
        (vLLM's prompt scoring, which generates nothing).
        llama-cpp-python takes a limit of 0 as none and generates until
        its context is full (4,086 tokens, 127 s, for a newcomer's
        C{max_tokens: 0}).

    @param payload: the parsed body, a JSON object.
    @param path: the request path, such as C{b"/v1/completions"}.
    @return: the message and the C{param} of the first fault, or L{None}.
    """
    messages = payload.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            return (
                "Invalid type for 'messages': expected an array of objects,"
                f" but got {json_kind(messages)} instead.",
                "messages",
            )
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                return (
                    f"Invalid type for 'messages[{index}]': expected an object,"
                    f" but got {json_kind(message)} instead.",
                    f"messages.[{index}]",
                )
            role = message.get("role")
            if not isinstance(role, str):
                got = json_kind(role) if "role" in message else "nothing"
                return (
                    f"Invalid type for 'messages[{index}].role': expected a"
                    f" string, but got {got} instead.",
                    f"messages.[{index}].role",
                )
    for name in ("prompt", "prompt_embeds"):
        prompt = payload.get(name)
        if prompt is not None and not isinstance(prompt, (str, list)):
            return (
                f"Invalid type for '{name}': expected a string or an array,"
                f" but got {json_kind(prompt)} instead.",
                name,
            )
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return "'stream' must be a boolean.", "stream"
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return "'stream_options' must be an object.", "stream_options"
    scoring = path == COMPLETIONS_PATH and payload.get("echo") is True
    for name in _COUNTS:
        value = payload.get(name)
        if value is None:
            continue
        low = 0 if scoring and name == "max_tokens" else 1
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not low <= value <= MAX_COUNT
        ):
            return (
                f"Invalid value for '{name}': expected an integer from {low} to"
                f" {MAX_COUNT}, but got {json.dumps(value)[:100]}.",
                name,
            )
    return None


def check_fields(payload: dict[str, Any], path: bytes) -> APIError | None:
    """
    @param payload: the parsed body, a JSON object.
    @param path: the request path, such as C{b"/v1/chat/completions"}.
    @return: the 400 for the first fault, a field of the wrong type
        (L{_wrong_type}, no code) before a required one missing
        (L{_missing_field}); L{None} for none.
    """
    fault = _wrong_type(payload, path)
    if fault is not None:
        return bad_request(*fault)
    return _missing_field(payload, path)
