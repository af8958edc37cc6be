"""
The admin API's keys and usage routes (C{/api/v1/keys},
C{/api/v1/usage}).

A key's changes (made, changed, revoked) reach the other processes that
check keys: a router tier's through the watch's keys counter
(L{llmgw.tier.keys}), the processes on one PostgreSQL database through its
key events (L{llmgw.accounts.keysync}).
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Callable
from typing import Any

from klein import Klein
from twisted.web.iweb import IRequest

from llmgw.admin.http import (
    AdminError,
    error_answers,
    json_answer,
    not_found,
    priority_number,
    read_body,
)
from llmgw.config_checks import ConfigError, parse_duration
from llmgw.control.runtime import ModelCatalog
from llmgw.router.accounting.api_key import ApiKey
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.routing.fairness import check_weight
from llmgw.store.base import KEY_LIMITS
from llmgw.store.db import Store
from llmgw.store.gpu_time import HOUR, idle_rows, per_gpu
from llmgw.store.usage import UsageWriter
from llmgw.tier.watch import Watch

_MAX_LIMIT = 2**53

USAGE_FLUSH_WAIT = 0.5
"""
Seconds C{GET /api/v1/usage} waits for buffered records to be written
before it answers from what the store holds (the rest counted in
C{pending}); the read itself is bounded by the store's read busy timeout.
"""
_ISO = re.compile(r"^\d{4}-\d\d-\d\d")


def _order_fields(body: dict[str, Any]) -> dict[str, Any]:
    """
    @return: the C{priority} (a name or an integer's digits) and C{weight}
        of a key's request body, those it has.
    @raise AdminError: 400 for a priority or weight that is not one.
    """
    order: dict[str, Any] = {}
    if "priority" in body:
        value = body["priority"]
        if value is None:
            raise AdminError(
                400, "priority: null: expected a name or an integer", "bad_request"
            )
        priority_number(value)
        order["priority"] = str(value).strip()
    if "weight" in body:
        try:
            order["weight"] = check_weight(body["weight"])
        except ValueError as e:
            raise AdminError(400, str(e)[:300], "bad_request") from None
    return order


def _optional_cost(body: dict[str, Any]) -> float | None:
    """
    @return: the body's C{budget_cost}: a number of 0 or more, or L{None}.
    @raise AdminError: 400 another value, named.
    """
    value = body.get("budget_cost")
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value < float("inf")
    ):
        raise AdminError(
            400,
            f"budget_cost: expected a number of 0 or more, got {value!r}"[:300],
            "bad_request",
        )
    return float(value)


def _optional_count(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= _MAX_LIMIT
    ):
        raise AdminError(
            400,
            f"{name}: expected an integer from 1 to {_MAX_LIMIT}, got {value!r}"[:300],
            "bad_request",
        )
    return value


def parse_expires(value: object, now: float) -> float | None:
    """
    @param value: POSIX seconds, a duration ahead of now (C{"30d"},
        C{"12h"}), an ISO 8601 time (UTC unless it says), or L{None} for
        never.
    @param now: POSIX seconds.
    @return: POSIX seconds, or L{None}.
    @raise AdminError: none of those, or a time not after now (revoke a
        key to stop it now).
    """
    if value is None:
        return None
    when: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        when = float(value) if math.isfinite(value) else None
    elif isinstance(value, str):
        try:
            when = now + parse_duration("expires", value)
        except ConfigError:
            when = _iso(value)
    if when is None:
        raise AdminError(
            400,
            f"expires: bad time {value!r}: use a duration from now (30d, 12h),"
            " an ISO 8601 time, POSIX seconds or null for never"[:300],
            "bad_request",
        )
    if when <= now:
        raise AdminError(
            400,
            f"expires: {value!r} is not in the future (revoke the key to stop it now)"[
                :300
            ],
            "bad_request",
        )
    return when


def _iso(value: str) -> float | None:
    if not _ISO.match(value):
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()


def _models_field(body: dict[str, Any]) -> list[str] | None:
    models = body.get("models")
    if models is not None and (
        not isinstance(models, list)
        or not models
        or not all(isinstance(m, str) and m for m in models)
    ):
        raise AdminError(
            400,
            f"models: expected a list of names, got {models!r}"[:300],
            "bad_request",
        )
    return models


def parse_since(value: str, now: float) -> float:
    """
    @param value: a duration back from now (C{"24h"}, C{"30m"}), an ISO
        8601 time, or POSIX seconds.
    @param now: POSIX seconds.
    @return: POSIX seconds.
    @raise AdminError: none of those.
    """
    try:
        return now - parse_duration("since", value)
    except ConfigError:
        pass
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds):
            return seconds
    parsed = _iso(value)
    if parsed is not None:
        return parsed
    raise AdminError(
        400,
        f"bad time {value!r}: use a duration back from now (24h, 30m),"
        " an ISO 8601 time or POSIX seconds",
        "bad_request",
    )


class KeyRoutes:
    """
    Keys and usage.

    @param keys: the API keys, when there is a store.
    @param store: the database.
    @param usage: the usage writer, flushed before usage is read.
    @param catalog: the control plane's catalog, when there is one: a
        key's models must be among its names.
    @param wall_clock: POSIX seconds now.
    @param watch: what a router tier follows, told of each key's change,
        when there is a control plane.
    """

    app = error_answers(Klein())

    def __init__(
        self,
        keys: KeyRing | None,
        store: Store | None,
        usage: UsageWriter | None,
        catalog: ModelCatalog | None,
        *,
        wall_clock: Callable[[], float],
        watch: Watch | None,
    ) -> None:
        self._key_ring = keys
        self._store = store
        self._usage = usage
        self._catalog = catalog
        self._wall_clock = wall_clock
        self._watch = watch

    def _keys(self) -> KeyRing:
        if self._key_ring is None or self._store is None:
            raise AdminError(404, "no store in this server", "not_found")
        return self._key_ring

    def _check_models(self, models: list[str] | None) -> None:
        """
        @raise AdminError: 400 naming the names no catalog model, alias
            or static endpoint serves (a key for them could never be used).
        """
        catalog = self._catalog
        if models is None or catalog is None:
            return
        known = set(catalog.names())
        for endpoint in catalog.static_endpoints():
            known.update(endpoint.models)
        unknown = [m for m in models if m not in known]
        if unknown:
            raise AdminError(
                400,
                f"models: no model named {', '.join(map(repr, unknown))}"[:250]
                + f" (models: {', '.join(sorted(known)) or 'none'})"[:250],
                "unknown_model",
            )

    def _keys_changed(self) -> None:
        if self._watch is not None:
            self._watch.keys_changed()

    @app.route("/api/v1/keys", methods=["GET"])
    def list_keys(self, request: IRequest) -> bytes:
        """
        C{{"keys": [...]}}: name, prefix, limits, created, last used,
        tokens used, revoked; never the key.
        """
        keys = [k.to_json() for k in self._keys().keys()]
        return json_answer(request, {"keys": keys})

    @app.route("/api/v1/keys", methods=["POST"])
    async def create_key(self, request: IRequest) -> bytes:
        """
        Make a key: C{{"name", "models"?, "rpm"?, "tpm"?,
        "budget_tokens"?, "budget_cost"?, "admin"?, "expires"?, "priority"?,
        "weight"?}}
        (C{expires} as L{parse_expires} reads it; C{priority} a name of
        L{llmgw.router.routing.fairness.PRIORITIES} or an integer, C{weight} a
        number above 0).  201 with the key under C{"key"}: the
        only time it is shown; C{"was_open"} true when the client API took
        requests without a key until this one (the first key, without
        C{[auth] require_api_key}): from now on each needs one.  400
        C{unknown_model} naming the models no catalog model or endpoint
        serves.
        """
        keys = self._keys()
        body = read_body(request)
        name = body.get("name")
        if not isinstance(name, str):
            raise AdminError(400, "name: expected a string", "bad_request")
        models = _models_field(body)
        self._check_models(models)
        expires = parse_expires(body.get("expires"), self._wall_clock())
        admin = body.get("admin", False)
        if not isinstance(admin, bool):
            raise AdminError(400, "admin: expected true or false", "bad_request")
        order = _order_fields(body)
        integrity_errors = self._store.integrity_errors if self._store else ()
        was_open = not keys.required
        try:
            key, secret = await keys.create(
                name,
                models=models,
                rpm=_optional_count(body, "rpm"),
                tpm=_optional_count(body, "tpm"),
                budget_tokens=_optional_count(body, "budget_tokens"),
                budget_cost=_optional_cost(body),
                admin=admin,
                expires=expires,
                **order,
            )
        except ValueError as e:
            raise AdminError(
                409 if "exists" in str(e) else 400, str(e), "bad_key"
            ) from None
        except integrity_errors:
            raise AdminError(409, f"a key named {name!r} exists", "conflict") from None
        self._keys_changed()
        return json_answer(
            request, {**key.to_json(), "key": secret, "was_open": was_open}, 201
        )

    @app.route("/api/v1/keys/<name>", methods=["PATCH"])
    async def update_key(self, request: IRequest, name: str) -> bytes:
        """
        Change a key, by name or prefix: any of C{{"models", "rpm", "tpm",
        "budget_tokens", "budget_cost", "expires", "priority", "weight"}};
        C{null} removes
        a limit (C{models}: all models; C{expires}: never), a field left out stays.  Its
        counters (tokens used, the minute's requests) are kept.  The key
        itself, its name and C{admin} do not change.  200 with the key;
        400 for a bad field or an unknown model (C{unknown_model}); 404 no
        such key; 409 a revoked key.
        """
        keys = self._keys()
        key = keys.find(name)
        if key is None:
            raise not_found(f"key {name[:200]!r}")
        body = read_body(request)
        allowed = KEY_LIMITS
        unknown = sorted(set(body) - set(allowed))
        if unknown or not body:
            raise AdminError(
                400,
                f"expected some of {', '.join(allowed)}; got"
                f" {', '.join(unknown) or 'none'}"[:300],
                "bad_request",
            )
        if key.revoked is not None:
            raise AdminError(409, f"key {key.name!r} is revoked", "revoked")
        changes: dict[str, Any] = {}
        if "models" in body:
            changes["models"] = _models_field(body)
            self._check_models(changes["models"])
        for field in ("rpm", "tpm", "budget_tokens"):
            if field in body:
                changes[field] = _optional_count(body, field)
        if "budget_cost" in body:
            changes["budget_cost"] = _optional_cost(body)
        if "expires" in body:
            changes["expires"] = parse_expires(body["expires"], self._wall_clock())
        changes.update(_order_fields(body))
        await keys.update(key, changes)
        self._keys_changed()
        return json_answer(request, key.to_json())

    @app.route("/api/v1/keys/<name>", methods=["DELETE"])
    @app.route("/api/v1/keys/<name>/revoke", methods=["POST"])
    async def revoke_key(self, request: IRequest, name: str) -> bytes:
        """
        Revoke a key, by name or prefix: it stops working at once.
        """
        try:
            key = await self.revoke(name)
        except KeyError:
            raise not_found(f"key {name[:200]!r}") from None
        return json_answer(request, key.to_json())

    async def revoke(self, name: str) -> ApiKey:
        """
        Revoke a key by name or prefix (the dashboard's revoke action
        calls this too); revoking a revoked key changes nothing.

        @raise KeyError: no such key.
        """
        keys = self._keys()
        key = keys.find(name)
        if key is None:
            raise KeyError(name)
        if key.revoked is None:
            await keys.revoke(key)
            self._keys_changed()
        return key

    @app.route("/api/v1/usage", methods=["GET"])
    async def get_usage(self, request: IRequest) -> bytes:
        """
        Usage grouped by C{by} (C{key}, C{model} or C{day}, default key)
        from C{since} (default 24h) to C{until} (default now): requests,
        errors, prompt and completion tokens, mean latency and time to
        first token, GPU-seconds and cost, per group; C{idle}: the GPU
        time no request was given and its cost (one row, or one per day
        by day), and C{gpus}: each GPU's seconds by state, the requests'
        and the idle (docs/cost.md), over the hours that start in the
        range (from the hour of C{since}); C{pending}: records not yet
        written to the store (another process holding its lock), not
        counted.
        Answers within about 2 s: 503 C{store_busy} when the store cannot be
        read then.
        """
        args = request.args or {}

        def arg(name: bytes, default: str) -> str:
            values = args.get(name)
            return values[0].decode("utf-8", "replace") if values else default

        by = arg(b"by", "key")
        if by not in ("key", "model", "day"):
            raise AdminError(
                400, f"by: expected key, model or day, got {by!r}", "bad_request"
            )
        now = self._wall_clock()
        since = parse_since(arg(b"since", "24h"), now)
        until_text = arg(b"until", "")
        until = parse_since(until_text, now) if until_text else None
        if until is not None and until <= since:
            raise AdminError(400, "until: must be after since", "bad_request")
        return json_answer(request, await self.usage(by, since, until))

    async def usage(self, by: str, since: float, until: float | None) -> dict[str, Any]:
        """
        The usage report (L{get_usage}'s answer), for the admin API and the
        dashboard alike.

        @param by: C{"key"}, C{"model"} or C{"day"}.
        @param since: POSIX seconds.
        @param until: POSIX seconds, or L{None} for now.
        @raise AdminError: 404 no store; 503 the store cannot be read now.
        """
        store = self._store
        if store is None:
            raise AdminError(404, "no store in this server", "not_found")
        now = self._wall_clock()
        pending = 0
        # Records still buffered count too, once written; a write waiting
        # for the lock is not waited for past USAGE_FLUSH_WAIT.
        usage = self._usage
        if usage is not None and not await usage.flush_within(USAGE_FLUSH_WAIT):
            pending = usage.pending
        # Without an end: up to now, and the records of this second (a
        # record's time is when its request finished).
        end = until if until is not None else now + 1
        try:
            groups = await store.usage(by, since, end)
            gpu_time = await store.gpu_time((since // HOUR) * HOUR, end)
        except store.database_errors as e:
            raise AdminError(
                503, f"the store cannot be read now ({e}); try again", "store_busy"
            ) from None
        return {
            "by": by,
            "since": since,
            "until": until if until is not None else now,
            "usage": groups,
            "idle": idle_rows(by, gpu_time),
            "gpus": per_gpu(gpu_time),
            "pending": pending,
        }
