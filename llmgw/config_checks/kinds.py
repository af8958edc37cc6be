"""
What a key takes, said once: a L{Kind} reads a value from the file
(checking its type, range, allowed values and unit, raising L{ConfigError}
in one line naming the key and the value as TOML writes it) and describes
itself for the configuration reference (L{Kind.words}, L{Kind.spell}).  A
setting is declared with its kind (L{llmgw.config_checks.tables.setting}),
so the check and the reference cannot drift apart.

The kinds here are those of more than one table; a kind of one table's key
only (the control plane's port range, the agent's C{sleep_memory}) is
written beside that table, as a subclass of L{Kind}.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

from llmgw.config_checks.values import (
    ConfigError,
    check_bool,
    check_choice,
    parse_duration,
    parse_size,
    parse_url,
    spelled,
)

_T_co = TypeVar("_T_co", covariant=True)

_DURATION_UNITS = (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0))
_SIZE_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


class Kind(ABC, Generic[_T_co]):
    """
    The values a key takes.
    """

    @property
    @abstractmethod
    def words(self) -> str:
        """
        The kind as the reference's Type column says it, such as
        C{"duration >= 10ms"} or C{"one of: text, json"}.
        """

    @abstractmethod
    def read(self, where: str, value: object) -> _T_co:
        """
        @param where: the key as messages name it, C{"router.idle_timeout"}.
        @param value: what the file gives, as C{tomllib} reads it.
        @return: the value as the settings hold it (seconds for a duration,
            bytes for a size, a tuple for a list).
        @raise ConfigError: C{value} is not of this kind, in one line naming
            C{where} and the value.
        """

    def spell(self, value: object) -> str:
        """
        @return: C{value} (as the settings hold it) as a file would give it,
            for the reference's Default column: C{"5s"}, C{"32MiB"},
            C{true}, C{[20000, 20999]}.
        """
        return spelled(value, literal=False)


def duration_text(seconds: float) -> str:
    """
    @return: C{seconds} in the largest unit that makes it whole: C{"2m"},
        C{"250ms"}, C{"0s"}.
    """
    if seconds == 0:
        return "0s"
    for unit, length in _DURATION_UNITS:
        count = seconds / length
        if count >= 1 and math.isclose(count, round(count)):
            return f"{round(count)}{unit}"
    return f"{round(seconds * 1000)}ms"


def size_text(size: int) -> str:
    """
    @return: C{size} bytes in the largest binary unit that makes it whole,
        C{"32MiB"}, else the number of bytes.
    """
    for unit, length in _SIZE_UNITS:
        if size >= length and size % length == 0:
            return f"{size // length}{unit}"
    return str(size)


def _span(least: str | None, most: str | None) -> str:
    """
    @return: a range as the reference's Type column writes it after the
        kind's name: C{" >= 10ms"}, C{" <= 60s"}, C{", 100ms to 60s"}.
    """
    if least is not None and most is not None:
        return f", {least} to {most}"
    if least is not None:
        return f" >= {least}"
    if most is not None:
        return f" <= {most}"
    return ""


@dataclass(frozen=True)
class Duration(Kind[float]):
    """
    A number of seconds, or a string with a unit: C{"250ms"}, C{"5s"}.

    @ivar least: the shortest, seconds.
    @ivar most: the longest, seconds; L{None} for no bound.
    @ivar positive: whether it must be more than 0s.
    @ivar off: whether C{"0s"}, under C{least}, is allowed: it turns the
        setting off.
    """

    least: float = 0.0
    most: float | None = None
    positive: bool = False
    off: bool = False

    @property
    def words(self) -> str:
        if self.positive and not self.least:
            text = "duration > 0s"
        else:
            least = duration_text(self.least) if self.least else None
            most = duration_text(self.most) if self.most is not None else None
            text = "duration" + _span(least, most)
        return text + (', or "0s" (off)' if self.off else "")

    def read(self, where: str, value: object) -> float:
        seconds = parse_duration(where, value)
        if self.off and seconds == 0:
            return seconds
        if self.positive and seconds <= 0:
            raise ConfigError(f"{where}: must be more than 0s, got {spelled(value)}")
        if seconds < self.least:
            off = " (0s turns it off)" if self.off else ""
            raise ConfigError(
                f"{where}: under the least, {duration_text(self.least)},"
                f" got {spelled(value)}{off}"
            )
        if self.most is not None and seconds > self.most:
            raise ConfigError(
                f"{where}: over the most, {duration_text(self.most)},"
                f" got {spelled(value)}"
            )
        return seconds

    def spell(self, value: object) -> str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return f'"{duration_text(float(value))}"'
        return super().spell(value)


@dataclass(frozen=True)
class Size(Kind[int]):
    """
    A number of bytes, or a string with a unit: C{"32MiB"}, C{"500KB"}.

    @ivar least: the smallest, bytes (more than 0).
    @ivar off: whether 0, under C{least}, is allowed: it turns the setting
        off.
    """

    least: int = 1
    off: bool = False

    @property
    def words(self) -> str:
        least = size_text(self.least) if self.least > 1 else None
        return "size" + _span(least, None) + (", or 0 (off)" if self.off else "")

    def read(self, where: str, value: object) -> int:
        size = parse_size(where, value, zero=self.off)
        if size < self.least and not (self.off and size == 0):
            raise ConfigError(
                f"{where}: under the least, {size_text(self.least)},"
                f" got {spelled(value)}"
            )
        return size

    def spell(self, value: object) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            text = size_text(value)
            return text if text.isdigit() else f'"{text}"'
        return super().spell(value)


@dataclass(frozen=True)
class Integer(Kind[int]):
    """
    A whole number, within bounds.

    @ivar least: the smallest; L{None} for no bound.
    @ivar most: the largest; L{None} for no bound.
    """

    least: int | None = None
    most: int | None = None

    @property
    def words(self) -> str:
        if self.least is not None and self.most is not None:
            return f"integer, {self.least} to {self.most}"
        return "integer" + _span(
            None if self.least is None else str(self.least),
            None if self.most is None else str(self.most),
        )

    def _expected(self) -> str:
        if self.least is not None and self.most is not None:
            return f"a whole number from {self.least} to {self.most}"
        if self.least == 0:
            return "a non-negative integer"
        if self.least is not None:
            return f"a whole number of at least {self.least}"
        if self.most is not None:
            return f"an integer of at most {self.most}"
        return "an integer"

    def read(self, where: str, value: object) -> int:
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or (self.least is not None and value < self.least)
            or (self.most is not None and value > self.most)
        ):
            raise ConfigError(
                f"{where}: expected {self._expected()}, got {spelled(value)}"
            )
        return value


def _number(value: float | None) -> str | None:
    """
    @return: a bound as messages and the reference write it: C{100000},
        C{0.5}; L{None} for none.
    """
    if value is None:
        return None
    return str(int(value)) if value == int(value) else repr(float(value))


@dataclass(frozen=True)
class Number(Kind[float]):
    """
    A number, whole or not, within bounds; read as a float.

    @ivar least: the smallest; L{None} for no bound.
    @ivar most: the largest; L{None} for no bound.
    @ivar positive: whether it must be more than 0.
    @ivar unit: what it counts, for the reference (C{"GB"}); empty for
        none.
    """

    least: float | None = None
    most: float | None = None
    positive: bool = False
    unit: str = ""

    def _range(self) -> tuple[str | None, str | None]:
        return _number(self.least), _number(self.most)

    @property
    def words(self) -> str:
        name = f"number of {self.unit}" if self.unit else "number"
        if self.positive:
            most = self._range()[1]
            return f"{name} > 0" + (f", up to {most}" if most else "")
        return name + _span(*self._range())

    def _expected(self) -> str:
        least, most = self._range()
        if self.positive:
            return "a number over 0" + (f", up to {most}" if most else "")
        if least is not None and most is not None:
            return f"a number from {least} to {most}"
        if least is not None:
            return f"a number of at least {least}"
        if most is not None:
            return f"a number of at most {most}"
        return "a number"

    def read(self, where: str, value: object) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or math.isnan(value)
            or (self.positive and not value > 0)
            or (self.least is not None and not value >= self.least)
            or (self.most is not None and not value <= self.most)
        ):
            raise ConfigError(
                f"{where}: expected {self._expected()}, got {spelled(value)}"
            )
        return float(value)


@dataclass(frozen=True)
class Boolean(Kind[bool]):
    """
    C{true} or C{false}.
    """

    @property
    def words(self) -> str:
        return "boolean"

    def read(self, where: str, value: object) -> bool:
        return check_bool(where, value)


@dataclass(frozen=True)
class Choice(Kind[str]):
    """
    One of a few strings.

    @ivar choices: the strings, in the order messages list them.
    """

    choices: tuple[str, ...]

    @property
    def words(self) -> str:
        return "one of: " + ", ".join(self.choices)

    def read(self, where: str, value: object) -> str:
        return check_choice(where, value, self.choices)


@dataclass(frozen=True)
class Text(Kind[str]):
    """
    A string.

    @ivar shape: what it is, for the reference and the messages: C{"path"},
        C{"Twisted server endpoint"}, C{"header name"}.
    @ivar empty: whether C{""} is allowed (it means none).
    @ivar pattern: what the whole string must match (C{fullmatch}), when
        anything will not do.
    @ivar secret: whether a message leaves the value out (a key, a token).
    """

    shape: str = "string"
    empty: bool = False
    pattern: re.Pattern[str] | None = None
    secret: bool = False

    @property
    def words(self) -> str:
        return self.shape

    def read(self, where: str, value: object) -> str:
        if isinstance(value, str) and (value or self.empty):
            if self.pattern is None or self.pattern.fullmatch(value):
                return value
        got = "" if self.secret else f", got {spelled(value)}"
        if self.pattern is not None:
            article = "an" if self.shape[:1].lower() in "aeiou" else "a"
            none = ' or ""' if self.empty else ""
            raise ConfigError(f"{where}: expected {article} {self.shape}{none}{got}")
        if self.empty:
            raise ConfigError(f"{where}: expected a string{got}")
        raise ConfigError(f"{where}: expected a non-empty string{got}")


@dataclass(frozen=True)
class Address(Kind[str]):
    """
    C{HOST:PORT}, a port from 1 to 65535.
    """

    @property
    def words(self) -> str:
        return "HOST:PORT"

    def read(self, where: str, value: object) -> str:
        if isinstance(value, str):
            host, _, port = value.rpartition(":")
            if host and port.isdigit() and 0 < int(port) < 65536:
                return value
        raise ConfigError(f"{where}: bad value {spelled(value)}: expected HOST:PORT")


@dataclass(frozen=True)
class Url(Kind[str]):
    """
    A URL of given schemes (L{llmgw.config_checks.values.parse_url}).

    @ivar schemes: such as C{("redis", "rediss")}.
    @ivar example: what it should look like, for messages.
    @ivar host: whether it must name a host.
    @ivar query: whether it may carry a query or fragment.
    @ivar trim: whether a trailing slash is cut off (a base URL that paths
        are added to).
    """

    schemes: tuple[str, ...]
    example: str
    host: bool = True
    query: bool = True
    trim: bool = False

    @property
    def words(self) -> str:
        return " or ".join(f"{scheme}://" for scheme in self.schemes) + " URL"

    def read(self, where: str, value: object) -> str:
        url = parse_url(
            where, value, self.schemes, self.example, host=self.host, query=self.query
        )
        return url.rstrip("/") if self.trim else url


@dataclass(frozen=True)
class ListOf(Kind[tuple[_T_co, ...]]):
    """
    A list, each item of one kind; read as a tuple.

    @ivar item: the items' kind; a message about one names it C{key[i]}.
    @ivar shape: the list as the reference and the messages say it,
        C{"list of strings"}.
    """

    item: Kind[_T_co]
    shape: str

    @property
    def words(self) -> str:
        return self.shape

    def read(self, where: str, value: object) -> tuple[_T_co, ...]:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a {self.shape}, got {spelled(value)}")
        return tuple(self.item.read(f"{where}[{i}]", v) for i, v in enumerate(value))


@dataclass(frozen=True)
class StringTable(Kind[dict[str, str]]):
    """
    A table of strings, such as C{{gpu = "h100"}}; read as a new dict.
    """

    @property
    def words(self) -> str:
        return "table of strings"

    def read(self, where: str, value: object) -> dict[str, str]:
        if not isinstance(value, dict) or not all(
            isinstance(v, str) for v in value.values()
        ):
            raise ConfigError(
                f"{where}: expected a table of strings, got {spelled(value)}"
            )
        return dict(value)


DURATION = Duration()
"""
Any duration, 0s or more.
"""

SIZE = Size()
"""
Any size, 1 byte or more.
"""

COUNT = Integer(least=0)
"""
A whole number, 0 or more.
"""

POSITIVE = Integer(least=1)
"""
A whole number, 1 or more.
"""

BOOLEAN = Boolean()
"""
C{true} or C{false}.
"""
