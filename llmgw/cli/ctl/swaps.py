"""
C{llmgw ctl}'s commands for more models than GPUs: C{models pin NAME} and
C{models unpin NAME} (a pinned model is never evicted to make room for
another), C{sleep REPLICA} and C{wake REPLICA}, and the words for a
replica's state in C{ctl replicas}.
"""

from __future__ import annotations

import argparse
from typing import IO, Any

from llmgw.cli.ctl.client import Client, quote


def state_words(replica: dict[str, Any]) -> str:
    """
    @return: the replica's state, with how long it has slept or been
        waking (C{"sleeping 12s"}, C{"waking 1.5s"}), or C{"going to
        sleep"} while its requests in flight end.
    """
    state = str(replica["state"])
    if state == "sleeping" and replica.get("leaving"):
        # Told to sleep; its requests in flight end first.
        return "going to sleep"
    seconds = replica.get(f"{state}_seconds")
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
        return f"{state} {seconds:g}s"
    return state


def _pin(client: Client, name: str, pinned: bool) -> tuple[Any, str]:
    verb = "pin" if pinned else "unpin"
    result = client.call("POST", f"/api/v1/models/{quote(name)}/{verb}")
    what = (
        "pinned: never evicted to make room for another model"
        if result["pinned"]
        else "unpinned: it may be evicted to make room for another model"
    )
    return result, f"model {result['name']} {what} (until the server restarts)\n"


def models_pin(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{models pin NAME}: the model is never evicted.
    """
    return _pin(client, args.name, True)


def models_unpin(
    client: Client, args: argparse.Namespace, out: IO[str]
) -> tuple[Any, str]:
    """
    C{models unpin NAME}: the model may be evicted again.
    """
    return _pin(client, args.name, False)


def sleep(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{sleep REPLICA}: the replica sleeps once its last request ends.
    """
    result = client.call("POST", f"/api/v1/replicas/{quote(args.id)}/sleep")
    return result, (
        f"replica {result['id']} of {result['model']} is {state_words(result)}:"
        " it takes no new requests and sleeps once its last one ends\n"
    )


def wake(client: Client, args: argparse.Namespace, out: IO[str]) -> tuple[Any, str]:
    """
    C{wake REPLICA}: a sleeping replica is woken where it sleeps.
    """
    result = client.call("POST", f"/api/v1/replicas/{quote(args.id)}/wake")
    return result, (
        f"replica {result['id']} of {result['model']} is {state_words(result)}\n"
    )
