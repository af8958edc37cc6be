"""
Profiling pages, for the admin listener only (never the client
listener): plain text, for an operator with curl.

  - C{GET /debug/profile?seconds=N}: a CPU profile of the reactor thread
    for N seconds (1 to 60, default 10), by pyinstrument (a sampling
    profiler: U{https://pyinstrument.readthedocs.io}); C{&format=html}
    for its interactive HTML page.  One at a time (409 otherwise).
  - C{GET /debug/heap}: the top allocations by source line, from
    C{tracemalloc}; the first call starts tracing (which slows the
    process while on), C{?stop=1} stops it.
  - C{GET /debug/threads}: every thread's stack (C{sys._current_frames}).
  - C{GET /debug/delayed}: the reactor's pending delayed calls, soonest
    first.
"""

from __future__ import annotations

import sys
import threading
import traceback
import tracemalloc
from typing import Any

from klein import Klein
from pyinstrument import Profiler
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.web.iweb import IRequest

MAX_SECONDS = 60


def _text(request: IRequest, body: str, status: int = 200) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    request.setHeader(b"cache-control", b"no-store")
    return body.encode("utf-8")


class Profiling:
    """
    @param reactor: the reactor whose thread is profiled (the profile
        starts and stops on it) and whose delayed calls are listed.
    """

    app = Klein()

    def __init__(self, reactor: IReactorTime) -> None:
        self._reactor = reactor
        self._profiling = False

    @app.route("/debug", methods=["GET"])
    @app.route("/debug/", methods=["GET"])
    def index(self, request: IRequest) -> bytes:
        return _text(request, (__doc__ or "").strip() + "\n")

    @app.route("/debug/profile", methods=["GET"])
    async def profile(self, request: IRequest) -> bytes:
        try:
            seconds = float(request.args.get(b"seconds", [b"10"])[0])
        except ValueError:
            seconds = -1
        if not 0 < seconds <= MAX_SECONDS:
            return _text(request, f"seconds: expected 0 to {MAX_SECONDS}\n", 400)
        if self._profiling:
            return _text(request, "a profile is being taken: try again later\n", 409)
        html = request.args.get(b"format", [b"text"])[0] == b"html"
        # Started on the reactor thread, the profiler samples that thread
        # alone; async_mode off, since Deferreds are not asyncio tasks.
        profiler = Profiler(interval=0.001, async_mode="disabled")
        self._profiling = True
        profiler.start()
        try:
            await deferLater(self._reactor, seconds, lambda: None)
        finally:
            profiler.stop()
            self._profiling = False
        if html:
            request.setHeader(b"content-type", b"text/html; charset=utf-8")
            return profiler.output_html().encode("utf-8")
        return _text(request, profiler.output_text(unicode=True, show_all=False))

    @app.route("/debug/heap", methods=["GET"])
    def heap(self, request: IRequest) -> bytes:
        if request.args.get(b"stop"):
            tracemalloc.stop()
            return _text(request, "tracing stopped\n")
        if not tracemalloc.is_tracing():
            tracemalloc.start(10)
            return _text(
                request,
                "tracemalloc started now: ask again for the allocations made"
                " since (?stop=1 stops it)\n",
            )
        snapshot = tracemalloc.take_snapshot().filter_traces(
            (tracemalloc.Filter(False, tracemalloc.__file__),)
        )
        stats = snapshot.statistics("lineno")
        total = sum(s.size for s in stats)
        lines = [f"traced: {total / 1024 / 1024:.1f} MiB in {len(stats)} lines"]
        lines += [str(s) for s in stats[:30]]
        return _text(request, "\n".join(lines) + "\n")

    @app.route("/debug/threads", methods=["GET"])
    def threads(self, request: IRequest) -> bytes:
        names = {t.ident: t.name for t in threading.enumerate()}
        out = []
        for ident, frame in sys._current_frames().items():
            out.append(f"thread {names.get(ident, '?')} ({ident}):")
            out.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
            out.append("")
        return _text(request, "\n".join(out))

    @app.route("/debug/delayed", methods=["GET"])
    def delayed(self, request: IRequest) -> bytes:
        now = self._reactor.seconds()
        calls: list[Any] = sorted(
            self._reactor.getDelayedCalls(), key=lambda c: c.getTime()
        )
        lines = [f"{len(calls)} delayed calls"]
        for call in calls[:500]:
            func = getattr(call, "func", None)
            name = getattr(func, "__qualname__", None) or repr(func)
            module = getattr(func, "__module__", "") or ""
            lines.append(f"in {call.getTime() - now:9.3f}s  {module}.{name}"[:300])
        return _text(request, "\n".join(lines) + "\n")
