"""What each photo of a request will cost to decode, read from its bytes before any pixel is decoded.

``read_size`` walks a file's parts once (``formats.too_many_parts``) and opens its header (Pillow, no pixel
decoded); ``check_request_pixels`` bounds a request's photos together by it (``CLASSIFIER_MAX_REQUEST_PIXELS``).
The ``Size`` it returns goes on to ``imaging.decode`` (through ``prepare``), which then does not walk the file
again: the walk costs ~2 ms on a 3 MB phone JPEG (its entropy-coded data is scanned for markers), once per
photo, not once per step that needs its verdict.
"""
from __future__ import annotations

import io
from PIL import Image

from . import repair
from .contract import FORMATS, Size, Upload
from .errors import TooLarge
from .formats import jpeg_arithmetic, too_many_parts
from .imaging import draft


def read_size(data: bytes, min_side: int | None) -> Size:
    """``data``'s ``Size``: ``too_many_parts``' verdict, and unless it refuses the file, ``decoded_pixels``."""
    if said := too_many_parts(data):
        return Size(0, min_side, said)
    return Size(_pixels(data, min_side), min_side)


def decoded_pixels(data: bytes, min_side: int | None) -> int:
    """How many pixels ``decode`` will produce from ``data``, read from its header alone (no pixel decoded):
    width x height, a large JPEG at the reduced DCT scale of its fast path (``imaging.draft``); 0 where the
    header cannot be read (``decode`` then names the fault, in its turn). Decode time grows with these pixels, not
    with the bytes: a 634 KB 16-bit PNG holds 79 MP and takes ~2.1 s (2-core Zen 4: 8-bit RGB PNG ~14 ms
    per MP, 16-bit ~27, lossless WebP ~10; a JPEG at 1/4 scale ~1 ms per full-size MP). 0, unopened, for a file
    ``too_many_parts`` refuses (``decode`` does)."""
    return read_size(data, min_side).pixels


def _pixels(data: bytes, min_side: int | None) -> int:
    """``decoded_pixels`` of a file ``too_many_parts`` lets through (mended as ``decode`` mends it)."""
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Exception as exc:  # noqa: BLE001 -- unreadable: decode raises the right error for it, or mends it
        fixed = repair.png_mended(data, exc) or repair.jpeg_mended(data) or repair.tiff_mended(data)  # as decode
        return decoded_pixels(fixed, min_side) if fixed else 0
    try:
        if min_side and img.format in ("JPEG", "MPO") and not jpeg_arithmetic(data):  # (that one: at full size)
            draft(img, min_side)  # sets the size it will decode at; decodes nothing
        return img.size[0] * img.size[1]
    except Exception:  # noqa: BLE001
        return 0


def check_request_pixels(uploads: list[Upload], *, limit: int, min_side: int | None) -> list[Size]:
    """Refuse a request whose photos together would decode to more than ``limit`` pixels
    (``CLASSIFIER_MAX_REQUEST_PIXELS``), before any of them is decoded; else each photo's ``Size``, in order.
    Each upload keeps its ``Size`` (``Upload.size``, read once: a second check reuses it) and ``imaging.prepare``
    takes it (``size=``), so a photo's parts are walked once a request, not once per step that needs the verdict.

    ``MAX_PIXELS`` bounds each photo, but 16 dense 80 MP PNGs of 600 KB each fit every byte and per-photo
    limit and take ~30 s to decode, holding the worker for the whole request timeout; this bounds the work
    one request can ask for by what it costs (``decoded_pixels``; reading the headers takes ~0.1 ms a photo,
    plus the parts walk: ~2 ms for a 3 MB JPEG). A photo ``too_many_parts`` refuses counts 0 here: its own 413
    comes from ``decode`` in its turn, so a request's error names its photos that cannot be read in request order.

    :raises TooLarge: over ``limit`` (413), naming the total, the largest photo and the setting.
    """
    for up in uploads:
        if up.size is None or up.size.min_side != min_side:
            up.size = read_size(up.data, min_side)
    counts = [(up.size.pixels, up.name) for up in uploads]
    total = sum(n for n, _ in counts)
    if total > limit:
        most, name = max(counts)
        raise TooLarge(f"these {len(uploads)} photos decode to {total:,} pixels together ({name}: {most:,}); "
                       f"the limit per request is {limit:,} (CLASSIFIER_MAX_REQUEST_PIXELS): send them in "
                       f"several requests" if len(uploads) > 1 else
                       f"{name}: decodes to {most:,} pixels; the limit per request is {limit:,} "
                       f"(CLASSIFIER_MAX_REQUEST_PIXELS)")
    return [up.size for up in uploads]
