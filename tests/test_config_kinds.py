"""
The kinds of L{llmgw.config_checks}: each reads a value, refusing a bad one
in one line naming the key and the value as TOML writes it, and says
itself for the reference; L{Table.read}, the one parser every table uses.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.config_checks import (
    REQUIRED,
    Address,
    ArrayOfTables,
    ConfigError,
    Duration,
    Integer,
    Key,
    ListOf,
    Number,
    Size,
    StringTable,
    Table,
    Text,
    Url,
    setting,
    settings_keys,
    spelled,
)


class _Case(SynchronousTestCase):
    def refused(self, kind: Any, value: object, message: str) -> None:
        """
        C{kind} refuses C{value} read as C{"t.k"} with C{message}.
        """
        with self.assertRaises(ConfigError) as raised:
            kind.read("t.k", value)
        self.assertEqual(str(raised.exception), message)


class DurationTests(_Case):
    def test_bounds(self) -> None:
        """
        A duration's bounds are checked by its kind, and said in its words:
        the least, the most, more than 0s, and 0s as off.
        """
        self.assertEqual(Duration(least=0.01).read("t.k", "10ms"), 0.01)
        self.refused(
            Duration(least=0.01), "5ms", "t.k: under the least, 10ms, got '5ms'"
        )
        self.refused(Duration(most=60.0), "2m", "t.k: over the most, 1m, got '2m'")
        self.refused(Duration(positive=True), 0, "t.k: must be more than 0s, got 0")
        off = Duration(least=0.1, off=True)
        self.assertEqual(off.read("t.k", "0s"), 0.0)
        self.refused(
            off,
            "10ms",
            "t.k: under the least, 100ms, got '10ms' (0s turns it off)",
        )
        self.assertEqual(
            [
                k.words
                for k in (
                    Duration(),
                    Duration(least=0.01),
                    Duration(least=0.1, most=60.0),
                    Duration(positive=True),
                    off,
                )
            ],
            [
                "duration",
                "duration >= 10ms",
                "duration, 100ms to 1m",
                "duration > 0s",
                'duration >= 100ms, or "0s" (off)',
            ],
        )

    def test_spelled_in_units(self) -> None:
        """
        A default is printed in the largest unit that makes it whole.
        """
        kind = Duration()
        self.assertEqual(
            [kind.spell(v) for v in (0.0, 0.25, 5.0, 120.0, 86400.0 * 365)],
            ['"0s"', '"250ms"', '"5s"', '"2m"', '"365d"'],
        )


class SizeTests(_Case):
    def test_least_and_off(self) -> None:
        """
        A size's least is checked; 0, in any unit, is allowed only where it
        turns the setting off.
        """
        self.assertEqual(Size(least=1024).read("t.k", "2KiB"), 2048)
        self.refused(Size(least=1024), 100, "t.k: under the least, 1KiB, got 100")
        self.assertEqual(Size(off=True).read("t.k", "0B"), 0)
        self.assertEqual(Size(off=True).read("t.k", 0), 0)
        self.refused(Size(), "0B", "t.k: bad size '0B': must be positive")
        self.refused(
            Size(off=True),
            False,
            't.k: bad size false: use bytes or a unit, such as "32MiB"',
        )
        self.assertEqual(Size(least=1024).words, "size >= 1KiB")
        self.assertEqual(Size().spell(32 * 1024**2), '"32MiB"')
        self.assertEqual(Size().spell(1000), "1000")


class NumberTests(_Case):
    def test_integers(self) -> None:
        """
        An integer is a whole number within its bounds; a boolean or a
        float is none.
        """
        self.assertEqual(Integer(0, 64).read("t.k", 64), 64)
        for value, shown in ((65, "65"), (True, "true"), (1.0, "1.0")):
            self.refused(
                Integer(0, 64),
                value,
                f"t.k: expected a whole number from 0 to 64, got {shown}",
            )
        self.refused(
            Integer(least=0), -2, "t.k: expected a non-negative integer, got -2"
        )
        self.refused(
            Integer(least=1), 0, "t.k: expected a whole number of at least 1, got 0"
        )
        self.assertEqual(Integer(least=1).words, "integer >= 1")

    def test_numbers(self) -> None:
        """
        A number is read as a float within its bounds; NaN is none.
        """
        self.assertEqual(Number(least=0, most=1).read("t.k", 1), 1.0)
        self.refused(
            Number(least=0, most=1),
            1.5,
            "t.k: expected a number from 0 to 1, got 1.5",
        )
        self.refused(
            Number(positive=True), math.nan, "t.k: expected a number over 0, got nan"
        )
        self.assertEqual(
            Number(positive=True, most=1_000_000, unit="GB").words,
            "number of GB > 0, up to 1000000",
        )


class TextTests(_Case):
    def test_strings(self) -> None:
        """
        A string is non-empty unless its kind allows C{""}; one with a
        pattern must match it whole; a secret is never shown.
        """
        self.refused(Text(), "", "t.k: expected a non-empty string, got ''")
        self.assertEqual(Text(empty=True).read("t.k", ""), "")
        header = Text("header name", empty=True, pattern=re.compile(r"[A-Za-z-]*"))
        self.refused(
            header, "X-A\n", 't.k: expected a header name or "", got "X-A\\u000a"'
        )
        secret = Text("token", pattern=re.compile(r"[!-~]+"), secret=True)
        self.refused(secret, "two words", "t.k: expected a token")

    def test_urls_and_addresses(self) -> None:
        """
        A URL's scheme, host and query are checked as its kind says; an
        address is HOST:PORT.
        """
        http = Url(("http", "https"), "http://host:port", query=False, trim=True)
        self.assertEqual(http.read("t.k", "http://h:1/"), "http://h:1")
        self.refused(http, "h:1", "t.k: bad URL 'h:1': expected http://host:port")
        self.refused(
            http,
            "http://h/?q",
            "t.k: bad URL 'http://h/?q': no query or fragment allowed",
        )
        self.assertEqual(http.words, "http:// or https:// URL")
        self.assertEqual(Address().read("t.k", "h:80"), "h:80")
        self.refused(Address(), "h:0", "t.k: bad value 'h:0': expected HOST:PORT")

    def test_list_items_named(self) -> None:
        """
        A bad item of a list is named by its index.
        """
        kind = ListOf(Text(), "list of names")
        self.assertEqual(kind.read("t.k", ["a", "b"]), ("a", "b"))
        self.refused(kind, "a", "t.k: expected a list of names, got 'a'")
        self.refused(kind, ["a", 3], "t.k[1]: expected a non-empty string, got 3")


@dataclass(frozen=True)
class _Settings:
    first: float = setting(5.0, Duration(), "First.")
    second: int = setting(1, Integer(least=1), "Second.")
    names: dict[str, str] = setting({}, StringTable(), "Names.")


_TABLE = Table(
    "[t]",
    "A table.",
    (
        Key("need", Text(), "Needed."),
        Key("many", ListOf(Text(), "list of strings"), "Many.", []),
        Key("after", Integer(), "After.", 0),
    ),
)


class TableReadTests(_Case):
    def test_values_and_defaults(self) -> None:
        """
        L{Table.read} gives every key: the value read, else a copy of its
        default.
        """
        values = _TABLE.read({"need": "x", "many": ["a"]})
        self.assertEqual(values, {"need": "x", "many": ("a",), "after": 0})
        first, second = _TABLE.read({"need": "x"}), _TABLE.read({"need": "y"})
        self.assertIsNot(first["many"], second["many"])

    def test_mistakes_named(self) -> None:
        """
        Not a table, an unknown key, a missing one and a bad value are each
        one line naming where; of two mistakes, the first key of the table
        is told, whatever the file's order.
        """
        for data, message in [
            (3, "t: expected a table, got 3"),
            ({"need": "x", "zz": 1}, "t.zz: unknown key (known: after, many, need)"),
            ({}, "t.need: missing"),
            ({"after": 1.5, "need": ""}, "t.need: expected a non-empty string, got ''"),
        ]:
            with self.assertRaises(ConfigError) as raised:
                _TABLE.read(data)
            self.assertEqual(str(raised.exception), message)
        # A key another reader takes is no unknown key; "where" names the
        # table in messages.
        self.assertEqual(_TABLE.read({"need": "x", "z": 1}, others=("z",))["need"], "x")
        with self.assertRaises(ConfigError) as raised:
            _TABLE.read({}, "t[0]")
        self.assertEqual(str(raised.exception), "t[0].need: missing")

    def test_settings_table(self) -> None:
        """
        A table of a settings class's keys reads them by their kinds; a
        key without a default is required.
        """
        table = Table("[s]", "S.", settings_keys(_Settings))
        self.assertEqual(
            table.read({"first": "1m", "names": {"a": "b"}}),
            {"first": 60.0, "second": 1, "names": {"a": "b"}},
        )
        self.assertIs(
            Table("[r]", "R.", (Key("a", Text(), "A."),)).keys[0].default, REQUIRED
        )

    def test_named_by(self) -> None:
        """
        A table named by one of its keys is called by it in messages about
        the others, once that key is read; the key itself, missing or bad,
        is named by the table's place.
        """
        table = Table("[[t]]", "T.", _TABLE.keys, named_by="need")
        for data, message in [
            ({"need": "x", "after": 1.5}, "t[0] (x).after: expected an integer"),
            ({"need": "x", "zz": 1}, "t[0] (x).zz: unknown key"),
            ({"after": 1}, "t[0].need: missing"),
            ({"need": ""}, "t[0].need: expected a non-empty string"),
        ]:
            with self.assertRaises(ConfigError) as raised:
                table.read(data, "t[0]")
            self.assertTrue(str(raised.exception).startswith(message), message)

    def test_check_after_the_read(self) -> None:
        """
        A table's check runs once every key is read, given the table's name
        in messages, the table as given and the values read; what it raises
        is what the read raises.
        """
        seen: list[tuple[str, object, dict[str, Any]]] = []

        def check(where: str, given: Any, values: dict[str, Any]) -> None:
            seen.append((where, dict(given), dict(values)))
            if values["after"] > len(values["many"]):
                raise ConfigError(f"{where}.after: more than many")

        table = Table("[[t]]", "T.", _TABLE.keys, named_by="need", check=check)
        self.assertEqual(
            table.read({"need": "x", "many": ["a"], "after": 1})["after"], 1
        )
        self.assertEqual(
            seen,
            [
                (
                    "t (x)",
                    {"need": "x", "many": ["a"], "after": 1},
                    {"need": "x", "many": ("a",), "after": 1},
                )
            ],
        )
        with self.assertRaises(ConfigError) as raised:
            table.read({"need": "x", "after": 1})
        self.assertEqual(str(raised.exception), "t (x).after: more than many")
        # A bad key is told before the check runs.
        with self.assertRaises(ConfigError) as raised:
            table.read({"need": "x", "after": "1"})
        self.assertIn("t (x).after: expected an integer", str(raised.exception))
        self.assertEqual(len(seen), 2)

    def test_array_of_tables(self) -> None:
        """
        An array of tables reads each with its table, named by its index.
        """
        kind = ArrayOfTables(_TABLE, lambda values: values["need"])
        self.assertEqual(kind.read("ts", [{"need": "a"}, {"need": "b"}]), ("a", "b"))
        self.refused(
            kind,
            {"need": "a"},
            "t.k: expected an array of tables ([t]), got {need = 'a'}",
        )
        with self.assertRaises(ConfigError) as raised:
            kind.read("ts", [{"need": "a"}, {}])
        self.assertEqual(str(raised.exception), "ts[1].need: missing")
        self.assertEqual(kind.words, "[t] tables")


_TOML_KEY = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
_TOML_SCALAR = (
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text()
)
_TOML_VALUE = st.recursive(
    _TOML_SCALAR,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(_TOML_KEY, inner, max_size=4)
    ),
    max_leaves=10,
)


class SpelledTests(SynchronousTestCase):
    @given(_TOML_VALUE, st.booleans())
    def test_spelled_is_toml(self, value: object, literal: bool) -> None:
        """
        What L{spelled} writes, in messages or the reference, is TOML that
        reads back as the value.
        """
        self.assertEqual(tomllib.loads(f"x = {spelled(value, literal)}")["x"], value)

    def test_spelled_as_toml(self) -> None:
        """
        Booleans as TOML writes them, strings as literal strings (where
        they can be) in messages, as basic strings in the reference.
        """
        self.assertEqual(
            [spelled(v) for v in (True, "xml", "it's", [1, "a"], {"a": 1.5})],
            ["true", "'xml'", '"it\'s"', "[1, 'a']", "{a = 1.5}"],
        )
        self.assertEqual(spelled("xml", literal=False), '"xml"')
