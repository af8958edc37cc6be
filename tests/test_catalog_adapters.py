"""
LoRA adapters in the catalog (L{llmgw.control.catalog}): what parses, the
flags a base's profiles get, and errors naming the model, the field and the
value; and the catalog at run time (L{llmgw.control.runtime}): adapters
resolve to themselves, activate their base, and a base with adapters is
not removed.
"""

from __future__ import annotations

import tomllib

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.config_checks import ConfigError
from llmgw.control.catalog import Model, parse_models
from llmgw.control.inventory import Inventory
from llmgw.control.runtime import ModelCatalog

BASE = """
[[models]]
name = "gemma"
{extra}
[[models.profiles]]
name = "gpu"
engine = "vllm"
source = "google/gemma-3-270m"
args = ["--max-lora-rank", "64"]

[[models.profiles]]
name = "sim"
engine = "sim"
source = "sim"
"""

ADAPTER = """
[[models]]
name = "{name}"
base = "gemma"
adapter = "/adapters/{name}"
{extra}
"""


def models(text: str) -> tuple[Model, ...]:
    return parse_models(tomllib.loads(text)["models"])


class AdapterCatalogTests(SynchronousTestCase):
    def test_base_gets_lora_flags(self) -> None:
        """
        A base named by adapters gets C{--enable-lora}, C{max_loras} 4 (the
        default) and C{max_lora_rank} 16 before its profile's args (which
        win: the engine's parser keeps the last), and vLLM's runtime
        updating variable; the adapter has no profiles of its own.
        """
        base, sql = models(
            BASE.format(extra="") + ADAPTER.format(name="sql", extra="rank = 8")
        )
        self.assertEqual((base.max_loras, base.max_lora_rank), (4, 16))
        flags = ("--enable-lora", "--max-loras", "4", "--max-lora-rank", "16")
        gpu, sim = base.profiles
        self.assertEqual(gpu.args, (*flags, "--max-lora-rank", "64"))
        self.assertEqual(sim.args, flags)
        for profile in base.profiles:
            self.assertIn(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"), profile.env)
        self.assertEqual(
            (sql.base, sql.adapter, sql.rank, sql.profiles),
            ("gemma", "/adapters/sql", 8, ()),
        )

    def test_no_lora_without_adapters(self) -> None:
        """
        A model no adapter names and without C{max_loras} starts as before.
        """
        (base,) = models(BASE.format(extra=""))
        self.assertEqual(base.max_loras, 0)
        self.assertEqual(base.profiles[0].args, ("--max-lora-rank", "64"))

    def test_errors(self) -> None:
        """
        Each mistake is one line naming the model and the field.
        """
        cases = [
            (
                ADAPTER.format(name="sql", extra="") + "[[models.profiles]]\n"
                'name = "p"\nengine = "sim"\nsource = "s"\n',
                "models[0] (sql).profiles: an adapter (base = 'gemma') runs on its"
                " base's replicas: remove it",
            ),
            (
                '[[models]]\nname = "sql"\nbase = "gemma"\n',
                "models[0] (sql).adapter: missing: the adapter's path or hub id",
            ),
            (
                ADAPTER.format(name="sql", extra=""),
                "models (sql).base: no model 'gemma'",
            ),
            (
                BASE.format(extra="max_loras = 0")
                + ADAPTER.format(name="sql", extra=""),
                "models (sql).base: 'gemma' has max_loras = 0: set it above 0 to"
                " load adapters",
            ),
            (
                BASE.format(extra="max_lora_rank = 8")
                + ADAPTER.format(name="sql", extra="rank = 16"),
                "models (sql).rank: 16 is above 'gemma''s max_lora_rank = 8",
            ),
            (
                BASE.format(extra="").replace('"sim"\nsource', '"llamacpp"\nsource')
                + ADAPTER.format(name="sql", extra=""),
                "models (sql).base: 'gemma' profiles sim run engines that load no"
                " adapters (only vllm, sim)",
            ),
            (
                BASE.format(extra='adapter = "/x"'),
                "models[0] (gemma).adapter: only for an adapter (with base)",
            ),
            (
                ADAPTER.format(name="sql", extra='rank = "8"') + BASE.format(extra=""),
                "models[0] (sql).rank: expected a whole number from 1 to 1024, got '8'",
            ),
        ]
        for text, message in cases:
            with self.assertRaises(ConfigError) as caught:
                models(text)
            self.assertEqual(str(caught.exception), message)


class AdapterRuntimeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.catalog = ModelCatalog(
            Clock(),
            Inventory(),
            models(BASE.format(extra="") + ADAPTER.format(name="sql", extra="")),
            (),
            lambda: None,
        )
        self.changed: list[str] = []
        self.catalog.adapters_changed = self.changed.append

    def test_resolves_to_itself_and_activates_base(self) -> None:
        """
        An adapter's name is its own (a key may be limited to it); its
        request activates the base; the plane sees the base only.
        """
        catalog = self.catalog
        self.assertEqual(catalog.resolve("sql"), "sql")
        self.assertEqual(catalog["sql"].model.name, "gemma")
        self.assertEqual([s.model.name for s in catalog.states()], ["gemma"])
        catalog.activate("sql")
        self.assertEqual(catalog["gemma"].wanted, 1)
        self.assertEqual([a.name for a in catalog.adapters_of("gemma")], ["sql"])

    def test_add_and_remove(self) -> None:
        """
        An adapter added at run time joins its base's adapters (its
        endpoints are worked out again); a base with adapters is refused
        removal, naming them; an adapter of a missing base is refused.
        """
        catalog = self.catalog
        (chat,) = parse_models(
            [{"name": "chat", "base": "gemma", "adapter": "/a/chat"}],
            check_bases=False,
        )
        catalog.add(chat)
        self.assertEqual(self.changed, ["gemma"])
        with self.assertRaises(ValueError) as caught:
            catalog.remove("gemma")
        self.assertEqual(
            str(caught.exception),
            "model 'gemma' is the base of adapters sql, chat: remove them first",
        )
        catalog.remove("chat")
        self.assertEqual(self.changed, ["gemma", "gemma"])
        self.assertIsNone(catalog.resolve("chat"))
        (orphan,) = parse_models(
            [{"name": "o", "base": "nope", "adapter": "/a/o"}], check_bases=False
        )
        with self.assertRaises(ValueError) as caught:
            catalog.add(orphan)
        self.assertEqual(str(caught.exception), "models (o).base: no model 'nope'")
