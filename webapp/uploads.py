"""Read the image(s) out of a request: multipart field ``file`` (one or several) or a raw image body.

HTTP only: no decoding here. Filenames are kept as the client sent them, only to be echoed
(escaped by JSON and Jinja); they are never used as paths, and nothing is written to disk.
"""

from __future__ import annotations

from flask import Request

from .errors import BadRequest, NoFile, NotAnImage, TooLarge
from .service import Upload

RAW_TYPES = ("application/octet-stream",)


def parse_topk(raw: str | None, default: int) -> int:
    """``topk`` query/form value -> int in 1..10.

    :raises BadRequest: not an integer in 1..10 (400).
    """
    if raw is None or raw == "":
        return default
    try:
        k = int(raw)
    except ValueError:
        raise BadRequest(f"topk must be an integer from 1 to 10, got {raw[:40]!r}") from None
    if not 1 <= k <= 10:
        raise BadRequest(f"topk must be an integer from 1 to 10, got {k}")
    return k


def _clean_name(name: str | None) -> str:
    # Keep what the client sent (non-ASCII and emoji included) for display; cap the length.
    name = (name or "").replace("\x00", "")
    return name[:255] or "upload"


def read_uploads(request: Request, *, max_files: int) -> list[Upload]:
    """The uploads in ``request``, in order.

    :raises NoFile: multipart without a ``file`` part, or with only empty ones (400).
    :raises TooLarge: more than ``max_files`` files (413); a body over the byte limit is
        refused by Werkzeug (413) as soon as it is read.
    :raises NotAnImage: a raw body whose Content-Type is not ``image/*`` (415).
    """
    mimetype = request.mimetype
    if mimetype == "multipart/form-data":
        parts = [f for f in request.files.getlist("file")]
        if not parts:
            other = ", ".join(sorted(request.files)) or "none"
            raise NoFile(f"no image: send it as multipart field 'file' (file fields received: {other})")
        if len(parts) > max_files:
            raise TooLarge(f"{len(parts)} files in one request; the limit is {max_files} (CLASSIFIER_MAX_FILES)")
        uploads = [Upload(_clean_name(p.filename), p.read()) for p in parts]
        if all(not (u.data) for u in uploads) and all(not p.filename for p in parts):
            raise NoFile("no image: the 'file' field is empty; choose a photo first")
        return uploads
    if mimetype.startswith("image/") or mimetype in RAW_TYPES:
        name = request.headers.get("X-Filename") or "upload"
        return [Upload(_clean_name(name), request.get_data(cache=False))]
    raise NotAnImage(f"Content-Type {mimetype or '(none)'} is not accepted: send multipart/form-data with an "
                     f"image in field 'file', or the raw image with Content-Type image/*")
