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
from llmgw.control.phases import start_phases, start_seconds
from llmgw.control.plane import ControlPlane
from llmgw.control.records import ReplicaRecord
from llmgw.control.views import count_states, explain, gpu_allocations, models_json
from llmgw.router.accounting.auth import KeyRing
from llmgw.web.history import FailureTap, History, Point, chart
from llmgw.web.traffic import SLOT, WINDOWS, Figures, Series, Traffic, percentile

MIB = 1024 * 1024
GIB = 1024 * MIB


class EngineLoad(Protocol):
    """
    One engine load reading (C{llmgw.router.routing.load.EngineLoad}).
    """

    @property
    def running(self) -> float: ...

    @property
    def waiting(self) -> float: ...

    @property
    def kv_cache_usage(self) -> float | None: ...

    @property
    def prefix_cache_hit_rate(self) -> float | None: ...

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


def _percent(part: float, whole: float) -> int:
    return min(100, round(100 * part / whole)) if whole > 0 else 0


def _gpus(
    node: Node, allocations: dict[tuple[str, int], tuple[float, int]]
) -> list[dict[str, Any]]:
    """
    @return: per GPU, its memory three ways, GiB: C{total}; C{allocated},
        what the replicas placed on it asked for (their profiles'
        C{gpu_memory_gb}); C{used}, what the agent measured, L{None} for a
        simulated GPU (nothing to measure: it reports 0); C{others_gib},
        held by processes llmgw does not manage (placement may not use
        it), C{others_title} naming them.
    """
    out = []
    for gpu in node.gpus:
        total = gpu.memory_total_mib * MIB
        allocated, shards = allocations.get((node.id, gpu.index), (0.0, 0))
        used = None if gpu.simulated else gpu.memory_used_mib * MIB
        in_use = "simulated" if used is None else f"{used / GIB:.0f} used"
        others = gpu.foreign_used_mib * MIB
        if others:
            in_use += f", {others / GIB:.0f} not llmgw's"
        out.append(
            {
                # The bar's text, made here: a fleet has hundreds of bars.
                "bar": f"{gpu.index}: {allocated / GIB:.0f}/{total / GIB:.0f} GiB"
                f" allocated · {in_use}",
                "index": gpu.index,
                "name": gpu.name,
                "uuid": gpu.uuid,
                "total_gib": total / GIB,
                "allocated_gib": allocated / GIB,
                "allocated_percent": _percent(allocated, total),
                "used_gib": used / GIB if used is not None else None,
                "used_percent": _percent(used or 0, total),
                "shards": shards,
                "problems": gpu.problems,
                "simulated": gpu.simulated,
                "allocated": shards > 0,
                "others_gib": others / GIB,
                "others_title": ", ".join(
                    f"pid {p['pid']} {p['name'] or '?'} {p['used_mib'] / 1024:.1f} GiB"
                    for p in gpu.processes
                    if not p["managed"]
                ),
            }
        )
    return out


def window_name(seconds: float) -> str:
    """
    @return: a window's length as the pages state it (C{"1 min"}).
    """
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s"


def _figures(figures: Figures) -> dict[str, Any]:
    """
    @return: one window's figures as the pages print them.
    """
    error = figures.error_rate
    return {
        "window": window_name(figures.seconds),
        "key": f"{figures.seconds / 60:g}m",
        "requests": figures.requests,
        "rate": f"{figures.rate:.1f}"
        if figures.rate >= 0.05 or not figures.requests
        else f"{figures.rate:.2f}",
        "errors": figures.errors,
        "error_rate": f"{100 * error:.1f}%" if error is not None else "-",
        "streams": figures.streams,
        "p50": _ms(figures.ttft_p50),
        "p95": _ms(figures.ttft_p95),
    }


class Fleet:
    """
    Reads for the pages.

    @param load: C{router.load} when the router polls engine load, else
        L{None} (the replica page says "no reading").
    @param traffic: the requests per model and replica, or L{None} (the
        pages show no traffic figures).
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
        traffic: Traffic | None = None,
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
        self.traffic = traffic
        self.wall_clock = wall_clock
        self.load_clock = load_clock or wall_clock

    def _replicas(self) -> list[ReplicaRecord]:
        if self.plane is None:
            return []
        return sorted(self.plane.replicas.values(), key=lambda r: (r.model, r.id))

    def _allocations(self) -> dict[tuple[str, int], tuple[float, int]]:
        return gpu_allocations(self.plane) if self.plane is not None else {}

    def _traffic(self, series: Series | None) -> list[dict[str, Any]]:
        """
        @return: the series' figures over each of L{WINDOWS}; none
            without a traffic record.
        """
        if self.traffic is None:
            return []
        return [_figures(f) for f in self.traffic.windows(series, WINDOWS)]

    def model_traffic(self, model: str) -> list[dict[str, Any]]:
        """
        @return: a catalog model's figures over each of L{WINDOWS}.
        """
        series = self.traffic.models.get(model) if self.traffic else None
        return self._traffic(series)

    def _estimated(self, model: str) -> dict[str, int]:
        """
        @return: C{{"requests": N, "answered": M}}: the model's requests
            since the start with estimated usage, and those of them
            answered whole (its engine sends no usage in streams); zeros
            without a traffic record.
        """
        if self.traffic is None:
            return {"requests": 0, "answered": 0}
        return {
            "requests": self.traffic.estimated.get(model, 0),
            "answered": self.traffic.answered_estimated.get(model, 0),
        }

    def replica_traffic(self, replica_id: str) -> list[dict[str, Any]]:
        """
        @return: a replica's figures over each of L{WINDOWS} (the
            requests it answered).
        """
        series = self.traffic.replicas.get(replica_id) if self.traffic else None
        return self._traffic(series)

    def _charts(self, series: Series | None) -> list[dict[str, str]]:
        """
        @return: a model's charts: requests per second, 5xx share and
            median time to first token, one point per slot.
        """
        if self.traffic is None:
            return []
        line = self.traffic.timeline(series)
        step = f"{SLOT:g} s"
        return [
            {
                "name": f"requests/s (per {step})",
                "svg": chart(
                    [(a, s.requests / SLOT if s else 0.0) for a, s in line], _per_s
                ),
            },
            {
                "name": f"errors, 5xx (per {step})",
                "svg": chart(
                    [(a, s.errors / s.requests if s else None) for a, s in line],
                    _share,
                ),
            },
            {
                "name": f"time to first token, p50 (per {step})",
                "svg": chart(
                    [(a, percentile(s.ttft, 0.5) if s else None) for a, s in line],
                    _axis_ms,
                ),
            },
        ]

    def _node_row(
        self,
        node: Node,
        now: float,
        allocations: dict[tuple[str, int], tuple[float, int]],
    ) -> dict[str, Any]:
        return {
            "id": node.id,
            "state": str(node.state),
            "draining": node.draining,
            "connected": node.connected,
            "seen": _ago(node.last_seen, now),
            "labels": sorted(node.labels.items()),
            "gpus": _gpus(node, allocations),
        }

    def overview(self) -> dict[str, Any]:
        """
        @return: nodes (with GPUs and labels), replica counts by state,
            models with desired and ready and their traffic over
            L{WINDOWS}, the headline figures (over the first window) with
            their charts, and recent failures.
        """
        now = self.wall_clock()
        allocations = self._allocations()
        nodes = [self._node_row(n, now, allocations) for n in self.inventory.nodes()]
        replicas = self._replicas()
        points = list(self.history.points)
        models = models_json(self.plane) if self.plane is not None else []
        for row in models:
            row["traffic"] = self.model_traffic(row["name"])
            row["usage_estimated"] = self._estimated(row["name"])
        return {
            "nodes": nodes,
            "node_states": count_states(
                "draining" if n["draining"] else n["state"] for n in nodes
            ),
            "replica_states": count_states(str(r.state) for r in replicas),
            "replicas": len(replicas),
            "models": models,
            "sparks": self._sparks(points, now),
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

    def _sparks(self, points: list[Point], now: float) -> list[dict[str, Any]]:
        """
        @return: the headline cards: each figure over the first of
            L{WINDOWS} (the second beside it; "-" without a traffic
            record), and a chart of the samples of the last 10 minutes.
        """
        fleet = self._traffic(self.traffic.fleet if self.traffic else None)
        empty = {"window": window_name(WINDOWS[0]), "rate": "-", "error_rate": "-"}
        first, second = fleet if fleet else (empty, empty)
        step = f"{self.history.interval:g} s"

        def both(figure: Callable[[dict[str, Any]], str]) -> dict[str, str]:
            return {
                "window": first["window"],
                "now": figure(first) if fleet else "-",
                "also": f"{second['window']}: {figure(second)}" if fleet else "",
            }

        return [
            {
                "id": "rate",
                "name": "requests/s",
                **both(lambda f: str(f["rate"])),
                "svg": chart([(now - p.at, p.rate) for p in points], _per_s),
                "axis": f"per {step}",
            },
            {
                "id": "errors",
                "name": "errors (5xx)",
                **both(lambda f: str(f["error_rate"])),
                "svg": chart(
                    [(now - p.at, p.error_rate if p.rate else None) for p in points],
                    _share,
                ),
                "axis": f"share per {step}",
            },
            {
                "id": "ttft",
                "name": "time to first token p50 / p95 (streams)",
                **both(lambda f: f"{f['p50']} / {f['p95']}"),
                "svg": chart([(now - p.at, p.ttft) for p in points], _axis_ms),
                "axis": f"mean per {step}",
            },
        ]

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
                            "traffic": self.replica_traffic(replica.id),
                        }
                    )
        return {
            **self._node_row(node, now, self._allocations()),
            "address": node.address,
            "agent_version": node.agent_version,
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
            engines' output tails, engine load and where its start spent
            its time (C{start_seconds}, C{phases}); L{None} for no such
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
            "traffic": self.replica_traffic(replica_id),
            "start_seconds": start_seconds(replica),
            "phases": start_phases(replica),
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
        kv, hits = reading.kv_cache_usage, reading.prefix_cache_hit_rate
        return {
            "text": "stale" if self.load.stale(replica_id, now) else "",
            "running": f"{reading.running:g}",
            "waiting": f"{reading.waiting:g}",
            "kv": f"{100 * kv:.0f}%" if kv is not None else "-",
            "prefix_cache": f"{100 * hits:.0f}%" if hits is not None else "-",
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
            "traffic": self.model_traffic(model.name),
            "usage_estimated": self._estimated(model.name),
            "charts": self._charts(
                self.traffic.models.get(model.name) if self.traffic else None
            ),
            "replica_rows": [
                {
                    "id": r.id,
                    "state": str(r.state),
                    "nodes": ", ".join(sorted({s.node for s in r.shards})),
                    "traffic": self.replica_traffic(r.id),
                }
                for r in self._replicas()
                if r.model == model.name
            ],
        }

    def key_rows(self) -> list[dict[str, Any]]:
        """
        @return: each key by name and prefix (never its secret or hash),
            with its limits, use and a chart of its tokens per sample
            over the last 10 minutes.
        """
        if self.keys is None:
            return []
        now = self.wall_clock()
        step = self.history.interval
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
                    "budget_cost": key.budget_cost,
                    "tokens": key.tokens_used,
                    "cost": key.cost_used,
                    "used": _ago(key.last_used, now),
                    "revoked": key.revoked is not None,
                    "svg": chart(
                        [
                            ((len(deltas) - 1 - i) * step, d)
                            for i, d in enumerate(deltas)
                        ],
                        _tokens,
                        width=220,
                        height=60,
                    ),
                }
            )
        return rows


def _tokens(value: float) -> str:
    return f"{value:g}"


def _per_s(value: float) -> str:
    return f"{value:g}/s"


def _share(value: float) -> str:
    return f"{100 * value:g}%"


def _axis_ms(value: float) -> str:
    return f"{value * 1000:g} ms" if value < 10 else f"{value:g} s"
