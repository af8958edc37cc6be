"""
Request preparation, pure: a client's body parsed, checked and rewritten into
what is sent to the engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw.router.api.anthropic import (
    COUNT_TOKENS_PATH,
    Invalid,
    MessagesCall,
    to_chat,
)
from llmgw.router.api.anthropic_fields import shows_thinking
from llmgw.router.api.anthropic_stream import MessagesStream, NativeStream
from llmgw.router.api.fields import check_fields
from llmgw.router.api.responses import ResponsesCall
from llmgw.router.api.responses_stream import ResponsesStream
from llmgw.router.errors import APIError, anthropic_event, bad_request, model_not_found
from llmgw.router.interfaces import Endpoint
from llmgw.router.routing.affinity import AffinityRule
from llmgw.router.upstream.relay import UsageFilter

Relay = UsageFilter | MessagesStream | NativeStream | ResponsesStream
"""
What relays a stream: C{feed}, C{end}, C{usage}, C{done}.
"""

USAGE_STREAM_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions"})
"""
Paths whose streams follow the chat/completions chunk format, where
C{stream_options.include_usage} applies (OpenAI API reference).
"""
DEFAULT_RESERVED_COMPLETION = 256
"""
Completion tokens held against a key's budget for a request that sets no
max_tokens, until its real count comes.
"""
HELD_COMPLETION = 1024
"""
Completion tokens held at most against a key's limits while a request
runs, whatever its C{max_tokens}: a ceiling, not what an answer uses.
Coding agents ask 32,000 on every turn and most answers are a few hundred
tokens; holding the ceiling would refuse a key's second request on a
C{tpm} of 50,000 while the first has used a fraction of it.  The answer's
real count replaces the hold when it ends.
"""
_USAGE_MEMBER = b',"stream_options":{"include_usage":true}'


MEDIA_ITEM_TOKENS = 1600
"""
Prompt tokens estimated for each image, audio clip or file a request
carries, whatever its size in bytes.  Anthropic documents about
C{width * height / 750} tokens an image, about 1,600 for the largest it
takes unresized (1.15 megapixels, "Vision"); OpenAI's high-detail image
costs 85 plus 170 per 512-pixel tile (765 for 1024x1024).  Audio and files
depend on a length and pages the router does not decode: one item each too.
"""
_IMAGE_PARTS = ("image_url", "input_image")
_FILE_PARTS = ("file", "input_file")


def _inline_data(part: dict[str, Any]) -> str | None:
    """
    @return: the URL or data of a content part that is a medium (image,
        audio, file; chat completions' and the Responses API's spellings),
        C{""} when it has none inline, or L{None} for another part.
    """
    kind = part.get("type")
    if kind in _IMAGE_PARTS:
        value = part.get("image_url")
        value = value.get("url") if isinstance(value, dict) else value
    elif kind == "input_audio":
        value = part.get("input_audio")
        value = value.get("data") if isinstance(value, dict) else None
    elif kind in _FILE_PARTS:
        value = part.get("file", part)
        value = value.get("file_data") if isinstance(value, dict) else None
    else:
        return None
    return value if isinstance(value, str) else ""


def media(payload: dict[str, Any]) -> tuple[int, int]:
    """
    @param payload: a chat completions or Responses API body, parsed.
    @return: the media items in its messages' content parts, and the
        characters of their inline data (data URLs, base64 audio and
        files).
    """
    items = size = 0
    for field in ("messages", "input"):
        messages = payload.get(field)
        for message in messages if isinstance(messages, list) else ():
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else ():
                data = _inline_data(part) if isinstance(part, dict) else None
                if data is not None:
                    items += 1
                    size += len(data)
    return items, size


def estimate_prompt_tokens(body: bytes, payload: dict[str, Any] | None = None) -> int:
    """
    @param payload: C{body} parsed, when its media are to be counted as
        what they are.
    @return: the prompt tokens of a request body, estimated: about 4 bytes
        of request per token, but L{MEDIA_ITEM_TOKENS} for each image,
        audio clip or file in C{payload}'s content parts instead of its
        bytes (a 3 MiB inline image is 1,600 tokens, not 786,000).
    """
    if payload is None:
        return len(body) // 4
    items, size = media(payload)
    return max(0, len(body) - size) // 4 + items * MEDIA_ITEM_TOKENS


@dataclass(frozen=True)
class Prepared:
    """
    A request ready to send.

    @ivar body: the body for the engine, JSON.
    @ivar model: the catalog name engines serve (the requested name, or
        the model an alias names).
    @ivar requested_model: the name the client sent.
    @ivar stream: whether the client asked for a stream.
    @ivar strip_usage: the router asked for usage the client did not: the
        usage-only chunk of the stream is to be left out.
    @ivar max_tokens: the completion tokens the request may use, in
        C{0..1,000,000}; L{DEFAULT_RESERVED_COMPLETION} when it sets none.
    @ivar affinity: the affinity key (L{llmgw.router.routing.affinity}), or
        L{None}.
    @ivar estimate: the prompt's tokens, estimated
        (L{estimate_prompt_tokens}, its media counted per item).
    @ivar messages: for a Messages API request, the request as it came
        (C{body} is its chat completions translation); else L{None}.
    @ivar responses: for a Responses API request, the request and its
        answer (C{body} is its chat completions translation); else L{None}.
    """

    body: bytes
    model: str
    requested_model: str
    stream: bool
    strip_usage: bool
    max_tokens: int
    affinity: bytes | None = None
    estimate: int = 0
    messages: MessagesCall | None = None
    responses: ResponsesCall | None = None

    @property
    def call(self) -> MessagesCall | ResponsesCall | None:
        """
        The translated request whose whole answer is translated back
        (C{whole}), or L{None}.
        """
        return self.messages if self.messages is not None else self.responses

    @property
    def reserve(self) -> int:
        """
        Tokens to hold against a key while the request runs: its prompt
        (estimated) and its C{max_tokens} up to L{HELD_COMPLETION}.
        """
        return self.estimate + min(self.max_tokens, HELD_COMPLETION)

    def for_replica(self, path: bytes, endpoint: Endpoint) -> tuple[bytes, bytes, bool]:
        """
        @param path: the path of C{body} (a Messages API request's
            translation goes to L{llmgw.router.api.anthropic.CHAT_PATH}).
        @return: the path and the body to send to C{endpoint}, and whether
            they are a Messages API request as it came (the engine serves
            that API).
        """
        call = self.messages
        if call is not None and endpoint.messages:
            return call.native_path, call.native_body, True
        return path, self.body, False

    def relay(self, max_event_size: int, path: bytes, native: bool) -> Relay:
        """
        @param path: where the request went.
        @param native: whether it went as a Messages API request.
        @return: the filter of its stream (L{UsageFilter}), or a Messages
            API request's translation of it.
        """
        if self.messages is not None:
            return self.messages.relay(max_event_size, native)
        if self.responses is not None:
            return self.responses.relay(max_event_size)
        return UsageFilter(max_event_size, self.strip_usage, path in USAGE_STREAM_PATHS)

    def error_event(self, error: APIError) -> bytes:
        """
        @return: C{error} as the last event of this request's stream, in
            its API's shape.
        """
        if self.responses is not None:
            return self.responses.error_event(error)
        return anthropic_event(error) if self.messages else error.sse_event()


class Refused(Exception):
    """
    The request cannot be sent.

    @ivar error: the answer for the client.
    @ivar model: the model name read before the fault, or C{""}.
    @ivar stream: the C{stream} flag read before the fault.
    """

    def __init__(self, error: APIError, model: str = "", stream: bool = False):
        super().__init__(error)
        self.error = error
        self.model = model
        self.stream = stream


def _refuse_constant(name: str) -> float:
    # json.loads takes NaN, Infinity and -Infinity by default; RFC 8259
    # (section 6) has no such numbers, and engines parse them differently.
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    # A literal past a double's range (1e999) is JSON, but parses to
    # infinity: engines would take it as Infinity, and a body written
    # again would say Infinity, which is not JSON.
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:50]} is not a finite number")
    return value


def _payload(body: bytes) -> dict[str, Any]:
    """
    @return: C{body} parsed, a JSON object.
    @raise Refused: a 400: not JSON (a constant such as C{NaN} or an
        infinite number included), nested too deeply, or not an object.
    """
    try:
        payload = json.loads(
            body, parse_constant=_refuse_constant, parse_float=_finite_float
        )
    except ValueError as e:
        raise Refused(
            bad_request(f"The request body is not valid JSON: {e}.")
        ) from None
    except RecursionError:
        raise Refused(bad_request("The request body is nested too deeply.")) from None
    if not isinstance(payload, dict):
        raise Refused(bad_request("The request body must be a JSON object."))
    return payload


def _model(payload: dict[str, Any]) -> str:
    """
    @raise Refused: a 400: no model, or not a non-empty string.
    """
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise Refused(
            bad_request("You must provide a model parameter (a string).", param="model")
        )
    return model


def _completion_limit(payload: dict[str, Any]) -> int:
    """
    @return: the first whole number of the completion limit's three names,
        else L{DEFAULT_RESERVED_COMPLETION} (tokens).
    """
    return next(
        (
            payload[k]
            for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
            if isinstance(payload.get(k), int) and not isinstance(payload.get(k), bool)
        ),
        DEFAULT_RESERVED_COMPLETION,
    )


def _stream(payload: dict[str, Any], model: str) -> bool:
    """
    @return: whether the answer streams (C{null} is no).
    @raise Refused: a 400 for C{model}: C{stream} is not a boolean.
    """
    stream = payload.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise Refused(bad_request("'stream' must be a boolean.", param="stream"), model)
    return stream


def prepare(
    body: bytes,
    path: bytes,
    knows: Callable[[str], bool],
    resolve: Callable[[str], str | None],
    affinity: AffinityRule | None = None,
    session: bytes | None = None,
) -> Prepared:
    """
    Parse and check a request body, and rewrite it for the engine: an alias
    becomes its catalog name, and a stream on a L{USAGE_STREAM_PATHS} path
    asks for usage (C{stream_options.include_usage}).  A body is written
    again only when something in it changes other than the usage request of
    a body without C{stream_options}, which gets one member more.

    @param body: the client's body, bytes.
    @param path: the request path, such as C{b"/v1/chat/completions"}.
    @param knows: whether a model name is served or in the catalog.
    @param resolve: a name's catalog model, or L{None}.
    @param affinity: how to read the affinity key, or L{None} for none.
    @param session: the request's session header, or L{None}.
    @raise Refused: a 400 for a malformed body, a 404 for an unknown model.
    """
    payload = _payload(body)
    model = _model(payload)
    limit = _completion_limit(payload)
    stream = _stream(payload, model)
    if not knows(model):
        raise Refused(model_not_found(model), model, stream)
    canonical = resolve(model)
    target = model
    rewrite = canonical is not None and canonical != model
    if rewrite:
        # An alias: engines serve the catalog name.
        target = payload["model"] = str(canonical)
    fault = check_fields(payload, path)
    if fault is not None:
        raise Refused(fault, target, stream)
    strip_usage = False
    if stream and path in USAGE_STREAM_PATHS:
        # Ask for usage so it can be accounted, and hide the chunk that
        # carries it from a client that did not ask.
        options = payload.get("stream_options")
        if "stream_options" not in payload and not rewrite:
            strip_usage = True
            # The body stays as the client wrote it, with one member more
            # before its closing brace (it parsed as a JSON object, so it
            # ends with one).
            end = body.rstrip().rfind(b"}")
            body = body[:end] + _USAGE_MEMBER + body[end:]
        elif options is None or not options.get("include_usage"):
            payload["stream_options"] = {**(options or {}), "include_usage": True}
            strip_usage = True
            rewrite = True
    if rewrite:
        # ASCII escapes: any string JSON can hold encodes, lone surrogates
        # included.
        body = json.dumps(payload, allow_nan=False).encode("ascii")
    key = affinity.key(payload, len(body), session) if affinity is not None else None
    return Prepared(
        body=body,
        model=target,
        requested_model=model,
        stream=stream,
        strip_usage=strip_usage,
        max_tokens=min(max(limit, 0), 1_000_000),
        affinity=key,
        estimate=estimate_prompt_tokens(body, payload),
    )


def prepare_messages(
    body: bytes,
    path: bytes,
    knows: Callable[[str], bool],
    resolve: Callable[[str], str | None],
    affinity: AffinityRule | None = None,
    session: bytes | None = None,
) -> Prepared:
    """
    Parse and check a Messages API request (C{POST /v1/messages} or
    C{/v1/messages/count_tokens}) and translate it into chat completions
    (L{llmgw.router.api.anthropic.to_chat}); the request as it came is kept
    for engines that serve the API (C{Prepared.messages}), its alias
    replaced by the catalog name.

    @param path: L{llmgw.router.api.anthropic.MESSAGES_PATH} or
        L{COUNT_TOKENS_PATH}.
    @raise Refused: a 400 for a malformed body (naming the field), a 404
        for an unknown model.
    """
    payload = _payload(body)
    model = _model(payload)
    counting = path == COUNT_TOKENS_PATH
    stream = not counting and payload.get("stream") is True
    if not knows(model):
        raise Refused(model_not_found(model), model, stream)
    target = resolve(model) or model
    try:
        chat = to_chat(payload, counting)
    except Invalid as invalid:
        raise Refused(
            bad_request(invalid.message, invalid.param), target, stream
        ) from None
    chat["model"] = target
    native = body
    if target != model:
        native = json.dumps({**payload, "model": target}).encode("ascii")
    chat_body = json.dumps(chat, allow_nan=False).encode("ascii")
    stops = chat.get("stop", [])
    key = affinity.key(chat, len(chat_body), session) if affinity is not None else None
    return Prepared(
        body=chat_body,
        model=target,
        requested_model=model,
        stream=stream,
        strip_usage=False,
        max_tokens=chat["max_tokens"],
        affinity=key,
        estimate=estimate_prompt_tokens(chat_body, chat),
        messages=MessagesCall(
            native, path, model, tuple(stops), shows_thinking(payload)
        ),
    )


def prepare_responses(
    body: bytes,
    path: bytes,
    knows: Callable[[str], bool],
    resolve: Callable[[str], str | None],
    affinity: AffinityRule | None = None,
    session: bytes | None = None,
    history: list[dict[str, Any]] | None = None,
) -> Prepared:
    """
    Parse and check a Responses API request (C{POST /v1/responses}) and
    translate it into chat completions
    (L{llmgw.router.api.responses.ResponsesCall}).

    @param path: L{llmgw.router.api.responses.RESPONSES_PATH}.
    @param history: the items of the stored responses it continues
        (C{previous_response_id}), loaded, or L{None}.
    @raise Refused: a 400 for a malformed body (naming the field, as
        C{input[3].type}), a 404 for an unknown model.
    """
    payload = _payload(body)
    model = _model(payload)
    stream = payload.get("stream") is True
    if not knows(model):
        raise Refused(model_not_found(model), model, stream)
    target = resolve(model) or model
    try:
        call = ResponsesCall(payload, history=history)
    except Invalid as invalid:
        raise Refused(
            bad_request(invalid.message, invalid.param), target, stream
        ) from None
    chat = {**call.chat, "model": target}
    chat_body = json.dumps(chat, allow_nan=False).encode("ascii")
    key = affinity.key(chat, len(chat_body), session) if affinity is not None else None
    return Prepared(
        body=chat_body,
        model=target,
        requested_model=model,
        stream=stream,
        strip_usage=False,
        max_tokens=min(chat.get("max_tokens", DEFAULT_RESERVED_COMPLETION), 1_000_000),
        affinity=key,
        estimate=estimate_prompt_tokens(chat_body, chat),
        responses=call,
    )
