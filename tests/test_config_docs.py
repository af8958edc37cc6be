"""
How a TOML table says its keys (L{llmgw.config_checks.Table},
L{llmgw.config_checks.setting}), and the configuration reference printed
from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from twisted.trial.unittest import SynchronousTestCase

from llmgw.config_checks import (
    DURATION,
    REQUIRED,
    Key,
    Table,
    setting,
    settings_keys,
)


@dataclass(frozen=True)
class _Settings:
    timeout: float = setting(5.0, DURATION, "How long.")
    # Filled from elsewhere (a flag, another table): no key of the table.
    derived: int = 3
    names: dict[str, str] = setting({}, "table of strings", "Which names.")


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
                Key("names", "table of strings", "Which names.", {}),
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
                Key("b", "boolean", "B.", False),
                Key("c", DURATION, "C.", 1.0),
            ),
        )
        self.assertEqual(table.names, {"a", "b", "c"})
        self.assertEqual(table.of_kind(DURATION), {"a", "c"})
        self.assertIs(table.keys[0].default, REQUIRED)
