"""
The admin API's weights routes (docs/agents.md): the model files each
agent reported, which of them nothing uses, and deleting them through the
agents.
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
    read_body,
)
from llmgw.control.inventory import Inventory
from llmgw.control.plane import ControlPlane


class WeightRoutes:
    """
    C{/api/v1/weights}, C{/api/v1/weights/collect} and
    C{/api/v1/nodes/<node>/weights/remove}.

    @param plane: the control plane, when there is one.
    @param inventory: the nodes, with the files their agents reported.
    """

    app = error_answers(Klein())

    def __init__(self, plane: ControlPlane | None, inventory: Inventory) -> None:
        self._plane = plane
        self._inventory = inventory

    @app.route("/api/v1/weights", methods=["GET"])
    def weights(self, request: IRequest) -> bytes:
        """
        Per node: the model files its agent reported (path, size_bytes,
        last_used), when, which of them nothing uses, how many it found
        (C{total}) and whether the list leaves some out (C{truncated}: more
        than one frame or the inventory holds).
        """
        plane = self._plane
        nodes = []
        for node in self._inventory.nodes():
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
        results = await need_plane(self._plane).weights.collect(dry_run)
        return json_answer(request, {"dry_run": dry_run, "nodes": results})

    @app.route("/api/v1/nodes/<node_id>/weights/remove", methods=["POST"])
    async def remove_weights(self, request: IRequest, node_id: str) -> bytes:
        """
        Ask a node's agent to delete C{{"paths": [...]}}; it refuses paths
        outside its weights directories (symlinks resolved) and those a
        running engine uses.  409 with the agent's reason when refused.
        """
        plane = need_plane(self._plane)
        if self._inventory.get(node_id) is None:
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
