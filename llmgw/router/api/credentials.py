"""
Which API key a client request carries, in the headers each client family
sends it in: shared by every route that checks keys.
"""

from __future__ import annotations

from twisted.web.iweb import IRequest

from llmgw.router.api.prepare import Prepared
from llmgw.router.interfaces import Auth, Key


def request_key(auth: Auth | None, request: IRequest) -> Key | None:
    """
    The key comes in C{Authorization: Bearer sk-...} (OpenAI's clients,
    and Anthropic's with C{auth_token}), in C{api-key: sk-...} (Azure
    OpenAI's, which the OpenAI SDK's C{AzureOpenAI} sends) or in
    C{x-api-key: sk-...} (Anthropic's clients); when several come,
    C{Authorization} is the one checked, then C{api-key}.

    @param auth: the keys, or L{None} for an open gateway.
    @return: the request's API key, or L{None} when none is needed.
    @raise llmgw.router.errors.APIError: 401.
    """
    if auth is None:
        return None
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
