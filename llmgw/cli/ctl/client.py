"""
The admin API's client for C{llmgw ctl}: one blocking call per command,
a failure told as one L{CtlError} line.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class CtlError(Exception):
    """
    One line for the user.
    """


class Client:
    """
    The admin API at C{base}, with an admin key if given.
    """

    def __init__(self, base: str, key: str | None, timeout: float = 60.0) -> None:
        """
        @param base: the admin listener's URL, C{http(s)://host:port}.
        @param key: an admin key sent as a bearer token, or L{None}.
        @param timeout: seconds for each call.
        """
        self.base = base.rstrip("/")
        self.key = key
        self.timeout = timeout

    def call(self, method: str, path: str, body: object = None) -> Any:
        """
        @param path: below the base URL, such as C{/api/v1/status}.
        @param body: sent as JSON unless L{None}.
        @return: the answer's JSON (L{None} for an empty body).
        @raise CtlError: the API refused (its message and status), the URL
            is not valid or the listener cannot be reached.
        """
        data = json.dumps(body).encode("utf-8") if body is not None else None
        headers = {"content-type": "application/json"}
        if self.key:
            headers["authorization"] = f"Bearer {self.key}"
        try:
            # A URL without a scheme fails here, as a ValueError.
            request = urllib.request.Request(
                self.base + path, data=data, method=method, headers=headers
            )
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw.decode("utf-8", "replace")[:300] or e.reason
            raise CtlError(f"{message} (HTTP {e.code})") from None
        except ValueError as e:
            raise CtlError(f"bad --admin-url {self.base!r}: {e}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise CtlError(
                f"cannot reach the admin API at {self.base}: {reason}"
                " (is llmgw-server running? see --admin-url)"
            ) from None


def quote(part: str) -> str:
    """
    @return: C{part} escaped as one path segment (a C{/} included).
    """
    return urllib.parse.quote(part, safe="")
