"""
The daemons' wiring makes its ties at construction: no module of
C{llmgw/server}, C{llmgw/tier} or C{llmgw/daemon} assigns an attribute of
an object other than C{self} (C{balancer.load = ...}), and the constructors
the taps call tie nothing into their collaborators.  Read from the source
with L{ast}.

The few assignments left are listed with their reason: Twisted's own
idioms with no constructor argument, a data record filled in, and the
fields of L{llmgw.control}'s objects (C{AgentHub}, C{Inventory}) that
still take them after construction: remove an entry once its object
takes the tie in C{__init__}.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

import llmgw.daemon
import llmgw.router.api
import llmgw.server
import llmgw.tier
from llmgw.router.api.app import Router
from llmgw.router.api.services import Services
from llmgw.router.routing.balancer import Balancer

PACKAGES = (llmgw.server, llmgw.tier, llmgw.daemon)

LEFT: list[tuple[str, str, str]] = [
    ("server/standby.py", "self._loop.clock", "LoopingCall.clock, Twisted's idiom"),
    ("tier/activate.py", "self._flush.clock", "LoopingCall.clock, Twisted's idiom"),
    ("tier/keys.py", "key.revoked", "ApiKey is a dataclass record"),
    ("tier/tap.py", "self._check.clock", "LoopingCall.clock, Twisted's idiom"),
    ("tier/watch.py", "self._tick.clock", "LoopingCall.clock, Twisted's idiom"),
]
"""
(path below llmgw, the target as written, why it stays), once per
assignment.
"""

LEFT_API: list[tuple[str, str, str]] = [
    ("router/api/app.py", "app.url_map.merge_slashes", "werkzeug's map, Klein's idiom"),
    ("router/api/exchange.py", "replica.outstanding", "the balancer's count, +1"),
    ("router/api/exchange.py", "replica.outstanding", "the balancer's count, -1"),
]
"""
The same for the router's C{api} room, where a request's exchange and its
waits keep their own state (L{llmgw.router.api.waiting.Waits}).
"""


def foreign_assignments(source: str) -> list[str]:
    """
    @param source: Python source.
    @return: each target of an assignment (plain, annotated or augmented)
        that is an attribute of something other than C{self} or C{cls},
        as written, in the order found.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: Iterable[ast.expr] = ()
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if not isinstance(part, ast.Attribute):
                    continue
                if not isinstance(part.ctx, ast.Store):
                    continue
                owner = part.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                found.append(ast.unparse(part))
    return found


def package_assignments(
    packages: Iterable[Any] = PACKAGES,
) -> list[tuple[str, str]]:
    """
    @param packages: the packages read, modules.
    @return: C{(path below llmgw, target)} of each assignment to another
        object's attribute in C{packages} (by default L{PACKAGES}), sorted.
    """
    top = os.path.dirname(os.path.dirname(os.path.abspath(llmgw.server.__file__)))
    found = []
    for package in packages:
        folder = os.path.dirname(os.path.abspath(package.__file__ or ""))
        for where, _, files in os.walk(folder):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(where, name)
                with open(path, encoding="utf-8") as f:
                    targets = foreign_assignments(f.read())
                relative = os.path.relpath(path, top).replace(os.sep, "/")
                found += [(relative, target) for target in targets]
    return sorted(found)


class TiesTests(SynchronousTestCase):
    """
    The wiring's ties are constructor arguments.
    """

    def test_wiring_assigns_no_other_object(self) -> None:
        """
        The server's, the router tier's and the daemons' modules assign no
        attribute of another object beyond those listed in L{LEFT}.
        """
        self.assertEqual(
            package_assignments(), sorted((path, target) for path, target, _ in LEFT)
        )

    def test_exchange_assigns_no_other_object(self) -> None:
        """
        The router's C{api} room (the routes, the exchange, its waits, the
        request's record) assigns no attribute of another object beyond
        those listed in L{LEFT_API}: the exchange's state is set by its
        constructor and its own methods, its waits' by theirs.
        """
        self.assertEqual(
            package_assignments([llmgw.router.api]),
            sorted((path, target) for path, target, _ in LEFT_API),
        )

    def test_constructors_tie_nothing(self) -> None:
        """
        The router's and its balancer's constructors, and the exchanges'
        shared services, assign no field of their collaborators (the
        balancer's metrics, its adapters' loads, their count).
        """
        constructors: list[Callable[..., Any]] = [
            Router.__init__,
            Balancer.__init__,
            Services.__post_init__,
        ]
        for constructor in constructors:
            source = textwrap.dedent(inspect.getsource(constructor))
            self.assertEqual(foreign_assignments(source), [], constructor)

    def test_finds_each_kind_of_assignment(self) -> None:
        """
        The reading finds a plain, an annotated, an augmented and a
        chained assignment to another object's attribute, and a tuple's,
        and passes over C{self}'s and a local name's.
        """
        source = textwrap.dedent(
            """
            balancer.load = board
            router.tracing: Any = tracing
            counts.total += 1
            a = guard.enabled = True
            first.x, self.y = 1, 2
            self.load = board
            cls.app = app
            local = 3
            """
        )
        self.assertEqual(
            foreign_assignments(source),
            [
                "balancer.load",
                "router.tracing",
                "counts.total",
                "guard.enabled",
                "first.x",
            ],
        )
