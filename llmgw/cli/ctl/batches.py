"""
C{llmgw ctl}'s commands of batches (docs/batches.md, "Watching batches"):
C{batches} (C{batches list}: every key's, filtered by status or key),
C{batches show ID} (one, with its lines by state) and C{batches cancel ID}
(cancelled as the operator), one function each (their entries of
L{llmgw.cli.ctl.commands.COMMANDS}).
"""

from __future__ import annotations

import argparse
import urllib.parse
from typing import IO, Any

from llmgw.cli.ctl.client import Client, quote
from llmgw.cli.ctl.show import cell, money, table, when


def progress(batch: dict[str, Any]) -> str:
    """
    @param batch: a batch as the admin API shows it.
    @return: its lines ended of all, and the share (C{"12/40 30%"});
        C{"0/0"} for a batch with no lines.
    """
    ended, total = batch["progress"]["ended"], batch["progress"]["total"]
    if not total:
        return "0/0"
    return f"{ended}/{total} {100 * ended // total}%"


def tokens(usage: dict[str, Any] | None) -> int | None:
    """
    @param usage: a batch's C{usage} as the admin API shows it, or
        L{None} from a server older than this C{ctl}, which shows none.
    @return: its lines' prompt and completion tokens so far, or L{None}.
    """
    if usage is None:
        return None
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


def batches_list(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{batches} (C{batches list}): a table of every key's batches, newest
    first, with their lines' tokens and cost so far, those of C{--status}
    or C{--key} only when given, at most C{--limit} of them, made before
    C{--after}'s batch when given (the table says the id to go on from
    when more follow).
    """
    query = {
        name: value
        for name, value in (
            ("status", args.status),
            ("key", args.key),
            ("limit", args.limit),
            ("after", args.after),
        )
        if value is not None
    }
    path = "/api/v1/batches"
    if query:
        path += "?" + urllib.parse.urlencode(query)
    result = client.call("GET", path)
    rows = [
        (
            b["id"],
            b["key"],
            b["endpoint"],
            b["status"],
            progress(b),
            (b.get("lines") or {}).get("failed", b["request_counts"]["failed"]),
            tokens(b.get("usage")),
            money((b.get("usage") or {}).get("cost")),
            when(b["created_at"]),
        )
        for b in result["batches"]
    ]
    header = (
        "BATCH",
        "KEY",
        "ENDPOINT",
        "STATUS",
        "DONE",
        "FAILED",
        "TOKENS",
        "COST",
        "CREATED",
    )
    text = table(rows, header)
    if result.get("has_more"):
        text += f"more follow: --after {result['last_id']}\n"
    return result, text


def batches_show(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{batches show ID}: one batch's fields, what its lines used (tokens,
    GPU-seconds, cost), its errors, and its lines by state (pending,
    running, done, failed, cancelled, expired).
    """
    batch = client.call("GET", f"/api/v1/batches/{quote(args.id)}")
    times = [
        f"{name}: {when(batch[f'{name}_at'])}"
        for name in (
            "created",
            "in_progress",
            "finalizing",
            "completed",
            "failed",
            "expired",
            "cancelling",
            "cancelled",
        )
        if batch.get(f"{name}_at") is not None
    ]
    lines = [
        f"batch: {batch['id']}",
        f"key: {cell(batch['key'])}",
        f"endpoint: {batch['endpoint']}",
        f"api: {batch['api']}",
        f"status: {batch['status']}",
        f"progress: {progress(batch)}",
        f"input file: {cell(batch['input_file_id'])}",
        f"output file: {cell(batch['output_file_id'])}",
        f"error file: {cell(batch['error_file_id'])}",
        *times,
        f"expires: {cell(when(batch['expires_at']))}",
    ]
    usage = batch.get("usage")
    if usage is not None:
        lines.append(
            f"usage: {usage['requests']} lines run,"
            f" {usage['prompt_tokens']} prompt and {usage['completion_tokens']}"
            f" completion tokens, {usage['gpu_seconds']:.3f} GPU s,"
            f" cost {money(usage['cost'])}"
        )
    lines += [
        f"error: line {cell(e.get('line'))}: {e.get('message')}"
        for e in batch.get("errors") or ()
    ]
    states = batch["lines"]
    text = (
        "\n".join(lines)
        + "\n\n"
        + table([list(states.values())], [state.upper() for state in states])
    )
    return batch, text


def batches_cancel(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{batches cancel ID}: the batch is cancelled as the operator; its
    lines not sent are not sent, those running end first.
    """
    batch = client.call("POST", f"/api/v1/batches/{quote(args.id)}/cancel")
    counts = batch["lines"]
    return batch, (
        f"batch {batch['id']} is {batch['status']}: {counts.get('cancelled', 0)}"
        f" lines not sent, {counts.get('running', 0)} running end first\n"
    )
