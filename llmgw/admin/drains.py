"""
The admin API's drain routes (docs/catalog.md, "Drains"; docs/agents.md,
"Stopping engines"): a node or a replica drained (replaced first, refused
when it would leave a model below its C{min_replicas}; forced, at once),
a node undrained, and engines stopped or started again on purpose.
"""

from __future__ import annotations

from collections.abc import Callable

from klein import Klein
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from llmgw.admin.http import (
    AdminError,
    error_answers,
    json_answer,
    need_plane,
    not_found,
    read_body,
)
from llmgw.control.drains import DrainRefused
from llmgw.control.inventory import Inventory
from llmgw.control.plane import ControlPlane
from llmgw.store.db import Store


class DrainRoutes:
    """
    C{/api/v1/nodes/<node>/drain} and C{undrain},
    C{/api/v1/replicas/<replica>/drain}, and the C{stop-engines} and
    C{start-engines} of one node or all.

    @param plane: the control plane, when there is one.
    @param inventory: the nodes.
    @param store: the database, where drains are kept, when there is one.
    @param wall_clock: POSIX seconds now (C{time.time}), kept with a drain.
    """

    app = error_answers(Klein())
    log = Logger()

    def __init__(
        self,
        plane: ControlPlane | None,
        inventory: Inventory,
        store: Store | None,
        *,
        wall_clock: Callable[[], float],
    ) -> None:
        self._plane = plane
        self._inventory = inventory
        self._store = store
        self._wall_clock = wall_clock

    @app.route("/api/v1/nodes/<node_id>/drain", methods=["POST"])
    async def drain_node(self, request: IRequest, node_id: str) -> bytes:
        """
        Drain a node: no new placements on it; each of its replicas is
        replaced elsewhere first and drains once its replacement is ready
        (where there is no room for one, at once): it stops taking
        requests, finishes those in flight (up to C{[control]
        drain_timeout}), then stops.  C{{"draining_replicas": [...]}}
        lists them all, C{"replaced_first"} those waiting for a
        replacement.  409 C{below_min_replicas}, naming the C{models},
        when a model would be left below its C{min_replicas} with no
        room for a replacement.  C{{"force": true}}: every replica drains
        at once, unchecked, and is replaced once gone (the drain of old).
        Kept in the store, when there is one: drained again after a
        restart.  503 C{store_busy} when the store refused the write (the
        node is draining, until this server restarts).
        """
        force = _force(request)
        plane = need_plane(self._plane)
        try:
            drained = plane.drain_node(node_id, force)
        except KeyError:
            raise not_found(f"node {node_id[:200]!r}") from None
        except DrainRefused as e:
            raise RefusedError(e) from None
        await self._kept(await self.keep_drain(node_id, True))
        first = [r for r in drained if _leaving(plane, r)]
        return json_answer(
            request,
            {"node": node_id, "draining_replicas": drained, "replaced_first": first},
        )

    @app.route("/api/v1/nodes/<node_id>/undrain", methods=["POST"])
    async def undrain_node(self, request: IRequest, node_id: str) -> bytes:
        """
        Take a node back: placements may use it again (replicas already
        moved stay where they are); forgotten by the store.  503
        C{store_busy} as for a drain.
        """
        try:
            need_plane(self._plane).undrain_node(node_id)
        except KeyError:
            raise not_found(f"node {node_id[:200]!r}") from None
        await self._kept(await self.keep_drain(node_id, False))
        return json_answer(request, {"node": node_id, "draining": False})

    async def keep_drain(self, node_id: str, draining: bool) -> bool:
        """
        Write a node's drain (or its end) to the store, when there is one:
        a restarted server drains it again.

        @return: whether the store kept it (L{False}: it refused, logged).
        """
        store = self._store
        if store is None:
            return True
        try:
            if draining:
                await store.set_drain(node_id, self._wall_clock())
            else:
                await store.clear_drain(node_id)
        except store.database_errors as e:
            self.log.warn(
                "node {node}: the store cannot keep its drain now: {error}",
                node=node_id,
                error=e,
            )
            return False
        return True

    async def _kept(self, kept: bool) -> None:
        """
        @raise AdminError: 503 C{store_busy} when the store refused.
        """
        if not kept:
            raise AdminError(
                503,
                "done in this server, but the store cannot keep it now; try again",
                "store_busy",
            )

    @app.route("/api/v1/replicas/<replica_id>/drain", methods=["POST"])
    def drain_replica(self, request: IRequest, replica_id: str) -> bytes:
        """
        Drain one replica: it is replaced first (C{"replaced_first":
        true}) and drains once its replacement is ready, or at once where
        there is no room for one.  409 C{below_min_replicas} as for a
        node; C{{"force": true}} drains it at once, unchecked.
        """
        force = _force(request)
        plane = need_plane(self._plane)
        try:
            started = plane.drain_replica(replica_id, force)
        except KeyError:
            raise not_found(f"replica {replica_id[:200]!r}") from None
        except DrainRefused as e:
            raise RefusedError(e) from None
        return json_answer(
            request,
            {
                "replica": replica_id,
                "draining": True,
                "was_draining": not started,
                "replaced_first": _leaving(plane, replica_id),
            },
        )

    @app.route("/api/v1/nodes/<node_id>/stop-engines", methods=["POST"])
    def stop_node_engines(self, request: IRequest, node_id: str) -> bytes:
        """
        Stop every engine of a node on purpose: its replicas drain now
        (not replaced first, never refused), nothing is placed on it until
        C{start-engines} or the server's next start, and nothing is kept
        in the store.  C{{"nodes": [id], "stopping_replicas": [...]}}.
        """
        return self._stop_engines(request, [node_id])

    @app.route("/api/v1/nodes/stop-engines", methods=["POST"])
    def stop_all_engines(self, request: IRequest) -> bytes:
        """
        Stop every engine of every node known now, as for one node.
        """
        return self._stop_engines(request, [n.id for n in self._inventory.nodes()])

    def _stop_engines(self, request: IRequest, node_ids: list[str]) -> bytes:
        try:
            stopping = need_plane(self._plane).stop_engines(node_ids)
        except KeyError as e:
            raise not_found(f"node {str(e.args[0])[:200]!r}") from None
        return json_answer(request, {"nodes": node_ids, "stopping_replicas": stopping})

    @app.route("/api/v1/nodes/<node_id>/start-engines", methods=["POST"])
    def start_node_engines(self, request: IRequest, node_id: str) -> bytes:
        """
        Let placements use a node whose engines were stopped again.
        """
        return self._start_engines(request, [node_id])

    @app.route("/api/v1/nodes/start-engines", methods=["POST"])
    def start_all_engines(self, request: IRequest) -> bytes:
        """
        Let placements use every node again, after C{stop-engines}.
        """
        return self._start_engines(request, [n.id for n in self._inventory.nodes()])

    def _start_engines(self, request: IRequest, node_ids: list[str]) -> bytes:
        try:
            need_plane(self._plane).start_engines(node_ids)
        except KeyError as e:
            raise not_found(f"node {str(e.args[0])[:200]!r}") from None
        return json_answer(request, {"nodes": node_ids, "engines_stopped": False})


def _force(request: IRequest) -> bool:
    """
    @return: the body's C{force} (C{false} when absent).
    @raise AdminError: 400, not a boolean.
    """
    force = read_body(request).get("force", False)
    if not isinstance(force, bool):
        raise AdminError(400, "force: expected true or false", "bad_request")
    return force


class RefusedError(AdminError):
    """
    409 for a drain refused: C{{"error": {"message", "code":
    "below_min_replicas", "models": [...]}}}, the models it would leave
    below their C{min_replicas}.
    """

    def __init__(self, refused: DrainRefused) -> None:
        super().__init__(409, str(refused), "below_min_replicas")
        self.models = refused.models


def _leaving(plane: ControlPlane, replica_id: str) -> bool:
    """
    @return: whether the replica waits for its replacement before it
        drains.
    """
    replica = plane.replicas.get(replica_id)
    return (
        replica is not None
        and replica.leaving_since is not None
        and replica.draining_since is None
    )
