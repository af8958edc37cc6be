"""
Affinity: which replica a request would rather go to, so that an engine's
prefix cache (the KV blocks of a prompt it has seen) is hit again.

A request gets a key: its session (a configured header, else the OpenAI
C{user} field), or a hash of its leading prompt content when the prompt is
long enough for a cache hit to matter.  The key maps to a replica by
rendezvous hashing (highest random weight: Thaler and Ravishankar, "Using
name-based mappings to increase hit rates", IEEE/ACM ToN 6(1), 1998), so a
replica joining or leaving moves only the keys it wins or held.  The owner
is used only while its load stays within M{(1 + epsilon)} times the
model's average (consistent hashing with bounded loads: Mirrokni,
Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA
2018, arXiv:1608.01350, 2016); the balancer otherwise takes the least
loaded replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

# 2**64, for a 64-bit hash as a fraction in (0, 1).
_SPAN = float(1 << 64)


@dataclass(frozen=True)
class AffinityRule:
    """
    How a request's affinity key is read.

    @ivar prefix_bytes: bytes of leading prompt content hashed (UTF-8).
    @ivar min_tokens: prompts estimated under this many tokens (about 4
        bytes of body a token) get no prefix key: a cache hit saves them
        little, and they balance better freely.
    @ivar session_header: the header naming a session, lower case
        (C{b"x-session-id"}), or C{b""} for none.
    """

    prefix_bytes: int = 1024
    min_tokens: int = 256
    session_header: bytes = b"x-session-id"

    def key(
        self, payload: dict[str, Any], body_size: int, session: bytes | None
    ) -> bytes | None:
        """
        @param payload: the parsed request body.
        @param body_size: its size, bytes (the prompt size estimate).
        @param session: the session header's value, or L{None}.
        @return: the affinity key, or L{None} for a request that balances
            freely.
        """
        if session:
            return b"s" + session
        user = payload.get("user")
        if isinstance(user, str) and user:
            return b"u" + user.encode("utf-8", "replace")
        if body_size // 4 < self.min_tokens:
            return None
        prefix = leading_content(payload, self.prefix_bytes)
        if not prefix:
            return None
        return b"p" + blake2b(prefix, digest_size=16).digest()


def leading_content(payload: dict[str, Any], limit: int) -> bytes:
    """
    The first C{limit} bytes of a request's prompt: the chat messages'
    roles and text in order (OpenAI chat completions: C{content} a string
    or a list of parts with C{text}), or a completion's C{prompt}.

    @return: UTF-8 bytes, at most C{limit}; empty when there is no text.
    """
    parts: list[str] = []
    size = 0
    messages = payload.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if size >= limit:
                break
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            text = ""
            if isinstance(content, str):
                text = content
            elif isinstance(content, list):
                text = "".join(
                    p["text"]
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            text = text[: limit - size]
            role = message.get("role")
            parts.append(f"{role}\x00{text}\x00")
            size += len(text) + 8
    else:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            # A batch: its first prompt.
            prompt = prompt[0]
        if isinstance(prompt, str):
            parts.append(prompt[:limit])
        elif isinstance(prompt, list):
            # Token ids.
            parts.append(",".join(str(t) for t in prompt[: max(limit // 4, 1)]))
    return "".join(parts).encode("utf-8", "replace")[:limit]


def rank(key: bytes, replica_id: str, weight: float) -> float:
    """
    A replica's rendezvous score for a key, weighted: M{-w / ln(h)} with
    M{h} the key and id's hash as a fraction in (0, 1) (Schindelhauer and
    Schomaker, "Weighted distributed hash tables", SPAA 2005): the highest
    wins, each replica with a share of keys proportional to its weight.
    """
    digest = blake2b(key + replica_id.encode("utf-8"), digest_size=8).digest()
    h = (int.from_bytes(digest, "big") + 0.5) / _SPAN
    return -weight / math.log(h)


def within_bound(
    load: float, weight: float, total: float, total_weight: float, epsilon: float
) -> bool:
    """
    Whether one more request fits the owner's bounded share: its load with
    the request at most M{ceil((1 + epsilon) * (total + 1) * weight /
    total_weight)} (Mirrokni et al., above; with equal weights the bound is
    the paper's M{ceil((1 + epsilon) m / n)}).

    @param load: the owner's load now (requests, see the balancer's score).
    @param total: the load of all the model's candidate replicas.
    """
    bound = math.ceil((1 + epsilon) * (total + 1) * weight / total_weight)
    return load + 1 <= bound


def owner(key: bytes, candidates: Sequence[tuple[str, float]]) -> int:
    """
    @param candidates: (replica id, weight) pairs, not empty.
    @return: the index of the candidate that owns C{key}.
    """
    best, best_rank = 0, -1.0
    for i, (replica_id, weight) in enumerate(candidates):
        r = rank(key, replica_id, weight)
        if r > best_rank:
            best, best_rank = i, r
    return best
