"""
C{llmgw ctl}: the admin API from the command line (docs/keys.md).
Tables by default, C{--json} for scripts; a failure is one line on stderr
and a non-zero exit status.  Usage::

    llmgw ctl [--admin-url URL] [--admin-key KEY] [--json] COMMAND ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from llmgw.wire.engines import ENGINES

DEFAULT_ADMIN_URL = "http://127.0.0.1:9090"


class CtlError(Exception):
    """
    One line for the user.
    """


class _Client:
    def __init__(self, base: str, key: str | None, timeout: float = 60.0) -> None:
        self.base = base.rstrip("/")
        self.key = key
        self.timeout = timeout

    def call(self, method: str, path: str, body: object = None) -> Any:
        data = json.dumps(body).encode("utf-8") if body is not None else None
        headers = {"content-type": "application/json"}
        if self.key:
            headers["authorization"] = f"Bearer {self.key}"
        try:
            # A URL without a scheme fails here, as a ValueError.
            request = urllib.request.Request(
                self.base + path, data=data, method=method, headers=headers
            )
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw.decode("utf-8", "replace")[:300] or e.reason
            raise CtlError(f"{message} (HTTP {e.code})") from None
        except ValueError as e:
            raise CtlError(f"bad --admin-url {self.base!r}: {e}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise CtlError(
                f"cannot reach the admin API at {self.base}: {reason}"
                " (is llmgw-server running? see --admin-url)"
            ) from None


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    if isinstance(value, (list, tuple)):
        return ",".join(_cell(v) for v in value) or "-"
    return str(value)


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """
    @return: C{rows} under C{header}, columns aligned, two spaces apart.
    """
    cells = [list(header)] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in cells
    ]
    return "\n".join(lines) + "\n"


def _when(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def _size(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"


def _model_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    if args.file:
        try:
            with open(args.file, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise CtlError(f"cannot read {args.file!r}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise CtlError(f"{args.file!r} is not valid TOML: {e}") from None
        models = data.get("models")
        if isinstance(models, list) and len(models) == 1:
            table = models[0]
        elif "models" not in data:
            table = data
        else:
            raise CtlError(f"{args.file!r}: expected one model (one [[models]] table)")
        return dict(table)
    if not (args.name and args.engine and args.source):
        raise CtlError(
            "models add: give NAME --engine E --source S, or --file FILE.toml"
        )
    profile: dict[str, Any] = {
        "name": args.profile,
        "engine": args.engine,
        "source": args.source,
        "gpus": args.gpus,
    }
    if args.gpu_memory_gb is not None:
        profile["gpu_memory_gb"] = args.gpu_memory_gb
    if args.arg:
        profile["args"] = args.arg
    model: dict[str, Any] = {
        "name": args.name,
        "min_replicas": args.min_replicas,
        "profiles": [profile],
    }
    if args.max_replicas is not None:
        model["max_replicas"] = args.max_replicas
    if args.alias:
        model["aliases"] = args.alias
    if args.idle_timeout is not None:
        model["idle_timeout"] = args.idle_timeout
    return model


def run(args: argparse.Namespace, out: Any) -> None:
    client = _Client(args.admin_url, args.admin_key)
    command = args.command
    result: Any
    text: str
    if command == "status":
        result = client.call("GET", "/api/v1/status")
        lines = []
        for name, value in result.items():
            if isinstance(value, dict):
                shown = ", ".join(f"{n} {c}" for n, c in value.items()) or "-"
            else:
                shown = _cell(value)
            lines.append(f"{name}: {shown}\n")
        text = "".join(lines)
    elif command == "nodes":
        result = client.call("GET", "/api/v1/nodes")
        text = table(
            [
                (
                    n["id"],
                    n["state"] + (" draining" if n.get("draining") else ""),
                    n["connected"],
                    n["address"],
                    len(n["gpus"]),
                    ",".join(sorted({g["name"] for g in n["gpus"]})),
                    n["last_seen"][:19],
                )
                for n in result["nodes"]
            ],
            ("NODE", "STATE", "CONNECTED", "ADDRESS", "GPUS", "GPU TYPES", "LAST SEEN"),
        )
    elif command == "replicas":
        result = client.call("GET", "/api/v1/replicas")
        rows = []
        for r in result["replicas"]:
            for s in r["shards"]:
                rows.append(
                    (
                        r["id"],
                        r["model"],
                        r["profile"],
                        r["state"],
                        s["node"],
                        s["gpus"],
                        s["port"],
                        s["pid"],
                        s["last_error"],
                    )
                )
        text = table(
            rows,
            (
                "REPLICA",
                "MODEL",
                "PROFILE",
                "STATE",
                "NODE",
                "GPU IDS",
                "PORT",
                "PID",
                "LAST ERROR",
            ),
        )
    elif command == "models":
        action = args.action or "list"
        if action == "list":
            result = client.call("GET", "/api/v1/models")
            text = table(
                [
                    (
                        m["name"],
                        m["aliases"],
                        m["ready"],
                        m["desired"],
                        f"{m['min_replicas']}-{m['max_replicas']}",
                        m["profiles"],
                        "runtime" if m.get("runtime") else "config",
                        m["last_error"],
                    )
                    for m in result["models"]
                ],
                (
                    "MODEL",
                    "ALIASES",
                    "READY",
                    "DESIRED",
                    "MIN-MAX",
                    "PROFILES",
                    "FROM",
                    "LAST ERROR",
                ),
            )
        elif action == "add":
            result = client.call("POST", "/api/v1/models", _model_from_flags(args))
            text = f"added model {result['name']} (desired {result['desired']})\n"
        elif action == "remove":
            result = client.call("DELETE", "/api/v1/models/" + _quote(args.name))
            text = f"removed model {args.name}: its replicas drain and stop\n"
        else:
            body = {}
            if args.min is not None:
                body["min_replicas"] = args.min
            if args.max is not None:
                body["max_replicas"] = args.max
            if not body:
                raise CtlError("models scale: give --min N and/or --max N")
            result = client.call(
                "POST", f"/api/v1/models/{_quote(args.name)}/scale", body
            )
            text = (
                f"model {result['name']}: min {result['min_replicas']},"
                f" max {result['max_replicas']}, desired {result['desired']}\n"
            )
    elif command == "placement":
        result = client.call("GET", "/api/v1/placement/" + _quote(args.model))
        if result["fits"]:
            where = ", ".join(
                f"{s['node']} GPU ids {_cell(s['gpus'])} port {s['port']}"
                for s in result["shards"]
            )
            text = f"{result['model']}: fits, profile {result['profile']}: {where}\n"
        else:
            text = f"{result['model']}: fits nowhere\n" + "".join(
                f"  {line}\n" for line in result["reasons"]
            )
    elif command == "undrain":
        result = client.call("POST", f"/api/v1/nodes/{_quote(args.id)}/undrain")
        text = f"node {args.id} takes placements again\n"
    elif command == "drain":
        if args.kind == "node":
            result = client.call("POST", f"/api/v1/nodes/{_quote(args.id)}/drain")
            moving = _cell(result["draining_replicas"])
            text = f"draining node {args.id}: replicas {moving}\n"
        else:
            result = client.call("POST", f"/api/v1/replicas/{_quote(args.id)}/drain")
            text = f"draining replica {args.id}\n"
    elif command == "keys":
        action = args.action or "list"
        if action == "create":
            fields: dict[str, Any] = {"name": args.name, "admin": args.admin}
            if args.models is not None:
                models = [m.strip() for m in args.models.split(",") if m.strip()]
                if not models:
                    raise CtlError(
                        "keys create: --models is empty (leave it out for all)"
                    )
                fields["models"] = models
            for field in ("rpm", "tpm", "budget_tokens"):
                if getattr(args, field) is not None:
                    fields[field] = getattr(args, field)
            result = client.call("POST", "/api/v1/keys", fields)
            text = (
                f"{result['key']}\n"
                f"key {result['name']} created; it is shown only this once.\n"
            )
        elif action == "revoke":
            result = client.call("POST", f"/api/v1/keys/{_quote(args.name)}/revoke")
            text = f"revoked key {result['name']} ({result['prefix']}...)\n"
        else:
            result = client.call("GET", "/api/v1/keys")
            text = table(
                [
                    (
                        k["name"],
                        k["prefix"] + "...",
                        k["models"] or "all",
                        k["rpm"],
                        k["tpm"],
                        k["budget_tokens"],
                        k["admin"],
                        _when(k["created"]),
                        _when(k["last_used"]),
                        k["tokens_used"],
                        _when(k["revoked"]),
                    )
                    for k in result["keys"]
                ],
                (
                    "NAME",
                    "PREFIX",
                    "MODELS",
                    "RPM",
                    "TPM",
                    "BUDGET",
                    "ADMIN",
                    "CREATED",
                    "LAST USED",
                    "TOKENS USED",
                    "REVOKED",
                ),
            )
    elif command == "usage":
        query = urllib.parse.urlencode(
            {
                "by": args.by,
                "since": args.since,
                **({"until": args.until} if args.until else {}),
            }
        )
        result = client.call("GET", "/api/v1/usage?" + query)
        text = table(
            [
                (
                    g[args.by],
                    g["requests"],
                    g["errors"],
                    g["prompt_tokens"],
                    g["completion_tokens"],
                    g["mean_latency"],
                    g["mean_time_to_first_token"],
                )
                for g in result["usage"]
            ],
            (
                args.by.upper(),
                "REQUESTS",
                "ERRORS",
                "PROMPT TOKENS",
                "COMPLETION TOKENS",
                "MEAN LATENCY S",
                "MEAN TTFT S",
            ),
        )
    elif command == "weights":
        if args.dry_run and not args.collect:
            raise CtlError("weights: --dry-run goes with --collect")
        if args.remove:
            node, *paths = args.remove
            if not paths:
                raise CtlError("weights --remove: give NODE PATH [PATH...]")
            result = client.call(
                "POST", f"/api/v1/nodes/{_quote(node)}/weights/remove", {"paths": paths}
            )
            text = "".join(f"removed {p} on {node}\n" for p in result["removed"])
        elif args.collect:
            if not args.dry_run:
                # A truncated list leaves files out, maybe the one that
                # makes a listed file used: nothing is deleted on it.
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
            result = client.call(
                "POST", "/api/v1/weights/collect", {"dry_run": args.dry_run}
            )
            lines = []
            for n in result["nodes"]:
                verb = (
                    "would remove"
                    if args.dry_run
                    else ("removed" if n["removed"] else "kept")
                )
                for entry in n["unused"]:
                    size = _size(entry["size_bytes"])
                    lines.append(f"{n['node']}: {verb} {entry['path']} ({size})")
                if n["error"]:
                    lines.append(f"{n['node']}: refused: {n['error']}")
            text = "\n".join(lines) + "\n" if lines else "nothing unused\n"
            if any(n["error"] for n in result["nodes"]):
                out.write(text)
                raise CtlError("some nodes refused; see above")
        else:
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
            text = ages + table(
                [
                    (
                        n["node"],
                        f["path"],
                        _size(f["size_bytes"]),
                        _when(f["last_used"]),
                        f["unused"],
                    )
                    for n in result["nodes"]
                    for f in n["files"]
                ],
                ("NODE", "PATH", "SIZE", "LAST USED", "UNUSED"),
            )
    else:  # pragma: no cover - argparse refuses others
        raise CtlError(f"unknown command {command!r}")
    out.write(json.dumps(result, indent=2) + "\n" if args.json else text)


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _with(shared: argparse.ArgumentParser, subparsers: Any) -> Any:
    """
    @return: C{subparsers}, whose parsers all take C{shared}'s options.
    """
    original = subparsers.add_parser

    def add_parser(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return original(name, parents=[shared], **kwargs)  # type: ignore[no-any-return]

    subparsers.add_parser = add_parser
    return subparsers


def parser() -> argparse.ArgumentParser:
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
    # --json is taken after the command too.
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    commands = _with(shared, top.add_subparsers(dest="command", required=True))
    commands.add_parser("status", help="version, uptime, counts")
    commands.add_parser("nodes", help="nodes and their GPUs")
    commands.add_parser("replicas", help="replicas and their shards")

    models = commands.add_parser("models", help="the catalog: list, add, remove, scale")
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
    remove = actions.add_parser("remove", help="remove a model added at run time")
    remove.add_argument("name")
    scale = actions.add_parser("scale", help="set min/max replicas")
    scale.add_argument("name")
    scale.add_argument("--min", type=int)
    scale.add_argument("--max", type=int)

    placement = commands.add_parser(
        "placement", help="where a model would go, or why not"
    )
    placement.add_argument("model")
    drain = commands.add_parser("drain", help="drain a node or a replica")
    drain.add_argument("kind", choices=("node", "replica"))
    drain.add_argument("id")
    undrain = commands.add_parser("undrain", help="let placements use a node again")
    undrain.add_argument("kind", choices=("node",))
    undrain.add_argument("id")

    keys = commands.add_parser("keys", help="API keys: list, create, revoke")
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
    create.add_argument("--admin", action="store_true", help="may use the admin API")
    revoke = key_actions.add_parser("revoke", help="revoke a key by name or prefix")
    revoke.add_argument("name")

    usage = commands.add_parser("usage", help="usage by key or model")
    usage.add_argument("--by", choices=("key", "model"), default="key")
    usage.add_argument(
        "--since", default="24h", help="24h, 30m, an ISO time or POSIX seconds"
    )
    usage.add_argument("--until")

    weights = commands.add_parser("weights", help="model files on the nodes")
    weights.add_argument(
        "--collect", action="store_true", help="delete those nothing uses"
    )
    weights.add_argument(
        "--dry-run", action="store_true", help="with --collect: only list"
    )
    weights.add_argument(
        "--remove", nargs="+", metavar="NODE PATH", help="delete these paths on NODE"
    )
    return top


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        run(args, sys.stdout)
    except CtlError as e:
        sys.stdout.flush()
        sys.stderr.write(f"llmgw ctl: {e}\n")
        return 1
    return 0
