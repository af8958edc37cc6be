"""
API keys and their admission policy (docs/keys.md): C{Authorization:
Bearer sk-...}, stored as SHA-256 hashes with a visible prefix, each with
allowed models, requests and tokens per minute and a token budget.  All keys
are held in memory, so checking one costs no database round trip; changes are
written through to a L{KeyStore} (L{llmgw.store.db.Store}).
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from llmgw.router.accounting.limits import (
    OVER_BUDGET,
    OVER_RPM,
    OVER_TPM,
    RedisLimits,
    over_budget,
    rate_limited,
)
from llmgw.router.errors import APIError
from llmgw.router.interfaces import Key
from llmgw.router.routing.fairness import Tenant, priority_rank

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,99}$")
WINDOW = 60.0
"""
Seconds over which requests and tokens per minute are counted.
"""


class KeyStore(Protocol):
    """
    Where keys are kept (L{llmgw.store.db.Store}).
    """

    def add_key(self, row: dict[str, Any]) -> Awaitable[int]:
        """
        Keep a new key: C{row} has C{name}, C{prefix}, C{hash}, C{models}
        (a list or L{None}), C{rpm}, C{tpm}, C{budget_tokens}, C{admin}
        and C{created} (seconds since the epoch).

        @return: fires with the key's id.
        """

    def revoke_key(self, key_id: int, when: float) -> Awaitable[None]:
        """
        Mark a key revoked at C{when}, seconds since the epoch.
        """

    def update_key(self, key_id: int, changes: dict[str, Any]) -> Awaitable[None]:
        """
        Change some of a key's C{models}, C{rpm}, C{tpm}, C{budget_tokens}
        and C{expires} (L{llmgw.store.base.Store.update_key}).
        """


def hash_key(secret: str) -> str:
    """
    @return: the SHA-256 of C{secret}, hex: what the store keeps.
    """
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


@dataclass
class ApiKey:
    """
    A key as the router checks it.

    @ivar models: the model names it may use; L{None} for all.
    @ivar rpm: requests per minute, or L{None} for no limit.
    @ivar tpm: tokens (prompt and completion) per minute, or L{None}.
    @ivar budget_tokens: tokens in all, or L{None}.
    @ivar tokens_used: tokens counted so far (stored, plus those not yet
        flushed).
    @ivar expires: POSIX seconds from which it is refused, or L{None}.
    @ivar priority: where its requests wait, who goes first: a name of
        L{llmgw.router.routing.fairness.PRIORITIES} or an integer's digits.
    @ivar weight: its share within its priority, above 0.
    """

    id: int
    name: str
    prefix: str
    hash: str
    models: tuple[str, ...] | None
    rpm: int | None
    tpm: int | None
    budget_tokens: int | None
    admin: bool
    created: float
    last_used: float | None = None
    tokens_used: int = 0
    revoked: float | None = None
    expires: float | None = None
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    tokens_in_window: int = 0
    reserved: int = 0
    used_at_start: int = 0
    priority: str = "standard"
    weight: float = 1.0

    @property
    def tenant(self) -> Tenant:
        """
        Who its requests are for where they wait (L{llmgw.router.routing.fairness}).
        """
        return Tenant(self.name, priority_rank(self.priority), self.weight)

    @property
    def limited(self) -> bool:
        """
        Whether any of rpm, tpm and the budget is set (else there is
        nothing to count with other routers).
        """
        return (
            self.rpm is not None
            or self.tpm is not None
            or self.budget_tokens is not None
        )

    def allows(
        self, model: str, resolve: Callable[[str], str | None] = lambda m: None
    ) -> bool:
        """
        @param resolve: a name's catalog model (aliases count as the
            model they name), or L{None}.
        """
        if self.models is None or model in self.models:
            return True
        wanted = resolve(model)
        return wanted is not None and any(resolve(m) == wanted for m in self.models)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "prefix": self.prefix,
            "models": list(self.models) if self.models is not None else None,
            "rpm": self.rpm,
            "tpm": self.tpm,
            "budget_tokens": self.budget_tokens,
            "admin": self.admin,
            "created": self.created,
            "last_used": self.last_used,
            "tokens_used": self.tokens_used,
            "revoked": self.revoked,
            "expires": self.expires,
            "priority": self.priority,
            "weight": self.weight,
        }


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_request_error", "invalid_api_key")


class KeyRing:
    """
    The keys, loaded from the store at start, and the checks of each
    request against them (an L{llmgw.router.interfaces.Auth}).

    @param store: where keys are kept.
    @param clock: seconds (monotonic) for the per-minute windows.
    @param wall_clock: seconds since the epoch, for the times kept with a
        key (made, last used, revoked).
    @param required: C{[auth] require_api_key}: a key is needed even
        while none exists.
    @param limits: requests and tokens per minute and budgets counted
        with every other router, in Redis; L{None} to count here.
    @param share: routers sharing the keys' limits without Redis (or
        while it cannot be reached): this one admits its equal share,
        C{ceil(limit / share)} per window, and of each budget what was
        left at start divided likewise.
    @param resolve: the catalog's model for a name or alias, or L{None}
        (the server's catalog, or a router's copy of it): a key allowed a
        model is allowed its aliases.
    """

    log = Logger()

    def __init__(
        self,
        store: KeyStore,
        *,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        required: bool = False,
        limits: RedisLimits | None = None,
        share: int = 1,
        resolve: Callable[[str], str | None] = lambda name: None,
    ) -> None:
        self.store = store
        self.limits = limits
        self._share = max(1, share)
        # Per key id, the Redis members of its requests in flight and the
        # tokens each holds.
        self._members: dict[int, list[tuple[str, int]]] = {}
        self._required = required
        self._clock = clock
        self._wall_clock = wall_clock
        self._by_hash: dict[str, ApiKey] = {}
        self._by_id: dict[int, ApiKey] = {}
        self.resolve = resolve

    def load(self, rows: Sequence[dict[str, Any]]) -> None:
        """
        Take the keys read from the store at start.
        """
        for row in rows:
            self._add(row)

    def learn(self, row: dict[str, Any]) -> None:
        """
        A key as the shared store has it now (made or revoked by another
        process on the same database): a new one is added, a known one
        takes the revocation if it has one.

        @param row: as L{load} takes them.
        """
        key = self._by_id.get(row["id"])
        if key is None:
            self._add(row)
            return
        self.take_limits(key, row)
        if row.get("revoked") is not None:
            self.revoked_elsewhere(key.id, row["revoked"])

    @staticmethod
    def take_limits(key: ApiKey, row: dict[str, Any]) -> bool:
        """
        Give C{key} the models, limits and expiry of C{row} (as the store
        has them now), keeping its counters (rate windows, tokens).

        @return: whether any of them changed.
        """
        models = tuple(row["models"]) if row["models"] is not None else None
        now = (models, row["rpm"], row["tpm"], row["budget_tokens"], row.get("expires"))
        order = (str(row.get("priority") or "standard"), float(row.get("weight") or 1))
        if now == (key.models, key.rpm, key.tpm, key.budget_tokens, key.expires) and (
            order == (key.priority, key.weight)
        ):
            return False
        key.models, key.rpm, key.tpm, key.budget_tokens, key.expires = now
        key.priority, key.weight = order
        return True

    def revoked_elsewhere(self, key_id: int, when: float) -> bool:
        """
        Another process revoked a key: refuse it from now on.

        @param when: POSIX seconds, as that process stored it.
        @return: whether this changed anything (the key was known here
            and not yet revoked).
        """
        key = self._by_id.get(key_id)
        if key is None or key.revoked is not None:
            return False
        key.revoked = when
        return True

    def _add(self, row: dict[str, Any]) -> ApiKey:
        key = ApiKey(
            id=row["id"],
            name=row["name"],
            prefix=row["prefix"],
            hash=row["hash"],
            models=tuple(row["models"]) if row["models"] is not None else None,
            rpm=row["rpm"],
            tpm=row["tpm"],
            budget_tokens=row["budget_tokens"],
            admin=bool(row["admin"]),
            created=row["created"],
            last_used=row.get("last_used"),
            tokens_used=row.get("tokens_used") or 0,
            revoked=row.get("revoked"),
            expires=row.get("expires"),
            priority=str(row.get("priority") or "standard"),
            weight=float(row.get("weight") or 1),
        )
        key.used_at_start = key.tokens_used
        self._by_hash[key.hash] = key
        self._by_id[key.id] = key
        return key

    @property
    def required(self) -> bool:
        """
        Whether requests need a key: C{require_api_key}, or any key was
        ever made (revoking the last one does not open the gateway).
        """
        return self._required or bool(self._by_id)

    def keys(self) -> list[ApiKey]:
        return sorted(self._by_id.values(), key=lambda k: k.id)

    def find(self, name_or_prefix: str) -> ApiKey | None:
        """
        @return: the key of that name or prefix (revoked ones too).
        """
        for key in self._by_id.values():
            if key.name == name_or_prefix:
                return key
        for key in self._by_id.values():
            if key.prefix == name_or_prefix:
                return key
        return None

    async def create(
        self,
        name: str,
        models: Sequence[str] | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        budget_tokens: int | None = None,
        admin: bool = False,
        expires: float | None = None,
        priority: str = "standard",
        weight: float = 1.0,
    ) -> tuple[ApiKey, str]:
        """
        Make a key.

        @param expires: POSIX seconds from which it is refused, or L{None}.
        @param priority: a name of L{llmgw.router.routing.fairness.PRIORITIES} or
            an integer's digits (checked by the caller).
        @param weight: its share within its priority, above 0.

        @return: the key and its secret, C{sk-...}: the only time it is
            shown.
        @raise ValueError: the name is taken or empty.
        """
        if not _NAME.match(name) or name.startswith("sk-"):
            raise ValueError(
                f"name: {name[:120]!r}: expected 1 to 100 letters, digits, '.',"
                " '_', '-' or '@', not starting with sk-"
            )
        if any(k.name == name for k in self._by_id.values()):
            raise ValueError(f"name: a key named {name!r} exists")
        secret = "sk-" + secrets.token_urlsafe(32)
        row = {
            "name": name,
            "prefix": secret[:11],
            "hash": hash_key(secret),
            "models": list(models) if models is not None else None,
            "rpm": rpm,
            "tpm": tpm,
            "budget_tokens": budget_tokens,
            "admin": admin,
            "created": self._wall_clock(),
            "expires": expires,
            "priority": priority,
            "weight": weight,
        }
        row["id"] = await self.store.add_key(row)
        return self._add(row), secret

    async def revoke(self, key: ApiKey) -> None:
        key.revoked = self._wall_clock()
        await self.store.revoke_key(key.id, key.revoked)

    def expired(self, key: ApiKey) -> bool:
        """
        @return: whether C{key}'s expiry has passed, by this ring's wall
            clock (a dashboard session it opened ends then too).
        """
        return key.expires is not None and self._wall_clock() >= key.expires

    async def update(self, key: ApiKey, changes: dict[str, Any]) -> None:
        """
        Change a key's models, limits or expiry: written to the store,
        then taken here (the next request is checked against them; its
        counters are kept).

        @param changes: as L{KeyStore.update_key} takes them.
        """
        await self.store.update_key(key.id, changes)
        row = {**key.to_json(), **changes}
        self.take_limits(key, row)

    def authenticate(self, header: bytes | None) -> ApiKey | None:
        """
        @param header: the request's C{Authorization} value.
        @return: the key, or L{None} when keys are not required (whatever
            was sent).
        @raise APIError: 401, no key or an unknown or revoked one.
        """
        if not self.required:
            # Open (no key made, none required): clients such as the openai
            # library always send something; it is not checked.
            return None
        if header is None:
            raise _unauthorized(
                "You didn't provide an API key. Send it as"
                " 'Authorization: Bearer sk-...' (or 'api-key: sk-...',"
                " 'x-api-key: sk-...')."
            )
        scheme, _, secret = header.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not secret.strip():
            raise _unauthorized(
                "The Authorization header must be 'Bearer' followed by an API key."
            )
        try:
            text = secret.strip().decode("ascii")
        except UnicodeDecodeError:
            raise _unauthorized("Incorrect API key provided.") from None
        return self._live(self._by_hash.get(hash_key(text)))

    def vouched(self, key_id: int | None) -> ApiKey | None:
        """
        The key a batch line runs as (L{llmgw.router.interfaces.Auth.vouched}).

        @raise APIError: 401, as L{authenticate} for an unknown, revoked or
            expired key (none named is unknown).
        """
        if not self.required:
            return None
        return self._live(self._by_id.get(key_id) if key_id is not None else None)

    def _live(self, key: ApiKey | None) -> ApiKey:
        if key is None or key.revoked is not None:
            raise _unauthorized("Incorrect API key provided.")
        if self.expired(key):
            raise _unauthorized("This API key has expired.")
        return key

    def admit(
        self, key: Key, names: Sequence[str], reserve: int = 0
    ) -> Deferred[None] | None:
        """
        Count a request of C{key} for a model known by C{names} (as sent,
        and its catalog name), and hold C{reserve} tokens for it until
        L{used}: requests in flight count against the budget and the
        tokens per minute, so concurrent ones cannot overshoot them by
        more than one request's own use.

        With L{limits}, the windows and the budget are Redis's, counted
        with every other router's requests; while Redis cannot be reached,
        this router's share (see C{share}) is counted here.

        @return: L{None} when decided here, or (with L{limits}) a
            Deferred that fires once admitted or fails with the same
            errors.
        @raise APIError: 403 the key may not use the model; 429 over its
            budget (C{insufficient_quota}) or its requests or tokens per
            minute (with C{Retry-After}).
        """
        api_key = self._by_id[key.id]
        self._check_models(api_key, names)
        if self.limits is None or not api_key.limited:
            self._admit(api_key, reserve)
            return None
        return Deferred.fromCoroutine(self._admit_shared(api_key, reserve))

    async def _admit_shared(self, key: ApiKey, reserve: int) -> None:
        assert self.limits is not None
        member = self.limits.member()
        try:
            verdict, wait = await self.limits.admit(
                key.id,
                key.rpm,
                key.tpm,
                key.budget_tokens,
                key.tokens_used,
                reserve,
                member,
            )
        except self.limits.errors:
            # Logged once per outage by the limits themselves.
            self._admit(key, reserve)
            return
        if verdict == OVER_BUDGET:
            raise over_budget()
        if verdict == OVER_RPM:
            raise rate_limited(f"{key.rpm} requests per minute", wait)
        if verdict == OVER_TPM:
            raise rate_limited(f"{key.tpm} tokens per minute", wait)
        key.last_used = self._wall_clock()
        self._members.setdefault(key.id, []).append((member, reserve))

    @property
    def _redis_failing(self) -> bool:
        """
        Whether the shared limits' Redis is away now (L{RedisLimits.failing}).
        """
        return self.limits is not None and self.limits.failing

    def _check_models(self, key: ApiKey, names: Sequence[str]) -> None:
        if not any(key.allows(n, self.resolve) for n in names):
            raise APIError(
                403,
                f"This API key may not use model {names[0]!r}.",
                "invalid_request_error",
                "model_not_allowed",
                "model",
            )

    def _admit(self, key: ApiKey, reserve: int) -> None:
        share = self._share
        if key.budget_tokens is not None:
            # This router's part of what was left at start, and what it
            # spent since.
            left = max(0, key.budget_tokens - key.used_at_start)
            mine = key.tokens_used - key.used_at_start + key.reserved
            if mine >= math.ceil(left / share):
                raise over_budget()
        rpm = math.ceil(key.rpm / share) if key.rpm is not None else None
        tpm = math.ceil(key.tpm / share) if key.tpm is not None else None
        now = self._clock()
        self._expire(key, now)
        if rpm is not None and len(key.requests) >= rpm:
            wait = key.requests[0] + WINDOW - now
            raise rate_limited(f"{key.rpm} requests per minute", wait)
        if tpm is not None and key.tokens_in_window + key.reserved >= tpm:
            over = key.tokens_in_window + key.reserved - tpm
            wait = WINDOW
            for when, count in key.tokens:
                over -= count
                if over < 0:
                    wait = when + WINDOW - now
                    break
            raise rate_limited(f"{key.tpm} tokens per minute", wait)
        key.requests.append(now)
        key.last_used = self._wall_clock()
        key.reserved += reserve

    def used(self, key: Key, tokens: int, reserved: int = 0) -> None:
        """
        Count the tokens a request of C{key} used, once it is over, and
        release what L{admit} held for it.
        """
        api_key = self._by_id[key.id]
        if self.limits is not None and api_key.limited:
            self._used_shared(api_key, tokens, reserved)
        self._used(api_key, tokens, reserved)

    def _used_shared(self, key: ApiKey, tokens: int, reserved: int) -> None:
        assert self.limits is not None
        members = self._members.get(key.id, [])
        member = None
        for index, (name, held) in enumerate(members):
            if held == reserved:
                member = name
                del members[index]
                break
        if not members:
            self._members.pop(key.id, None)
        if member is None:
            if tokens <= 0:
                return
            # Admitted while Redis was away, or holding nothing: its
            # tokens count all the same.
            member, reserved = self.limits.member(), 0
        d = self.limits.used(key.id, member, reserved, tokens, key.tpm is not None)
        # A Redis outage is logged once by the limits (its uncounted
        # tokens summed when it ends), not once per finished request.
        errors = self.limits.errors
        d.addErrback(lambda f: f.trap(*errors) and None)
        d.addErrback(
            lambda f: self.log.failure(
                "limits: counting {tokens} tokens of key {key}",
                f,
                tokens=tokens,
                key=key.name,
            )
        )

    def _used(self, key: ApiKey, tokens: int, reserved: int) -> None:
        key.reserved = max(0, key.reserved - reserved)
        if tokens <= 0:
            return
        key.tokens_used += tokens
        if key.tpm is not None:
            key.tokens.append((self._clock(), tokens))
            key.tokens_in_window += tokens

    def _expire(self, key: ApiKey, now: float) -> None:
        start = now - WINDOW
        requests = key.requests
        while requests and requests[0] <= start:
            requests.popleft()
        tokens = key.tokens
        while tokens and tokens[0][0] <= start:
            key.tokens_in_window -= tokens.popleft()[1]
