"""
Every third-party package llmgw imports is declared in setup.cfg: the
package's own imports in C{install_requires} (or the C{local} extra, for
C{llmgw-server --local}), the tests' in those or the C{test} extra.  A
package that is only pulled in by another dependency can leave with that
dependency's next release.

Imports are read from the source with L{ast}; an import name is mapped to
its distribution by the installed metadata
(L{importlib.metadata.packages_distributions}).
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import os
import re
import sys

from twisted.trial.unittest import SynchronousTestCase

from tests.test_architecture import ROOT

TOP = os.path.dirname(ROOT)

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def normalize(name: str) -> str:
    """
    @return: C{name} as PEP 503 compares distribution names.
    """
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(line: str) -> tuple[str, list[str]] | None:
    """
    @return: the distribution name and extras of one requirement line, or
        L{None} for a blank or comment line.
    """
    line = line.split("#", 1)[0].strip()
    match = _NAME.match(line)
    if not line or match is None:
        return None
    extras = [e.strip() for e in (match.group(2) or "").split(",") if e.strip()]
    return normalize(match.group(1)), extras


def declared(*groups: str) -> set[str]:
    """
    @param groups: C{"install_requires"} or the name of an extra.
    @return: the normalized names of the distributions those groups of
        setup.cfg declare, with what each declared extra of theirs adds
        (C{psycopg[pool]} declares C{psycopg-pool}).
    """
    config = configparser.ConfigParser()
    config.read(os.path.join(TOP, "setup.cfg"), encoding="utf-8")
    lines: list[str] = []
    for group in groups:
        if group == "install_requires":
            lines += config["options"]["install_requires"].splitlines()
        else:
            lines += config["options.extras_require"][group].splitlines()
    names: set[str] = set()
    for line in lines:
        parsed = _requirement(line)
        if parsed is None:
            continue
        name, extras = parsed
        names.add(name)
        for requirement in importlib.metadata.requires(name) or []:
            marker = _EXTRA.search(requirement)
            inner = _requirement(requirement.split(";", 1)[0])
            if marker and marker.group(1) in extras and inner is not None:
                names.add(inner[0])
    return names


def third_party_imports(folder: str) -> dict[str, set[str]]:
    """
    @param folder: a folder of the project (C{"llmgw"}, C{"tests"}).
    @return: top-level module name -> the files under C{folder} that import
        it, for each module neither of the standard library nor of the
        project (llmgw, tests, the C{twisted.plugins} entry point aside).
    """
    found: dict[str, set[str]] = {}
    for where, _, files in os.walk(os.path.join(TOP, folder)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(where, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    modules = [node.module or ""]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top in sys.stdlib_module_names or top in (
                        "",
                        "__future__",
                        # typeshed's stubs of the standard library, for
                        # annotations only (mypy reads them; nothing runs).
                        "_typeshed",
                        "llmgw",
                        "tests",
                    ):
                        continue
                    found.setdefault(top, set()).add(os.path.relpath(path, TOP))
    return found


def undeclared(folder: str, groups: tuple[str, ...]) -> list[str]:
    """
    @return: one line per third-party module imported under C{folder} that
        no distribution declared in C{groups} provides, sorted.
    """
    providers = importlib.metadata.packages_distributions()
    names = declared(*groups)
    missing = []
    for module, paths in sorted(third_party_imports(folder).items()):
        dists = {normalize(d) for d in providers.get(module, [])}
        if not dists & names:
            where = ", ".join(sorted(paths)[:3])
            missing.append(
                f"{module} (from {', '.join(sorted(dists)) or 'no distribution'}),"
                f" imported by {where}"
            )
    return missing


class DeclaredTests(SynchronousTestCase):
    """
    What llmgw and its tests import is what setup.cfg declares.
    """

    def test_package_imports_are_declared(self) -> None:
        """
        Each third-party module llmgw imports comes from a distribution in
        C{install_requires} or the C{local} extra.
        """
        self.assertEqual(undeclared("llmgw", ("install_requires", "local")), [])

    def test_test_imports_are_declared(self) -> None:
        """
        Each third-party module the tests import comes from a distribution
        the package or the C{test} extra declares.
        """
        self.assertEqual(undeclared("tests", ("install_requires", "local", "test")), [])

    def test_finds_what_is_imported(self) -> None:
        """
        The walk finds the imports the package is known to have, so the
        checks above cannot pass on an empty read; the extras of a
        declared requirement count.
        """
        imports = third_party_imports("llmgw")
        for module in ("twisted", "klein", "cryptography", "werkzeug", "google"):
            self.assertIn(module, imports)
        self.assertNotIn("os", imports)
        self.assertIn("psycopg-pool", declared("install_requires"))

    def test_an_undeclared_import_is_reported(self) -> None:
        """
        A module imported but not declared is reported with its
        distribution: the tests' own C{hypothesis} against the package's
        requirements alone.
        """
        self.assertIn(
            "hypothesis (from hypothesis), imported by",
            "\n".join(undeclared("tests", ("install_requires",))),
        )
