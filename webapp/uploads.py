"""Read the image(s) out of a request: multipart field ``file`` (one or several) or a raw image body.

HTTP only: no decoding here. Filenames are kept as the client sent them, only to be echoed
(escaped by JSON and Jinja); they are never used as paths, and nothing is written to disk.
A multipart upload may also describe, per file, the original of a photo the client scaled down
before sending it (``original_width``, ``original_height``, ``original_format``, ``original_bytes``).
"""

from __future__ import annotations

import io
import re

from flask import Request
from werkzeug import formparser
from werkzeug.sansio.multipart import MultipartDecoder
from werkzeug.exceptions import HTTPException

from .errors import BadRequest, NoFile, TooLarge
from .contract import ORIGINAL_FORMATS, Original, Upload
from .headers import ORIGINAL_FIELDS, RAW_TYPES, SAMPLE, SPACE, TEXT_FIELDS, parse_topk

class UploadRequest(Request):
    """Flask's request, with multipart files kept in memory: an upload never touches the disk.

    (Werkzeug spools file parts over 500 KB to a temporary file by default.) Memory stays
    bounded by ``MAX_CONTENT_LENGTH``, which is checked before parsing.
    """

    form_error: str | None = None  # why Werkzeug could not parse the multipart body (None: it could)

    def _get_file_stream(self, total_content_length, content_type, filename=None, content_length=None):
        return io.BytesIO()

    def make_form_data_parser(self):
        """Werkzeug's parser, told not to swallow its parse errors: ``_load_form_data`` keeps the reason."""
        parser = super().make_form_data_parser()
        parser.silent = False
        return parser

    def _load_form_data(self) -> None:
        """As Werkzeug's, but a body it cannot parse leaves ``form_error`` saying why (Werkzeug's silent mode
        would leave only an empty form, which reads as "no file"); the form and files stay empty, as there."""
        try:
            super()._load_form_data()  # returns at once when the form is parsed already
        except ValueError as exc:  # UnicodeDecodeError included
            self.form_error = str(exc)[:200]
            self.__dict__["form"] = self.parameter_storage_class()
            self.__dict__["files"] = self.parameter_storage_class()


_LINE_BREAK = re.compile(rb"(\r\n|\n|\r)")  # Werkzeug ends a part's header line at any of these
# The HTML standard's multipart/form-data encoding of a line break in a field or file name.
_NAME_BREAK = {b"\r\n": b"%0D%0A", b"\n": b"%0A", b"\r": b"%0D"}


def _open_quote(line: bytes) -> bool:
    """Whether ``line`` ends inside a quoted string (an odd count of ``"`` not escaped by a backslash)."""
    return len(re.findall(rb'(?<!\\)"', line)) % 2 == 1


class LenientHeadersDecoder(MultipartDecoder):
    """Werkzeug's multipart decoder, reading each part's header lines as UTF-8, and a line that is not
    UTF-8 as Latin-1 (HTTP's historical charset): ``curl -F file=@café.jpg`` on a system whose file names
    are Latin-1 sends the name's raw bytes, and Werkzeug's strict UTF-8 would drop the whole form.

    A raw CR or LF inside a quoted ``filename`` (a hand-made client; browsers send ``%0D``/``%0A``)
    would end the ``Content-Disposition`` line there and leave the part without a filename, so the
    photo read as a text field (a misleading 400). Where a line ends inside a quoted string and the
    next line closes it, the two are one header: the break is written as a browser writes it (``%0D``,
    ``%0A``), so the name echoed is the one a browser upload of that file would show."""

    def _parse_headers(self, data):
        pieces = _LINE_BREAK.split(bytes(data))  # line, break, line, break, ..., line
        lines, breaks = pieces[0::2], pieces[1::2]
        joined: list[bytes] = []
        i = 0
        while i < len(lines):
            line = lines[i]
            if _open_quote(line):  # the first later line with a quote closes it (none folded in between)
                j = next((k for k in range(i + 1, len(lines)) if b'"' in lines[k] or lines[k][:1] in (b" ", b"\t")),
                         None)
                if j is not None and b'"' in lines[j] and lines[j][:1] not in (b" ", b"\t"):
                    for k in range(i + 1, j + 1):
                        line += _NAME_BREAK[breaks[k - 1]] + lines[k]
                    i = j
            joined.append(line)
            i += 1
        lines = [utf8_or_latin1(line).encode("utf-8") for line in joined]
        return super()._parse_headers(b"\r\n".join(lines))


def utf8_or_latin1(raw: bytes) -> str:
    """``raw`` as UTF-8 text where it is that, else as Latin-1 (which every byte string is)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def lenient_multipart_headers() -> None:
    """Make Werkzeug's multipart parser use ``LenientHeadersDecoder`` (it has no hook for its decoder class,
    so this sets the name ``werkzeug.formparser`` looks it up by; ``create_app`` calls it, idempotent)."""
    formparser.MultipartDecoder = LenientHeadersDecoder





def request_topk(request, default: int) -> int:
    """A request's ``topk``: the query's, else a multipart form's field (as the page's form sends it; any other body
    type is refused by its headers) -> int in 1..10 (``parse_topk``). :raises BadRequest: not in 1..10 (400)."""
    raw = request.args.get("topk")
    if raw is None and request.mimetype == "multipart/form-data":
        raw = request.form.get("topk")
    return parse_topk(raw, default)


def _int_field(field: str, raw: str, lo: int, hi: int) -> int:
    """``raw`` as an integer in ``lo..hi``.

    :raises BadRequest: not plain ASCII digits, or out of range (400, naming ``field``).
    """
    # ASCII digits only, and few of them: int() takes "3_0", other scripts' digits, and refuses over 4300
    # digits with a ValueError. Around them, ASCII whitespace is dropped, as original_format's is: curl's
    # -F 'original_width=<file' sends the file's final newline.
    raw = raw.strip(SPACE)
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 20):
        raise BadRequest(f"{field} must be an integer from {lo} to {hi}, got {raw[:40]!r}")
    value = int(raw)
    if not lo <= value <= hi:
        raise BadRequest(f"{field} must be an integer from {lo} to {hi}, got {value}")
    return value


def read_originals(form, files: int) -> list[Original | None]:
    """The ``original_*`` form fields of a multipart upload of ``files`` file parts: one ``Original``
    per part, in order (None for a part whose four values are all empty: sent as it is, beside scaled copies);
    ``[None] * files`` when the client sent none of them.

    :raises BadRequest: some of the four fields and not the others, a count other than one per
        file part, a width or height not an integer in 1..65535, a byte size not in 1..2**40, or a
        format not in ``contract.ORIGINAL_FORMATS`` (400, naming the field).
    """
    values = {f: form.getlist(f) for f in ORIGINAL_FIELDS}
    if not any(values.values()):
        return [None] * files
    for f in ORIGINAL_FIELDS:
        if not values[f]:
            raise BadRequest(f"{f} is missing: {', '.join(ORIGINAL_FIELDS)} describe the original of a photo "
                             f"scaled before upload and go together")
        if len(values[f]) != files:
            raise BadRequest(f"{f}: {len(values[f])} value(s) for {files} file(s); send one per file part, "
                             f"in the same order")
    out = []
    for width, height, fmt, size in zip(*values.values()):
        if not any(v.strip() for v in (width, height, fmt, size)):  # all four empty: this part is not a copy
            out.append(None)
            continue
        name = fmt.strip(SPACE).upper()
        if name not in ORIGINAL_FORMATS:
            raise BadRequest(f"original_format must be one of {', '.join(ORIGINAL_FORMATS)}, got {fmt[:40]!r}")
        out.append(Original(width=_int_field("original_width", width, 1, Original.MAX_SIDE),
                            height=_int_field("original_height", height, 1, Original.MAX_SIDE),
                            format="JPEG" if name == "MPO" else name,  # Pillow's name for a JPEG: reported as one
                            bytes=_int_field("original_bytes", size, 1, Original.MAX_BYTES)))
    return out


def _longer_than_empty(request: Request, boundary: str) -> bool:
    """True if the body is longer than a multipart body with no part at all (``--boundary--``)."""
    return (request.content_length or 0) > len(boundary) + 8


_FILENAME = re.compile(r'filename="((?:[^"\\]|\\.)*)"')


def _part_name(part) -> str | None:
    """A multipart file's name as the client sent it, Windows paths' backslashes kept.

    Some Windows clients send ``filename="C:\\Users\\x\\pic.jpg"`` with bare backslashes, which the
    quoted-string rules Werkzeug applies read as escapes (``C:Usersxpic.jpg``); the raw header still has them. A
    backslash before ``"`` escapes it (as curl sends one), no separator: ``a\\"b.jpg`` was ``"b.jpg`` (tryout30)."""
    raw = _FILENAME.search(part.headers.get("Content-Disposition", ""))
    return raw.group(1).replace('\\"', '"') if raw and "\\" in raw.group(1) else part.filename


def _part_bytes(part) -> bytes:
    """A file part's bytes. From our in-memory stream (``UploadRequest``) without a copy: ``getvalue()``
    hands over the BytesIO's own buffer (CPython shrinks it in place), where ``read()`` would copy it, a
    second 3 MB per 12 MP upload in flight."""
    stream = part.stream
    return stream.getvalue() if isinstance(stream, io.BytesIO) else part.read()


def _clean_name(name: str | None) -> str:
    """The name echoed for a photo: its last path component (``C:\\x\\pic.jpg`` and ``../../etc/pic.jpg`` are
    ``pic.jpg``: RFC 7578 section 4.2, a path says where the file was on the client), NULs dropped, at most 255
    characters; ``upload`` where nothing is left. Non-ASCII and emoji are kept for display."""
    name = re.split(r"[\\/]", (name or "").replace("\x00", ""))[-1]
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
    return TooLarge.body(request.max_content_length, request.content_length)


def _header_text(value: str | None) -> str | None:
    """A header's text: WSGI hands headers over decoded as Latin-1, so a UTF-8 value (``X-Filename: 狗.jpg``,
    as curl and requests send it) arrives as mojibake; its bytes are read as UTF-8 where they are that."""
    if not value:
        return value
    try:
        return utf8_or_latin1(value.encode("latin-1"))
    except UnicodeEncodeError:  # not from a WSGI server (a test client's str): already text
        return value


def read_uploads(request: Request, *, max_files: int) -> list[Upload]:
    """The uploads in ``request``, in order.

    :raises NoFile: multipart without a ``file`` part, or with only empty ones (400).
    :raises TooLarge: more than ``max_files`` files, or a body over ``MAX_CONTENT_LENGTH`` (413;
        Werkzeug raises its own 413 when Content-Length already says so).
    :raises BadRequest: a malformed multipart body, bad ``original_*`` fields (400; see ``read_originals``) or any
        in the query string (read from the form only, they were ignored there), or
        one of ``TEXT_FIELDS`` sent as a file part (a part with a filename).
    What the headers alone decide (411, 415, 400: a Content-Type that is neither multipart nor an image's, no body,
    a Content-Encoding) is ``headers.check_headers``'s: its callers (the routes) call that first, before ``admit``.
    """
    mimetype = request.mimetype
    if mimetype == "multipart/form-data":
        boundary = request.mimetype_params["boundary"]
        try:
            parts = list(request.files.getlist("file"))
        except HTTPException as exc:
            declared, limit = request.content_length, request.max_content_length
            if _over_limit(request) or (declared is not None and limit is not None and declared > limit):
                raise _too_large(request) from None
            if exc.code == 413:  # within the byte limit: Werkzeug's limits on the form's parts and text fields
                raise TooLarge.form(request.max_form_parts, request.max_form_memory_size, max_files) from None
            raise BadRequest(f"malformed multipart body: {exc.description}") from None
        if _over_limit(request):
            raise _too_large(request)
        error = request.form_error or ""
        # Werkzeug's "Invalid form-data cannot parse beyond State.<where the body ended>": PREAMBLE: no
        # delimiter of this boundary at all; PART or DATA: inside a part, before the closing delimiter.
        cut_off = "cannot parse beyond" in error and "PREAMBLE" not in error
        if cut_off:
            raise BadRequest(f"malformed multipart body: it ends before its closing delimiter "
                             f"'--{boundary[:70]}--' (a cut-off upload?)")
        if error and "cannot parse beyond" not in error:
            raise BadRequest(f"malformed multipart body: {error}")
        if not parts and not request.files and not request.form and (
                "PREAMBLE" in error or _longer_than_empty(request, boundary)):
            # Werkzeug finds no part when the body's delimiters are not the boundary the header names (however short
            # the body: 5 bytes of text under a multipart header were "no file"; tryout18).
            raise BadRequest(f"malformed multipart body: no part is delimited by the boundary {boundary[:70]!r} "
                             f"that the Content-Type header names")
        if not parts and "file" in request.form:  # e.g. curl -F 'file=<photo.jpg': a part without a filename
            raise NoFile("no image: the 'file' field arrived as a text field (its part has no filename); send it "
                         "as a file part, e.g. curl -F 'file=@photo.jpg', or an <input type=file>")
        if not parts:
            # Werkzeug keys a part without name= as None (sorting None with names raised TypeError: a 500)
            other = ", ".join(sorted(k if k is not None else "(a part with no name)" for k in request.files)) \
                or "none"
            raise NoFile(f"no image: send it as multipart field 'file' (file fields received: {other})")
        # A browser sends every <input type=file> of the form, an unused one as a part with an empty filename and
        # no bytes (the page's camera input): nothing chosen there, so it is neither a photo nor counted as one.
        blank = [not p.filename and not _part_bytes(p) for p in parts]
        if all(blank):
            raise NoFile("no image: the 'file' field is empty; choose a photo first")
        parts = [p for p, b in zip(parts, blank) if not b]
        if len(parts) > max_files:
            raise TooLarge(f"{len(parts)} files in one request; the limit is {max_files} (CLASSIFIER_MAX_FILES)")
        # A text field sent as a file part (curl -F 'topk=@k.txt': a part with a filename) is not in the form,
        # so it read as missing (original_*) or as not sent at all (topk: the default, silently).
        if misplaced := [f for f in TEXT_FIELDS if f in request.files]:
            field = misplaced[0]  # an example value, never "<value>": curl reads "<x" as the file x (tryout24)
            raise BadRequest(f"{field} arrived as a file part (its part has a filename, as curl -F '{field}=@file' "
                             f"sends it); send it as a text field: curl -F '{field}={SAMPLE[field]}', or "
                             f"-F '{field}=<file'")
        originals = read_originals(request.form, len(parts))
        return [Upload(_clean_name(_part_name(p)), _part_bytes(p), o) for p, o in zip(parts, originals)]
    if mimetype.startswith("image/") or mimetype in RAW_TYPES:
        name = _header_text(request.headers.get("X-Filename")) or "upload"
        data = request.get_data(cache=False)
        if _over_limit(request):
            raise _too_large(request)
        return [Upload(_clean_name(name), data)]
    raise AssertionError(f"check_headers passed Content-Type {mimetype!r}")  # (it refuses every other type)
