"""
Weights collection: which model files the agents report that nothing
uses, and deleting them through the agents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from twisted.logger import Logger

from llmgw.control.commands import Commands
from llmgw.control.inventory import Inventory, Node
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.engines import hub_cache_name


class WeightsCollector:
    """
    Finds and deletes model files nothing uses.

    @param inventory: the nodes and the files their agents report.
    @param commands: sends C{RemoveWeights} to agents.
    @param sources: the weights in use now: (source, user) pairs, a
        profile's source path or hub id and the catalog model or replica
        using it.
    """

    log = Logger()

    def __init__(
        self,
        inventory: Inventory,
        commands: Commands,
        sources: Callable[[], Iterable[tuple[str, str]]],
    ) -> None:
        self.inventory = inventory
        self.commands = commands
        self._sources = sources

    def user(self, path: str) -> str | None:
        """
        @return: the catalog model or replica that uses C{path} (its source
            path, a folder holding it, a file or folder inside it, or the
            Hugging Face cache entry C{models--ORG--NAME} of a hub id), or
            L{None}.
        """
        path = path.rstrip("/")
        name = path.rsplit("/", 1)[-1]
        for source, user in self._sources():
            source = source.rstrip("/")
            if (
                source == path
                or source.startswith(path + "/")
                or path.startswith(source + "/")
                or name == hub_cache_name(source)
            ):
                return user
        return None

    def unused(self, node: Node) -> list[dict[str, Any]]:
        """
        @return: the node's reported model files that nothing in the
            catalog and no replica uses (see L{user}).
        """
        return [e for e in node.weights if self.user(e["path"]) is None]

    async def collect(self, dry_run: bool) -> list[dict[str, Any]]:
        """
        Delete, through each node's agent, the model files nothing uses.

        @return: per node: the files chosen, and with C{dry_run} off,
            whether the agent removed them or its error.  A node whose list
            is truncated is refused (error said, nothing removed): what it
            left out may be what makes a listed file used.
        """
        results = []
        for node in self.inventory.nodes():
            unused = self.unused(node)
            result: dict[str, Any] = {
                "node": node.id,
                "unused": unused,
                "bytes": sum(e["size_bytes"] for e in unused),
                "removed": False,
                "error": None,
            }
            results.append(result)
            if dry_run or not unused:
                continue
            if node.weights_truncated:
                result["error"] = (
                    f"its weights list is truncated ({len(node.weights)} of"
                    f" {node.weights_total} entries reported): not collecting;"
                    " remove files by path (llmgw ctl weights --remove)"
                )
                continue
            result.update(await self.remove(node.id, [e["path"] for e in unused]))
        return results

    async def remove(self, node_id: str, paths: list[str]) -> dict[str, Any]:
        """
        Ask a node's agent to delete C{paths} (it refuses any outside its
        weights directories).

        @return: C{{"removed": bool, "error": str | None}}.
        """
        try:
            await self.commands.send(
                node_id,
                pb.ControlMessage(remove_weights=pb.RemoveWeights(paths=paths)),
            )
        except Exception as e:
            result = getattr(e, "result", None)
            error = result.error if result is not None else str(e) or repr(e)
            self.log.warn(
                "removing weights on {node} refused: {error}", node=node_id, error=error
            )
            return {"removed": False, "error": error}
        self.log.info(
            "removed weights on {node}: {paths}", node=node_id, paths=", ".join(paths)
        )
        return {"removed": True, "error": None}
