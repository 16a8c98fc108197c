"""Who may do what, checked on every request, and what a refused or failed request is answered.

Every page needs a login (a ``[[web_token]]`` secret, access.py: a session cookie, or a bearer
token for scripts) except ``/login``, ``/health`` and the static files. Every POST needs the same
origin (``Sec-Fetch-Site``/``Origin``) and, for a session, its CSRF token (form field ``csrf`` or
header ``X-CSRF-Token``); actions need the admin scope. :func:`route` wraps a page's handler so
that its refusals and the errors a person can act on become a page (or plain text for scripts)
with the message and the right status: 400 for bad input, 404 for what does not exist, 503 only
for a shard that did not answer, 504 for a query past the statement timeout.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from urllib.parse import urlencode, urlsplit

import psycopg
from psycopg import errors as pg
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from queue_manager.errors import ConfigurationError, InvalidNameError, QueueManagerError, UnknownQueueError
from queue_manager.web.access import WebUser
from queue_manager.web.context import Web, base
from queue_manager.web.filters import FilterError
from queue_manager.web.shards import ShardUnavailable, StatementTimeout

logger = logging.getLogger(__name__)

COOKIE = "qm_session"
#: a page's handler: the shared pieces and the request in, a response out
Handler = Callable[[Web, Request], Awaitable[Response]]


class Refused(Exception):
    """A request refused with a status and a message the person can act on."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def user_of(web: Web, request: Request) -> WebUser | None:
    bearer = web.config.tokens.from_authorization(request.headers.get("authorization"))
    if bearer is not None:
        return bearer
    return web.sessions.read(request.cookies.get(COOKIE))


def same_origin(request: Request) -> None:
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise Refused(403, f"cross-site request refused (Sec-Fetch-Site: {site}): act from the dashboard itself")
    origin = request.headers.get("origin")
    if origin is not None:
        host = request.headers.get("host", "")
        if origin == "null" or urlsplit(origin).netloc != host:
            raise Refused(403, f"cross-origin request refused (Origin {origin!r} is not this dashboard's)")


async def form_of(request: Request) -> FormData:
    try:
        return await request.form(max_files=0, max_fields=5000)
    except Exception as exc:  # a malformed body: multipart parser errors have no common base
        raise Refused(400, f"the form could not be read: {exc}") from None


async def require(web: Web, request: Request, *, action: bool = False) -> tuple[WebUser, FormData]:
    """The user and the form (empty for a GET), after the checks of the request's kind (the module
    docstring)."""
    user = user_of(web, request)
    if user is None:
        raise Refused(401, 'log in first: this dashboard needs a token (docs/dashboard.md, "Access")')
    form = FormData()
    if request.method == "POST":
        same_origin(request)
        form = await form_of(request)
        if user.csrf is not None:
            sent = request.headers.get("x-csrf-token") or str(form.get("csrf") or "")
            if not sent or not hmac.compare_digest(sent, user.csrf):
                raise Refused(403, "the form's CSRF token is missing or stale: reload the page and try again")
    if action and not user.admin:
        raise Refused(403, f'token {user.name!r} is read-only: actions need a token with scope "admin"')
    return user, form


def safe_next(raw: str | None, root: str) -> str:
    """Where to go after login (or back from an error): a path of this dashboard, never another site."""
    home = f"{root}/"
    if not raw or not raw.startswith(home) or raw.startswith("//") or "\\" in raw or not raw.isprintable():
        return home
    return raw


def error(web: Web, request: Request, status: int, message: str) -> Response:
    """The answer to a refused or failed request: a page with the message, or plain text for scripts."""
    if "text/html" in request.headers.get("accept", ""):
        back = None
        referer = urlsplit(request.headers.get("referer", ""))
        if referer.netloc and referer.netloc == request.headers.get("host"):
            back = safe_next(referer.path + (f"?{referer.query}" if referer.query else ""), base(request))
        user = user_of(web, request)
        return web.page(request, "error.html", user, status=status, code=status, message=message, back=back)
    return PlainTextResponse(f"{message}\n", status_code=status)


def _status(exc: Exception) -> tuple[int, str] | None:
    """The status and message of an error a person can act on; None for a fault of the dashboard."""
    if isinstance(exc, FilterError | InvalidNameError | ConfigurationError):
        return 400, str(exc)
    if isinstance(exc, UnknownQueueError):
        return 404, str(exc)
    if isinstance(exc, StatementTimeout):
        return 504, str(exc)
    if isinstance(exc, ShardUnavailable):
        return 503, f"{exc}; try again"
    if isinstance(exc, QueueManagerError):
        return 400, str(exc)
    if isinstance(exc, pg.QueryCanceled):
        return 504, f"a query ran past the dashboard's statement timeout ({exc}); narrow it"
    if isinstance(exc, psycopg.OperationalError):  # a shard down, wherever it came from
        logger.warning("dashboard request failed", extra={"action": "web_db_error", "error": str(exc)})
        return 503, f"a shard did not answer: {str(exc).strip()}; try again"
    if isinstance(exc, psycopg.DataError | psycopg.IntegrityError):
        return 400, f"a shard refused a value: {exc.diag.message_primary or exc}"
    return None


def guard(web: Web, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` with its refusals and the errors a person can act on answered as pages."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Refused as exc:
            if exc.status == 401 and request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                target = request.url.path
                return RedirectResponse(f"{base(request)}/login?{urlencode({'next': target})}", status_code=303)
            return error(web, request, exc.status, exc.message)
        except (QueueManagerError, psycopg.Error) as exc:
            answer = _status(exc)
            if answer is None:
                raise
            return error(web, request, *answer)

    return wrapped


def route(web: Web, path: str, handler: Handler, method: str = "GET") -> Route:
    """A route of ``handler``, guarded (:func:`guard`)."""
    return Route(path, guard(web, partial(handler, web)), methods=[method])


# ------------------------------------------------------------------------------------ login


async def login_form(web: Web, request: Request) -> Response:
    return web.page(request, "login.html", None, next=safe_next(request.query_params.get("next"), base(request)))


async def login(web: Web, request: Request) -> Response:
    same_origin(request)
    form = await form_of(request)
    issued = web.sessions.issue(str(form.get("token") or "").strip())
    target = safe_next(str(form.get("next") or ""), base(request))
    if issued is None:
        return web.page(request, "login.html", None, status=401, next=target, message="unknown token")
    value, user = issued
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        COOKIE,
        value,
        max_age=web.sessions.max_age,
        path=base(request) or "/",
        httponly=True,
        samesite="strict",
        secure=web.config.secure_cookie,
    )
    logger.info("dashboard login", extra={"action": "web_login", "token": user.name, "scope": user.scope})
    return response


async def logout(web: Web, request: Request) -> Response:
    await require(web, request)
    response = RedirectResponse(f"{base(request)}/login", status_code=303)
    response.delete_cookie(COOKIE, path=base(request) or "/")
    return response


def routes(web: Web) -> list[Route]:
    return [
        route(web, "/login", login_form),
        route(web, "/login", login, "POST"),
        route(web, "/logout", logout, "POST"),
    ]
