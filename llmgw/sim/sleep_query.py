"""
The parameters of the simulator's sleep routes as vLLM and SGLang take
them: vLLM's C{POST /sleep?level=N} and C{POST /wake_up?tags=...} query
strings (vLLM 0.32: vllm/entrypoints/serve/dev/sleep/api_router.py), and
SGLang's C{release_memory_occupation} and C{resume_memory_occupation}
JSON bodies.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from llmgw.sim.api import ApiError, parse_json_object
from llmgw.sim.sleep import SGLANG_TAGS


def sleep_level(query: bytes) -> int:
    """
    @param query: a C{POST /sleep} URL's query string.
    @return: its C{level}, 1 when absent (vLLM's default).
    @raise ApiError: 400, a level other than 0, 1 or 2 (vLLM answers a
        query its route does not validate with 400).
    """
    values = parse_qs(query.decode("ascii", "replace")).get("level", ["1"])
    if values[-1] not in ("0", "1", "2"):
        raise ApiError(
            400, f"level: expected 0, 1 or 2, got {values[-1]!r}", param="level"
        )
    return int(values[-1])


def wake_tags(query: bytes) -> list[str] | None:
    """
    @param query: a C{POST /wake_up} URL's query string.
    @return: its C{tags}, L{None} when none (all).
    """
    return parse_qs(query.decode("ascii", "replace")).get("tags") or None


def sglang_tags(body: bytes) -> list[str] | None:
    """
    @param body: the JSON body of SGLang's memory routes: C{{}} or
        C{{"tags": [...]}} (or none).
    @return: its C{tags} (C{cuda_graph}, which the simulator holds no
        memory for, left out), L{None} when none (all).
    @raise ApiError: 400, not such an object, or a tag SGLang does not know.
    """
    obj = parse_json_object(body) if body.strip() else {}
    tags = obj.get("tags")
    if tags is None:
        return None
    if not (isinstance(tags, list) and all(t in SGLANG_TAGS for t in tags)):
        raise ApiError(
            400,
            f"tags: expected a list of {', '.join(SGLANG_TAGS)}, got {tags!r}",
            param="tags",
        )
    return [t for t in tags if t != "cuda_graph"] or None
