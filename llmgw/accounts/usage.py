"""
The router's usage records into the store: the L{UsageSink} the server
wires between L{llmgw.router.api.app.Router} and L{llmgw.store.usage.UsageWriter}.
"""

from __future__ import annotations

from llmgw.router.interfaces import BATCH_RUN_AGAIN, RequestRecord
from llmgw.store.db import UsageRow
from llmgw.store.usage import UsageWriter


def usage_row(record: RequestRecord) -> UsageRow:
    """
    @return: the store's row for one finished request.
    """
    return UsageRow(
        request_id=record.request_id,
        client_request_id=record.client_request_id,
        key_id=record.key_id,
        key_name=record.key_name,
        model=record.model,
        replica=record.replica,
        status=record.status,
        stream=record.stream,
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        latency=record.latency,
        time_to_first_token=record.time_to_first_token,
        estimated=record.usage_estimated,
        batch_id=record.batch_id,
    )


class StoreUsageSink:
    """
    A L{llmgw.router.interfaces.UsageSink} handing each request's row to the
    store's writer.

    @param writer: buffers the rows and writes them.
    """

    def __init__(self, writer: UsageWriter) -> None:
        self.writer = writer

    def record(self, record: RequestRecord) -> None:
        if record.key_id is None and (
            record.status == 401 or not self.writer.record_rows
        ):
            # Unauthenticated: anyone could fill the store with these (the
            # log line and the metrics still count them).  Or nothing to
            # write: no rows kept, no key to count for.
            return
        if record.batch_id is not None and record.status in BATCH_RUN_AGAIN:
            # The runner sends this line again: its record is its answer's,
            # one per line (the line's request id is its usage key).
            return
        self.writer.add(usage_row(record))
