"""
Which API key a client request carries, in the headers each client family
sends it in: shared by every route that checks keys.
"""

from __future__ import annotations

from dataclasses import replace

from twisted.web.iweb import IRequest

from llmgw.router.api.prepare import Prepared
from llmgw.router.edge.site import BatchLineId
from llmgw.router.interfaces import BATCH_RANK, Auth, Key, Tenant
from llmgw.router.routing.fairness import ANONYMOUS


def request_key(auth: Auth | None, request: IRequest) -> Key | None:
    """
    The key comes in C{Authorization: Bearer sk-...} (OpenAI's clients,
    and Anthropic's with C{auth_token}), in C{api-key: sk-...} (Azure
    OpenAI's, which the OpenAI SDK's C{AzureOpenAI} sends) or in
    C{x-api-key: sk-...} (Anthropic's clients); when several come,
    C{Authorization} is the one checked, then C{api-key}.

    A batch line (L{batch_line}) runs as the key that made its batch, which
    the runner vouches for on its own listener: no secret is checked, but
    a key revoked or expired since is refused all the same.

    @param auth: the keys, or L{None} for an open gateway.
    @return: the request's API key, or L{None} when none is needed.
    @raise llmgw.router.errors.APIError: 401.
    """
    if auth is None:
        return None
    line = batch_line(request)
    if line is not None:
        return auth.vouched(line.key_id)
    header = request.getHeader(b"authorization")
    for name in (b"api-key", b"x-api-key"):
        api_key = request.getHeader(name) if header is None else None
        if api_key is not None and api_key.strip():
            header = b"Bearer " + api_key.strip()
    return auth.authenticate(header)


async def admit(auth: Auth | None, key: Key | None, prepared: Prepared) -> int:
    """
    Wait for C{key}'s limits to let C{prepared} in: its model asked for and
    the one it resolved to, and its tokens held while it runs
    (L{Prepared.reserve}).

    @return: the tokens held (0 without a key).
    @raise llmgw.router.errors.APIError: 403 or 429 (L{Auth.admit}).
    """
    if key is None:
        return 0
    assert auth is not None
    reserve = prepared.reserve
    admitted = auth.admit(key, (prepared.requested_model, prepared.model), reserve)
    if admitted is not None:
        await admitted
    return reserve


def batch_line(request: IRequest) -> BatchLineId | None:
    """
    @return: the batch line C{request} is, as the runner's listener
        (L{llmgw.router.edge.internal}) found it; L{None} for a client's
        request.
    """
    line = getattr(request, "batch_line", None)
    return line if isinstance(line, BatchLineId) else None


def tenant(request: IRequest, key: Key | None) -> Tenant:
    """
    @return: whom C{request} is for where requests wait: its key's tenant
        (or L{ANONYMOUS}), at L{BATCH_RANK} for a batch line, below every
        client's own request.
    """
    who = key.tenant if key is not None else ANONYMOUS
    if batch_line(request) is not None:
        return replace(who, rank=BATCH_RANK)
    return who
