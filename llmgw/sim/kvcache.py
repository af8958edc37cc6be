"""
The simulator's prefix cache: an LRU over KV-cache blocks named by chained
hashes, as vLLM's automatic prefix caching names them.

vLLM's design (U{https://docs.vllm.ai/en/latest/design/prefix_caching/},
C{vllm/v1/core/kv_cache_utils.py} in U{https://github.com/vllm-project/vllm})
splits a sequence into blocks of C{block_size} tokens (16 by default) and
names each I{full} block by the hash of its parent block's hash and its own
tokens, so one name stands for the whole prefix up to the block's end.  A
new request reuses the longest run of leading blocks found in the cache;
at least its last prompt token is computed again (it must produce logits).
Freed blocks stay cached until their space is needed, evicted least
recently used first; a request frees its blocks tail first, so that a
shared prefix outlives the turns that extended it.

The simulator's tokens are the whitespace-separated words of the prompt
(L{llmgw.sim.engine.count_prompt_tokens} counts the same), and a block's
name is 16 bytes of BLAKE2b over its parent's name and its words.  Unlike
vLLM, the cache's size is fixed (C{--prefix-cache-tokens}): it does not
shrink while running sequences hold KV space.

Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_TOKENS = 16
"""
Tokens per KV-cache block: vLLM's default C{--block-size} on GPUs.
"""

_ROOT = b"\x00" * 16


def block_hashes(
    words: Sequence[bytes], block_tokens: int = BLOCK_TOKENS
) -> list[bytes]:
    """
    The chained names of a sequence's full blocks.

    @param words: the sequence's tokens (the simulator's: words, UTF-8).
    @param block_tokens: tokens per block.
    @return: C{len(words) // block_tokens} names of 16 bytes; name C{i}
        depends on every token of blocks C{0..i}.  A partial last block has
        no name (vLLM caches only full blocks).
    """
    names = []
    parent = _ROOT
    for start in range(0, len(words) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b" ".join(words[start : start + block_tokens]))
        parent = h.digest()
        names.append(parent)
    return names


@dataclass(frozen=True, slots=True)
class SequenceBlocks:
    """
    One request's blocks, named once when the request comes.

    @ivar prompt: the prompt's full blocks, in order.
    @ivar whole: the full blocks of the prompt followed by the completion
        (what a later turn of the conversation sends back as its prefix).
    @ivar prompt_tokens: the prompt's length in tokens.
    """

    prompt: list[bytes]
    whole: list[bytes]
    prompt_tokens: int

    @classmethod
    def of(cls, prompt: bytes, completion: Sequence[str]) -> SequenceBlocks:
        """
        @param prompt: the prompt text, UTF-8 (for chat, the message
            contents joined by spaces).
        @param completion: the completion's tokens, as
            L{llmgw.sim.engine.completion_tokens} gives them.
        """
        words = prompt.split()
        tokens = max(1, len(words))
        answer = " ".join(completion).encode("utf-8").split()
        return cls(block_hashes(words), block_hashes(words + answer), tokens)


class PrefixCache:
    """
    At most C{capacity} blocks, evicted least recently used first, and
    vLLM's two counters.

    @ivar queries: prompt tokens looked up so far (vLLM's
        C{vllm:prefix_cache_queries}, which counts tokens).
    @ivar hits: of those, tokens found cached (C{vllm:prefix_cache_hits}).
    """

    def __init__(self, capacity: int, block_tokens: int = BLOCK_TOKENS) -> None:
        """
        @param capacity: blocks the cache holds; 0 holds none (every lookup
            misses, the counters still count).
        @param block_tokens: tokens per block.
        """
        self.capacity = capacity
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, name: bytes) -> bool:
        return name in self._blocks

    def lookup(self, blocks: SequenceBlocks) -> int:
        """
        Count one prompt's lookup and touch the blocks it reuses.

        @return: the prompt tokens found cached: the leading run of cached
            blocks, in tokens, at most C{prompt_tokens - 1}.
        """
        cached = self._blocks
        n = 0
        for name in blocks.prompt:
            if name not in cached:
                break
            n += 1
        # The last prompt token is always computed again (it yields the
        # first token's logits): a prompt made only of cached blocks reuses
        # all but its last block.
        while n and n * self.block_tokens >= blocks.prompt_tokens:
            n -= 1
        # Touched last to first, as L{insert} does: the head stays newest.
        for name in reversed(blocks.prompt[:n]):
            cached.move_to_end(name)
        hit = n * self.block_tokens
        self.queries += blocks.prompt_tokens
        self.hits += hit
        return hit

    def insert(self, names: Sequence[bytes]) -> None:
        """
        Cache a sequence's blocks (computed, or freed by a finished
        request), then evict down to capacity.

        Blocks are touched last to first, so the sequence's first blocks are
        the most recently used and its tail goes first, as vLLM frees a
        request's blocks in reverse order.
        """
        cached = self._blocks
        for name in reversed(names):
            cached[name] = None
            cached.move_to_end(name)
        while len(cached) > self.capacity:
            cached.popitem(last=False)

    def clear(self) -> None:
        """
        Drop every block; the counters stay.
        """
        self._blocks.clear()
