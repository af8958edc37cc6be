"""
Turn the bundled Gemma 3 270M GGUF into a model folder vLLM loads on the
CPU: C{python scripts/vllm_model.py GGUF FOLDER}, run by the vLLM venv's
Python (scripts/setup-vllm).

Why a folder and not the GGUF itself: vLLM's GGUF loader runs its
dequantizing kernels on CUDA only.  transformers reads the GGUF (with the
C{gguf} package), dequantizes it, and saves it as bf16 safetensors (536 MB,
about a minute here).

The GGUF carries no chat template, and vLLM refuses a chat request without
one: the template below is Gemma's turn format (C{<start_of_turn>user},
C{<start_of_turn>model}, C{<end_of_turn>}, as llama-cpp-python's
C{--chat_format gemma} writes it), saved with the tokenizer.  Gemma ends a
turn with C{<end_of_turn>} (token 106), which the GGUF does not list as an
end token: added, so that a chat reply stops where the model ends it.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] + '\n\n' -%}"
    "{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
END_OF_TURN = "<end_of_turn>"


def main(gguf: str, folder: str) -> None:
    directory, name = os.path.split(os.path.abspath(gguf))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.bfloat16
    )
    # Loaded from a GGUF, the model is marked quantized, which
    # save_pretrained refuses; its weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=[model.config.eos_token_id, end_of_turn],
        pad_token_id=model.config.pad_token_id,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
