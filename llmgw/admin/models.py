"""
The admin API's model routes (docs/catalog.md): the catalog's models
listed, added at run time (kept in the store), removed, and scaled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from klein import Klein
from twisted.web.iweb import IRequest

from llmgw.admin.http import (
    AdminError,
    error_answers,
    json_answer,
    need_plane,
    not_found,
    read_body,
)
from llmgw.config_checks import ConfigError
from llmgw.control.catalog import parse_models
from llmgw.control.plane import ControlPlane
from llmgw.control.views import models_json
from llmgw.store.db import Store
from llmgw.tier.watch import Watch


def model_json(
    plane: ControlPlane, config_models: frozenset[str], name: str
) -> dict[str, Any]:
    """
    @param config_models: names of the config file's models.
    @return: the model C{name} as C{GET /api/v1/models} shows it.
    @raise AdminError: 404, no such model.
    """
    for model in models_json(plane):
        if model["name"] == name:
            model["runtime"] = name not in config_models
            return model
    raise not_found(f"model {name[:200]!r}")


def load_errors(
    model: dict[str, Any], refusals: list[dict[str, Any]], now: float
) -> None:
    """
    Show on an adapter's entry the loads its engines refused: under
    C{load_errors} each one (replica, refusals in a row, the engine's
    status and error, C{retry_at} POSIX seconds and C{retry_in} seconds
    until the load is tried again), and the first as its C{last_error}
    line, which C{llmgw ctl models} prints.

    @param model: the adapter's entry of C{GET /api/v1/models}, changed.
    @param refusals: L{llmgw.router.routing.adapters.AdapterLoads.refusals}.
    @param now: POSIX seconds.
    """
    shown = [
        {**r, "retry_in": max(0.0, round(r["retry_at"] - now, 1))} for r in refusals
    ]
    model["load_errors"] = shown
    if shown:
        first = shown[0]
        model["last_error"] = (
            f"replica {first['replica']} refused to load it"
            f" ({first['failures']} in a row): {first['status']} {first['error']};"
            f" tried again in {first['retry_in']}s"
        )


class ModelRoutes:
    """
    C{/api/v1/models}: list and add; C{/api/v1/models/<name>}: remove;
    C{/api/v1/models/<name>/scale}.

    @param plane: the control plane, when there is one.
    @param store: the database, where models added at run time are kept.
    @param config_models: names of the config file's models (not
        removable at run time).
    @param wall_clock: POSIX seconds now (C{time.time}), kept with a model.
    @param watch: what a router tier follows, told of each change, when
        there is a control plane.
    @param adapter_refusals: the loads of an adapter its engines refused,
        by name, from this server's router
        (L{llmgw.router.routing.adapters.AdapterLoads.refusals}); L{None}
        without one.
    """

    app = error_answers(Klein())

    def __init__(
        self,
        plane: ControlPlane | None,
        store: Store | None,
        config_models: frozenset[str],
        *,
        wall_clock: Callable[[], float],
        watch: Watch | None,
        adapter_refusals: Callable[[str], list[dict[str, Any]]] | None = None,
    ) -> None:
        self._adapter_refusals = adapter_refusals
        self._plane = plane
        self._store = store
        self._config_models = config_models
        self._wall_clock = wall_clock
        self._watch = watch

    @app.route("/api/v1/models", methods=["GET"])
    def models(self, request: IRequest) -> bytes:
        """
        C{{"models": [...]}}: each catalog model with C{desired} and
        C{ready} replica counts, and whether it was added at run time; an
        adapter with C{load_errors}, the loads its engines refused
        (L{load_errors}).
        """
        plane = self._plane
        models = models_json(plane) if plane is not None else []
        for model in models:
            model["runtime"] = model["name"] not in self._config_models
            if model.get("base") and self._adapter_refusals is not None:
                load_errors(
                    model, self._adapter_refusals(model["name"]), self._wall_clock()
                )
        return json_answer(request, {"models": models})

    @app.route("/api/v1/models", methods=["POST"])
    async def add_model(self, request: IRequest) -> bytes:
        """
        Add a model: the body is one C{[[models]]} table as JSON (name,
        aliases, min_replicas, max_replicas, idle_timeout, profiles).  It
        is stored, placed, and back after a restart.  201 with the model.
        """
        plane = need_plane(self._plane)
        store = self._store
        if store is None:
            raise AdminError(404, "no store in this server", "not_found")
        body = read_body(request)
        try:
            (model,) = parse_models([body], check_bases=False)
        except ConfigError as e:
            raise AdminError(400, str(e), "bad_model") from None
        try:
            plane.catalog.add(model)
        except ValueError as e:
            raise AdminError(409, str(e), "conflict") from None
        try:
            await store.put_model(model.name, json.dumps(body), self._wall_clock())
        except Exception:
            plane.catalog.remove(model.name)
            raise
        if self._watch is not None:
            self._watch.changed()
        return json_answer(
            request, model_json(plane, self._config_models, model.name), 201
        )

    @app.route("/api/v1/models/<path:name>", methods=["DELETE"])
    async def remove_model(self, request: IRequest, name: str) -> bytes:
        """
        Remove a model added at run time: its replicas drain and stop.
        """
        plane = need_plane(self._plane)
        name = plane.catalog.resolve(name) or name
        if plane.catalog.model(name) is None and plane.catalog.adapter(name) is None:
            raise not_found(f"model {name[:200]!r}")
        if name in self._config_models:
            raise AdminError(
                409,
                f"model {name!r} is declared in the config file: remove it there",
                "conflict",
            )
        uses = plane.catalog.adapters_of(name)
        if uses:
            raise AdminError(
                409,
                f"model {name!r} is the base of adapters"
                f" {', '.join(a.name for a in uses)}: remove them first",
                "conflict",
            )
        assert self._store is not None
        await self._store.delete_model(name)
        try:
            plane.catalog.remove(name)
        except KeyError:
            # Removed meanwhile by another request.
            raise not_found(f"model {name[:200]!r}") from None
        if self._watch is not None:
            self._watch.changed()
        return json_answer(request, {"removed": name})

    @app.route("/api/v1/models/<path:name>/scale", methods=["POST"])
    async def scale_model(self, request: IRequest, name: str) -> bytes:
        """
        Set C{min_replicas} and/or C{max_replicas}.  Kept across restarts
        for models added at run time; a config file model's bounds come
        back from the file at restart.
        """
        plane = need_plane(self._plane)
        name = plane.catalog.resolve(name) or name
        model = plane.catalog.model(name)
        if model is None:
            raise not_found(f"model {name[:200]!r}")
        body = read_body(request)
        low = body.get("min_replicas", model.min_replicas)
        high = body.get("max_replicas", model.max_replicas)
        for field, value in (("min_replicas", low), ("max_replicas", high)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise AdminError(
                    400, f"{field}: expected an integer, got {value!r}", "bad_request"
                )
        try:
            name = await self.set_scale(name, low, high)
        except KeyError:
            raise not_found(f"model {name[:200]!r}") from None
        except ValueError as e:
            raise AdminError(400, str(e), "bad_request") from None
        return json_answer(request, model_json(plane, self._config_models, name))

    async def set_scale(self, name: str, low: int, high: int) -> str:
        """
        Set a model's bounds, kept across restarts for a model added at
        run time (the dashboard's scale action calls this too).

        @return: the model's catalog name.
        @raise KeyError: no such model (or alias).
        @raise ValueError: bounds the plane refuses.
        @raise AdminError: 404, no control plane in this server.
        """
        plane = need_plane(self._plane)
        name = plane.catalog.resolve(name) or name
        if plane.catalog.model(name) is None:
            raise KeyError(name)
        plane.scale(name, low, high)
        if name not in self._config_models and self._store is not None:
            for stored, spec in await self._store.models():
                if stored == name:
                    table = json.loads(spec)
                    table.update(min_replicas=low, max_replicas=high)
                    await self._store.put_model(
                        name, json.dumps(table), self._wall_clock()
                    )
        return name
