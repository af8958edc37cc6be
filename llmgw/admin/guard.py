"""
Who may use the admin listener: a loopback peer without a key (as the
operator on the server's own machine, or through an SSH tunnel), anyone
else with an admin key; and what a browser must not make a loopback peer
do for another site (cross-site writes, DNS-rebound C{Host}s).
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from twisted.web.iweb import IRequest
from twisted.web.resource import Resource

from llmgw.admin.http import json_answer
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.errors import APIError


def is_loopback(host: str, otherwise: bool) -> bool:
    """
    @param host: an address as Twisted gives it.
    @param otherwise: the answer when C{host} is not an IP address (a UNIX
        socket's path, or nothing).
    @return: whether C{host} is a loopback address.
    """
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return otherwise


_SAFE_METHODS = (b"GET", b"HEAD", b"OPTIONS")


def _local_host(host: bytes | None) -> bool:
    """
    @param host: a request's C{Host}, or L{None}.
    @return: whether it names this machine without DNS: an IP address,
        C{localhost} or a C{.localhost} name (RFC 6761), or none at all.
    """
    if host is None:
        return True
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        name = text[1 : text.find("]")] if "]" in text else text
    elif text.count(":") == 1:
        name = text.split(":", 1)[0]
    else:
        name = text
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def browser_refusal(request: IRequest) -> str | None:
    """
    Why a request that needs no key (a loopback peer) is refused, if it is
    a browser's on behalf of another site.  Any page a local browser
    opens (or one through an SSH tunnel to this port) can send it a form
    POST, which needs no preflight: without this, such a page could
    create an admin key, revoke keys, add a model with engine arguments of
    its choosing or drain nodes.

      - C{Host} must name this machine without DNS: a name of the
        attacker's that resolves to 127.0.0.1 (DNS rebinding) makes its
        page same-origin with this listener, free to read the answers;
      - a POST or DELETE from a page of another origin (C{Origin} not this
        C{Host}, or C{Sec-Fetch-Site} other than C{same-origin} or
        C{none}) is refused.  C{llmgw ctl} and curl send neither header.

    @return: the message of a 403, or L{None} to let it through.
    """
    host = request.getHeader(b"host")
    if not _local_host(host):
        return (
            "requests without an admin key must name this machine in Host"
            " (127.0.0.1, [::1] or localhost)"
        )
    if request.method in _SAFE_METHODS:
        return None
    site = request.getHeader(b"sec-fetch-site")
    origin = request.getHeader(b"origin")
    if (site is not None and site.lower() not in (b"same-origin", b"none")) or (
        origin is not None
        and origin.partition(b"://")[2].lower() != (host or b"").lower()
    ):
        return "a page of another site may not change anything here"
    return None


class AdminGuard(Resource):
    """
    The admin API behind an admin key, while C{enabled}: for an admin
    listener that is not on loopback.  Requests from this machine (a
    loopback peer) need none, so the first admin key can be made there;
    C{/metrics} and C{/healthz} stay open.  A request let through without
    a key is refused (403) when a browser sends it for another site
    (L{browser_refusal}).

    @param inner: the admin app's resource.
    @param keys: where admin keys are found.
    @param internal: the bearer token of the server's own router workers
        (C{--router-workers}), which hold no admin key; L{None} without.
    @ivar enabled: whether keys are asked: closed until the listener's
        address is known (L{bound}).
    """

    isLeaf = True

    def __init__(
        self, inner: Resource, keys: KeyRing, internal: bytes | None = None
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._inner = inner
        self._keys = keys
        self.enabled = True
        self.internal = internal

    def bound(self, host: str) -> bool:
        """
        The admin listener is bound to C{host}: keys are asked unless it is
        a loopback address.  A UNIX socket (no IP address) is reached
        through the file system's permissions: no key either.

        @param host: the listener's C{getHost()} host.
        @return: whether keys are asked.
        """
        self.enabled = not is_loopback(host, True)
        return self.enabled

    def render(self, request: IRequest) -> Any:
        peer = getattr(request.getClientAddress(), "host", "")
        # Decided on the segments routing uses (percent-decoded: /%61pi/
        # is /api/), and closed unless plainly open.
        segments = getattr(request, "postpath", None) or []
        open_path = segments in ([b"metrics"], [b"healthz"])
        header = request.getHeader(b"authorization") or b""
        internal = self.internal is not None and hmac.compare_digest(
            header, b"Bearer " + self.internal
        )
        if (
            self.enabled
            and not open_path
            and not internal
            and not is_loopback(peer, False)
        ):
            try:
                key = self._keys.authenticate(
                    request.getHeader(b"authorization") or b""
                )
            except APIError as error:
                return json_answer(
                    request,
                    {"error": {"message": error.message, "code": "unauthorized"}},
                    401,
                )
            if key is None or not key.admin:
                return json_answer(
                    request,
                    {
                        "error": {
                            "message": "an admin key is needed",
                            "code": "unauthorized",
                        }
                    },
                    401,
                )
        elif not open_path:
            refusal = browser_refusal(request)
            if refusal is not None:
                return json_answer(
                    request, {"error": {"message": refusal, "code": "forbidden"}}, 403
                )
        return self._inner.render(request)
