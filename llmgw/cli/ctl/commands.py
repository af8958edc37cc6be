"""
C{llmgw ctl}'s commands, one function each, and L{COMMANDS}, the table
from a command's name to its function.  Each calls the admin API and
returns its JSON (printed with C{--json}) and the text printed otherwise.
"""

from __future__ import annotations

import argparse
import time
import tomllib
import urllib.parse
from collections.abc import Callable
from typing import IO, Any

from llmgw.cli.ctl.client import Client, CtlError, quote
from llmgw.cli.ctl.show import cell, size, table, when

Command = Callable[[Client, argparse.Namespace, IO[str]], tuple[Any, str]]
"""
A command: (the admin API, the parsed arguments, the output) -> (the API's
JSON, the text for a person).  Raises L{CtlError} to fail with one line.
"""


def status(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{status}: each field of the status on a line, counts by state.
    """
    result = client.call("GET", "/api/v1/status")
    lines = []
    for name, value in result.items():
        if isinstance(value, dict):
            shown = ", ".join(f"{n} {c}" for n, c in value.items()) or "-"
        else:
            shown = cell(value)
        lines.append(f"{name}: {shown}\n")
    return result, "".join(lines)


def nodes(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{nodes}: a table of the nodes, their state, GPUs and last report.
    """
    result = client.call("GET", "/api/v1/nodes")
    rows = [
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
    ]
    header = ("NODE", "STATE", "CONNECTED", "ADDRESS", "GPUS", "GPU TYPES", "LAST SEEN")
    return result, table(rows, header)


def replicas(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{replicas}: a table of the replicas, one row per shard.
    """
    result = client.call("GET", "/api/v1/replicas")
    rows = [
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
        for r in result["replicas"]
        for s in r["shards"]
    ]
    header = (
        "REPLICA",
        "MODEL",
        "PROFILE",
        "STATE",
        "NODE",
        "GPU IDS",
        "PORT",
        "PID",
        "LAST ERROR",
    )
    return result, table(rows, header)


def models_list(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{models} (C{models list}): a table of the catalog.
    """
    result = client.call("GET", "/api/v1/models")
    rows = [
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
    ]
    header = (
        "MODEL",
        "ALIASES",
        "READY",
        "DESIRED",
        "MIN-MAX",
        "PROFILES",
        "FROM",
        "LAST ERROR",
    )
    return result, table(rows, header)


def models_add(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{models add}: a model from the flags or a TOML file, kept across restarts.
    """
    result = client.call("POST", "/api/v1/models", _model_from_flags(args))
    return result, f"added model {result['name']} (desired {result['desired']})\n"


def models_remove(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{models remove}: a model added at run time; its replicas drain.
    """
    result = client.call("DELETE", "/api/v1/models/" + quote(args.name))
    return result, f"removed model {args.name}: its replicas drain and stop\n"


def models_scale(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{models scale}: a model's min and max replicas.
    """
    body = {}
    if args.min is not None:
        body["min_replicas"] = args.min
    if args.max is not None:
        body["max_replicas"] = args.max
    if not body:
        raise CtlError("models scale: give --min N and/or --max N")
    result = client.call("POST", f"/api/v1/models/{quote(args.name)}/scale", body)
    text = (
        f"model {result['name']}: min {result['min_replicas']},"
        f" max {result['max_replicas']}, desired {result['desired']}\n"
    )
    return result, text


def _model_from_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise CtlError(f"cannot read {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise CtlError(f"{path!r} is not valid TOML: {e}") from None
    models = data.get("models")
    if isinstance(models, list) and len(models) == 1:
        found = models[0]
    elif "models" not in data:
        found = data
    else:
        raise CtlError(f"{path!r}: expected one model (one [[models]] table)")
    return dict(found)


def _model_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """
    @return: the model C{models add} sends: the one table of C{--file}, or
        one built from the flags.
    @raise CtlError: neither a file nor NAME, --engine and --source.
    """
    if args.file:
        return _model_from_file(args.file)
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


def placement(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{placement}: where a model would go, or each node's reason why not.
    """
    result = client.call("GET", "/api/v1/placement/" + quote(args.model))
    if result["fits"]:
        where = ", ".join(
            f"{s['node']} GPU ids {cell(s['gpus'])} port {s['port']}"
            for s in result["shards"]
        )
        text = f"{result['model']}: fits, profile {result['profile']}: {where}\n"
        return result, text
    reasons = "".join(f"  {line}\n" for line in result["reasons"])
    return result, f"{result['model']}: fits nowhere\n" + reasons


def drain(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{drain node|replica [--force]}: a node's replicas or one replica
    drained, each replaced first; a refusal says that C{--force} drains
    anyway.
    """
    kind = "nodes" if args.kind == "node" else "replicas"
    body = {"force": True} if args.force else None
    try:
        result = client.call("POST", f"/api/v1/{kind}/{quote(args.id)}/drain", body)
    except CtlError as e:
        if "(HTTP 409)" in str(e) and not args.force:
            raise CtlError(f"{e}; --force drains anyway") from None
        raise
    if args.kind == "node":
        moving = cell(result["draining_replicas"])
        text = f"draining node {args.id}: replicas {moving}\n"
        if result.get("replaced_first"):
            first = cell(result["replaced_first"])
            text += f"each drains once its replacement is ready: {first}\n"
        return result, text
    if result.get("replaced_first"):
        return result, (f"draining replica {args.id} once its replacement is ready\n")
    return result, f"draining replica {args.id}\n"


def stop_engines(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{stop-engines NODE|--all}: every engine of a node, or of the fleet,
    stopped on purpose, no drain kept.
    """
    where = "" if args.all else f"/{quote(args.node)}"
    result = client.call("POST", f"/api/v1/nodes{where}/stop-engines")
    return result, (
        f"stopping the engines of {cell(result['nodes'])}: replicas"
        f" {cell(result['stopping_replicas'])}; nothing is placed there until"
        " `llmgw ctl start-engines` or the server's next start\n"
    )


def start_engines(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{start-engines NODE|--all}: placements use the nodes again.
    """
    where = "" if args.all else f"/{quote(args.node)}"
    result = client.call("POST", f"/api/v1/nodes{where}/start-engines")
    return result, f"placing engines on {cell(result['nodes'])} again\n"


def undrain(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{undrain node}: a node takes placements again.
    """
    result = client.call("POST", f"/api/v1/nodes/{quote(args.id)}/undrain")
    return result, f"node {args.id} takes placements again\n"


def keys_create(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{keys create}: a new key, printed once.
    """
    fields: dict[str, Any] = {"name": args.name, "admin": args.admin}
    if args.models is not None:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        if not models:
            raise CtlError("keys create: --models is empty (leave it out for all)")
        fields["models"] = models
    for field in ("rpm", "tpm", "budget_tokens"):
        if getattr(args, field) is not None:
            fields[field] = getattr(args, field)
    result = client.call("POST", "/api/v1/keys", fields)
    text = (
        f"{result['key']}\nkey {result['name']} created; it is shown only this once.\n"
    )
    return result, text


def keys_revoke(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{keys revoke}: a key revoked, by name or prefix.
    """
    result = client.call("POST", f"/api/v1/keys/{quote(args.name)}/revoke")
    return result, f"revoked key {result['name']} ({result['prefix']}...)\n"


def keys_list(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{keys} (C{keys list}): a table of the keys, their limits and use.
    """
    result = client.call("GET", "/api/v1/keys")
    rows = [
        (
            k["name"],
            k["prefix"] + "...",
            k["models"] or "all",
            k["rpm"],
            k["tpm"],
            k["budget_tokens"],
            k["admin"],
            when(k["created"]),
            when(k["last_used"]),
            k["tokens_used"],
            when(k["revoked"]),
        )
        for k in result["keys"]
    ]
    header = (
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
    )
    return result, table(rows, header)


def usage(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{usage}: a table of usage by key or model over a period.
    """
    query = urllib.parse.urlencode(
        {
            "by": args.by,
            "since": args.since,
            **({"until": args.until} if args.until else {}),
        }
    )
    result = client.call("GET", "/api/v1/usage?" + query)
    rows = [
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
    ]
    header = (
        args.by.upper(),
        "REQUESTS",
        "ERRORS",
        "PROMPT TOKENS",
        "COMPLETION TOKENS",
        "MEAN LATENCY S",
        "MEAN TTFT S",
    )
    return result, table(rows, header)


def weights(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{weights}: the model files on the nodes; with C{--collect} or C{--remove}, deleted.
    """
    if args.dry_run and not args.collect:
        raise CtlError("weights: --dry-run goes with --collect")
    if args.remove:
        return _weights_remove(client, args.remove)
    if args.collect:
        return _weights_collect(client, args.dry_run, out)
    return _weights_list(client)


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


COMMANDS: dict[str, Command] = {
    "status": status,
    "nodes": nodes,
    "replicas": replicas,
    "models list": models_list,
    "models add": models_add,
    "models remove": models_remove,
    "models scale": models_scale,
    "placement": placement,
    "drain": drain,
    "undrain": undrain,
    "stop-engines": stop_engines,
    "start-engines": start_engines,
    "keys list": keys_list,
    "keys create": keys_create,
    "keys revoke": keys_revoke,
    "usage": usage,
    "weights": weights,
}
"""
A command's name, with its action for C{models} and C{keys}, to its
function.
"""


def command_name(args: argparse.Namespace) -> str:
    """
    @return: the key of L{COMMANDS} for C{args}: C{models} and C{keys}
        without an action are their C{list}.
    """
    if hasattr(args, "action"):
        return f"{args.command} {args.action or 'list'}"
    return str(args.command)
