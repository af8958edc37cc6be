"""
C{llmgw ctl weights}: the model files on the nodes, listed, collected
(after a question, or with C{--yes}) or removed by path.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import IO, Any

from llmgw.cli.ctl.client import Client, CtlError, quote
from llmgw.cli.ctl.show import size, table, when


def weights(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{weights}: the model files on the nodes; with C{--collect} or
    C{--remove}, deleted.  C{--collect} lists what it would delete and asks
    first, on a terminal, unless C{--yes}; without a terminal it needs
    C{--yes} (L{_confirmed_collect}).
    """
    if args.dry_run and not args.collect:
        raise CtlError("weights: --dry-run goes with --collect")
    if args.yes and not args.collect:
        raise CtlError("weights: --yes goes with --collect")
    if args.remove:
        return _weights_remove(client, args.remove)
    if args.collect and not args.dry_run and not args.yes:
        return _confirmed_collect(client, out)
    if args.collect:
        return _weights_collect(client, args.dry_run, out)
    return _weights_list(client)


def _confirmed_collect(client: Client, out: IO[str]) -> tuple[Any, str]:
    """
    C{weights --collect} without C{--yes}: the files nothing uses listed
    on stderr, a question, and on C{y} exactly those deleted, node by node
    (through C{weights --remove}'s route, which refuses a file that became
    used meanwhile).

    @raise CtlError: stdin is not a terminal (nothing asked, nothing
        deleted), the answer was not yes, or a node refused.
    """
    _refuse_truncated(client)
    if not sys.stdin.isatty():
        raise CtlError(
            "weights --collect: deletes only after asking, and stdin is not"
            " a terminal: give --yes to delete without asking (--dry-run lists)"
        )
    listed = client.call("POST", "/api/v1/weights/collect", {"dry_run": True})
    unused = [(n["node"], e) for n in listed["nodes"] for e in n["unused"]]
    if not unused:
        return listed, "nothing unused\n"
    for node, entry in unused:
        sys.stderr.write(f"{node}: {entry['path']} ({size(entry['size_bytes'])})\n")
    total = size(sum(e["size_bytes"] for _, e in unused))
    sys.stderr.write(f"delete these {len(unused)} entries ({total})? [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise CtlError("weights --collect: not confirmed; nothing deleted")
    nodes = []
    for n in listed["nodes"]:
        paths = [e["path"] for e in n["unused"]]
        error = None
        if paths:
            try:
                client.call(
                    "POST",
                    f"/api/v1/nodes/{quote(n['node'])}/weights/remove",
                    {"paths": paths},
                )
            except CtlError as e:
                error = str(e)
        nodes.append(
            {
                **n,
                "removed": bool(paths) and error is None,
                "error": error or n["error"],
            }
        )
    return _collected({"dry_run": False, "nodes": nodes}, False, out)


def _weights_remove(client: Client, remove: list[str]) -> tuple[Any, str]:
    node, *paths = remove
    if not paths:
        raise CtlError("weights --remove: give NODE PATH [PATH...]")
    result = client.call(
        "POST", f"/api/v1/nodes/{quote(node)}/weights/remove", {"paths": paths}
    )
    return result, "".join(f"removed {p} on {node}\n" for p in result["removed"])


def _refuse_truncated(client: Client) -> None:
    # A truncated list leaves files out, maybe the one that makes a listed
    # file used: nothing is deleted on it.
    listed = client.call("GET", "/api/v1/weights")
    cut = [n for n in listed["nodes"] if n.get("truncated")]
    if cut:
        raise CtlError(
            "weights --collect: refusing, the weights list of "
            + ", ".join(
                f"{n['node']} is truncated ({len(n['files'])} of"
                f" {n['total']} entries reported)"
                for n in cut
            )
            + "; use --dry-run to see the list, --remove NODE PATH"
            " to delete by path"
        )


def _weights_collect(client: Client, dry_run: bool, out: IO[str]) -> tuple[Any, str]:
    if not dry_run:
        _refuse_truncated(client)
    result = client.call("POST", "/api/v1/weights/collect", {"dry_run": dry_run})
    return _collected(result, dry_run, out)


def _collected(result: Any, dry_run: bool, out: IO[str]) -> tuple[Any, str]:
    lines = []
    for n in result["nodes"]:
        verb = "would remove" if dry_run else ("removed" if n["removed"] else "kept")
        for entry in n["unused"]:
            lines.append(
                f"{n['node']}: {verb} {entry['path']} ({size(entry['size_bytes'])})"
            )
        if n["error"]:
            lines.append(f"{n['node']}: refused: {n['error']}")
    text = "\n".join(lines) + "\n" if lines else "nothing unused\n"
    if any(n["error"] for n in result["nodes"]):
        out.write(text)
        raise CtlError("some nodes refused; see above")
    return result, text


def _weights_list(client: Client) -> tuple[Any, str]:
    result = client.call("GET", "/api/v1/weights")
    now = time.time()
    ages = "".join(
        f"{n['node']}: reported {now - n['reported_at']:.0f}s ago"
        " (agents report every 60 s and after a removal)"
        + (
            f"; TRUNCATED: {len(n['files'])} of {n['total']} entries listed"
            if n.get("truncated")
            else ""
        )
        + "\n"
        for n in result["nodes"]
        if n["reported_at"] is not None
    )
    rows = [
        (
            n["node"],
            f["path"],
            size(f["size_bytes"]),
            when(f["last_used"]),
            f["unused"],
        )
        for n in result["nodes"]
        for f in n["files"]
    ]
    return result, ages + table(rows, ("NODE", "PATH", "SIZE", "LAST USED", "UNUSED"))
