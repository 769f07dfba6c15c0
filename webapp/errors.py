"""Errors are part of the API: each class carries its HTTP status and a stable code.

One handler (registered in ``create_app``) renders any of them, and Werkzeug's HTTP errors,
as ``{"error": {"code", "message", "status"}}`` for ``/api/*`` and as the page for the UI.
Messages are written for the person who sent the request: what was wrong and what to do.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base class: ``status`` (HTTP), ``code`` (stable machine-readable), ``message`` (for people).

    ``headers`` carries extra response headers (``Retry-After`` for 429).
    """

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def to_dict(self) -> dict:
        """The JSON error body: ``{"error": {"code", "message", "status"}}``."""
        return {"error": {"code": self.code, "message": self.message, "status": self.status}}


class BadRequest(ServiceError):
    """400: the request is malformed (bad ``topk``, missing form field...)."""

    status = 400
    code = "bad_request"


class NoFile(ServiceError):
    """400: no image in the request (no ``file`` part, or an empty one)."""

    status = 400
    code = "no_file"


class UndecodableImage(ServiceError):
    """400: the file claims a known image format but its data is broken (truncated, corrupt)."""

    status = 400
    code = "undecodable_image"


class TooLarge(ServiceError):
    """413: body over ``MAX_UPLOAD_BYTES``, too many files, or too many pixels."""

    status = 413
    code = "too_large"


class NotAnImage(ServiceError):
    """415: the bytes are not an image format this server can decode (or the content type is wrong)."""

    status = 415
    code = "unsupported_media_type"


class Overloaded(ServiceError):
    """429: this worker's queue is full; ``Retry-After`` says when to try again (seconds)."""

    status = 429
    code = "overloaded"


class NotReady(ServiceError):
    """503: the model is still warming up, failed its self-test, or the worker is stopping."""

    status = 503
    code = "not_ready"


class InferenceTimeout(ServiceError):
    """504: the image waited longer than ``REQUEST_TIMEOUT_S`` for its result."""

    status = 504
    code = "timeout"


class InferenceFailed(ServiceError):
    """500: the model raised on this image's batch (logged with its traceback, never sent)."""

    status = 500
    code = "inference_failed"


class StartupError(RuntimeError):
    """The service cannot start (no weights, bad weights file, failed self-test); the message says what to do."""


def from_dict(error: dict, headers: dict[str, str] | None = None) -> ServiceError:
    """Rebuild the ``ServiceError`` whose ``to_dict()["error"]`` is ``error`` (same class, status, code).

    A Ray Serve model replica answers errors as data (webapp/cluster.py); the HTTP replica raises
    them again here so the one error handler renders them. An unknown code gives a plain 500.
    """
    kinds = {cls.code: cls for cls in ServiceError.__subclasses__()}
    cls = kinds.get(error.get("code"), ServiceError)
    return cls(str(error.get("message", "internal server error")), headers=headers)
