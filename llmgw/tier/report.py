"""
A router of the tier reports its traffic to the control plane it follows
(C{POST /api/v1/report} every L{REPORT_INTERVAL} seconds, and once more
as it stops), so that the server's C{/metrics}, its metrics listener and
its dashboard count the fleet's whole traffic whatever the process layout
(the report's format and why: L{llmgw.router.telemetry.reports}).
"""

from __future__ import annotations

from twisted.application.service import Service
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmgw.router.telemetry.reports import REPORT_INTERVAL, Reporter
from llmgw.tier.admin_client import AdminClient

LAST_REPORT_TIMEOUT = 2.0
"""
Seconds the stop waits for the last report.
"""


class TrafficReports(Service):
    """
    Sends L{Reporter}'s payloads, one at a time; one that fails is said
    again in the next (nothing is lost while the server is away, but for
    traffic batches past L{llmgw.router.telemetry.reports.MAX_BATCHES}).
    Logs one warning when reports start failing and one line when they
    are taken again.

    @param interval: seconds between reports.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        control: AdminClient,
        reporter: Reporter,
        interval: float = REPORT_INTERVAL,
    ) -> None:
        self.clock = clock
        self.control = control
        self.reporter = reporter
        self.failing = False
        self._sending: Deferred[None] | None = None
        self._loop = LoopingCall(self.send)
        self._loop.clock = clock
        self._interval = interval

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._loop.start(self._interval, now=False)

    def stopService(self) -> Deferred[None]:
        """
        @return: fires once the last report was taken, failed or timed
            out after L{LAST_REPORT_TIMEOUT} seconds (the requests drained
            before this step: their counts reach the server).
        """
        super().stopService()  # type: ignore[no-untyped-call]
        if self._loop.running:
            self._loop.stop()
        last = self.send()
        last.addTimeout(LAST_REPORT_TIMEOUT, self.clock)
        return last.addErrback(lambda _: None)

    def send(self) -> Deferred[None]:
        """
        Send a report now, unless one is in flight (then wait for it) or
        there is nothing to say.

        @return: fires when it was answered (never fails).
        """
        if self._sending is not None:
            waiting: Deferred[None] = Deferred()
            self._sending.addBoth(lambda _: waiting.callback(None))
            return waiting
        payload = self.reporter.payload()
        if payload is None:
            return Deferred.fromCoroutine(_nothing())
        sending = ensureDeferred(self._post(payload))
        self._sending = sending

        def done(_: object) -> None:
            self._sending = None

        return sending.addBoth(done)

    async def _post(self, payload: dict[str, object]) -> None:
        try:
            code, value = await self.control.post("/api/v1/report", payload)
        except Exception as e:
            self._failed(str(e) or type(e).__name__)
            return
        if code != 200:
            error = value.get("error") if isinstance(value, dict) else None
            message = error.get("message") if isinstance(error, dict) else None
            self._failed(f"{code} {str(message or '')[:200]}".strip())
            return
        self.reporter.delivered(payload)
        if self.failing:
            self.failing = False
            self.log.info("traffic reports to {url} taken again", url=self.control.url)

    def _failed(self, why: str) -> None:
        if self.failing:
            return
        self.failing = True
        self.log.warn(
            "cannot report traffic to {url}: {why}; its /metrics and dashboard"
            " lack this router's counts until a report is taken (kept meanwhile)",
            url=self.control.url,
            why=why,
        )


async def _nothing() -> None:
    return None
