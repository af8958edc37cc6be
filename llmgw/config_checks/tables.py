"""
How a TOML table says its keys, and the one parser every table uses: a
L{Table} of L{Key}s, each with its L{Kind}, default and meaning (from a
settings dataclass whose fields are made with L{setting}, or written
out), which L{Table.read} reads a file's table with and
L{llmgw.config_docs} prints as the configuration reference.

L{Table.read} refuses an unknown key (L{check_keys}) and a missing
required one, reads each key through its kind, and gives the values by
name; a table whose keys must agree with each other checks that after,
in its own parser (such as C{[control]}'s C{lost_after >=
unreachable_after}) or, for each table of an array, in its L{Table.check}
(the catalog's profiles: a gang needs its C{fabric}).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from llmgw.config_checks.kinds import Kind
from llmgw.config_checks.values import ConfigError, spelled

_T = TypeVar("_T")

REQUIRED = object()
"""
The default of a key that has none: the table must give it.
"""


@dataclass(frozen=True)
class Key:
    """
    One key of a TOML table.

    @ivar name: the key, as written in the file.
    @ivar kind: what value it takes: the L{Kind} that reads it and says it
        in the reference.
    @ivar doc: what it means: one or more sentences, never empty.
    @ivar default: its value when the table leaves it out (as the settings
        hold it: seconds for a duration, bytes for a size), L{REQUIRED}, or
        L{None} for none.
    @ivar shown: the default as the reference prints it, when it is not the
        value itself (such as C{"max(min_replicas, 1)"}); empty to print
        C{default}.
    """

    name: str
    kind: Kind[Any]
    doc: str
    default: object = REQUIRED
    shown: str = ""

    @property
    def words(self) -> str:
        """
        The kind as the reference's Type column says it.
        """
        return self.kind.words


Check = Callable[[str, Mapping[str, Any], dict[str, Any]], None]
"""
What a table's keys must agree on (L{Table.check}), called with the
table's name in messages (C{"models[0] (chat)"}), the table as the file
gives it (to tell a key given from one left to its default) and the
values L{Table.read} read; raises L{ConfigError} naming the key.
"""


@dataclass(frozen=True)
class Table:
    """
    One TOML table (or array of tables) and its keys.

    @ivar name: as a file writes its header, C{"[router]"},
        C{"[[models]]"}; empty for the top level of a file.
    @ivar doc: what the table is for, one or more sentences.
    @ivar keys: its keys, in the order the reference lists them and
        L{read} reads them.
    @ivar named_by: the key whose value names the table in messages, read
        first: C{"name"} turns C{models[0]} into C{models[0] (chat)}, so
        that a message names the model, not only its place in the file;
        empty for none.
    @ivar check: what the keys must agree on, run once each is read
        (L{Check}); L{None} for nothing.
    """

    name: str
    doc: str
    keys: tuple[Key, ...]
    named_by: str = ""
    check: Check | None = None

    @property
    def names(self) -> frozenset[str]:
        """
        The keys the table accepts.
        """
        return frozenset(key.name for key in self.keys)

    def of_kind(self, kind: Kind[Any]) -> frozenset[str]:
        """
        @return: the keys of the given kind, such as L{DURATION}.
        """
        return frozenset(key.name for key in self.keys if key.kind == kind)

    def read(
        self, data: object, where: str | None = None, others: Iterable[str] = ()
    ) -> dict[str, Any]:
        """
        Read a file's table: every key through its kind, in the table's
        order, so that of two mistakes the same one is told first.

        @param data: the table as C{tomllib} reads it.
        @param where: the table's name in messages, such as
            C{"endpoints[0]"}; by default its C{name} without brackets;
            followed by the value of C{named_by}, C{"models[0] (chat)"}.
        @param others: keys the table may also hold, read elsewhere (the
            tables of the file's top level).
        @return: each key's value, as the settings hold it: the value read,
            else the default (a copy), for every key of the table.
        @raise ConfigError: not a table, an unknown key, a required key
            missing, a bad value, or keys that disagree (L{check}), naming
            the table, the key and the value.
        """
        if where is None:
            where = self.name.strip("[]")
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a table, got {spelled(data)}")
        if self.named_by:
            where = f"{where} ({self._title(where, data)})"
        check_keys(where, data, self.names | set(others))
        values: dict[str, Any] = {}
        for key in self.keys:
            name = f"{where}.{key.name}" if where else key.name
            if key.name in data:
                values[key.name] = key.kind.read(name, data[key.name])
            elif key.default is REQUIRED:
                raise ConfigError(f"{name}: missing")
            else:
                values[key.name] = copy.copy(key.default)
        if self.check is not None:
            self.check(where, data, values)
        return values

    def _title(self, where: str, data: Mapping[str, Any]) -> str:
        """
        @return: the value of the key L{named_by}, read by its kind, for
            the messages about the table's other keys.
        @raise ConfigError: it is missing or bad, named by the table's
            place (C{"models[0].name: missing"}).
        """
        (key,) = (key for key in self.keys if key.name == self.named_by)
        name = f"{where}.{key.name}"
        if key.name not in data:
            raise ConfigError(f"{name}: missing")
        return str(key.kind.read(name, data[key.name]))


@dataclass(frozen=True)
class ArrayOfTables(Kind[tuple[_T, ...]]):
    """
    An array of tables (C{[[endpoints]]}), each read by L{Table.read} and
    made into one value; read as a tuple.

    @ivar table: the keys of each.
    @ivar make: what makes a value of one table's values.
    """

    table: Table
    make: Callable[[dict[str, Any]], _T]

    @property
    def words(self) -> str:
        return f"{self.table.name} tables"

    def read(self, where: str, value: object) -> tuple[_T, ...]:
        if not isinstance(value, list):
            raise ConfigError(
                f"{where}: expected an array of tables ({self.table.name}),"
                f" got {spelled(value)}"
            )
        return tuple(
            self.make(self.table.read(item, f"{where}[{i}]"))
            for i, item in enumerate(value)
        )


def setting(default: _T, kind: Kind[_T], doc: str, shown: str = "") -> _T:
    """
    A field of a settings dataclass that is a key of its TOML table, of the
    same name: L{settings_keys} reads it back.

    @param default: the key's default (mutable ones are copied per instance).
    @param kind: see L{Key.kind}.
    @param doc: see L{Key.doc}.
    @param shown: see L{Key.shown}; such as C{"none"} for an empty string
        that means none but cannot be written (the key takes no C{""}).
    """
    metadata = {"llmgw.key": (kind, doc, shown)}
    if isinstance(default, (dict, list)):
        make = default.copy
        return field(default_factory=make, metadata=metadata)  # type: ignore[return-value]
    return field(default=default, metadata=metadata)


def settings_keys(settings: type[Any]) -> tuple[Key, ...]:
    """
    @param settings: a dataclass whose table keys are made with L{setting}.
    @return: a L{Key} per such field, in the class's order; the other fields
        (filled from elsewhere, such as a flag) are no keys.
    """
    keys = []
    for item in fields(settings):
        if "llmgw.key" not in item.metadata:
            continue
        kind, doc, shown = item.metadata["llmgw.key"]
        if item.default_factory is not MISSING:
            default: object = item.default_factory()
        else:
            default = item.default
        keys.append(Key(item.name, kind, doc, default, shown))
    return tuple(keys)


def check_keys(where: str, table: Mapping[str, Any], known: Iterable[str]) -> None:
    """
    Refuse a key a table does not have.

    @param where: the table's name in messages, such as C{"router"} or
        C{"models[0] (chat)"}; empty for the top level of a file.
    @param table: the parsed TOML table.
    @param known: the keys the table may hold.
    @raise ConfigError: the first unknown key, named with C{where} and the
        known keys, such as C{"router.retries: unknown key (known:
        connect_timeout, ...)"}.
    """
    allowed = set(known)
    for key in table:
        if key not in allowed:
            name = f"{where}.{key}" if where else key
            raise ConfigError(
                f"{name}: unknown key (known: {', '.join(sorted(allowed))})"
            )
