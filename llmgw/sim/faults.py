"""
The simulator's faults: what C{--fault KEY=VALUE} and C{POST /sim/faults}
set (an HTTP status, stalls, cut streams), checked once, and the faults in
force for one model, layered over the engine-wide ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass


class FaultError(ValueError):
    """
    A fault specification is invalid; the message names the key.
    """


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_status(key: str, value: object) -> None:
    if not (_is_int(value) and 100 <= value <= 599):  # type: ignore[operator]
        raise FaultError(f"fault {key!r} must be an HTTP status 100..599")


def _check_seconds(key: str, value: object) -> None:
    if not (_is_number(value) and 0 <= value < float("inf")):  # type: ignore[operator]
        raise FaultError(f"fault {key!r} must be a number of seconds >= 0")


def _check_count(key: str, value: object) -> None:
    if not (_is_int(value) and value >= 0):  # type: ignore[operator]
        raise FaultError(f"fault {key!r} must be an integer >= 0")


def _check_bool(key: str, value: object) -> None:
    if not isinstance(value, bool):
        raise FaultError(f"fault {key!r} must be true or false")


_FAULT_CHECKS = {
    "status": _check_status,
    "stall_before_first_byte": _check_seconds,
    "stall_after_chunks": _check_count,
    "stall_seconds": _check_seconds,
    "drop_after_chunks": _check_count,
    "byte_writes": _check_bool,
}

FAULT_KEYS: frozenset[str] = frozenset(_FAULT_CHECKS)
"""
The fault keys accepted per request (C{"llmgw_sim"} body field), by
C{--fault} and by C{POST /sim/fault}.
"""


def validate_faults(spec: object) -> dict[str, object]:
    """
    Check a fault specification.

    @param spec: a JSON object: fault key to value.
    @return: a copy of C{spec}.
    @raise FaultError: C{spec} is not an object, names an unknown key, or
        has a value of the wrong type or range.
    """
    if not isinstance(spec, dict):
        raise FaultError("faults must be a JSON object")
    for key, value in spec.items():
        check = _FAULT_CHECKS.get(key)
        if check is None:
            raise FaultError(f"unknown fault key {key!r}")
        check(key, value)
    return dict(spec)


def parse_fault_option(text: str) -> tuple[str, object]:
    """
    Parse one C{--fault KEY=VALUE} option; VALUE is JSON (C{503}, C{1.5},
    C{true}).

    @return: the key and its value, validated.
    @raise FaultError: malformed, unknown key or bad value.
    """
    key, sep, raw = text.partition("=")
    if not sep:
        raise FaultError(f"fault {text!r} is not KEY=VALUE")
    try:
        value: object = json.loads(raw)
    except ValueError:
        value = raw
    validate_faults({key: value})
    return key, value


@dataclass(frozen=True, slots=True)
class Faults:
    """
    The faults in force for one request.

    @ivar status: answer with this HTTP status and an error object instead
        of generating; None for no such fault.
    @ivar stall_before_first_byte: seconds to wait before any response byte
        (headers included); at least L{FOREVER} means until the client
        leaves.
    @ivar stall_after_chunks: after this many events (SSE events for a
        stream, the one body for other responses) pause for C{stall_seconds};
        None for no stall.
    @ivar stall_seconds: the pause's length in seconds; None (key absent) or
        at least L{FOREVER} means until the client leaves.
    @ivar drop_after_chunks: after this many events abort the TCP
        connection; None for no drop.
    @ivar byte_writes: write the response body one byte per write, 2 ms
        apart.
    """

    status: int | None = None
    stall_before_first_byte: float = 0.0
    stall_after_chunks: int | None = None
    stall_seconds: float | None = None
    drop_after_chunks: int | None = None
    byte_writes: bool = False

    @classmethod
    def layered(
        cls, process: Mapping[str, object], request: Mapping[str, object]
    ) -> Faults:
        """
        Combine validated process-wide and per-request faults; per-request
        keys win.
        """
        merged = {**process, **request}
        return cls(**merged)  # type: ignore[arg-type]


NO_FAULTS = Faults()
