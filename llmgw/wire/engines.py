"""
Facts about inference engines that the server and the agent both need:
the engine names a catalog profile may give and an agent can launch, and
where the Hugging Face cache keeps a hub model's files.

Imports nothing but the standard library: both processes import it.
"""

from __future__ import annotations

ENGINES = ("vllm", "sglang", "llamacpp", "sim")
"""
Engine names, as a catalog profile's C{engine} and C{StartShard.engine}:
vLLM, SGLang, llama.cpp (or llama-cpp-python) and the simulator.
"""

SLEEPING_ENGINES = ("vllm", "sglang", "sim")
"""
The engines that can release their GPU memory and keep running: vLLM's
sleep mode, SGLang's memory saver, and the simulator's copy of both.
"""

MESSAGES_ENGINES = ("vllm",)
"""
The engines that serve Anthropic's Messages API themselves
(C{/v1/messages}, C{/v1/messages/count_tokens}: vLLM's
C{entrypoints/anthropic}); the router translates it to chat completions for
the others.  llama.cpp's C{llama-server} serves it too, but a C{llamacpp}
profile may run llama-cpp-python, which does not: translated.
"""

SLEEP_LEVELS = {"off": 0, "weights": 1, "discard": 2}
"""
A profile's C{sleep} by name, and its level as vLLM numbers them (and
C{StartShard.sleep_level}): 1 keeps the weights in host memory, 2
discards them.
"""


def hub_cache_name(source: str) -> str:
    """
    @param source: a Hugging Face hub id, C{ORG/NAME}.
    @return: the folder the Hugging Face cache keeps a hub id's files in,
        C{models--ORG--NAME} (huggingface_hub's cache layout).
    """
    return "models--" + source.replace("/", "--")


LORA_ENGINES = ("vllm", "sim")
"""
The engines that load LoRA adapters at run time (vLLM's C{--enable-lora}
with C{VLLM_ALLOW_RUNTIME_LORA_UPDATING=True}: C{POST /v1/load_lora_adapter}
and C{/v1/unload_lora_adapter}; the simulator's copy of them).
"""


def share_args(engine: str, fraction: float) -> tuple[str, ...]:
    """
    The flags that tell an engine sharing its GPU the share of the GPU's
    memory it may take, so that it leaves the rest to the replicas beside
    it: vLLM's C{--gpu-memory-utilization} (the fraction of the GPU's total
    memory the engine may use, vLLM's engine arguments), SGLang's
    C{--mem-fraction-static} (the fraction for weights and KV cache,
    SGLang's server arguments).  The sim is told its share in GB already
    (C{--gpu-memory-gb}, the profile's C{gpu_memory_gb}, which its memory
    report on simulated GPUs follows).  llama.cpp takes no fraction: its
    memory follows its C{--n-gpu-layers} and context, which the profile's
    args say.

    @param fraction: of the GPU's total memory, over 0, at most 1.
    @return: the flags, none for an engine without one.
    """
    if engine == "vllm":
        return ("--gpu-memory-utilization", f"{fraction:.4f}")
    if engine == "sglang":
        return ("--mem-fraction-static", f"{fraction:.4f}")
    return ()
