"""
One object, one job (docs/architecture.md, "The control plane's layers"):
the shape of llmgw's classes and modules read from the source with L{ast}.
(No import circle: C{tests/test_import_circles.py}; no tie made after
construction: C{tests/test_ties.py}.)

  - The control plane's parts import one way, in layers
    (L{CONTROL_LAYERS}): each is built with the parts below it it calls.
  - No class has more than one base that is an llmgw class with methods
    or state (one object in several files); Twisted's interfaces, its
    C{Protocol} and C{Service} bases and one behaviour mixin with its own
    state (Twisted's C{TimeoutMixin}) aside.
  - No method is a stub of another's (C{raise NotImplementedError}),
    but in the store's interface, which its two engines implement.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re

from twisted.trial.unittest import SynchronousTestCase

from tests.test_architecture import ROOT, all_edges, imports_of, modules

DOCS = os.path.join(os.path.dirname(ROOT), "docs")

CONTROL_LAYERS: tuple[tuple[str, ...], ...] = (
    # The records.
    ("llmgw.control.ledger",),
    # What reads the records only: placement's view of the inventory, the
    # router's list, the sleepers' room.
    ("llmgw.control.snapshot", "llmgw.control.publishing", "llmgw.control.sleeping"),
    # What is done to one replica, and its answers.
    ("llmgw.control.actions",),
    # Making room for a held model.
    ("llmgw.control.swaps",),
    # Bringing a model up: wake, else make room, else place.
    ("llmgw.control.placing",),
    # The operator's drains, sleep, wake and pin; the agents' reports.
    ("llmgw.control.drains", "llmgw.control.operating", "llmgw.control.reports"),
    # Scaling a model in a pass.
    ("llmgw.control.scaler",),
    # The wiring and the pass.
    ("llmgw.control.plane",),
)
"""
The control plane's parts, lowest first: a module may import the parts of
the layers below its own, never one of its own layer or above.
"""

STUB_ALLOWED = {
    ("llmgw/store/base.py", "Store"): "the store's interface: SQLite and"
    " PostgreSQL implement it",
}
"""
Classes whose methods may raise C{NotImplementedError}, and why.
"""

MIXINS = {
    "TimeoutMixin": "Twisted's one behaviour with its own state",
    "Generic": "typing, not a base with state",
}
"""
Bases a class may have beside its one base of state and methods.
"""


def layer_violations(
    edges: dict[str, set[str]],
    layers: tuple[tuple[str, ...], ...] = CONTROL_LAYERS,
) -> list[str]:
    """
    @param edges: module name -> the llmgw modules it imports.
    @return: one line per import of a part of the same or a higher layer.
    """
    level = {module: i for i, layer in enumerate(layers) for module in layer}
    found = []
    for module, imported in edges.items():
        if module not in level:
            continue
        for target in sorted(imported):
            if target in level and target != module and level[target] >= level[module]:
                found.append(
                    f"{module} (layer {level[module]}) imports {target}"
                    f" (layer {level[target]})"
                )
    return sorted(found)


class ClassInfo:
    """
    A class of llmgw as the source shows it.
    """

    def __init__(self, path: str, node: ast.ClassDef) -> None:
        self.path = path
        self.name = node.name
        self.bases = [ast.unparse(b) for b in node.bases]
        self.has_body = any(
            isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef, ast.AnnAssign))
            for b in node.body
        )
        self.stubs = [
            f.name
            for f in node.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any(
                isinstance(n, ast.Raise)
                and n.exc is not None
                and "NotImplementedError" in ast.unparse(n.exc)
                for n in ast.walk(f)
            )
        ]


def classes() -> list[ClassInfo]:
    """
    @return: every class defined in llmgw.
    """
    found: list[ClassInfo] = []
    for _, path in modules():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        # Against the package's folder, as modules() names them: a
        # checkout in a folder itself named llmgw has "/llmgw/" twice.
        relative = os.path.relpath(path, os.path.dirname(ROOT))
        found.extend(
            ClassInfo(relative, n)
            for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef)
        )
    return found


def spread_classes(found: list[ClassInfo]) -> list[str]:
    """
    @return: one line per class with more than one base that is an llmgw
        class with methods or state (not an interface, not a mixin of
        L{MIXINS}).
    """
    ours = {c.name: c for c in found if c.has_body}
    lines = []
    for info in found:
        bases = [
            b
            for b in info.bases
            if b.split("[")[0] in ours
            and not b.startswith("I")
            and b.split("[")[0] not in MIXINS
        ]
        if len(bases) > 1:
            lines.append(f"{info.path}: {info.name}({', '.join(bases)})")
    return sorted(lines)


def stub_lines(found: list[ClassInfo]) -> list[str]:
    """
    @return: one line per method raising C{NotImplementedError} outside
        L{STUB_ALLOWED}.
    """
    return sorted(
        f"{c.path}: {c.name}.{name}"
        for c in found
        if (c.path, c.name) not in STUB_ALLOWED
        for name in c.stubs
    )


class ControlLayerTests(SynchronousTestCase):
    """
    The control plane's parts import one way.
    """

    def test_layers_kept(self) -> None:
        """
        No part imports one of its own layer or above.
        """
        self.assertEqual(layer_violations(all_edges()), [])

    def test_every_part_is_read(self) -> None:
        """
        Each module the layers name exists, so a rule cannot pass because
        its module was never read.
        """
        names = dict(modules())
        for layer in CONTROL_LAYERS:
            for module in layer:
                self.assertIn(module, names)
                self.assertTrue(imports_of(module, names[module]))

    def test_finds_an_upward_import(self) -> None:
        """
        The records importing the plane, or two parts of one layer
        importing each other, are found.
        """
        edges = {
            "llmgw.control.ledger": {"llmgw.control.plane"},
            "llmgw.control.drains": {"llmgw.control.reports"},
            "llmgw.control.swaps": {"llmgw.control.actions"},
        }
        self.assertEqual(
            layer_violations(edges),
            [
                "llmgw.control.drains (layer 5) imports llmgw.control.reports"
                " (layer 5)",
                "llmgw.control.ledger (layer 0) imports llmgw.control.plane (layer 7)",
            ],
        )


class ClassShapeTests(SynchronousTestCase):
    """
    One object is one class: no object spread over several bases, no stubs
    of a sibling's methods.
    """

    def test_no_object_in_several_bases(self) -> None:
        self.assertEqual(spread_classes(classes()), [])

    def test_no_stub(self) -> None:
        self.assertEqual(stub_lines(classes()), [])

    def test_finds_a_spread_object_and_its_stubs(self) -> None:
        """
        A class made of two llmgw classes with methods is found, and the
        stub one of them holds for the other; an interface base and a
        mixin of L{MIXINS} are not counted.
        """
        source = (
            "class A:\n    def f(self):\n        raise NotImplementedError()\n"
            "class B:\n    def g(self):\n        return 1\n"
            "class IThing:\n    def h(self):\n        pass\n"
            "class TimeoutMixin:\n    def t(self):\n        pass\n"
            "class C(A, B):\n    pass\n"
            "class D(B, IThing, TimeoutMixin):\n    pass\n"
        )
        tree = ast.parse(source)
        found = [
            ClassInfo("llmgw/x.py", n)
            for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef)
        ]
        self.assertEqual(spread_classes(found), ["llmgw/x.py: C(A, B)"])
        self.assertEqual(stub_lines(found), ["llmgw/x.py: A.f"])


def documented_layers(text: str) -> tuple[tuple[str, ...], ...]:
    """
    @param text: C{docs/architecture.md}.
    @return: the parts of each layer its "The control plane's layers"
        table names, as module names, lowest first.
    """
    section = text.split("## The control plane's layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            names = [n.strip().strip("`") for n in cells[1].split(",")]
            layers.append(tuple(f"llmgw.control.{n}" for n in names))
    return tuple(layers)


def walk_steps(text: str) -> list[str]:
    """
    @param text: C{docs/architecture.md}.
    @return: each C{module.Class.method} the held request's walk names.
    """
    section = text.split("A held request's walk", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"`([a-z_]+\.[A-Z][A-Za-z]+\.[a-z_]+)`", section)


class LayerDocsTests(SynchronousTestCase):
    """
    docs/architecture.md says what the code does of the plane's layers.
    """

    def setUp(self) -> None:
        with open(os.path.join(DOCS, "architecture.md"), encoding="utf-8") as f:
            self.text = f.read()

    def test_table_is_the_layers(self) -> None:
        self.assertEqual(documented_layers(self.text), CONTROL_LAYERS)

    def test_walk_passes_no_stub(self) -> None:
        """
        Every method of the walk from a held request to C{WakeShard}
        exists and is no stub.
        """
        steps = walk_steps(self.text)
        self.assertGreaterEqual(len(steps), 6)
        for step in steps:
            module, cls, name = step.split(".")
            found = getattr(
                getattr(importlib.import_module(f"llmgw.control.{module}"), cls), name
            )
            self.assertNotIn("NotImplementedError", inspect.getsource(found), step)
