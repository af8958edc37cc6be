"""
The dashboard (docs/dashboard.md): server-rendered pages on the admin
listener at C{/}, and the same pages on the client listener at
C{/admin} behind L{llmgw.web.login}.

Pages: the overview C{/}, C{/nodes/<id>}, C{/replicas/<id>},
C{/models/<name>}, C{/keys}, C{/batches}; each answers C{?fragment=1} with its
C{<main>} only, which C{static/dash.js} fetches every few seconds to
refresh the page without a reload.  Actions are form POSTs carrying a
CSRF token (403 without it), confirmed in the browser first, calling the
same functions the admin API calls; each answers 303 back to its page.
"""

from __future__ import annotations

import hmac
import os
import secrets
from importlib.resources import files
from typing import Any, Protocol, cast
from urllib.parse import parse_qs, quote

from jinja2 import Environment, PackageLoader, select_autoescape
from klein import Klein
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from werkzeug.exceptions import NotFound

from llmgw.control.drains import DrainRefused
from llmgw.control.plane import ControlPlane
from llmgw.web.batches import BatchesView
from llmgw.web.fleet import Fleet, window_name
from llmgw.web.traffic import WINDOWS

CSRF_COOKIE = b"llmgw_csrf"

STATIC_TYPES = {".css": b"text/css; charset=utf-8", ".js": b"text/javascript"}
STATIC_NAMES = frozenset(
    entry.name
    for entry in files("llmgw.web").joinpath("static").iterdir()
    if entry.is_file()
)
"""
The files C{/static/NAME} serves: a name from a client is looked up here,
never on the file system (a name too long for it raised there).
"""

TEMPLATES = Environment(
    loader=PackageLoader("llmgw.web", "templates"),
    autoescape=select_autoescape(default=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
TEMPLATES.filters["q"] = lambda value: quote(str(value), safe="")
TEMPLATES.globals["windows"] = [window_name(w) for w in WINDOWS]


class Actions(Protocol):
    """
    The admin API's changes that the dashboard offers
    (L{llmgw.admin.api.Admin} provides them).
    """

    async def set_scale(self, name: str, low: int, high: int) -> Any:
        """
        Set a model's bounds, as C{POST /api/v1/models/<name>/scale}.

        @raise KeyError: no such model.
        @raise ValueError: bad bounds.
        """

    async def revoke(self, name: str) -> Any:
        """
        Revoke a key by name, as C{POST /api/v1/keys/<name>/revoke}.

        @raise KeyError: no such key.
        """

    async def usage(
        self, by: str, since: float, until: float | None
    ) -> dict[str, Any] | None:
        """
        The usage report, as C{GET /api/v1/usage} answers it (docs/cost.md:
        GPU-seconds and cost per group, the idle row, each GPU's seconds).

        @return: L{None} when there is no store or it cannot be read now.
        """

    async def keep_drain(self, node_id: str, draining: bool) -> bool:
        """
        Keep a node's drain (or its end) in the store, as the admin API's
        drain and undrain do.

        @return: whether the store kept it.
        """


class Csrf(Protocol):
    """
    Where a request's CSRF token comes from.
    """

    def token(self, request: IRequest) -> str:
        """
        @return: the token to put in this request's forms.
        """

    def check(self, request: IRequest, given: str) -> bool:
        """
        @return: whether C{given} is this request's token.
        """


class CookieCsrf:
    """
    Double-submit tokens for the admin listener, which has no login: a
    random token in an C{HttpOnly}, C{SameSite=Strict} cookie, and the
    same in each form.  Another site can neither read the cookie nor
    make the browser send it with its own POST.
    """

    def token(self, request: IRequest) -> str:
        given = (request.getCookie(CSRF_COOKIE) or b"").decode("ascii", "replace")
        if len(given) == 43 and given.isascii():
            return given
        token = secrets.token_urlsafe(32)
        # IRequest declares fewer arguments than Request takes.
        cast(Any, request).addCookie(
            CSRF_COOKIE,
            token.encode("ascii"),
            path=b"/",
            httpOnly=True,
            sameSite="strict",
            secure=request.isSecure(),
        )
        return token

    def check(self, request: IRequest, given: str) -> bool:
        cookie = (request.getCookie(CSRF_COOKIE) or b"").decode("ascii", "replace")
        return bool(cookie) and hmac.compare_digest(cookie, given)


def form(request: IRequest) -> dict[str, str]:
    """
    @return: an urlencoded body's fields (the first value of each); the
        client listener's site parses no forms itself.  A body of more
        than 20 fields is no form of these pages: none (parse_qs raises
        past its cap, and a client without a key could send one).
    """
    content = request.content
    raw = content.read(64 * 1024) if content is not None else b""
    try:
        fields = parse_qs(raw.decode("utf-8", "replace"), max_num_fields=20)
    except ValueError:
        return {}
    return {name: values[0] for name, values in fields.items()}


class Dashboard:
    """
    The pages; one instance per listener.

    @param base: the path the pages are under: C{""} on the admin
        listener, C{"/admin"} on the client listener.
    @param csrf: the CSRF tokens of this listener.
    @param logout: whether pages offer a logout button.
    @param batches: the batches page's reads, when the server has a
        store (else the page says there are none to show).
    """

    app = Klein()
    log = Logger()

    def __init__(
        self,
        fleet: Fleet,
        actions: Actions,
        csrf: Csrf,
        base: str = "",
        logout: bool = False,
        batches: BatchesView | None = None,
    ) -> None:
        self.fleet = fleet
        self.actions = actions
        self.csrf = csrf
        self.base = base
        self.logout = logout
        self.batches = batches

    def _page(
        self, request: IRequest, name: str, title: str, status: int = 200, **values: Any
    ) -> bytes:
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(
            b"content-security-policy",
            b"default-src 'self'; style-src 'self' 'unsafe-inline';"
            b" img-src 'self' data:; frame-ancestors 'none'",
        )
        request.setHeader(b"x-frame-options", b"DENY")
        template = TEMPLATES.get_template(name)
        context = {
            "base": self.base,
            "title": title,
            "csrf": self.csrf.token(request),
            "logout": self.logout,
            **values,
        }
        if request.args.get(b"fragment"):
            block = template.blocks["main"]
            html = "".join(block(template.new_context(context)))
        else:
            html = template.render(context)
        return html.encode("utf-8")

    def _missing(self, request: IRequest, what: str) -> bytes:
        return self._page(request, "missing.html", "Not found", 404, what=what)

    def _back(self, request: IRequest, path: str) -> bytes:
        request.setResponseCode(303)
        request.setHeader(b"location", (self.base + path).encode("utf-8"))
        return b""

    def _checked(self, request: IRequest) -> dict[str, str] | None:
        fields = form(request)
        if not self.csrf.check(request, fields.get("csrf", "")):
            return None
        return fields

    def _unkept(self, request: IRequest) -> bytes:
        return self._page(
            request,
            "missing.html",
            "Store busy",
            503,
            what="the store to keep this (done in this server only): try again",
        )

    def _refused(self, request: IRequest, refused: DrainRefused) -> bytes:
        # The admin API's 409: only `llmgw ctl drain --force` overrides it.
        what = f"drain: {refused}"
        return self._page(request, "missing.html", "Drain refused", 409, what=what)

    def _forbidden(self, request: IRequest) -> bytes:
        return self._page(
            request,
            "missing.html",
            "Forbidden",
            403,
            what="a valid CSRF token: reload the page and try again",
        )

    def _plane(self) -> ControlPlane:
        if self.fleet.plane is None:
            raise NotFound()
        return self.fleet.plane

    @app.handle_errors(NotFound)
    def _not_found(self, request: IRequest, failure: Any) -> bytes:
        return self._missing(request, "such page")

    # Pages

    @app.route("/", methods=["GET"])
    def overview(self, request: IRequest) -> bytes:
        return self._page(request, "overview.html", "Fleet", **self.fleet.overview())

    @app.route("/nodes/<node_id>", methods=["GET"])
    def node(self, request: IRequest, node_id: str) -> bytes:
        node = self.fleet.node(node_id)
        if node is None:
            return self._missing(request, f"node {node_id[:200]}")
        return self._page(request, "node.html", f"Node {node_id}", node=node)

    @app.route("/replicas/<replica_id>", methods=["GET"])
    def replica(self, request: IRequest, replica_id: str) -> bytes:
        replica = self.fleet.replica(replica_id)
        if replica is None:
            return self._missing(request, f"replica {replica_id[:200]}")
        return self._page(
            request, "replica.html", f"Replica {replica_id}", replica=replica
        )

    @app.route("/models/<path:name>", methods=["GET"])
    def model(self, request: IRequest, name: str) -> bytes:
        model = self.fleet.model(name)
        if model is None:
            return self._missing(request, f"model {name[:200]}")
        return self._page(request, "model.html", f"Model {name}", model=model)

    @app.route("/keys", methods=["GET"])
    async def keys(self, request: IRequest) -> bytes:
        # The same report as llmgw ctl usage, over the last day.
        since = self.fleet.wall_clock() - 86400
        usage = await self.actions.usage("key", since, None)
        return self._page(
            request,
            "keys.html",
            "Keys",
            keys=self.fleet.key_rows(),
            interval=self.fleet.history.interval,
            usage=usage,
        )

    @app.route("/batches", methods=["GET"])
    def batch_page(self, request: IRequest) -> bytes:
        if self.batches is None:
            return self._missing(request, "batches in this server (no store)")
        return self._page(request, "batches.html", "Batches", **self.batches.page())

    @app.route("/static/<name>", methods=["GET"])
    def static(self, request: IRequest, name: str) -> bytes:
        kind = STATIC_TYPES.get(os.path.splitext(name)[1])
        if kind is None or name not in STATIC_NAMES:
            raise NotFound()
        request.setHeader(b"content-type", kind)
        request.setHeader(b"cache-control", b"max-age=300")
        return files("llmgw.web").joinpath("static", name).read_bytes()

    # Actions

    @app.route("/nodes/<node_id>/drain", methods=["POST"])
    async def drain_node(self, request: IRequest, node_id: str) -> bytes:
        if self._checked(request) is None:
            return self._forbidden(request)
        try:
            self._plane().drain_node(node_id)
        except KeyError:
            return self._missing(request, f"node {node_id[:200]}")
        except DrainRefused as e:
            return self._refused(request, e)
        if not await self.actions.keep_drain(node_id, True):
            return self._unkept(request)
        return self._back(request, "/nodes/" + quote(node_id, safe=""))

    @app.route("/nodes/<node_id>/undrain", methods=["POST"])
    async def undrain_node(self, request: IRequest, node_id: str) -> bytes:
        if self._checked(request) is None:
            return self._forbidden(request)
        try:
            self._plane().undrain_node(node_id)
        except KeyError:
            return self._missing(request, f"node {node_id[:200]}")
        if not await self.actions.keep_drain(node_id, False):
            return self._unkept(request)
        return self._back(request, "/nodes/" + quote(node_id, safe=""))

    @app.route("/replicas/<replica_id>/drain", methods=["POST"])
    def drain_replica(self, request: IRequest, replica_id: str) -> bytes:
        if self._checked(request) is None:
            return self._forbidden(request)
        try:
            self._plane().drain_replica(replica_id)
        except KeyError:
            return self._missing(request, f"replica {replica_id[:200]}")
        except DrainRefused as e:
            return self._refused(request, e)
        return self._back(request, "/replicas/" + quote(replica_id, safe=""))

    @app.route("/models/<path:name>/scale", methods=["POST"])
    async def scale(self, request: IRequest, name: str) -> bytes:
        fields = self._checked(request)
        if fields is None:
            return self._forbidden(request)
        try:
            low = int(fields.get("min_replicas", ""))
            high = int(fields.get("max_replicas", ""))
            await self.actions.set_scale(name, low, high)
        except KeyError:
            return self._missing(request, f"model {name[:200]}")
        except ValueError as e:
            return self._page(
                request, "missing.html", "Bad request", 400, what=f"valid bounds: {e}"
            )
        return self._back(request, "/models/" + quote(name, safe=""))

    @app.route("/keys/<name>/revoke", methods=["POST"])
    async def revoke(self, request: IRequest, name: str) -> bytes:
        if self._checked(request) is None:
            return self._forbidden(request)
        try:
            await self.actions.revoke(name)
        except KeyError:
            return self._missing(request, f"key {name[:200]}")
        return self._back(request, "/keys")
