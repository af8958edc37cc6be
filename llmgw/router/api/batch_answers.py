"""
What the Files and Batches routes share: their answers (JSON, or an error
in OpenAI's or Anthropic's shape), the key of a request, and the page
sizes of their lists.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.web.iweb import IRequest

from llmgw.router.api.credentials import request_key
from llmgw.router.edge.site import JSON
from llmgw.router.errors import APIError, anthropic_error, bad_request
from llmgw.router.interfaces import Auth


def answer(request: IRequest, body: dict[str, Any]) -> bytes:
    """
    @return: C{body} as JSON, its content type set.
    """
    request.setHeader(b"content-type", JSON)
    return json.dumps(body).encode("utf-8")


def openai_error(request: IRequest, error: APIError) -> bytes:
    """
    @return: C{error} as OpenAI's error object, its status set.
    """
    request.setResponseCode(error.status)
    request.setHeader(b"content-type", JSON)
    return error.body()


def anthropic_answer_error(request: IRequest, error: APIError) -> bytes:
    """
    @return: C{error} in Anthropic's shape, its status set.
    """
    status, body = anthropic_error(error)
    request.setResponseCode(status)
    request.setHeader(b"content-type", JSON)
    return body


def key_id(auth: Auth | None, request: IRequest) -> int | None:
    """
    @return: the id of the request's key; L{None} on a gateway without
        keys.
    @raise APIError: 401 (L{request_key}).
    """
    key = request_key(auth, request)
    return key.id if key is not None else None


def query(request: IRequest, name: str) -> str | None:
    """
    @return: the last value of the query's C{name}, or L{None}.
    """
    args: dict[bytes, list[bytes]] = request.args or {}
    values = args.get(name.encode("ascii"))
    return values[-1].decode("utf-8", "replace") if values else None


def limit(request: IRequest, name: str, default: int, most: int) -> int:
    """
    @return: the query's C{name}, an integer from 1 to C{most}; C{default}
        when absent.
    @raise APIError: 400 naming C{name}, out of range or not an integer.
    """
    text = query(request, name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise bad_request(f"{name} must be an integer from 1 to {most}.", name)
    return value


def json_body(request: IRequest) -> dict[str, Any]:
    """
    @return: the request's body, a JSON object.
    @raise APIError: 413, the body was over the route's limit; 400, it is
        not a JSON object.
    """
    if getattr(request, "body_too_large", False):
        raise APIError(
            413, "Request body too large.", "invalid_request_error", "request_too_large"
        )
    assert request.content is not None
    request.content.seek(0)
    try:
        body = json.loads(request.content.read())
    except (ValueError, RecursionError):
        # RecursionError: nested past the parser's depth.
        body = None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.")
    return body


__all__ = [
    "anthropic_answer_error",
    "answer",
    "json_body",
    "key_id",
    "limit",
    "openai_error",
    "query",
]
