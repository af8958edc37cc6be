"""
Cross-origin access for scripts in web pages (CORS), pure: which headers an
answer carries, and what a preflight is answered.

How browsers check them (WHATWG Fetch standard, section 3.2, "CORS
protocol", and MDN's "Access-Control-Allow-Headers"):

  - A script reads a cross-origin answer only when its
    C{Access-Control-Allow-Origin} is C{*} or the page's origin; errors
    (401, 429) too, so every answer carries it, not only successes.
  - Before a POST with C{Content-Type: application/json} or an
    C{Authorization} header the browser sends a preflight, C{OPTIONS} with
    C{Origin}, C{Access-Control-Request-Method} and
    C{Access-Control-Request-Headers}, without credentials and so without
    the key: it must succeed (a 2xx) with no key.  Each requested header
    that is not CORS-safelisted must be named in
    C{Access-Control-Allow-Headers}; C{*} there never covers
    C{Authorization}, so the names are echoed instead.
  - Of an answer's headers a script sees only the CORS-safelisted ones
    (C{Content-Type}, C{Content-Length}, ...) and those named in
    C{Access-Control-Expose-Headers}: here C{X-Request-ID} and
    C{Retry-After}.
  - An answer that depends on C{Origin} says C{Vary: Origin}, so that a
    cache does not hand one origin's answer to another.

The OpenAI SDK for JavaScript sends C{Authorization}, C{Content-Type},
C{OpenAI-Organization}, C{OpenAI-Project}, C{OpenAI-Beta} and its
C{X-Stainless-*} headers; Azure-style clients send C{api-key}.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

ALLOWED_HEADERS = frozenset(
    {b"authorization", b"content-type", b"x-request-id", b"api-key", b"accept"}
)
"""
Request headers a cross-origin script may send, lower case; besides these,
any whose name starts with one of L{ALLOWED_PREFIXES}.
"""
ALLOWED_PREFIXES = (b"openai-", b"x-stainless-")
EXPOSED_HEADERS = b"X-Request-ID, Retry-After"
MAX_AGE = b"600"
"""
Seconds a browser may keep a preflight's answer (Chromium keeps at most
7,200, Firefox 86,400).
"""


def _allowed_header(name: bytes) -> bool:
    return name in ALLOWED_HEADERS or name.startswith(ALLOWED_PREFIXES)


@dataclass(frozen=True)
class Cors:
    """
    The C{[cors]} policy.

    @ivar allow_origins: C{("*",)} for any origin, or the origins allowed
        (C{scheme://host[:port]}, as browsers send C{Origin}); empty: no
        CORS headers at all, and preflights are not answered.
    @ivar methods: the methods of a path (decoded, such as
        C{"/v1/models"}), such as C{["GET"]}; none for a path with no
        route.
    """

    allow_origins: tuple[str, ...] = ()
    methods: Callable[[str], list[str]] = field(default=lambda path: [])

    @property
    def enabled(self) -> bool:
        return bool(self.allow_origins)

    def allows(self, origin: bytes | None) -> bool:
        """
        @return: whether a script from C{origin} may read answers.
        """
        if not self.allow_origins or origin is None:
            return False
        if self.allow_origins == ("*",):
            return True
        try:
            return origin.decode("ascii") in self.allow_origins
        except UnicodeDecodeError:
            return False

    def answer_headers(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        """
        @param origin: the request's C{Origin}, or L{None}.
        @return: the headers every answer carries, names and values; none
            when CORS is off.
        """
        if not self.allow_origins:
            return []
        headers = [(b"vary", b"Origin")]
        if self.allow_origins == ("*",):
            headers.append((b"access-control-allow-origin", b"*"))
        elif origin is not None and self.allows(origin):
            headers.append((b"access-control-allow-origin", origin))
        else:
            return headers
        headers.append((b"access-control-expose-headers", EXPOSED_HEADERS))
        return headers

    def preflight(
        self,
        path: str,
        origin: bytes | None,
        method: bytes | None,
        requested: bytes | None,
    ) -> list[tuple[bytes, bytes]] | None:
        """
        Answer an C{OPTIONS} request, when it is a preflight from an
        allowed origin for a method of a route (answered 204, with no key
        asked).

        @param path: the request's path, decoded.
        @param origin: its C{Origin}, or L{None}.
        @param method: its C{Access-Control-Request-Method}, or L{None}.
        @param requested: its C{Access-Control-Request-Headers}, or L{None}.
        @return: the headers of the 204 besides L{answer_headers}, or
            L{None} when it is not such a preflight (it is then routed as
            any request: 405, or 404 for a path with no route).
        """
        if method is None or not self.allows(origin):
            return None
        methods = [m for m in self.methods(path) if m != "OPTIONS"]
        if method.decode("latin-1") not in methods:
            return None
        return self.preflight_headers(methods, requested)

    def preflight_headers(
        self, methods: list[str], requested: bytes | None
    ) -> list[tuple[bytes, bytes]]:
        """
        @param methods: the methods of the path, such as C{["POST"]}.
        @param requested: the C{Access-Control-Request-Headers} value, or
            L{None}.
        @return: the headers of a preflight's answer besides
            L{answer_headers}, names and values: the methods, the requested
            headers that are allowed (echoed, lower case), and how long the
            answer may be kept.
        """
        names = [
            name.strip().lower()
            for name in (requested or b"").split(b",")
            if name.strip()
        ]
        allowed = [name for name in names if _allowed_header(name)]
        headers = [
            (b"access-control-allow-methods", ", ".join(methods).encode("ascii")),
            (b"access-control-max-age", MAX_AGE),
        ]
        if allowed:
            headers.append((b"access-control-allow-headers", b", ".join(allowed)))
        return headers
