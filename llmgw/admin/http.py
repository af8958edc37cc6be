"""
What the admin API's route modules share: the Klein app their routes
are on, its error, and reading and writing JSON.
"""

from __future__ import annotations

import json
from typing import Any

from klein import Klein
from twisted.web.iweb import IRequest

from llmgw.router.routing.fairness import priority_rank

app = Klein()
"""
The admin API's routes, from L{llmgw.admin.api} and
L{llmgw.admin.keys}; bound to an L{llmgw.admin.api.Admin}.
"""


class AdminError(Exception):
    """
    An answer other than 200: C{{"error": {"message", "code"}}}.

    @ivar status: the HTTP status.
    """

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def json_answer(request: IRequest, value: object, status: int = 200) -> bytes:
    """
    @return: C{value} as the JSON body of an answer with C{status}.
    """
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(value).encode("utf-8")


def not_found(what: str) -> AdminError:
    """
    @return: a 404 saying there is no C{what}.
    """
    return AdminError(404, f"no {what}", "not_found")


def priority_number(value: Any) -> int:
    """
    @param value: a body's C{priority}: a name of
        L{llmgw.router.routing.fairness.PRIORITIES}, an integer (or its digits), or
        L{None} for C{standard}.
    @return: its number, higher goes first.
    @raise AdminError: 400, it is none of those (the message names what is
        expected).
    """
    try:
        return priority_rank(value)
    except ValueError as e:
        raise AdminError(400, str(e)[:300], "bad_request") from None


def read_body(request: IRequest) -> dict[str, Any]:
    """
    @return: the request's JSON object body; C{{}} when empty.
    @raise AdminError: 400, not a JSON object.
    """
    content = request.content
    raw = content.read() if content is not None else b""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise AdminError(400, "the body is not valid JSON", "bad_request") from None
    if not isinstance(body, dict):
        raise AdminError(400, "the body must be a JSON object", "bad_request")
    return body
