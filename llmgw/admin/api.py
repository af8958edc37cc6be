"""
The admin listener (docs/catalog.md, docs/keys.md): metrics, liveness and the admin
API under C{/api/v1}, loopback-only by default; bound elsewhere, the API
wants an admin key.

Answers are JSON; errors C{{"error": {"message", "code"}}} with 400 (bad
body or parameter), 401 (admin key needed), 404, 409 (conflict; a drain
refused adds C{"models"}, those it would leave below C{min_replicas}).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from werkzeug.exceptions import MethodNotAllowed, NotFound

from llmgw import __version__
from llmgw.admin.drains import DrainRoutes
from llmgw.admin.http import AdminError, json_answer, not_found, read_body
from llmgw.admin.http import app as admin_app
from llmgw.admin.keys import KeyRoutes
from llmgw.admin.swaps import SwapRoutes
from llmgw.admin.watch import WatchRoutes
from llmgw.config_checks import ConfigError
from llmgw.control.catalog import parse_models
from llmgw.control.inventory import Inventory
from llmgw.control.plane import ControlPlane
from llmgw.control.views import (
    count_states,
    explain,
    models_json,
    nodes_json,
    replicas_json,
)
from llmgw.router.accounting.auth import KeyRing
from llmgw.store.db import Store
from llmgw.store.usage import UsageWriter
from llmgw.tier.watch import Watch

__all__ = ["Admin", "AdminError"]


def _placement_state(plane: ControlPlane | None) -> dict[str, Any] | None:
    """
    @return: what holds placements back, as C{GET /api/v1/status} says it.
    """
    if plane is None:
        return None
    grace = plane.settings.startup_grace
    left = plane.started + grace - plane.clock.seconds()
    if plane.grace_over or left <= 0:
        # Over, or over at the next pass (which ends it).
        return {"waiting_for": None}
    return {
        "waiting_for": "startup_grace",
        "seconds_left": round(left, 1),
        "startup_grace": grace,
    }


class Admin(KeyRoutes, WatchRoutes, DrainRoutes, SwapRoutes):
    """
    The admin API.  The keys and usage routes are in L{KeyRoutes}, the
    drains and engine stops in L{DrainRoutes}.  The API
    reads the control plane's views (L{llmgw.control.views}) and calls its
    methods; it changes no record itself.

    @param registry: the metrics served on C{/metrics}.
    @param plane: the control plane, when there is one.
    @param keys: the API keys, when there is a store.
    @param store: the database.
    @param usage: the usage writer, flushed before usage is read.
    @param config_models: names of the config file's models (not
        removable at run time).
    @param wall_clock: POSIX seconds now (C{time.time}).
    @param watch: what a router tier follows, when there is a control
        plane.
    @param standby: with standbys (L{llmgw.server.standby}), whether this
        server leads and the leader's agent address; L{None} alone.
    """

    app = admin_app
    log = Logger()

    def __init__(
        self,
        registry: CollectorRegistry,
        inventory: Inventory,
        plane: ControlPlane | None = None,
        keys: KeyRing | None = None,
        store: Store | None = None,
        usage: UsageWriter | None = None,
        config_models: frozenset[str] = frozenset(),
        *,
        wall_clock: Callable[[], float],
        watch: Watch | None = None,
        standby: Callable[[], dict[str, object]] | None = None,
    ) -> None:
        self.watch = watch
        self.registry = registry
        self.inventory = inventory
        self.plane = plane
        self.keys = keys
        self.store = store
        self.usage = usage
        self.config_models = config_models
        self.wall_clock = wall_clock
        self.started = wall_clock()
        self.standby = standby

    @app.handle_errors(AdminError)
    def _admin_error(self, request: IRequest, failure: Any) -> bytes:
        error: AdminError = failure.value
        body: dict[str, str] = {"message": error.message, "code": error.code}
        leader = getattr(error, "leader", None)  # A standby's (admin_watch).
        if leader is not None:
            body["leader"] = leader
        models = getattr(error, "models", None)  # A drain refused.
        answer: dict[str, Any] = dict(body, models=models) if models else body
        return json_answer(request, {"error": answer}, error.status)

    @app.handle_errors(NotFound)
    def _no_path(self, request: IRequest, failure: Any) -> bytes:
        path = request.path.decode("utf-8", "replace")[:200]
        return json_answer(
            request, {"error": {"message": f"no path {path}", "code": "not_found"}}, 404
        )

    @app.handle_errors(MethodNotAllowed)
    def _no_method(self, request: IRequest, failure: Any) -> bytes:
        allowed = getattr(failure.value, "valid_methods", None) or []
        if allowed:
            request.setHeader(b"allow", ", ".join(allowed).encode("ascii"))
        method = request.method.decode("ascii", "replace")
        return json_answer(
            request,
            {
                "error": {
                    "message": f"{method} is not allowed here",
                    "code": "bad_method",
                }
            },
            405,
        )

    def _plane(self) -> ControlPlane:
        if self.plane is None:
            raise AdminError(404, "no control plane in this server", "not_found")
        return self.plane

    # Status

    @app.route("/api/v1/status", methods=["GET"])
    def status(self, request: IRequest) -> bytes:
        """
        Version, uptime (seconds), node and replica counts by state,
        catalog size, key count, whether clients need a key, with
        standbys C{{"leading": bool, "leader": "HOST:PORT"}} (else null),
        and C{placement}: C{{"waiting_for": "startup_grace",
        "seconds_left": S, "startup_grace": S}} while the start-up grace
        holds every placement and scale-down back (C{[control]
        startup_grace}, from the start or from taking the lead), else
        C{{"waiting_for": null}}; null without a control plane.
        """
        plane = self.plane
        nodes = count_states(n.state for n in self.inventory.nodes())
        replicas = count_states(
            r.state for r in (plane.replicas.values() if plane is not None else ())
        )
        models = len(plane.catalog.states()) if plane is not None else 0
        return json_answer(
            request,
            {
                "version": __version__,
                "uptime_seconds": round(self.wall_clock() - self.started, 1),
                "nodes": nodes,
                "replicas": replicas,
                "models": models,
                "keys": sum(1 for k in self.keys.keys() if k.revoked is None)
                if self.keys is not None
                else 0,
                "static_endpoints": len(plane.catalog.static_endpoints())
                if plane is not None
                else 0,
                "auth_required": bool(self.keys is not None and self.keys.required),
                "standby": self.standby() if self.standby is not None else None,
                "placement": _placement_state(plane),
            },
        )

    # Fleet

    @app.route("/api/v1/nodes", methods=["GET"])
    def nodes(self, request: IRequest) -> bytes:
        """
        C{{"nodes": [...]}}, each node as L{Node.to_json} gives it.
        """
        nodes = nodes_json(self.inventory, self.plane)
        return json_answer(request, {"nodes": nodes})

    @app.route("/api/v1/replicas", methods=["GET"])
    def replicas(self, request: IRequest) -> bytes:
        """
        C{{"replicas": [...]}}: id, model, profile, engine, state, adopted,
        shards (id, node, gpus, port, rank, state, pid, last_error).
        """
        return json_answer(request, {"replicas": replicas_json(self.plane)})

    @app.route("/api/v1/placement/<path:model>", methods=["GET"])
    def placement(self, request: IRequest, model: str) -> bytes:
        """
        Where a replica of C{model} would be placed now, or C{reasons}: one
        line per profile and node saying why not.
        """
        plane = self._plane()
        if plane.catalog.resolve(model) is None:
            raise not_found(f"model {model[:200]!r} in the catalog")
        return json_answer(request, explain(plane, model))

    # Models

    @app.route("/api/v1/models", methods=["GET"])
    def models(self, request: IRequest) -> bytes:
        """
        C{{"models": [...]}}: each catalog model with C{desired} and
        C{ready} replica counts, and whether it was added at run time.
        """
        plane = self.plane
        models = models_json(plane) if plane is not None else []
        for model in models:
            model["runtime"] = model["name"] not in self.config_models
        return json_answer(request, {"models": models})

    @app.route("/api/v1/models", methods=["POST"])
    async def add_model(self, request: IRequest) -> bytes:
        """
        Add a model: the body is one C{[[models]]} table as JSON (name,
        aliases, min_replicas, max_replicas, idle_timeout, profiles).  It
        is stored, placed, and back after a restart.  201 with the model.
        """
        plane = self._plane()
        if self.store is None:
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
            await self.store.put_model(model.name, json.dumps(body), self.wall_clock())
        except Exception:
            plane.catalog.remove(model.name)
            raise
        if self.watch is not None:
            self.watch.changed()
        return json_answer(request, self._model_json(model.name), 201)

    def _model_json(self, name: str) -> dict[str, Any]:
        plane = self._plane()
        for model in models_json(plane):
            if model["name"] == name:
                model["runtime"] = name not in self.config_models
                return model
        raise not_found(f"model {name[:200]!r}")

    @app.route("/api/v1/models/<path:name>", methods=["DELETE"])
    async def remove_model(self, request: IRequest, name: str) -> bytes:
        """
        Remove a model added at run time: its replicas drain and stop.
        """
        plane = self._plane()
        name = plane.catalog.resolve(name) or name
        if plane.catalog.model(name) is None and plane.catalog.adapter(name) is None:
            raise not_found(f"model {name[:200]!r}")
        if name in self.config_models:
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
        assert self.store is not None
        await self.store.delete_model(name)
        try:
            plane.catalog.remove(name)
        except KeyError:
            # Removed meanwhile by another request.
            raise not_found(f"model {name[:200]!r}") from None
        if self.watch is not None:
            self.watch.changed()
        return json_answer(request, {"removed": name})

    @app.route("/api/v1/models/<path:name>/scale", methods=["POST"])
    async def scale_model(self, request: IRequest, name: str) -> bytes:
        """
        Set C{min_replicas} and/or C{max_replicas}.  Kept across restarts
        for models added at run time; a config file model's bounds come
        back from the file at restart.
        """
        plane = self._plane()
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
        return json_answer(request, self._model_json(name))

    async def set_scale(self, name: str, low: int, high: int) -> str:
        """
        Set a model's bounds, kept across restarts for a model added at
        run time (the dashboard's scale action calls this too).

        @return: the model's catalog name.
        @raise KeyError: no such model (or alias).
        @raise ValueError: bounds the plane refuses.
        """
        plane = self._plane()
        name = plane.catalog.resolve(name) or name
        if plane.catalog.model(name) is None:
            raise KeyError(name)
        plane.scale(name, low, high)
        if name not in self.config_models and self.store is not None:
            for stored, spec in await self.store.models():
                if stored == name:
                    table = json.loads(spec)
                    table.update(min_replicas=low, max_replicas=high)
                    await self.store.put_model(
                        name, json.dumps(table), self.wall_clock()
                    )
        return name

    # Weights

    @app.route("/api/v1/weights", methods=["GET"])
    def weights(self, request: IRequest) -> bytes:
        """
        Per node: the model files its agent reported (path, size_bytes,
        last_used), when, which of them nothing uses, how many it found
        (C{total}) and whether the list leaves some out (C{truncated}: more
        than one frame or the inventory holds).
        """
        plane = self.plane
        nodes = []
        for node in self.inventory.nodes():
            unused = {e["path"] for e in plane.weights.unused(node)} if plane else set()
            nodes.append(
                {
                    "node": node.id,
                    "reported_at": node.weights_at,
                    "total": node.weights_total,
                    "truncated": node.weights_truncated,
                    "files": [
                        {**e, "unused": e["path"] in unused} for e in node.weights
                    ],
                }
            )
        return json_answer(request, {"nodes": nodes})

    @app.route("/api/v1/weights/collect", methods=["POST"])
    async def collect(self, request: IRequest) -> bytes:
        """
        Delete the files no catalog model and no replica uses, through
        the agents; C{{"dry_run": true}} only lists them.  A node whose
        list is truncated is left alone (its C{error} says why).
        """
        body = read_body(request)
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise AdminError(400, "dry_run: expected true or false", "bad_request")
        results = await self._plane().weights.collect(dry_run)
        return json_answer(request, {"dry_run": dry_run, "nodes": results})

    @app.route("/api/v1/nodes/<node_id>/weights/remove", methods=["POST"])
    async def remove_weights(self, request: IRequest, node_id: str) -> bytes:
        """
        Ask a node's agent to delete C{{"paths": [...]}}; it refuses paths
        outside its weights directories (symlinks resolved) and those a
        running engine uses.  409 with the agent's reason when refused.
        """
        plane = self._plane()
        if self.inventory.get(node_id) is None:
            raise not_found(f"node {node_id[:200]!r}")
        paths = read_body(request).get("paths")
        if (
            not isinstance(paths, list)
            or not paths
            or not all(isinstance(p, str) for p in paths)
        ):
            raise AdminError(400, "paths: expected a list of paths", "bad_request")
        for path in paths:
            if not path.startswith("/"):
                raise AdminError(
                    400,
                    f"path {path[:200]!r}: expected an absolute path",
                    "bad_request",
                )
            user = plane.weights.user(path)
            if user is not None:
                raise AdminError(
                    409, f"path {path[:200]!r} is used by {user!r}", "in_use"
                )
        result = await plane.weights.remove(node_id, paths)
        if result["error"]:
            raise AdminError(409, result["error"], "refused")
        return json_answer(request, {"node": node_id, "removed": paths})

    @app.handle_errors(Exception)
    def _failed(self, request: IRequest, failure: Any) -> bytes:
        # Last: the handlers above take what they know first.
        self.log.failure("admin API: {path}", failure, path=request.path[:200])
        return json_answer(
            request,
            {
                "error": {
                    "message": "internal error; see the server log",
                    "code": "internal",
                }
            },
            500,
        )

    # Metrics and liveness

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode("ascii"))
        return generate_latest(self.registry)

    @app.route("/healthz", methods=["GET"])
    def healthz(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return b'{"status":"ok"}'
