"""
What GPUs cost (docs/cost.md): each request's share of its replica's GPU
time by processor sharing (L{llmgw.router.routing.gpu_share}), the
C{[cost]} prices (L{llmgw.control.prices}), and the control plane's
meter of every GPU's seconds by state (L{llmgw.control.meter}).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.admin.keys import KeyRoutes
from llmgw.config import parse_config
from llmgw.config_checks import ConfigError
from llmgw.control.inventory import Inventory
from llmgw.control.meter import GpuMeter, fleet_gpus
from llmgw.control.placement import Profile
from llmgw.control.prices import CostConfig, GpuPrice, Prices
from llmgw.control.records import ReplicaRecord, ShardRecord
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.errors import APIError
from llmgw.router.interfaces import Endpoint
from llmgw.router.routing.balancer import Balancer
from llmgw.router.routing.gpu_share import GpuShare
from llmgw.server.metering import TICK, MeterService
from llmgw.store.base import UsageRow
from llmgw.store.db import SQLiteStore
from llmgw.store.gpu_time import GpuTimeRow, per_gpu
from llmgw.wire.states import ShardState
from tests.plane_support import PlaneCase, make_model, register_message
from tests.test_limits import _NoStore, _row


class GpuShareTests(SynchronousTestCase):
    """
    Processor sharing: each second a replica serves n requests, each
    gets 1/n of its GPU-seconds and of their price.
    """

    def test_overlapping_requests_split_the_seconds(self) -> None:
        """
        Two requests on a replica of 2 GPUs at 7200 an hour (2 a
        second), A from 0 to 4 s and B from 2 to 6 s: each gets its 2 s
        alone whole (4 GPU-seconds) and half of the 2 s together (2):
        6 GPU-seconds and 6 of cost each, 12 in all for 6 busy seconds
        of 2 GPUs.
        """
        share = GpuShare()
        a = share.enter(0.0, 2.0, 7200.0)
        b = share.enter(2.0, 2.0, 7200.0)
        used_a = share.leave(4.0, 2.0, 7200.0, a)
        used_b = share.leave(6.0, 2.0, 7200.0, b)
        self.assertEqual((used_a.gpu_seconds, used_a.cost), (6.0, 6.0))
        self.assertEqual((used_b.gpu_seconds, used_b.cost), (6.0, 6.0))
        self.assertEqual((share.busy, share.in_flight), (6.0, 0))

    def test_idle_seconds_go_to_no_request(self) -> None:
        """
        Seconds with no request in flight are no request's: a request
        after a pause gets only its own time.
        """
        share = GpuShare()
        first = share.enter(0.0, 1.0, 0.0)
        share.leave(1.0, 1.0, 0.0, first)
        second = share.enter(10.0, 1.0, 0.0)
        used = share.leave(12.0, 1.0, 0.0, second)
        self.assertEqual((used.gpu_seconds, used.cost), (2.0, 0.0))
        self.assertEqual(share.busy, 3.0)

    def test_shares_sum_to_the_busy_seconds(self) -> None:
        """
        However requests overlap, their shares add up to the replica's
        busy seconds times its GPUs.
        """
        share = GpuShare()
        spans = [(0.0, 3.0), (0.5, 1.0), (0.5, 7.0), (2.0, 2.5), (6.0, 9.0)]
        events = sorted(
            [(start, 1, i) for i, (start, _) in enumerate(spans)]
            + [(end, 0, i) for i, (_, end) in enumerate(spans)]
        )
        marks = {}
        total = 0.0
        for when, entering, i in events:
            if entering:
                marks[i] = share.enter(when, 1.5, 0.0)
            else:
                total += share.leave(when, 1.5, 0.0, marks[i]).gpu_seconds
        self.assertAlmostEqual(total, 9.0 * 1.5)
        self.assertEqual(share.busy, 9.0)


class PricesTests(SynchronousTestCase):
    """
    C{[cost] gpu_hour}: a price per GPU model, and per node where a
    node's differs.
    """

    def test_most_precise_price_wins(self) -> None:
        """
        A node's own price for a model beats its C{"*"}, which beats every
        node's price for the model, which beats every node's C{"*"}; a
        GPU no price names costs 0.
        """
        config = parse_config(
            {
                "cost": {
                    "gpu_hour": [
                        {"gpu": "*", "price": 1.0},
                        {"gpu": "H100", "price": 2.5},
                        {"gpu": "*", "node": "n2", "price": 3.0},
                        {"gpu": "H100", "node": "n3", "price": 4.0},
                    ]
                }
            }
        )
        prices = Prices(config.cost)
        self.assertEqual(prices.per_hour("n1", "H100"), 2.5)
        self.assertEqual(prices.per_hour("n1", "L4"), 1.0)
        self.assertEqual(prices.per_hour("n2", "H100"), 3.0)
        self.assertEqual(prices.per_hour("n3", "H100"), 4.0)
        self.assertEqual(prices.per_hour("n3", "L4"), 1.0)
        self.assertEqual(Prices().per_hour("n1", "H100"), 0.0)

    def test_bad_price_named(self) -> None:
        """
        A price that is not a number of 0 or more, or an entry of an
        unknown key, is refused in one line naming the entry and the value.
        """
        cases = [
            ({"gpu": "H100", "price": -1}, "cost.gpu_hour[0].price: ", "got -1"),
            ({"gpu": "H100", "price": "2"}, "cost.gpu_hour[0].price: ", "got '2'"),
            ({"price": 2}, "cost.gpu_hour[0].gpu: ", "got"),
            ({"gpu": "H100", "price": 1, "zone": "a"}, "cost.gpu_hour[0]: ", "'zone'"),
        ]
        for entry, where, what in cases:
            with self.assertRaises(ConfigError) as raised:
                parse_config({"cost": {"gpu_hour": [entry]}})
            message = str(raised.exception)
            self.assertTrue(message.startswith(where), message)
            self.assertIn(what, message)


class MeterTests(PlaneCase):
    """
    The meter counts every GPU's seconds by state, from the control
    plane's records, and the part of them requests used.
    """

    def test_each_gpu_sums_to_the_time_counted(self) -> None:
        """
        A replica starting 10 s, then awake 20 s with a request in flight
        5 of them, on n1's GPU; n2's GPU held by none: each GPU's seconds
        add up to the 30 s counted, split between the requests' and the
        idle, and priced at its node's price.
        """
        self.make(make_model(low=1), nodes=("n1", "n2"))
        busy = {"seconds": 0.0}
        prices = Prices(CostConfig(gpu_hour=(GpuPrice("H100", "", 3600.0),)))
        meter = GpuMeter(
            self.inventory, self.plane.ledger.shards, prices, lambda r: busy["seconds"]
        )
        self.plane.reconcile()
        counted = meter.tick(self.clock.seconds())
        self.clock.advance(10)
        counted += meter.tick(self.clock.seconds())
        self.ready_all()
        counted += meter.tick(self.clock.seconds())
        self.clock.advance(20)
        busy["seconds"] = 5.0
        counted += meter.tick(self.clock.seconds())
        rows = [GpuTimeRow(**vars(c)) for c in counted]
        gpus = {(g["node"], g["gpu"]): g for g in per_gpu(rows)}
        (node,) = {s.node for _, s in self.plane.ledger.shards()}
        other = ({"n1", "n2"} - {node}).pop()
        held, free = gpus[node, 0], gpus[other, 0]
        self.assertEqual(held["seconds"], 30.0)
        self.assertEqual(held["states"]["starting"], 10.0)
        self.assertEqual(held["states"]["awake"], 20.0)
        self.assertEqual((held["requests"], held["idle"]), (5.0, 25.0))
        self.assertEqual((held["cost"], held["requests_cost"]), (30.0, 5.0))
        self.assertEqual((free["seconds"], free["states"]["free"]), (30.0, 30.0))
        self.assertEqual(free["requests"], 0.0)

    def test_priced_endpoints(self) -> None:
        """
        The endpoints published carry each replica's GPUs and their price
        per hour; a static endpoint none.
        """
        self.make(make_model(low=1), nodes=("n1",))
        prices = Prices(CostConfig(gpu_hour=(GpuPrice("*", "", 2.0),)))
        meter = GpuMeter(self.inventory, self.plane.ledger.shards, prices, lambda r: 0)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (endpoint,) = self.published[-1]
        static = Endpoint("s", "http://s", ("x",))
        priced, still = meter.priced([endpoint, static])
        self.assertEqual((priced.gpus, priced.gpu_hour), (1.0, 2.0))
        self.assertEqual(still, static)


class SharedGpuTests(SynchronousTestCase):
    """
    A GPU shared by C{share_gpu} replicas counts each one's share of it,
    the rest free.
    """

    def test_shares_and_the_rest(self) -> None:
        """
        Two sharers of one GPU, given a quarter and a half of its memory:
        each holds its share, the last quarter is free; a sharer whose
        share is not known (adopted) gets an equal part of what is left.
        """
        inventory = Inventory()
        inventory.register(register_message("n1"), 0.0, 0.0)
        profile = Profile("s", "sim", "s", gpus=1, gpu_memory_gb=10, share_gpu=True)

        def replica(name: str, share: float) -> tuple[ReplicaRecord, ShardRecord]:
            shard = ShardRecord(name, "n1", (0,), 1, 0, ShardState.READY, share=share)
            return ReplicaRecord(name, name, profile, [shard], 0.0), shard

        pairs = [replica("a", 0.25), replica("b", 0.5)]
        (gpu,) = fleet_gpus(inventory, lambda: pairs, Prices())
        self.assertEqual(
            [(h.replica, h.weight, h.state) for h in gpu.holders],
            [("a", 0.25, "awake"), ("b", 0.5, "awake")],
        )
        pairs.append(replica("c", 0.0))
        (gpu,) = fleet_gpus(inventory, lambda: pairs, Prices())
        self.assertEqual([h.weight for h in gpu.holders], [0.25, 0.5, 0.25])


class CostBudgetTests(SynchronousTestCase):
    """
    A key's budget in cost (C{budget_cost}) refuses its requests once its
    requests' cost reaches it, as a token budget does.
    """

    def ring(self, share: int = 1, **limits: Any) -> KeyRing:
        ring = KeyRing(
            _NoStore(), clock=lambda: 0.0, wall_clock=lambda: 0.0, share=share
        )
        ring.load([_row(**limits)])
        return ring

    def test_refused_once_spent(self) -> None:
        """
        A budget of 1.0 with 0.25 spent before start: admitted while its
        requests cost less than the 0.75 left, then 429
        C{insufficient_quota} saying the cost budget.
        """
        ring = self.ring(budget_cost=1.0, cost_used=0.25)
        (key,) = ring.keys()
        ring.admit(key, ["m"])
        ring.used(key, 10, cost=0.5)
        ring.admit(key, ["m"])
        ring.used(key, 10, cost=0.25)
        with self.assertRaises(APIError) as raised:
            ring.admit(key, ["m"])
        self.assertEqual(
            (raised.exception.status, raised.exception.code),
            (429, "insufficient_quota"),
        )
        self.assertIn("cost budget", str(raised.exception))
        self.assertEqual(key.to_json()["cost_used"], 1.0)

    def test_shared_among_routers(self) -> None:
        """
        Two routers sharing the keys' limits each spend half of what was
        left at start.
        """
        ring = self.ring(share=2, budget_cost=1.0)
        (key,) = ring.keys()
        ring.admit(key, ["m"])
        ring.used(key, 1, cost=0.5)
        with self.assertRaises(APIError):
            ring.admit(key, ["m"])

    def test_no_budget(self) -> None:
        """
        Without a budget in cost, no cost refuses.
        """
        ring = self.ring()
        (key,) = ring.keys()
        ring.used(key, 1, cost=1e9)
        self.assertIsNone(ring.admit(key, ["m"]))


class _GpuStore:
    """
    The store's GPU time as L{MeterService} writes it.
    """

    def __init__(self) -> None:
        self.rows: list[GpuTimeRow] = []
        self.fail = False

    def add_gpu_time(self, rows: Sequence[GpuTimeRow]) -> Deferred[None]:
        if self.fail:
            return fail(RuntimeError("database away"))
        self.rows.extend(rows)
        return succeed(None)


class MeterServiceTests(PlaneCase):
    """
    The meter ticks while the server leads, its counts added to the store
    every L{WRITE_EVERY} seconds and at stop; a failed write is kept for
    the next.
    """

    def service(self, leading: list[bool]) -> tuple[MeterService, _GpuStore]:
        self.make(make_model(low=0), nodes=("n1",))
        meter = GpuMeter(
            self.inventory, self.plane.ledger.shards, Prices(), lambda r: 0
        )
        store = _GpuStore()
        service = MeterService(
            self.clock,
            meter,
            store,
            lambda: leading[0],
        )
        return service, store

    def seconds(self, store: _GpuStore) -> float:
        return sum(r.seconds for r in store.rows)

    def test_written_every_interval_and_at_stop(self) -> None:
        """
        25 s leading: 20 s written by the ticks (at 10 and 20 s), the
        last 5 at stop; nothing left on the clock.
        """
        service, store = self.service([True])
        service.startService()
        self.clock.pump([TICK] * 100)
        self.assertAlmostEqual(self.seconds(store), 20.0)
        self.assertEqual({r.state for r in store.rows}, {"free"})
        self.successResultOf(service.stopService())
        self.assertAlmostEqual(self.seconds(store), 25.0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_standby_counts_nothing(self) -> None:
        """
        While another server leads nothing is counted; from the lead on,
        the seconds since.
        """
        leading = [False]
        service, store = self.service(leading)
        service.startService()
        self.clock.pump([TICK] * 40)
        leading[0] = True
        self.clock.pump([TICK] * 40)
        self.successResultOf(service.stopService())
        self.assertAlmostEqual(self.seconds(store), 10.0 - TICK)

    def test_failed_write_kept(self) -> None:
        """
        A write that fails is added to the next: no second lost.
        """
        service, store = self.service([True])
        store.fail = True
        service.startService()
        self.clock.pump([TICK] * 44)
        self.assertEqual(store.rows, [])
        store.fail = False
        self.successResultOf(service.stopService())
        self.assertAlmostEqual(self.seconds(store), 11.0)
        self.flushLoggedErrors(RuntimeError)


def _request(request_id: str, gpu_seconds: float, cost: float) -> UsageRow:
    return UsageRow(
        request_id,
        1,
        "k",
        "m",
        "r",
        200,
        False,
        1,
        1,
        0.1,
        0.1,
        False,
        None,
        gpu_seconds=gpu_seconds,
        cost=cost,
    )


class UsageReportTests(TestCase):
    """
    The admin API's usage report (as the dashboard reads it too), over a
    real SQLite store: each group's GPU-seconds and cost, the GPU time no
    request was given as its own row (per day by day), each GPU's split.
    """

    async def test_idle_row_and_gpus(self) -> None:
        """
        Two requests of key k on day 1 (3 GPU-seconds, cost 1.5) and a GPU
        counted 10 s on day 1 (4 of them the requests') and 6 s on day 2:
        by key, k's sums and one idle row of 6 + 6 s; by day, an idle row
        per day; the GPU's 16 s split 4 and 12.
        """
        path = os.path.join(self.mktemp(), "llmgw.db")
        store = SQLiteStore(path)
        store.prepare()
        self.addCleanup(store.close)
        day = 86400.0
        rows = [
            _request("a", 2.0, 1.0),
            _request("b", 1.0, 0.5),
        ]
        await store.add_usage([(day + 10, r) for r in rows], {})
        awake = GpuTimeRow(day, "n1", 0, "H100", "m", "awake", 10.0, 4.0, 5.0, 2.0)
        free = GpuTimeRow(2 * day, "n1", 0, "H100", "", "free", 6.0, 0.0, 3.0, 0.0)
        await store.add_gpu_time([awake, free])
        routes = KeyRoutes(
            None, store, None, None, wall_clock=lambda: 3 * day, watch=None
        )
        by_key = await routes.usage("key", 0.0, None)
        (k,) = by_key["usage"]
        self.assertEqual((k["key"], k["gpu_seconds"], k["cost"]), ("k", 3.0, 1.5))
        self.assertEqual(by_key["idle"], [{"gpu_seconds": 12.0, "cost": 6.0}])
        (gpu,) = by_key["gpus"]
        self.assertEqual(
            (gpu["seconds"], gpu["requests"], gpu["idle"], gpu["states"]["free"]),
            (16.0, 4.0, 12.0, 6.0),
        )
        by_day = await routes.usage("day", 0.0, None)
        self.assertEqual(
            [(g["day"], g["requests"]) for g in by_day["usage"]], [(day, 2)]
        )
        self.assertEqual(
            by_day["idle"],
            [
                {"day": day, "gpu_seconds": 6.0, "cost": 3.0},
                {"day": 2 * day, "gpu_seconds": 6.0, "cost": 3.0},
            ],
        )


class BalancerBusyTests(SynchronousTestCase):
    """
    The router's busy seconds per replica, as the meter reads them: up to
    now while a request is in flight, and kept when the replica leaves
    the endpoint list (put to sleep as its last request ended).
    """

    def test_busy_kept_across_the_list(self) -> None:
        """
        A request of 3 s, read 1 s in (1 s busy), then the replica taken
        out of the list as it ends: its 3 s are still read; back in the
        list, its next request's seconds add to them.
        """
        clock = Clock()
        endpoint = Endpoint("r1", "http://r1", ("m",), gpus=1.0)
        balancer = Balancer(clock, 10)
        balancer.set_endpoints([endpoint])
        (replica,) = balancer.replicas_of("m")
        mark = replica.enter(clock.seconds())
        clock.advance(1)
        self.assertEqual(balancer.busy("r1"), 1.0)
        clock.advance(2)
        replica.leave(clock.seconds(), mark)
        balancer.set_endpoints([])
        self.assertEqual(balancer.busy("r1"), 3.0)
        balancer.set_endpoints([endpoint])
        (again,) = balancer.replicas_of("m")
        mark = again.enter(clock.seconds())
        clock.advance(2)
        again.leave(clock.seconds(), mark)
        self.assertEqual(balancer.busy("r1"), 5.0)
