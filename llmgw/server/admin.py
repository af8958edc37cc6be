"""
The admin listener (DESIGN.md section 6): metrics, liveness and the admin
API under C{/api/v1}, loopback-only by default; bound elsewhere, the API
wants an admin key.

Answers are JSON; errors C{{"error": {"message", "code"}}} with 400 (bad
body or parameter), 401 (admin key needed), 404, 409 (conflict).
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import sqlite3
import time
from typing import Any

from klein import Klein
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from werkzeug.exceptions import MethodNotAllowed, NotFound

from llmgw import __version__
from llmgw.config import ConfigError, parse_duration
from llmgw.control.catalog import parse_models
from llmgw.control.inventory import Inventory
from llmgw.control.plane import ControlPlane
from llmgw.router.auth import KeyRing
from llmgw.router.errors import APIError
from llmgw.store.db import Store
from llmgw.store.usage import StoreUsageSink


class AdminError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def _json(request: IRequest, value: object, status: int = 200) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(value).encode("utf-8")


def _not_found(what: str) -> AdminError:
    return AdminError(404, f"no {what}", "not_found")


def _body(request: IRequest) -> dict[str, Any]:
    content = request.content
    raw = content.read() if content is not None else b""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise AdminError(400, "the body is not valid JSON", "bad_request") from None
    if not isinstance(body, dict):
        raise AdminError(400, "the body must be a JSON object", "bad_request")
    return body


_MAX_LIMIT = 2**53


def _optional_count(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= _MAX_LIMIT
    ):
        raise AdminError(
            400,
            f"{name}: expected an integer from 1 to {_MAX_LIMIT}, got {value!r}"[:300],
            "bad_request",
        )
    return value


_ISO = re.compile(r"^\d{4}-\d\d-\d\d")


def parse_since(value: str, now: float) -> float:
    """
    @param value: a duration back from now (C{"24h"}, C{"30m"}), an ISO
        8601 time, or POSIX seconds.
    @return: POSIX seconds.
    @raise AdminError: none of those.
    """
    try:
        return now - parse_duration("since", value)
    except ConfigError:
        pass
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds):
            return seconds
    if _ISO.match(value):
        import datetime

        try:
            parsed = datetime.datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=datetime.UTC)
            return parsed.timestamp()
    raise AdminError(
        400,
        f"bad time {value!r}: use a duration back from now (24h, 30m),"
        " an ISO 8601 time or POSIX seconds",
        "bad_request",
    )


class Admin:
    """
    The admin API.

    @param registry: the metrics served on C{/metrics}.
    @param plane: the control plane, when there is one.
    @param keys: the API keys, when there is a store.
    @param store: the database.
    @param usage: the usage sink, flushed before usage is read.
    @param config_models: names of the config file's models (not
        removable at run time).
    """

    app = Klein()
    log = Logger()

    def __init__(
        self,
        registry: CollectorRegistry,
        inventory: Inventory,
        plane: ControlPlane | None = None,
        keys: KeyRing | None = None,
        store: Store | None = None,
        usage: StoreUsageSink | None = None,
        config_models: frozenset[str] = frozenset(),
    ) -> None:
        self.registry = registry
        self.inventory = inventory
        self.plane = plane
        self.keys = keys
        self.store = store
        self.usage = usage
        self.config_models = config_models
        self.started = time.time()

    @app.handle_errors(AdminError)
    def _admin_error(self, request: IRequest, failure: Any) -> bytes:
        error: AdminError = failure.value
        return _json(
            request,
            {"error": {"message": error.message, "code": error.code}},
            error.status,
        )

    @app.handle_errors(NotFound)
    def _no_path(self, request: IRequest, failure: Any) -> bytes:
        path = request.path.decode("utf-8", "replace")[:200]
        return _json(
            request, {"error": {"message": f"no path {path}", "code": "not_found"}}, 404
        )

    @app.handle_errors(MethodNotAllowed)
    def _no_method(self, request: IRequest, failure: Any) -> bytes:
        allowed = getattr(failure.value, "valid_methods", None) or []
        if allowed:
            request.setHeader(b"allow", ", ".join(allowed).encode("ascii"))
        method = request.method.decode("ascii", "replace")
        return _json(
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

    def _keys(self) -> KeyRing:
        if self.keys is None or self.store is None:
            raise AdminError(404, "no store in this server", "not_found")
        return self.keys

    # Status

    @app.route("/api/v1/status", methods=["GET"])
    def status(self, request: IRequest) -> bytes:
        """
        Version, uptime (seconds), node and replica counts by state,
        catalog size, key count and whether clients need a key.
        """
        nodes: dict[str, int] = {}
        for node in self.inventory.nodes():
            nodes[node.state] = nodes.get(node.state, 0) + 1
        replicas: dict[str, int] = {}
        models = 0
        if self.plane is not None:
            for replica in self.plane.replicas.values():
                replicas[replica.state] = replicas.get(replica.state, 0) + 1
            models = len(self.plane.models_json())
        return _json(
            request,
            {
                "version": __version__,
                "uptime_seconds": round(time.time() - self.started, 1),
                "nodes": nodes,
                "replicas": replicas,
                "models": models,
                "keys": sum(1 for k in self.keys.keys() if k.revoked is None)
                if self.keys is not None
                else 0,
                "static_endpoints": len(self.plane.static_endpoints())
                if self.plane is not None
                else 0,
                "auth_required": bool(self.keys is not None and self.keys.required),
            },
        )

    # Fleet

    @app.route("/api/v1/nodes", methods=["GET"])
    def nodes(self, request: IRequest) -> bytes:
        """
        C{{"nodes": [...]}}, each node as L{Node.to_json} gives it.
        """
        nodes = [node.to_json() for node in self.inventory.nodes()]
        if self.plane is not None:
            # The control plane's records are current; the Register's
            # list is as of the agent's last connection.
            shards: dict[str, list[dict[str, Any]]] = {}
            for replica in self.plane.replicas.values():
                for shard in replica.shards:
                    shards.setdefault(shard.node, []).append(
                        {
                            **shard.to_json(),
                            "model": replica.model,
                            "replica": replica.id,
                        }
                    )
            for node in nodes:
                node["shards"] = shards.get(node["id"], [])
        return _json(request, {"nodes": nodes})

    @app.route("/api/v1/replicas", methods=["GET"])
    def replicas(self, request: IRequest) -> bytes:
        """
        C{{"replicas": [...]}}: id, model, profile, engine, state, adopted,
        shards (id, node, gpus, port, rank, state, pid, last_error).
        """
        replicas = self.plane.replicas.values() if self.plane is not None else ()
        ordered = sorted(replicas, key=lambda r: (r.model, r.id))
        return _json(request, {"replicas": [r.to_json() for r in ordered]})

    @app.route("/api/v1/placement/<path:model>", methods=["GET"])
    def placement(self, request: IRequest, model: str) -> bytes:
        """
        Where a replica of C{model} would be placed now, or C{reasons}: one
        line per profile and node saying why not.
        """
        plane = self._plane()
        if plane.resolve(model) is None:
            raise _not_found(f"model {model[:200]!r} in the catalog")
        return _json(request, plane.explain(model))

    @app.route("/api/v1/nodes/<node_id>/drain", methods=["POST"])
    def drain_node(self, request: IRequest, node_id: str) -> bytes:
        """
        Drain a node: no new placements on it; its replicas stop taking
        requests, finish those in flight (up to C{[control]
        drain_timeout}), then stop, and are placed elsewhere.
        """
        try:
            drained = self._plane().drain_node(node_id)
        except KeyError:
            raise _not_found(f"node {node_id[:200]!r}") from None
        return _json(request, {"node": node_id, "draining_replicas": drained})

    @app.route("/api/v1/nodes/<node_id>/undrain", methods=["POST"])
    def undrain_node(self, request: IRequest, node_id: str) -> bytes:
        """
        Take a node back: placements may use it again (replicas already
        moved stay where they are).
        """
        node = self.inventory.get(node_id)
        if node is None:
            raise _not_found(f"node {node_id[:200]!r}")
        node.draining = False
        node.version += 1
        self._plane().loop.kick()
        return _json(request, {"node": node_id, "draining": False})

    @app.route("/api/v1/replicas/<replica_id>/drain", methods=["POST"])
    def drain_replica(self, request: IRequest, replica_id: str) -> bytes:
        """
        Drain one replica; its model gets another if it needs one.
        """
        try:
            started = self._plane().drain_replica(replica_id)
        except KeyError:
            raise _not_found(f"replica {replica_id[:200]!r}") from None
        return _json(
            request,
            {"replica": replica_id, "draining": True, "was_draining": not started},
        )

    # Models

    @app.route("/api/v1/models", methods=["GET"])
    def models(self, request: IRequest) -> bytes:
        """
        C{{"models": [...]}}: each catalog model with C{desired} and
        C{ready} replica counts, and whether it was added at run time.
        """
        plane = self.plane
        models = plane.models_json() if plane is not None else []
        for model in models:
            model["runtime"] = model["name"] not in self.config_models
        return _json(request, {"models": models})

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
        body = _body(request)
        try:
            (model,) = parse_models([body])
        except ConfigError as e:
            raise AdminError(400, str(e), "bad_model") from None
        try:
            plane.add_model(model)
        except ValueError as e:
            raise AdminError(409, str(e), "conflict") from None
        try:
            await self.store.put_model(model.name, json.dumps(body), time.time())
        except Exception:
            plane.remove_model(model.name)
            raise
        return _json(request, self._model_json(model.name), 201)

    def _model_json(self, name: str) -> dict[str, Any]:
        plane = self._plane()
        for model in plane.models_json():
            if model["name"] == name:
                model["runtime"] = name not in self.config_models
                return model
        raise _not_found(f"model {name[:200]!r}")

    @app.route("/api/v1/models/<path:name>", methods=["DELETE"])
    async def remove_model(self, request: IRequest, name: str) -> bytes:
        """
        Remove a model added at run time: its replicas drain and stop.
        """
        plane = self._plane()
        name = plane.resolve(name) or name
        if plane.model(name) is None:
            raise _not_found(f"model {name[:200]!r}")
        if name in self.config_models:
            raise AdminError(
                409,
                f"model {name!r} is declared in the config file: remove it there",
                "conflict",
            )
        assert self.store is not None
        await self.store.delete_model(name)
        try:
            plane.remove_model(name)
        except KeyError:
            # Removed meanwhile by another request.
            raise _not_found(f"model {name[:200]!r}") from None
        return _json(request, {"removed": name})

    @app.route("/api/v1/models/<path:name>/scale", methods=["POST"])
    async def scale_model(self, request: IRequest, name: str) -> bytes:
        """
        Set C{min_replicas} and/or C{max_replicas}.  Kept across restarts
        for models added at run time; a config file model's bounds come
        back from the file at restart.
        """
        plane = self._plane()
        name = plane.resolve(name) or name
        model = plane.model(name)
        if model is None:
            raise _not_found(f"model {name[:200]!r}")
        body = _body(request)
        low = body.get("min_replicas", model.min_replicas)
        high = body.get("max_replicas", model.max_replicas)
        for field, value in (("min_replicas", low), ("max_replicas", high)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise AdminError(
                    400, f"{field}: expected an integer, got {value!r}", "bad_request"
                )
        try:
            plane.scale(name, low, high)
        except ValueError as e:
            raise AdminError(400, str(e), "bad_request") from None
        if name not in self.config_models and self.store is not None:
            for stored, spec in await self.store.models():
                if stored == name:
                    table = json.loads(spec)
                    table.update(min_replicas=low, max_replicas=high)
                    await self.store.put_model(name, json.dumps(table), time.time())
        return _json(request, self._model_json(name))

    # Keys

    @app.route("/api/v1/keys", methods=["GET"])
    def list_keys(self, request: IRequest) -> bytes:
        """
        C{{"keys": [...]}}: name, prefix, limits, created, last used,
        tokens used, revoked; never the key.
        """
        return _json(request, {"keys": [k.to_json() for k in self._keys().keys()]})

    @app.route("/api/v1/keys", methods=["POST"])
    async def create_key(self, request: IRequest) -> bytes:
        """
        Make a key: C{{"name", "models"?, "rpm"?, "tpm"?,
        "budget_tokens"?, "admin"?}}.  201 with the key under C{"key"}:
        the only time it is shown.
        """
        keys = self._keys()
        body = _body(request)
        name = body.get("name")
        if not isinstance(name, str):
            raise AdminError(400, "name: expected a string", "bad_request")
        models = body.get("models")
        if models is not None and (
            not isinstance(models, list)
            or not models
            or not all(isinstance(m, str) and m for m in models)
        ):
            raise AdminError(
                400, f"models: expected a list of names, got {models!r}", "bad_request"
            )
        admin = body.get("admin", False)
        if not isinstance(admin, bool):
            raise AdminError(400, "admin: expected true or false", "bad_request")
        try:
            key, secret = await keys.create(
                name,
                models=models,
                rpm=_optional_count(body, "rpm"),
                tpm=_optional_count(body, "tpm"),
                budget_tokens=_optional_count(body, "budget_tokens"),
                admin=admin,
            )
        except ValueError as e:
            raise AdminError(
                409 if "exists" in str(e) else 400, str(e), "bad_key"
            ) from None
        except sqlite3.IntegrityError:
            raise AdminError(409, f"a key named {name!r} exists", "conflict") from None
        return _json(request, {**key.to_json(), "key": secret}, 201)

    @app.route("/api/v1/keys/<name>", methods=["DELETE"])
    @app.route("/api/v1/keys/<name>/revoke", methods=["POST"])
    async def revoke_key(self, request: IRequest, name: str) -> bytes:
        """
        Revoke a key, by name or prefix: it stops working at once.
        """
        keys = self._keys()
        key = keys.find(name)
        if key is None:
            raise _not_found(f"key {name[:200]!r}")
        if key.revoked is None:
            await keys.revoke(key)
        return _json(request, key.to_json())

    # Usage

    @app.route("/api/v1/usage", methods=["GET"])
    async def get_usage(self, request: IRequest) -> bytes:
        """
        Usage grouped by C{by} (C{key} or C{model}, default key) from
        C{since} (default 24h) to C{until} (default now): requests,
        errors, prompt and completion tokens, mean latency and time to
        first token, per group.
        """
        if self.store is None:
            raise AdminError(404, "no store in this server", "not_found")
        args = request.args or {}

        def arg(name: bytes, default: str) -> str:
            values = args.get(name)
            return values[0].decode("utf-8", "replace") if values else default

        by = arg(b"by", "key")
        if by not in ("key", "model"):
            raise AdminError(
                400, f"by: expected key or model, got {by!r}", "bad_request"
            )
        now = time.time()
        since = parse_since(arg(b"since", "24h"), now)
        until_text = arg(b"until", "")
        until = parse_since(until_text, now) if until_text else None
        if until is not None and until <= since:
            raise AdminError(400, "until: must be after since", "bad_request")
        if self.usage is not None:
            # Records still buffered count too.
            await self.usage.flush()
        groups = await self.store.usage(by, since, until)
        return _json(
            request,
            {
                "by": by,
                "since": since,
                "until": until if until is not None else now,
                "usage": groups,
            },
        )

    # Weights

    @app.route("/api/v1/weights", methods=["GET"])
    def weights(self, request: IRequest) -> bytes:
        """
        Per node: the model files its agent reported (path, size_bytes,
        last_used), when, and which of them nothing uses.
        """
        plane = self.plane
        nodes = []
        for node in self.inventory.nodes():
            unused = {e["path"] for e in plane.unused_weights(node)} if plane else set()
            nodes.append(
                {
                    "node": node.id,
                    "reported_at": node.weights_at,
                    "files": [
                        {**e, "unused": e["path"] in unused} for e in node.weights
                    ],
                }
            )
        return _json(request, {"nodes": nodes})

    @app.route("/api/v1/weights/collect", methods=["POST"])
    async def collect(self, request: IRequest) -> bytes:
        """
        Delete the files no catalog model and no replica uses, through
        the agents; C{{"dry_run": true}} only lists them.
        """
        body = _body(request)
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise AdminError(400, "dry_run: expected true or false", "bad_request")
        results = await self._plane().collect_weights(dry_run)
        return _json(request, {"dry_run": dry_run, "nodes": results})

    @app.route("/api/v1/nodes/<node_id>/weights/remove", methods=["POST"])
    async def remove_weights(self, request: IRequest, node_id: str) -> bytes:
        """
        Ask a node's agent to delete C{{"paths": [...]}}; it refuses paths
        outside its weights directories (symlinks resolved) and those a
        running engine uses.  409 with the agent's reason when refused.
        """
        plane = self._plane()
        if self.inventory.get(node_id) is None:
            raise _not_found(f"node {node_id[:200]!r}")
        paths = _body(request).get("paths")
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
            user = plane.weights_user(path)
            if user is not None:
                raise AdminError(
                    409, f"path {path[:200]!r} is used by {user!r}", "in_use"
                )
        result = await plane.remove_weights(node_id, paths)
        if result["error"]:
            raise AdminError(409, result["error"], "refused")
        return _json(request, {"node": node_id, "removed": paths})

    @app.handle_errors(Exception)
    def _failed(self, request: IRequest, failure: Any) -> bytes:
        # Last: the handlers above take what they know first.
        self.log.failure("admin API: {path}", failure, path=request.path[:200])
        return _json(
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


def is_loopback(host: str, otherwise: bool) -> bool:
    """
    @param host: an address as Twisted gives it.
    @param otherwise: the answer when C{host} is not an IP address (a UNIX
        socket's path, or nothing).
    @return: whether C{host} is a loopback address.
    """
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return otherwise


class AdminGuard(Resource):
    """
    The admin API behind an admin key, while C{enabled}: for an admin
    listener that is not on loopback.  Requests from this machine (a
    loopback peer) need none, so the first admin key can be made there;
    C{/metrics} and C{/healthz} stay open.

    @param inner: the admin app's resource.
    @param keys: where admin keys are found.
    @ivar enabled: set once the listener's address is known (on by
        default: closed until then).
    """

    isLeaf = True

    def __init__(self, inner: Resource, keys: KeyRing) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._inner = inner
        self._keys = keys
        self.enabled = True

    def render(self, request: IRequest) -> Any:
        peer = getattr(request.getClientAddress(), "host", "")
        # Decided on the segments routing uses (percent-decoded: /%61pi/
        # is /api/), and closed unless plainly open.
        segments = getattr(request, "postpath", None) or []
        open_path = segments in ([b"metrics"], [b"healthz"])
        if self.enabled and not open_path and not is_loopback(peer, False):
            try:
                key = self._keys.authenticate(
                    request.getHeader(b"authorization") or b""
                )
            except APIError as error:
                return _json(
                    request,
                    {"error": {"message": error.message, "code": "unauthorized"}},
                    401,
                )
            if key is None or not key.admin:
                return _json(
                    request,
                    {
                        "error": {
                            "message": "an admin key is needed",
                            "code": "unauthorized",
                        }
                    },
                    401,
                )
        return self._inner.render(request)
