"""
Twisted's private names go through L{llmgw.twisted_private} only, and each
one it lists is still where llmgw expects it in the installed Twisted.

A private name is one with a leading underscore, or any name from a module
whose dotted path has a part with one (C{twisted.web._http2}).  Imports
and attribute accesses are read from the source with L{ast}, as in
L{tests.test_architecture}.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import textwrap

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import HTTPConnectionPool
from twisted.web.http import HTTPChannel

from llmgw import twisted_private
from llmgw.twisted_private import (
    PRIVATE_USES,
    GenericHTTPChannelProtocol,
    H2Connection,
    PrivateUse,
)
from tests.test_architecture import modules

HOME = "llmgw.twisted_private"


def _private_path(dotted: str) -> bool:
    """
    @return: whether C{dotted}, a name under C{twisted}, has a private part.
    """
    parts = dotted.split(".")
    return parts[0] == "twisted" and any(
        part.startswith("_") and not part.startswith("__") for part in parts
    )


def _dotted(node: ast.expr) -> str | None:
    """
    @return: C{"a.b.c"} for the expression C{a.b.c}, or L{None} for any
        other expression.
    """
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def private_imports(source: str) -> list[str]:
    """
    @param source: a Python module's text.
    @return: each private Twisted name the module imports or reaches
        through an imported Twisted name (C{http._GenericHTTPChannelProtocol}
        after C{from twisted.web import http}), as C{line: dotted name}.
    """
    tree = ast.parse(source)
    bound: dict[str, str] = {}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private_path(alias.name):
                    found.append(f"{node.lineno}: {alias.name}")
                if alias.name.split(".")[0] == "twisted":
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["twisted"] = "twisted"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if _private_path(name):
                    found.append(f"{node.lineno}: {name}")
                if node.module.split(".")[0] == "twisted":
                    bound[alias.asname or alias.name] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            dotted = _dotted(node)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            if head in bound and rest:
                name = f"{bound[head]}.{rest}"
                if _private_path(name):
                    found.append(f"{node.lineno}: {name}")
    return sorted(set(found), key=lambda line: int(line.split(":")[0]))


def private_imports_outside_home() -> list[str]:
    """
    @return: C{module line: name} for each private Twisted name used by a
        module of llmgw other than L{HOME}.
    """
    found: list[str] = []
    for module, path in modules():
        if module == HOME:
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        found.extend(f"{module} {line}" for line in private_imports(source))
    return found


class PrivateImportTests(SynchronousTestCase):
    """
    Only L{llmgw.twisted_private} imports Twisted's private names.
    """

    def test_only_the_home_module(self) -> None:
        """
        No module of llmgw but L{llmgw.twisted_private} imports or reaches
        a private Twisted name.
        """
        self.assertEqual(private_imports_outside_home(), [])

    def test_the_home_module_is_read(self) -> None:
        """
        The walk reads the home module and finds its imports, so the rule
        above cannot pass because nothing was read.
        """
        paths = dict(modules())
        self.assertIn(HOME, paths)
        with open(paths[HOME], encoding="utf-8") as f:
            found = private_imports(f.read())
        self.assertEqual(
            [line.split(": ")[1] for line in found],
            [
                "twisted.web._http2.H2Connection",
                "twisted.web.client._HTTP11ClientFactory",
                "twisted.web.http._GenericHTTPChannelProtocol",
            ],
        )

    def test_detects_each_kind(self) -> None:
        """
        A private name is found whether imported from a private module, as
        a private name, as a private module, or reached as an attribute of
        an imported Twisted module; public names and llmgw's own private
        names are not.
        """
        cases = {
            "from twisted.web._http2 import H2Connection\n": [
                "1: twisted.web._http2.H2Connection"
            ],
            "from twisted.web.http import _GenericHTTPChannelProtocol\n": [
                "1: twisted.web.http._GenericHTTPChannelProtocol"
            ],
            "import twisted.web._http2\n": ["1: twisted.web._http2"],
            "import twisted.web._http2 as h2\n": ["1: twisted.web._http2"],
            "from twisted.web import http\nX = http._GenericHTTPChannelProtocol\n": [
                "2: twisted.web.http._GenericHTTPChannelProtocol"
            ],
            "import twisted.web.client\nX = twisted.web.client._HTTP11ClientFactory": [
                "2: twisted.web.client._HTTP11ClientFactory"
            ],
            "def f():\n    from twisted.web.client import _HTTP11ClientFactory\n": [
                "2: twisted.web.client._HTTP11ClientFactory"
            ],
            "from twisted.web.http import HTTPChannel\n": [],
            "from twisted.internet import reactor as _reactor\n": [],
            "from llmgw.agent.service import _Uplink\n": [],
            "from twisted.web.http import HTTPChannel\nX = self._transferDecoder\n": [],
        }
        for source, expected in cases.items():
            self.assertEqual(private_imports(source), expected, source)


def _instance(owner: type) -> object:
    """
    @return: a live instance of C{owner}, as Twisted has it once its
        connection is made, for the attributes Twisted sets per instance.
    """
    if owner is HTTPChannel:
        channel = HTTPChannel()
        channel.makeConnection(StringTransport())
        return channel
    if owner is GenericHTTPChannelProtocol:
        return GenericHTTPChannelProtocol(HTTPChannel())
    if owner is H2Connection:
        return H2Connection(Clock())
    if owner is HTTPConnectionPool:
        return HTTPConnectionPool(Clock(), persistent=False)
    raise AssertionError(f"no instance of {owner!r} to check")


def missing(use: PrivateUse) -> str | None:
    """
    @return: why C{use} no longer holds in the installed Twisted, or
        L{None} when it holds.
    """
    where = f"{use.owner.__module__}.{use.owner.__qualname__}"
    if use.kind == "method":
        if not callable(getattr(use.owner, use.name, None)):
            return f"{where}.{use.name} is not a method any more ({use.user})"
    elif use.kind == "attribute":
        if not hasattr(use.owner, use.name) and not hasattr(
            _instance(use.owner), use.name
        ):
            return f"{where}.{use.name} is not set any more ({use.user})"
    elif use.kind == "parameter":
        method = getattr(use.owner, use.method, None)
        if method is None or use.name not in inspect.signature(method).parameters:
            return f"{where}.{use.method} takes no {use.name} any more ({use.user})"
    elif use.kind == "copied":
        method = getattr(use.owner, use.name, None)
        if method is None:
            return f"{where}.{use.name} is gone ({use.user})"
        source = textwrap.dedent(inspect.getsource(method))
        digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
        if digest != use.source_sha256:
            return (
                f"{where}.{use.name} changed (sha256 {digest}): {use.user}"
                " copies it; compare the two, then record the new digest"
            )
    else:
        return f"unknown kind {use.kind!r} for {where}.{use.name}"
    return None


class PrivateUseTests(SynchronousTestCase):
    """
    Each private name L{llmgw.twisted_private.PRIVATE_USES} lists is still
    on its Twisted class, and each is in the module's documented table.
    """

    def test_each_is_still_there(self) -> None:
        """
        The installed Twisted still has every private method, attribute
        and parameter llmgw relies on, and the code llmgw copies is
        unchanged.
        """
        self.assertEqual([m for m in map(missing, PRIVATE_USES) if m], [])

    def test_a_missing_name_is_reported(self) -> None:
        """
        A name that is not there is reported, for each kind: the check
        above reads the real classes.
        """
        gone = [
            PrivateUse(HTTPChannel, "_noSuchMethod", "method", "x"),
            PrivateUse(H2Connection, "_noSuchAttribute", "attribute", "x"),
            PrivateUse(
                H2Connection, "_noSuch", "parameter", "x", method="connectionLost"
            ),
            PrivateUse(
                GenericHTTPChannelProtocol,
                "dataReceived",
                "copied",
                "x",
                source_sha256="0" * 64,
            ),
        ]
        reports = [missing(use) for use in gone]
        self.assertEqual([r is not None for r in reports], [True] * 4, reports)
        self.assertIn("_noSuchMethod is not a method", str(reports[0]))
        self.assertIn("_noSuchAttribute is not set", str(reports[1]))
        self.assertIn("takes no _noSuch", str(reports[2]))
        self.assertIn("dataReceived changed", str(reports[3]))

    def test_instance_attributes_are_read_from_live_objects(self) -> None:
        """
        Attributes Twisted sets per instance (not on the class) are found
        on a live object: the check does not pass by reading the class.
        """
        for owner, name in (
            (HTTPChannel, "_networkProducer"),
            (GenericHTTPChannelProtocol, "_channel"),
            (H2Connection, "_reactor"),
        ):
            self.assertFalse(hasattr(owner, name), name)
            self.assertIsNone(missing(PrivateUse(owner, name, "attribute", "x")), name)

    def test_the_rapid_reset_defence_is_there(self) -> None:
        """
        The installed Twisted's HTTP/2 connection has the token bucket on
        stream resets that setup.cfg's floor (26.10) stands for.
        """
        names = {(u.owner, u.name) for u in PRIVATE_USES}
        self.assertIn((H2Connection, "_resetTokenBurst"), names)
        self.assertIn((H2Connection, "_resetTokenRate"), names)
        self.assertIsNone(
            missing(PrivateUse(H2Connection, "_resetTokenBurst", "attribute", "x"))
        )

    def test_each_is_in_the_table(self) -> None:
        """
        The module's docstring names each private name it lists, and each
        llmgw module said to use one exists.
        """
        doc = twisted_private.__doc__ or ""
        for use in PRIVATE_USES:
            self.assertIn(use.name.lstrip("_"), doc, use)
            importlib.import_module(use.user)


def _overrides(cls: type) -> set[str]:
    """
    @return: the private names C{cls}'s own body defines (methods, class
        attributes) or sets on C{self} that a Twisted class of its MRO
        defines too: overrides of Twisted's private names.
    """
    twisted_names: set[str] = set()
    for base in cls.__mro__[1:]:
        if base.__module__.split(".")[0] != "twisted":
            continue
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(source))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
                twisted_names.add(node.name)
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                twisted_names.add(node.attr)
            elif isinstance(node, ast.Name) and node.id.startswith("_"):
                twisted_names.add(node.id)
    mine: set[str] = set(vars(cls))
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            mine.add(node.attr)
    return {
        name
        for name in mine & twisted_names
        if name.startswith("_") and not name.startswith("__")
    }


class _Overriding(HTTPChannel):
    # A private override and a private read, as EdgeChannel has them, and a
    # private name of llmgw's own.
    _mine = 0

    def _respondToBadRequestAndDisconnect(self) -> None:
        self._transferDecoder = None


class _OwnNamesOnly(HTTPChannel):
    _settings = None

    def _arm(self) -> None:
        self._timer = None


class ListedTests(SynchronousTestCase):
    """
    Every private name of Twisted that a class of llmgw overrides, reads
    or sets is listed in L{llmgw.twisted_private.PRIVATE_USES}.
    """

    def test_every_override_is_listed(self) -> None:
        """
        For each class of llmgw built on a Twisted class, the private names
        it shares with that class are listed, so a new override of a
        private method cannot slip in unlisted.
        """
        listed = {u.name for u in PRIVATE_USES}
        unlisted = []
        for module, path in modules():
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
            if not classes:
                continue
            loaded = importlib.import_module(module)
            for name in classes:
                cls = getattr(loaded, name)
                if not isinstance(cls, type):
                    # A zope interface (llmgw.reactors): no class, no
                    # overrides.
                    continue
                if not any(
                    b.__module__.split(".")[0] == "twisted" for b in cls.__mro__[1:]
                ):
                    continue
                for private in sorted(_overrides(cls) - listed):
                    unlisted.append(f"{module}.{name}: {private}")
        self.assertEqual(unlisted, [])

    def test_finds_overrides(self) -> None:
        """
        An override of a private method and a private attribute set are
        found on a subclass of a Twisted class; the subclass's own private
        names are not.
        """
        self.assertEqual(
            _overrides(_Overriding),
            {"_respondToBadRequestAndDisconnect", "_transferDecoder"},
        )
        self.assertEqual(_overrides(_OwnNamesOnly), set())
