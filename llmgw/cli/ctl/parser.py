"""
C{llmgw ctl}'s argument parser, built one command at a time.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from llmgw.wire.engines import ENGINES

DEFAULT_ADMIN_URL = "http://127.0.0.1:9090"


def _with(shared: argparse.ArgumentParser, subparsers: Any) -> Any:
    """
    @return: C{subparsers}, whose parsers all take C{shared}'s options.
    """
    original = subparsers.add_parser

    def add_parser(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return original(name, parents=[shared], **kwargs)  # type: ignore[no-any-return]

    subparsers.add_parser = add_parser
    return subparsers


def _top() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="llmgw ctl",
        description="Run an llmgw fleet through the admin API.",
        # Else "keys create --admin" is taken for an abbreviation of
        # --admin-url or --admin-key, and refused as ambiguous.
        allow_abbrev=False,
    )
    top.add_argument(
        "--admin-url",
        default=os.environ.get("LLMGW_ADMIN_URL", DEFAULT_ADMIN_URL),
        help=f"the admin listener (default {DEFAULT_ADMIN_URL}, or $LLMGW_ADMIN_URL)",
    )
    top.add_argument(
        "--admin-key",
        default=os.environ.get("LLMGW_ADMIN_KEY"),
        help="an admin key, for an admin listener not on loopback ($LLMGW_ADMIN_KEY)",
    )
    top.add_argument("--json", action="store_true", help="print the API's JSON")
    return top


def _reads(commands: Any, shared: argparse.ArgumentParser) -> None:
    commands.add_parser("status", help="version, uptime, counts")
    nodes = commands.add_parser(
        "nodes", help="nodes and their GPUs; with NODE, that node in full"
    )
    nodes.add_argument("node", nargs="?", help="one node's id")
    replicas = commands.add_parser("replicas", help="replicas and their shards")
    replicas.add_argument(
        "--phases",
        action="store_true",
        help="where each replica's start spent its time, one row per phase",
    )


def _models(commands: Any, shared: argparse.ArgumentParser) -> None:
    models = commands.add_parser(
        "models", help="the catalog: list, add, remove, scale, pin, unpin"
    )
    actions = _with(shared, models.add_subparsers(dest="action"))
    actions.add_parser("list")
    add = actions.add_parser("add", help="add a model (kept across restarts)")
    add.add_argument("name", nargs="?")
    add.add_argument("--file", help="a TOML file with one [[models]] table")
    add.add_argument("--engine", choices=ENGINES)
    add.add_argument("--source", help="hub id or local path")
    add.add_argument(
        "--profile", default="default", help="profile name (default: default)"
    )
    add.add_argument("--gpus", type=int, default=0)
    add.add_argument("--gpu-memory-gb", type=float)
    add.add_argument("--min-replicas", type=int, default=0)
    add.add_argument("--max-replicas", type=int)
    add.add_argument("--idle-timeout")
    add.add_argument("--alias", action="append")
    add.add_argument("--arg", action="append", help="an engine argument (repeatable)")
    add.add_argument("--base", help="a LoRA adapter: the catalog model it runs on")
    add.add_argument("--adapter", help="with --base: the adapter's path or hub id")
    add.add_argument("--rank", type=int, help="with --base: the adapter's LoRA rank")
    add.add_argument(
        "--max-loras", type=int, help="a LoRA base: adapters each replica keeps loaded"
    )
    remove = actions.add_parser("remove", help="remove a model added at run time")
    remove.add_argument("name")
    scale = actions.add_parser("scale", help="set min/max replicas")
    scale.add_argument("name")
    scale.add_argument("--min", type=int)
    scale.add_argument("--max", type=int)
    pin = actions.add_parser("pin", help="never evict the model to make room")
    pin.add_argument("name")
    unpin = actions.add_parser("unpin", help="let the model be evicted again")
    unpin.add_argument("name")


def _placement_and_drains(commands: Any, shared: argparse.ArgumentParser) -> None:
    placement = commands.add_parser(
        "placement", help="where a model would go, or why not"
    )
    placement.add_argument("model")
    drain = commands.add_parser(
        "drain",
        help="drain a node or a replica (each replaced first)",
        description="Drain a node or a replica: each replica is replaced"
        " elsewhere first and drains once its replacement is ready.  Refused"
        " when a model would be left below its min_replicas with no room for"
        " a replacement.  A node's drain is kept across restarts until"
        " `undrain`.",
    )
    drain.add_argument("kind", choices=("node", "replica"))
    drain.add_argument("id")
    drain.add_argument(
        "--force",
        action="store_true",
        help="drain at once, unchecked and not replaced first: a model may go"
        " below its min_replicas",
    )
    undrain = commands.add_parser("undrain", help="let placements use a node again")
    undrain.add_argument("kind", choices=("node",))
    undrain.add_argument("id")
    asleep = commands.add_parser(
        "sleep",
        help="put a replica to sleep (its profile's sleep level)",
        description="The replica takes no new requests and sleeps once its last"
        " one ends; its model wants one replica fewer.  Refused when its profile"
        ' has sleep = "off", its engine refused sleep mode, its node\'s'
        " sleep_memory is full or its model would go below min_replicas.",
    )
    asleep.add_argument("id", help="the replica's id (ctl replicas)")
    awake = commands.add_parser("wake", help="wake a sleeping replica where it sleeps")
    awake.add_argument("id", help="the replica's id (ctl replicas)")
    for name, doing in (
        ("stop-engines", "stop every engine of NODE (or of every node) on purpose"),
        ("start-engines", "let placements use NODE (or every node) again"),
    ):
        engines = commands.add_parser(
            name,
            help=doing,
            description=doing[0].upper() + doing[1:] + ".  Nothing is kept in"
            " the store: the server's next start places engines again."
            "  (An agent's own SIGTERM keeps its engines running.)",
        )
        which = engines.add_mutually_exclusive_group(required=True)
        which.add_argument("node", nargs="?", metavar="NODE")
        which.add_argument("--all", action="store_true", help="every node")


_EXPIRES = "when it stops working: 30d, 12h, an ISO 8601 time or POSIX seconds"


def _cost_limit(value: str) -> float | None:
    """
    @return: C{--budget-cost} of C{keys update}: a number, or L{None} for
        none.
    """
    if value.lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or none, got {value!r}"
        ) from None


def _limit(value: str) -> int | None:
    """
    @return: a limit of C{keys update}: a whole number, or L{None} for none.
    """
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number or none, got {value!r}"
        ) from None


def _keys(commands: Any, shared: argparse.ArgumentParser) -> None:
    keys = commands.add_parser("keys", help="API keys: list, create, update, revoke")
    key_actions = _with(shared, keys.add_subparsers(dest="action"))
    key_actions.add_parser("list")
    create = key_actions.add_parser("create", help="make a key; printed once")
    create.add_argument("--name", required=True)
    create.add_argument(
        "--models", help="comma-separated models it may use (default all)"
    )
    create.add_argument("--rpm", type=int, help="requests per minute")
    create.add_argument("--tpm", type=int, help="tokens per minute")
    create.add_argument("--budget-tokens", type=int, help="tokens in all")
    create.add_argument(
        "--budget-cost",
        type=float,
        help="cost in all (the unit of [cost] gpu_hour's prices)",
    )
    create.add_argument("--admin", action="store_true", help="may use the admin API")
    create.add_argument("--expires", help=_EXPIRES)
    _order(create)
    update = key_actions.add_parser(
        "update",
        help="change a key's models, limits or expiry (by name or prefix)",
        description="Change a key: what is not given stays; 'none' removes a"
        " limit, '--models all' lets it use every model, '--expires never'"
        " keeps it for good.  Its counters (tokens used) are kept.",
    )
    update.add_argument("name")
    update.add_argument("--models", help="comma-separated models it may use, or all")
    update.add_argument(
        "--rpm",
        type=_limit,
        default=argparse.SUPPRESS,
        help="requests per minute, or none",
    )
    update.add_argument(
        "--tpm",
        type=_limit,
        default=argparse.SUPPRESS,
        help="tokens per minute, or none",
    )
    update.add_argument(
        "--budget-tokens",
        type=_limit,
        default=argparse.SUPPRESS,
        help="tokens in all, or none",
    )
    update.add_argument(
        "--budget-cost",
        type=_cost_limit,
        default=argparse.SUPPRESS,
        help="cost in all (the unit of [cost] gpu_hour's prices), or none",
    )
    update.add_argument("--expires", help=_EXPIRES + ", or never")
    _order(update)
    revoke = key_actions.add_parser("revoke", help="revoke a key by name or prefix")
    revoke.add_argument("name")


def _order(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--priority",
        help="where requests wait, who goes first: interactive, standard,"
        " batch or an integer (higher first)",
    )
    parser.add_argument(
        "--weight", type=float, help="its share within its priority (above 0)"
    )


def _usage(commands: Any, shared: argparse.ArgumentParser) -> None:
    usage = commands.add_parser(
        "usage", help="usage by key, model or day, with GPU-seconds and cost"
    )
    usage.add_argument("--by", choices=("key", "model", "day"), default="key")
    usage.add_argument(
        "--since", default="24h", help="24h, 30m, an ISO time or POSIX seconds"
    )
    usage.add_argument("--until")


def _weights(commands: Any, shared: argparse.ArgumentParser) -> None:
    weights = commands.add_parser("weights", help="model files on the nodes")
    weights.add_argument(
        "--collect", action="store_true", help="delete those nothing uses"
    )
    weights.add_argument(
        "--dry-run", action="store_true", help="with --collect: only list"
    )
    weights.add_argument(
        "--yes",
        action="store_true",
        help="with --collect: delete without asking (needed without a terminal)",
    )
    weights.add_argument(
        "--remove", nargs="+", metavar="NODE PATH", help="delete these paths on NODE"
    )


def _batches(commands: Any, shared: argparse.ArgumentParser) -> None:
    batches = commands.add_parser(
        "batches", help="every key's batches: list, show, cancel"
    )
    actions = _with(shared, batches.add_subparsers(dest="action"))
    listed = actions.add_parser("list", help="the batches, newest first")
    for parser_ in (batches, listed):
        # "batches --status ..." as "batches list --status ...".
        parser_.add_argument(
            "--status",
            help="only those in this status (validating, in_progress,"
            " finalizing, completed, failed, expired, cancelling, cancelled)",
        )
        parser_.add_argument("--key", help="only this key's (by name)")
        parser_.add_argument(
            "--limit", type=int, help="at most this many (1 to 100; 20 by default)"
        )
        parser_.add_argument("--after", help="those made before this batch (an id)")
    show = actions.add_parser("show", help="one batch, with its lines by state")
    show.add_argument("id", help="the batch's id (ctl batches)")
    cancel = actions.add_parser(
        "cancel",
        help="cancel a batch as the operator",
        description="Cancel a batch, whichever key made it: its lines not"
        " sent are cancelled, those running end first; the batch then ends"
        " cancelled, with the answers it has in its output file.",
    )
    cancel.add_argument("id", help="the batch's id (ctl batches)")


# In the order --help lists them.
_COMMAND_PARSERS = (
    _reads,
    _models,
    _placement_and_drains,
    _keys,
    _usage,
    _weights,
    _batches,
)


def parser() -> argparse.ArgumentParser:
    """
    @return: the parser of C{llmgw ctl}'s command line; the parsed
        arguments' C{command} (and C{action} for C{models}, C{keys} and
        C{batches}) name the command.
    """
    top = _top()
    # --json is taken after the command too.
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    commands = _with(shared, top.add_subparsers(dest="command", required=True))
    for add_commands in _COMMAND_PARSERS:
        add_commands(commands, shared)
    return top
