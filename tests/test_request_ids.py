"""
L{llmgw.router.edge.site.RequestIds}: llmgw's own id of each request,
made for it alone, with the client's C{X-Request-ID} beside it; what the
answer's C{X-Request-ID} and the engine's are.
"""

from __future__ import annotations

from typing import cast

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.test.requesthelper import DummyRequest

from llmgw.router.edge.site import RequestIds, request_ids

UUID = b"6f1c2a9e-0d4b-4e2a-9a57-3c1f0e8b7d21"


def _request(given: bytes | None) -> IRequest:
    request = DummyRequest([b"v1", b"chat", b"completions"])
    if given is not None:
        request.requestHeaders.setRawHeaders(b"x-request-id", [given])
    return cast(IRequest, request)


class RequestIdsTests(SynchronousTestCase):
    def test_own_id_per_request(self) -> None:
        """
        Two requests with one client id get two ids of llmgw's own (32 hex
        digits), the client's kept beside each; the answer carries the
        client's; the engine gets llmgw's, the client's not being a UUID.
        """
        first, second = (request_ids(_request(b"retry-1")) for _ in range(2))
        self.assertNotEqual(first.own, second.own)
        for ids in (first, second):
            self.assertRegex(ids.own.decode(), r"^[0-9a-f]{32}$")
            self.assertEqual((ids.client, ids.header), (b"retry-1", b"retry-1"))
            self.assertEqual(ids.upstream, ids.own)

    def test_without_client_id(self) -> None:
        """
        No id (or one not usable: a space, too long): the answer carries
        llmgw's own, and so does the engine's request.
        """
        for given in (None, b"has space", b"x" * 201):
            ids = request_ids(_request(given))
            self.assertIsNone(ids.client)
            self.assertEqual((ids.header, ids.upstream), (ids.own, ids.own))

    def test_client_uuid_to_engine(self) -> None:
        """
        A client id that is a UUID is the engine's too.
        """
        ids = request_ids(_request(UUID))
        self.assertEqual((ids.header, ids.upstream), (UUID, UUID))

    def test_set_ids_kept(self) -> None:
        """
        The ids the site set when it processed the request are those read
        later (the router's record and its log line).
        """
        request = _request(b"retry-1")
        made = RequestIds(b"0" * 32, b"retry-1")
        request.ids = made  # type: ignore[attr-defined]  # LimitedRequest's
        self.assertIs(request_ids(request), made)
