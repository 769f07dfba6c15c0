"""What a request's line and headers decide, before its body is read: the refusals (411, 415, 400) that need
no body, and the names and forms of the fields an upload's form shares with its query (``topk``, the
``original_*`` fields). ``webapp/uploads.py`` reads the body itself.
"""

from __future__ import annotations

from flask import Request

from .errors import BadRequest, LengthRequired, NoFile, NotAnImage

RAW_TYPES = ("application/octet-stream",)
SPACE = " \t\r\n"  # ASCII whitespace around a text field's value, dropped

# Multipart form fields describing the photo a client scaled before upload, one value per ``file``
# part, in the same order: all four or none (see ``read_originals``).
ORIGINAL_FIELDS = ("original_width", "original_height", "original_format", "original_bytes")
# The multipart fields read as text: ``topk`` and the ``original_*`` ones.
TEXT_FIELDS = ("topk", *ORIGINAL_FIELDS)
SAMPLE = dict(topk="5", original_width="4000", original_height="3000", original_format="PNG", original_bytes="3250000")


def parse_topk(raw: str | None, default: int) -> int:
    """``topk`` query/form value -> int in 1..10 (``default`` when absent or blank). :raises BadRequest: not an
    integer in 1..10 (400)."""
    if raw is not None:  # a file's final newline (curl -F 'topk=<file'), spaces around it: as _int_field
        raw = raw.strip(SPACE)
    if raw is None or raw == "":
        return default
    if not (raw.isascii() and raw.isdigit() or raw.startswith("-") and raw[1:].isascii() and raw[1:].isdigit()):
        # ASCII digits only: int() would also take "3_0" and other scripts' digits ("٣").
        raise BadRequest(f"topk must be an integer from 1 to 10, got {raw[:40]!r}")
    digits = raw.lstrip("-").lstrip("0") or "0"
    if len(digits) > 2:  # int() refuses over 4300 digits (a 500); nothing that long is in range
        raise BadRequest(f"topk must be an integer from 1 to 10, got {raw[:40]}{'...' if len(raw) > 40 else ''}")
    k = int(digits) * (-1 if raw.startswith("-") else 1)
    if not 1 <= k <= 10:
        raise BadRequest(f"topk must be an integer from 1 to 10, got {k}")
    return k


def no_body(request: Request) -> bool:
    """True when the request carries no body: ``Content-Length: 0``, or neither a length nor chunked encoding."""
    length = request.content_length
    return length == 0 if length is not None else "chunked" not in request.headers.get("Transfer-Encoding", "").lower()


def require_length(request: Request) -> None:
    """Refuse an HTTP/1.0 request without Content-Length before reading it: HTTP/1.0 has no chunked encoding, so
    its body (if it sent one) can only be delimited by its length. gunicorn reads it as no body at all, and the
    photo the client did send was answered "the file is empty (0 bytes)" (or "no body").

    :raises LengthRequired: HTTP/1.0 and no Content-Length (411).
    """
    if request.environ.get("SERVER_PROTOCOL") == "HTTP/1.0" and request.content_length is None:
        raise LengthRequired.http10()


def require_identity(request: Request) -> None:
    """Refuse a body sent with a ``Content-Encoding`` (gzip, br...), or a transfer coding besides chunked, before
    reading it: it would be read as the
    photo's own bytes and answered as "a gzip file" or a malformed multipart body. Photos are compressed already;
    ``/v2``'s JSON, which is not, takes gzip and deflate (``webapp/v2.py``). RFC 9110 15.5.16 and 12.5.3: 415,
    with ``Accept-Encoding`` naming what is accepted.

    :raises NotAnImage: a Content-Encoding other than identity, a Transfer-Encoding other than chunked (415).
    """
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding not in ("", "identity"):
        raise NotAnImage(f"Content-Encoding {coding[:40]} is not accepted here: send the photo as it is, uncompressed "
                         f"(JPEG, PNG and WebP are compressed already)", headers={"Accept-Encoding": "identity"})
    require_plain_transfer(request)


def require_plain_transfer(request: Request) -> None:
    """Refuse a transfer coding besides chunked before reading the body: gunicorn takes "Transfer-Encoding: gzip,
    chunked" and undoes only the chunking, so the gzip bytes were read as the photo (or /v2's JSON).

    :raises NotAnImage: a Transfer-Encoding other than chunked (415).
    """
    transfer = [c.strip() for c in request.headers.get("Transfer-Encoding", "").lower().split(",") if c.strip()]
    if [c for c in transfer if c not in ("chunked", "identity")]:
        raise NotAnImage(f"Transfer-Encoding {', '.join(transfer)[:60]} is not accepted here: send the body "
                         f"uncompressed, with Content-Length or Transfer-Encoding: chunked alone")


def check_headers(request: Request) -> None:
    """Refuse what the request line and headers decide, before admission and before the body is read: a request
    that cannot be valid gets its own 4xx, not a ``429`` whose ``Retry-After`` says to send it again as it is (under
    load, a text/plain body, a gzip one, an empty one and ``?topk=99`` each got 429 about as often as their
    answer: tryout32). The routes call it before ``admit``; ``read_uploads`` relies on it.

    :raises LengthRequired: HTTP/1.0 without Content-Length (411, ``require_length``).
    :raises NotAnImage: a Content-Encoding (415, ``require_identity``); a body that is neither multipart/form-data
        nor an image type (415).
    :raises BadRequest: an ``original_*`` field or a ``topk`` not in 1..10 in the query string; multipart/form-data
        without a boundary (400).
    :raises NoFile: no body at all, of a type that is not an upload's (400).
    """
    require_length(request)
    require_identity(request)
    if in_query := [f for f in ORIGINAL_FIELDS if f in request.args]:  # read only beside their files: was ignored
        raise BadRequest(f"{in_query[0]} is a multipart form field, not a query parameter: one per file part, beside "
                         f"the file (the answer would have described the photo sent, not its original), e.g. curl "
                         f"-F 'file=@photo.jpg' -F '{in_query[0]}={SAMPLE[in_query[0]]}'")
    parse_topk(request.args.get("topk"), 1)  # (request_topk reads it again, or the form's where the query has none)
    mimetype = request.mimetype
    if mimetype == "multipart/form-data":
        if not request.mimetype_params.get("boundary"):
            raise BadRequest("malformed multipart body: Content-Type multipart/form-data has no boundary "
                             "parameter (multipart/form-data; boundary=...)")
        return
    if mimetype.startswith("image/") or mimetype in RAW_TYPES:
        return
    if no_body(request):  # nothing sent at all: no photo, whatever the Content-Type says
        raise NoFile("no image: the request has no body; send the photo as multipart field 'file', or as the raw "
                     "body with Content-Type image/*")
    form = {  # what sent it, and what to send instead: the clients people use
        "application/x-www-form-urlencoded": " (curl -d and --data-binary send that unless told otherwise, and -d "
        "strips the file's CR and LF bytes: use -F file=@photo.jpg, or --data-binary @photo.jpg -H 'Content-Type: "
        "image/jpeg')",
        "": " (Python requests sends none for data=: use files={'file': open(path, 'rb')}, or data= with "
        "headers={'Content-Type': 'image/jpeg'})"}.get(mimetype, "")
    raise NotAnImage(f"Content-Type {mimetype or '(none)'} is not accepted{form}: send multipart/form-data with an "
                     f"image in field 'file', or the raw image with Content-Type image/*")
