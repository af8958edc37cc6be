"""
What every exchange of a router shares (L{llmgw.router.api.exchange}).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.router.interfaces import Activator
from llmgw.router.routing.activation import ActivationQueues
from llmgw.router.routing.adapters import AdapterLoads
from llmgw.router.routing.balancer import Balancer
from llmgw.router.routing.overload import Overload
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.router.upstream.base import Upstream


@dataclass(frozen=True)
class Services:
    """
    What every exchange of a router shares.

    @ivar clock: the reactor's clock, for deadlines.
    @ivar activating: the activation queues (shared, mutable).
    @ivar log: where failures of replicas are logged.
    @ivar overload: the waiting room for overloaded models, or L{None}.
    @ivar adapters: the LoRA adapters loaded on each replica: the
        balancer's, which narrows an adapter's replicas by them.
    """

    clock: IReactorTime
    settings: RouterConfig
    balancer: Balancer
    upstream: Upstream
    metrics: RouterMetrics
    activator: Activator | None
    activating: ActivationQueues
    log: Logger
    overload: Overload | None = None
    adapters: AdapterLoads = field(init=False)

    def __post_init__(self) -> None:
        adapters = self.balancer.adapters
        if adapters is None:
            # A balancer built without them (a router alone, in tests)
            # narrows nothing; the exchanges still load adapters, counted.
            loads = self.metrics.adapter_loads
            adapters = AdapterLoads(
                self.upstream,
                self.settings.affinity_epsilon,
                lambda adapter, outcome: loads.labels(adapter, outcome).inc(),
                clock=self.clock,
            )
        object.__setattr__(self, "adapters", adapters)
