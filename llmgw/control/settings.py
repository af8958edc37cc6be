"""
The control plane's settings, the C{[control]} table of the server's
configuration: the reconciler's timers and limits, each key's kind (which
reads and checks it), default and meaning given with its field.  Here,
beside the control plane that reads them, so that the control plane needs
nothing of L{llmgw.config}, which composes the server's file out of every
table.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.config_checks import (
    BOOLEAN,
    DURATION,
    ConfigError,
    Duration,
    Kind,
    Number,
    Table,
    setting,
    settings_keys,
    spelled,
)

_LOWEST_PORT = 1024


@dataclass(frozen=True)
class PortRange(Kind[tuple[int, int]]):
    """
    C{[first, last]}: ports engines may listen on, 1024 to 65535.
    """

    @property
    def words(self) -> str:
        return f"[first, last] ports, {_LOWEST_PORT} to 65535"

    def read(self, where: str, value: object) -> tuple[int, int]:
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(p, int) and not isinstance(p, bool) for p in value)
            or not _LOWEST_PORT <= value[0] <= value[1] < 65536
        ):
            raise ConfigError(
                f"{where}: expected [first, last], ports {_LOWEST_PORT} to 65535,"
                f" got {spelled(value)}"
            )
        return (value[0], value[1])


@dataclass(frozen=True)
class ControlConfig:
    """
    The C{[control]} table: the reconciler's timers and limits.  Durations
    in seconds.

    @ivar unreachable_after: a node silent this long gets no new placements,
        and another agent for it may take over its link.
    @ivar lost_after: a node silent this long has its replicas placed
        elsewhere.
    @ivar base_backoff: the wait after a model's first failed replica;
        doubled per failure in a row up to C{max_backoff}.
    @ivar port_range: ports engines may listen on, C{(first, last)}.
    @ivar start_timeout: a shard not ready this long after it was placed is
        stopped and counted as failed.
    @ivar startup_grace: after the server starts, no placements and no
        scale-down for this long, while agents reconnect and their shards
        are adopted (so a restart makes no duplicates).
    @ivar drain_timeout: a draining replica's requests in flight get this
        long before its engines are stopped.
    @ivar interval: seconds between reconciler passes when nothing kicks.
    @ivar scale_up_in_flight: requests in flight per ready replica above
        which a model gets one more replica (up to C{max_replicas}).
    @ivar evict: whether a request held for a model that fits nowhere
        frees room by stopping (or putting to sleep) idle replicas of
        other models (L{llmgw.control.eviction}).
    @ivar swap_max_wait: the longest a held request is passed over while
        the replicas holding its room are busy; after it they are evicted
        too, leaving once their requests end.  0: a busy replica is never
        evicted.
    @ivar swap_in_use: seconds: a replica whose model was used this
        recently counts as busy for C{swap_max_wait}, so the requests held
        for other models wait for it and are served in a batch.  0: only
        requests in flight make it busy.
    """

    unreachable_after: float = setting(
        15.0,
        Duration(positive=True),
        "A node silent this long gets no new placements, and another agent"
        " for it may take over its link (before, one is refused).",
    )
    lost_after: float = setting(
        60.0,
        # More than 0s: it is at least unreachable_after, which is.
        Duration(positive=True),
        "A node silent this long has its replicas placed elsewhere (at least"
        " unreachable_after).",
    )
    base_backoff: float = setting(
        5.0,
        Duration(positive=True),
        "A failed replica's model waits this long before the next one,"
        " doubling per failure in a row up to max_backoff.",
    )
    max_backoff: float = setting(
        300.0,
        # More than 0s: it is at least base_backoff, which is.
        Duration(positive=True),
        "The longest wait after failures (at least base_backoff).",
    )
    port_range: tuple[int, int] = setting(
        (20000, 20999),
        PortRange(),
        "Ports engines listen on; keep them outside the"
        " kernel's ephemeral ports (warned at start).",
    )
    start_timeout: float = setting(
        900.0,
        Duration(positive=True),
        "A shard not ready this long after it was placed is stopped and"
        " counted as a failure.",
    )
    startup_grace: float = setting(
        10.0,
        DURATION,
        "After the server starts (or a standby takes the lead), no placements"
        " and no scale-down for this long, while agents reconnect and their"
        " engines are adopted.",
    )
    drain_timeout: float = setting(
        60.0,
        DURATION,
        "A draining replica's requests in flight get this long before its"
        " engines are stopped.",
    )
    interval: float = setting(
        1.0,
        Duration(least=0.01),
        "Between reconciler passes when nothing kicks one.",
    )
    scale_up_in_flight: float = setting(
        8.0,
        Number(least=1, most=100_000),
        "Requests in flight per ready replica above which a model gets one"
        " more replica (up to its max_replicas).",
    )
    evict: bool = setting(
        True,
        BOOLEAN,
        "A request held for a model that fits nowhere frees room: idle"
        " replicas of other models are stopped, or put to sleep where their"
        " profile says so (never a pinned model's, never below min_replicas,"
        " never before min_resident).",
    )
    swap_max_wait: float = setting(
        30.0,
        DURATION,
        "The longest a held request is passed over while the replicas holding"
        " its room are busy: then they take no new requests and leave once"
        " their streams end, and its model goes before higher priorities in"
        ' the swap queue ("0s": a busy replica is never evicted, and the'
        " swap queue goes by priority alone).",
    )
    swap_in_use: float = setting(
        0.0,
        DURATION,
        "A replica whose model was used this recently counts as busy for"
        " swap_max_wait: requests held for other models wait for it, up to"
        " swap_max_wait, and are served in a batch when it goes, rather than"
        ' one swap each ("0s": only requests in flight make it busy).',
    )


CONTROL_TABLE = Table(
    "[control]",
    "The control plane's reconciler: when a node counts as gone, backoff"
    " after failures, engine ports, start and drain deadlines, scaling up.",
    settings_keys(ControlConfig),
)


def parse_control(table: object) -> ControlConfig:
    """
    @return: the C{[control]} table's settings.
    @raise ConfigError: an unknown key, a bad value, or two that disagree
        (such as C{lost_after} shorter than C{unreachable_after}).
    """
    control = ControlConfig(**CONTROL_TABLE.read(table))
    if control.lost_after < control.unreachable_after:
        raise ConfigError(
            f"control.lost_after: {control.lost_after:g}s is shorter than"
            f" unreachable_after = {control.unreachable_after:g}s"
        )
    if control.max_backoff < control.base_backoff:
        raise ConfigError(
            f"control.max_backoff: {control.max_backoff:g}s is shorter than"
            f" base_backoff = {control.base_backoff:g}s"
        )
    if control.swap_in_use > 0 and control.swap_max_wait <= 0:
        raise ConfigError(
            f"control.swap_in_use: {control.swap_in_use:g}s needs swap_max_wait"
            " over 0s (a model used without pause would keep its room for ever)"
        )
    return control
