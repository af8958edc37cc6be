"""
The OpenAI request and response shapes the simulator speaks, without I/O.

Shapes follow the OpenAI API reference
(U{https://platform.openai.com/docs/api-reference/chat},
U{https://platform.openai.com/docs/api-reference/completions},
U{https://platform.openai.com/docs/api-reference/embeddings}): the
C{chat.completion}, C{chat.completion.chunk} and C{text_completion} objects,
C{usage} with C{prompt_tokens}, C{completion_tokens} and C{total_tokens},
and with C{stream_options.include_usage} a last chunk with C{"choices": []}
and C{usage}, every other chunk carrying C{"usage": null}.  Errors are
C{{"error": {"message", "type", "param", "code"}}}.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from llmgw.sim.engine import (
    VOCAB_JSON,
    completion_tokens,
    count_prompt_tokens,
    token_indices,
)
from llmgw.sim.script import Script, full_message, plan, stream_chunks

FAULTS_FIELD = "llmgw_sim"
"""
The request body field holding per-request faults.
"""

DONE_EVENT = b"data: [DONE]\n\n"


def _dumps(obj: object) -> bytes:
    # Compact, and UTF-8 rather than \\u escapes: the byte stream must
    # really carry multi-byte characters.
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate echoed from the request: ASCII escapes carry it.
        return json.dumps(obj, separators=(",", ":")).encode("ascii")


def json_body(obj: object) -> bytes:
    """
    C{obj} as compact UTF-8 JSON.
    """
    return _dumps(obj)


class ApiError(Exception):
    """
    A request the simulator refuses, with its HTTP status and OpenAI error.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> bytes:
        """
        The OpenAI error object as JSON.
        """
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None, code: str | None) -> bytes:
    """
    An OpenAI error object:
    C{{"error": {"message", "type", "param", "code"}}}, as JSON.
    """
    return _dumps(
        {"error": {"message": message, "type": type, "param": param, "code": code}}
    )


def error_type_for(status: int) -> str:
    """
    The OpenAI error C{type} commonly paired with an HTTP status.
    """
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def model_not_found(model: str) -> ApiError:
    """
    The 404 OpenAI answers for an unknown model.
    """
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


Kind = Literal["chat", "completion"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """
    A parsed chat or completions request.

    @ivar kind: C{"chat"} or C{"completion"}.
    @ivar model: the requested model name.
    @ivar prompt: the prompt text in UTF-8 (chat: message contents joined by
        spaces), which seeds the completion.
    @ivar prompt_tokens: whitespace-separated words in the prompt, at least 1.
    @ivar max_tokens: completion tokens asked for, or None for the default.
    @ivar stream: answer with server-sent events.
    @ivar include_usage: C{stream_options.include_usage}.
    @ivar faults: the C{llmgw_sim} field, unvalidated, or None.
    @ivar ignore_eos: vLLM's C{ignore_eos}: the answer is C{max_tokens} long.
    @ivar min_tokens: vLLM's C{min_tokens}: no natural end before these.
    @ivar script: the scripted answer the chat messages ask for
        (L{llmgw.sim.script}), or None.
    @ivar thinks: whether a reasoning parser may find reasoning in the
        answer: not when the request turns thinking off
        (C{reasoning_effort: "none"}, or C{chat_template_kwargs} with
        C{enable_thinking: false}, as Qwen3's and DeepSeek's templates read).
    """

    kind: Kind
    model: str
    prompt: bytes
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    faults: object
    ignore_eos: bool = False
    min_tokens: int = 0
    script: Script | None = None
    thinks: bool = True


def parse_json_object(body: bytes) -> dict[str, object]:
    """
    A request body as a JSON object.

    @raise ApiError: 400, not JSON or not an object.
    """
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "request body must be a JSON object")
    return obj


def _model(obj: dict[str, object]) -> str:
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is a required string", param="model")
    return model


def _message_text(content: object, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise ApiError(
                    400, "content parts must be objects", param=f"messages[{index}]"
                )
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ApiError(
                        400,
                        "a text part needs a string 'text'",
                        param=f"messages[{index}]",
                    )
                texts.append(text)
        return " ".join(texts)
    raise ApiError(
        400,
        "message content must be a string or a list of parts",
        param=f"messages[{index}].content",
    )


def _chat_prompt(obj: dict[str, object]) -> tuple[str, Script | None]:
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    texts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, "each message must be an object", param="messages")
        texts.append(_message_text(message.get("content"), i))
    return " ".join(texts), plan(messages, obj.get("tools"))


def _completion_prompt(obj: dict[str, object]) -> str:
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        # Several prompts are read as one: the simulator answers one choice.
        if all(isinstance(p, str) for p in prompt):
            return " ".join(prompt)
        return json.dumps(prompt)
    raise ApiError(400, "'prompt' must be a string or a non-empty list", param="prompt")


def _max_tokens(obj: dict[str, object]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = obj.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ApiError(400, f"'{key}' must be an integer >= 0", param=key)
        return value
    return None


def _length_fields(obj: dict[str, object], max_tokens: int | None) -> tuple[bool, int]:
    # vLLM's extra sampling fields: its protocol types them as a boolean
    # and an integer >= 0, and its SamplingParams refuses a min_tokens
    # above max_tokens.
    ignore_eos = obj.get("ignore_eos", False)
    if ignore_eos is None:
        ignore_eos = False
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")
    min_tokens = obj.get("min_tokens", 0)
    if min_tokens is None:
        min_tokens = 0
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool):
        min_tokens = -1
    if min_tokens < 0:
        raise ApiError(400, "'min_tokens' must be an integer >= 0", param="min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise ApiError(
            400,
            f"min_tokens must be less than or equal to max_tokens={max_tokens},"
            f" got {min_tokens}.",
            param="min_tokens",
        )
    return ignore_eos, min_tokens


def parse_generation(kind: Kind, body: bytes) -> GenerationRequest:
    """
    Parse a C{/v1/chat/completions} (C{kind="chat"}) or C{/v1/completions}
    body.

    @raise ApiError: 400 for bad JSON or missing or ill-typed fields.
    """
    obj = parse_json_object(body)
    model = _model(obj)
    script = None
    if kind == "chat":
        text, script = _chat_prompt(obj)
    else:
        text = _completion_prompt(obj)
    max_tokens = _max_tokens(obj)
    ignore_eos, min_tokens = _length_fields(obj, max_tokens)
    stream = obj.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    include_usage = False
    options = obj.get("stream_options")
    if isinstance(options, dict):
        include_usage = options.get("include_usage") is True
    elif options is not None:
        raise ApiError(
            400, "'stream_options' must be an object", param="stream_options"
        )
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt=text.encode("utf-8", "surrogatepass"),
        prompt_tokens=count_prompt_tokens(text),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        faults=obj.get(FAULTS_FIELD),
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        script=script,
        thinks=_thinks(obj),
    )


def _thinks(obj: dict[str, object]) -> bool:
    kwargs = obj.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False:
        return False
    return obj.get("reasoning_effort") != "none"


def reasoning_tokens(parser: str, req: GenerationRequest, count: int) -> int:
    """
    @param parser: the sim's C{--reasoning-parser}, or C{""}.
    @param count: the answer's completion tokens.
    @return: how many of them are reasoning: the first half (rounded down)
        of a chat answer when a parser is on and the request thinks, as a
        thinking model's answer opens with its reasoning; else 0.
    """
    if not parser or req.kind != "chat" or not req.thinks:
        return 0
    return count // 2


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """
    A parsed C{/v1/embeddings} request.

    @ivar model: the requested model name.
    @ivar inputs: each input's bytes (text in UTF-8, a token list as JSON).
    @ivar prompt_tokens: words per text input (at least 1) plus the length
        of each token list.
    @ivar faults: the C{llmgw_sim} field, unvalidated, or None.
    """

    model: str
    inputs: Sequence[bytes]
    prompt_tokens: int
    faults: object


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def parse_embeddings(body: bytes) -> EmbeddingRequest:
    """
    Parse a C{/v1/embeddings} body: C{input} is a string, a list of strings,
    a token list or a list of token lists.

    @raise ApiError: 400 for bad JSON or a missing or ill-typed C{input}.
    """
    obj = parse_json_object(body)
    model = _model(obj)
    raw = obj.get("input")
    items: list[object]
    if isinstance(raw, str):
        items = [raw]
    elif isinstance(raw, list) and raw and _is_token_list(raw):
        items = [raw]
    elif isinstance(raw, list) and raw:
        items = list(raw)
    else:
        raise ApiError(
            400, "'input' must be a string or a non-empty list", param="input"
        )
    inputs = []
    tokens = 0
    for item in items:
        if isinstance(item, str):
            inputs.append(item.encode("utf-8", "surrogatepass"))
            tokens += count_prompt_tokens(item)
        elif _is_token_list(item) and item:
            inputs.append(json.dumps(item).encode("ascii"))
            tokens += len(item)  # type: ignore[arg-type]
        else:
            raise ApiError(
                400,
                "each input must be a string or a non-empty list of integers",
                param="input",
            )
    return EmbeddingRequest(model, inputs, tokens, obj.get(FAULTS_FIELD))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """
    An OpenAI C{usage} object.
    """
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_text(prompt: bytes, count: int) -> str:
    """
    The whole completion as one string.
    """
    return "".join(completion_tokens(prompt, count))


def _call_id(response_id: str) -> str:
    # vLLM names tool calls chatcmpl-tool-<random>; the simulator's are
    # deterministic and unique in the process, like its response ids.
    return "chatcmpl-tool-" + response_id.removeprefix("chatcmpl-")


def full_response(
    req: GenerationRequest,
    response_id: str,
    created: int,
    count: int,
    reasoning: int = 0,
    finish: str = "length",
) -> bytes:
    """
    The non-streamed answer: a C{chat.completion} or C{text_completion};
    for a scripted answer (C{req.script}) its message and finish reason.

    @param count: completion tokens.
    @param finish: the C{finish_reason} of a generated answer.
    @param reasoning: how many of them are reasoning: the message's
        C{reasoning} (vLLM 0.32's field with a reasoning parser), the rest
        its C{content}.
    """
    choice: dict[str, object]
    tokens = completion_tokens(req.prompt, count)
    text = "".join(tokens[reasoning:])
    if req.script is not None:
        choice = {
            "index": 0,
            "message": full_message(req.script, _call_id(response_id)),
            "logprobs": None,
            "finish_reason": req.script.finish_reason,
        }
        obj = "chat.completion"
    elif req.kind == "chat":
        message = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning"] = "".join(tokens[:reasoning])
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return _dumps(
        {
            "id": response_id,
            "object": obj,
            "created": created,
            "model": req.model,
            "choices": [choice],
            "usage": usage(req.prompt_tokens, count),
        }
    )


def _scripted_events(
    req: GenerationRequest, script: Script, response_id: str, created: int, count: int
) -> list[bytes]:
    """
    @return: a scripted answer's events (L{llmgw.sim.script.stream_chunks}),
        then C{[DONE]}.
    """
    fields: dict[str, object] = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": req.model,
    }
    counts = usage(req.prompt_tokens, count) if req.include_usage else None
    chunks = stream_chunks(fields, script, _call_id(response_id), counts)
    return [*chunks, DONE_EVENT]


def stream_events(
    req: GenerationRequest,
    response_id: str,
    created: int,
    count: int,
    reasoning: int = 0,
    finish: str = "length",
) -> tuple[list[bytes], int]:
    """
    The server-sent events of a streamed answer, each C{data: <json>\\n\\n}.

    Chat: a role chunk (C{delta} C{{"role": "assistant", "content": ""}}),
    one chunk per token, a chunk with an empty delta and C{finish_reason},
    the usage chunk if asked for, C{[DONE]}.  Completions: one chunk per
    token, a chunk with empty text and C{finish_reason}, the usage chunk if
    asked for, C{[DONE]}.  A scripted answer: L{_scripted_events}.

    @param count: completion tokens (a scripted answer's L{Script.tokens}).
    @param finish: the C{finish_reason} of a generated answer.
    @param reasoning: how many of them are reasoning: their deltas are
        C{{"reasoning": ...}}, as vLLM 0.32's with a reasoning parser.
    @return: the events, and the index of the first token's event.
    """
    if req.script is not None:
        return _scripted_events(req, req.script, response_id, created, count), 1
    head = _dumps(
        {
            "id": response_id,
            "object": "chat.completion.chunk"
            if req.kind == "chat"
            else "text_completion",
            "created": created,
            "model": req.model,
        }
    )[:-1]
    tail_usage = b',"usage":null}\n\n' if req.include_usage else b"}\n\n"
    events: list[bytes] = []
    if req.kind == "chat":
        first = 1
        events.append(
            b"data: "
            + head
            + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]' + tail_usage
        )
        prefix = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
        suffix = b'},"logprobs":null,"finish_reason":null}]' + tail_usage
        last = (
            # vLLM's finish chunk carries a content string (its last
            # token's, or ""), never an empty delta.
            b"data: "
            + head
            + b',"choices":[{"index":0,"delta":{"content":""},"logprobs":null,'
            b'"finish_reason":"' + finish.encode("ascii") + b'"}]' + tail_usage
        )
    else:
        first = 0
        prefix = b"data: " + head + b',"choices":[{"index":0,"text":'
        suffix = b',"logprobs":null,"finish_reason":null}]' + tail_usage
        last = (
            b"data: " + head + b',"choices":[{"index":0,"text":"","logprobs":null,'
            b'"finish_reason":"' + finish.encode("ascii") + b'"}]' + tail_usage
        )
    size = len(VOCAB_JSON)
    thinking = prefix.replace(b'"delta":{"content":', b'"delta":{"reasoning":')
    events.extend(
        (thinking if n < reasoning else prefix) + VOCAB_JSON[i % size] + suffix
        for n, i in enumerate(token_indices(req.prompt, count))
    )
    events.append(last)
    if req.include_usage:
        events.append(
            b"data: "
            + head
            + b',"choices":[],"usage":'
            + _dumps(usage(req.prompt_tokens, count))
            + b"}\n\n"
        )
    events.append(DONE_EVENT)
    return events, first


def embeddings_response(
    req: EmbeddingRequest, vectors: Sequence[Sequence[float]]
) -> bytes:
    """
    The OpenAI embeddings answer: C{{"object": "list", "data": [...],
    "model", "usage"}}, the usage with C{completion_tokens} 0 as vLLM's
    (its C{UsageInfo}'s default; OpenAI's own names no completion count).
    """
    return _dumps(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": list(v)}
                for i, v in enumerate(vectors)
            ],
            "model": req.model,
            "usage": {
                "prompt_tokens": req.prompt_tokens,
                "total_tokens": req.prompt_tokens,
                "completion_tokens": 0,
            },
        }
    )
