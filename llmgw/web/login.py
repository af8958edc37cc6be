"""
The dashboard on the client listener, at C{/admin}, behind a login with
an admin API key.

The key is asked once, on C{/admin/login}, and checked as the client
API checks keys (L{KeyRing.authenticate}); an admin key opens a session
named by a random token in a cookie (C{HttpOnly}, C{SameSite=Strict},
C{Path=/admin}, C{Secure} when the listener is TLS).  A session ends at
logout, after C{idle} seconds without a request, or when its key is
revoked.  Failed logins are limited per client address.  Sessions live in
the server's memory: a restart logs everyone out.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from twisted.logger import Logger
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource

from llmgw.router.accounting.auth import KeyRing
from llmgw.router.errors import APIError
from llmgw.web.pages import TEMPLATES, form

SESSION_COOKIE = b"llmgw_session"

IDLE_EXPIRY = 30 * 60.0
"""
Seconds without a request after which a session ends.
"""

LOGIN_ATTEMPTS = 5
LOGIN_WINDOW = 60.0
"""
At most C{LOGIN_ATTEMPTS} failed logins per client address in
C{LOGIN_WINDOW} seconds; more are refused with 429 unread.
"""

MAX_SESSIONS = 1000
MAX_ADDRESSES = 10_000


@dataclass
class Session:
    """
    @ivar key: the name of the admin key that opened it.
    @ivar csrf: the token its forms carry.
    @ivar last: monotonic seconds of its last request.
    """

    key: str
    csrf: str
    last: float


@dataclass
class _Failures:
    times: deque[float] = field(default_factory=deque)


class Sessions:
    """
    Login sessions, and the CSRF tokens of their forms
    (L{llmgw.web.pages.Csrf}).

    @param clock: monotonic seconds now.
    """

    log = Logger()

    def __init__(
        self,
        keys: KeyRing,
        clock: Callable[[], float],
        idle: float = IDLE_EXPIRY,
        attempts: int = LOGIN_ATTEMPTS,
        window: float = LOGIN_WINDOW,
    ) -> None:
        self._keys = keys
        self._clock = clock
        self.idle = idle
        self.attempts = attempts
        self.window = window
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._failures: OrderedDict[str, _Failures] = OrderedDict()

    def limited(self, address: str) -> bool:
        """
        @return: whether C{address} failed too often lately.
        """
        failures = self._failures.get(address)
        if failures is None:
            return False
        now = self._clock()
        while failures.times and failures.times[0] <= now - self.window:
            failures.times.popleft()
        return len(failures.times) >= self.attempts

    def _failed(self, address: str) -> None:
        failures = self._failures.pop(address, None) or _Failures()
        failures.times.append(self._clock())
        self._failures[address] = failures
        while len(self._failures) > MAX_ADDRESSES:
            self._failures.popitem(last=False)

    def login(self, address: str, secret: str) -> str | None:
        """
        @param secret: the key as typed (C{sk-...}).
        @return: a new session's token, or L{None}: not a key, or not an
            admin key (counted as a failure of C{address}).
        """
        try:
            key = self._keys.authenticate(b"Bearer " + secret.strip().encode())
        except (APIError, UnicodeEncodeError):
            key = None
        if key is None or not key.admin:
            self._failed(address)
            self.log.warn("dashboard login refused from {address}", address=address)
            return None
        token = secrets.token_urlsafe(32)
        self._sessions[token] = Session(
            key.name, secrets.token_urlsafe(32), self._clock()
        )
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        self.log.info(
            "dashboard login with key {key} from {address}",
            key=key.name,
            address=address,
        )
        return token

    def logout(self, request: IRequest) -> None:
        """
        End the request's session, if any.
        """
        self._sessions.pop(self._token(request), None)

    def _token(self, request: IRequest) -> str:
        return (request.getCookie(SESSION_COOKIE) or b"").decode("ascii", "replace")

    def session(self, request: IRequest) -> Session | None:
        """
        @return: the request's live session (its idle clock reset), or
            L{None}: none, expired, or its key revoked or gone.
        """
        token = self._token(request)
        session = self._sessions.get(token)
        if session is None:
            return None
        now = self._clock()
        key = self._keys.find(session.key)
        if (
            now - session.last > self.idle
            or key is None
            or key.revoked is not None
            or self._keys.expired(key)
            or not key.admin
        ):
            del self._sessions[token]
            return None
        session.last = now
        return session

    # Csrf

    def token(self, request: IRequest) -> str:
        session = self._sessions.get(self._token(request))
        return session.csrf if session is not None else ""

    def check(self, request: IRequest, given: str) -> bool:
        session = self.session(request)
        return session is not None and hmac.compare_digest(session.csrf, given)


def _cookie(request: IRequest, base: str, value: bytes, **extra: Any) -> None:
    # IRequest declares fewer arguments than Request takes.
    cast(Any, request).addCookie(
        SESSION_COOKIE,
        value,
        path=(base or "/").encode("ascii"),
        httpOnly=True,
        sameSite="strict",
        secure=request.isSecure(),
        **extra,
    )


class LoginGate(Resource):
    """
    The pages behind a login: C{login} (GET a form, POST a key),
    C{logout} (POST with the CSRF token) and C{static} are open; any
    other path wants a session, and is sent to the login form without
    one (401 for the refresh script's fragment requests).

    @param inner: the dashboard's resource.
    @param base: where this is mounted (C{/admin}).
    """

    isLeaf = True

    def __init__(self, inner: IResource, sessions: Sessions, base: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._inner = inner
        self._sessions = sessions
        self._base = base

    def _login_page(self, request: IRequest, message: str, status: int) -> bytes:
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-frame-options", b"DENY")
        page = TEMPLATES.get_template("login.html").render(
            base=self._base, message=message
        )
        return page.encode("utf-8")

    def _redirect(self, request: IRequest, path: str) -> bytes:
        request.setResponseCode(303)
        request.setHeader(b"location", (self._base + path).encode("utf-8"))
        return b""

    def render(self, request: IRequest) -> Any:
        segments = list(getattr(request, "postpath", None) or [])
        first = segments[0] if segments else b""
        method = request.method
        if first == b"static":
            return self._inner.render(request)
        if first == b"login" and len(segments) == 1:
            if method == b"POST":
                return self._login(request)
            return self._login_page(request, "", 200)
        if first == b"logout" and len(segments) == 1 and method == b"POST":
            session = self._sessions.session(request)
            if session is None or not hmac.compare_digest(
                session.csrf, form(request).get("csrf", "")
            ):
                request.setResponseCode(403)
                return b"a valid CSRF token is needed\n"
            self._sessions.logout(request)
            _cookie(request, self._base, b"", max_age=b"0")
            return self._redirect(request, "/login")
        if self._sessions.session(request) is None:
            if request.args.get(b"fragment"):
                request.setResponseCode(401)
                return b"log in again\n"
            return self._redirect(request, "/login")
        return self._inner.render(request)

    def _login(self, request: IRequest) -> bytes:
        address = str(getattr(request.getClientAddress(), "host", ""))
        if self._sessions.limited(address):
            request.setHeader(b"retry-after", str(int(self._sessions.window)).encode())
            return self._login_page(
                request, "Too many failed logins: wait a minute and try again.", 429
            )
        token = self._sessions.login(address, form(request).get("key", ""))
        if token is None:
            return self._login_page(request, "That is not an admin API key.", 403)
        _cookie(request, self._base, token.encode("ascii"))
        return self._redirect(request, "/")


class Mount(Resource):
    """
    The client API with the dashboard at C{/prefix}: requests under it go
    to C{mounted} (the prefix moved to the request's C{prepath}, so the
    dashboard's routes are relative); all others to C{inner}, as before.
    """

    isLeaf = True

    def __init__(self, inner: IResource, prefix: bytes, mounted: IResource) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._inner = inner
        self._prefix = prefix
        self._mounted = mounted

    def render(self, request: IRequest) -> Any:
        postpath: list[bytes] = getattr(request, "postpath", None) or []
        if postpath[:1] == [self._prefix]:
            request.prepath = [*request.prepath, postpath.pop(0)]
            if not postpath:
                postpath.append(b"")
            request.postpath = postpath
            return self._mounted.render(request)
        return self._inner.render(request)


class Split(Resource):
    """
    The admin listener's paths by their first segment: C{routes} for
    those named (each sees the whole path), C{default} for the rest.
    """

    isLeaf = True

    def __init__(self, routes: dict[bytes, IResource], default: IResource) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._routes = routes
        self._default = default

    def render(self, request: IRequest) -> Any:
        postpath = getattr(request, "postpath", None) or []
        inner = self._routes.get(postpath[0] if postpath else b"", self._default)
        return inner.render(request)
