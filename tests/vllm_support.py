"""
Where the tests find the real vLLM that C{scripts/setup-vllm} sets up (a
venv, the converted Gemma 3 270M and SGLang's package for its parser, under
C{.vllm/}, or C{LLMGW_VLLM_HOME}),
and what they do without it: skip naming that command, except in CI
(C{CI=true}), where C{.ci/run} sets it up and a missing one fails.
"""

from __future__ import annotations

import os

from tests.support import missing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_HOME = os.path.abspath(
    os.environ.get("LLMGW_VLLM_HOME") or os.path.join(ROOT, ".vllm")
)
VLLM_BIN = os.path.join(VLLM_HOME, "venv", "bin")
VLLM_PYTHON = os.path.join(VLLM_BIN, "python")
VLLM_MODEL = os.path.join(VLLM_HOME, "models", "gemma-3-270m")
SGLANG_PATH = os.path.join(VLLM_HOME, "sglang")
SETUP = "scripts/setup-vllm"


def require_vllm(model: bool = False, sglang: bool = False) -> None:
    """
    @param model: the converted model folder is needed too.
    @param sglang: SGLang's package (for its parser) is needed too.
    @raise SkipTest: the set-up is missing, outside CI.
    @raise AssertionError: it is missing in CI.
    """
    absent = [
        path
        for path, wanted in (
            (os.path.join(VLLM_BIN, "vllm"), True),
            (os.path.join(VLLM_MODEL, ".complete"), model),
            (os.path.join(SGLANG_PATH, "sglang"), sglang),
        )
        if wanted and not os.path.exists(path)
    ]
    if not absent:
        return
    why = f"no real vLLM here ({', '.join(absent)}): {SETUP} sets it up"
    missing(why, in_ci=why + " (.ci/run runs it before the tests)")
