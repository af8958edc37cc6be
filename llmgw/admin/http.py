"""
What the admin API's route groups share: their error and the answers it
gives, reading and writing JSON, and L{Composed}, which serves the groups
as one resource.

Each route group (L{llmgw.admin.status}, L{llmgw.admin.models},
L{llmgw.admin.weights}, L{llmgw.admin.keys}, L{llmgw.admin.watch},
L{llmgw.admin.drains}, L{llmgw.admin.swaps}, L{llmgw.admin.batches}) is a
class with its own Klein app (C{app = error_answers(Klein())}) and the
collaborators it calls passed to its C{__init__}; L{llmgw.admin.api.Admin}
builds them and composes them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from klein import Klein
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound

from llmgw.control.plane import ControlPlane
from llmgw.router.routing.fairness import priority_rank

log = Logger()


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


def need_plane(plane: ControlPlane | None) -> ControlPlane:
    """
    @return: C{plane}.
    @raise AdminError: 404, this server has no control plane.
    """
    if plane is None:
        raise AdminError(404, "no control plane in this server", "not_found")
    return plane


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


def _no_path(request: IRequest) -> bytes:
    """
    @return: the 404 body for a path no route group has.
    """
    path = request.path.decode("utf-8", "replace")[:200]
    return json_answer(
        request, {"error": {"message": f"no path {path}", "code": "not_found"}}, 404
    )


def _no_method(request: IRequest, allowed: Sequence[str]) -> bytes:
    """
    @param allowed: the methods the path's routes take, for C{Allow}.
    @return: the 405 body for a method no route of the path takes.
    """
    if allowed:
        request.setHeader(b"allow", ", ".join(allowed).encode("ascii"))
    method = request.method.decode("ascii", "replace")
    return json_answer(
        request,
        {"error": {"message": f"{method} is not allowed here", "code": "bad_method"}},
        405,
    )


# Klein's error handlers: self is the route group (Klein's KleinErrorMethod
# names it so), which these do not need.


def _admin_error(self: object, request: IRequest, failure: Failure) -> bytes:
    error = failure.value
    assert isinstance(error, AdminError)
    body: dict[str, str] = {"message": error.message, "code": error.code}
    leader = getattr(error, "leader", None)  # A standby's (admin.watch).
    if leader is not None:
        body["leader"] = leader
    models = getattr(error, "models", None)  # A drain refused.
    answer: dict[str, Any] = dict(body, models=models) if models else body
    return json_answer(request, {"error": answer}, error.status)


def _not_found(self: object, request: IRequest, failure: Failure) -> bytes:
    return _no_path(request)


def _not_allowed(self: object, request: IRequest, failure: Failure) -> bytes:
    return _no_method(request, getattr(failure.value, "valid_methods", None) or [])


def _failed(self: object, request: IRequest, failure: Failure) -> bytes:
    # Last: the handlers before it take what they know first.
    log.failure("admin API: {path}", failure, path=request.path[:200])
    return json_answer(
        request,
        {
            "error": {
                "message": "internal error; see the server log",
                "code": "internal",
            }
        },
        500,
    )


def error_answers(app: Klein) -> Klein:
    """
    Make C{app}'s errors answer as the admin API's do: an L{AdminError}
    with its status and C{{"error": {"message", "code"}}} (and the
    C{"leader"} or C{"models"} it carries), a path no route has 404, a
    method the path does not take 405 with C{Allow}, anything else 500
    (logged).  Each route group's class calls it on its own app.

    @return: C{app}.
    """
    app.handle_errors(AdminError)(_admin_error)
    app.handle_errors(NotFound)(_not_found)
    app.handle_errors(MethodNotAllowed)(_not_allowed)
    app.handle_errors(Exception)(_failed)
    return app


class Composed(Resource):
    """
    Route groups served as one resource, as though their routes were in
    one URL map: a request goes to the first group with a route for its
    path and method; a path some group has, with a method none of them
    takes, is answered 405 with every group's methods for it in C{Allow}
    (C{DELETE /api/v1/models/<name>} and C{GET, POST
    /api/v1/models/<name>/activate} are in two groups); a path none has,
    404.

    No two groups have a route for the same path and method, so the order
    of the groups decides nothing.

    @param groups: each group's Klein app, bound to the group.
    """

    isLeaf = True

    def __init__(self, groups: Sequence[Klein]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._groups = [(group, group.resource()) for group in groups]

    def render(self, request: IRequest) -> Any:
        method = request.method.decode("ascii", "replace")
        postpath = getattr(request, "postpath", None) or []
        # The path as Klein matches it (klein._resource.extractURLparts).
        raw = b"/".join(postpath)
        try:
            path = ("" if raw.startswith(b"/") else "/") + raw.decode("utf-8")
        except UnicodeDecodeError:
            # Klein answers it (400), whichever group it asks.
            return self._groups[0][1].render(request)
        allowed: list[str] = []
        elsewhere: IResource | None = None
        for app, resource in self._groups:
            try:
                app.url_map.bind("", path_info=path, default_method=method).match()
            except MethodNotAllowed as e:
                allowed.extend(m for m in e.valid_methods or () if m not in allowed)
            except NotFound:
                pass
            except HTTPException:
                # A redirect (werkzeug's merged slashes): the group answers
                # it as it would have alone.
                elsewhere = elsewhere or resource
            else:
                return resource.render(request)
        if elsewhere is not None:
            return elsewhere.render(request)
        body = _no_method(request, allowed) if allowed else _no_path(request)
        # Written, as Klein writes every answer of the groups, so that the
        # framing is the same as theirs.
        request.write(body)
        request.finish()
        return NOT_DONE_YET
