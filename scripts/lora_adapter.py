"""
Write a small LoRA adapter for Gemma 3 270M by hand, in PEFT's layout
(C{adapter_config.json} and C{adapter_model.safetensors}), as
C{tests/test_e2e_vllm_lora.py} serves it through llmgw: run as C{PYTHON
scripts/lora_adapter.py FOLDER [RANK]} by the Python of the vLLM venv
(C{.vllm/venv/bin/python}: torch and safetensors), outside C{tests/}
because llmgw's own venv has neither.

The adapter's target modules are each layer's C{self_attn.q_proj} and
C{v_proj} (Gemma 3 270M: hidden size 640, 4 query heads and 1 key-value
head of 256), A and B small random bfloat16 (seed 0): about 0.7 MB at rank 8.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 640, 4, 1, 256, 18


def main(folder: str, rank: int) -> int:
    torch.manual_seed(0)
    tensors = {}
    for layer in range(LAYERS):
        for name, size in (("q_proj", HEADS * HEAD_DIM), ("v_proj", KV_HEADS * HEAD_DIM)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            a = torch.randn(rank, HIDDEN) * 0.01
            b = torch.randn(size, rank) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": "gemma-3-270m",
    }
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8))
