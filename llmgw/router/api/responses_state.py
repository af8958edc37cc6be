"""
The Responses API's stored state: a request that continues a stored
response (C{previous_response_id}) gets its items first, and a response
asked to be kept (C{store}, true by default, as the API's) is kept once
complete, streamed or not, under the key that made it.  The store is
llmgw's (SQLite or PostgreSQL, through L{ResponseStore}), so a continuation
works on any replica, any router and after a restart.

The API's rules (OpenAI's API reference, "Responses", "Conversation
state"): the continued response's input and output items come before the
request's input; its C{instructions} do not carry over; an unknown
C{previous_response_id} is a 404 naming that param.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from twisted.logger import Logger
from twisted.web.iweb import IRequest

from llmgw.router.api.prepare import Prepared
from llmgw.router.errors import APIError
from llmgw.router.interfaces import KeptResponse, Key, ResponseStore


def unknown_response(response_id: str) -> APIError:
    """
    @return: the 404 for a response not found (or another key's).
    """
    shown = response_id[:100].encode("ascii", "backslashreplace").decode("ascii")
    return APIError(
        404,
        f"Previous response with id '{shown}' not found.",
        "invalid_request_error",
        "previous_response_not_found",
        "previous_response_id",
    )


def _previous(body: bytes) -> str | None:
    """
    @return: the body's C{previous_response_id}, or L{None} when it has
        none or does not parse (its preparation says why).
    """
    if b"previous_response_id" not in body:
        return None
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    previous = (
        payload.get("previous_response_id") if isinstance(payload, dict) else None
    )
    return previous if isinstance(previous, str) and previous else None


def _plausible(response_id: str) -> bool:
    """
    @return: whether C{response_id} could be one llmgw made (C{resp_} and
        32 hex digits): printable ASCII of at most 256 characters.  Another
        is unknown without asking the store (whose query could not even
        encode a lone surrogate).
    """
    return len(response_id) <= 256 and all(" " < c <= "~" for c in response_id)


class Conversations:
    """
    Stored responses, loaded and kept for the Responses API's route.

    @param store: where they are kept, or L{None} for a router without a
        store (every C{previous_response_id} is then unknown).
    @param wall_clock: the time of day, POSIX seconds.
    """

    log = Logger()

    def __init__(
        self, store: ResponseStore | None, wall_clock: Callable[[], float]
    ) -> None:
        self._store = store
        self._wall_clock = wall_clock

    async def history(
        self, request: IRequest, key: Key | None
    ) -> list[dict[str, Any]] | None:
        """
        @param request: a Responses API request (C{POST /v1/responses}).
        @return: the items of the response the request continues (its
            input, then its output), or L{None} when it continues none.
        @raise APIError: a 404 naming C{previous_response_id}: unknown,
            expired or another key's.
        """
        if getattr(request, "body_too_large", False):
            return None
        content = request.content
        assert content is not None
        content.seek(0)
        previous = _previous(content.read())
        if previous is None:
            return None
        if self._store is None or not _plausible(previous):
            raise unknown_response(previous)
        kept = await self._store.get(previous, key.id if key is not None else None)
        if kept is None:
            raise unknown_response(previous)
        return kept.input_items + kept.output_items

    async def keep(self, prepared: Prepared, key: Key | None) -> None:
        """
        Keep a Responses API request's response when it asked to be kept
        and completed (or came back incomplete); a failure to write is
        logged, the client has its answer.
        """
        call = prepared.responses
        if call is None or not call.store or call.result is None:
            return
        if self._store is None:
            return
        response = call.result
        kept = KeptResponse(
            id=call.id,
            key_id=key.id if key is not None else None,
            model=call.model,
            created_at=self._wall_clock(),
            previous_response_id=call.previous_response_id,
            input_items=call.items,
            output_items=list(response.get("output", [])),
            response=response,
        )
        try:
            await self._store.put(kept)
        except Exception:
            self.log.failure("response {id} could not be kept", id=call.id)
