"""
C{--log-format json}: the server's log as one JSON object per line, for
log shippers (Loki, Elasticsearch, journald's JSON readers).

Each line is Twisted's L{eventAsJSON} of the event (its fields as keys:
a request line carries C{request_id} (llmgw's own), C{client_request_id},
C{model}, C{replica}, C{status}, C{latency}, C{time_to_first_token} and
the token counts; see
L{llmgw.router.accounting.usage_log.LogUsageSink}) plus C{text}, the line as the text
format would print it.  twistd takes the observer from the application's
L{ILogObserver} component (C{twisted.application.app.AppLogger.start}),
which L{llmgw.daemon.lifecycle.Lifecycle} sets.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from twisted.logger import ILogObserver, LogEvent, eventAsJSON, formatEvent
from zope.interface import implementer


@implementer(ILogObserver)
class JsonLines:
    """
    Writes each event as one line of JSON (no record separator, unlike
    L{twisted.logger.jsonFileLogObserver}'s default).

    @param out: a text file, flushed after each line.
    """

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def __call__(self, event: LogEvent) -> None:
        event = dict(event)
        # Objects, not data: eventAsJSON would write them as
        # {"unpersistable": true}.
        event.pop("log_logger", None)
        event.pop("log_source", None)
        try:
            event["text"] = formatEvent(event)
        except Exception:
            event["text"] = repr(event.get("log_format"))
        self.out.write(eventAsJSON(event) + "\n")
        self.out.flush()


def json_observer(twistd_options: Any) -> JsonLines:
    """
    @param twistd_options: twistd's own options (C{--logfile},
        C{--nodaemon}), or L{None}.
    @return: an observer writing where twistd would have: C{--logfile},
        standard output with C{-n}, else C{twistd.log}.
    @raise OSError: the log file cannot be opened.
    """
    logfile = twistd_options.get("logfile") if twistd_options is not None else None
    nodaemon = bool(twistd_options.get("nodaemon")) if twistd_options else True
    if logfile == "-" or (not logfile and nodaemon):
        return JsonLines(sys.stdout)
    return JsonLines(open(logfile or "twistd.log", "a", encoding="utf-8"))
