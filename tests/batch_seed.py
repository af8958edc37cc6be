"""
Batches written straight into a server's SQLite store, as the Batches API
would have made them (a child process, so that the store's threads run on
a reactor of their own while the test waits): for the end-to-end tests of
what shows batches (C{llmgw ctl batches}, the dashboard, the metrics),
which need batches in known states whatever makes them.

Run as C{python -m tests.batch_seed DATABASE} with the batches on
stdin, as JSON: C{[{"row": {...BatchRow's fields}, "lines": [{...}, ...]}]}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.support import hermetic_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def chat_batch(
    batch_id: str,
    key: dict[str, Any] | None,
    lines: int,
    created_at: float,
    status: str = "in_progress",
) -> dict[str, Any]:
    """
    @param key: the key that made it (as C{llmgw ctl keys --json} lists
        it), or L{None}.
    @return: a batch of C{lines} chat lines for model C{chat}, all
        pending, as L{seed} takes it.
    """
    return {
        "row": {
            "id": batch_id,
            "key_id": key["id"] if key else None,
            "key_name": key["name"] if key else None,
            "endpoint": "/v1/chat/completions",
            "input_file_id": "file-seeded",
            "completion_window": "24h",
            "status": status,
            "created_at": created_at,
            "expires_at": created_at + 86400,
            "in_progress_at": created_at,
            "total": lines,
        },
        "lines": [
            {
                "batch_id": batch_id,
                "line_no": n,
                "custom_id": f"c{n}",
                "model": "chat",
                "url": "/v1/chat/completions",
                "body": json.dumps(
                    {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
                ),
            }
            for n in range(1, lines + 1)
        ],
    }


def seed(database: str, batches: list[dict[str, Any]]) -> None:
    """
    Write C{batches} into the SQLite store at C{database} (migrated
    first if new), in a child process.
    """
    subprocess.run(
        [sys.executable, "-m", "tests.batch_seed", database],
        input=json.dumps(batches),
        text=True,
        check=True,
        cwd=ROOT,
        env=hermetic_env(),
        timeout=60,
    )


def _main(database: str, batches: list[dict[str, Any]]) -> None:
    from twisted.internet.defer import Deferred
    from twisted.internet.task import react

    from llmgw.store.batches import BatchLine, BatchRow
    from llmgw.store.db import open_store

    async def write(reactor: Any) -> None:
        store = open_store(f"sqlite://{database}", "/nonexistent")
        store.prepare()
        try:
            for batch in batches:
                await store.add_batch(
                    BatchRow(**batch["row"]),
                    [BatchLine(**line) for line in batch["lines"]],
                )
        finally:
            store.close()

    react(lambda reactor: Deferred.fromCoroutine(write(reactor)))


if __name__ == "__main__":
    _main(sys.argv[1], json.loads(sys.stdin.read()))
