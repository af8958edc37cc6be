"""
C{llmgw ctl}'s commands of keys and usage: C{keys list}, C{keys create},
C{keys update}, C{keys revoke} and C{usage}, one function each (their
entries of L{llmgw.cli.ctl.commands.COMMANDS}).
"""

from __future__ import annotations

import argparse
import datetime
import urllib.parse
from typing import IO, Any

from llmgw.cli.ctl.client import Client, CtlError, quote
from llmgw.cli.ctl.show import cell, money, table, when


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
    for field in ("rpm", "tpm", "budget_tokens", "budget_cost"):
        if getattr(args, field) is not None:
            fields[field] = getattr(args, field)
    if args.expires is not None:
        fields["expires"] = _expires(args.expires)
    fields.update(_order(args))
    result = client.call("POST", "/api/v1/keys", fields)
    text = (
        f"{result['key']}\nkey {result['name']} created; it is shown only this once.\n"
    )
    if result.get("was_open"):
        text += (
            "the client API took requests without a key until now: from now on"
            " every request needs one (Authorization: Bearer KEY), and a client"
            " without one gets 401\n"
        )
    return result, text


def _expires(value: str) -> str | float:
    """
    @return: C{--expires} as the API takes it: POSIX seconds as a number,
        a duration or an ISO time as given.
    """
    try:
        return float(value)
    except ValueError:
        return value


def keys_update(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{keys update NAME}: a key's models, limits or expiry changed; what is
    not given stays.
    """
    fields: dict[str, Any] = {}
    if args.models is not None:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        if not models:
            raise CtlError("keys update: --models is empty (--models all for all)")
        fields["models"] = None if models == ["all"] else models
    # Absent from args unless given (a given "none" is None).
    for field in ("rpm", "tpm", "budget_tokens", "budget_cost"):
        if hasattr(args, field):
            fields[field] = getattr(args, field)
    if args.expires is not None:
        never = args.expires.lower() == "never"
        fields["expires"] = None if never else _expires(args.expires)
    fields.update(_order(args))
    if not fields:
        raise CtlError(
            "keys update: give --models, --rpm, --tpm, --budget-tokens,"
            " --budget-cost, --expires, --priority or --weight"
        )
    k = client.call("PATCH", f"/api/v1/keys/{quote(args.name)}", fields)
    shown = cell(k["models"]) if k["models"] else "all"
    text = (
        f"key {k['name']} ({k['prefix']}...): models {shown},"
        f" rpm {cell(k['rpm'])}, tpm {cell(k['tpm'])},"
        f" budget {cell(k['budget_tokens'])},"
        f" budget cost {cell(k.get('budget_cost'))},"
        f" expires {when(k['expires']) or 'never'},"
        f" priority {k.get('priority', 'standard')}, weight {k.get('weight', 1):g}\n"
    )
    return k, text


def _order(args: argparse.Namespace) -> dict[str, Any]:
    """
    @return: C{--priority} and C{--weight} as the API takes them, those
        given (the API checks them).
    """
    fields: dict[str, Any] = {}
    if getattr(args, "priority", None) is not None:
        text = args.priority.strip()
        fields["priority"] = int(text) if text.lstrip("-").isdigit() else text
    if getattr(args, "weight", None) is not None:
        fields["weight"] = args.weight
    return fields


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
            when(k.get("expires")),
            when(k["revoked"]),
            k.get("priority", "standard"),
            k.get("weight", 1),
            k.get("budget_cost"),
            money(k.get("cost_used")),
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
        "EXPIRES",
        "REVOKED",
        "PRIORITY",
        "WEIGHT",
        "BUDGET COST",
        "COST USED",
    )
    return result, table(rows, header)


def usage(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{usage}: a table of usage by key, model or UTC day over a period,
    with each group's GPU-seconds and cost, and the GPU time no request
    was given as its own C{(idle)} row (docs/cost.md).
    """
    query = urllib.parse.urlencode(
        {
            "by": args.by,
            "since": args.since,
            **({"until": args.until} if args.until else {}),
        }
    )
    result = client.call("GET", "/api/v1/usage?" + query)

    def name(group: dict[str, Any]) -> object:
        return _day(group["day"]) if args.by == "day" else group[args.by]

    rows: list[tuple[object, ...]] = [
        (
            name(g),
            g["requests"],
            g["errors"],
            g["prompt_tokens"],
            g["completion_tokens"],
            g.get("answered"),
            g["mean_latency"],
            g["mean_time_to_first_token"],
            g.get("gpu_seconds"),
            money(g.get("cost")),
        )
        for g in result["usage"]
    ]
    for idle in result.get("idle", []):
        label = f"(idle) {_day(idle['day'])}" if "day" in idle else "(idle)"
        rows.append(
            (label, None, None, None, None, None, None, None, idle["gpu_seconds"])
            + (money(idle["cost"]),)
        )
    header = (
        args.by.upper(),
        "REQUESTS",
        "ERRORS",
        "PROMPT TOKENS",
        "COMPLETION TOKENS",
        "ANSWERED",
        "MEAN LATENCY S",
        "MEAN TTFT S",
        "GPU S",
        "COST",
    )
    # Both means are over the answered requests (a first byte came).
    return result, table(rows, header)


def _day(seconds: float) -> str:
    """
    @return: the UTC day starting at C{seconds}, C{YYYY-MM-DD}.
    """
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d")
