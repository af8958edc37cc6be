"""
The control plane's records of what it placed or adopted: replicas and
their shards, with their states.  Plain data; the reconciler
(L{llmgw.control.plane}) changes them, the views
(L{llmgw.control.views}) show them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from llmgw.wire.states import ShardState

if TYPE_CHECKING:
    from llmgw.control.placement import Profile


# Lines that name a cause rather than a consequence: Python's exception
# lines ("ValueError: ...", "torch.OutOfMemoryError: CUDA out of memory"),
# CUDA's and the C++ runtime's wording, and log levels.
_CAUSE = re.compile(
    r"error|exception|out of memory|fatal|killed|abort|cannot|can't|failed",
    re.IGNORECASE,
)


def output_summary(lines: Sequence[str], last: int = 3) -> str:
    """
    @param lines: an engine's last output lines.
    @return: C{"; last output: ..."} for an error message: the first line
        that names a cause (an error, an exception, out of memory), where
        it is not among the last C{last} lines, then those, joined by
        C{" | "}; C{""} for no lines.
    """
    if not lines:
        return ""
    shown = list(lines[-last:])
    cause = next((line for line in lines if _CAUSE.search(line)), None)
    if cause is not None and cause not in shown:
        shown = [cause, "...", *shown]
    return "; last output: " + " | ".join(shown)


class ReplicaState(StrEnum):
    """
    A replica's state, from its shards' and whether it drains.
    """

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    SLEEPING = "sleeping"
    WAKING = "waking"


@dataclass
class ShardRecord:
    """
    One engine process of a replica, on one node.

    @ivar state: C{pending} (command sent), C{starting}, C{ready},
        C{draining}, C{stopped}, C{failed}, or C{lost} (its node was lost).
    @ivar gpus: GPU indices on its node.
    @ivar pid: the engine's process id on its node, 0 while unknown.
    @ivar error: why it failed, or C{""}.
    @ivar output: the engine's last output lines (at most 50, as its agent
        sent them) when it failed or was stopped before it served.
    @ivar misplaced: it failed for where it was placed (its port or GPUs
        were not free), not for its model: replaced at once, no backoff.
    @ivar sleep_refused: its engine's answer when it refused sleep mode
        at start (its agent started it without), or C{""}.
    @ivar sent_at: reactor seconds when its start command went out, or 0.
    @ivar phases: its start's phases as its agent measured them, (name,
        seconds, detail), once ready (L{llmgw.control.phases}).
    @ivar share: the fraction of its GPU's memory its engine was given
        when its profile shares the GPU (L{llmgw.control.placement.shares});
        0 for whole GPUs, or not known (adopted).
    """

    id: str
    node: str
    gpus: tuple[int, ...]
    port: int
    rank: int
    state: ShardState = ShardState.PENDING
    pid: int = 0
    error: str = ""
    output: tuple[str, ...] = ()
    misplaced: bool = False
    sleep_refused: str = ""
    sent_at: float = 0.0
    phases: tuple[tuple[str, float, bool], ...] = ()
    share: float = 0.0


@dataclass
class ReplicaRecord:
    """
    One serving copy of a model: one shard per node of its profile.

    @ivar created: reactor seconds when placed (or adopted).
    @ivar draining_since: reactor seconds when draining began, or L{None}.
    @ivar stop_sent_at: reactor seconds when its shards were told to
        stop, or L{None}.
    @ivar drain_patience: seconds its requests in flight may take once it
        drains, when more than C{[control] drain_timeout}.
    @ivar error: why it failed, once it did (it is then kept for the
        admin API until its model has a ready replica again), or C{""}.
    @ivar rendezvous_port: for a gang, the port on rank 0's address where
        its ranks meet (C{StartShard.leader_address}); 0 otherwise.
    @ivar leaving_since: reactor seconds when a drain asked for it to go
        once a replacement is ready (L{llmgw.control.drains}), or L{None};
        it serves meanwhile.
    @ivar leaving_reason: why it leaves, for the admin API and its drain.
    @ivar leaving_hold: whether it is kept serving while its model has
        fewer ready replicas than C{min_replicas} and no room for a
        replacement (the drain that asked was checked for that; one kept
        across a restart was not).
    @ivar resident_since: reactor seconds when it was last started or
        woken (its model's C{min_resident} counts from then).
    @ivar ready_at: reactor seconds when it was first ready, or L{None}.
    @ivar sleep_at: reactor seconds when it was put to sleep (unpublished,
        its sleep sent once its last request ends), or L{None} (awake, or
        woken).
    @ivar sleep_sent_at: reactor seconds when its shards were told to
        sleep, or L{None}.
    @ivar sleep_reason: why it sleeps, for the admin API and the log.
    @ivar asleep_at: reactor seconds when its agents answered that it
        sleeps, or L{None}.
    @ivar wake_at: reactor seconds when it was told to wake, or L{None}
        (not waking).
    @ivar wake_refusals: its wakes refused in a row for C{gpus_in_use}.
    @ivar wake_refused_until: reactor seconds before which it is not woken
        again after such a refusal.
    @ivar adopt_unsettled: adopted as awake (its shards listed starting
        or ready) and its agent's check of the engine not answered yet:
        found asleep, it no longer counts in its model's C{wanted}.
    """

    id: str
    model: str
    profile: Profile
    shards: list[ShardRecord]
    created: float
    draining_since: float | None = None
    drain_reason: str = ""
    adopted: bool = False
    stop_sent_at: float | None = None
    drain_patience: float = 0.0
    error: str = ""
    rendezvous_port: int = 0
    leaving_since: float | None = None
    leaving_reason: str = ""
    leaving_hold: bool = False
    resident_since: float = 0.0
    ready_at: float | None = None
    sleep_at: float | None = None
    wake_at: float | None = None
    sleep_sent_at: float | None = None
    sleep_reason: str = ""
    asleep_at: float | None = None
    adopt_unsettled: bool = False
    wake_refusals: int = 0
    wake_refused_until: float = 0.0

    @property
    def dormant(self) -> bool:
        """
        Put to sleep (going or gone) and not woken since: it serves
        nothing and counts as none of its model's replicas.
        """
        if self.wake_at is not None or self.draining_since is not None:
            return False
        return self.sleep_at is not None or bool(
            self.shards and all(s.state == ShardState.SLEEPING for s in self.shards)
        )

    @property
    def asleep(self) -> bool:
        """
        Dormant and every shard asleep: it may be woken.
        """
        return self.dormant and all(s.state == ShardState.SLEEPING for s in self.shards)

    @property
    def state(self) -> ReplicaState:
        """
        C{draining}, C{failed} (a shard failed or was lost), C{waking}
        (told to wake, or a shard waking), C{sleeping} (told to sleep, or
        every shard asleep), C{ready} (all shards are), or C{starting}.
        """
        if self.draining_since is not None:
            return ReplicaState.DRAINING
        if self.error or any(s.state.gone for s in self.shards):
            return ReplicaState.FAILED
        if self.wake_at is not None or any(
            s.state == ShardState.WAKING for s in self.shards
        ):
            return ReplicaState.WAKING
        if self.sleep_at is not None or (
            self.shards and all(s.state == ShardState.SLEEPING for s in self.shards)
        ):
            return ReplicaState.SLEEPING
        if (
            len(self.shards) == self.profile.nodes
            and all(s.state == ShardState.READY for s in self.shards)
            and self.leader is not None
        ):
            return ReplicaState.READY
        return ReplicaState.STARTING

    @property
    def leader(self) -> ShardRecord | None:
        """
        @return: its rank 0 shard, if recorded.
        """
        for shard in self.shards:
            if shard.rank == 0:
                return shard
        return None

    def fault(self, now: float, start_timeout: float) -> tuple[str, bool]:
        """
        @param now: reactor seconds.
        @param start_timeout: C{[control] start_timeout}, seconds.
        @return: why the replica is to be dropped (a shard gone, or not
            ready in time), or C{""}; and whether it is not the model's
            fault (its node was lost, or its port was taken): replaced
            at once.
        """
        state = self.state
        if state == ReplicaState.FAILED:
            bad = next(s for s in self.shards if s.state.gone)
            error = f"shard {bad.id} on {bad.node}: {bad.state}: {bad.error}"
            return error, bad.state == ShardState.LOST or bad.misplaced
        if state == ReplicaState.STARTING and now - self.created > start_timeout:
            return f"not ready after {start_timeout:g}s", False
        return "", False


# Placement failure reasons, a fixed set (metric label values): a NoFit
# line's cause, told by the words placement writes (see
# L{llmgw.control.placement}).
_NO_FIT_KINDS = (
    ("no nodes", "no_nodes"),
    ("fabric", "fabric"),
    ("free port", "ports"),
    (" GB", "gpu_memory"),
    ("GPU", "gpus"),
    ("nodes fit", "multi_node"),
)
# Every kind L{no_fit_kinds} may return.
NO_FIT_KIND_NAMES = (*(kind for _, kind in _NO_FIT_KINDS), "node_state")


def no_fit_kinds(lines: list[str]) -> set[str]:
    """
    @param lines: a L{llmgw.control.placement.NoFit}'s lines.
    @return: the kinds of cause among them, each a fixed word
        (C{no_nodes}, C{fabric}, C{ports}, C{gpus}, C{gpu_memory},
        C{multi_node}, or C{node_state} for a node not ready).
    """
    kinds = set()
    for line in lines:
        for words, kind in _NO_FIT_KINDS:
            if words in line:
                kinds.add(kind)
                break
        else:
            kinds.add("node_state")
    return kinds


@dataclass
class PlaneCounts:
    """
    What the control plane did since it started, for the fleet metrics
    (L{llmgw.control.metrics}).

    @ivar engine_starts: replicas started, by model.
    @ivar engine_failures: replicas failed (not drained), by model.
    @ivar placement_failures: placements that found no fit, by kind of
        cause (L{no_fit_kinds}); one placement may count under several.
    @ivar swaps: replicas swapped out, by (model, reason): C{"evicted"}
        (stopped to make room), C{"slept"} (put to sleep to make room),
        C{"idle_sleep"} (asleep after C{idle_timeout}).
    @ivar wake_seconds: per model, the seconds each wake took.
    @ivar sleep_seconds: per model, the seconds each sleep took.
    @ivar cold_start_seconds: per model, the seconds from placement to
        ready of each replica started.
    @ivar start_phase_seconds: per (model, phase), the seconds each start
        spent in it (L{llmgw.control.phases}).
    """

    engine_starts: dict[str, int] = field(default_factory=dict)
    engine_failures: dict[str, int] = field(default_factory=dict)
    placement_failures: dict[str, int] = field(default_factory=dict)
    swaps: dict[tuple[str, str], int] = field(default_factory=dict)
    wake_seconds: dict[str, list[float]] = field(default_factory=dict)
    sleep_seconds: dict[str, list[float]] = field(default_factory=dict)
    cold_start_seconds: dict[str, list[float]] = field(default_factory=dict)
    start_phase_seconds: dict[tuple[str, str], list[float]] = field(
        default_factory=dict
    )

    def started(self, model: str) -> None:
        self.engine_starts[model] = self.engine_starts.get(model, 0) + 1

    def failed(self, model: str) -> None:
        self.engine_failures[model] = self.engine_failures.get(model, 0) + 1

    def no_fit(self, lines: list[str]) -> None:
        for kind in no_fit_kinds(lines):
            count = self.placement_failures.get(kind, 0)
            self.placement_failures[kind] = count + 1

    def swapped(self, model: str, reason: str) -> None:
        """
        A replica of C{model} was swapped out for C{reason} (one of
        C{"evicted"}, C{"slept"}, C{"idle_sleep"}).

        @raise ValueError: another reason.
        """
        if reason not in SWAP_REASONS:
            raise ValueError(f"swap reason {reason!r}: expected one of {SWAP_REASONS}")
        self.swaps[model, reason] = self.swaps.get((model, reason), 0) + 1

    def observed(self, kind: str, model: str, seconds: float) -> None:
        """
        A wake, sleep or cold start (C{kind}: C{"wake"}, C{"sleep"},
        C{"cold_start"}) of a replica of C{model} took C{seconds}.

        @raise ValueError: another kind.
        """
        lists = {
            "wake": self.wake_seconds,
            "sleep": self.sleep_seconds,
            "cold_start": self.cold_start_seconds,
        }
        if kind not in lists:
            raise ValueError(f"observed kind {kind!r}: expected one of {sorted(lists)}")
        lists[kind].setdefault(model, []).append(seconds)


SWAP_REASONS = ("evicted", "slept", "idle_sleep")
"""
Why a replica was swapped out (L{PlaneCounts.swapped}).
"""
