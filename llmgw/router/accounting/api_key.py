"""
An API key as the router checks it (docs/keys.md): what it may use, its
limits and budgets, and what it used so far; the record the key ring
(L{llmgw.router.accounting.auth.KeyRing}) holds and changes.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmgw.router.routing.fairness import Tenant, priority_rank


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
    @ivar budget_cost: what its requests may cost in all (C{[cost]}'s
        unit, docs/cost.md), or L{None}.
    @ivar cost_used: what they cost so far (stored, plus this router's
        since); C{cost_at_start} the stored part at start.
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
    budget_cost: float | None = None
    cost_used: float = 0.0
    cost_at_start: float = 0.0

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

    def over_cost(self, share: int) -> bool:
        """
        @param share: routers sharing the keys' limits: this one may spend
            its equal part of what was left at start (cost is not counted
            in Redis).
        @return: whether its cost budget is spent, as this router counts.
        """
        if self.budget_cost is None:
            return False
        left = max(0.0, self.budget_cost - self.cost_at_start)
        return self.cost_used - self.cost_at_start >= left / max(1, share)

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
            "budget_cost": self.budget_cost,
            "cost_used": self.cost_used,
        }
