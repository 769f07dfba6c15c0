"""Who may classify, and how often: the optional API token and the optional per-client rate limit.

Both are off by default (a localhost service needs neither) and switched on by settings.
The rate limit uses Flask-Limiter: one budget per client address, shared by every way of
classifying (the page, the JSON API, /v2); its counters live where ``RATE_LIMIT_STORAGE`` says
(``memory://`` is per worker process, so N workers admit up to N times the limit; point it
at Redis to share one count; Memcached keeps no moving window). Every answer of a classify route
carries ``X-RateLimit-Limit``, ``-Remaining`` and ``-Reset``; ``Retry-After`` only the refusals: the rate
limit's 429, and the 429 ``overloaded`` and 503 with their own. A refused token says whether it was missing
or wrong; every 401 carries ``WWW-Authenticate: Bearer realm="classifier"`` (RFC 9110 15.5.2).

With ``PAGE_LOGIN`` the page asks for the API token too, as HTTP Basic's password (any user name): its 401 says
``WWW-Authenticate: Basic``, so a browser asks for it once and sends it with every request of the page after,
its photos included (the page's own ``POST /``, which is otherwise open to anyone who can open the page).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hmac

from flask import Flask, g, request
from werkzeug.exceptions import TooManyRequests

from .errors import Unauthorized

# Endpoints that classify (and so cost CPU): the rate limit applies to these, the API token to the
# JSON API's and the Open Inference Protocol's (webapp/v2.py), not to the page's.
CLASSIFY_ENDPOINTS = ("api.predict", "ui.classify", "v2.infer")
TOKEN_ENDPOINTS = ("api.predict", "v2.infer")
PAGE_ENDPOINTS = ("ui.index", "ui.classify")  # with PAGE_LOGIN (the static files and words stay open)
PAGE_CHALLENGE = 'Basic realm="classifier", charset="UTF-8"'
# Where Flask-Limiter writes its Retry-After (its header_name_mapping), for init_access's hook to move onto its
# own 429 only: never sent.
LIMITER_RETRY_AFTER = "X-Classifier-Limiter-Retry-After"


def check_token(header: str | None, token: str) -> bool:
    """True if ``header`` is ``Bearer <token>``; constant-time in the token's content."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def token_refusal(header: str | None, token: str, what: str) -> Unauthorized | None:
    """None if ``header`` carries ``token``; else the 401 for ``what`` ("this API", "/metrics"), saying which
    problem it is: no bearer token at all, or one that is not this server's (RFC 6750's ``invalid_token``)."""
    if check_token(header, token):
        return None
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return Unauthorized(f"{what} needs a token: send 'Authorization: Bearer <token>'")  # the plain challenge
    return Unauthorized(f"{what} needs a token, and the bearer token sent is not this server's: send "
                        f"'Authorization: Bearer <token>' with the right one",
                        headers={"WWW-Authenticate": f'{Unauthorized.CHALLENGE}, error="invalid_token"'})


def page_refusal(header: str | None, token: str) -> Unauthorized | None:
    """None if ``header`` carries ``token``: as HTTP Basic's password (RFC 7617; any user name: a browser's login
    dialog), or as a bearer token; else the 401 whose ``WWW-Authenticate: Basic`` makes a browser ask for it."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() == "basic":
        try:
            _, _, password = base64.b64decode(given.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            password = ""
        if hmac.compare_digest(password.encode(), token.encode()):
            return None
    elif check_token(header, token):
        return None
    return Unauthorized("this page needs the server's token: give it as the password (any user name)",
                        headers={"WWW-Authenticate": PAGE_CHALLENGE})


def init_access(app: Flask, settings) -> None:
    """Install the token check and the rate limit on ``app`` as ``settings`` say.

    ``settings`` come from ``settings.load``, whose table has checked ``RATE_LIMIT`` and its storage
    (``webapp/rate_limits.py``) before any worker starts.
    """
    # Which token each protected endpoint takes. /metrics is open only when no token is set at all:
    # with an API token, a scrape needs METRICS_TOKEN if set (Prometheus' `authorization` config),
    # else the API token.
    tokens = {}
    if settings.API_TOKEN:
        tokens.update(dict.fromkeys(TOKEN_ENDPOINTS, settings.API_TOKEN))
    if settings.METRICS_TOKEN or settings.API_TOKEN:
        tokens["metrics"] = settings.METRICS_TOKEN or settings.API_TOKEN
    page = settings.API_TOKEN if settings.PAGE_LOGIN else ""
    if tokens:
        @app.before_request
        def require_token():
            if page and request.endpoint in PAGE_ENDPOINTS:
                if refusal := page_refusal(request.headers.get("Authorization"), page):
                    raise refusal
                return
            token = tokens.get(request.endpoint)
            what = "/metrics" if request.endpoint == "metrics" else "this API"
            refusal = token and token_refusal(request.headers.get("Authorization"), token, what)
            if refusal:
                raise refusal

    if not settings.RATE_LIMIT:
        return
    from flask_limiter import HeaderNames, Limiter
    from flask_limiter.util import get_remote_address

    @app.after_request  # registered before the limiter's own hook, so it runs after it
    def retry_after_on_refusals_only(resp):
        # Flask-Limiter puts Retry-After (the window's reset) on every answer of a limited route, a 200
        # included, and raises a 429 overloaded's or a 503's own Retry-After to it. It writes its value
        # under LIMITER_RETRY_AFTER instead; only its own refusal (a 429 with no Retry-After of its own)
        # takes it, at least 1 s: rounded to the reset it can be 0, and a client told 0 is refused again.
        wait = resp.headers.pop(LIMITER_RETRY_AFTER, None)
        if resp.status_code == 429 and wait is not None and "Retry-After" not in resp.headers:
            resp.headers["Retry-After"] = str(max(1, int(wait)))
        return resp

    limiter = Limiter(get_remote_address, app=app, storage_uri=settings.RATE_LIMIT_STORAGE, headers_enabled=True,
                      header_name_mapping={HeaderNames.RETRY_AFTER: LIMITER_RETRY_AFTER}, strategy="moving-window")
    # One budget per client address for every way of classifying (page, API, /v2): a shared limit, so
    # switching from the API to the page does not double what a client may send.
    # The server's own refusals (429 overloaded, 503 not ready: come back after Retry-After) cost the client none of
    # it: a client that honoured them spent its budget and was then told rate_limited (tryout18). Everything else it
    # sent counts, refused or not.
    budget = limiter.shared_limit(settings.RATE_LIMIT, scope="classify", deduct_when=lambda resp: g.get(
        "error_code") not in ("overloaded", "not_ready"))
    # Counted after the answer, a client's requests that arrive together were all let in: 20 at once against
    # 6/minute, all 200 (tryout33). Those of its requests still in progress in this worker count against what is
    # left of its budget, so one over is refused as the limiter refuses (its 429, Retry-After from its window).
    in_progress: dict[str, int] = {}

    def counted(view):
        @functools.wraps(view)
        def run(*args, **kwargs):
            key, limit = get_remote_address(), limiter.current_limit
            # (its window read afresh, not limit.remaining: that is kept, and the answer's X-RateLimit-Remaining
            # would say what was left before this request; here it is, this one not yet counted)
            # (no window read when none of this client's is in progress: that is every request of a polite one)
            busy = in_progress.get(key, 0)
            if busy and limit is not None and busy >= limit.limiter.get_window_stats(
                    limit.limit, *limit.request_args)[1]:
                raise TooManyRequests(f"{limit.limit}, counting the requests in progress")
            in_progress[key] = busy + 1
            try:
                return view(*args, **kwargs)
            finally:
                in_progress[key] -= 1
                if not in_progress[key]:
                    del in_progress[key]
        return run

    for endpoint in CLASSIFY_ENDPOINTS:
        app.view_functions[endpoint] = budget(counted(app.view_functions[endpoint]))

