"""
The control plane at fleet scale: one reconcile pass and the placement of
one model over 1,000 simulated nodes of 8 GPUs and a catalog of 500 models.

No processes and no network: the inventory is filled as agents' Registers
would fill it, commands to agents are answered at once, and shards are
reported ready through the same entry point the agent links use.  What is
timed is the pass the server's reactor runs.

    python bench/control_bench.py [--nodes 1000] [--gpus 8] [--models 500]
        [--passes 200] [--placements 200]

Cases (each timed many times; median and p99 in milliseconds):

- initial: the first pass, placing every model's replicas on an empty
  fleet (once: it happens once per fleet);
- steady: a pass with everything placed and ready, nothing to do;
- replace one: a pass after one replica failed, placing its replacement
  (the pass an engine crash costs);
- place(): one call of the placement function on the loaded fleet, as the
  pass makes it.

The target is a pass under 50 ms.  The baseline printed beside it is the
same pass over a fleet of 10 nodes with 5 models, run in the same process,
for a ratio that this machine's noise affects less than absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from llmgw.config import ControlConfig
from llmgw.control.catalog import Model
from llmgw.control.inventory import Inventory
from llmgw.control.placement import Profile, place
from llmgw.control.plane import ControlPlane
from llmgw.control.snapshot import Snapshot
from llmgw.wire import agent_pb2 as pb


class _Agents:
    def __init__(self) -> None:
        self.started: list[tuple[str, str]] = []

    def send(self, node_id: str, message: pb.ControlMessage) -> Deferred[Any]:
        if message.WhichOneof("kind") == "start_shard":
            self.started.append((node_id, message.start_shard.shard_id))
        return succeed(None)


def _catalog(count: int) -> list[Model]:
    """
    Models of 1, 2, 4 or 8 GPUs per replica, 1 or 2 replicas each; each
    prefers H200s (over 80 GB per GPU) and falls back to twice as many
    H100s.
    """
    sizes = (1, 1, 2, 4)
    models = []
    for i in range(count):
        gpus = sizes[i % len(sizes)]
        models.append(
            Model(
                name=f"model-{i:03d}",
                aliases=(),
                min_replicas=1 + i % 2,
                max_replicas=4,
                idle_timeout=0,
                profiles=(
                    Profile(
                        name=f"h200x{gpus}",
                        engine="vllm",
                        source=f"org/model-{i}",
                        gpus=gpus,
                        gpu_memory_gb=100,
                        priority=1,
                    ),
                    Profile(
                        name=f"h100x{gpus * 2}",
                        engine="vllm",
                        source=f"org/model-{i}",
                        gpus=gpus * 2,
                        gpu_memory_gb=50,
                    ),
                ),
            )
        )
    return models


def _fleet(nodes: int, gpus: int, models: int) -> tuple[ControlPlane, _Agents, Clock]:
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
    for n in range(nodes):
        register = pb.Register(
            node_id=f"node-{n:04d}",
            address=f"10.{n // 250}.{n % 250}.1",
            # Half the fleet H200 (141 GB), half H100 (80 GB).
            gpus=[
                pb.Gpu(
                    index=i,
                    name="H200" if n % 2 else "H100",
                    memory_total_mib=(141 if n % 2 else 80) * 1024,
                )
                for i in range(gpus)
            ],
        )
        inventory.register(register, 0.0, clock.seconds())
        plane.node_registered(register.node_id, register)
    return plane, agents, clock


def _ready(plane: ControlPlane, agents: _Agents) -> None:
    for node, shard_id in agents.started:
        status = pb.ShardStatus(shard_id=shard_id, state=pb.SHARD_STATE_READY)
        plane.shard_status(node, status)
    agents.started.clear()


def _ms(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered) * 1000, p99 * 1000


def measure(
    nodes: int, gpus: int, models: int, passes: int, placements: int
) -> dict[str, Any]:
    plane, agents, clock = _fleet(nodes, gpus, models)
    started = time.perf_counter()
    plane.reconcile()
    initial = time.perf_counter() - started
    placed = len(agents.started)
    _ready(plane, agents)
    plane.reconcile()

    steady = []
    for _ in range(passes):
        clock.advance(0.01)
        for node in plane.inventory.nodes():
            node.heard = clock.seconds()
        started = time.perf_counter()
        plane.reconcile()
        steady.append(time.perf_counter() - started)

    replace_one = []
    for i in range(placements):
        replica = list(plane.replicas.values())[i % len(plane.replicas)]
        shard = replica.shards[0]
        status = pb.ShardStatus(shard_id=shard.id, state=pb.SHARD_STATE_FAILED)
        plane.shard_status(shard.node, status)
        plane.reconcile()
        # Past the model's backoff, so the pass places the replacement.
        clock.advance(400)
        for node in plane.inventory.nodes():
            node.heard = clock.seconds()
        started = time.perf_counter()
        plane.reconcile()
        replace_one.append(time.perf_counter() - started)
        if len(agents.started) != 1:
            raise SystemExit(f"expected one placement, got {len(agents.started)}")
        _ready(plane, agents)
        plane.reconcile()

    snapshot = Snapshot(plane.inventory.nodes(), plane.replicas.values(), {})
    fleet = snapshot.fleet
    catalog = _catalog(models)
    place_one = []
    for i in range(placements):
        model = catalog[i % len(catalog)]
        started = time.perf_counter()
        place(model.profiles, fleet, range(20000, 21000))
        place_one.append(time.perf_counter() - started)
    return {
        "nodes": nodes,
        "gpus": nodes * gpus,
        "models": models,
        "replicas": len(plane.replicas),
        "initial_placements": placed,
        "initial_ms": initial * 1000,
        "steady_ms": _ms(steady),
        "replace_one_ms": _ms(replace_one),
        "place_ms": _ms(place_one),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--passes", type=int, default=200)
    parser.add_argument("--placements", type=int, default=200)
    args = parser.parse_args()
    small = measure(10, args.gpus, 5, args.passes, args.placements)
    big = measure(args.nodes, args.gpus, args.models, args.passes, args.placements)
    for result in (small, big):
        print(
            f"{result['nodes']} nodes, {result['gpus']} GPUs,"
            f" {result['models']} models, {result['replicas']} replicas"
        )
        print(
            f"  initial pass ({result['initial_placements']} placements):"
            f" {result['initial_ms']:.1f} ms"
        )
        for key, label in (
            ("steady_ms", "steady pass"),
            ("replace_one_ms", "pass replacing one replica"),
            ("place_ms", "place() one model"),
        ):
            median, p99 = result[key]
            print(f"  {label}: median {median:.2f} ms, p99 {p99:.2f} ms")
    for key, label in (("steady_ms", "steady"), ("replace_one_ms", "replace one")):
        print(
            f"ratio big/small, {label} pass median:"
            f" {big[key][0] / max(small[key][0], 1e-9):.1f}x"
        )
    worst = max(big["steady_ms"][1], big["replace_one_ms"][1])
    verdict = "met" if worst < 50 else "NOT met"
    print(f"target: a pass under 50 ms at p99: {verdict} ({worst:.1f} ms)")


if __name__ == "__main__":
    main()
