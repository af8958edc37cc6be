"""
The protocol's version, and which versions mix.

Server, routers and agents each say the version of the protocol they
speak, C{MAJOR.MINOR}: agents in C{Register.protocol_version} and the
server in C{Welcome.protocol_version}; routers in the C{LLMGW-Protocol}
header of their requests to the admin API, which the server answers with
its own.  A server serves a peer of its own major version and at most one
minor version older or newer, and refuses the others saying why
(L{mismatch}).  So an upgrade goes one minor version at a time, in this
order: standby servers first, then the leader, then the routers, then
the agents.

A peer that says no version speaks C{1.0}, the protocol before versions
were said.  Within a major version, messages change only by fields added:
a field a peer does not know is skipped (protobuf's rule), and one it
does not send reads as its default.  The admin API's answers to routers
change the same way: the activate route's C{"refused": true}
(L{llmgw.admin.watch.refused_answer}) came within 1.1, and a router that
does not know it reads its 429 as any answer but 200, asking again, as it
did before; nothing is withheld, so it is no L{Feature}.

A feature a peer may not know says the version it came with (L{Feature},
L{FEATURES}); the server never hands a feature to a peer older than that
(L{supports}), whatever else it serves that peer: the watch names no LoRA
adapter to a router of 1.0 (L{llmgw.tier.watch}), which would send an
adapter's requests to its base engine unloaded (404), and no agent of 1.0 is
sent C{SleepShard} or C{WakeShard} (L{llmgw.control.agents}, which also
refuses to send them; L{llmgw.control.sleeping}, which stops such a node's
replicas instead of putting them to sleep), which it would leave unanswered.
A new feature adds its line to L{FEATURES} and a test that runs a peer of the
version before it (C{tests/test_versions.py}).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PROTOCOL = (1, 1)
"""
The version this build speaks: C{(major, minor)}.  The minor grows with
every release that adds fields or messages; the major when a change
cannot mix.
"""

UNSAID = (1, 0)
"""
The version of a peer that says none.
"""

HEADER = "LLMGW-Protocol"
"""
The HTTP header a router says its version in, and the server its own.
"""

UPGRADE_ORDER = "standby servers first, then the leader, routers, agents"

_VERSION = re.compile(r"^(\d{1,6})\.(\d{1,6})$")


def text(version: tuple[int, int] = PROTOCOL) -> str:
    """
    @return: C{version} as peers say it, C{"MAJOR.MINOR"}.
    """
    return f"{version[0]}.{version[1]}"


def served(ours: tuple[int, int] = PROTOCOL) -> tuple[str, str]:
    """
    @return: the oldest and newest versions a server speaking C{ours}
        serves (L{mismatch}'s rule), as peers say them: C{("1.0", "1.2")}.
    """
    return text((ours[0], max(ours[1] - 1, 0))), text((ours[0], ours[1] + 1))


def parse(said: str) -> tuple[int, int]:
    """
    @param said: a version as a peer said it; C{""} for none.
    @return: C{(major, minor)}; L{UNSAID} for C{""}.
    @raise ValueError: not C{MAJOR.MINOR}.
    """
    if not said:
        return UNSAID
    match = _VERSION.match(said)
    if match is None:
        raise ValueError(f"protocol version {said[:40]!r} is not MAJOR.MINOR")
    return int(match.group(1)), int(match.group(2))


def mismatch(said: str, peer: str, ours: tuple[int, int] = PROTOCOL) -> str:
    """
    @param said: the peer's version, as it said it (C{""}: none).
    @param peer: what the peer is, for the sentence (C{"agent"}, C{"router"}).
    @return: why a server speaking C{ours} does not serve that peer, or
        C{""} when it does (same major, minor at most one apart).
    """
    try:
        theirs = parse(said)
    except ValueError as e:
        return f"{e}: this server speaks {text(ours)}"
    if theirs[0] == ours[0] and abs(theirs[1] - ours[1]) <= 1:
        return ""
    newer = "newer" if theirs > ours else "older"
    return (
        f"the {peer} speaks protocol {text(theirs)}, {newer} than this server's"
        f" {text(ours)} by more than one minor version: upgrade one minor version"
        f" at a time, {UPGRADE_ORDER}"
    )


@dataclass(frozen=True)
class Feature:
    """
    What a peer must know to be handed something.

    @ivar name: the feature, as log lines and refusals name it.
    @ivar since: the first protocol version that has it, C{(major, minor)}.
    @ivar what: what the server withholds from an older peer, in words.
    @ivar peer: the peer it is withheld from, C{"router"} or C{"agent"}.
    """

    name: str
    since: tuple[int, int]
    what: str
    peer: str


ADAPTERS = Feature(
    "adapters",
    (1, 1),
    "LoRA adapters' names in the watch (routers load them)",
    "router",
)
"""
LoRA adapters as catalog models: a router loads an adapter on its base's
replica before sending its requests there (L{llmgw.router.routing.adapters}).
"""

SLEEP = Feature("sleep", (1, 1), "SleepShard and WakeShard", "agent")
"""
Engines put to sleep and woken on the server's command
(C{SleepShard}, C{WakeShard}; C{Register.sleep_memory_bytes}).
"""

FEATURES = (ADAPTERS, SLEEP)
"""
Every feature a peer of an older version lacks, oldest first.
"""

COMMANDS = {"sleep_shard": SLEEP, "wake_shard": SLEEP}
"""
The feature an agent needs to be sent each C{ControlMessage} kind; those
not named every agent served has.
"""


def supports(version: tuple[int, int], feature: Feature) -> bool:
    """
    @param version: a peer's version, C{(major, minor)} (one the server
        serves: L{mismatch} is C{""} for it).
    @return: whether that peer has C{feature}: its version is the
        feature's or newer.
    """
    return version >= feature.since


def peer_version(said: str) -> tuple[int, int]:
    """
    @param said: a peer's version as it said it (C{""}: none).
    @return: it as C{(major, minor)}; L{UNSAID} when it is not
        C{MAJOR.MINOR} (a peer saying that is refused by L{mismatch}
        first), so that nothing is handed on a guess.
    """
    try:
        return parse(said)
    except ValueError:
        return UNSAID


def lacks(version: tuple[int, int], feature: Feature, peer: str) -> str:
    """
    @return: why a C{peer} speaking C{version} is not handed C{feature},
        e.g. C{"the agent speaks protocol 1.0; sleep needs 1.1"}, or C{""}
        when it has it.
    """
    if supports(version, feature):
        return ""
    return (
        f"the {peer} speaks protocol {text(version)}; {feature.name} needs"
        f" {text(feature.since)} (upgrade it)"
    )
