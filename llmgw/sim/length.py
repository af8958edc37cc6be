"""
How long the simulator's answer is: a natural length at which it stops by
itself, as a model emits its end-of-sequence token, unless the request
forces the length.

The rule, deterministic in the prompt: the natural length is
C{NATURAL_MIN + (crc32(prompt) >> 5) % NATURAL_SPAN} tokens, 256 to 512.
The answer is that long, with C{finish_reason} C{"stop"}, when it is
shorter than the cap (the request's C{max_tokens} or C{max_completion_tokens},
else the simulator's C{--max-tokens}); otherwise it is the cap, with
C{"length"}.  As in vLLM's sampling parameters (its C{SamplingParams}:
C{ignore_eos} and C{min_tokens}, which the chat and completions requests
carry as extra fields), C{ignore_eos: true} makes the answer exactly the
cap and C{min_tokens} keeps the end token away until that many tokens.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

NATURAL_MIN = 256
"""
Tokens: the shortest natural answer.  Above every length the simulator's
own tests ask for without forcing it, so a request for fewer tokens gets
exactly what it asked for.
"""

NATURAL_SPAN = 257
"""
How many natural lengths there are: C{NATURAL_MIN} to C{NATURAL_MIN +
NATURAL_SPAN - 1} (512) tokens.
"""

FinishReason = Literal["stop", "length"]


def natural_length(prompt: bytes) -> int:
    """
    The length at which the simulator's model ends its answer to C{prompt}.

    The low five bits of the checksum pick the first token of the answer
    (L{llmgw.sim.engine.token_indices}); the bits above pick its length, so
    the two vary independently.

    @param prompt: the prompt text, UTF-8.
    @return: tokens, C{NATURAL_MIN} to C{NATURAL_MIN + NATURAL_SPAN - 1}.
    """
    return NATURAL_MIN + (zlib.crc32(prompt) >> 5) % NATURAL_SPAN


@dataclass(frozen=True, slots=True)
class Length:
    """
    An answer's length and why it ended.

    @ivar count: completion tokens.
    @ivar finish_reason: C{"stop"}, it ended by itself; C{"length"}, it
        reached the cap.
    """

    count: int
    finish_reason: FinishReason


def answer_length(
    prompt: bytes, cap: int, *, ignore_eos: bool = False, min_tokens: int = 0
) -> Length:
    """
    The length of the answer to C{prompt}.

    @param prompt: the prompt text, UTF-8.
    @param cap: tokens at most: the request's C{max_tokens}, or the
        simulator's default.
    @param ignore_eos: never stop by itself (vLLM's C{ignore_eos}).
    @param min_tokens: do not stop by itself before this many tokens
        (vLLM's C{min_tokens}).
    @return: C{cap} tokens and C{"length"}, or fewer and C{"stop"}.
    """
    if ignore_eos:
        return Length(cap, "length")
    natural = max(natural_length(prompt), min_tokens)
    if natural < cap:
        return Length(natural, "stop")
    return Length(cap, "length")
