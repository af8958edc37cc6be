"""
The dashboard's pages as data: plain dicts for the templates, read from
the inventory, the control plane's records and views, the keys, the
engine load board and L{llmgw.web.history}.  Nothing here changes a
record; nothing here is HTML (the templates escape every value).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from llmgw.control.inventory import Inventory, Node
from llmgw.control.plane import ControlPlane
from llmgw.control.records import ReplicaRecord
from llmgw.control.views import count_states, explain, models_json
from llmgw.router.auth import KeyRing
from llmgw.web.history import FailureTap, History, sparkline

MIB = 1024 * 1024


class EngineLoad(Protocol):
    """
    One engine load reading (C{llmgw.router.load.EngineLoad}).
    """

    @property
    def running(self) -> float: ...

    @property
    def waiting(self) -> float: ...

    @property
    def kv_cache_usage(self) -> float | None: ...

    @property
    def read_at(self) -> float:
        """
        Reactor seconds of the reading.
        """


class LoadBoard(Protocol):
    """
    The router's engine load readings (C{router.load}), when the server
    polls engines.
    """

    def reading(self, replica_id: str) -> EngineLoad | None: ...

    def stale(self, replica_id: str, now: float) -> bool: ...

    def has_metrics(self, replica_id: str) -> bool | None: ...


def _ago(then: float | None, now: float) -> str:
    if then is None:
        return "never"
    seconds = max(0.0, now - then)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _gpus(node: Node, allocated: set[int]) -> list[dict[str, Any]]:
    out = []
    for gpu in node.gpus:
        total = gpu.memory_total_mib
        used = min(gpu.memory_used_mib, total) if total else gpu.memory_used_mib
        out.append(
            {
                "index": gpu.index,
                "name": gpu.name,
                "uuid": gpu.uuid,
                "used_gib": used / 1024,
                "total_gib": total / 1024,
                "percent": round(100 * used / total) if total else 0,
                "problems": gpu.problems,
                "simulated": gpu.simulated,
                "allocated": gpu.index in allocated,
            }
        )
    return out


class Fleet:
    """
    Reads for the pages.

    @param load: C{router.load} when the router polls engine load, else
        L{None} (the replica page says "no reading").
    @param wall_clock: POSIX seconds now.
    @param load_clock: the clock of C{load}'s readings (the reactor's
        C{seconds}); C{wall_clock} by default.
    """

    def __init__(
        self,
        inventory: Inventory,
        plane: ControlPlane | None,
        keys: KeyRing | None,
        history: History,
        failures: FailureTap | None,
        load: LoadBoard | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
        load_clock: Callable[[], float] | None = None,
    ) -> None:
        self.inventory = inventory
        self.plane = plane
        self.keys = keys
        self.history = history
        self.failures = failures
        self.load = load
        self.wall_clock = wall_clock
        self.load_clock = load_clock or wall_clock

    def _replicas(self) -> list[ReplicaRecord]:
        if self.plane is None:
            return []
        return sorted(self.plane.replicas.values(), key=lambda r: (r.model, r.id))

    def _allocated(self) -> dict[str, set[int]]:
        """
        @return: per node, the GPUs its live shards hold.
        """
        held: dict[str, set[int]] = {}
        for replica in self._replicas():
            for shard in replica.shards:
                if not shard.state.gone:
                    held.setdefault(shard.node, set()).update(shard.gpus)
        return held

    def _node_row(
        self, node: Node, now: float, allocated: dict[str, set[int]]
    ) -> dict[str, Any]:
        return {
            "id": node.id,
            "state": str(node.state),
            "draining": node.draining,
            "connected": node.connected,
            "seen": _ago(node.last_seen, now),
            "gpus": _gpus(node, allocated.get(node.id, set())),
        }

    def overview(self) -> dict[str, Any]:
        """
        @return: nodes (with GPUs), replica counts by state, models with
            desired and ready, the three sparklines and recent failures.
        """
        now = self.wall_clock()
        allocated = self._allocated()
        nodes = [self._node_row(n, now, allocated) for n in self.inventory.nodes()]
        replicas = self._replicas()
        points = list(self.history.points)
        last = points[-1] if points else None
        return {
            "nodes": nodes,
            "node_states": count_states(
                "draining" if n["draining"] else n["state"] for n in nodes
            ),
            "replica_states": count_states(str(r.state) for r in replicas),
            "replicas": len(replicas),
            "models": models_json(self.plane) if self.plane is not None else [],
            "sparks": [
                {
                    "name": "requests/s",
                    "now": f"{last.rate:.1f}" if last else "-",
                    "svg": sparkline(p.rate for p in points),
                },
                {
                    "name": "errors",
                    "now": f"{100 * last.error_rate:.1f}%" if last else "-",
                    "svg": sparkline(p.error_rate for p in points),
                },
                {
                    "name": "time to first token",
                    "now": f"{last.ttft * 1000:.0f} ms"
                    if last and last.ttft is not None
                    else "-",
                    "svg": sparkline(p.ttft for p in points),
                },
            ],
            "failures": [
                {
                    "ago": _ago(f.at, now),
                    "node": f.node,
                    "shard": f.shard,
                    "error": f.error,
                    "tail": "\n".join(f.output_tail[-10:]),
                }
                for f in (self.failures.failures if self.failures else ())
            ],
        }

    def node(self, node_id: str) -> dict[str, Any] | None:
        """
        @return: the node's GPUs, shards (with model and replica), last
            heartbeat and weights; L{None} for no such node.
        """
        node = self.inventory.get(node_id)
        if node is None:
            return None
        now = self.wall_clock()
        shards = []
        for replica in self._replicas():
            for shard in replica.shards:
                if shard.node == node_id:
                    shards.append(
                        {
                            "id": shard.id,
                            "replica": replica.id,
                            "model": replica.model,
                            "gpus": ", ".join(map(str, shard.gpus)) or "CPU",
                            "port": shard.port,
                            "state": str(shard.state),
                            "pid": shard.pid,
                        }
                    )
        return {
            **self._node_row(node, now, self._allocated()),
            "address": node.address,
            "agent_version": node.agent_version,
            "labels": node.labels,
            "cpus": node.cpus,
            "memory_gib": node.memory_bytes / (1024 * MIB),
            "shards": shards,
            "weights": [
                {
                    "path": w.get("path", ""),
                    "size_gib": (w.get("size_bytes") or 0) / (1024 * MIB),
                    "used": _ago(w.get("last_used"), now),
                }
                for w in node.weights[:200]
            ],
            "weights_count": len(node.weights),
            "weights_at": _ago(node.weights_at, now),
        }

    def replica(self, replica_id: str) -> dict[str, Any] | None:
        """
        @return: the replica's state and its history, shards, last error,
            engines' output tails and engine load; L{None} for no such
            replica.
        """
        if self.plane is None or replica_id not in self.plane.replicas:
            return None
        replica = self.plane.replicas[replica_id]
        now = self.wall_clock()
        tails = self.failures.tails if self.failures else {}
        shards = [
            {
                "id": s.id,
                "node": s.node,
                "gpus": ", ".join(map(str, s.gpus)) or "CPU",
                "port": s.port,
                "rank": s.rank,
                "state": str(s.state),
                "pid": s.pid,
                "error": s.error,
                "tail": "\n".join(tails.get(s.id, ())),
            }
            for s in sorted(replica.shards, key=lambda s: s.rank)
        ]
        return {
            "id": replica.id,
            "model": replica.model,
            "profile": replica.profile.name,
            "engine": replica.profile.engine,
            "state": str(replica.state),
            "adopted": replica.adopted,
            "drain_reason": replica.drain_reason,
            "shards": shards,
            "last_error": next((s["error"] for s in shards if s["error"]), ""),
            "history": [
                {"ago": _ago(at, now), "state": state}
                for at, state in reversed(self.history.states.get(replica_id, ()))
            ],
            "load": self._load(replica_id, self.load_clock()),
        }

    def _load(self, replica_id: str, now: float) -> dict[str, Any]:
        # now: on the readings' clock (read_at is reactor seconds).
        if self.load is None:
            return {"text": "no reading (this server does not poll engine load)"}
        if self.load.has_metrics(replica_id) is False:
            return {"text": "no reading: the engine serves no metrics"}
        reading = self.load.reading(replica_id)
        if reading is None:
            return {"text": "no reading yet"}
        kv = reading.kv_cache_usage
        return {
            "text": "stale" if self.load.stale(replica_id, now) else "",
            "running": f"{reading.running:g}",
            "waiting": f"{reading.waiting:g}",
            "kv": f"{100 * kv:.0f}%" if kv is not None else "-",
            "age": _ago(reading.read_at, now),
        }

    def model(self, name: str) -> dict[str, Any] | None:
        """
        @return: the model's counts, profiles, placement explanation and
            replicas; L{None} for no such catalog model.
        """
        plane = self.plane
        if plane is None:
            return None
        resolved = plane.catalog.resolve(name) or name
        model = plane.catalog.model(resolved)
        if model is None:
            return None
        row = next(m for m in models_json(plane) if m["name"] == model.name)
        return {
            **row,
            "profile_rows": [
                {
                    "name": p.name,
                    "engine": p.engine,
                    "source": p.source,
                    "gpus": p.gpus,
                    "gpu_memory_gb": p.gpu_memory_gb,
                    "nodes": p.nodes,
                    "priority": p.priority,
                }
                for p in model.profiles
            ],
            "placement": explain(plane, model.name),
            "replica_rows": [
                {
                    "id": r.id,
                    "state": str(r.state),
                    "nodes": ", ".join(sorted({s.node for s in r.shards})),
                }
                for r in self._replicas()
                if r.model == model.name
            ],
        }

    def key_rows(self) -> list[dict[str, Any]]:
        """
        @return: each key by name and prefix (never its secret or hash),
            with its limits, use and a sparkline of tokens per sample.
        """
        if self.keys is None:
            return []
        now = self.wall_clock()
        rows = []
        for key in sorted(self.keys.keys(), key=lambda k: k.name):
            seen = list(self.history.key_tokens.get(key.name, ()))
            deltas = [max(0, b - a) for a, b in zip(seen, seen[1:], strict=False)]
            rows.append(
                {
                    "name": key.name,
                    "prefix": key.prefix,
                    "admin": key.admin,
                    "models": ", ".join(key.models) if key.models else "all",
                    "rpm": key.rpm,
                    "tpm": key.tpm,
                    "budget": key.budget_tokens,
                    "tokens": key.tokens_used,
                    "used": _ago(key.last_used, now),
                    "revoked": key.revoked is not None,
                    "svg": sparkline(deltas, 160, 28),
                }
            )
        return rows
