"""
Where each finished request's record goes: several sinks at once, and the
log line every request gets.
"""

from __future__ import annotations

from twisted.logger import Logger

from llmgw.router.interfaces import RequestRecord, UsageSink


class UsageSinks:
    """
    Hands each record to several sinks.
    """

    def __init__(self, *sinks: UsageSink) -> None:
        self.sinks = sinks

    def record(self, record: RequestRecord) -> None:
        for sink in self.sinks:
            sink.record(record)


class LogUsageSink:
    """
    A L{UsageSink} that writes one log line per request: led by llmgw's
    own id of it (the key of its usage record), then the client's
    C{X-Request-ID} (C{client_id}, C{-} when it sent none) and the one the
    engine got (C{upstream_id}).

    The line is formatted here, once, and handed to the logger as a
    format with no fields (its braces doubled): Twisted's formatting of
    a ten-field format was a tenth of the router's CPU per request
    (cProfile, C{bench/router_bench.py}).  The fields still travel with
    the event, for the JSON log (C{--log-format json}).
    """

    log = Logger()

    def record(self, record: RequestRecord) -> None:
        line = (
            f"request {record.request_id}"
            f" client_id={record.client_request_id or '-'}"
            f" upstream_id={record.upstream_request_id} model={record.model}"
            f" replica={record.replica} key={record.key_name}"
            f" status={record.status} prompt_tokens={record.prompt_tokens}"
            f" completion_tokens={record.completion_tokens}"
            f" latency={record.latency:.3f}s"
        )
        extra = {} if record.candidates is None else {"candidates": record.candidates}
        self.log.info(
            line.replace("{", "{{").replace("}", "}}"),
            request_id=record.request_id,
            client_request_id=record.client_request_id,
            upstream_request_id=record.upstream_request_id,
            model=record.model,
            replica=record.replica,
            key=record.key_name,
            status=record.status,
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.completion_tokens,
            latency=record.latency,
            # Not in the text line; fields of the JSON line (--log-format).
            time_to_first_token=record.time_to_first_token,
            stream=record.stream,
            usage_estimated=record.usage_estimated,
            **extra,
        )
