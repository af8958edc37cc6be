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
import re
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
from tests.test_architecture import ROOT, modules

PACKAGES = (llmgw.server, llmgw.tier, llmgw.daemon)

LEFT: list[tuple[str, str, str]] = [
    ("server/standby.py", "self._loop.clock", "LoopingCall.clock, Twisted's idiom"),
    ("tier/activate.py", "self._flush.clock", "LoopingCall.clock, Twisted's idiom"),
    ("tier/keys.py", "key.revoked", "ApiKey is a dataclass record"),
    ("tier/report.py", "self._loop.clock", "LoopingCall.clock, Twisted's idiom"),
    ("tier/tap.py", "self._check.clock", "LoopingCall.clock, Twisted's idiom"),
    ("tier/watch.py", "self._tick.clock", "LoopingCall.clock, Twisted's idiom"),
]
"""
(path below llmgw, the target as written, why it stays), once per
assignment.
"""

LEFT_API: list[tuple[str, str, str]] = [
    ("router/api/app.py", "app.url_map.merge_slashes", "werkzeug's map, Klein's idiom"),
    ("router/api/batch_api.py", "app.url_map.merge_slashes", "the same, for batches"),
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


# The whole of llmgw: no object of an llmgw class (or an outside one) has
# an attribute assigned from outside, but records and Twisted's idioms.
# An owner's class is read from what the source says of it: a parameter's
# or a name's annotation, a constructor call, or the parameter an
# attribute of self was set from in __init__.

IDIOMS: dict[tuple[str, str], str] = {
    ("LoopingCall", "clock"): "LoopingCall takes no clock argument: Twisted's"
    " tests and docs set it so",
    ("IRequest", "prepath"): "Twisted's resource traversal moves path segments so",
    ("IRequest", "postpath"): "Twisted's resource traversal moves path segments so",
    ("AgentProtocol", "factory"): "Twisted's buildProtocol sets a protocol's factory",
}
"""
(the owner's class, the attribute): why it may be assigned from outside.
"""


def _class_name(annotation: ast.expr | None) -> str | None:
    """
    @return: the one class an annotation names (C{X | None} is C{X};
        C{a.b.X[Y]} is C{X}), or L{None}.
    """
    if annotation is None:
        return None
    text = ast.unparse(annotation).strip("'\"")
    parts = [p.strip() for p in text.split("|") if p.strip() != "None"]
    if len(parts) != 1:
        return None
    return parts[0].split("[")[0].split(".")[-1]


def _is_record(node: ast.ClassDef) -> bool:
    decorators = [ast.unparse(d) for d in node.decorator_list]
    bases = [ast.unparse(b) for b in node.bases]
    return any("dataclass" in d for d in decorators) or any(
        b in ("NamedTuple", "TypedDict") for b in bases
    )


def _protobuf_messages() -> set[str]:
    with open(os.path.join(ROOT, "wire", "agent_pb2.pyi"), encoding="utf-8") as f:
        return set(re.findall(r"^class (\w+)\(_message\.Message\)", f.read(), re.M))


def _self_attribute_classes(node: ast.ClassDef) -> dict[str, str | None]:
    """
    @return: the class of each attribute of C{self} a method of C{node}
        annotates, builds by a constructor call, or sets from an annotated
        parameter.
    """
    found: dict[str, str | None] = {}
    for method in node.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        arguments = method.args.args + method.args.kwonlyargs
        parameters = {a.arg: _class_name(a.annotation) for a in arguments}
        for part in ast.walk(method):
            targets: list[ast.expr]
            value: ast.expr | None
            if isinstance(part, ast.AnnAssign):
                targets, value = [part.target], None
                annotated = _class_name(part.annotation)
            elif isinstance(part, ast.Assign):
                targets, value, annotated = part.targets, part.value, None
            else:
                continue
            for target in targets:
                if not (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    continue
                if annotated is not None:
                    found[target.attr] = annotated
                elif isinstance(value, ast.Name) and value.id in parameters:
                    found.setdefault(target.attr, parameters[value.id])
                elif isinstance(value, ast.Call):
                    found.setdefault(target.attr, _class_name(value.func))
    return found


def _local_classes(
    function: ast.FunctionDef | ast.AsyncFunctionDef,
) -> dict[str, str | None]:
    """
    @return: the class of each parameter and local name of C{function}
        that its source says (an annotation, a constructor call).
    """
    arguments = function.args.args + function.args.kwonlyargs
    found = {a.arg: _class_name(a.annotation) for a in arguments}
    for part in ast.walk(function):
        if isinstance(part, ast.AnnAssign) and isinstance(part.target, ast.Name):
            found.setdefault(part.target.id, _class_name(part.annotation))
        elif isinstance(part, ast.Assign) and isinstance(part.value, ast.Call):
            for target in part.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, _class_name(part.value.func))
    return found


def typed_ties(trees: dict[str, ast.Module]) -> list[str]:
    """
    @param trees: path -> module, the code to read.
    @return: C{"path: target (Class)"} for each attribute of an object of
        a known class other than a record assigned from outside that
        object, but L{IDIOMS}.
    """
    classes: dict[str, ast.ClassDef] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node
    records = {name for name, node in classes.items() if _is_record(node)}
    records |= _protobuf_messages()
    found = []

    def walk(path: str, node: ast.AST, owner: ast.ClassDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(path, child, child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                check(path, child, owner)
                walk(path, child, owner)
            else:
                walk(path, child, owner)

    def check(
        path: str,
        function: ast.FunctionDef | ast.AsyncFunctionDef,
        owner: ast.ClassDef | None,
    ) -> None:
        names = _local_classes(function)
        attributes = _self_attribute_classes(owner) if owner is not None else {}
        for target in foreign_assignments(ast.unparse(function)):
            base, _, attribute = target.rpartition(".")
            if base.startswith("self.") and base.count(".") == 1:
                kind = attributes.get(base[5:])
            else:
                kind = names.get(base)
            if kind is None or kind in records or (kind, attribute) in IDIOMS:
                continue
            if kind[:1].isupper() and kind != "Any":
                found.append(f"{path}: {target} ({kind})")

    for path, tree in trees.items():
        walk(path, tree, None)
    return sorted(set(found))


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


class TypedTiesTests(SynchronousTestCase):
    """
    Across llmgw, no object of a class with behaviour has an attribute
    assigned from outside it (L{typed_ties}).
    """

    def test_none_in_llmgw(self) -> None:
        trees = {}
        for _, path in modules():
            if path.endswith("_pb2.py"):
                continue
            with open(path, encoding="utf-8") as f:
                trees[os.path.relpath(path, os.path.dirname(ROOT))] = ast.parse(
                    f.read()
                )
        self.assertGreater(len(trees), 100)
        self.assertEqual(typed_ties(trees), [])

    def test_finds_ties_by_what_the_source_says(self) -> None:
        """
        An owner's class is known from a parameter's annotation, a
        constructor call, or the annotated parameter an attribute of
        C{self} was set from; a record's fields and Twisted's idioms are
        not ties, nor an owner of no known class.
        """
        source = textwrap.dedent(
            """
            @dataclass
            class Record:
                x: int = 0

            class Board:
                def __init__(self, hub: Hub) -> None:
                    self._hub = hub
                    self._loop = LoopingCall(self.tick)

                def wire(self, balancer: Balancer, record: Record, thing) -> None:
                    balancer.load = self
                    router = Router()
                    router.tracing = None
                    self._hub.listener = self
                    self._loop.clock = None
                    record.x = 1
                    thing.y = 2

            class Hub:
                pass
            """
        )
        self.assertEqual(
            typed_ties({"x.py": ast.parse(source)}),
            [
                "x.py: balancer.load (Balancer)",
                "x.py: router.tracing (Router)",
                "x.py: self._hub.listener (Hub)",
            ],
        )
