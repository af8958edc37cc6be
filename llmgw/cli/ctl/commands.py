"""
C{llmgw ctl}'s commands, one function each, and L{COMMANDS}, the table
from a command's name to its function.  Each calls the admin API and
returns its JSON (printed with C{--json}) and the text printed otherwise.
The keys and usage commands are in L{llmgw.cli.ctl.keys}, C{weights} in
L{llmgw.cli.ctl.weights}, C{models pin} and C{unpin} in
L{llmgw.cli.ctl.swaps}, C{batches} in L{llmgw.cli.ctl.batches}.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Callable
from typing import IO, Any

from llmgw.cli.ctl.batches import batches_cancel, batches_list, batches_show
from llmgw.cli.ctl.client import Client, CtlError, quote
from llmgw.cli.ctl.keys import keys_create, keys_list, keys_revoke, keys_update, usage
from llmgw.cli.ctl.show import cell, size, table
from llmgw.cli.ctl.swaps import models_pin, models_unpin, sleep, state_words, wake
from llmgw.cli.ctl.weights import weights

Command = Callable[[Client, argparse.Namespace, IO[str]], tuple[Any, str]]
"""
A command: (the admin API, the parsed arguments, the output) -> (the API's
JSON, the text for a person).  Raises L{CtlError} to fail with one line.
"""


def status(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{status}: each field of the status on a line, counts by state; the
    protocol version the server speaks and those it serves; what holds
    placements back, if anything, in words.
    """
    result = client.call("GET", "/api/v1/status")
    lines = []
    for name, value in result.items():
        if name == "placement":
            lines.append(f"placement: {_placement_words(value)}\n")
            continue
        if name == "protocol" and isinstance(value, dict):
            oldest, newest = value["serves"]
            lines.append(
                f"protocol: {value['speaks']} (serves agents and routers of"
                f" {oldest} to {newest})\n"
            )
            continue
        if isinstance(value, dict):
            shown = ", ".join(f"{n} {c}" for n, c in value.items()) or "-"
        else:
            shown = cell(value)
        lines.append(f"{name}: {shown}\n")
    return result, "".join(lines)


def _placement_words(placement: dict[str, Any] | None) -> str:
    if placement is None:
        return "- (no control plane)"
    if placement.get("waiting_for") == "startup_grace":
        return (
            f"waiting for the start-up grace: {placement['seconds_left']:g} s left"
            f" of [control] startup_grace = {placement['startup_grace']:g} s;"
            " nothing is placed or scaled down until then, while agents"
            " reconnect and their engines are adopted"
        )
    return "active"


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f}"


def _memory(node: dict[str, Any], field: str) -> str:
    return _gib(sum(g.get(field) or 0 for g in node["gpus"]))


def nodes(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{nodes}: a table of the nodes: state, GPUs (how many, how many free:
    no shard on them and no problem), their memory in GiB (allocated to
    shards, as their profiles ask; used, as the agent reports; used by
    processes llmgw does not manage, which placement may not use; total)
    and the last report.  C{nodes NODE}: that node in full (L{node_detail}).
    """
    result = client.call("GET", "/api/v1/nodes")
    if args.node is not None:
        return node_detail(result, args.node)
    rows = [
        (
            n["id"],
            n["state"] + (" draining" if n.get("draining") else ""),
            n["connected"],
            n["address"],
            len(n["gpus"]),
            n.get("free_gpus"),
            ",".join(sorted({g["name"] for g in n["gpus"]})),
            _memory(n, "memory_allocated_mib"),
            _memory(n, "memory_used_mib"),
            _memory(n, "foreign_used_mib"),
            _memory(n, "memory_total_mib"),
            n["last_seen"][:19],
        )
        for n in result["nodes"]
    ]
    header = (
        "NODE",
        "STATE",
        "CONNECTED",
        "ADDRESS",
        "GPUS",
        "FREE",
        "GPU TYPES",
        "ALLOC GiB",
        "USED GiB",
        "OTHERS GiB",
        "TOTAL GiB",
        "LAST SEEN",
    )
    return result, table(rows, header)


def _replicas_on_gpus(node: dict[str, Any]) -> dict[int, list[str]]:
    """
    @return: GPU index to the replicas on it, each with its allocation in
        GiB where it has one (several may share one GPU).
    """
    on_gpu: dict[int, list[str]] = {}
    for shard in node.get("shards") or ():
        held = shard.get("gpu_memory_gb")
        name = str(shard.get("replica") or shard["id"])
        for index in shard["gpus"]:
            on_gpu.setdefault(index, []).append(
                name if held is None else f"{name} ({held:g} GiB)"
            )
    return on_gpu


def node_detail(listed: dict[str, Any], node_id: str) -> tuple[Any, str]:
    """
    C{nodes NODE}: one node's fields, its GPUs (memory in GiB, allocated,
    used, total; the shards on each) and its shards.

    @raise CtlError: no such node (the known ones named).
    """
    found = [n for n in listed["nodes"] if n["id"] == node_id]
    if not found:
        known = ", ".join(n["id"] for n in listed["nodes"]) or "none"
        raise CtlError(f"no node {node_id!r} (nodes: {known})")
    (node,) = found
    simulated = any(g.get("simulated") for g in node["gpus"])
    lines = [
        f"node: {node['id']}",
        "state: " + node["state"] + (" draining" if node.get("draining") else ""),
        f"connected: {cell(node['connected'])}",
        f"address: {cell(node['address'])}",
        f"agent version: {cell(node.get('agent_version'))}",
        f"labels: {cell([f'{k}={v}' for k, v in (node.get('labels') or {}).items()])}",
        f"cpus: {cell(node.get('cpus'))}",
        f"memory: {size(node['memory_bytes']) if node.get('memory_bytes') else '-'}",
        f"gpus: {len(node['gpus'])}, {node.get('free_gpus')} free"
        + (" (simulated)" if simulated else ""),
        f"last seen: {node['last_seen'][:19]}",
    ]
    on_gpu = _replicas_on_gpus(node)
    gpus = [
        (
            g["index"],
            g["name"],
            _gib(g.get("memory_allocated_mib") or 0),
            _gib(g["memory_used_mib"]),
            _gib(g.get("foreign_used_mib") or 0),
            _gib(g["memory_total_mib"]),
            on_gpu.get(g["index"], []),
            g["problems"],
        )
        for g in node["gpus"]
    ]
    gpu_header = (
        "GPU",
        "NAME",
        "ALLOC GiB",
        "USED GiB",
        "OTHERS GiB",
        "TOTAL GiB",
        "REPLICAS",
    )
    others = [
        f"GPU {g['index']}: pid {p['pid']} ({p['name'] or '?'}),"
        f" {_gib(p['used_mib'])} GiB, not llmgw's: placement may not use it"
        for g in node["gpus"]
        for p in g.get("processes") or ()
        if not p["managed"]
    ]
    shards = [
        (s.get("replica"), s.get("model"), s["state"], s["gpus"], s["port"], s["pid"])
        for s in node.get("shards") or ()
    ]
    text = (
        "\n".join(lines)
        + "\n\n"
        + table(gpus, (*gpu_header, "PROBLEMS"))
        + "".join(line + "\n" for line in others)
        + "\n"
        + (
            table(shards, ("REPLICA", "MODEL", "STATE", "GPU IDS", "PORT", "PID"))
            if shards
            else "no shards\n"
        )
    )
    return node, text


def replicas(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{replicas}: a table of the replicas, one row per shard; with
    C{--phases}, one row per phase of each start.
    """
    result = client.call("GET", "/api/v1/replicas")
    if getattr(args, "phases", False):
        return result, phases_table(result["replicas"])
    rows = [
        (
            r["id"],
            r["model"],
            r["profile"],
            state_words(r),
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


def phases_table(replicas: list[dict[str, Any]]) -> str:
    """
    @return: a table of each replica's start phases (seconds, and the
        share of its start time), a detail marked as inside the phases,
        then the start time itself.
    """
    rows: list[tuple[Any, ...]] = []
    for r in replicas:
        total = r.get("start_seconds")
        for p in r.get("phases", []):
            share = f"{100 * p['seconds'] / total:.0f}%" if total else ""
            name = f"  ({p['phase']})" if p["detail"] else p["phase"]
            rows.append((r["id"], r["model"], name, f"{p['seconds']:.2f}", share))
        if total is not None:
            rows.append((r["id"], r["model"], "start", f"{total:.2f}", "100%"))
    return table(rows, ("REPLICA", "MODEL", "PHASE", "SECONDS", "SHARE"))


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
            "pinned" if m.get("pinned") else "",
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
        "PINNED",
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
    if result.get("base"):
        return result, f"added adapter {result['name']} of model {result['base']}\n"
    text = f"added model {result['name']} (desired {result['desired']})\n"
    if result.get("unplaceable"):
        # Added all the same (a node may join): its requests get a 503 now.
        text += (
            f"warning: it can never be placed on this fleet: {result['unplaceable']}\n"
        )
    return result, text


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
    if not result.get("runtime", True):
        text += (
            f"model {result['name']} is declared in the config file: this lasts"
            " until the server's next start, which takes the file's"
            " min_replicas and max_replicas again; change the file to keep it\n"
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
    @raise CtlError: neither a file nor NAME, --engine and --source (or
        NAME, --base and --adapter for a LoRA adapter).
    """
    if args.file:
        return _model_from_file(args.file)
    if args.base is not None or args.adapter is not None:
        if not (args.name and args.base and args.adapter):
            raise CtlError(
                "models add: an adapter needs NAME --base BASE --adapter PATH"
            )
        adapter = {"name": args.name, "base": args.base, "adapter": args.adapter}
        if args.rank is not None:
            adapter["rank"] = args.rank
        if args.alias:
            adapter["aliases"] = args.alias
        return adapter
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
    if args.max_loras is not None:
        model["max_loras"] = args.max_loras
    return model


def placement(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{placement}: where a model would go, or each node's reason why not,
    and the last eviction made for it.
    """
    result = client.call("GET", "/api/v1/placement/" + quote(args.model))
    evicted = ""
    if result.get("eviction"):
        ago = result.get("eviction_seconds_ago")
        when = f" ({ago:g}s ago)" if isinstance(ago, (int, float)) else ""
        evicted = f"last eviction for it{when}: {result['eviction']}\n"
    if result["fits"]:
        where = ", ".join(
            f"{s['node']} GPU ids {cell(s['gpus'])} port {s['port']}"
            for s in result["shards"]
        )
        text = f"{result['model']}: fits, profile {result['profile']}: {where}\n"
        return result, text + evicted
    reasons = "".join(f"  {line}\n" for line in result["reasons"])
    return result, f"{result['model']}: fits nowhere\n" + reasons + evicted


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


COMMANDS: dict[str, Command] = {
    "status": status,
    "nodes": nodes,
    "replicas": replicas,
    "models list": models_list,
    "models add": models_add,
    "models remove": models_remove,
    "models scale": models_scale,
    "models pin": models_pin,
    "models unpin": models_unpin,
    "placement": placement,
    "drain": drain,
    "undrain": undrain,
    "sleep": sleep,
    "wake": wake,
    "stop-engines": stop_engines,
    "start-engines": start_engines,
    "keys list": keys_list,
    "keys create": keys_create,
    "keys update": keys_update,
    "keys revoke": keys_revoke,
    "usage": usage,
    "weights": weights,
    "batches list": batches_list,
    "batches show": batches_show,
    "batches cancel": batches_cancel,
}
"""
A command's name, with its action for C{models}, C{keys} and C{batches},
to its function.
"""


def command_name(args: argparse.Namespace) -> str:
    """
    @return: the key of L{COMMANDS} for C{args}: C{models}, C{keys} and
        C{batches} without an action are their C{list}.
    """
    if hasattr(args, "action"):
        return f"{args.command} {args.action or 'list'}"
    return str(args.command)
