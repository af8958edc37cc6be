"""
The catalog's [[models]] tables: what parses, and errors naming the model,
the profile, the field and the value.
"""

from __future__ import annotations

import re
import tomllib

from twisted.trial.unittest import SynchronousTestCase

from llmgw.config_checks import ConfigError
from llmgw.control.catalog import MODELS_TABLE, PROFILES_TABLE, Model, parse_models

GOOD = """
[[models]]
name = "llama-3.1-70b"
aliases = ["llama-70b"]
min_replicas = 1
max_replicas = 4
idle_timeout = "30m"

[[models.profiles]]
name = "h100x4"
engine = "vllm"
source = "meta-llama/Llama-3.1-70B-Instruct"
args = ["--max-model-len", "8192"]
gpus = 4
gpu_memory_gb = 70
priority = 10

[[models.profiles]]
name = "two-nodes"
engine = "sglang"
source = "/models/llama-70b"
gpus = 8
gpu_memory_gb = 40
nodes = 2
fabric = "ib-a"

[[models]]
name = "gemma-3-270m"

[[models.profiles]]
name = "cpu"
engine = "llamacpp"
source = "/models/gemma.gguf"
env = { LLAMA_ARG_THREADS = "2" }
"""


def models(text: str) -> tuple[Model, ...]:
    return parse_models(tomllib.loads(text)["models"])


class CatalogTests(SynchronousTestCase):
    def test_parses(self) -> None:
        """
        Models with their aliases, replica bounds, idle timeout and ordered
        profiles; defaults for what is left out.
        """
        llama, gemma = parse_models(tomllib.loads(GOOD)["models"])
        self.assertEqual(llama.names, ("llama-3.1-70b", "llama-70b"))
        self.assertEqual((llama.min_replicas, llama.max_replicas), (1, 4))
        self.assertEqual(llama.idle_timeout, 1800.0)
        self.assertEqual([p.name for p in llama.profiles], ["h100x4", "two-nodes"])
        self.assertEqual(llama.profiles[0].args, ("--max-model-len", "8192"))
        self.assertEqual(
            (llama.profiles[1].nodes, llama.profiles[1].fabric), (2, "ib-a")
        )
        self.assertEqual((gemma.min_replicas, gemma.max_replicas), (0, 1))
        self.assertEqual(gemma.profiles[0].gpus, 0)
        self.assertEqual(gemma.profiles[0].env, (("LLAMA_ARG_THREADS", "2"),))
        self.assertEqual(
            (gemma.pinned, gemma.priority, gemma.min_resident), (False, 0, 5.0)
        )
        self.assertEqual(gemma.profiles[0].sleep, "off")

    def test_sleep_and_eviction_keys(self) -> None:
        """
        C{pinned}, C{priority} and C{min_resident} on a model; C{sleep} on
        a profile, whose host memory defaults to its GPU memory for
        C{"weights"} (the weights go to host memory) and to 0 for
        C{"discard"}.
        """
        (model,) = models(
            '[[models]]\nname = "m"\npinned = true\npriority = -2\n'
            'min_resident = "2m"\n'
            '[[models.profiles]]\nname = "w"\nengine = "vllm"\nsource = "s"\n'
            'gpus = 2\ngpu_memory_gb = 30\nsleep = "weights"\n'
            '[[models.profiles]]\nname = "d"\nengine = "sglang"\nsource = "s"\n'
            'gpus = 1\ngpu_memory_gb = 30\nsleep = "discard"\n'
            "sleep_gpu_memory_gb = 0.5\n"
            '[[models.profiles]]\nname = "h"\nengine = "sim"\nsource = "s"\n'
            'sleep = "weights"\nsleep_host_memory_gb = 3\n'
        )
        self.assertEqual(
            (model.pinned, model.priority, model.min_resident), (True, -2, 120.0)
        )
        weights, discard, held = model.profiles
        self.assertEqual(
            (weights.sleep, weights.sleep_gpu_memory_gb, weights.sleep_host_memory_gb),
            ("weights", 1.0, 60.0),
        )
        self.assertEqual(
            (discard.sleep, discard.sleep_gpu_memory_gb, discard.sleep_host_memory_gb),
            ("discard", 0.5, 0.0),
        )
        self.assertEqual(held.sleep_host_memory_gb, 3.0)

    def test_errors(self) -> None:
        """
        Each mistake is one line naming model, profile, field and value.
        """
        profile = '[[models.profiles]]\nname = "p"\nengine = "vllm"\nsource = "s"\n'
        cases = [
            (
                '[[models]]\nname = "m"\ncolour = 1\n' + profile,
                "models[0] (m).colour: unknown key",
            ),
            ('[[models]]\nname = "m"\n', "models[0] (m).profiles: missing"),
            (
                '[[models]]\nname = "m"\n' + profile.replace('"vllm"', '"tgi"'),
                "models[0] (m).profiles[0] (p).engine: unknown 'tgi'",
            ),
            (
                '[[models]]\nname = "m"\n' + profile + "gpus = -1\n",
                "models[0] (m).profiles[0] (p).gpus: expected a whole number"
                " from 0 to 10000, got -1",
            ),
            (
                '[[models]]\nname = "m"\n' + profile + "gpus = 8\nnodes = 2\n",
                "models[0] (m).profiles[0] (p).fabric: missing",
            ),
            (
                '[[models]]\nname = "m"\n' + profile + "gpu_memory_gb = 40\n",
                "gpu_memory_gb: 40 with gpus = 0",
            ),
            (
                '[[models]]\nname = "m"\nmin_replicas = 3\nmax_replicas = 2\n'
                + profile,
                "models[0] (m).min_replicas: 3 is more than max_replicas = 2",
            ),
            (
                '[[models]]\nname = "m"\nidle_timeout = "soon"\n' + profile,
                "models[0] (m).idle_timeout: bad duration 'soon'",
            ),
            (
                '[[models]]\nname = "m"\n'
                + profile
                + '[[models]]\nname = "n"\naliases = ["m"]\n'
                + profile,
                "models (n): name 'm' is already model 'm'",
            ),
            (
                '[[models]]\nname = "m"\n' + profile + profile,
                "models[0] (m).profiles: duplicate name 'p'",
            ),
            (
                '[[models]]\nname = "m"\npinned = "yes"\n' + profile,
                "models[0] (m).pinned: expected true or false, got 'yes'",
            ),
            (
                '[[models]]\nname = "m"\npriority = 1.5\n' + profile,
                "models[0] (m).priority: expected a whole number from -1000000"
                " to 1000000, got 1.5",
            ),
            (
                '[[models]]\nname = "m"\nmin_resident = "a while"\n' + profile,
                "models[0] (m).min_resident: bad duration 'a while'",
            ),
            (
                '[[models]]\nname = "m"\n' + profile + 'sleep = "deep"\n',
                "models[0] (m).profiles[0] (p).sleep: expected one of off,"
                " weights, discard, got 'deep'",
            ),
            (
                '[[models]]\nname = "m"\n'
                + profile.replace('"vllm"', '"llamacpp"')
                + 'sleep = "weights"\n',
                "models[0] (m).profiles[0] (p).sleep: engine 'llamacpp' has no"
                " sleep API (vllm, sglang, sim do)",
            ),
            (
                '[[models]]\nname = "m"\n' + profile + "sleep_gpu_memory_gb = -1\n",
                "models[0] (m).profiles[0] (p).sleep_gpu_memory_gb: expected a"
                " number from 0 to 100000, got -1",
            ),
        ]
        for text, message in cases:
            with self.subTest(message):
                with self.assertRaises(ConfigError) as raised:
                    models(text)
                self.assertIn(message, str(raised.exception))
                self.assertNotIn("\n", str(raised.exception))


# A value of the wrong shape for each key of a model, of an adapter and of
# a profile, at or just past the bound its kind declares where it has one.
_PROFILE = {"name": "p", "engine": "vllm", "source": "s"}
_WRONG_MODEL: list[tuple[str, object]] = [
    ("name", ""),
    ("name", "x" * 201),
    ("aliases", [" "]),
    ("aliases", "chat"),
    ("min_replicas", -1),
    ("max_replicas", 0),
    ("max_replicas", 10_001),
    ("idle_timeout", "soon"),
    ("pinned", "yes"),
    ("priority", 1_000_001),
    ("min_resident", -1),
    ("profiles", {"name": "p"}),
    ("max_loras", -1),
    ("max_loras", 1025),
    ("max_lora_rank", 0),
    ("max_lora_rank", 1025),
]
_WRONG_ADAPTER: list[tuple[str, object]] = [
    ("base", ""),
    ("adapter", " "),
    ("rank", 0),
    ("rank", 1025),
    ("rank", "8"),
]
_WRONG_PROFILE: list[tuple[str, object]] = [
    ("name", " "),
    ("engine", "tgi"),
    ("source", ""),
    ("args", ["--x", 1]),
    ("env", {"A=B": "x"}),
    ("env", {"A": 1}),
    ("gpus", -1),
    ("gpus", 10_001),
    ("gpu_memory_gb", -1),
    ("gpu_memory_gb", True),
    ("nodes", 0),
    ("fabric", ""),
    ("priority", 1.5),
    ("sleep", "deep"),
    ("sleep_gpu_memory_gb", -0.5),
    ("sleep_host_memory_gb", 100_001),
    ("share_gpu", "yes"),
]


class KeyShapeTests(SynchronousTestCase):
    def refused(self, tables: list[dict[str, object]], where: str) -> str:
        """
        @return: the message C{tables} are refused with, which names
            C{where} (a key, C{"models[0] (m).rank"}, or an item of its
            list, C{"models[0] (m).aliases[0]"}) first.
        """
        with self.assertRaises(ConfigError) as raised:
            parse_models(tables)
        message = str(raised.exception)
        self.assertRegex(message, rf"^{re.escape(where)}(\[\d+\])?: ")
        self.assertNotIn("\n", message)
        return message

    def test_every_key_refuses_a_wrong_shape(self) -> None:
        """
        Each key of a model, of an adapter and of a profile refuses a value
        of the wrong type or out of the range its declaration states, in
        one line naming the model, the profile and the key; every key of
        both tables is tried.
        """
        tried: set[tuple[str, str]] = set()
        for key, value in _WRONG_MODEL:
            with self.subTest(key=key, value=value):
                where = "models[0]" if key == "name" else "models[0] (m)"
                self.refused(
                    [{"name": "m", "profiles": [_PROFILE], key: value}],
                    f"{where}.{key}",
                )
            tried.add(("model", key))
        for key, value in _WRONG_ADAPTER:
            with self.subTest(key=key, value=value):
                self.refused(
                    [
                        {"name": "m", "profiles": [_PROFILE]},
                        {"name": "a", "base": "m", "adapter": "/a", key: value},
                    ],
                    f"models[1] (a).{key}",
                )
            tried.add(("model", key))
        for key, value in _WRONG_PROFILE:
            with self.subTest(key=key, value=value):
                where = "models[0] (m).profiles[0]"
                if key != "name":
                    where += " (p)"
                profile = {**_PROFILE, "gpus": 1, key: value}
                self.refused([{"name": "m", "profiles": [profile]}], f"{where}.{key}")
            tried.add(("profile", key))
        self.assertEqual(
            tried,
            {("model", k) for k in MODELS_TABLE.names}
            | {("profile", k) for k in PROFILES_TABLE.names},
        )

    def test_lora_bounds_enforced(self) -> None:
        """
        An adapter's C{rank} and a base's C{max_loras} hold to the ranges
        the reference states (1 to 1024, 0 to 1024): C{rank = 0} and
        C{max_loras = -1} were once read as "not given".
        """
        message = self.refused(
            [
                {"name": "m", "profiles": [_PROFILE]},
                {"name": "a", "base": "m", "adapter": "/a", "rank": 0},
            ],
            "models[1] (a).rank",
        )
        self.assertIn("from 1 to 1024, got 0", message)
        message = self.refused(
            [{"name": "m", "profiles": [_PROFILE], "max_loras": -1}],
            "models[0] (m).max_loras",
        )
        self.assertIn("from 0 to 1024, got -1", message)
