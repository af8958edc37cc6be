"""
Helpers shared by the simulator's test modules (L{tests.test_sim},
L{tests.test_sim_site}, L{tests.test_sim_listening}).
"""

from __future__ import annotations

import json
from typing import Any


def event_json(event: bytes) -> Any:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
    return json.loads(event[6:-2])


def dechunk(data: bytes) -> tuple[bytes, bool]:
    """
    The body of a chunked response so far, and whether it is complete.
    """
    out: list[bytes] = []
    while data:
        size_line, sep, rest = data.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            return b"".join(out), True
        if len(rest) < size + 2:
            out.append(rest[:size])
            break
        out.append(rest[:size])
        data = rest[size + 2 :]
    return b"".join(out), False


def chat_body(
    max_tokens: int, stream: bool = True, **extra: object
) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }
