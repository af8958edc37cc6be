"""
End to end: C{twistd -n llmgw-server} and C{llmgw sim} as child processes,
talked to over loopback sockets with the official C{openai} client.  The
modules of this package: the API in front of one engine
(L{tests.test_e2e_router.test_api}), several and misbehaving replicas
(L{tests.test_e2e_router.test_replicas}), the server's start, TLS and
stop (L{tests.test_e2e_router.test_server}), and the forwarding fast path
and the request log line (L{tests.test_e2e_router.test_fastpath}).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about naïve cafés"}]


def client(base_url: str, **kwargs: Any) -> openai.OpenAI:
    """
    The official client, without its own retries (they would hide what the
    gateway answered) and with a bounded timeout.
    """
    return openai.OpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30, **kwargs
    )


def stream_text(chunks: Iterator[Any]) -> tuple[str, list[Any]]:
    """
    @return: the concatenated delta contents and every chunk.
    """
    seen = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in seen if c.choices)
    return text, seen
