"""
Checks every configuration parser uses: the error they raise, durations,
sizes, URLs, booleans, strings, and the one unknown-key check for every
TOML table (the server's file, the catalog's C{[[models]]}, the agent's
file); and how a table says which keys it has: a L{Table} of L{Key}s,
each with its kind, default and meaning, which the table's parser checks
keys against and L{llmgw.config_docs} prints as the configuration
reference.

A leaf: it imports nothing from the rest of llmgw, so any process may
import it.  A configuration error is raised as L{ConfigError} carrying one
line that names the key and the offending value, so that C{twistd} can
print it and exit without a traceback.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar
from urllib.parse import urlsplit

_T = TypeVar("_T")


class ConfigError(Exception):
    """
    The configuration is invalid.  C{str(error)} is one line naming the key
    and the value.
    """


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KB": 1000,
    "KiB": 1024,
    "MB": 1000**2,
    "MiB": 1024**2,
    "GB": 1000**3,
    "GiB": 1024**3,
}


DURATION = "duration"
"""
The kind of a key read by L{parse_duration}.
"""

SIZE = "size"
"""
The kind of a key read by L{parse_size}.
"""

COUNT = "integer >= 0"
"""
The kind of a key that is a whole number, 0 or more.
"""

POSITIVE = "integer >= 1"
"""
The kind of a key that is a whole number, 1 or more.
"""

REQUIRED = object()
"""
The default of a key that has none: the table must give it.
"""


@dataclass(frozen=True)
class Key:
    """
    One key of a TOML table, as the configuration reference shows it.

    @ivar name: the key, as written in the file.
    @ivar kind: what value it takes, in words (L{DURATION}, L{SIZE},
        L{COUNT}, C{"boolean"}, C{"one of: a, b"}...).
    @ivar doc: what it means: one or more sentences, never empty.
    @ivar default: its value when the table leaves it out (as the settings
        hold it: seconds for a duration, bytes for a size), L{REQUIRED}, or
        L{None} for none.
    @ivar shown: the default as the reference prints it, when it is not the
        value itself (such as C{"max(min_replicas, 1)"}); empty to print
        C{default}.
    """

    name: str
    kind: str
    doc: str
    default: object = REQUIRED
    shown: str = ""


@dataclass(frozen=True)
class Table:
    """
    One TOML table (or array of tables) and its keys.

    @ivar name: as a file writes its header, C{"[router]"},
        C{"[[models]]"}; empty for the top level of a file.
    @ivar doc: what the table is for, one or more sentences.
    @ivar keys: its keys, in the order the reference lists them.
    """

    name: str
    doc: str
    keys: tuple[Key, ...]

    @property
    def names(self) -> frozenset[str]:
        """
        The keys the table accepts.
        """
        return frozenset(key.name for key in self.keys)

    def of_kind(self, kind: str) -> frozenset[str]:
        """
        @return: the keys of the given kind, such as L{DURATION}.
        """
        return frozenset(key.name for key in self.keys if key.kind == kind)


def setting(default: _T, kind: str, doc: str, shown: str = "") -> _T:
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
        copy = default.copy
        return field(default_factory=copy, metadata=metadata)  # type: ignore[return-value]
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


def parse_duration(key: str, value: object) -> float:
    """
    Parse a duration such as C{"250ms"}, C{"5s"}, C{"2m"} or C{"1h"}.

    @param key: the configuration key, for the error message.
    @param value: a string with a unit, or a non-negative number of seconds.
    @return: seconds.
    @raise ConfigError: the value is not a duration.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{key}: bad duration {value!r}: must be finite")
        if value < 0:
            raise ConfigError(f"{key}: bad duration {value!r}: must not be negative")
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is not None:
            return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    raise ConfigError(
        f"{key}: bad duration {value!r}: use a number with a unit,"
        ' ms, s, m, h or d, such as "5s" or "2m"'
    )


def parse_size(key: str, value: object) -> int:
    """
    Parse a size such as C{33554432}, C{"32MiB"} or C{"500KB"}.

    @return: bytes.
    @raise ConfigError: the value is not a size, or is zero.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)) is not None:
        size = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    else:
        raise ConfigError(
            f'{key}: bad size {value!r}: use bytes or a unit, such as "32MiB"'
        )
    if size <= 0:
        raise ConfigError(f"{key}: bad size {value!r}: must be positive")
    return size


def check_url(key: str, value: object) -> str:
    """
    @return: an C{http} or C{https} URL with a host, without the trailing
        slash.
    @raise ConfigError: anything else, or a URL with a query or fragment.
    """
    if not isinstance(value, str):
        raise ConfigError(f"{key}: bad URL {value!r}: expected a string")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise ConfigError(f"{key}: bad URL {value!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{key}: bad URL {value!r}: expected http://host:port or https://host:port"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"{key}: bad URL {value!r}: no query or fragment allowed")
    del port
    return value.rstrip("/")


def check_bool(key: str, value: object) -> bool:
    """
    @raise ConfigError: not C{true} or C{false}.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def check_choice(key: str, value: object, choices: tuple[str, ...]) -> str:
    """
    @raise ConfigError: not one of the strings C{choices}.
    """
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def check_string(key: str, value: object) -> str:
    """
    @raise ConfigError: not a string, or empty.
    """
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value
