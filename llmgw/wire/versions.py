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
does not send reads as its default.
"""

from __future__ import annotations

import re

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
