"""
The Responses API's routes on stored responses: C{GET /v1/responses/{id}}
(the Response object), C{GET /v1/responses/{id}/input_items} (its input
items, a page at a time) and C{DELETE /v1/responses/{id}}.

Shapes from OpenAI's API reference ("Responses": retrieve, list input
items, delete) as the official C{openai} SDK parses them
(C{openai.types.responses.ResponseItemList}, C{responses.input_items.list}'s
cursor page).  An unknown id and another key's response get the same 404,
with the message, type and C{param} vLLM's Responses server gives
(C{vllm/entrypoints/openai/responses/serving.py}, C{_make_not_found_error}).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.web.iweb import IRequest

from llmgw.router.api.credentials import request_key
from llmgw.router.edge.site import JSON
from llmgw.router.errors import APIError
from llmgw.router.interfaces import Auth, KeptResponse, ResponseStore

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
"""
Input items per page: by default, and at most (the API's C{limit}, 1 to
100).
"""


def not_found(response_id: str) -> APIError:
    """
    @return: the 404 of an unknown response id (or another key's).
    """
    shown = response_id if len(response_id) <= 200 else response_id[:200] + "..."
    return APIError(
        404,
        f"Response with id {shown!r} not found.",
        "invalid_request_error",
        None,
        "response_id",
    )


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, "invalid_request_error", None, param)


def item_with_id(item: dict[str, Any], response_id: str, index: int) -> dict[str, Any]:
    """
    An input item as the API lists it: with an C{id} and a C{type}.  Items
    as clients send them may have neither (C{{"role": "user", "content":
    "hi"}}, the API's "easy" input message) and a string for content; the
    listing gives them an id made of the response's and their place (the
    same on every read, so C{after} pages through them) and their content
    as parts.

    @param index: the item's place in the response's input, from 0.
    @return: a new dict; C{item} is not changed.
    """
    shaped = dict(item)
    if "type" not in shaped and "role" in shaped:
        shaped["type"] = "message"
    if shaped.get("type") == "message" and isinstance(shaped.get("content"), str):
        part = "output_text" if shaped.get("role") == "assistant" else "input_text"
        shaped["content"] = [{"type": part, "text": shaped["content"]}]
    if not shaped.get("id"):
        prefix = "msg" if shaped.get("type") == "message" else "item"
        shaped["id"] = f"{prefix}_{response_id.removeprefix('resp_')}_{index}"
    return shaped


def _query(request: IRequest, name: str) -> str | None:
    args: dict[bytes, list[bytes]] = request.args or {}
    values = args.get(name.encode("ascii"))
    return values[-1].decode("utf-8", "replace") if values else None


def _limit(request: IRequest) -> int:
    text = _query(request, "limit")
    if text is None:
        return DEFAULT_LIMIT
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise _bad("limit", f"limit must be an integer from 1 to {MAX_LIMIT}.")
    return limit


def item_page(
    state: KeptResponse, limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """
    One page of a response's input items.

    @param order: C{"asc"} (the order the model saw them) or C{"desc"}.
    @param after: the id of the item the page starts after (in C{order}),
        or L{None} for the first page.
    @return: the API's list object: C{object}, C{data}, C{first_id},
        C{last_id} (L{None} for an empty page) and C{has_more}.
    @raise APIError: 400 naming C{after} when no item has that id.
    """
    items = [item_with_id(i, state.id, n) for n, i in enumerate(state.input_items)]
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise _bad("after", f"No input item with id {after!r} in this response.")
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }


class ResponseRoutes:
    """
    The stored responses' routes, each answering for the key of the
    request only (keys checked as on the other client routes: a missing or
    wrong key is a 401).

    @param responses: where responses are kept, or L{None} when nothing
        keeps them (every id is then unknown).
    @param auth: the API keys, or L{None} for an open gateway.
    """

    def __init__(self, responses: ResponseStore | None, auth: Auth | None) -> None:
        self._responses = responses
        self._auth = auth

    async def response(self, request: IRequest, response_id: str) -> bytes:
        """
        C{GET}: the stored Response object.  C{DELETE}: the response
        deleted, C{{"id", "object": "response", "deleted": true}}.
        """
        try:
            key_id = self._key_id(request)
            if request.method == b"DELETE":
                deleted = self._responses is not None and (
                    await self._responses.delete(response_id, key_id)
                )
                if not deleted:
                    raise not_found(response_id)
                body = {"id": response_id, "object": "response", "deleted": True}
                return _answer(request, body)
            state = await self._state(response_id, key_id)
            return _answer(request, state.response)
        except APIError as error:
            return _error(request, error)

    async def input_items(self, request: IRequest, response_id: str) -> bytes:
        """
        C{GET}: a page of the response's input items (L{item_page}), by the
        query's C{limit} (1 to 100, default 20), C{order} (C{asc} or
        C{desc}, the default) and C{after}; C{include} changes nothing
        (the items are kept whole).
        """
        try:
            key_id = self._key_id(request)
            limit = _limit(request)
            order = _query(request, "order") or "desc"
            if order not in ("asc", "desc"):
                raise _bad("order", "order must be 'asc' or 'desc'.")
            state = await self._state(response_id, key_id)
            page = item_page(state, limit, order, _query(request, "after"))
            return _answer(request, page)
        except APIError as error:
            return _error(request, error)

    def _key_id(self, request: IRequest) -> int | None:
        key = request_key(self._auth, request)
        return key.id if key is not None else None

    async def _state(self, response_id: str, key_id: int | None) -> KeptResponse:
        state = None
        if self._responses is not None:
            state = await self._responses.get(response_id, key_id)
        if state is None:
            raise not_found(response_id)
        return state


def _answer(request: IRequest, body: dict[str, Any]) -> bytes:
    request.setHeader(b"content-type", JSON)
    return json.dumps(body).encode("utf-8")


def _error(request: IRequest, error: APIError) -> bytes:
    request.setResponseCode(error.status)
    request.setHeader(b"content-type", JSON)
    return error.body()
