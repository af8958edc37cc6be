"""
The Responses API's stored responses: the row type and the statements both
engines run on the C{responses} table (migration 9).  A response is kept
under the key that made it and read back only by that key: the key is part
of every lookup, so another key's response reads as an unknown one.

The Responses API keeps a response (C{store}, true by default) so that a
later request continues it by C{previous_response_id}, and so that
C{GET /v1/responses/{id}} and its C{input_items} read it back (OpenAI's API
reference, "Responses").  The items and the Response object are JSON
objects kept as JSON text: the store only hands them back.

A leaf, as the whole store: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """
    One response of the Responses API, as the store keeps it.

    @ivar id: the response's id, C{"resp_..."}.
    @ivar key_id: the API key that made it; L{None} on a server without
        keys.
    @ivar model: the model's name, as the client asked for it.
    @ivar created_at: when it was made, POSIX seconds.
    @ivar previous_response_id: the response it continued, or L{None}.
    @ivar input_items: every input item the model saw, in order (those of
        the responses it continued first), as the API's item objects.
    @ivar output_items: this response's output items.
    @ivar response: the Response object as returned to the client.
    """

    id: str
    key_id: int | None
    model: str
    created_at: float
    previous_response_id: str | None
    input_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    response: dict[str, Any]


RESPONSE_COLUMNS = (
    "id, key_id, model, created_at, previous_response_id,"
    " input_items, output_items, response"
)


def _json(value: Any) -> str:
    # ASCII: a client's JSON may hold a lone surrogate ("\\ud800"), which
    # json.loads takes but neither driver can encode as UTF-8 text.
    return json.dumps(value, separators=(",", ":"))


def response_values(row: StoredResponse) -> tuple[Any, ...]:
    """
    @return: the values of L{RESPONSE_COLUMNS} for one row, the items and
        the Response object as JSON text.
    """
    return (
        row.id,
        row.key_id,
        row.model,
        row.created_at,
        row.previous_response_id,
        _json(row.input_items),
        _json(row.output_items),
        _json(row.response),
    )


def response_row(values: Sequence[Any]) -> StoredResponse:
    """
    @param values: a row of C{SELECT RESPONSE_COLUMNS FROM responses}.
    @return: the row, its JSON decoded.
    """
    rid, key_id, model, created, previous, inputs, outputs, response = values
    return StoredResponse(
        id=str(rid),
        key_id=None if key_id is None else int(key_id),
        model=str(model),
        created_at=float(created),
        previous_response_id=previous,
        input_items=json.loads(inputs),
        output_items=json.loads(outputs),
        response=json.loads(response),
    )


def put_response_sql(placeholder: str) -> str:
    """
    @param placeholder: the driver's parameter marker, C{?} or C{%s}.
    @return: the statement keeping one row, taking L{response_values}: a
        response put again (a retried write) replaces its row, keeping the
        key that made it.
    """
    marks = ",".join([placeholder] * 8)
    return (
        f"INSERT INTO responses ({RESPONSE_COLUMNS}) VALUES ({marks})"
        " ON CONFLICT (id) DO UPDATE SET model = excluded.model,"
        " created_at = excluded.created_at,"
        " previous_response_id = excluded.previous_response_id,"
        " input_items = excluded.input_items,"
        " output_items = excluded.output_items, response = excluded.response"
    )


def owned(
    response_id: str, key_id: int | None, placeholder: str
) -> tuple[str, tuple[Any, ...]]:
    """
    The condition naming one response of one key, for either engine
    (C{key_id = NULL} is never true, and the engines spell "is not
    distinct from" differently).

    @return: the C{WHERE} clause's text and its parameters.
    """
    if key_id is None:
        return f"id = {placeholder} AND key_id IS NULL", (response_id,)
    return (
        f"id = {placeholder} AND key_id = {placeholder}",
        (response_id, key_id),
    )


__all__ = [
    "RESPONSE_COLUMNS",
    "StoredResponse",
    "owned",
    "put_response_sql",
    "response_row",
    "response_values",
]
