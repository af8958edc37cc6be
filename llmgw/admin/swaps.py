"""
The admin API's routes for more models than GPUs (docs/catalog.md): a
model pinned (never evicted to make room for another) or unpinned; a
replica put to sleep or woken.
"""

from __future__ import annotations

from klein import Klein
from twisted.web.iweb import IRequest

from llmgw.admin.http import (
    AdminError,
    error_answers,
    json_answer,
    need_plane,
    not_found,
)
from llmgw.admin.models import model_json
from llmgw.control.operating import SleepRefused
from llmgw.control.plane import ControlPlane
from llmgw.control.views import replica_json


class SwapRoutes:
    """
    C{/api/v1/models/<name>/pin} and C{unpin},
    C{/api/v1/replicas/<replica>/sleep} and C{wake}.

    @param plane: the control plane, when there is one.
    @param config_models: names of the config file's models, for the
        model's C{runtime} in a pin's answer.
    """

    app = error_answers(Klein())

    def __init__(
        self, plane: ControlPlane | None, config_models: frozenset[str]
    ) -> None:
        self._plane = plane
        self._config_models = config_models

    def _pin(self, request: IRequest, name: str, pinned: bool) -> bytes:
        plane = need_plane(self._plane)
        model = plane.catalog.resolve(name)
        if model is None:
            raise not_found(f"model {name[:200]!r}")
        try:
            plane.pin(model, pinned)
        except KeyError:
            # Removed meanwhile by another request.
            raise not_found(f"model {name[:200]!r}") from None
        return json_answer(request, model_json(plane, self._config_models, model))

    @app.route("/api/v1/models/<path:name>/pin", methods=["POST"])
    def pin(self, request: IRequest, name: str) -> bytes:
        """
        Pin the model C{name} (or an alias): its replicas are never evicted
        to make room for another model, until unpinned or the server
        restarts (the catalog's C{pinned} is read again then).  The model
        as C{GET /api/v1/models} shows it; 404 C{not_found}.
        """
        return self._pin(request, name, True)

    @app.route("/api/v1/models/<path:name>/unpin", methods=["POST"])
    def unpin(self, request: IRequest, name: str) -> bytes:
        """
        Unpin the model C{name}: it may be evicted again (least recently
        used and lower C{priority} first).  As L{pin}.
        """
        return self._pin(request, name, False)

    @app.route("/api/v1/replicas/<replica_id>/sleep", methods=["POST"])
    def sleep_replica(self, request: IRequest, replica_id: str) -> bytes:
        """
        Put a ready replica to sleep at its profile's level (it takes no
        new requests and sleeps once its last one ends); its model wants
        one replica fewer, as after a scale-down.  The replica as C{GET
        /api/v1/replicas} shows it; 404 C{not_found}; 409 C{cannot_sleep}
        when its profile's C{sleep} is off, its engine refused sleep mode,
        its node's C{sleep_memory} is full, it is not ready, or its model
        would go below C{min_replicas} (the message says which).
        """
        return self._sleep_or_wake(request, replica_id, True)

    @app.route("/api/v1/replicas/<replica_id>/wake", methods=["POST"])
    def wake_replica(self, request: IRequest, replica_id: str) -> bytes:
        """
        Wake a sleeping replica where it sleeps; its model wants one
        replica more, idle from now.  As L{sleep_replica}, with 409
        C{cannot_wake} when it is not asleep, its model is at
        C{max_replicas} or its GPUs have no room.
        """
        return self._sleep_or_wake(request, replica_id, False)

    def _sleep_or_wake(self, request: IRequest, replica_id: str, sleep: bool) -> bytes:
        plane = need_plane(self._plane)
        try:
            if sleep:
                replica = plane.sleep_replica(replica_id)
            else:
                replica = plane.wake_replica(replica_id)
        except KeyError:
            raise not_found(f"replica {replica_id[:200]!r}") from None
        except SleepRefused as e:
            code = "cannot_sleep" if sleep else "cannot_wake"
            raise AdminError(409, str(e), code) from None
        return json_answer(request, replica_json(replica, plane.clock.seconds()))
