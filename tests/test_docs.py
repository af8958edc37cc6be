"""
The docs in the repository: the README and C{docs/} link only to files
that exist, C{docs/architecture.md} names every package and module of
llmgw, and no module or test refers to a design note outside the
repository.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

from twisted.trial.unittest import SynchronousTestCase

import llmgw
from tests.test_architecture import ROOMS, all_edges, package_of, room_of

PACKAGE = os.path.dirname(os.path.abspath(llmgw.__file__))
ROOT = os.path.dirname(PACKAGE)
DOCS = os.path.join(ROOT, "docs")

# [text](target) outside code spans; a target with a scheme is not a file.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`[^`]*`")


def markdown_files() -> list[str]:
    """
    @return: the paths of the README and of every C{.md} file under
        C{docs/}.
    """
    found = [os.path.join(ROOT, "README.md")]
    for folder, _, files in os.walk(DOCS):
        found.extend(
            os.path.join(folder, f) for f in sorted(files) if f.endswith(".md")
        )
    return found


def relative_links(path: str) -> Iterator[tuple[int, str]]:
    """
    @return: C{(line number, target)} of each link in the markdown file at
        C{path} to a file of the repository (no scheme, no bare
        C{#anchor}), the anchor cut off; fenced and indented code is not
        read.
    """
    fenced = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced or line.startswith("    "):
                continue
            for target in _LINK.findall(_CODE.sub("", line)):
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue
                yield number, target.split("#", 1)[0]


def broken_links(paths: list[str]) -> list[str]:
    """
    @return: one line per relative link in C{paths} whose file does not
        exist.
    """
    broken = []
    for path in paths:
        for number, target in relative_links(path):
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
            if os.path.exists(resolved):
                continue
            broken.append(f"{os.path.relpath(path, ROOT)}:{number}: {target}")
    return broken


def package_rows(text: str) -> dict[str, str]:
    """
    @return: the first cell of each row of the package table in
        C{docs/architecture.md} (C{"router/"}, or C{"config_checks,
        config, ..."} for the top-level modules) -> its
        second cell.
    """
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            rows[cells[0].replace("`", "")] = cells[1]
    return rows


def unnamed_modules(text: str) -> list[str]:
    """
    @return: the dotted name of each module of llmgw (packages' modules and
        the top-level ones, C{__init__} aside) that the package table of
        C{text} does not name in backquotes in its package's row.
    """
    rows = package_rows(text)
    # Top-level modules have a row of their own, named in its first cell.
    top = {name for cell in rows if "/" not in cell for name in cell.split(", ")}
    missing = []
    for entry in sorted(os.listdir(PACKAGE)):
        path = os.path.join(PACKAGE, entry)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "__init__.py")):
            row = rows.get(entry + "/")
            if row is None:
                missing.append(f"llmgw.{entry}")
                continue
            missing.extend(_unnamed_in(rows, path, entry, row))
        elif entry.endswith(".py") and entry != "__init__.py":
            module = entry[: -len(".py")]
            if module not in top:
                missing.append(f"llmgw.{module}")
    return missing


def _unnamed_in(rows: dict[str, str], path: str, relative: str, row: str) -> list[str]:
    """
    @param rows: L{package_rows} of the docs.
    @param path: the folder of a package of llmgw.
    @param relative: its path below llmgw (C{"router"}, C{"router/edge"}).
    @param row: the row that names its modules when it has none of its
        own: its parent package's.
    @return: the dotted name of each module of the package and of the
        packages inside it that the row naming it leaves out: a package's
        own row (C{"router/edge/"}, the router's rooms) where the docs have
        one, else its parent's.
    """
    row = rows.get(relative + "/", row)
    missing = []
    for name in sorted(os.listdir(path)):
        inner = os.path.join(path, name)
        if os.path.exists(os.path.join(inner, "__init__.py")):
            missing.extend(_unnamed_in(rows, inner, f"{relative}/{name}", row))
        elif name.endswith(".py") and name != "__init__.py":
            module = name[: -len(".py")]
            if f"`{module}`" not in row:
                missing.append("llmgw." + relative.replace("/", ".") + "." + module)
    return missing


def documented_rooms(text: str) -> dict[str, set[str]]:
    """
    @return: each room of the router's rooms table in C{text} (C{"edge"} for
        its row C{router/edge/}) -> the rooms its last cell says it imports
        (names in parentheses are modules of the name before them; C{none}
        is no room).
    """
    said: dict[str, set[str]] = {}
    table = text.split("\n## The router's rooms\n", 1)[-1].split("\n## ", 1)[0]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `router/") or len(cells) < 3:
            continue
        room = cells[0].strip("`").split("/")[1]
        said[room] = set(re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cells[-1])))
    return said


def actual_rooms() -> dict[str, set[str]]:
    """
    @return: each room of the router -> the other rooms whose modules its
        modules import.
    """
    found: dict[str, set[str]] = {room: set() for room in ROOMS}
    for module, imported in all_edges().items():
        source = room_of(module)
        if source:
            targets = {room_of(t) for t in imported} - {None, "", source}
            found.setdefault(source, set()).update(t for t in targets if t)
    return found


def documented_imports(text: str) -> dict[str, set[str]]:
    """
    @return: each package (C{"router"}) or top-level module (C{"config"}) of
        the package table in C{text} -> the packages and top-level modules
        of llmgw its last cell says it imports (names in parentheses are
        modules of the name before them; C{"anything"} is left out).
    """
    said: dict[str, set[str]] = {}
    table = text.split("\n## Packages\n", 1)[-1].split("\n## ", 1)[0]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 3:
            continue
        names = [n.strip("`/ ") for n in cells[0].split(", ")]
        imports = cells[-1].split("; ") if len(names) > 1 else [cells[-1]]
        for name, cell in zip(names, imports, strict=True):
            if cell == "anything":
                continue
            cell = re.sub(r"\([^)]*\)", "", cell)
            said[name] = {n.split(".")[0] for n in re.findall(r"`([^`]+)`", cell)}
    return said


def actual_imports() -> dict[str, set[str]]:
    """
    @return: each package or top-level module of llmgw -> the others whose
        modules it imports.
    """
    found: dict[str, set[str]] = {}
    for module, imported in all_edges().items():
        source = package_of(module)
        if source:
            targets = {package_of(t) for t in imported} - {source, ""}
            found.setdefault(source, set()).update(targets)
    return found


class LinkTests(SynchronousTestCase):
    """
    Every relative link of the README and C{docs/} resolves to a file.
    """

    def test_links_resolve(self) -> None:
        """
        No relative link in the README or under C{docs/} names a missing
        file.
        """
        self.assertEqual(broken_links(markdown_files()), [])

    def test_reads_the_docs(self) -> None:
        """
        The walk reads the README's map and the pages it links, so that the
        test cannot pass on nothing read.
        """
        paths = markdown_files()
        self.assertIn(os.path.join(DOCS, "architecture.md"), paths)
        readme = [t for _, t in relative_links(os.path.join(ROOT, "README.md"))]
        self.assertIn("docs/architecture.md", readme)
        self.assertIn("docs/server.md", readme)

    def test_detects_a_broken_link(self) -> None:
        """
        A link to a missing file is reported with its file and line; links
        with a scheme, bare anchors, code spans and fenced code are not
        read as links to files.
        """
        path = self.mktemp() + ".md"
        with open(path, "w", encoding="utf-8") as f:
            f.write(
                "# T\n"
                "[ok](https://example.com/x.md) [here](#t) `[no](nothing.md)`\n"
                "```\n[no](nothing-either.md)\n```\n"
                "see [gone](gone.md#part)\n"
            )
        self.assertEqual(
            [line.split(": ", 1)[1] for line in broken_links([path])], ["gone.md"]
        )
        self.assertTrue(broken_links([path])[0].endswith(":6: gone.md"))


class ArchitectureTests(SynchronousTestCase):
    """
    C{docs/architecture.md} keeps up with the package layout.
    """

    def test_every_module_named(self) -> None:
        """
        Each package of llmgw has a row in the package table, and its row
        names each of its modules.
        """
        with open(os.path.join(DOCS, "architecture.md"), encoding="utf-8") as f:
            self.assertEqual(unnamed_modules(f.read()), [])

    def test_imports_as_the_code_does(self) -> None:
        """
        Each row's last cell names the packages and top-level modules its
        package imports, no more and no fewer.
        """
        with open(os.path.join(DOCS, "architecture.md"), encoding="utf-8") as f:
            said = documented_imports(f.read())
        actual = actual_imports()
        self.assertEqual(
            {name: actual.get(name, set()) for name in said},
            said,
        )
        self.assertIn("router", said)
        self.assertIn("config", said)

    def test_detects_an_import_left_out(self) -> None:
        """
        A package whose row leaves out an import is told apart from the
        code.
        """
        with open(os.path.join(DOCS, "architecture.md"), encoding="utf-8") as f:
            text = f.read()
        said = documented_imports(
            text.replace(
                "| `wire`, `config_checks`, `daemon`, `reactors`, `twisted_private` |",
                "| `wire` |",
            )
        )
        self.assertEqual(said["agent"], {"wire"})
        self.assertNotEqual(said["agent"], actual_imports()["agent"])
        # server/ imports anything: its row is not read.
        self.assertNotIn("server", documented_imports(text))

    def test_detects_an_unnamed_module(self) -> None:
        """
        A module its package's row leaves out, or a package without a row,
        is reported.
        """
        with open(os.path.join(DOCS, "architecture.md"), encoding="utf-8") as f:
            text = f.read()
        self.assertIn("llmgw.wire.codec", unnamed_modules(text.replace("`codec`", "")))
        without_sim = "\n".join(
            line for line in text.splitlines() if not line.startswith("| `sim/`")
        )
        self.assertIn("llmgw.sim", unnamed_modules(without_sim))
        self.assertIn(
            "llmgw.config_docs",
            unnamed_modules(text.replace("`config`, `config_docs`, ", "`config`, ")),
        )


class RoomsTests(SynchronousTestCase):
    """
    C{docs/architecture.md}'s table of the router's rooms keeps up with
    the code.
    """

    def test_rooms_import_as_the_code_does(self) -> None:
        """
        Each room has a row, and its last cell names the rooms its modules
        import, no more and no fewer.
        """
        with open(os.path.join(DOCS, "architecture.md"), encoding="utf-8") as f:
            said = documented_rooms(f.read())
        self.assertEqual(said, actual_rooms())
        self.assertEqual(set(said), set(ROOMS))

    def test_detects_a_room_import_left_out(self) -> None:
        """
        A room's row that leaves out a room it imports is told apart from
        the code, and a room's module its row leaves out is reported.
        """
        with open(os.path.join(DOCS, "architecture.md"), encoding="utf-8") as f:
            text = f.read()
        said = documented_rooms(
            text.replace("| `upstream`, `telemetry` |", "| `upstream` |")
        )
        self.assertEqual(said["routing"], {"upstream"})
        self.assertNotEqual(said["routing"], actual_rooms()["routing"])
        self.assertIn(
            "llmgw.router.edge.channel",
            unnamed_modules(text.replace("`channel` an HTTP/1.1", "an HTTP/1.1")),
        )


class OutsideReferenceTests(SynchronousTestCase):
    """
    llmgw and its tests refer to no design note outside the repository.
    """

    def test_no_outside_design_note(self) -> None:
        """
        No module of llmgw or tests/ and no page of the docs names the
        design note kept outside the repository (its name is put together
        below, so that this module does not name it); the design lives in
        C{docs/architecture.md}.
        """
        name = "DESIGN" + ".md"
        found = []
        for top in ("llmgw", "tests", "docs"):
            for folder, _, files in os.walk(os.path.join(ROOT, top)):
                for file in files:
                    if not file.endswith((".py", ".md", ".pyi")):
                        continue
                    path = os.path.join(folder, file)
                    with open(path, encoding="utf-8") as f:
                        if name in f.read():
                            found.append(os.path.relpath(path, ROOT))
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            if name in f.read():
                found.append("README.md")
        self.assertEqual(sorted(found), [])


_MIGRATION_ROW = re.compile(r"^\| (\d+) \| (.+) \| (.+) \|$")


def migration_rows(text: str) -> list[tuple[int, str]]:
    """
    @param text: C{docs/store.md}.
    @return: C{(number, kind)} of each row of its table of migrations, in
        order; the kind is C{"additive"} or begins with C{"rewrites"}.
    """
    rows = []
    for line in text.splitlines():
        match = _MIGRATION_ROW.match(line.strip())
        if match is not None:
            rows.append((int(match.group(1)), match.group(3)))
    return rows


class StoreDocsTests(SynchronousTestCase):
    """
    C{docs/store.md} lists every migration of the schema, as
    C{llmgw store migrate --dry-run} would, and the README links to it.
    """

    def test_every_migration_listed(self) -> None:
        """
        The table has one row per migration, numbered 1 to the schema's
        version, each additive or rewriting as the migration is, and the
        text names the version.
        """
        from llmgw.store.migrations import MIGRATIONS

        with open(os.path.join(DOCS, "store.md"), encoding="utf-8") as f:
            text = f.read()
        rows = migration_rows(text)
        self.assertEqual(
            [number for number, _ in rows], list(range(1, len(MIGRATIONS) + 1))
        )
        for (number, kind), migration in zip(rows, MIGRATIONS, strict=True):
            rewrites = migration.rewritten(False) or migration.rewritten(True)
            self.assertEqual(
                kind.startswith("rewrites"), rewrites is not None, (number, kind)
            )
        self.assertIn(f"The schema is at version {len(MIGRATIONS)}", text)

    def test_detects_a_migration_left_out(self) -> None:
        """
        A table that stops before the last migration is told apart.
        """
        rows = migration_rows("| 1 | a | additive |\n| 2 | b | rewrites `usage` |\n")
        self.assertEqual(rows, [(1, "additive"), (2, "rewrites `usage`")])

    def test_linked_from_the_readme(self) -> None:
        """
        The README links to the store's page and to the changelog.
        """
        links = {
            target for _, target in relative_links(os.path.join(ROOT, "README.md"))
        }
        self.assertIn("docs/store.md", links)
        self.assertIn("CHANGELOG.md", links)
