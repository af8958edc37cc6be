"""
Each replica's speed, learnt from the answers it gave: a multiplier of its
configured weight, so that a replica three times slower than its peers
gets about a third of their share (in the balancer's score, in the
bounded-load capacity and in the rendezvous weights) with no operator
setting.

The measure is the decode rate of finished streamed answers: completion
tokens after the first over the time from the first byte to the last
(L{llmgw.router.interfaces.RequestRecord}'s C{latency} less its
C{time_to_first_token}).  It leaves out the queueing and the prefill,
which depend on the load and on prefix cache hits, not on the replica's
speed.  A non-streamed answer's body comes in one piece at the end, so its
first byte says nothing of the decode; those records are not used.  The
engines' own counters (C{vllm:generation_tokens_total} over running
requests) would serve too, but only for engines that export them, a poll
interval late, and with the batch's size folded in; the router sees every
answer it relays whatever the engine.

Per model and replica the router keeps decayed sums of tokens, seconds and
samples (half-life L{HALF_LIFE}): the rate is tokens over seconds, recent
answers counting most, and a replica that stops answering loses its
samples and counts as average again, so a slow replica that recovered is
tried and seen.  A replica's factor is its rate over the mean rate of the
model's replicas with at least L{MIN_SAMPLES} (decayed) samples, bounded
to [L{LOWEST}, L{HIGHEST}]; replicas with fewer count as the mean (1).
Factors move in steps of a fourth of an octave (2 ** (1/4), 19%) with
hysteresis (a step is taken when the rate is L{HYSTERESIS} steps from the
factor held): equal replicas keep equal factors, so that the balancer's
ties still rotate between them instead of going to whichever measured a
percent faster.
Factors are computed when an answer is recorded, not when a replica is
picked: a pick reads one dictionary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import log2

from twisted.internet.interfaces import IReactorTime

HALF_LIFE = 30.0
"""
Seconds after which an answer counts half as much in its replica's rate.
"""
MIN_SAMPLES = 4.0
"""
Decayed samples a replica needs before its rate counts.
"""
LOWEST = 0.25
"""
The smallest factor: a replica is never all but dropped on its rate alone.
"""
HIGHEST = 4.0
"""
The largest factor.
"""
STEPS = 4
"""
Factor steps per doubling.
"""
HYSTERESIS = 0.75
"""
Steps (fractional) the measured ratio must move from the held factor
before the factor moves to the nearest step.
"""
MIN_DECODE = 0.005
"""
Seconds: a shorter first-to-last-byte gap (one chunk) measures no decode.
"""


@dataclass
class _Rate:
    """
    Decayed sums for one model on one replica, as of C{at}.
    """

    at: float
    tokens: float = 0.0
    seconds: float = 0.0
    samples: float = 0.0

    def decay(self, now: float, half_life: float) -> None:
        if now > self.at:
            keep = 0.5 ** ((now - self.at) / half_life)
            self.tokens *= keep
            self.seconds *= keep
            self.samples *= keep
            self.at = now


class Speeds:
    """
    Replica speed factors per model.

    @param clock: the reactor's clock, seconds.
    """

    def __init__(
        self,
        clock: IReactorTime,
        half_life: float = HALF_LIFE,
        min_samples: float = MIN_SAMPLES,
    ) -> None:
        self._clock = clock
        self._half_life = half_life
        self._min_samples = min_samples
        self._rates: dict[tuple[str, str], _Rate] = {}
        self._factors: dict[str, dict[str, float]] = {}
        self._refreshed: dict[str, float] = {}
        self._levels: dict[tuple[str, str], int] = {}

    def observe(
        self,
        model: str,
        replica_id: str,
        peers: Sequence[str],
        tokens: float,
        seconds: float,
    ) -> None:
        """
        Record an answer and recompute the model's factors (O(peers)).

        @param peers: the ids of every replica serving C{model}, this one
            among them.
        @param tokens: tokens decoded after the first.
        @param seconds: the time they took (first byte to last).
        """
        now = self._clock.seconds()
        rate = self._rates.get((model, replica_id))
        if rate is None:
            rate = self._rates[(model, replica_id)] = _Rate(now)
        rate.decay(now, self._half_life)
        rate.tokens += tokens
        rate.seconds += seconds
        rate.samples += 1
        self._refresh(model, peers, now)

    def _refresh(self, model: str, peers: Sequence[str], now: float) -> None:
        rates: dict[str, float] = {}
        for replica_id in peers:
            rate = self._rates.get((model, replica_id))
            if rate is None:
                continue
            rate.decay(now, self._half_life)
            if rate.samples >= self._min_samples and rate.seconds > 0:
                rates[replica_id] = rate.tokens / rate.seconds
        self._refreshed[model] = now
        if len(rates) < 2:
            self._factors.pop(model, None)
            for replica_id in peers:
                self._levels.pop((model, replica_id), None)
            return
        mean = sum(rates.values()) / len(rates)
        lowest, highest = round(log2(LOWEST) * STEPS), round(log2(HIGHEST) * STEPS)
        levels = self._levels
        factors: dict[str, float] = {}
        for replica_id, r in rates.items():
            held = levels.get((model, replica_id), 0)
            measured = log2(r / mean) * STEPS
            if abs(measured - held) > HYSTERESIS:
                held = min(max(round(measured), lowest), highest)
                levels[(model, replica_id)] = held
            factors[replica_id] = 2.0 ** (held / STEPS)
        for replica_id in peers:
            if replica_id not in rates:
                levels.pop((model, replica_id), None)
        self._factors[model] = factors

    def factors(self, model: str) -> Mapping[str, float] | None:
        """
        @return: replica id to factor for C{model} (a replica not in it
            counts 1), or L{None} when all count 1.  Factors older than a
            half-life are recomputed first, so a model that stopped
            answering returns to equal factors.
        """
        factors = self._factors.get(model)
        if factors is None:
            return None
        now = self._clock.seconds()
        if now - self._refreshed[model] > self._half_life:
            peers = [rid for (m, rid) in self._rates if m == model]
            self._refresh(model, peers, now)
            return self._factors.get(model)
        return factors

    def forget(self, keep: set[str]) -> None:
        """
        Drop the rates of replicas no longer configured.

        @param keep: the ids still configured.
        """
        for model, replica_id in list(self._rates):
            if replica_id not in keep:
                del self._rates[(model, replica_id)]
                self._levels.pop((model, replica_id), None)
                factors = self._factors.get(model)
                if factors is not None:
                    factors.pop(replica_id, None)
