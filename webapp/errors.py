"""The error table: every error the service answers, with its HTTP status, code and words.

Errors are part of the API. Each class below is one row: ``status`` (HTTP), ``code`` (stable,
machine-readable), ``retryable`` (the same request may succeed after ``Retry-After``), ``when``
(the README's and the OpenAPI document's words) and ``settings`` (what changes the limit).
``ERRORS`` lists the rows in the README's order; from it come the README's "Limits and errors"
table (``markdown_table``, kept in step by a test), the OpenAPI error responses, the page's
"try again in N s" codes, and ``from_dict``. The words people read on the page are in
``webapp/i18n.py`` (``err_<code>``, in each language). Adding an error code: a class here, its
``err_<code>`` strings there.

One handler, ``init_errors(app)``, renders any of them, Werkzeug's HTTP errors and unexpected
exceptions as ``{"error": {"code", "message", "status"}}`` for the API and as the page for the UI.
Messages are written for the person who sent the request: what was wrong and what to do.

Imports neither torch nor Flask at module level: the core (imaging, batcher, engine) raises these.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable


class ServiceError(Exception):
    """Base class: ``status`` (HTTP), ``code`` (stable machine-readable), ``message`` (for people).

    ``headers`` carries extra response headers (``Retry-After`` for 429 and 503).
    """

    status = 500
    code = "internal_error"
    retryable = False
    when = ""
    settings: tuple[str, ...] = ()

    def __init__(self, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def to_dict(self) -> dict:
        """The JSON error body: ``{"error": {"code", "message", "status"}}`` (``error_body``'s API shape)."""
        return error_body(None, self.code, self.message, self.status)


class NoFile(ServiceError):
    status, code = 400, "no_file"
    when = "no body at all (e.g. a bare POST), no multipart `file` part, an empty one, or a 0-byte file"


class UndecodableImage(ServiceError):
    status, code = 400, "undecodable_image"
    when = ("a known format with broken data (e.g. a truncated JPEG), or a photo changed on the way as if it were "
            "text (`curl -d`, a string read as UTF-8 or Latin-1, a text-mode copy: the message says which, and "
            "how to send it)")


class BadRequest(ServiceError):
    status, code = 400, "bad_request"
    when = ("`topk` not an integer from 1 to 10, a malformed multipart body, bad `original_*` fields, or "
            "`topk` or an `original_*` field sent as a file part (`-F 'topk=@file'`; the message names the "
            "field); a body that ends before its `Content-Length`, or a chunked body that is malformed, in tiny "
            "chunks (under 128 bytes on average) or ends before its last chunk (the connection closes); a request "
            "line or header gunicorn cannot parse, e.g. `Content-Length: abc` (answered by gunicorn, same JSON shape)")


class Unauthorized(ServiceError):
    """Every one carries ``WWW-Authenticate`` (RFC 9110 15.5.2: a 401 must say how to authenticate): ``CHALLENGE``,
    unless ``headers`` give a more precise one (RFC 6750's ``error="invalid_token"`` for a wrong token)."""

    status, code = 401, "unauthorized"
    when = ("`CLASSIFIER_API_TOKEN` (on /metrics: `CLASSIFIER_METRICS_TOKEN`, else the API token) is set and the "
            "request lacks `Authorization: Bearer <token>`, or its token is wrong (the message says which); every "
            "401 carries `WWW-Authenticate: Bearer realm=\"classifier\"`")
    settings = ("API_TOKEN", "METRICS_TOKEN")
    CHALLENGE = 'Bearer realm="classifier"'

    def __init__(self, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message, headers={"WWW-Authenticate": self.CHALLENGE, **(headers or {})})


class LengthRequired(ServiceError):
    status, code = 411, "length_required"
    when = ("an HTTP/1.0 POST without Content-Length: its body's length cannot be known (RFC 1945 8.3; HTTP/1.1 "
            "may send `Transfer-Encoding: chunked` instead)")

    @classmethod
    def http10(cls) -> "LengthRequired":
        """An HTTP/1.0 request that may carry a body the server cannot delimit (gunicorn reads it as none)."""
        return cls("an HTTP/1.0 request with a body needs a Content-Length header (without one its length cannot "
                   "be known); send Content-Length, or use HTTP/1.1")


class TooLarge(ServiceError):
    status, code = 413, "too_large"
    when = ("body over the byte limit; too many files (or more than a worker's queue holds); too many pixels in a "
            "photo or in the request's photos together (read from the headers, before decoding); a JPEG, PNG or GIF "
            "of far more scans, segments, chunks or extension blocks than a photo has (formats.too_many_parts)")
    settings = ("MAX_UPLOAD_BYTES", "MAX_FILES", "MAX_PIXELS", "MAX_REQUEST_PIXELS", "QUEUE_SIZE")

    @classmethod
    def queue(cls, n: int, queue_size: int) -> "TooLarge":
        """``n`` images in one request, more than a worker's queue holds (``QUEUE_SIZE``): never servable."""
        return cls(f"{n} photos in one request, and this server queues at most {queue_size} images "
                   f"(CLASSIFIER_QUEUE_SIZE): send at most {queue_size} per request")

    @classmethod
    def body(cls, limit: int, declared: int | None = None) -> "TooLarge":
        """A request body over ``limit`` bytes (``MAX_UPLOAD_BYTES``): of ``declared`` bytes (its Content-Length),
        or None where it came chunked (counted as it came)."""
        size = f"is {declared:,} bytes; the limit is {limit:,}" if declared else f"is larger than {limit:,} bytes"
        return cls(f"the upload {size} (CLASSIFIER_MAX_UPLOAD_BYTES): send fewer photos per request, or smaller "
                   f"ones (scaled down: the model looks at far fewer pixels than a phone photo has)")

    @classmethod
    def form(cls, parts: int | None, field_bytes: int | None, max_files: int) -> "TooLarge":
        """A multipart form within the byte limit but over Werkzeug's form limits: more than ``parts``
        parts, or a text field over ``field_bytes`` (None: no such limit)."""
        limits = ", ".join(x for x in (f"{parts:,} parts" if parts else "",
                                        f"{field_bytes:,} bytes per text field" if field_bytes else "") if x)
        return cls(f"the form has too many parts or too large a text field (at most {limits}; a request holds at "
                   f"most {max_files} files, CLASSIFIER_MAX_FILES, each with its original_* fields)")

    @classmethod
    def file(cls, size: int | None, limit: int) -> "TooLarge":
        """One file of ``size`` bytes over ``limit`` (the CLI's and Ray Data's files, read from disk); ``size``
        None: more than ``limit`` bytes came from a file whose size said less (it grew, or a pipe)."""
        if size is None:
            return cls(f"the file is larger than {limit:,} bytes (CLASSIFIER_MAX_UPLOAD_BYTES)")
        return cls(f"the file is {size:,} bytes; the limit is {limit:,} (CLASSIFIER_MAX_UPLOAD_BYTES)")


def check_file_size(size: int, limit: int) -> None:
    """The upload byte limit for a file read from disk (no HTTP body to measure).

    :raises TooLarge: ``size`` bytes > ``limit`` bytes.
    """
    if size > limit:
        raise TooLarge.file(size, limit)


class NotAnImage(ServiceError):
    status, code = 415, "unsupported_media_type"
    when = ("not JPEG/PNG/WebP/GIF/BMP/TIFF/AVIF/PPM (PDF, HEIC, text... named in the message; base64 or hex text "
            "of a photo, or a `data:` URL, said so), a 12-bit, lossless or arithmetic-coded CMYK JPEG, a raw body "
            "whose Content-Type is not `image/*` or `application/octet-stream`, or an upload with a "
            "`Content-Encoding` (gzip...: `Accept-Encoding: identity` says what is taken; `/v2` takes gzip and deflate) "
            "or a `Transfer-Encoding` that compresses (gzip, deflate, compress, beside chunked; a coding HTTP does "
            "not know at all is gunicorn's 501 `http_error`)")


class Overloaded(ServiceError):
    status, code, retryable = 429, "overloaded", True
    when = ("this worker predicts it would answer later than the latency budget (from the photos it is decoding "
            "and has queued, and their measured cost), or its queue is full; answered before the body is read, "
            "`Retry-After` from the same prediction (what the headers refuse gets its 411/415/400 first; a photo "
            "over half the budget to decode, while such a one decodes here, gets it once its headers are read)")
    settings = ("MAX_WAIT_MS", "QUEUE_SIZE")


class RateLimited(ServiceError):
    status, code, retryable = 429, "rate_limited", True
    when = "this client address sent more than the rate limit allows; `Retry-After` says when to try again"
    settings = ("RATE_LIMIT",)


class NotReady(ServiceError):
    status, code, retryable = 503, "not_ready", True
    when = "warming up, self-test failed, or shutting down; `Retry-After` says when to try again"


class BodyTimeout(ServiceError):
    status, code = 408, "body_timeout"
    when = ("the client stopped sending its body for longer than the body timeout; the connection is closed "
            "(a stalled upload cannot hold a worker's connection)")
    settings = ("BODY_TIMEOUT_S",)

    @classmethod
    def after(cls, seconds: float) -> "BodyTimeout":
        """No byte of the body arrived for ``seconds`` (``BODY_TIMEOUT_S``)."""
        return cls(f"no byte of the request body arrived for {seconds:g} s (CLASSIFIER_BODY_TIMEOUT_S); "
                   f"send the whole body without pausing")


class InferenceTimeout(ServiceError):
    status, code = 504, "timeout"
    when = ("no result within the request timeout (decoding included); the image is dropped from its batch if not "
            "yet run")
    settings = ("REQUEST_TIMEOUT_S",)

    @classmethod
    def after(cls, seconds: float, where: str = "server") -> "InferenceTimeout":
        """No result within ``seconds`` (``REQUEST_TIMEOUT_S``); ``where`` is overloaded (server, cluster)."""
        return cls(f"no result within {seconds:g} s (CLASSIFIER_REQUEST_TIMEOUT_S); the {where} is overloaded, try again later"
                   + (" (under a second, one photo's own work may take longer: its operator can raise it)" if seconds < 1 else ""))

    @classmethod
    def decoding(cls, seconds: float, formats: Iterable[str | None] = ()) -> "InferenceTimeout":
        """Its photos were still being decoded at ``seconds`` (``REQUEST_TIMEOUT_S``): not only an overload,
        the photos themselves may be slow to decode, so the message says both. ``formats``: the request's photos'
        formats (``formats.claimed_format``); those other than JPEG (lossless ones: PNG, TIFF...; a large one
        decodes for seconds) are named as the possible cause, and a request of JPEGs is not told of PNGs
        (tryout17: a tiny request timeout on small JPEGs blamed "large PNG, TIFF or WebP images")."""
        slow = sorted({f for f in formats if f and f != "JPEG"})
        maybe = (f", or its {' and '.join(slow)} images are slow to decode (a large lossless one takes seconds)"
                 if slow else "")
        return cls(f"no result within {seconds:g} s (CLASSIFIER_REQUEST_TIMEOUT_S): its photos were still being "
                   f"decoded; the server is busy{maybe}: try again later, or send fewer or smaller photos per request")


class NotFound(ServiceError):
    status, code = 404, "not_found"
    when = "no such route"


class MethodNotAllowed(ServiceError):
    status, code = 405, "method_not_allowed"
    when = "the route exists, not with this method (e.g. `GET /api/v1/predict`)"


class InferenceFailed(ServiceError):
    status, code = 500, "inference_failed"
    when = "the model raised on this image's batch (logged; other batches unaffected)"


class InternalError(ServiceError):
    status, code = 500, "internal_error"
    when = "an unexpected error (logged on the server, never sent)"


# The table, in the README's order.
ERRORS: tuple[type[ServiceError], ...] = (
    NoFile, UndecodableImage, BadRequest, Unauthorized, BodyTimeout, LengthRequired, TooLarge, NotAnImage, Overloaded,
    RateLimited, NotReady, InferenceTimeout, NotFound, MethodNotAllowed, InferenceFailed, InternalError)
for _cls in ERRORS:  # each row's docstring is its own words, not a second copy of them
    _cls.__doc__ = f"{_cls.status} ``{_cls.code}``: {_cls.when}."
BY_CODE: dict[str, type[ServiceError]] = {cls.code: cls for cls in ERRORS}
RETRYABLE: tuple[str, ...] = tuple(cls.code for cls in ERRORS if cls.retryable)
# Werkzeug's HTTP errors that have a row of their own; any other becomes "http_error" with its status.
_HTTP = {404: NotFound, 405: MethodNotAllowed, 413: TooLarge, 429: RateLimited}
# The table's last row: no class (no one status), the code and words for every HTTP error without a row,
# answered by the app's handler (Werkzeug's unlisted ones) or by gunicorn before the app sees the request.
OTHER_HTTP_CODE = "http_error"
OTHER_HTTP_WHEN = ("any other HTTP error, with its own status in the same JSON shape: e.g. a request line over "
                   "gunicorn's limit (414) or too many or too large headers (431), refused by gunicorn before the "
                   "app sees the request")


def is_v2(path: str | None) -> bool:
    """Whether ``path`` is under ``/v2``, the Open Inference Protocol's routes (their own error shape)."""
    return bool(path) and (path == "/v2" or path.startswith("/v2/") or path.startswith("/v2?"))


def error_body(path: str | None, code: str, message: str, status: int) -> dict:
    """An error's JSON body for a request to ``path`` (None: unknown): the protocol's ``{"error": "<code>:
    <message>"}`` under ``/v2`` (its clients read a string), else ``{"error": {"code", "message", "status"}}``.
    The one handler, gunicorn's refusals (webapp/worker.py) and the master's 503 (webapp/responder.py) all use it."""
    if is_v2(path):
        return {"error": f"{code}: {message}"}
    return {"error": {"code": code, "message": message, "status": status}}


class ClientGone(ServiceError):
    """499 ``client_gone``: the client hung up before its photos were decoded or run, so they were not.

    Not a row of the table: no one is there to read it. The request ends with it so that the access
    log and ``/metrics`` show it (499 is nginx's "client closed request"); the worker logs it at info.
    """

    status, code = 499, "client_gone"

    @classmethod
    def before(cls, stage: str) -> "ClientGone":
        """The client was gone before ``stage`` ("its photos were decoded", "... queued", "its batch ran")."""
        return cls(f"the client closed the connection before {stage}; nothing more was done for it")


class StartupError(RuntimeError):
    """The service cannot start (no weights, bad weights file, failed self-test); the message says what to do."""


def from_dict(error: dict, headers: dict[str, str] | None = None) -> ServiceError:
    """Rebuild the ``ServiceError`` whose ``to_dict()["error"]`` is ``error`` (same class, status, code).

    A Ray Serve model replica answers errors as data (webapp/cluster/); the HTTP replica raises
    them again here so the one error handler renders them. An unknown code gives a plain 500.
    """
    cls = BY_CODE.get(error.get("code"), ServiceError)
    return cls(str(error.get("message", "internal server error")), headers=headers)


def markdown_table() -> str:
    """The README's "Limits and errors" table, one row per code, from ``ERRORS`` (a test keeps it in step)."""
    rows = ["| status | code | when | setting |", "|---|---|---|---|"]
    for cls in ERRORS:
        setting = ", ".join(f"`CLASSIFIER_{name}`" for name in cls.settings)
        rows.append(f"| {cls.status} | `{cls.code}` | {cls.when} | {setting} |")
    rows.append(f"| other | `{OTHER_HTTP_CODE}` | {OTHER_HTTP_WHEN} |  |")
    return "\n".join(rows)


# Routes outside /api/ and /v2 whose errors are JSON whatever the client accepts (a 405 for `PUT /openapi.json`
# too): the API blueprint's probes and document, and /metrics. The page (/, its assets) answers its HTML page.
API_PATHS = ("/healthz", "/readyz", "/openapi.json", "/metrics")


def rate_limit_wait(app) -> int | None:
    """Seconds until the rate limit that refused this request lets the client in again (>= 1: a client told 0
    is refused again), from Flask-Limiter's window for it; None where no limiter or window is known.

    Its own hook writes that Retry-After only after the response is made, too late for the page and the
    message, which are drawn here (``webapp/access.py`` keeps a Retry-After already set)."""
    for limiter in app.extensions.get("limiter", ()):
        try:
            limit = limiter.current_limit
            if limit is not None:
                return max(1, int(limit.reset_at - time.time()))
        except Exception:  # storage unreachable: the words say "later", as before
            return None
    return None


def not_served(path: str) -> str:
    """The 404's words for a /v2 path of a protocol extension this server does not serve (Triton's own)."""
    return (f"{path[:200]} is not served here: this server speaks the Open Inference Protocol's health, metadata "
            f"and infer endpoints (GET /v2 lists its extensions), not Triton's model repository, configuration, "
            f"statistics, trace, logging or shared memory ones")


def init_errors(app, settings) -> None:
    """Register the one error handler on ``app``: JSON for the API, the page for the UI, and
    ``{"error": "<code>: <message>"}`` under ``/v2`` (the Open Inference Protocol's shape).

    ``ServiceError``s render as themselves; Werkzeug's HTTP errors by their row (404, 405, 413, 429;
    others as ``http_error``); any other exception is logged with its traceback and answered 500
    ``internal_error`` without it.
    """
    from flask import g, jsonify, render_template, request
    from werkzeug.exceptions import HTTPException

    def wants_json() -> bool:
        # (/healthz/ too: a probe or scrape with a slip got the page's HTML 404; tryout18)
        return request.path.startswith("/api/") or request.path.rstrip("/") in API_PATHS \
            or request.accept_mimetypes.best == "application/json"

    def render(status: int, code: str, message: str, headers: dict | None = None):
        g.error_code = code  # /metrics counts requests by it (webapp/metrics.py)
        body = error_body(request.path, code, message, status)  # under /v2: the protocol's shape (webapp/v2.py)
        if is_v2(request.path) or wants_json():
            resp = jsonify(body)
        else:
            classifier = app.extensions["classifier"]
            resp = app.response_class(
                render_template("index.html", model=classifier.describe(), ready=classifier.ready, answer=None,
                                error=body["error"], topk=settings.TOP_K,
                                retry_after=(headers or {}).get("Retry-After")), mimetype="text/html")
        resp.status_code = status
        resp.headers.update(headers or {})
        return resp

    @app.errorhandler(ServiceError)
    def service_error(exc: ServiceError):
        # The access log has the status only: the server's own failures (504 past REQUEST_TIMEOUT_S, a 503 of a
        # worker that is stopping or broken) get a warning with the reason; a client's (4xx) a debug line.
        app.logger.log(logging.WARNING if exc.status >= 500 else logging.DEBUG, "%s %s: %d %s: %s", request.method,
                       request.path, exc.status, exc.code, exc.message)
        return render(exc.status, exc.code, exc.message, exc.headers)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        row = _HTTP.get(exc.code)
        code = row.code if row else OTHER_HTTP_CODE
        message = exc.description or exc.name
        headers = None
        if row is RateLimited:  # Flask-Limiter's refusal: its Retry-After, known now, in the words and the page too
            wait = rate_limit_wait(app)
            message = (f"too many requests from this address (limit {exc.description}); "
                       + (f"try again in {wait} s" if wait else "try again later"))
            headers = {"Retry-After": str(wait)} if wait else None
        if row is MethodNotAllowed and getattr(exc, "valid_methods", None):  # RFC 9110 15.5.6: say which, in Allow
            allowed = sorted(set(exc.valid_methods) - {"HEAD", "OPTIONS"}) or sorted(exc.valid_methods)
            message = f"{request.method} is not allowed on {request.path}; it takes {', '.join(allowed)}"
            headers = {"Allow": ", ".join(sorted(exc.valid_methods))}
        if row is TooLarge:  # answered before the body is read; webapp/bodies.py closes and drains after
            declared = request.content_length
            if declared is not None and declared <= settings.MAX_UPLOAD_BYTES:  # within it: the form's limits
                message = TooLarge.form(request.max_form_parts, request.max_form_memory_size, settings.MAX_FILES).message
            else:
                message = TooLarge.body(settings.MAX_UPLOAD_BYTES, declared).message
        if row is NotFound and is_v2(request.path):  # a Triton extension's path (tryout19: get_model_config's 404
            # said "If you entered the URL manually please check your spelling")
            message = not_served(request.path)
        return render(exc.code or 500, code, message, headers)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        app.logger.exception("unhandled error on %s %s", request.method, request.path)
        return render(500, InternalError.code, "internal server error; it is logged on the server")
