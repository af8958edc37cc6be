"""
The admin API's routes for a router tier (issue 12 item 2): the watch a
router follows, activations it forwards (and where they stand), the use
it reports, and its traffic (L{llmgw.router.telemetry.reports}).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from klein import Klein
from twisted.internet.defer import Deferred, TimeoutError
from twisted.web.iweb import IRequest

from llmgw.admin.http import (
    AdminError,
    error_answers,
    json_answer,
    not_found,
    priority_number,
    read_body,
)
from llmgw.control.plane import ControlPlane
from llmgw.router.interfaces import ActivationRefused, NeverPlaceable
from llmgw.router.telemetry.reports import Reports
from llmgw.tier.watch import Watch
from llmgw.wire import versions

MAX_ACTIVATION_WAIT = 600.0
"""
Seconds an activation request may ask to wait, at most.
"""


class StandbyError(AdminError):
    """
    503 from a standby control plane: C{{"error": {"message", "code":
    "standby", "leader": "HOST:PORT"}}}, the leader's agent address
    (L{llmgw.server.standby}; C{""} while none is known).
    """

    def __init__(self, leader: str) -> None:
        super().__init__(
            503,
            f"this server is a standby; the leader is {leader or 'not known yet'}",
            "standby",
        )
        self.leader = leader


class WatchRoutes:
    """
    C{/api/v1/watch}, C{/api/v1/models/<name>/activate},
    C{/api/v1/touch} and C{/api/v1/report}.

    @param plane: the control plane, when there is one.
    @param watch: what a router tier follows, when there is a control
        plane.
    @param standby: with standbys (L{llmgw.server.standby}), whether this
        server leads and the leader's agent address (C{{"leading": bool,
        "leader": "HOST:PORT"}}); L{None} for a server alone.
    @param reports: where the routers report their traffic, when there is
        a router here.
    """

    app = error_answers(Klein())

    def __init__(
        self,
        plane: ControlPlane | None,
        watch: Watch | None,
        *,
        standby: Callable[[], dict[str, object]] | None,
        reports: Reports | None = None,
    ) -> None:
        self._plane = plane
        self._watch = watch
        self._standby = standby
        self._reports = reports

    def _watched(
        self, request: IRequest, adopting: bool = False
    ) -> tuple[ControlPlane, Watch]:
        """
        @raise AdminError: 409 to a router whose protocol version this
            server does not serve (C{"code": "protocol_version"}, its
            C{LLMGW-Protocol} header; see L{llmgw.wire.versions}); 404
            without a control plane; 503 from a standby
            (C{"code": "standby"}, with the C{"leader"}'s agent address),
            and from a leader that took over and is still in its startup
            grace, adopting the agents' engines (its state is not whole
            yet: a router keeps what it had and asks again), unless
            C{adopting} (the route needs no whole state).
        """
        request.setHeader(versions.HEADER.encode(), versions.text().encode())
        said = request.getHeader(versions.HEADER.encode())
        reason = versions.mismatch(
            said.decode("ascii", "replace") if said is not None else "", "router"
        )
        if reason:
            raise AdminError(409, reason, "protocol_version")
        plane, watch = self._plane, self._watch
        if plane is None or watch is None:
            raise AdminError(404, "no control plane in this server", "not_found")
        if self._standby is not None:
            state = self._standby()
            if not state.get("leading"):
                leader = str(state.get("leader") or "")
                raise StandbyError(leader)
            if not plane.grace_over and not adopting:
                raise AdminError(
                    503,
                    "this server has just taken over and is adopting the"
                    " agents' engines; ask again in a few seconds",
                    "adopting",
                )
        return plane, watch

    @app.route("/api/v1/watch", methods=["GET"])
    def watch_state(self, request: IRequest) -> Deferred[None]:
        """
        The endpoints (with their secrets) and the catalog's names as
        newline-delimited JSON, pushed on each change
        (L{llmgw.tier.watch}), less what the router's protocol version
        (its C{LLMGW-Protocol} header; none: 1.0) does not know; the answer
        never ends while the server runs.
        """
        _, watch = self._watched(request)
        said = request.getHeader(versions.HEADER.encode())
        protocol = versions.peer_version(
            said.decode("ascii", "replace") if said is not None else ""
        )
        return watch.watch(request, protocol)

    @app.route("/api/v1/models/<path:name>/activate", methods=["POST"])
    async def activate(self, request: IRequest, name: str) -> bytes:
        """
        A router's request for C{name} found no replica: ask for one and
        answer when one is published (C{{"ready": model}}), or 504 with
        why not after the body's C{timeout} seconds (default 60, at most
        L{MAX_ACTIVATION_WAIT}).  The body's C{priority} (a name such as
        C{"batch"} or a number, higher first; default C{standard}) is the
        waiting request's, which the swap queue orders by; C{waited} the
        seconds it has waited already (a router of a tier posts again
        after each C{timeout}), counted as though it arrived that long ago.

        The fleet's requests held for a model are bounded by this server's
        C{[router] activation_queue}: past it the lowest priority's newest,
        this one or one held earlier, is answered 429 C{{"error":
        {"message", "code": "activation_queue_full"}, "refused": true}}
        (L{refused_answer}), and its router answers its client as its own
        full queue does.  A router that does not know C{refused} reads a
        429 as any answer but 200: it posts again a second later, and keeps
        waiting as before the field.
        """
        plane, watch = self._watched(request)
        model = plane.catalog.resolve(name)
        if model is None:
            raise not_found(f"model {name[:200]!r}")
        body = read_body(request)
        timeout = _seconds(
            body,
            "timeout",
            60.0,
            lambda n: 0 < n <= MAX_ACTIVATION_WAIT,
            f"in (0, {MAX_ACTIVATION_WAIT:g}]",
        )
        waited = _seconds(body, "waited", 0.0, lambda n: 0 <= n < math.inf, "0 or more")
        rank = priority_number(body.get("priority"))
        if not watch.serves(model):
            ready = plane.catalog.activate(model, rank, waited)
            ready.addTimeout(timeout, watch.clock)
            try:
                await ready
            except ActivationRefused as e:
                return refused_answer(request, e)
            except NeverPlaceable as e:
                # A router that does not know the field reads "not yet".
                error = {"message": str(e), "code": "model_unplaceable"}
                answer = {"error": error, "unplaceable": e.why}
                return json_answer(request, answer, 429)
            except TimeoutError:
                # addTimeout's; a router that goes cancels with CancelledError.
                why = plane.catalog.why_not(model) or "no replica is ready yet"
                raise AdminError(504, why, "activation_timeout") from None
        return json_answer(request, {"ready": model})

    @app.route("/api/v1/models/<path:name>/activate", methods=["GET"])
    def standing(self, request: IRequest, name: str) -> bytes:
        """
        Where a request held for C{name} stands
        (L{llmgw.router.interfaces.Activator.where}): C{{"model", "ready":
        bool, "words": str, "eta_seconds": float | null}} (the words why
        no replica is ready when the plane has none of where); a router of a
        tier says it in a waiting stream's keep-alive comments and sets
        C{Retry-After} from it.
        """
        plane, watch = self._watched(request)
        model = plane.catalog.resolve(name)
        if model is None:
            raise not_found(f"model {name[:200]!r}")
        where = plane.catalog.where(model)
        return json_answer(
            request,
            {
                "model": model,
                "ready": watch.serves(model),
                "words": where.words or plane.catalog.why_not(model),
                "eta_seconds": where.eta_seconds,
            },
        )

    @app.route("/api/v1/touch", methods=["POST"])
    def touch(self, request: IRequest) -> bytes:
        """
        Requests for the body's C{names} came through a router: the models
        are not idle.
        """
        plane, _ = self._watched(request)
        names: Any = read_body(request).get("names", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise AdminError(400, "names must be a list of strings", "bad_request")
        for name in names[:10000]:
            plane.catalog.touch(name)
        return json_answer(request, {"touched": len(names)})

    @app.route("/api/v1/report", methods=["POST"])
    def report(self, request: IRequest) -> bytes:
        """
        A router's traffic since it last reported (the body's format:
        L{llmgw.router.telemetry.reports}), added to this server's
        C{/metrics} and dashboard: C{{"taken": N}}, the samples and
        series counted; 400 naming what is wrong with a body that is not a
        report (nothing of it counted).
        """
        # Counted from the first: a leader that took over is still in its
        # startup grace while the routers come to it.
        self._watched(request, adopting=True)
        if self._reports is None:
            raise not_found("report here")
        try:
            taken = self._reports.take(read_body(request))
        except ValueError as e:
            raise AdminError(400, str(e)[:300], "bad_request") from None
        return json_answer(request, {"taken": taken})


def refused_answer(request: IRequest, refused: ActivationRefused) -> bytes:
    """
    @return: the answer to an activation the fleet's bound refused: 429
        C{{"error": {"message", "code": "activation_queue_full"},
        "refused": true}}.  C{refused} is the field a router reads
        (L{llmgw.tier.activate}); the status and error are what a router
        that does not know it reads as "not yet" (it asks again).
    """
    error = {"message": str(refused), "code": "activation_queue_full"}
    return json_answer(request, {"error": error, "refused": True}, 429)


def _seconds(
    body: dict[str, Any],
    key: str,
    default: float,
    within: Callable[[float], bool],
    expected: str,
) -> float:
    """
    @return: the number of seconds C{body[key]} says (C{default} when
        absent).
    @raise AdminError: 400 when it is not a number for which C{within}
        holds: C{"KEY must be a number of seconds EXPECTED"}.
    """
    value = body.get(key, default)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not within(value):
        raise AdminError(
            400, f"{key} must be a number of seconds {expected}", "bad_request"
        )
    return float(value)
