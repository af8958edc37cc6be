"""
Helpers for the batches' end-to-end tests: input files of chat lines, a
batch submitted and followed through the official C{openai} client as a
user would (C{files.create}, C{batches.create}, polling, C{files.content}),
and the results read back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import openai
from openai.types import Batch

from tests.test_e2e_fleet_metrics import samples, values

MODEL = "sim-model"


def line_body(number: int, max_tokens: int = 4) -> dict[str, Any]:
    """
    @return: the chat request of line C{number}: a prompt of its own, so
        that each line's answer is its own.
    """
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"line {number} of the batch"}],
        "max_tokens": max_tokens,
    }


def chat_lines(count: int, max_tokens: int = 4) -> bytes:
    """
    @return: an input file of C{count} chat lines, C{custom_id}
        C{req-1} ... C{req-COUNT}.
    """
    return b"".join(
        json.dumps(
            {
                "custom_id": f"req-{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": line_body(n, max_tokens),
            }
        ).encode()
        + b"\n"
        for n in range(1, count + 1)
    )


def submit(client: openai.OpenAI, content: bytes) -> Batch:
    """
    Upload C{content} and make a batch of it.
    """
    uploaded = client.files.create(file=("lines.jsonl", content), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )


def wait_for(
    client: openai.OpenAI,
    batch_id: str,
    done: Callable[[Batch], bool],
    timeout: float,
    what: str,
) -> Batch:
    """
    Poll the batch (every 0.1 s, at most C{timeout} seconds) until C{done}.

    @raise AssertionError: the time ran out first.
    """
    deadline = time.monotonic() + timeout
    batch = client.batches.retrieve(batch_id)
    while not done(batch):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s: {batch}")
        time.sleep(0.1)
        batch = client.batches.retrieve(batch_id)
    return batch


def engine_running(engine_url: str, timeout: float = 30) -> None:
    """
    Wait (every 20 ms, at most C{timeout} seconds) until the engine at
    C{engine_url} says it runs a request: its C{vllm:num_requests_running}
    gauge, as vLLM serves it on C{/metrics}.  A test that stops or kills
    a server "mid-batch" sends its signal then, not at a moment the
    runner may rightly hold no line in flight (all of a wave ended, the
    next not yet claimed).

    @raise AssertionError: the time ran out first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = values(samples(engine_url), "vllm:num_requests_running")
        if sum(running.values()) > 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"{engine_url} ran no request within {timeout} s")


def ended(status: str) -> Callable[[Batch], bool]:
    return lambda batch: batch.status == status


def completed_at_least(count: int) -> Callable[[Batch], bool]:
    def enough(batch: Batch) -> bool:
        counts = batch.request_counts
        return counts is not None and counts.completed >= count

    return enough


def results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    """
    @return: the lines of a batch's output or error file (none for
        L{None}).
    """
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line]


def by_custom_id(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """
    @return: C{entries} by C{custom_id}.
    @raise AssertionError: one comes twice.
    """
    found: dict[str, dict[str, Any]] = {}
    for entry in entries:
        assert entry["custom_id"] not in found, entry["custom_id"]
        found[entry["custom_id"]] = entry
    return found
