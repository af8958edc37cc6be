"""
The admin API's routes for more models than GPUs (docs/catalog.md): a
model pinned (never evicted to make room for another) or unpinned.
"""

from __future__ import annotations

from typing import Any

from twisted.web.iweb import IRequest

from llmgw.admin.http import app, json_answer, not_found
from llmgw.control.plane import ControlPlane


class SwapRoutes:
    """
    Mixed into L{llmgw.admin.api.Admin}; needs its C{_plane} and
    C{_model_json}.
    """

    def _plane(self) -> ControlPlane:
        raise NotImplementedError()

    def _model_json(self, name: str) -> dict[str, Any]:
        raise NotImplementedError()

    def _pin(self, request: IRequest, name: str, pinned: bool) -> bytes:
        plane = self._plane()
        model = plane.catalog.resolve(name)
        if model is None:
            raise not_found(f"model {name[:200]!r}")
        try:
            plane.pin(model, pinned)
        except KeyError:
            # Removed meanwhile by another request.
            raise not_found(f"model {name[:200]!r}") from None
        return json_answer(request, self._model_json(model))

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
