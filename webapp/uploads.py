"""Read the image(s) out of a request: multipart field ``file`` (one or several) or a raw image body.

HTTP only: no decoding here. Filenames are kept as the client sent them, only to be echoed
(escaped by JSON and Jinja); they are never used as paths, and nothing is written to disk.
"""

from __future__ import annotations

import io

from flask import Request
from werkzeug.exceptions import HTTPException

from .errors import BadRequest, NoFile, NotAnImage, TooLarge, drain_body
from .contract import Upload

RAW_TYPES = ("application/octet-stream",)

class UploadRequest(Request):
    """Flask's request, with multipart files kept in memory: an upload never touches the disk.

    (Werkzeug spools file parts over 500 KB to a temporary file by default.) Memory stays
    bounded by ``MAX_CONTENT_LENGTH``, which is checked before parsing.
    """

    def _get_file_stream(self, total_content_length, content_type, filename=None, content_length=None):
        return io.BytesIO()


def parse_topk(raw: str | None, default: int) -> int:
    """``topk`` query/form value -> int in 1..10.

    :raises BadRequest: not an integer in 1..10 (400).
    """
    if raw is None or raw == "":
        return default
    # ASCII digits only: int() would also take " 3", "3_0" and other scripts' digits ("٣").
    if not (raw.isascii() and raw.isdigit() or raw.startswith("-") and raw[1:].isascii() and raw[1:].isdigit()):
        raise BadRequest(f"topk must be an integer from 1 to 10, got {raw[:40]!r}")
    digits = raw.lstrip("-").lstrip("0") or "0"
    if len(digits) > 2:  # int() refuses over 4300 digits (a 500); nothing that long is in range
        raise BadRequest(f"topk must be an integer from 1 to 10, got {raw[:40]!r}")
    k = int(digits) * (-1 if raw.startswith("-") else 1)
    if not 1 <= k <= 10:
        raise BadRequest(f"topk must be an integer from 1 to 10, got {k}")
    return k


def _clean_name(name: str | None) -> str:
    # Keep what the client sent (non-ASCII and emoji included) for display; cap the length.
    name = (name or "").replace("\x00", "")
    return name[:255] or "upload"


def _over_limit(request: Request) -> bool:
    """True if a body sent without Content-Length (chunked) went past ``MAX_CONTENT_LENGTH``.

    Werkzeug stops reading such a body at the limit without saying so; one more byte tells.
    """
    limit = request.max_content_length
    if request.content_length is not None or limit is None:
        return False
    try:
        return bool(request.environ["wsgi.input"].read(1))
    except Exception:
        return False


def _too_large(request: Request) -> TooLarge:
    drain_body(request.environ)
    return TooLarge.body(request.max_content_length)


def read_uploads(request: Request, *, max_files: int) -> list[Upload]:
    """The uploads in ``request``, in order.

    :raises NoFile: multipart without a ``file`` part, or with only empty ones (400).
    :raises TooLarge: more than ``max_files`` files, or a body over ``MAX_CONTENT_LENGTH`` (413;
        Werkzeug raises its own 413 when Content-Length already says so).
    :raises BadRequest: a malformed multipart body (400).
    :raises NotAnImage: a raw body whose Content-Type is not ``image/*`` (415).
    """
    mimetype = request.mimetype
    if mimetype == "multipart/form-data":
        try:
            parts = list(request.files.getlist("file"))
        except HTTPException as exc:
            if exc.code == 413 or _over_limit(request):
                raise _too_large(request) from None
            raise BadRequest(f"malformed multipart body: {exc.description}") from None
        if _over_limit(request):
            raise _too_large(request)
        if not parts:
            other = ", ".join(sorted(request.files)) or "none"
            raise NoFile(f"no image: send it as multipart field 'file' (file fields received: {other})")
        if len(parts) > max_files:
            raise TooLarge(f"{len(parts)} files in one request; the limit is {max_files} (CLASSIFIER_MAX_FILES)")
        uploads = [Upload(_clean_name(p.filename), p.read()) for p in parts]
        if all(not u.data for u in uploads) and all(not p.filename for p in parts):
            raise NoFile("no image: the 'file' field is empty; choose a photo first")
        return uploads
    if mimetype.startswith("image/") or mimetype in RAW_TYPES:
        name = request.headers.get("X-Filename") or "upload"
        data = request.get_data(cache=False)
        if _over_limit(request):
            raise _too_large(request)
        return [Upload(_clean_name(name), data)]
    raise NotAnImage(f"Content-Type {mimetype or '(none)'} is not accepted: send multipart/form-data with an "
                     f"image in field 'file', or the raw image with Content-Type image/*")
