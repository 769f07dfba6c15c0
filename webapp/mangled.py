"""Photos changed on the way as if they were text, told from damaged files and from other formats, so that a
refusal says what happened and how to send the photo instead of "not an image" or "damaged".

Client scripts do this, not the photos: ``curl -d @photo.jpg`` drops every CR and LF byte (curl's manual:
"carriage returns and newlines will be stripped out"); a JavaScript ``fetch`` of ``await file.text()`` or Node's
``readFileSync(path, "utf8")`` replaces each byte that is not UTF-8 with U+FFFD; a string read as Latin-1 (or
Windows-1252: ``readAsBinaryString``) and sent as UTF-8 doubles each byte over 0x7F; a text-mode (FTP ASCII)
copy turns LF into CR LF; and some send base64 or hex text, or a ``data:`` URL, where the bytes belong.

``how_mangled`` is asked only about an upload that is refused anyway, and answers only where the bytes leave no
doubt: a photo's magic bytes changed by one of those mappings (the
PNG signature holds CR LF and 0x1A for this very purpose: RFC 2083 12.11), or a JPEG of more than 4 KiB without a
single CR and LF byte (a real one has about 2 of each per 256 bytes: none in 4 KiB by chance is ~e^-32), or one
whose every LF follows a CR (8 LFs or more: 256^-8 by chance). ``jpeg_copied_as_text`` is asked about every
JPEG before it is decoded: the same two marks in its coded data, which libjpeg may decode into noise without an
error. Bytes and numpy, no Pillow, no torch.
"""

from __future__ import annotations

import base64
import binascii
import re

import numpy as np

from .formats import claimed_format

_MAGIC = {"JPEG": b"\xff\xd8\xff", "PNG": b"\x89PNG\r\n\x1a\n"}  # the others (GIF, TIFF, BMP, WebP, PPM) start
# in ASCII, which these mappings keep: changed on the way, they are refused as damaged, without the why
_BASE64 = re.compile(rb"[A-Za-z0-9+/]+={0,2}|[A-Za-z0-9_-]+={0,2}")
_HEX = re.compile(rb"(?:[0-9a-fA-F]{2})+")
_DATA_URL = re.compile(rb"data:[\w.+-]+/[\w.+-]+(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.IGNORECASE)
_PLAIN_JPEG = 4096  # bytes: a JPEG this long without a CR or LF byte was stripped of them


def _mapped(magic: bytes) -> dict[bytes, str]:
    """The starts ``magic`` takes under each text mapping, with its words."""
    replaced = magic.decode("utf-8", "replace").encode("utf-8")
    latin = magic.decode("latin-1").encode("utf-8")
    cp1252 = magic.decode("cp1252", "replace").encode("utf-8")
    starts = {replaced: "read as UTF-8 text: each byte that is not UTF-8 became U+FFFD (EF BF BD)",
              cp1252: "read as Windows-1252 text and sent as UTF-8: each byte over 0x7F became two or three",
              latin: ("read as Latin-1 text and sent as UTF-8: each byte over 0x7F became two" if latin != cp1252
                      else "read as Latin-1 (or Windows-1252) text and sent as UTF-8: each byte over 0x7F became two")}
    if b"\r\n" in magic:  # the PNG signature: its CR LF, LF and 0x1A catch each line-end conversion
        starts[magic.replace(b"\r\n", b"\n")] = "copied as text: its CR LF bytes became LF"
        starts[magic.replace(b"\n", b"\r\n")] = "copied as text: its LF bytes became CR LF"
        starts[magic.replace(b"\r", b"").replace(b"\n", b"")] = ("sent as text with its line breaks stripped: "
                                                                 "every CR and LF byte is gone (curl -d does that)")
    return {start: said for start, said in starts.items() if start != magic}


_STARTS = {start: (fmt, said) for fmt, magic in _MAGIC.items() for start, said in _mapped(magic).items()}


def lenient_base64(text: bytes) -> bytes | None:
    """``text`` decoded as base64 in either alphabet (standard, or URL-safe ``-_``: RFC 4648 5; not both), its ``=``
    padding optional (Go's ``RawStdEncoding``, Rust's ``*_NO_PAD``); None where it is not base64 so."""
    body = text.rstrip(b"=")
    if not _BASE64.fullmatch(text) or len(body) % 4 == 1:
        return None
    try:
        return base64.b64decode(body + b"=" * (-len(body) % 4), altchars=b"-_" if b"-" in body or b"_" in body
                                else None, validate=True)
    except (binascii.Error, ValueError):
        return None


def _text_of(data: bytes) -> tuple[str, str] | None:
    """(what text, the format inside) where ``data`` is base64 or hex text of a photo, or a ``data:`` URL."""
    body = data.strip()
    url = _DATA_URL.match(body)
    if url:
        body = body[url.end():]
    packed = re.sub(rb"\s+", b"", body)  # base64 wrapped at 76 columns (MIME, `base64` without -w0)
    if _BASE64.fullmatch(packed):
        head = lenient_base64(packed[:64]) or b""
        if fmt := claimed_format(head):
            return ("a data: URL" if url else "base64 text"), fmt
    if not url and _HEX.fullmatch(packed) and (fmt := claimed_format(bytes.fromhex(packed[:64].decode()))):
        return "hex text", fmt
    return None


def _path(fmt: str) -> str:
    """An example file name for a ``fmt`` photo in the advice: photo.jpg, photo.png..."""
    return "photo." + {"JPEG": "jpg"}.get(fmt, fmt.lower())


def _send(fmt: str) -> str:
    """What to send instead of a ``fmt`` photo changed on the way."""
    path = _path(fmt)
    return (f"send the file's bytes unchanged (curl -F file=@{path}, or --data-binary @{path} -H 'Content-Type: "
            f"image/{'jpeg' if fmt == 'JPEG' else fmt.lower()}', not -d; Python requests: files={{'file': open(path, "
            f"'rb')}}; JavaScript: the File itself in FormData, or as the body with its type)")


def _a(fmt: str) -> str:
    return f"{'an' if fmt[0] in 'AEIOU' else 'a'} {fmt}"


def how_mangled(data: bytes) -> tuple[str, bool] | None:
    """How an upload that is refused anyway was changed on the way, as words ending in what to send instead, and
    whether the photo is in it (True: its bytes were changed, 400 damaged; False: it is text that holds a photo,
    base64 or hex, 415 not an image); None where the bytes do not leave it beyond doubt."""
    if text := _text_of(data):
        what, fmt = text
        path = _path(fmt)
        return (f"it is {what} of {_a(fmt)}, not the {fmt}'s bytes: send the bytes themselves (curl --data-binary "
                f"@{path} or -F file=@{path}); base64 goes in a /v2 JSON request"), False
    for start, (fmt, said) in _STARTS.items():
        if data.startswith(start):
            return f"{_a(fmt)} changed on the way: it was {said}; {_send(fmt)}", True
    if data.startswith(_MAGIC["JPEG"]) and (said := _line_breaks_changed(data) or jpeg_copied_as_text(data)):
        return said, True
    return None


def for_a_file(said: str, data: bytes) -> str:
    """``how_mangled``'s words ``said`` about ``data``, made for a file read here (``classify`` without a server), not
    an upload: its advice on sending (curl, requests, /v2) replaced by what to do with the file (tryout27: local
    classify told the user to use curl). Any other ``said`` is returned as it is."""
    found = how_mangled(data)
    if found is None or said != found[0]:
        return said
    if found[1]:  # the bytes were changed: only a copy made as bytes has the photo
        return said.split("; send ")[0] + "; get the file again, copied as bytes (a binary transfer, not as text)"
    what, fmt = _text_of(data)
    path = _path(fmt)
    how = {"hex text": f"xxd -r -p FILE > {path}", "a data: URL": f"cut -d, -f2 FILE | base64 -d > {path}"}.get(
        what, f"base64 -d FILE > {path}")
    return f"{said.split(': send ')[0]}: decode it to the photo's bytes first ({how}), then classify {path}"


def _line_breaks_changed(data: bytes) -> str | None:
    """The words for JPEG bytes ``data`` (the whole file, or its coded data) whose CR and LF bytes a text copy
    changed: none at all in over 4 KiB, or 8 LFs or more each after a CR; None otherwise."""
    lf = data.count(b"\n")
    if len(data) > _PLAIN_JPEG and lf == 0 and b"\r" not in data:
        return (f"a JPEG changed on the way: it has no CR or LF byte at all, which any JPEG over 4 KB has: "
                f"they were stripped, as curl -d does; {_send('JPEG')}")
    if lf >= 8 and data.count(b"\r\n") == lf:
        return (f"a JPEG changed on the way: every LF byte in it follows a CR, so it was copied as text (LF "
                f"became CR LF, as an FTP ASCII transfer does); {_send('JPEG')}")
    return None


_CODED_WINDOW = 65536  # bytes of a JPEG's coded data looked at: ~0.1 ms; a phone photo's hold ~200 LF bytes
# Coded data judged only where there is this much of it, this close to random (bits per byte): a photo's is
# 7.3-8.0 (406 JPEGs on this machine, diagrams included), a flat picture's ~2.0, and only in random-like bytes
# do the odds below hold.
_CODED_JUDGED, _CODED_ENTROPY = 16384, 7.0


def jpeg_copied_as_text(data: bytes) -> str | None:
    """For a JPEG that may well decode: the words where a text copy changed its CR and LF bytes, else None.

    libjpeg decodes such a file with only warnings (which Pillow does not pass on): an FTP ASCII copy of a 12 MP
    photo (LF -> CR LF) came out as noise and was classified "radio" (tryout19). The first 64 KiB of its coded
    data (after the first SOS marker: no metadata, whose text may well end its lines in CR LF) decide: in a real
    photo about 1 LF in 1,000 follows a CR (8 of 10,276 in the shared 12 MP one), so 8 or more all after one is
    beyond chance (~1e-25), and 16 KiB without either byte too (~e^-100 at that photo's rate; none of 428 real
    JPEGs on this machine was taken for a copy). Those odds hold for random-like bytes only: coded data under
    16 KiB, or as regular as a flat picture's (no CR or LF in 17 KB), is not judged. A copy that turned CR LF into
    LF leaves no such mark (real coded data has few CR LF pairs: that one has 8 in 3 MB), and is caught only where
    it fails to decode."""
    # Found by its bytes, not by walking the segments: a copy that put a CR into a segment's length breaks the walk
    # (Pillow skips such damage). An EXIF thumbnail's SOS may come first: its coded data was copied alike.
    sos = data.find(b"\xff\xda", 2)
    window = data[sos:sos + _CODED_WINDOW] if sos >= 0 else b""
    if len(window) < _CODED_JUDGED or _entropy(window) < _CODED_ENTROPY:
        return None  # too little, or too regular (a flat picture's coded data repeats: no CR or LF in 17 KB)
    if said := _line_breaks_changed(window):
        return said
    # One of the two gone alone, as unlikely by chance: LF made CR (an old Mac text copy), CR made LF or dropped
    # (tr -d '\r', the usual "fix" of Windows line ends); tryout20: each answered 200 with a label for noise.
    gone = "LF" if b"\n" not in window else "CR" if b"\r" not in window else None
    return None if gone is None else (f"a JPEG changed on the way: its data has no {gone} byte at all, which any "
                                      f"photo's has: a text copy {_ONE_GONE[gone]}; {_send('JPEG')}")


_ONE_GONE = {"LF": "made each LF a CR (as an old Mac text transfer does)",
             "CR": "dropped its CR bytes or made them LF (as tr -d '\\r' does)"}


def _entropy(data: bytes) -> float:
    """Shannon entropy of ``data``'s bytes, in bits per byte (8: uniform)."""
    p = np.bincount(np.frombuffer(data, np.uint8), minlength=256) / len(data)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())
