"""
What the router knows of the LoRA adapters on its replicas that it did not
do itself: the adapters an engine lists as loaded, and the loads it
refused, each tried again only after a back-off
(L{llmgw.router.routing.adapters} uses both).

An engine's adapters are read from its C{GET /v1/models}: vLLM lists each
adapter loaded as a model card whose C{parent} is the base model's name
and whose C{root} is the adapter's path (vLLM 0.32's
C{vllm/entrypoints/openai/models/serving.py}, C{show_available_models});
the base model's own card has no C{parent}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from twisted.internet.interfaces import IReactorTime

MODELS_PATH = b"/v1/models"

FIRST_BACKOFF = 1.0
"""
Seconds before a refused load is tried again, the first time.
"""

MAX_BACKOFF = 60.0
"""
The longest wait between two tries of a refused load, seconds: each
refusal doubles the wait up to it.
"""


def backoff_seconds(failures: int) -> float:
    """
    @param failures: refusals in a row, at least 1.
    @return: seconds before the next try: L{FIRST_BACKOFF} doubled for each
        refusal after the first, at most L{MAX_BACKOFF}.
    """
    return float(min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (failures - 1)))


def listed_adapters(body: bytes) -> dict[str, str]:
    """
    @param body: an engine's C{GET /v1/models} answer (OpenAI's list).
    @return: the adapters it lists as loaded, each name with its path
        (C{root}; C{""} when not given).
    @raise ValueError: not a JSON object with a C{data} list.
    """
    answer = json.loads(body)
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError("not a model list")
    found: dict[str, str] = {}
    for card in data:
        if not isinstance(card, dict):
            continue
        name, parent = card.get("id"), card.get("parent")
        if isinstance(name, str) and isinstance(parent, str) and parent != name:
            root = card.get("root")
            found[name] = root if isinstance(root, str) else ""
    return found


@dataclass(frozen=True)
class Refusal:
    """
    An engine's refusal to load an adapter, kept until a try succeeds.

    @ivar replica: the replica's id.
    @ivar adapter: the adapter's name.
    @ivar failures: refusals in a row.
    @ivar status: the HTTP status of the last one.
    @ivar error: the engine's answer, at most 300 characters.
    @ivar since: clock seconds of the first refusal in a row.
    @ivar retry_at: clock seconds from which the load is tried again;
        before it, a request for the adapter there gets this refusal.
    @ivar answer: the engine's whole answer and headers, replayed to those
        requests (L{llmgw.router.routing.adapters}).
    """

    replica: str
    adapter: str
    failures: int
    status: int
    error: str
    since: float
    retry_at: float
    answer: Any

    def describe(self) -> dict[str, Any]:
        """
        @return: what the admin API shows: the replica, the adapter, the
            refusals in a row, the engine's status and error, and the
            clock seconds (POSIX in production) it began and when the load
            is tried again.
        """
        return {
            "replica": self.replica,
            "adapter": self.adapter,
            "failures": self.failures,
            "status": self.status,
            "error": self.error,
            "since": self.since,
            "retry_at": self.retry_at,
        }


class LoadBackoff:
    """
    Refused loads, per replica and adapter: each refusal doubles the wait
    before the next try (L{FIRST_BACKOFF} to L{MAX_BACKOFF}); a load that
    succeeds forgets them.

    @param clock: the reactor's clock.
    """

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._refused: dict[tuple[str, str], Refusal] = {}

    def refused(
        self, replica: str, adapter: str, status: int, error: str, answer: Any
    ) -> Refusal:
        """
        Note a refusal.

        @return: what is kept of it (its C{retry_at} set).
        """
        now = self._clock.seconds()
        before = self._refused.get((replica, adapter))
        failures = before.failures + 1 if before is not None else 1
        wait = backoff_seconds(failures)
        refusal = Refusal(
            replica,
            adapter,
            failures,
            status,
            error[:300],
            before.since if before is not None else now,
            now + wait,
            answer,
        )
        self._refused[(replica, adapter)] = refusal
        return refusal

    def loaded(self, replica: str, adapter: str) -> None:
        """
        A load went through: its refusals are forgotten.
        """
        self._refused.pop((replica, adapter), None)

    def waiting(self, replica: str, adapter: str) -> Refusal | None:
        """
        @return: the refusal a request for C{adapter} on C{replica} gets now
            (its back-off not over), or L{None}: the load may be tried.
        """
        refusal = self._refused.get((replica, adapter))
        if refusal is None or self._clock.seconds() >= refusal.retry_at:
            return None
        return refusal

    def forget(self, replicas: set[str], adapters: set[str]) -> None:
        """
        Keep only the refusals of these replicas and adapters (the others
        are gone).
        """
        for key in list(self._refused):
            if key[0] not in replicas or key[1] not in adapters:
                del self._refused[key]

    def of(self, adapter: str) -> list[Refusal]:
        """
        @return: the refusals kept for C{adapter}, by replica.
        """
        return sorted(
            (r for r in self._refused.values() if r.adapter == adapter),
            key=lambda r: r.replica,
        )

    def all(self) -> list[Refusal]:
        """
        @return: every refusal kept, by adapter and replica.
        """
        return sorted(self._refused.values(), key=lambda r: (r.adapter, r.replica))
