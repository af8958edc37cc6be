"""
The simulator's LoRA adapters (L{llmgw.sim.lora}), as vLLM 0.32's runtime
LoRA routes answer (C{vllm/entrypoints/openai/models/serving.py}): loads,
the refusals with vLLM's messages, unloads, and the model cards with
C{parent}; the routes only with C{--enable-lora} and
C{VLLM_ALLOW_RUNTIME_LORA_UPDATING} true.
"""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from llmgw.sim.cli import build_parser, sim_config
from llmgw.sim.lora import ENV, Adapters, LoraError


class AdaptersTests(SynchronousTestCase):
    def test_load_list_unload(self) -> None:
        adapters = Adapters("base")
        self.assertEqual(
            adapters.load(
                {"lora_name": "sql", "lora_path": "/a/sql"}, frozenset({"base"})
            ),
            "Success: LoRA adapter 'sql' added successfully.",
        )
        self.assertEqual(
            adapters.cards(7),
            [
                {
                    "id": "sql",
                    "object": "model",
                    "created": 7,
                    "owned_by": "llmgw-sim",
                    "root": "/a/sql",
                    "parent": "base",
                }
            ],
        )
        self.assertEqual(
            adapters.unload({"lora_name": "sql"}),
            "Success: LoRA adapter 'sql' removed successfully.",
        )
        self.assertEqual(adapters.cards(7), [])
        self.assertEqual(adapters.loads, {"sql": 1})

    def test_refusals(self) -> None:
        adapters = Adapters("base")
        adapters.load({"lora_name": "sql", "lora_path": "/a/sql"}, frozenset())
        cases = [
            (
                {"lora_name": "x"},
                400,
                "Both 'lora_name' and 'lora_path' must be provided.",
            ),
            (
                {"lora_name": "base", "lora_path": "/p"},
                400,
                "The lora adapter 'base' conflicts with a served base model.",
            ),
            (
                {"lora_name": "sql", "lora_path": "/a/sql"},
                400,
                "The lora adapter 'sql' has already been loaded. If you want to"
                " load the adapter in place, set 'load_inplace' to True.",
            ),
        ]
        for body, status, message in cases:
            with self.assertRaises(LoraError) as caught:
                adapters.load(body, frozenset({"base"}))
            self.assertEqual(
                (caught.exception.status, caught.exception.message), (status, message)
            )
        with self.assertRaises(LoraError) as caught:
            adapters.unload({"lora_name": "nope"})
        self.assertEqual(
            (caught.exception.status, caught.exception.message),
            (404, "The lora adapter 'nope' cannot be found."),
        )
        self.assertEqual(adapters.load_requests, {"sql": 2, "x": 1, "base": 1})

    def test_routes_need_the_variable(self) -> None:
        args = build_parser().parse_args(
            ["--port", "0", "--model", "m", "--enable-lora", "--max-loras", "2"]
        )
        saved = os.environ.pop(ENV, None)
        try:
            self.assertFalse(sim_config(args).lora.runtime)
            os.environ[ENV] = "True"
            lora = sim_config(args).lora
            self.assertEqual(
                (lora.enabled, lora.runtime, lora.max_loras), (True, True, 2)
            )
        finally:
            os.environ.pop(ENV, None)
            if saved is not None:
                os.environ[ENV] = saved
