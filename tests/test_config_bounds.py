"""
Every documented range enforced (issue 37, item 4): for every key of every
table of the server's and the agent's files whose declared kind has a
bound, a file giving the value at each bound is read, and one giving the
value just past it is refused in one line naming the key, through the
files' own parsers (L{parse_config}, L{parse_agent_config}), so that a
table parser reading a key around its kind is caught as well as a kind
whose check is wrong.

The bounds are read from the declared kinds themselves (L{Integer},
L{Number}, L{Duration}, L{Size}, L{PortRange} and lists of them), so a new
key is tried as soon as it is declared; a kind this test cannot try is
named by L{test_every_kind_known} until it is taught here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.settings import (
    AGENT_TABLES,
    AbsolutePath,
    SleepMemory,
    parse_agent_config,
)
from llmgw.config import SERVER_TABLES, parse_config
from llmgw.config_checks import (
    Address,
    ArrayOfTables,
    Boolean,
    Choice,
    ConfigError,
    Duration,
    Integer,
    Key,
    Kind,
    ListOf,
    Number,
    Size,
    StringTable,
    Table,
    Text,
    Url,
)
from llmgw.control.prices import PriceList
from llmgw.control.settings import PortRange
from llmgw.router.settings_toml import ModelNames, Origins

Probe = tuple[object, bool]
"""
A value to give a key, and whether the file must be read (L{True}) or
refused naming the key (L{False}).
"""

_UNBOUNDED: tuple[type[Kind[Any]], ...] = (
    Address,
    Boolean,
    Choice,
    StringTable,
    Text,
    Url,
    AbsolutePath,
    ModelNames,
    Origins,
    SleepMemory,
)
"""
Kinds with no numeric range to try (their shapes are tried by
C{tests/test_config_kinds.py}).
"""

_REQUIRED_SAMPLES: dict[tuple[str, str], object] = {
    ("[[endpoints]]", "id"): "e1",
    ("[[endpoints]]", "url"): "http://127.0.0.1:8000",
    ("[[endpoints]]", "models"): ["m"],
    ("[[models]]", "name"): "m",
    ("[[models]]", "max_replicas"): 1,
    ("[[models]]", "profiles"): [{"name": "p", "engine": "sim", "source": "s"}],
    ("[[models.profiles]]", "name"): "p",
    ("[[models.profiles]]", "engine"): "sim",
    ("[[models.profiles]]", "source"): "s",
    ("[[simulated_gpus]]", "name"): "sim-0",
    ("[[simulated_gpus]]", "memory_gb"): 80,
}
"""
A good value of each required key of a table with a bounded key, so that
a file giving one key of that table is otherwise whole.
"""

_PEERS: dict[tuple[str, str], dict[str, object]] = {
    # lost_after must be at least unreachable_after (default 15s): try it
    # against the shortest unreachable_after, so that its own bound is what
    # is tried.
    ("[control]", "lost_after"): {"unreachable_after": 0.001},
    # max_backoff must be at least base_backoff.
    ("[control]", "max_backoff"): {"base_backoff": 0.001},
    # body_rate_window is at least 100ms only while min_body_rate is set.
    ("[router]", "body_rate_window"): {"min_body_rate": 0},
    # lease must be at least twice retry.
    ("[standby]", "retry"): {"lease": 120},
    ("[standby]", "lease"): {"retry": 0.1},
    # min_replicas is at most max_replicas.
    ("[[models]]", "min_replicas"): {"max_replicas": 10000},
    # A CPU profile (gpus = 0) takes no gpu_memory_gb.
    ("[[models.profiles]]", "gpu_memory_gb"): {"gpus": 1},
    # A gang (nodes > 1) names its fabric.
    ("[[models.profiles]]", "nodes"): {"fabric": "ib"},
}
"""
Other keys given with a key whose bound another key's value would mask.
"""


def _adapter(value: object) -> dict[str, Any]:
    """
    @return: a file whose adapter (a model with a base) has C{rank =
        value}, on a base that takes the largest rank.
    """
    profile = {"name": "p", "engine": "vllm", "source": "s", "gpus": 1}
    base = {"name": "b", "max_replicas": 1, "max_loras": 1, "max_lora_rank": 1024}
    adapter = {"name": "a", "base": "b", "adapter": "x", "rank": value}
    return {"models": [{**base, "profiles": [profile]}, adapter]}


_FILES: dict[tuple[str, str], Callable[[object], dict[str, Any]]] = {
    ("[[models]]", "rank"): _adapter,
}
"""
Whole files for keys that only one shape of their table takes (an
adapter's C{rank}).
"""


def _below(value: float) -> float:
    return math.nextafter(value, -math.inf)


def _above(value: float) -> float:
    return math.nextafter(value, math.inf)


def probes(kind: Kind[Any]) -> list[Probe]:
    """
    @return: the values at and just past each bound of C{kind}; none for a
        kind in L{_UNBOUNDED}.
    @raise TypeError: a kind this test does not know.
    """
    if isinstance(kind, Integer):
        found: list[Probe] = []
        if kind.least is not None:
            found += [(kind.least, True), (kind.least - 1, False)]
        if kind.most is not None:
            found += [(kind.most, True), (kind.most + 1, False)]
        return found
    if isinstance(kind, Number):
        found = []
        if kind.positive:
            found += [(0, False), (_above(0.0), True)]
        if kind.least is not None:
            found += [(kind.least, True), (_below(kind.least), False)]
        if kind.most is not None:
            found += [(kind.most, True), (_above(kind.most), False)]
        return found
    if isinstance(kind, Duration):
        found = [(-1, False)]
        if kind.off:
            found.append((0, True))
        if kind.positive:
            found += [(0.001, True)] + ([] if kind.off else [(0, False)])
        if kind.least > 0:
            found += [(kind.least, True), (_below(kind.least), False)]
        elif not kind.positive:
            found.append((0, True))
        if kind.most is not None:
            found += [(kind.most, True), (_above(kind.most), False)]
        return found
    if isinstance(kind, Size):
        found = [(kind.least, True)]
        if kind.least - 1 > 0 or not kind.off:
            found.append((kind.least - 1, False))
        found.append((0, kind.off))
        return found
    if isinstance(kind, PortRange):
        return [
            ([1024, 2000], True),
            ([1023, 2000], False),
            ([2000, 65535], True),
            ([2000, 65536], False),
        ]
    if isinstance(kind, ListOf):
        return [([value], good) for value, good in probes(kind.item)]
    if isinstance(kind, PriceList):
        # A price is 0 or more.
        return [
            ([{"gpu": "*", "price": 0}], True),
            ([{"gpu": "*", "price": _below(0.0)}], False),
        ]
    if isinstance(kind, ArrayOfTables):
        # Its table is tried as a table of its own.
        return []
    if isinstance(kind, _UNBOUNDED):
        return []
    raise TypeError(f"no probes for {kind!r}")


def _file(table: Table, key: Key, value: object) -> dict[str, Any]:
    """
    @return: a parsed file whose C{table} gives C{key} as C{value}, the
        table's required keys their samples and the key's peers theirs.
    """
    if (table.name, key.name) in _FILES:
        return _FILES[(table.name, key.name)](value)
    body: dict[str, Any] = {}
    for other in table.keys:
        sample = (table.name, other.name)
        if sample in _REQUIRED_SAMPLES and other.name != key.name:
            body[other.name] = _REQUIRED_SAMPLES[sample]
    body.update(_PEERS.get((table.name, key.name), {}))
    body[key.name] = value
    name = table.name.strip("[]")
    if not name:
        return body
    parent, _, child = name.rpartition(".")
    if parent:
        # A table inside another's ([[models.profiles]]): in the parent's
        # sample, in place of its sample of this one.
        outer = {
            key: value
            for (table_name, key), value in _REQUIRED_SAMPLES.items()
            if table_name == f"[[{parent}]]"
        }
        outer[child] = [body]
        return {parent: [outer]}
    return {name: [body] if table.name.startswith("[[") else body}


def _bounded(tables: tuple[Table, ...]) -> Iterator[tuple[Table, Key, list[Probe]]]:
    for table in tables:
        for key in table.keys:
            if isinstance(key.kind, str):
                continue
            found = probes(key.kind)
            if found:
                yield table, key, found


class BoundsTests(SynchronousTestCase):
    """
    Each bounded key, at and just past each of its bounds, through the
    file's parser.
    """

    def tried(
        self,
        tables: tuple[Table, ...],
        parse: Callable[[dict[str, Any]], object],
    ) -> int:
        """
        Try every bounded key of C{tables} through C{parse}.

        @return: how many values were tried.
        """
        count = 0
        wrong = []
        for table, key, found in _bounded(tables):
            where = f"{table.name.strip('[]')}.{key.name}".lstrip(".")
            leaf = key.name
            for value, good in found:
                count += 1
                data = _file(table, key, value)
                try:
                    parse(data)
                except ConfigError as e:
                    if good:
                        wrong.append(f"{where} = {value!r}: refused: {e}")
                    elif leaf not in str(e):
                        wrong.append(f"{where} = {value!r}: key not named: {e}")
                else:
                    if not good:
                        wrong.append(f"{where} = {value!r}: read, past its bound")
        self.assertEqual(wrong, [], "\n".join(wrong))
        return count

    def test_server(self) -> None:
        """
        Every bounded key of the server's file holds its range.
        """
        self.assertGreater(self.tried(SERVER_TABLES, parse_config), 100)

    def test_agent(self) -> None:
        """
        Every bounded key of the agent's file holds its range (a simulated
        GPU's memory is over 0 and at most 1000000 GB).
        """
        self.assertGreater(self.tried(AGENT_TABLES, parse_agent_config), 3)

    def test_every_kind_known(self) -> None:
        """
        Every key's kind is a L{Kind} this test knows how to try: none is
        declared in words only, which no parser reads.
        """
        for table in SERVER_TABLES + AGENT_TABLES:
            for key in table.keys:
                if isinstance(key.kind, str):
                    self.fail(f"{table.name} {key.name}: a kind in words")
                probes(key.kind)

    def test_probes_catch_a_hole(self) -> None:
        """
        The probes of a bounded kind include a value past the bound: a
        parser that let C{max_retries = -1} through would be caught.
        """
        self.assertIn((-1, False), probes(Integer(least=0)))
        self.assertIn((0, False), probes(Number(positive=True)))
        self.assertIn((_above(1.0), False), probes(Number(least=0, most=1)))
        self.assertIn((_below(0.1), False), probes(Duration(least=0.1, off=True)))
        self.assertIn((1023, False), probes(Size(least=1024)))
