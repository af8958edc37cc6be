"""
The API keys' SQL both engines share: the columns L{Store.update_key} may
change, a key's insert and update, what usage adds to a key's cost, and a
key's row read back (L{llmgw.store.base.Store}'s key methods).

A leaf, as the whole store: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol


class Costed(Protocol):
    """
    A usage row as L{key_costs} reads it (L{llmgw.store.base.UsageRow}).
    """

    @property
    def request_id(self) -> str: ...

    @property
    def key_id(self) -> int | None: ...

    @property
    def cost(self) -> float: ...


KEY_LIMITS = (
    "models",
    "rpm",
    "tpm",
    "budget_tokens",
    "budget_cost",
    "expires",
    "priority",
    "weight",
)
"""
The columns of a key that L{Store.update_key} may change: what it may use,
its limits, its expiry, and its priority and weight where requests wait.
"""


def key_update(changes: dict[str, Any], placeholder: str) -> tuple[str, list[Any]]:
    """
    The C{SET} clause of L{Store.update_key}'s statement, for either engine.

    @param changes: as L{Store.update_key} takes them.
    @param placeholder: the engine's parameter mark, C{?} or C{%s}.
    @return: the clause (C{"rpm = ?, models = ?"}) and its parameters.
    @raise ValueError: a column not in L{KEY_LIMITS}, or none at all.
    """
    unknown = sorted(set(changes) - set(KEY_LIMITS))
    if unknown or not changes:
        raise ValueError(f"key update: cannot change {unknown or 'nothing'}")
    columns = [c for c in KEY_LIMITS if c in changes]
    values = [
        json.dumps(changes[c])
        if c == "models" and changes[c] is not None
        else changes[c]
        for c in columns
    ]
    return ", ".join(f"{c} = {placeholder}" for c in columns), values


def key_insert(
    row: dict[str, Any], p: str, returning: str = ""
) -> tuple[str, tuple[Any, ...]]:
    """
    L{Store.add_key}'s statement, for either engine.

    @param row: as L{Store.add_key} takes it.
    @param p: the engine's parameter mark, C{?} or C{%s}.
    @param returning: what follows the values (C{" RETURNING id"}).
    @return: the statement and its parameters.
    """
    return (
        "INSERT INTO api_keys (name, prefix, hash, models, rpm, tpm,"
        " budget_tokens, admin, created, expires, priority, weight, budget_cost)"
        f" VALUES ({','.join([p] * 13)}){returning}",
        (
            row["name"],
            row["prefix"],
            row["hash"],
            json.dumps(row["models"]) if row["models"] is not None else None,
            row["rpm"],
            row["tpm"],
            row["budget_tokens"],
            int(row["admin"]),
            row["created"],
            row.get("expires"),
            str(row.get("priority") or "standard"),
            float(row.get("weight") or 1.0),
            row.get("budget_cost"),
        ),
    )


def key_costs(
    rows: Sequence[tuple[float, Costed]], seen: set[str]
) -> list[tuple[float, int]]:
    """
    What L{Store.add_usage} adds to each key's C{cost_used}: the cost of
    the rows not written before (their request id not in C{seen}), each
    once.

    @return: C{(cost, key id)} per key with a cost, for L{KEY_COST}.
    """
    fresh: set[str] = set(seen)
    costs: dict[int, float] = {}
    for _, row in rows:
        if row.request_id in fresh:
            continue
        fresh.add(row.request_id)
        if row.key_id is not None and row.cost:
            costs[row.key_id] = costs.get(row.key_id, 0.0) + row.cost
    return [(cost, key_id) for key_id, cost in costs.items()]


KEY_COST = "UPDATE api_keys SET cost_used = cost_used + {p} WHERE id = {p}"
"""
Adds to one key's C{cost_used} (L{key_costs}), C{{p}} the engine's mark.
"""


def key_row(names: Sequence[str], values: Sequence[Any]) -> dict[str, Any]:
    """
    @return: a key's dict as L{Store.prepare} gives it, from a row of
        C{SELECT * FROM api_keys}.
    """
    row = dict(zip(names, values, strict=True))
    row["models"] = json.loads(row["models"]) if row["models"] else None
    row["admin"] = bool(row["admin"])
    return row
