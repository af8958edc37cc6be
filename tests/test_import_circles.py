"""
No import circle among llmgw's modules: a module that needs a type of a
module that needs it back shares that type from a module below both, or
the object that needs it owns it.  Imports are read as
L{tests.test_architecture} reads them, with L{ast}: one under
C{TYPE_CHECKING} closes a circle as much as one at the top.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from tests.test_architecture import all_edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """
    @param edges: module name -> the modules it imports.
    @return: each set of modules that import each other, round a circle
        (a strongly connected component of more than one module, or a
        module that imports itself), sorted; in sorted order.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    # Tarjan's algorithm, iterative: a deep import chain must not meet
    # Python's recursion limit.
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = []
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work.append((root, sorted(edges.get(root, ()))))
        while work:
            # The imports of this module still to follow.
            node, unread = work[-1]
            if unread:
                nxt = unread.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(edges.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] != index[node]:
                continue
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))
    return sorted(found)


class ImportCircleTests(SynchronousTestCase):
    def test_no_circle(self) -> None:
        """
        No module of llmgw imports, directly or through others, a module
        that imports it back.
        """
        self.assertEqual(circles(all_edges()), [])

    def test_finds_circles(self) -> None:
        """
        A circle through three modules, a pair and a module importing
        itself are each found once; a chain and a diamond are not circles.
        """
        edges = {
            "a": {"b"},
            "b": {"c"},
            "c": {"a", "d"},
            "d": {"e"},
            "e": {"d", "f", "g"},
            "f": {"h"},
            "g": {"h"},
            "h": set(),
            "i": {"i"},
        }
        self.assertEqual(circles(edges), [["a", "b", "c"], ["d", "e"], ["i"]])
