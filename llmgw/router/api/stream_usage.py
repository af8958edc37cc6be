"""
Engines that send no usage in their streams though asked: each model's
named once in the log, so that an operator knows its streams' usage is
estimated.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.logger import Logger

from llmgw.router.api.exchange import Exchange
from llmgw.router.api.prepare import USAGE_STREAM_PATHS


class MissingStreamUsage:
    """
    Warns once per model whose engine ended a stream cleanly (a choice
    finished) without the usage the router asked for (llama-cpp-python's server ignores
    C{stream_options}): its usage is estimated, and the operator should
    know.

    @param knows: whether a model name is served or in the catalog (only
        those are named, never a client's invention).
    """

    def __init__(self, knows: Callable[[str], bool]) -> None:
        self._knows = knows
        self._warned: set[str] = set()

    def note(self, status: int, exchange: Exchange | None, log: Logger) -> None:
        """
        @param status: the status the client got.
        @param exchange: the request's trip to the replicas, if it went.
        @param log: where the warning goes (the router's log).
        """
        if (
            exchange is None
            or status != 200
            or exchange.usage is not None
            or not exchange.prepared.stream
            # An engine that broke off (vLLM's error event, then [DONE])
            # sends no usage then: it says nothing of its usage.
            or not exchange.finished
            or exchange.path not in USAGE_STREAM_PATHS
            or exchange.answer_status != 200
            or exchange.model in self._warned
            or not self._knows(exchange.model)
        ):
            return
        self._warned.add(exchange.model)
        log.warn(
            "model {model}: its engine (replica {replica}) sends no usage in"
            " streams though asked (stream_options.include_usage); its streams'"
            " usage is estimated from the events relayed",
            model=exchange.model,
            replica=exchange.replica.id if exchange.replica is not None else None,
        )
