"""Request ids and access logs.

- Every request gets an id: the client's ``X-Request-ID`` when it is a sane token (1..128 of
  ``A-Z a-z 0-9 . _ : + / = @ ~ -``), else a fresh uuid4 hex. Every response echoes it in
  ``X-Request-ID``, and the service's log lines written while serving the request end with
  ``[request_id=...]`` (:class:`RequestIdFilter`, installed on the ``webapp`` logger's handlers).
- ``ACCESS_LOG=json``: one JSON object per request, one line each, on the logger
  ``webapp.access`` (stdout; ``gunicorn.conf.py`` then turns gunicorn's own text access log off).
  ``text`` leaves access logs to gunicorn (its format shows the request id too); ``off``: none.
- The master's own 503s are logged with the same fields (``access_fields``; ``webapp.responder``).

JSON is written with ``json.dumps`` (ASCII, escaped), so a client cannot forge or break a line
with what it puts in a path or a header.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import datetime, timezone

from flask import Flask, g, has_request_context, request

from .contract import REQUEST_ID_HEADER, request_id_from  # noqa: F401 (the rule lives there: torch- and Flask-free)
from .redact import hide_query_secrets

ACCESS_LOGGER = "webapp.access"


def current_request_id() -> str | None:
    """The id of the request being served here, or None outside a request."""
    if not has_request_context():
        return None
    return g.get("request_id")


def request_started() -> float | None:
    """``time.perf_counter()`` when this request's first hook ran (None outside a request)."""
    return g.get("request_start") if has_request_context() else None


class RequestIdFilter(logging.Filter):
    """Tags ``webapp.*`` records logged during a request with its id (``record.request_id``, and a
    ``[request_id=...]`` suffix on the message, since gunicorn's formatter is not ours to change)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_request_id_done", False):  # one record, several handlers: tag it once
            return True
        record._request_id_done = True
        rid = current_request_id()
        record.request_id = rid or "-"
        if rid and (record.name == "webapp" or record.name.startswith("webapp.")) and record.name != ACCESS_LOGGER:
            try:
                message = record.getMessage()
            except Exception:  # a bad format string: leave it to the handler to report
                return True
            record.msg, record.args = f"{message} [request_id={rid}]", ()
        return True


def install_request_id_filter(logger: logging.Logger | None = None) -> None:
    """Put a :class:`RequestIdFilter` on each handler of ``logger`` (default ``webapp``); idempotent.

    Called by ``create_app`` and, under gunicorn, by ``post_fork`` after it routes the logger to
    gunicorn's error log (so ``--preload``, where the app is made first, is covered too).
    """
    logger = logger or logging.getLogger("webapp")
    for handler in logger.handlers:
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())


def configure_access_logger(stream=None) -> logging.Logger:
    """The JSON access logger: bare lines to ``stream`` (stdout), INFO whatever ``LOG_LEVEL`` says."""
    log = logging.getLogger(ACCESS_LOGGER)
    log.setLevel(logging.INFO)
    log.propagate = False
    if not log.handlers:
        handler = logging.StreamHandler(stream or sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    return log


def access_fields(*, request_id: str | None, method: str, path: str, status: int, duration_ms: float | None,
                  size: int | None, remote_addr: str | None, query: str, user_agent: str | None) -> dict:
    """One JSON access log object, as workers and the master (its own 503s) write it: ``duration_ms`` in ms,
    ``size`` the body's bytes (the "bytes" key); the query is cut at 1,024 characters and the User-Agent at 512,
    and each is left out where empty."""
    record = {
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "request_id": request_id, "method": method, "path": path, "status": status,
        "duration_ms": None if duration_ms is None else round(duration_ms, 2), "bytes": size,
        "remote_addr": remote_addr, "pid": os.getpid(),
    }
    if query:  # a credential sent in the URL by mistake (?token=...) is not written in clear (webapp/redact.py)
        record["query"] = hide_query_secrets(query)[:1024]
    if user_agent:
        record["user_agent"] = user_agent[:512]
    return record


def access_record(resp, duration_s: float | None) -> dict:
    """The JSON access log object of the current request and its response ``resp``."""
    size = resp.content_length
    if size is None and not resp.is_streamed:
        size = resp.calculate_content_length()
    return access_fields(request_id=current_request_id(), method=request.method, path=request.path,
                         status=resp.status_code, duration_ms=None if duration_s is None else duration_s * 1e3,
                         size=size, remote_addr=request.remote_addr,
                         query=request.query_string.decode("latin-1"), user_agent=request.headers.get("User-Agent"))


def init_logs(app: Flask, settings) -> None:
    """Request ids on every request and response; the JSON access log when ``ACCESS_LOG=json``."""
    install_request_id_filter()
    json_log = configure_access_logger() if settings.ACCESS_LOG == "json" else None

    def assign_request_id():
        g.request_start = time.perf_counter()
        g.request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))

    # First of all before_request hooks, so even a request refused by the token check has an id.
    app.before_request_funcs.setdefault(None, []).insert(0, assign_request_id)

    @app.after_request
    def echo_request_id(resp):
        rid = current_request_id()
        if rid:
            resp.headers[REQUEST_ID_HEADER] = rid
        if json_log is not None:
            try:
                start = request_started()
                duration = None if start is None else time.perf_counter() - start
                json_log.info(json.dumps(access_record(resp, duration), separators=(",", ":")))
            except Exception:  # never fail a request over its log line
                logging.getLogger(__name__).exception("cannot write the access log line")
        return resp
