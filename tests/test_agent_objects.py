"""
The agent's objects, read from the source with L{ast}: no import circle
between its modules (type-only imports under C{TYPE_CHECKING} count), and
no attribute of another object assigned once that object is built, but
for the few named here with the reason (records being filled in,
Twisted's idioms).  An object says what it needs in its C{__init__}, or
offers a method that says what happens (C{factory.redirect_to(leader)}).
"""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from tests.test_architecture import ROOT, all_edges
from tests.test_import_circles import circles
from tests.test_ties import foreign_assignments

AGENT = "llmgw.agent"

# (file below llmgw/agent, the target as written): why it may be
# assigned from outside its object.
ALLOWED: dict[tuple[str, str], str] = {
    ("link.py", "register.max_frame_size"): "a protobuf Register filled in",
    ("link.py", "register.agent_instance"): "a protobuf Register filled in",
    ("link.py", "protocol.factory"): "Twisted's buildProtocol idiom",
    ("link.py", "self._beat.clock"): "LoopingCall has no clock argument",
    ("link.py", "self._weights.clock"): "LoopingCall has no clock argument",
    ("shard.py", "status.note"): "a protobuf ShardStatus filled in",
    ("shard.py", "status.state"): "a protobuf ShardStatus filled in",
    ("shard.py", "status.exit_code"): "a protobuf ShardStatus filled in",
    ("shard.py", "status.has_exit_code"): "a protobuf ShardStatus filled in",
    ("shard.py", "self._watch.clock"): "LoopingCall has no clock argument",
    ("liveness.py", "self._loop.clock"): "LoopingCall has no clock argument",
    ("shard.py", "self._health.clock"): "LoopingCall has no clock argument",
    ("supervisor.py", "poll.clock"): "LoopingCall has no clock argument",
    ("sleep.py", "copy.sleep_level"): "a protobuf StartShard copied",
    ("gpus.py", "gpu.memory_used_mib"): "a protobuf Gpu kept up to date",
    ("gpus.py", "seen[pid].used_mib"): "a protobuf GpuProcess filled in",
}


def agent_edges() -> dict[str, set[str]]:
    """
    @return: each module of llmgw.agent -> the modules of llmgw.agent it
        imports.
    """
    edges = all_edges()
    inside = {m for m in edges if m.startswith(AGENT + ".")}
    return {m: edges[m] & inside for m in inside}


class ImportCircleTests(SynchronousTestCase):
    """
    The agent's modules import one another one way only.
    """

    def test_no_circle(self) -> None:
        """
        No import circle between the modules of llmgw.agent, type-only
        imports included.
        """
        edges = agent_edges()
        self.assertIn("llmgw.agent.supervisor", edges)
        self.assertIn("llmgw.agent.shard", edges["llmgw.agent.supervisor"])
        self.assertEqual(circles(edges), [])

    def test_detects_a_circle(self) -> None:
        """
        A circle is found however long, and a module importing itself is
        one; a diamond is not.
        """
        edges = {
            "a": {"b"},
            "b": {"c"},
            "c": {"a", "d"},
            "d": set(),
            "e": {"e"},
            "f": {"g", "h"},
            "g": {"i"},
            "h": {"i"},
            "i": set(),
        }
        self.assertEqual(circles(edges), [["a", "b", "c"], ["e"]])

    def test_type_only_imports_count(self) -> None:
        """
        An import under C{if TYPE_CHECKING:} is an edge of the graph.
        """
        from tests.test_architecture import imports_of

        path = self.mktemp()
        with open(path, "w") as f:
            f.write(
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from llmgw.agent.supervisor import Supervisor\n"
            )
        self.assertEqual(imports_of("llmgw.agent.x", path), {"llmgw.agent.supervisor"})


class TiesAtConstructionTests(SynchronousTestCase):
    """
    No module of llmgw.agent assigns an attribute of another object, but
    those L{ALLOWED}.
    """

    def found(self) -> dict[tuple[str, str], int]:
        folder = os.path.join(ROOT, "agent")
        counts: dict[tuple[str, str], int] = {}
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py") or name.endswith("_pb2.py"):
                continue
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                for target in foreign_assignments(f.read()):
                    counts[name, target] = counts.get((name, target), 0) + 1
        return counts

    def test_none_but_those_allowed(self) -> None:
        """
        Every attribute of another object assigned in llmgw.agent is one
        L{ALLOWED} names.
        """
        self.assertEqual(sorted(set(self.found()) - set(ALLOWED)), [])

    def test_allowed_still_there(self) -> None:
        """
        Each allowance is still used: one no longer needed is removed
        from the list rather than left to excuse a later one.
        """
        self.assertEqual(sorted(set(ALLOWED) - set(self.found())), [])

    def test_detects_an_assignment(self) -> None:
        """
        An attribute of another object is found whether assigned plainly,
        annotated, augmented, through C{self.x}, or as one of several
        targets; C{self}'s own are not.
        """
        source = (
            "def f(self, factory):\n"
            "    factory.hint = 1\n"
            "    factory.seen: int = 2\n"
            "    factory.count += 1\n"
            "    self._agents.dialing = 'x'\n"
            "    self.mine = factory.other = 3\n"
            "    a, factory.pair = 1, 2\n"
            "    self.own = 4\n"
        )
        self.assertEqual(
            sorted(foreign_assignments(source)),
            sorted(
                [
                    "factory.hint",
                    "factory.seen",
                    "factory.count",
                    "self._agents.dialing",
                    "factory.other",
                    "factory.pair",
                ]
            ),
        )
