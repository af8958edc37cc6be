"""
The control plane's admin API as a router of the tier reaches it: its
base URLs (a leader and its standbys), the admin key or token sent with
each request, and an HTTP client trusting the given CA for C{https}.
Requests go to the URL the follower (L{llmgw.tier.follow}) last found
leading.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from OpenSSL.crypto import Error as SSLError
from twisted.internet.defer import Deferred
from twisted.internet.ssl import Certificate, optionsForClientTLS
from twisted.web.client import Agent, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IPolicyForHTTPS, IResponse
from zope.interface import implementer

from llmgw.config_checks import ConfigError
from llmgw.reactors import IConnectingReactor
from llmgw.wire import versions


@implementer(IPolicyForHTTPS)
class _TrustCA:
    """
    TLS to the control plane, trusting only one CA's certificates.
    """

    def __init__(self, ca: Certificate) -> None:
        self._ca = ca

    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:
        return optionsForClientTLS(hostname.decode("ascii"), trustRoot=self._ca)


@dataclass
class AdminClient:
    """
    @ivar urls: the admin APIs' base URLs, C{http(s)://host:port}, no
        trailing slash: one per control plane (the leader and its
        standbys), at least one.
    @ivar current: the index in C{urls} requests go to.
    @ivar key: the admin key (or the server's token for its own workers),
        sent as C{Authorization: Bearer}; C{""} for none (loopback).
    @ivar agent: the HTTP client (a Twisted C{Agent} with its own pool).
    """

    urls: list[str]
    key: str = field(default="", repr=False)
    agent: Any = None
    current: int = 0

    @property
    def url(self) -> str:
        """
        The base URL requests go to now.
        """
        return self.urls[self.current]

    def advance(self, leader: str = "") -> str:
        """
        Go on to the next URL in turn, or to the first whose host is
        C{leader}'s (C{"HOST:PORT"}, as a standby names the leader's agent
        address) if another URL has that host and this one has not.

        @return: the URL requests go to now.
        """
        host = urlsplit("//" + leader).hostname if leader else None
        count = len(self.urls)
        order = [(self.current + step) % count for step in range(1, count + 1)]
        if host is not None and urlsplit(self.url).hostname != host:
            for index in order:
                if urlsplit(self.urls[index]).hostname == host:
                    self.current = index
                    return self.url
        self.current = order[0]
        return self.url

    @classmethod
    def make(
        cls,
        reactor: IConnectingReactor,
        urls: list[str],
        key: str = "",
        ca: str | None = None,
    ) -> AdminClient:
        """
        @param urls: the admin APIs' base URLs (C{--control}, repeatable or
            comma-separated), at least one.
        @param ca: a PEM file of the CA that signed the admin listeners'
            certificates, for C{https}; the system's trust otherwise.
        @raise ConfigError: no URL, a bad one, or an unreadable CA file.
        """
        if not urls:
            raise ConfigError("--control URL is required")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"--control: not an http(s) URL: {url!r}")
        pool = HTTPConnectionPool(reactor, persistent=True)
        if ca is not None:
            try:
                with open(ca, "rb") as f:
                    trust = Certificate.loadPEM(f.read())
            except (OSError, ValueError) as e:
                raise ConfigError(f"--control-ca: cannot read {ca!r}: {e}") from None
            except SSLError:
                raise ConfigError(
                    f"--control-ca: {ca!r} is not a PEM certificate"
                ) from None
            agent = Agent(reactor, contextFactory=_TrustCA(trust), pool=pool)
        else:
            agent = Agent(reactor, pool=pool)
        return cls([url.rstrip("/") for url in urls], key, agent)

    def request(
        self, method: bytes, path: str, body: object = None
    ) -> Deferred[IResponse]:
        """
        One request to the admin API; C{body} is sent as JSON, and the
        protocol version this router speaks in C{LLMGW-Protocol}
        (L{llmgw.wire.versions}).
        """
        headers = Headers(
            {
                b"accept": [b"application/json"],
                # The server serves routers one minor version apart at most.
                versions.HEADER.encode(): [versions.text().encode()],
            }
        )
        if self.key:
            headers.addRawHeader(b"authorization", b"Bearer " + self.key.encode())
        producer = None
        if body is not None:
            from io import BytesIO

            from twisted.web.client import FileBodyProducer

            headers.addRawHeader(b"content-type", b"application/json")
            producer = FileBodyProducer(BytesIO(json.dumps(body).encode("utf-8")))
        result: Deferred[IResponse] = self.agent.request(
            method, (self.url + path).encode("utf-8"), headers, producer
        )
        return result

    async def post(self, path: str, body: object) -> tuple[int, Any]:
        """
        @return: the answer's status and JSON body (L{None} if not JSON).
        """
        response = await self.request(b"POST", path, body)
        raw = await readBody(response)
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        return response.code, value
