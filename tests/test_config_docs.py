"""
How a TOML table says its keys (L{llmgw.config_checks.Table},
L{llmgw.config_checks.setting}), and the configuration reference printed
from them.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

import llmgw
from llmgw.accounts.settings import AuthConfig, LimitsConfig, StoreConfig
from llmgw.agent.settings import AGENT_TABLES, AgentConfig, parse_agent_config
from llmgw.batches.settings import BatchesConfig
from llmgw.config import SERVER_TABLE, SERVER_TABLES, ServerConfig, parse_config
from llmgw.config_checks import (
    BOOLEAN,
    DURATION,
    REQUIRED,
    ConfigError,
    Integer,
    Key,
    Kind,
    StringTable,
    Table,
    Text,
    setting,
    settings_keys,
)
from llmgw.config_docs import PATH, reference, render_default
from llmgw.control.settings import ControlConfig
from llmgw.router.settings import RouterConfig
from llmgw.router.settings_toml import TracingConfig
from llmgw.server.settings import StandbyConfig


@dataclass(frozen=True)
class _Settings:
    timeout: float = setting(5.0, DURATION, "How long.")
    # Filled from elsewhere (a flag, another table): no key of the table.
    derived: int = 3
    names: dict[str, str] = setting({}, StringTable(), "Which names.")


class SettingsKeysTests(SynchronousTestCase):
    def test_fields_made_with_setting_are_the_keys(self) -> None:
        """
        L{settings_keys} gives a L{Key} per field made with L{setting}, in
        the class's order, with its kind, meaning and default, and skips
        the other fields.
        """
        self.assertEqual(
            settings_keys(_Settings),
            (
                Key("timeout", DURATION, "How long.", 5.0),
                Key("names", StringTable(), "Which names.", {}),
            ),
        )

    def test_mutable_default_is_not_shared(self) -> None:
        """
        A mutable default is made anew for each instance, as with
        C{field(default_factory=...)}.
        """
        self.assertEqual(_Settings().timeout, 5.0)
        self.assertIsNot(_Settings().names, _Settings().names)

    def test_table_names_and_kinds(self) -> None:
        """
        A L{Table} tells the keys it accepts and those of one kind.
        """
        table = Table(
            "[t]",
            "A table.",
            (
                Key("a", DURATION, "A."),
                Key("b", BOOLEAN, "B.", False),
                Key("c", DURATION, "C.", 1.0),
            ),
        )
        self.assertEqual(table.names, {"a", "b", "c"})
        self.assertEqual(table.of_kind(DURATION), {"a", "c"})
        self.assertIs(table.keys[0].default, REQUIRED)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(llmgw.__file__)))

_ENDPOINT = {"id": "a", "url": "http://h:1", "models": ["m"]}
_PROFILE = {"name": "p", "engine": "sim", "source": "s"}
_MODEL = {"name": "m", "profiles": [_PROFILE]}
_GPU = {"name": "g", "memory_gb": 1}


def _server_probe(table: Table) -> Callable[[dict[str, Any]], object]:
    """
    @return: what parses C{table} (given as a dict) inside a server's file
        holding it alone, with the keys its table requires.
    """
    name = table.name.strip("[]")
    if table.name == "":
        return parse_config
    if table.name == "[[endpoints]]":
        return lambda t: parse_config({"endpoints": [{**_ENDPOINT, **t}]})
    if table.name == "[[models]]":
        return lambda t: parse_config({"models": [{**_MODEL, **t}]})
    if table.name == "[[models.profiles]]":
        return lambda t: parse_config(
            {"models": [{"name": "m", "profiles": [{**_PROFILE, **t}]}]}
        )
    if table.name == "[agent_tls]":
        return lambda t: parse_config(
            {"agent_tls": {"ca": "c", "cert": "s", "key": "k", **t}}
        )
    return lambda t: parse_config({name: t})


def _agent_probe(table: Table) -> Callable[[dict[str, Any]], object]:
    if table.name == "":
        return parse_agent_config
    assert table.name == "[[simulated_gpus]]", table.name
    return lambda t: parse_agent_config({"simulated_gpus": [{**_GPU, **t}]})


def _probes() -> list[tuple[Table, Callable[[dict[str, Any]], object]]]:
    return [(t, _server_probe(t)) for t in SERVER_TABLES] + [
        (t, _agent_probe(t)) for t in AGENT_TABLES
    ]


_KNOWN = re.compile(r": unknown key \(known: (.*)\)$")

_NOT_KEYS: dict[type[Any], set[str]] = {
    # Filled from other tables or flags, not keys of their own table.
    ServerConfig: {
        "agent_tls",
        "local",
        "simulated_gpus",
        "store_url",
        "usage_flush_interval",
        "record_usage",
        "usage_retention",
        "responses_retention",
        "limits_url",
        "limits_routers",
        "require_api_key",
        "endpoints",
        "router",
        "control",
        "standby",
        "models",
        "tracing",
        "batches",
    },
    RouterConfig: {"cors_allow_origins"},
    ControlConfig: set(),
    StandbyConfig: set(),
    StoreConfig: set(),
    LimitsConfig: set(),
    AuthConfig: set(),
    AgentConfig: set(),
    TracingConfig: set(),
    BatchesConfig: set(),
}


class ReferenceTests(SynchronousTestCase):
    """
    C{docs/configuration.md} is what the settings print, and the settings
    say every key the parsers take.
    """

    def test_not_stale(self) -> None:
        """
        The checked-in reference is what L{reference} prints from the
        code: a key added, removed or changed without C{make config-docs}
        fails here.
        """
        with open(os.path.join(ROOT, PATH), encoding="utf-8") as f:
            checked_in = f.read()
        self.assertEqual(
            checked_in, reference(), f"{PATH} is stale: run make config-docs"
        )

    def test_key_without_meaning_refused(self) -> None:
        """
        A key without a meaning (or a type) cannot be printed: the
        reference refuses it, naming the table and the key.
        """

        @dataclass(frozen=True)
        class Bare:
            x: int = setting(1, Integer(), " ")

        for keys in (settings_keys(Bare), (Key("x", Text(""), "X."),)):
            with self.assertRaises(ValueError) as raised:
                reference([Table("[t]", "T.", keys)], [])
            self.assertIn("[t]: x", str(raised.exception))

    def test_settings_fields_are_keys(self) -> None:
        """
        Every field of a settings class is a key made with L{setting},
        but for those filled from elsewhere: a field added as a plain
        attribute is neither taken by the parser nor printed.
        """
        for settings, others in _NOT_KEYS.items():
            documented = {key.name for key in settings_keys(settings)}
            self.assertEqual(
                {f.name for f in fields(settings)} - documented,
                others,
                settings.__name__,
            )

    def test_parsers_take_the_documented_keys(self) -> None:
        """
        Each table's parser takes exactly the keys the reference lists:
        an unknown key's message lists them.  At the top level of the
        server's file, the tables' names too.
        """
        for table, probe in _probes():
            expected = set(table.names)
            if table is SERVER_TABLE:
                expected |= {
                    t.name.strip("[]")
                    for t in SERVER_TABLES
                    if t.name and "." not in t.name
                }
            with self.assertRaises(ConfigError) as raised:
                probe({"zz_unknown": 1})
            match = _KNOWN.search(str(raised.exception))
            assert match is not None, str(raised.exception)
            self.assertEqual(set(match.group(1).split(", ")), expected, table.name)

    def test_every_key_read_by_its_kind(self) -> None:
        """
        Every key of the server's and the agent's tables, the catalog's
        included, is declared with the kind that reads it: a value of no
        key's shape, given to the key in its file, is refused in one line
        naming the key.
        """
        checked = 0
        for table, probe in _probes():
            for key in table.keys:
                where = f"{table.name or 'top'}: {key.name}"
                self.assertIsInstance(key.kind, Kind, where)
                with self.assertRaises(ConfigError) as raised:
                    probe({key.name: {"zz": 1.5}})
                self.assertRegex(
                    str(raised.exception), rf"(^|\.){re.escape(key.name)}: ", where
                )
                checked += 1
        self.assertGreater(checked, 110)

    def test_defaults_as_printed(self) -> None:
        """
        A key given its default as the reference prints it (read as TOML)
        parses to the same settings as the key left out.
        """
        checked = 0
        for table, probe in _probes():
            for key in table.keys:
                if key.shown or key.default is REQUIRED or key.default is None:
                    continue
                value = tomllib.loads(f"{key.name} = {render_default(key)}")
                self.assertEqual(
                    probe(value), probe({}), f"{table.name or 'top'}: {key.name}"
                )
                checked += 1
        self.assertGreater(checked, 60)

    def test_server_defaults_agree(self) -> None:
        """
        The server's settings with no file are those of an empty file.
        """
        self.assertEqual(ServerConfig(), parse_config({}))

    def test_docs_keys_in_reference(self) -> None:
        """
        Every key a TOML example of the README or of docs/ shows (comments
        included) is in the reference, under its table.
        """
        tables: dict[str, set[str]] = {}
        for table in (*SERVER_TABLES, *AGENT_TABLES):
            tables.setdefault(table.name.strip("[]"), set()).update(table.names)
        paths = [os.path.join(ROOT, "README.md")]
        docs = os.path.join(ROOT, "docs")
        paths += [
            os.path.join(docs, name)
            for name in sorted(os.listdir(docs))
            if name.endswith(".md") and name != os.path.basename(PATH)
        ]
        shown = 0
        for path in paths:
            for where, key in _example_keys(path):
                self.assertIn(where, tables, f"{path}: [{where}]")
                self.assertIn(key, tables[where], f"{path}: [{where}] {key}")
                shown += 1
        self.assertGreater(shown, 50)


_HEADING = re.compile(r"^\[\[?([a-z_.]+)\]\]?")
_KEY = re.compile(r"^(?:# ?)?([a-z_][a-z0-9_]*)\s*=")


def _example_keys(path: str) -> list[tuple[str, str]]:
    """
    @return: C{(table, key)} for each key line of the C{toml} code blocks
        of the Markdown file C{path}; C{""} for the top level.
    """
    found = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    inside, table = False, ""
    for line in lines:
        if line.startswith("```"):
            inside, table = line.strip() == "```toml", ""
            continue
        if not inside:
            continue
        heading = _HEADING.match(line)
        if heading is not None:
            table = heading.group(1)
        elif (key := _KEY.match(line)) is not None:
            found.append((table, key.group(1)))
    return found
