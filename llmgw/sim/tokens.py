"""
The simulator's tokenizer routes and context length, as vLLM 0.32 serves
them (its C{entrypoints/serve/tokenize} router and protocol, and the
length check of C{renderers/params.py}).

C{POST /tokenize} takes C{{"model", "prompt"}} or C{{"model",
"messages"}} and answers C{{"count": int, "max_model_len": int,
"tokens": [int, ...], "token_strs": null}}; C{POST /detokenize} takes
C{{"model", "tokens": [int, ...]}} and answers C{{"prompt": str}}.  The
simulator's tokens are its prompt's whitespace-separated words
(L{llmgw.sim.engine.count_prompt_tokens}); a word's id is a hash of it, and
an id detokenizes to the simulator's vocabulary (L{VOCAB}), so ids round
trip to text of the same length, not to the same words.

C{GET /v1/models} lists each served model with vLLM's model card fields
(L{model_card}), its context length among them.

With C{--max-model-len N}, a completion or chat asking for more than N
tokens, or whose prompt holds more than N, gets vLLM's 400 naming the
context length (L{context_error}).
"""

from __future__ import annotations

import zlib
from collections.abc import Collection

from llmgw.sim.api import ApiError, model_not_found, parse_json_object
from llmgw.sim.engine import VOCAB

VOCAB_SIZE = 262144
"""
Token ids run from 0 to this, less one (Gemma 3's vocabulary, the model
the tests serve on the real vLLM).
"""


def model_card(name: str, created: int, max_model_len: int) -> dict[str, object]:
    """
    @param created: the card's C{created}, Unix seconds.
    @return: a served model's entry in C{GET /v1/models}, with the fields
        of vLLM's C{ModelCard} and C{ModelPermission} (its
        C{entrypoints/openai} protocol): C{root} the model loaded,
        C{max_model_len} the context length (0: none set).
    """
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "llmgw-sim",
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{zlib.crc32(name.encode('utf-8')):08x}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def context_error(
    prompt_tokens: int, max_tokens: int | None, max_model_len: int
) -> ApiError | None:
    """
    vLLM's length checks, in its order (its C{renderers/params.py}): the
    completion asked for, then the prompt.

    @param prompt_tokens: the prompt's length in tokens.
    @param max_tokens: the completion tokens asked for, L{None} for none.
    @param max_model_len: C{--max-model-len}; 0: no limit.
    @return: vLLM's 400 for C{max_tokens} over the context length
        (parameter C{max_tokens}) or a prompt longer than it ("This
        model's maximum context length is N tokens. However, your prompt
        contains M input tokens, ...", parameter C{input_tokens}), or
        L{None} when both fit.
    """
    if not max_model_len:
        return None
    if max_tokens is not None and max_tokens > max_model_len:
        return ApiError(
            400,
            f"max_tokens={max_tokens} cannot be greater than"
            f" max_model_len={max_model_len}. Please request fewer output"
            f" tokens. (parameter=max_tokens, value={max_tokens})",
            type="BadRequestError",
            param="max_tokens",
        )
    if prompt_tokens <= max_model_len:
        return None
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens."
        f" However, your prompt contains {prompt_tokens} input tokens, which"
        " exceeds this limit even without any output tokens. Please reduce the"
        " length of the input prompt. (parameter=input_tokens,"
        f" value={prompt_tokens})",
        type="BadRequestError",
        param="input_tokens",
    )


def _text(obj: dict[str, object]) -> str:
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = obj.get("messages")
    if isinstance(messages, list):
        return " ".join(
            str(m.get("content", "")) for m in messages if isinstance(m, dict)
        )
    raise ApiError(400, "prompt: expected a string, or messages", param="prompt")


def _model(obj: dict[str, object], models: Collection[str]) -> None:
    model = obj.get("model")
    if model is not None and model not in models:
        raise model_not_found(str(model))


def tokenize(body: bytes, models: Collection[str], max_model_len: int) -> object:
    """
    @param body: a C{POST /tokenize} body.
    @param models: the served model names.
    @param max_model_len: C{--max-model-len}, reported as is.
    @return: the answer's JSON.
    @raise ApiError: 400 for a body without a prompt or messages, 404 for a
        model not served.
    """
    obj = parse_json_object(body)
    _model(obj, models)
    words = _text(obj).split()
    tokens = [zlib.crc32(w.encode("utf-8")) % VOCAB_SIZE for w in words]
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": None,
    }


def detokenize(body: bytes, models: Collection[str]) -> object:
    """
    @param body: a C{POST /detokenize} body.
    @param models: the served model names.
    @return: the answer's JSON.
    @raise ApiError: 400 for C{tokens} not a list of ints, 404 for a model
        not served.
    """
    obj = parse_json_object(body)
    _model(obj, models)
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ApiError(400, "tokens: expected a list of integers", param="tokens")
    return {"prompt": "".join(VOCAB[t % len(VOCAB)] for t in tokens)}
