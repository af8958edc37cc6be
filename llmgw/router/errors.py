"""
OpenAI error objects, and the same errors in Anthropic's shape for the
Messages API's routes.

Shape from the OpenAI API reference ("Error codes"), as the official client
parses it: C{{"error": {"message", "type", "param", "code"}}} where C{code} is
a string or null.  Anthropic's (API reference, "Errors"): C{{"type": "error",
"error": {"type", "message"}}}, the type given by the status
(L{ANTHROPIC_TYPES}).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from twisted.web.http import RESPONSES
from twisted.web.http_headers import Headers

_TRACEBACK = re.compile(r'Traceback \(most recent call last\)|File "[^"\n]*", line \d+')
"""
What a Python traceback leaves in an engine's error message: its header,
or one of its frames (pydantic's validation errors quote a frame without
the header: C{File ".../llama_cpp/server/app.py", line 376, in ...}).
Such a message is not passed to a client.
"""


@dataclass(frozen=True)
class APIError(Exception):
    """
    A failure to report to the client as an OpenAI error object.

    @ivar status: the HTTP status code.
    @ivar message: a human-readable sentence; never an upstream address,
        a key or a traceback.
    @ivar type: the OpenAI error type, such as C{"invalid_request_error"}.
    @ivar code: a machine-readable code, or L{None}.
    @ivar param: the request field at fault, or L{None}.
    @ivar retry_after: seconds for a C{Retry-After} header, or L{None}.
    """

    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None

    def body(self) -> bytes:
        """
        @return: the JSON error object, UTF-8.
        """
        return json.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        ).encode("utf-8")

    def sse_event(self) -> bytes:
        """
        @return: the error object as one server-sent event, for a stream
            that already started; the official client raises C{APIError}
            when it reads an event whose data has an C{error} member.
        """
        return b"data: " + self.body() + b"\n\n"


ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""
Anthropic's error type for each status it documents; another 4xx is an
C{invalid_request_error}, another 5xx an C{api_error}.
"""
OVERLOADED = 529
"""
Anthropic's status for C{overloaded_error}: llmgw's 503s (no replica ready
yet, the replica overloaded) and the overload room's refusals.
"""


def anthropic_error(error: APIError) -> tuple[int, bytes]:
    """
    @return: the status and the body of C{error} in Anthropic's shape, the
        message naming the field at fault (C{"max_tokens: ..."}).
    """
    status = error.status
    if status == 503 or error.code == "model_overloaded":
        status = OVERLOADED
    kind = ANTHROPIC_TYPES.get(status) or (
        "invalid_request_error" if status < 500 else "api_error"
    )
    message = error.message
    if error.param and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return status, json.dumps(body).encode("utf-8")


def anthropic_event(error: APIError) -> bytes:
    """
    @return: C{error} as the Messages API's C{error} event, for a stream
        that already started (the official SDK raises it as an
        C{APIStatusError}).
    """
    return b"event: error\ndata: " + anthropic_error(error)[1] + b"\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    """
    @return: a 400 C{invalid_request_error}.
    """
    return APIError(400, message, "invalid_request_error", None, param)


def model_not_found(model: str) -> APIError:
    """
    @return: the 404 OpenAI returns for an unknown model.
    """
    if len(model) > 200:
        model = model[:200] + "..."
    return APIError(
        404,
        f"The model {model!r} does not exist.",
        "invalid_request_error",
        "model_not_found",
        "model",
    )


def body_too_large(limit: int) -> APIError:
    """
    @param limit: the maximum body size, bytes.
    @return: a 413 error.
    """
    return APIError(
        413,
        f"Request body too large: the limit is {limit} bytes.",
        "invalid_request_error",
        "request_too_large",
    )


def no_ready_replica(model: str) -> APIError:
    """
    @return: a 503 for a known model that no replica can serve now.
    """
    return APIError(
        503,
        f"No replica of model {model!r} is ready; try again later.",
        "service_unavailable_error",
        "no_ready_replica",
        retry_after=5,
    )


def upstream_failed(message: str) -> APIError:
    """
    @return: a 502: the replica broke the exchange.
    """
    return APIError(502, message, "upstream_error", "upstream_error")


def deadline_exceeded(phase: str, seconds: float) -> APIError:
    """
    @param phase: C{"connect"}, C{"first_byte"}, C{"idle"} or C{"total"}.
    @param seconds: the deadline that passed.
    @return: a 504 whose code names the phase, C{"<phase>_timeout"}.
    """
    what = {
        "connect": "connecting to the replica",
        "first_byte": "waiting for the first byte from the replica",
        "idle": "waiting for the next chunk from the replica",
        "total": "for the whole request",
    }[phase]
    return APIError(
        504,
        f"Deadline of {seconds:g}s exceeded {what}.",
        "timeout_error",
        f"{phase}_timeout",
    )


def retry_after(headers: Headers) -> int | None:
    """
    @return: a C{Retry-After} in whole seconds, when the engine sent one.
    """
    value = headers.getRawHeaders(b"retry-after", [b""])[0]
    return int(value) if value.isdigit() and len(value) < 10 else None


def engine_error(status: int, body: bytes, retry_after: int | None) -> APIError:
    """
    An engine's 4xx answer as an OpenAI error object.  Engines differ:
    OpenAI's and recent vLLM's C{{"error": {...}}} (vLLM with an integer
    C{code}), older vLLM's top-level C{message}, FastAPI's C{detail}.

    @param status: the engine's HTTP status.
    @param body: the engine's answer, any bytes.
    @param retry_after: seconds for C{Retry-After}, or L{None}.
    """
    error: dict[str, Any] = {}
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        nested = parsed.get("error")
        error = nested if isinstance(nested, dict) else parsed
    message = error_message(body) or (
        f"The replica rejected the request with status {status}."
    )
    kind = error.get("type")
    code = error.get("code")
    param = error.get("param")
    default_kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    return APIError(
        status,
        message,
        kind if isinstance(kind, str) and kind else default_kind,
        code if isinstance(code, str) else None,
        param if isinstance(param, str) else None,
        retry_after=retry_after,
    )


def engine_failure(
    status: int, content_type: bytes, body: bytes, retry_after: int | None
) -> APIError | None:
    """
    An engine's own 5xx error answer, to pass on with its status and
    message, when it is a well-formed error object: JSON
    (C{application/json}) holding OpenAI's and recent vLLM's
    C{{"error": {"message": ...}}}, or older vLLM's
    C{{"object": "error", "message": ...}}.  Anything else (HTML, plain
    text, a traceback page, JSON of another shape) is no answer the
    client can use: L{None}, and the caller answers 502.

    A message holding a Python traceback keeps to the operator's log
    (file paths, addresses): the client gets the status, type and code
    with a plain sentence instead.

    @param status: the engine's HTTP status, 500..599.
    @param content_type: its C{Content-Type}, raw.
    @param body: its answer, any bytes.
    @param retry_after: seconds for C{Retry-After} (the engine's), or
        L{None}.
    """
    if not content_type.split(b";")[0].strip().lower() == b"application/json":
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    nested = parsed.get("error")
    if isinstance(nested, dict) and isinstance(nested.get("message"), str):
        error: dict[str, Any] = nested
    elif parsed.get("object") == "error" and isinstance(parsed.get("message"), str):
        error = parsed
    else:
        return None
    message = str(error["message"])[:1000].strip()
    if not message or _TRACEBACK.search(message):
        message = f"The replica failed the request with status {status}."
    kind, code, param = error.get("type"), error.get("code"), error.get("param")
    return APIError(
        status,
        message,
        kind if isinstance(kind, str) and kind else "server_error",
        code if isinstance(code, str) else None,
        param if isinstance(param, str) else None,
        retry_after=retry_after,
    )


def error_message(body: bytes) -> str | None:
    """
    @return: the message of an engine's error body, if it has one: at most
        1,000 characters of C{error.message}, C{error}, C{message} or
        C{detail}.
    """
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])[:1000]
        if isinstance(error, str):
            return error[:1000]
        if isinstance(parsed.get("message"), str):
            return str(parsed["message"])[:1000]
        if isinstance(parsed.get("detail"), str):
            return str(parsed["detail"])[:1000]
    return None


def activation_queue_full(model: str, retry_after: int) -> APIError:
    """
    @param retry_after: seconds for C{Retry-After}, from the queue
        (L{llmgw.router.routing.activation.retry_seconds}).
    @return: a 503: too many requests already wait for C{model} to start.
    """
    return APIError(
        503,
        f"Too many requests are waiting for model {model!r} to start;"
        f" try again in {retry_after}s.",
        "service_unavailable_error",
        "activation_queue_full",
        retry_after=retry_after,
    )


def model_unplaceable(model: str, why: str) -> APIError:
    """
    @param why: why no node could ever hold it (L{NeverPlaceable.why}).
    @return: a 503 at once: C{model} can never be placed on the fleet as
        it is, so waiting for it would be in vain.
    """
    return APIError(
        503,
        f"Model {model!r} can never be placed on this fleet: {why}.",
        "service_unavailable_error",
        "model_unplaceable",
    )


def activation_timeout(
    model: str, seconds: float, why: str, retry_after: int
) -> APIError:
    """
    @param seconds: how long the request waited.
    @param why: why no replica is ready, for the client, or C{""}.
    @param retry_after: seconds for C{Retry-After}, from the queue
        (L{llmgw.router.routing.activation.retry_seconds}).
    @return: a 503: no replica of C{model} became ready in time.
    """
    return APIError(
        503,
        f"No replica of model {model!r} became ready within {seconds:g}s"
        + (f" ({why})" if why else "")
        + f"; try again in {retry_after}s.",
        "service_unavailable_error",
        "activation_timeout",
        retry_after=retry_after,
    )


def replica_unavailable(retry_after: int | None) -> APIError:
    """
    @param retry_after: the engine's C{Retry-After}, seconds, or L{None}
        (then 1).
    @return: a 503: the replica is overloaded or not ready.
    """
    return APIError(
        503,
        "The replica is overloaded or not ready.",
        "service_unavailable_error",
        "replica_unavailable",
        retry_after=retry_after or 1,
    )


_MORE_REASONS = {
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    499: b"Client Closed Request",
}
"""
Reason phrases twisted.web's table lacks (RFC 6585 sections 4 and 5;
499 is nginx's).
"""


def reason_phrase(status: int) -> bytes:
    """
    @return: the reason phrase of an HTTP/1.1 status line for C{status}:
        twisted.web's, else RFC 6585's, else C{Error} (twisted.web's own
        fallback is C{Unknown Status}).
    """
    return RESPONSES.get(status) or _MORE_REASONS.get(status, b"Error")
