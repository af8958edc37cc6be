"""
The catalog at run time, and the router's side of the control plane
(L{llmgw.router.interfaces.Activator}): each model's state by name, every name
and alias that leads to it, activation and use.  Models come from the
configuration and the admin API (added and removed while the server
runs); the reconciler (L{llmgw.control.plane}) places what they want.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.config_checks import ConfigError
from llmgw.control.catalog import MAX_COUNT, Model, check_adapter
from llmgw.control.held_order import refused_first, release_turns
from llmgw.control.inventory import Inventory, NodeState
from llmgw.control.placement import GpuView, NodeView, never_fits
from llmgw.control.scaling import ModelState
from llmgw.router.interfaces import (
    ActivationRefused,
    Endpoint,
    NeverPlaceable,
    Standing,
)

RELEASE_GAP = 0.2
"""
Seconds between the turns in which the requests held for a model that
became ready are let go (L{ModelCatalog.release}): one turn per priority,
the highest first.  Long enough for a router of the tier to have sent the
requests of a turn to the engine (a loopback or LAN round trip and a
connection) before the next turn's answers leave the server, so that the
engine's first places go to the fleet's highest priority whichever router
holds it; short beside a start (seconds).
"""


class ModelCatalog:
    """
    @param clock: the reactor's clock.
    @param inventory: the nodes (L{why_not} says when none is connected).
    @param models: the configuration's catalog.
    @param static: the configuration's endpoints; the model names they
        serve cannot be taken by a catalog model.
    @param changed: called when what the reconciler reads changed: kicks
        a pass.
    @param touched: told each model touched (the control plane's dirty
        set, L{llmgw.control.changes}).
    @param adapters_changed: told the base model whose adapters changed
        (its endpoints list them).
    @param standing: where a request held for a model stands (the control
        plane's swap queue, L{llmgw.control.swaps}).
    @param bound: requests that may be held per model across the fleet
        (C{[router] activation_queue}, the bound each router also keeps on
        its own), at least 1; L{None} for no bound.  Past it the lowest
        priority's newest is refused (L{activate}).
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        inventory: Inventory,
        models: Sequence[Model],
        static: Sequence[Endpoint],
        changed: Callable[[], None],
        touched: Callable[[str], None] = lambda model: None,
        adapters_changed: Callable[[str], None] = lambda base: None,
        standing: Callable[[str], Standing] = lambda model: Standing(""),
        bound: int | None = None,
    ) -> None:
        self.clock = clock
        self.inventory = inventory
        adapters = [m for m in models if m.base is not None]
        models = [m for m in models if m.base is None]
        self._models: dict[str, ModelState] = {m.name: ModelState(m) for m in models}
        self._names: dict[str, str] = {name: m.name for m in models for name in m.names}
        # LoRA adapters by name: no state of their own (their requests
        # activate and touch their base); the plane never sees them.
        self._adapters: dict[str, Model] = {}
        for adapter in adapters:
            try:
                check_adapter(adapter, self.model(adapter.base or ""))
            except ConfigError as e:
                self.log.warn(
                    "adapter {name} is skipped: {error}", name=adapter.name, error=e
                )
                continue
            self._adapters[adapter.name] = adapter
            self._names.update((name, adapter.name) for name in adapter.names)
        self.adapters_changed = adapters_changed
        # The last answer of unplaceable per model: its warning once.
        self._unplaceable: dict[str, str | None] = {}
        self._static = tuple(static)
        self._changed = changed
        # Catalog order, for a pass that looks at some models only.
        self._order = itertools.count()
        self._position = {m.name: next(self._order) for m in models}
        # Models a request waits for (some may no longer have waiters).
        self.waiting: set[str] = set()
        self.touched = touched
        # Requests that waited for an activation, and their seconds waited
        # (the fleet metrics' summary).
        self.activation_waits = 0
        self.activation_wait_seconds = 0.0
        self._standing = standing
        self._bound = bound
        # Held requests refused because the fleet held more than the
        # bound, per model (the fleet metrics' counter).
        self.refused: dict[str, int] = {}

    def resolve(self, name: str) -> str | None:
        """
        @return: the catalog model C{name} names (itself or an alias), or
            L{None}.
        """
        return self._names.get(name)

    def names(self) -> list[str]:
        """
        @return: every catalog name and alias, sorted.
        """
        return sorted(self._names)

    def adapter(self, name: str) -> Model | None:
        """
        @return: the LoRA adapter named C{name} (not an alias), if any.
        """
        return self._adapters.get(name)

    def adapter_names(self) -> list[str]:
        """
        @return: the LoRA adapters' model names, sorted.
        """
        return sorted(self._adapters)

    def adapters_of(self, base: str) -> list[Model]:
        """
        @return: the adapters declared on the model named C{base}, in the
            order they were added.
        """
        return [a for a in self._adapters.values() if a.base == base]

    def _base(self, name: str) -> str | None:
        """
        @return: the catalog model C{name} leads to: an adapter's base.
        """
        model = self._names.get(name)
        adapter = self._adapters.get(model) if model is not None else None
        return adapter.base if adapter is not None else model

    def static_endpoints(self) -> tuple[Endpoint, ...]:
        """
        @return: the endpoints from the configuration.
        """
        return self._static

    def model(self, name: str) -> Model | None:
        """
        @return: the catalog model named C{name} (not an alias), if any.
        """
        state = self._models.get(name)
        return state.model if state is not None else None

    def get(self, model: str) -> ModelState | None:
        """
        @return: the state of the model named C{model} (not an alias), if
            any.
        """
        return self._models.get(model)

    def __getitem__(self, name: str) -> ModelState:
        """
        @return: the state of the model C{name} names (itself or an
            alias).
        @raise KeyError: not a catalog name.
        """
        base = self._base(name)
        if base is None:
            raise KeyError(name)
        return self._models[base]

    def position(self, model: str) -> int:
        """
        @return: where the model named C{model} is in catalog order.
        @raise KeyError: no such model.
        """
        return self._position[model]

    def __contains__(self, model: str) -> bool:
        return model in self._models

    def states(self) -> list[ModelState]:
        """
        @return: each model's state, in catalog order.
        """
        return list(self._models.values())

    def activate(
        self, name: str, priority: int = 1, waited: float = 0.0
    ) -> Deferred[None]:
        """
        A request for C{name} found no ready replica: ask for one.

        @param priority: the waiting request's priority number
            (L{llmgw.router.routing.fairness}: higher goes first; 1 is
            C{standard}): the swap queue serves the models holding the
            highest first.
        @param waited: seconds the request has waited already elsewhere
            (a router of a tier asking again): its arrival, for the swap
            queue's order and C{swap_max_wait}, is that long ago.
        @return: fires when a replica of the model is published; cancel it
            to stop waiting.  Fails with L{ActivationRefused} when the
            fleet then holds more requests for the model than its bound
            and this one is the lowest priority's newest (at once: it is
            the newcomer), or later, when a request of a higher priority
            comes, from whichever router, and takes its place.
            Fails at once with L{NeverPlaceable} when no node could ever
            hold it (L{unplaceable}).
        @raise KeyError: C{name} is not in the catalog.
        """
        state = self[name]
        why = self.unplaceable(state.model.name)
        if why is not None:
            return fail(NeverPlaceable(state.model.name, why))
        state.last_used = self.clock.seconds()
        if state.wanted < 1:
            state.wanted = 1
            self.log.info(
                "activating model {model}: a request is waiting", model=state.model.name
            )
        waiter: Deferred[None] = Deferred(
            lambda d: state.waiters.remove(d) if d in state.waiters else None
        )
        started = self.clock.seconds()

        def ended(result: object) -> object:
            state.held.pop(waiter, None)
            self.activation_waits += 1
            self.activation_wait_seconds += self.clock.seconds() - started
            return result

        waiter.addBoth(ended)
        state.held[waiter] = (started - max(0.0, waited), priority)
        state.waiters.append(waiter)
        self.waiting.add(state.model.name)
        self._changed()
        if self._bound is not None and len(state.waiters) > self._bound:
            self._refuse(state)
        return waiter

    def _refuse(self, state: ModelState) -> None:
        """
        The fleet holds more requests for C{state}'s model than the bound:
        fail the lowest priority's newest (L{refused_first}) with
        L{ActivationRefused}; the router that holds it answers its client
        as its own full queue does.
        """
        now = self.clock.seconds()
        index = refused_first([state.held.get(w, (now, 1)) for w in state.waiters])
        if index is None:
            return
        waiter = state.waiters.pop(index)
        arrival, rank = state.held.get(waiter, (now, 1))
        name = state.model.name
        self.refused[name] = self.refused.get(name, 0) + 1
        self.log.debug(
            "refused a request held for model {model} (priority {rank}, waited"
            " {waited:.3f}s): more than {bound} held across the fleet",
            model=name,
            rank=rank,
            waited=now - arrival,
            bound=self._bound,
        )
        waiter.errback(ActivationRefused(name))

    def release(self, name: str) -> None:
        """
        A replica of model C{name} is published: let go the requests held
        for it, in the fleet's order (L{release_turns}: the highest
        priority first, oldest first within one), whichever router holds
        them: the requests of the first turn now, each next turn
        L{RELEASE_GAP} seconds after the one before.  A request that stops
        waiting meanwhile (its router gave up) is skipped.
        """
        state = self._models.get(name)
        if state is None or not state.waiters:
            return
        waiters, state.waiters = state.waiters, []
        now = self.clock.seconds()
        turns = release_turns([state.held.get(w, (now, 1)) for w in waiters])
        for number, turn in enumerate(turns):
            going = [waiters[i] for i in turn]
            if number == 0:
                _let_go(going)
            else:
                self.clock.callLater(number * RELEASE_GAP, _let_go, going)

    def touch(self, name: str) -> None:
        """
        A request for C{name} came: it is not idle (an adapter's base).
        """
        model = self._base(name)
        if model is not None and model in self._models:
            self._models[model].last_used = self.clock.seconds()
            self.touched(model)

    def why_not(self, name: str) -> str:
        """
        @return: why the model has no ready replica, in a few words fit for
            a client (no node names or addresses), or C{""}.
        """
        model = self._base(name)
        state = self._models.get(model) if model is not None else None
        if state is None:
            return ""
        if state.no_fit is not None:
            return "no node has room for it now"
        if state.failures:
            return f"its last {state.failures} starts failed"
        if not any(n.state == NodeState.READY for n in self.inventory.nodes()):
            return "no node is connected"
        return ""

    def where(self, name: str) -> Standing:
        """
        @return: where a request held for C{name} (a model or an alias)
            stands: what the control plane is doing for it (waking a
            replica, evicting others, its place in the swap queue) and when
            a replica is expected; C{Standing("")} when nothing is known.
        """
        model = self._base(name)
        if model is None:
            return Standing("")
        return self._standing(model)

    def unplaceable(self, name: str) -> str | None:
        """
        Whether model C{name} could never be placed on the nodes known now
        (L{never_fits}: whatever is freed); a warning is logged each time
        the answer changes to a reason.  It looks at every node: asked
        when a request finds no ready replica, a model is added, or the
        start-up grace ends, not in every pass.

        @return: why, or L{None} (also for a name not a model here, and
            while no node is known).
        """
        state = self._models.get(name)
        if state is None:
            return None
        views = [
            NodeView(
                id=node.id,
                state=str(node.state),
                fabrics=frozenset(node.fabrics),
                gpus=tuple(
                    GpuView(g.index, g.name, g.memory_total_mib) for g in node.gpus
                ),
            )
            for node in self.inventory.nodes()
        ]
        why = never_fits(state.model.profiles, views)
        if why is not None and self._unplaceable.get(name) != why:
            self.log.warn(
                "model {model} can never be placed on this fleet: {why}; its"
                " requests are answered 503 at once",
                model=name,
                why=why,
            )
        self._unplaceable[name] = why
        return why

    def add(self, model: Model) -> None:
        """
        Add a model; its replicas are placed by the next pass.  An
        adapter is added to its base's replicas' names.

        @raise ValueError: one of its names is taken; an adapter's base
            cannot load it (L{check_adapter}'s message).
        """
        static = {name for e in self._static for name in e.models}
        for name in model.names:
            if name in self._names:
                owner = self._names[name]
                what = "model" if owner == name else f"an alias of model {owner!r}"
                raise ValueError(f"name {name!r} is already {what}")
            if name in static:
                raise ValueError(f"name {name!r} is served by a static endpoint")
        if model.base is not None:
            try:
                check_adapter(model, self.model(model.base) or self.adapter(model.base))
            except ConfigError as e:
                raise ValueError(str(e)) from None
            self._adapters[model.name] = model
            self._names.update((name, model.name) for name in model.names)
            self.adapters_changed(model.base)
            self._changed()
            return
        self._models[model.name] = ModelState(model)
        self._position[model.name] = next(self._order)
        for name in model.names:
            self._names[name] = model.name
        self.unplaceable(model.name)
        self._changed()

    def remove(self, model: str) -> None:
        """
        Remove a model: its replicas drain and stop; requests waiting for
        it are let go (they find no replica: 503).  An adapter leaves its
        base's replicas' names.

        @raise KeyError: no model named C{model}.
        @raise ValueError: it is the base of adapters (named).
        """
        adapter = self._adapters.pop(model, None)
        if adapter is not None:
            for name in adapter.names:
                self._names.pop(name, None)
            self.adapters_changed(adapter.base or "")
            self._changed()
            return
        if model in self._models and (uses := self.adapters_of(model)):
            raise ValueError(
                f"model {model!r} is the base of adapters"
                f" {', '.join(a.name for a in uses)}: remove them first"
            )
        state = self._models.pop(model)
        del self._position[model]
        for alias in state.model.names:
            self._names.pop(alias, None)
        waiters, state.waiters = state.waiters, []
        for waiter in waiters:
            waiter.callback(None)
        self._changed()


def _let_go(waiters: Sequence[Deferred[None]]) -> None:
    """
    Fire each of C{waiters} still waiting, in order.
    """
    for waiter in waiters:
        if not waiter.called:
            waiter.callback(None)


def check_bounds(min_replicas: int, max_replicas: int) -> None:
    """
    @raise ValueError: not C{0 <= min_replicas <= max_replicas} with
        C{1 <= max_replicas <= MAX_COUNT}.
    """
    if (
        min_replicas < 0
        or not 1 <= max_replicas <= MAX_COUNT
        or min_replicas > max_replicas
    ):
        raise ValueError(
            f"expected 0 <= min_replicas <= max_replicas, 1 <= max_replicas;"
            f" got {min_replicas} and {max_replicas}"
        )
