"""
What broke an attempt on a replica: whether another replica may be tried
(L{Retry}), and the OpenTelemetry C{error.type} of its span
(L{llmgw.router.telemetry.tracing.ERROR_TYPES}): a short word by the
failure's kind, never a Python class name.  Pure.
"""

from __future__ import annotations

from llmgw.router.errors import APIError
from llmgw.router.telemetry.tracing import (
    CONNECT_ERROR,
    CONNECTION_CLOSED,
    CONNECTION_REFUSED,
    INVALID_RESPONSE,
    REPLICA_GONE,
    RESPONSE_TOO_LARGE,
    STREAM_INCOMPLETE,
    TIMEOUT,
)
from llmgw.router.upstream.base import BadAnswer, UpstreamConnectError
from llmgw.router.upstream.relay import StreamCut
from llmgw.router.upstream.sse import EventTooLarge


class Retry(Exception):
    """
    An attempt failed before anything reached the client, and another
    replica may be tried (this one too if C{stale}: a kept connection closed).

    @ivar error: what the client is answered if no retry is left.
    """

    def __init__(self, error: APIError, stale: bool = False) -> None:
        self.error = error
        self.stale = stale


ENGINE_DEAD = b"EngineCore encountered an issue"
"""
The start of vLLM's C{EngineDeadError} message (C{vllm/v1/engine/
exceptions.py}), which its server answers with status 500 to every request
once its engine core process is gone, until its watchdog ends it.
"""


def engine_dead(status: int, body: bytes) -> bool:
    """
    @param status: a replica's answer status.
    @param body: its answer body.
    @return: whether the answer says the engine itself is dead (vLLM's
        C{EngineDeadError}): the request was not the cause, and may go to
        another replica.
    """
    return status == 500 and ENGINE_DEAD in body[:4096]


class AnswerTooLarge(Exception):
    """
    A replica's answer passed a size limit.
    """


def failure_type(
    error: BaseException, expired: str | None = None, cut: str | None = None
) -> str:
    """
    @param error: what ended the exchange with the replica.
    @param expired: the phase whose deadline passed, if one did (it is why
        the exchange was cancelled).
    @param cut: why the replica left the fleet, if it did meanwhile.
    @return: the C{error.type} of the attempt: C{timeout},
        C{replica_gone}, C{connection_refused}, C{connect_error},
        C{response_too_large}, C{stream_incomplete}, C{invalid_response}
        or C{connection_closed}.
    """
    if expired is not None:
        return TIMEOUT
    if cut is not None:
        return REPLICA_GONE
    if isinstance(error, UpstreamConnectError):
        if error.timed_out:
            return TIMEOUT
        return CONNECTION_REFUSED if error.refused else CONNECT_ERROR
    if isinstance(error, (AnswerTooLarge, EventTooLarge)):
        return RESPONSE_TOO_LARGE
    if isinstance(error, StreamCut):
        return STREAM_INCOMPLETE
    if isinstance(error, BadAnswer):
        return INVALID_RESPONSE
    return CONNECTION_CLOSED
