"""
The client API's second listener, on loopback, for the batches' runner
alone (L{llmgw.batches.runner}): each batch line goes through the same
router resource as a client's request, so that it takes the production
path (its key's models, limits and budget, the translations of the
Responses and Messages APIs, the waits, usage), as the key that made its
batch.

The runner proves itself with a secret made at random for each server
process (L{RUNNER_HEADER}); a request without it is refused here with a
403 before the router sees it.  The headers that name the line and its key
(L{BATCH_HEADER}, L{LINE_HEADER}, L{KEY_HEADER}) are read on this listener
only: the client listener's requests (L{llmgw.router.edge.site.LimitedRequest})
never look at them, so that no client can run as another key.
"""

from __future__ import annotations

import hmac
import re

from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import IResource
from twisted.web.server import Site

from llmgw.router.edge.connections import EdgeSite
from llmgw.router.edge.site import JSON, BatchLineId, LimitedRequest, RequestIds
from llmgw.router.errors import APIError
from llmgw.router.settings import RouterConfig

RUNNER_HEADER = b"x-llmgw-runner"
"""
The runner's secret, as URL-safe text.
"""

BATCH_HEADER = b"x-llmgw-batch"
"""
The batch's id (C{batch_...}, an Anthropic batch's C{msgbatch_...}):
letters, digits, C{_} or C{-}.
"""

LINE_HEADER = b"x-llmgw-batch-line"
"""
The line's number in the batch's input file, from 1.
"""

KEY_HEADER = b"x-llmgw-batch-key"
"""
The id of the key that made the batch; empty for a batch without a key.
"""

_BATCH_ID = re.compile(rb"^[A-Za-z0-9_-]{1,120}$")


def batch_line(
    batch: bytes | None, line: bytes | None, key: bytes | None
) -> BatchLineId:
    """
    @return: the line the runner's headers name.
    @raise ValueError: one is missing or malformed.
    """
    if batch is None or not _BATCH_ID.match(batch):
        raise ValueError(f"{BATCH_HEADER.decode()}: expected a batch id")
    if line is None or not line.isdigit() or int(line) < 1:
        raise ValueError(f"{LINE_HEADER.decode()}: expected a line number")
    if key is None or not (key == b"" or key.isdigit()):
        raise ValueError(f"{KEY_HEADER.decode()}: expected a key id or nothing")
    return BatchLineId(batch.decode("ascii"), int(line), int(key) if key else None)


class RunnerRequest(LimitedRequest):
    """
    A request on the runner's listener: refused (403) without the runner's
    secret, refused (400) when it does not name a line; else it is that
    line, its llmgw request id the line's own (L{BatchLineId.request_id}).

    @cvar secret: the runner's secret.
    """

    secret = b""

    def process(self) -> None:
        given = self.getHeader(RUNNER_HEADER)
        if given is None or not hmac.compare_digest(given, self.secret):
            self._refuse(
                APIError(
                    403,
                    "This listener serves the gateway's batch runner alone.",
                    "permission_error",
                )
            )
            return
        try:
            line = batch_line(
                self.getHeader(BATCH_HEADER),
                self.getHeader(LINE_HEADER),
                self.getHeader(KEY_HEADER),
            )
        except ValueError as e:
            self._refuse(APIError(400, str(e), "invalid_request_error"))
            return
        self.batch_line = line
        self.ids = RequestIds(line.request_id, None, line.batch_id)
        super().process()

    def _refuse(self, error: APIError) -> None:
        self.setResponseCode(error.status)
        self.setHeader(b"content-type", JSON)  # type: ignore[no-untyped-call]
        self.write(error.body())
        self.finish()  # type: ignore[no-untyped-call]


def runner_site(
    resource: IResource,
    settings: RouterConfig,
    reactor: IReactorTime,
    secret: bytes,
) -> Site:
    """
    @param resource: the client API's router resource (the one the client
        listener serves, without the dashboard's mount).
    @param settings: the router's settings, as the client listener's.
    @param secret: the runner's secret for this process.
    @return: a site whose requests are L{RunnerRequest}s.
    """
    proof = secret

    class _Request(RunnerRequest):
        max_body_size = settings.max_body_size
        clock = reactor
        secret = proof

    return EdgeSite(
        resource,
        settings,
        reactor,
        requestFactory=_Request,
        parsePOSTFormSubmission=False,
    )


def runner_headers(secret: bytes, line: BatchLineId) -> dict[bytes, bytes]:
    """
    @return: the headers the runner sends with C{line}.
    """
    return {
        RUNNER_HEADER: secret,
        BATCH_HEADER: line.batch_id.encode("ascii"),
        LINE_HEADER: str(line.line_no).encode("ascii"),
        KEY_HEADER: b"" if line.key_id is None else str(line.key_id).encode("ascii"),
        b"content-type": JSON,
    }
