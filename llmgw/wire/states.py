"""
Shard state names: the facts both processes name the same way, the
agent in its records and logs, the server in its records, logs and admin
API.  On the wire a state is C{pb.ShardState}; everywhere else it is a
L{ShardState}, whose value is the lower-case name the JSON shows.
"""

from __future__ import annotations

from enum import StrEnum

from llmgw.wire import agent_pb2 as pb


class ShardState(StrEnum):
    """
    Where a shard (one engine process) is in its life.

    C{LOST} is the server's alone: the shard's node was lost, so nothing
    is known of it; it has no protobuf value.  C{SLEEPING}: its engine
    runs with its GPU memory released (vLLM's sleep mode, SGLang's memory
    saver); C{WAKING}: its engine's wake route was called and has not
    answered yet.
    """

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"
    LOST = "lost"
    SLEEPING = "sleeping"
    WAKING = "waking"

    @property
    def gone(self) -> bool:
        """
        Whether the shard no longer runs (stopped, failed or lost).
        """
        return self in _GONE

    def to_pb(self) -> pb.ShardState:
        """
        @return: the protobuf value.
        @raise ValueError: L{LOST}, which has none.
        """
        try:
            return _TO_PB[self]
        except KeyError:
            raise ValueError(f"shard state {self} has no protobuf value") from None

    @classmethod
    def from_pb(cls, value: int) -> ShardState | None:
        """
        @param value: a C{pb.ShardState} value.
        @return: its state, or L{None} for C{SHARD_STATE_UNSPECIFIED} and
            values this version does not know.
        """
        return _FROM_PB.get(value)


_GONE = frozenset({ShardState.STOPPED, ShardState.FAILED, ShardState.LOST})
_TO_PB: dict[ShardState, pb.ShardState] = {
    ShardState.PENDING: pb.SHARD_STATE_PENDING,
    ShardState.STARTING: pb.SHARD_STATE_STARTING,
    ShardState.READY: pb.SHARD_STATE_READY,
    ShardState.DRAINING: pb.SHARD_STATE_DRAINING,
    ShardState.STOPPED: pb.SHARD_STATE_STOPPED,
    ShardState.FAILED: pb.SHARD_STATE_FAILED,
    ShardState.SLEEPING: pb.SHARD_STATE_SLEEPING,
    ShardState.WAKING: pb.SHARD_STATE_WAKING,
}
_FROM_PB: dict[int, ShardState] = {value: state for state, value in _TO_PB.items()}
