"""
No function of llmgw passes L{MAX_FUNCTION_LINES}: past it, a function
does more than one thing and is split into named pieces (a service tree
into builders, a command line into one function per command).  Modules
have their own bound, L{tests.test_architecture.MAX_LINES}.

Functions are read from the source with L{ast}: methods, nested functions
and C{async def}s count, each from its C{def} line to its last line, its
docstring included.
"""

from __future__ import annotations

import ast
import os

from twisted.trial.unittest import SynchronousTestCase

import llmgw

ROOT = os.path.dirname(os.path.abspath(llmgw.__file__))

MAX_FUNCTION_LINES = 80

KNOWN_LONG: frozenset[tuple[str, str]] = frozenset()
"""
(path from the project's root, function name) of the functions allowed
past the bound for now.
"""


def long_functions(folder: str) -> list[tuple[str, str, int]]:
    """
    @param folder: a folder of Python modules; paths are given from its
        parent.
    @return: C{(path, name, lines)} of each function under C{folder}
        longer than L{MAX_FUNCTION_LINES}, sorted; generated C{_pb2}
        modules aside.
    """
    top = os.path.dirname(folder)
    found = []
    for where, _, files in os.walk(folder):
        for name in sorted(files):
            if not name.endswith(".py") or name.endswith("_pb2.py"):
                continue
            path = os.path.join(where, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    relative = os.path.relpath(path, top).replace(os.sep, "/")
                    found.append((relative, node.name, lines))
    return sorted(found)


class FunctionSizeTests(SynchronousTestCase):
    """
    No function of llmgw passes L{MAX_FUNCTION_LINES}, but the known ones.
    """

    def test_no_long_function(self) -> None:
        """
        Every function of llmgw but those of L{KNOWN_LONG} has at most
        L{MAX_FUNCTION_LINES} lines; the offenders are listed with their
        lengths.
        """
        found = long_functions(ROOT)
        self.assertEqual(
            [f for f in found if (f[0], f[1]) not in KNOWN_LONG],
            [],
        )

    def test_known_long_still_long(self) -> None:
        """
        A known exception that was split is taken off the list, so that
        the list never excuses a function that grows again.
        """
        found = {(path, name) for path, name, _ in long_functions(ROOT)}
        self.assertEqual(sorted(KNOWN_LONG - found), [])

    def test_finds_long_functions(self) -> None:
        """
        The count reads real files: a function, a method and a nested
        C{async def} of L{MAX_FUNCTION_LINES} + 1 lines are found, their
        docstrings counted; one of L{MAX_FUNCTION_LINES} lines is not.
        """
        folder = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(folder, "sub"))
        body = "    x = 1\n"
        fits = "def fits():\n" + body * (MAX_FUNCTION_LINES - 1)
        long = 'def long():\n    """\n    Doc.\n    """\n' + body * (
            MAX_FUNCTION_LINES - 3
        )
        method = "class C:\n    def method(self):\n" + (
            "        x = 1\n" * MAX_FUNCTION_LINES
        )
        nested = "def outer():\n    async def inner():\n" + (
            "        x = 1\n" * MAX_FUNCTION_LINES
        )
        with open(os.path.join(folder, "a.py"), "w") as f:
            f.write(fits + "\n" + long)
        with open(os.path.join(folder, "sub", "b.py"), "w") as f:
            f.write(method + "\n" + nested)
        name = os.path.basename(folder)
        limit = MAX_FUNCTION_LINES
        self.assertEqual(
            long_functions(folder),
            [
                (f"{name}/a.py", "long", limit + 1),
                (f"{name}/sub/b.py", "inner", limit + 1),
                (f"{name}/sub/b.py", "method", limit + 1),
                (f"{name}/sub/b.py", "outer", limit + 2),
            ],
        )
