"""
The module layout's rules (docs/architecture.md, "Packages"):
which package of llmgw may import which.  Processes are the boundaries:
the control plane and the agent meet only through C{wire}; the router
defines the interfaces others implement and imports none of them; C{store},
C{wire} and C{sim} are leaves.  Inside the router, its rooms (C{edge},
C{api}, C{routing}, C{upstream}, C{accounting}, C{telemetry}) import one
way (docs/architecture.md, "The router's rooms").

Imports are read from the source with L{ast}, so a function-level import or
one under C{TYPE_CHECKING} counts as much as one at the top.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

from twisted.trial.unittest import SynchronousTestCase

import llmgw

ROOT = os.path.dirname(os.path.abspath(llmgw.__file__))

# (importing package, imported package, why).  A package is the first part
# of the module's name below llmgw ("store" for llmgw.store.db; "config"
# for llmgw.config).  "*" as the imported package: any llmgw module
# outside the importer's own package.
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("store", "*", "the store is a leaf: any process may use it"),
    ("agent", "control", "agent and control plane meet only through wire"),
    ("control", "agent", "agent and control plane meet only through wire"),
    ("agent", "router", "the agent runs on GPU nodes, without the router"),
    ("wire", "control", "wire is the protocol both processes share"),
    ("wire", "agent", "wire is the protocol both processes share"),
    ("wire", "router", "wire is the protocol both processes share"),
    ("wire", "store", "wire is the protocol both processes share"),
    ("router", "control", "the router defines Activator; control implements it"),
    ("router", "store", "the router defines Auth and UsageSink; others implement them"),
    ("router", "server", "server/ wires the router, not the other way"),
    ("router", "config", "the router's settings are its own (router.settings)"),
    (
        "control",
        "config",
        "the control plane's settings are its own (control.settings)",
    ),
    ("sim", "*", "the simulator stands alone like a real engine"),
    ("daemon", "router", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "control", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "agent", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "store", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "server", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "tier", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "admin", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "web", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "accounts", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "config", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "wire", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "sim", "every daemon's plumbing knows no part of llmgw"),
    ("daemon", "cli", "every daemon's plumbing knows no part of llmgw"),
    ("config_checks", "*", "configuration checks are a leaf every table uses"),
    ("reactors", "*", "reactor interfaces are a leaf every package uses"),
    ("tier", "server", "server/ runs the tier's workers, not the other way"),
    ("admin", "server", "server/ wires the admin API, not the other way"),
    ("admin", "agent", "the admin API runs in the server, reading the plane"),
    ("accounts", "server", "server/ and tier/ wire the accounts, not the other way"),
    ("accounts", "tier", "server/ and tier/ wire the accounts, not the other way"),
    ("accounts", "control", "keys and usage know no placement"),
    ("accounts", "config", "accounts read their own tables (accounts.settings)"),
    ("control", "admin", "the admin API reads the plane, not the other way"),
    ("router", "admin", "server/ mounts the admin API beside the router"),
    ("router", "tier", "the tier wires the router, not the other way"),
    ("router", "accounts", "the router defines UsageSink; accounts implement it"),
    (
        "router",
        "batches",
        "the router defines FileStore and BatchStore; batches implement them",
    ),
    ("batches", "server", "server/ and tier/ wire the batches, not the other way"),
    ("batches", "tier", "server/ and tier/ wire the batches, not the other way"),
    ("batches", "control", "files and batches know no placement"),
    ("batches", "config", "batches read their own table (batches.settings)"),
    # The dashboard reads the control plane and the keys; server/ wires it.
    ("web", "agent", "the dashboard runs in the server, reading the plane"),
    ("web", "server", "server/ wires the dashboard, not the other way"),
    ("router", "web", "the router serves clients; server/ mounts the dashboard"),
    ("control", "web", "the dashboard reads the plane, not the other way"),
)

# (importing package, imported package): the only modules of the imported
# package the importer may use.  The control plane implements the router's
# interfaces and fills in its endpoints; it never reaches into the router.
ONLY: dict[tuple[str, str], tuple[str, ...]] = {
    ("control", "router"): ("llmgw.router.interfaces",),
    # The server's file is composed of each table's parser, kept next to
    # its consumer in a settings module that imports only config_checks:
    # config reaches into those leaves and nothing else, so that a router
    # of the tier reading the file does not import the server.
    ("config", "accounts"): ("llmgw.accounts.settings",),
    ("config", "batches"): ("llmgw.batches.settings",),
    ("config", "control"): ("llmgw.control.settings", "llmgw.control.catalog"),
    ("config", "router"): (
        "llmgw.router.interfaces",
        "llmgw.router.settings",
        "llmgw.router.settings_toml",
    ),
    ("config", "server"): ("llmgw.server.settings",),
    ("config", "tier"): ("llmgw.tier.settings",),
}

# Modules that define the router's interfaces import nothing else from
# llmgw, so that implementing one never drags the router in; nor does the
# one home of Twisted's private names, which router and agent both use.
LEAF_MODULES = (
    "llmgw.router.interfaces",
    "llmgw.router.batch_interfaces",
    "llmgw.twisted_private",
)

# Why each leaf is one, for the report; "an interface module is a leaf"
# for any other.
LEAF_WHY = {
    "llmgw.twisted_private": "Twisted's private names are a leaf every process uses",
}

# Settings read by more than their own process's wiring import only the
# configuration checks: reading the server's file (which llmgw-router does
# too) then pulls in none of the server's, control plane's or router's
# machinery.
SETTINGS_MODULES = (
    "llmgw.router.settings",
    "llmgw.control.settings",
    "llmgw.server.settings",
    "llmgw.accounts.settings",
    "llmgw.tier.settings",
    "llmgw.batches.settings",
)


# The router's rooms (docs/architecture.md, "The router's rooms"): the
# folders of llmgw/router, named by the path a request takes, each with the
# rooms it may import and why.  A module at the router's top (interfaces,
# settings, settings_toml, errors) is open to every room and imports none,
# so that what other packages import of the router drags no room in.
ROOMS: dict[str, tuple[tuple[str, ...], str]] = {
    "edge": ((), "the edge takes the connection and knows no room past the site"),
    "upstream": ((), "the engines' side knows no room that asked for the exchange"),
    "telemetry": ((), "every room counts into telemetry, which knows none of them"),
    "routing": (
        ("upstream", "telemetry"),
        "routing chooses a replica below the routes: it reads the engines"
        " (load, adapters) and counts, nothing of the edge, api or accounting",
    ),
    "accounting": (
        ("routing",),
        "a key knows its priority (routing.fairness), nothing of the routes",
    ),
    "api": (
        ("edge", "routing", "upstream", "telemetry"),
        "the routes reach accounting only through the interfaces (Auth, UsageSink)",
    ),
}

TOP_WHY = "the router's top imports no room: importing it drags no room in"


def modules() -> Iterator[tuple[str, str]]:
    """
    @return: (dotted module name, file path) of every module of llmgw.
    """
    for folder, _, files in os.walk(ROOT):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")]
            parts = relative.split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


MODULES = frozenset(name for name, _ in modules())


def imports_of(module: str, path: str) -> set[str]:
    """
    @return: the dotted names of the llmgw modules C{path} imports,
        relative imports resolved against C{module}.
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if not is_package:
                    package.pop()
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            # "from llmgw.wire import agent_pb2" imports the module
            # llmgw.wire.agent_pb2; "from llmgw.wire.codec import X", the
            # module llmgw.wire.codec.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        found.update(n for n in names if n == "llmgw" or n.startswith("llmgw."))
    return found


def package_of(module: str) -> str:
    """
    @return: the part of C{module}'s name below llmgw, or C{""} for llmgw
        itself.
    """
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(
    edges: dict[str, set[str]],
    forbidden: tuple[tuple[str, str, str], ...] = FORBIDDEN,
    leaves: tuple[str, ...] = LEAF_MODULES,
    only: dict[tuple[str, str], tuple[str, ...]] = ONLY,
) -> list[str]:
    """
    @param edges: module name -> the llmgw modules it imports.
    @return: one line per forbidden import, sorted.
    """
    found = []
    for module, imported in edges.items():
        source = package_of(module)
        for target in sorted(imported):
            destination = package_of(target)
            if destination == source or destination == "":
                # Its own package, or llmgw's __init__ (the version).
                if module not in leaves or target == module:
                    continue
            if module in leaves and not target.startswith(module):
                why = LEAF_WHY.get(module, "an interface module is a leaf")
                found.append(f"{module} imports {target}: {why}")
                continue
            allowed = only.get((source, destination))
            if allowed is not None and target not in allowed:
                found.append(
                    f"{module} imports {target}: only {', '.join(allowed)}"
                    f" of {destination} is for {source}"
                )
            for importer, importee, why in forbidden:
                if importer != source:
                    continue
                if importee == destination or (importee == "*" and destination):
                    found.append(f"{module} imports {target}: {why}")
    return sorted(set(found))


def room_of(module: str) -> str | None:
    """
    @return: the room of a module of the router (C{"edge"} for
        C{llmgw.router.edge.site} and for C{llmgw.router.edge} itself),
        C{""} for a module at the router's top (C{llmgw.router.errors}, or
        C{llmgw.router}), or L{None} for a module outside the router.
    """
    parts = module.split(".")
    if parts[:2] != ["llmgw", "router"]:
        return None
    if len(parts) > 3 or (len(parts) == 3 and parts[2] in ROOMS):
        return parts[2]
    return ""


def room_violations(
    edges: dict[str, set[str]],
    rooms: dict[str, tuple[tuple[str, ...], str]] = ROOMS,
) -> list[str]:
    """
    @param edges: module name -> the llmgw modules it imports.
    @return: one line per import of the router's modules from one room into
        another that L{ROOMS} does not allow, or from the router's top into
        a room, sorted.  A room without a rule allows nothing.
    """
    found = []
    for module, imported in edges.items():
        source = room_of(module)
        if source is None:
            continue
        allowed, why = rooms.get(source, ((), f"{source} is a room without a rule"))
        for target in sorted(imported):
            destination = room_of(target)
            if destination in (None, "", source):
                continue
            if source == "":
                found.append(f"{module} imports {target}: {TOP_WHY}")
            elif destination not in allowed:
                found.append(f"{module} imports {target}: {why}")
    return sorted(found)


def all_edges() -> dict[str, set[str]]:
    return {module: imports_of(module, path) for module, path in modules()}


class ImportRuleTests(SynchronousTestCase):
    """
    Every module of llmgw keeps the layout's import rules.
    """

    def test_no_forbidden_import(self) -> None:
        """
        No module of llmgw imports across a forbidden edge.
        """
        self.assertEqual(violations(all_edges()), [])

    def test_reads_the_tree(self) -> None:
        """
        The walk finds the packages the rules speak of, so a rule cannot
        pass because its importer was never read.
        """
        packages = {package_of(module) for module, _ in modules()}
        for importer, _, _ in FORBIDDEN:
            self.assertIn(importer, packages)
        for leaf in LEAF_MODULES:
            self.assertIn(leaf, dict(modules()))

    def test_detects_each_kind_of_import(self) -> None:
        """
        A forbidden edge is found whether written as C{import a.b},
        C{from a import b}, a relative import or inside a function.
        """
        cases = {
            "import llmgw.router.api.app\n": "llmgw.router.api.app",
            "from llmgw.router.api import app\n": "llmgw.router.api.app",
            "from ..router.api.app import Router\n": "llmgw.router.api.app",
            "def f():\n    from llmgw.router.api.app import Router\n": (
                "llmgw.router.api.app"
            ),
        }
        path = self.mktemp()
        for source, target in cases.items():
            with open(path, "w", encoding="utf-8") as f:
                f.write(source)
            edges = {"llmgw.store.db": imports_of("llmgw.store.db", path)}
            self.assertIn(target, edges["llmgw.store.db"], source)
            self.assertEqual(
                violations(edges),
                [
                    f"llmgw.store.db imports {target}: the store is a leaf:"
                    " any process may use it"
                ],
                source,
            )

    def test_allowed_edges_pass(self) -> None:
        """
        Edges the rules allow are not reported: the server wiring imports
        everything, the control plane imports the router's interfaces and
        wire, a package imports itself.
        """
        edges = {
            "llmgw.server.tap": {"llmgw.router.api.app", "llmgw.control.plane"},
            "llmgw.control.plane": {"llmgw.router.interfaces", "llmgw.wire.states"},
            "llmgw.store.usage": {"llmgw.store.db"},
            "llmgw.agent.link": {"llmgw.wire.protocol", "llmgw"},
        }
        self.assertEqual(violations(edges), [])

    def test_settings_import_only_the_checks(self) -> None:
        """
        Each of L{SETTINGS_MODULES} imports nothing of llmgw but
        L{llmgw.config_checks}.
        """
        paths = dict(modules())
        for module in SETTINGS_MODULES:
            self.assertEqual(
                imports_of(module, paths[module]) - {"llmgw.config_checks"},
                set(),
                module,
            )

    def test_control_uses_only_router_interfaces(self) -> None:
        """
        The control plane may import the router's interfaces, and nothing
        else of the router.
        """
        edges = {
            "llmgw.control.plane": {
                "llmgw.router.interfaces",
                "llmgw.router.routing.balancer",
            }
        }
        self.assertEqual(
            violations(edges),
            [
                "llmgw.control.plane imports llmgw.router.routing.balancer: only"
                " llmgw.router.interfaces of router is for control"
            ],
        )

    def test_twisted_private_is_a_leaf(self) -> None:
        """
        The home of Twisted's private names imports nothing from llmgw,
        not even llmgw itself.
        """
        edges = {"llmgw.twisted_private": {"llmgw.router.edge.channel", "llmgw"}}
        why = "Twisted's private names are a leaf every process uses"
        self.assertEqual(
            violations(edges),
            [
                f"llmgw.twisted_private imports llmgw.router.edge.channel: {why}",
                f"llmgw.twisted_private imports llmgw: {why}",
            ],
        )

    def test_interface_module_is_a_leaf(self) -> None:
        """
        The router's interface module may import nothing else from llmgw,
        not even the router's own modules.
        """
        edges = {"llmgw.router.interfaces": {"llmgw.router.errors"}}
        self.assertEqual(
            violations(edges),
            [
                "llmgw.router.interfaces imports llmgw.router.errors:"
                " an interface module is a leaf"
            ],
        )


class RoomRuleTests(SynchronousTestCase):
    """
    The router's rooms import one way (L{ROOMS}).
    """

    def test_rooms_import_one_way(self) -> None:
        """
        No module of the router imports a room its own room may not.
        """
        self.assertEqual(room_violations(all_edges()), [])

    def test_every_room_has_a_rule(self) -> None:
        """
        Each folder of llmgw/router is a room of L{ROOMS}, and each room of
        L{ROOMS} is a folder with modules the walk reads, so that no room is
        left out of the rules and no rule passes on nothing read.
        """
        router = os.path.join(ROOT, "router")
        folders = {
            name
            for name in os.listdir(router)
            if os.path.exists(os.path.join(router, name, "__init__.py"))
        }
        self.assertEqual(folders, set(ROOMS))
        read = {room_of(module) for module in MODULES}
        self.assertTrue(set(ROOMS) <= read)

    def test_detects_a_backwards_import(self) -> None:
        """
        A room importing one above it (the edge importing the routes,
        upstream importing routing), a room importing one beside it that
        its rule leaves out, and the router's top importing a room, are
        each reported with the importer's reason.
        """
        edges = {
            "llmgw.router.edge.site": {"llmgw.router.api.app"},
            "llmgw.router.upstream.http1": {"llmgw.router.routing.balancer"},
            "llmgw.router.routing.balancer": {"llmgw.router.accounting.auth"},
            "llmgw.router.errors": {"llmgw.router.edge.site"},
        }
        self.assertEqual(
            room_violations(edges),
            [
                "llmgw.router.edge.site imports llmgw.router.api.app: "
                + ROOMS["edge"][1],
                f"llmgw.router.errors imports llmgw.router.edge.site: {TOP_WHY}",
                "llmgw.router.routing.balancer imports"
                " llmgw.router.accounting.auth: " + ROOMS["routing"][1],
                "llmgw.router.upstream.http1 imports"
                " llmgw.router.routing.balancer: " + ROOMS["upstream"][1],
            ],
        )

    def test_allowed_room_edges_pass(self) -> None:
        """
        A room importing one its rule allows, its own modules, the router's
        top or a package outside the router is not reported; nor is a
        package outside the router importing any room.
        """
        edges = {
            "llmgw.router.api.app": {
                "llmgw.router.edge.site",
                "llmgw.router.api.exchange",
                "llmgw.router.errors",
                "llmgw.reactors",
            },
            "llmgw.router.accounting.auth": {"llmgw.router.routing.fairness"},
            "llmgw.router.settings": {"llmgw.config_checks"},
            "llmgw.server.tap": {"llmgw.router.api.app"},
        }
        self.assertEqual(room_violations(edges), [])

    def test_room_of(self) -> None:
        """
        A room's modules and the room's package are in the room; the
        router's own modules and package are at its top; others are not
        the router's.
        """
        self.assertEqual(room_of("llmgw.router.edge.site"), "edge")
        self.assertEqual(room_of("llmgw.router.edge"), "edge")
        self.assertEqual(room_of("llmgw.router.errors"), "")
        self.assertEqual(room_of("llmgw.router"), "")
        self.assertIsNone(room_of("llmgw.control.plane"))


MAX_LINES = 600
"""
The most lines a module may have (docs/architecture.md, "Packages"): past it, a module
has more than one job and is split by job.
"""

GENERATED = ("agent_pb2.py", "agent_pb2.pyi")


def long_modules(folders: tuple[str, ...]) -> list[tuple[str, int]]:
    """
    @return: C{(path, lines)} of each Python module under C{folders} (from
        the project's root) longer than L{MAX_LINES}, generated code aside.
    """
    top = os.path.dirname(ROOT)
    found = []
    for folder in folders:
        for where, _, files in os.walk(os.path.join(top, folder)):
            for name in sorted(files):
                if not name.endswith(".py") or name in GENERATED:
                    continue
                path = os.path.join(where, name)
                with open(path, encoding="utf-8") as f:
                    count = sum(1 for _ in f)
                if count > MAX_LINES:
                    found.append((os.path.relpath(path, top), count))
    return found


class ModuleSizeTests(SynchronousTestCase):
    """
    No module of llmgw, its tests or its benchmarks passes L{MAX_LINES}.
    """

    def test_no_long_module(self) -> None:
        self.assertEqual(long_modules(("llmgw", "tests", "bench")), [])

    def test_finds_a_long_module(self) -> None:
        """
        The count reads real files: one of L{MAX_LINES} + 1 lines is found.
        """
        top = os.path.dirname(ROOT)
        folder = self.mktemp()
        os.makedirs(folder)
        with open(os.path.join(folder, "long.py"), "w") as f:
            f.write("x = 1\n" * (MAX_LINES + 1))
        with open(os.path.join(folder, "short.py"), "w") as f:
            f.write("x = 1\n" * MAX_LINES)
        relative = os.path.relpath(os.path.abspath(folder), top)
        self.assertEqual(
            long_modules((relative,)),
            [(os.path.join(relative, "long.py"), MAX_LINES + 1)],
        )
