"""
The dashboard at fleet scale: each page rendered over 100 nodes of 8 GPUs
and 200 replicas, timed (median and p95 in milliseconds) and sized
(bytes of HTML).

No processes and no network: the inventory is filled as agents'
Registers fill it, the control plane places the replicas and they are
reported ready through the entry point the agent links use (as in
L{bench/control_bench.py}); 50 keys, 20 engine failures with 50-line
output tails, and a full sparkline history (120 samples) are added.
Each page is rendered by the dashboard's own handler, as the admin
listener's resource calls it (the HTTP framing around it is left out).
The traffic figures hold 10 minutes of requests, 2 per second per
replica; the cost each request adds on the router's side (its record
counted per model and replica) is timed too, in microseconds.

    python bench/dashboard_bench.py [--nodes 100] [--gpus 8] [--models 100]
        [--rounds 30]

Targets: under 300 ms and under 200 KB per page.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyChannel

from llmgw.control.catalog import Model
from llmgw.control.inventory import Inventory
from llmgw.control.placement import Profile
from llmgw.control.plane import ControlPlane
from llmgw.control.settings import ControlConfig
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.web.fleet import Fleet
from llmgw.web.history import FailureTap, History, Point
from llmgw.web.pages import CookieCsrf, Dashboard
from llmgw.web.traffic import KEPT, SLOT, Traffic
from llmgw.wire import agent_pb2 as pb


class _Agents:
    def __init__(self) -> None:
        self.started: list[tuple[str, str]] = []

    def send(self, node_id: str, message: pb.ControlMessage) -> Deferred[Any]:
        if message.WhichOneof("kind") == "start_shard":
            self.started.append((node_id, message.start_shard.shard_id))
        return succeed(None)


class _Actions:
    async def set_scale(self, name: str, low: int, high: int) -> Any:
        raise NotImplementedError

    async def revoke(self, name: str) -> Any:
        raise NotImplementedError


def _catalog(count: int) -> list[Model]:
    """
    C{count} models of 1, 2 or 4 GPUs per replica, 2 replicas each.
    """
    sizes = (1, 2, 4, 1)
    return [
        Model(
            name=f"model-{i:03d}",
            aliases=(f"alias-{i:03d}",),
            min_replicas=2,
            max_replicas=4,
            idle_timeout=0,
            profiles=(
                Profile(
                    name=f"h200x{sizes[i % 4]}",
                    engine="vllm",
                    source=f"org/model-{i}",
                    gpus=sizes[i % 4],
                    gpu_memory_gb=60,
                ),
            ),
        )
        for i in range(count)
    ]


class _Record:
    def __init__(self, model: str, replica: str, i: int) -> None:
        self.model = model
        self.replica = replica
        self.status = 502 if i % 50 == 0 else 200
        self.stream = True
        self.time_to_first_token = 0.05 + (i % 97) / 100
        self.usage_estimated = False


def fill(traffic: Traffic, clock: Clock, plane: ControlPlane) -> list[_Record]:
    """
    Ten minutes of requests: 2 per second for each replica.
    """
    records = [
        _Record(r.model, r.id, i)
        for i, r in enumerate(plane.replicas.values())
        for i in (i, i + 1)
    ]
    for _ in range(int(KEPT / SLOT)):
        for _ in range(int(SLOT)):
            for record in records:
                traffic.record(record)
        clock.advance(SLOT)
    return records


def per_request(traffic: Traffic, records: list[_Record], rounds: int = 20) -> float:
    """
    @return: microseconds per request that L{Traffic.record} adds.
    """
    started = time.perf_counter()
    for _ in range(rounds):
        for record in records:
            traffic.record(record)
    return (time.perf_counter() - started) / (rounds * len(records)) * 1e6


def build(
    nodes: int, gpus: int, models: int
) -> tuple[Dashboard, ControlPlane, Traffic, list[_Record]]:
    clock = Clock()
    clock.advance(1000)
    inventory = Inventory()
    agents = _Agents()
    plane = ControlPlane(
        clock,
        inventory,
        agents,
        _catalog(models),
        ControlConfig(startup_grace=0, port_range=(20000, 20999)),
        lambda endpoints: None,
    )
    failures = FailureTap(plane, time.time)
    for n in range(nodes):
        register = pb.Register(
            node_id=f"node-{n:04d}",
            address=f"10.0.{n}.1",
            agent_version="0.1.0",
            cpus=96,
            memory_bytes=2 * 1024**4,
            gpus=[
                pb.Gpu(
                    index=i,
                    uuid=f"GPU-{n:04d}-{i}",
                    name="NVIDIA H200",
                    memory_total_mib=141 * 1024,
                    memory_used_mib=(n * 7 + i * 13) % 141 * 1024,
                )
                for i in range(gpus)
            ],
        )
        inventory.register(register, time.time(), clock.seconds())
        failures.node_registered(register.node_id, register)
    plane.reconcile()
    for node, shard_id in agents.started:
        failures.shard_status(
            node, pb.ShardStatus(shard_id=shard_id, state=pb.SHARD_STATE_READY)
        )
    plane.reconcile()
    for i in range(20):
        failures.shard_status(
            f"node-{i:04d}",
            pb.ShardStatus(
                shard_id=f"gone-{i}",
                state=pb.SHARD_STATE_FAILED,
                error="exit code 1",
                output_tail=[f"line {j}: " + "x" * 100 for j in range(50)],
            ),
        )
    keys = KeyRing(None, clock=time.monotonic, wall_clock=time.time)  # type: ignore[arg-type]
    keys.load(
        [
            {
                "id": i,
                "name": f"key-{i:02d}",
                "prefix": f"sk-{i:08d}",
                "hash": f"{i:064x}",
                "models": None,
                "rpm": 600,
                "tpm": None,
                "budget_tokens": None,
                "admin": i == 0,
                "created": time.time(),
            }
            for i in range(50)
        ]
    )
    history = History(
        clock, RouterMetrics(CollectorRegistry()), plane, keys, wall_clock=time.time
    )
    for i in range(120):
        history.points.append(Point(time.time() - 600 + 5 * i, i % 17, 0.01, 0.2))
        history.record_states(time.time())
        history.sample_keys(keys)
    traffic = Traffic(clock.seconds, plane.catalog.resolve)
    records = fill(traffic, clock, plane)
    fleet = Fleet(
        inventory, plane, keys, history, failures, wall_clock=time.time, traffic=traffic
    )
    return Dashboard(fleet, _Actions(), CookieCsrf()), plane, traffic, records


def render(page: Any, *args: str, fragment: bool = False) -> bytes:
    request = Request(DummyChannel())
    request.method = b"GET"
    request.args = {b"fragment": [b"1"]} if fragment else {}
    body: bytes = page(request, *args)
    assert request.code == 200, request.code
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    options = parser.parse_args()
    dashboard, plane, traffic, records = build(
        options.nodes, options.gpus, options.models
    )
    replica = sorted(plane.replicas)[0]
    states: dict[str, int] = {}
    for r in plane.replicas.values():
        states[str(r.state)] = states.get(str(r.state), 0) + 1
    print(
        f"fleet: {options.nodes} nodes x {options.gpus} GPUs,"
        f" {len(plane.replicas)} replicas {states}, {options.models} models,"
        " 50 keys, 20 failures"
    )
    pages = [
        ("overview /", dashboard.overview, (), False),
        ("overview fragment", dashboard.overview, (), True),
        ("node /nodes/node-0000", dashboard.node, ("node-0000",), False),
        (f"replica /replicas/{replica}", dashboard.replica, (replica,), False),
        ("model /models/model-000", dashboard.model, ("model-000",), False),
        ("keys /keys", dashboard.keys, (), False),
    ]
    print(f"{'page':40} {'median ms':>10} {'p95 ms':>8} {'bytes':>8}  target")
    worst = 0.0
    for name, page, args, fragment in pages:
        render(page, *args, fragment=fragment)
        times = []
        for _ in range(options.rounds):
            started = time.perf_counter()
            body = render(page, *args, fragment=fragment)
            times.append(time.perf_counter() - started)
        times.sort()
        median = statistics.median(times) * 1000
        p95 = times[min(len(times) - 1, int(len(times) * 0.95))] * 1000
        worst = max(worst, p95)
        ok = p95 < 300 and len(body) < 200_000
        print(
            f"{name:40} {median:10.1f} {p95:8.1f} {len(body):8d}"
            f"  {'ok' if ok else 'MISSED'}"
        )
    print(f"traffic record per request: {per_request(traffic, records):.2f} us")


if __name__ == "__main__":
    main()
