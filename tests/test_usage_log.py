"""
L{llmgw.router.accounting.usage_log}: the per-request log line, formatted once and
logged as a format with no fields, and the fields on its event.
"""

from __future__ import annotations

from twisted.logger import LogEvent, Logger, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.accounting.usage_log import LogUsageSink, UsageSinks
from llmgw.router.interfaces import RequestRecord
from tests.typing_support import collect


def _record(**changes: object) -> RequestRecord:
    fields: dict[str, object] = dict(
        request_id="req-1",
        upstream_request_id="up-1",
        model="m",
        replica="r1",
        status=200,
        stream=True,
        prompt_tokens=11,
        completion_tokens=22,
        latency=1.23456,
        time_to_first_token=0.5,
        key_id=3,
        key_name="app",
        usage_estimated=False,
    )
    fields.update(changes)
    return RequestRecord(**fields)  # type: ignore[arg-type]


class LogUsageSinkTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.events: list[LogEvent] = []
        self.sink = LogUsageSink()
        self.sink.log = Logger(observer=collect(self.events))

    def test_line(self) -> None:
        """
        One event per record, whose text is the request line (latency in
        seconds to the millisecond) and whose fields are the record's.
        """
        self.sink.record(_record(client_request_id="trace-7"))
        (event,) = self.events
        self.assertEqual(
            formatEvent(event),
            "request req-1 client_id=trace-7 upstream_id=up-1 model=m replica=r1"
            " key=app status=200 prompt_tokens=11 completion_tokens=22 latency=1.235s",
        )
        self.assertEqual(
            {
                k: event[k]
                for k in ("request_id", "client_request_id", "model", "status")
            },
            {
                "request_id": "req-1",
                "client_request_id": "trace-7",
                "model": "m",
                "status": 200,
            },
        )
        self.assertEqual(event["time_to_first_token"], 0.5)
        self.assertIs(event["stream"], True)

    def test_braces_printed_as_they_are(self) -> None:
        """
        Braces in the model, the request id or the key's name are printed
        literally, not read as fields of a format.
        """
        self.sink.record(
            _record(request_id="{id}", model="a{b}c{0}", key_name="{}", replica="{{r}}")
        )
        (event,) = self.events
        self.assertEqual(
            formatEvent(event),
            "request {id} client_id=- upstream_id=up-1 model=a{b}c{0} replica={{r}}"
            " key={} status=200 prompt_tokens=11 completion_tokens=22 latency=1.235s",
        )
        self.assertEqual(event["model"], "a{b}c{0}")

    def test_sinks_all_get_each_record(self) -> None:
        """
        L{UsageSinks} hands each record to each of its sinks, in order.
        """
        seen: list[tuple[str, RequestRecord]] = []

        class Sink:
            def __init__(self, name: str) -> None:
                self.name = name

            def record(self, record: RequestRecord) -> None:
                seen.append((self.name, record))

        record = _record()
        UsageSinks(Sink("a"), Sink("b")).record(record)
        self.assertEqual(seen, [("a", record), ("b", record)])
