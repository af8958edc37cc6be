"""
Typed views of test doubles whose libraries declare less than they do:
a bound C{list.append} as a log observer, L{treq.testing.StubTreq}'s
methods, L{twisted.web.test.requesthelper.DummyRequest} as an
L{IRequest}, a listening port's address as a TCP one.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from treq.response import _Response
from treq.testing import StubTreq
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort
from twisted.logger import ILogObserver, LogEvent
from twisted.web.iweb import IRequest, IResponse
from twisted.web.resource import IResource
from twisted.web.test.requesthelper import DummyRequest

Response = _Response
"""
What treq's requests fire with: an L{IResponse} with treq's helpers.
"""


def collect(events: list[LogEvent]) -> ILogObserver:
    """
    @return: an observer that appends each event to C{events}.  Twisted
        calls whatever callable it is given; to mypy-zope a bound
        C{list.append} provides no interface, hence the cast.
    """
    return cast(ILogObserver, events.append)


class TypedStubTreq(Protocol):
    """
    What llmgw's tests call on a L{StubTreq}: treq's functions of the same
    names (which it copies onto each instance at run time, so that mypy
    sees none of them), answered in memory by the resource it wraps.
    """

    def request(self, method: str, url: str, **kwargs: Any) -> Deferred[Response]: ...

    def get(self, url: str, **kwargs: Any) -> Deferred[Response]: ...

    def post(self, url: str, data: Any = None, **kwargs: Any) -> Deferred[Response]: ...

    def content(self, response: IResponse) -> Deferred[bytes]: ...

    def json_content(self, response: IResponse, **kwargs: Any) -> Deferred[Any]: ...

    def text_content(self, response: IResponse, **kwargs: Any) -> Deferred[str]: ...

    def flush(self) -> None: ...


def stub_treq(resource: IResource) -> TypedStubTreq:
    """
    @return: a L{StubTreq} over C{resource}, seen through L{TypedStubTreq}.
    """
    return cast(TypedStubTreq, StubTreq(resource))


def as_request(request: DummyRequest) -> IRequest:
    """
    @return: C{request}, as the L{IRequest} the code under test takes.
        L{DummyRequest} has what those calls use but declares no
        interface.
    """
    return cast(IRequest, request)


def tcp_port(listening: IListeningPort) -> int:
    """
    @return: the TCP port C{listening} is bound to (its L{IAddress} is a
        TCP one: C{listenTCP}'s).
    """
    address = listening.getHost()
    assert isinstance(address, IPv4Address | IPv6Address), address
    return address.port
