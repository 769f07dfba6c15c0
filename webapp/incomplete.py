"""Files that decode but are not whole, told from whole ones: each check returns None for a whole file.

- ``jpeg_rows_decoded``: a baseline JPEG whose scan data was cut and then closed by a marker (EOI),
  which libjpeg decodes without an error, filling the rest with grey;
- ``container_cut``: a WebP (RIFF) or AVIF (ISO BMFF boxes) shorter than its container says, which
  Pillow reports only as a header it cannot read ("could not create decoder object").

``webapp/imaging.py``'s ``decode`` turns a finding into ``400 undecodable_image`` saying the file was
cut short. Pillow-only (no torch), cheap for a whole photo: one row looked at, a few header bytes read.
"""

from __future__ import annotations

import io
import logging
import struct
from typing import Callable

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

_JPEG_FILL = 128  # what libjpeg writes where a scan has no data: all-zero coefficients, mid-grey


def _row_values(core, y: int) -> set[tuple[int, int]]:
    """The (min, max) of each band of row ``y`` of a Pillow core image (``Image.im``)."""
    row = core.crop((0, y, core.size[0], y + 1))
    return {row.getband(i).getextrema() for i in range(row.bands)}


def jpeg_rows_decoded(img: Image.Image, data: bytes, header_height: int,
                      draft: Callable[[Image.Image], None]) -> float | None:
    """For a decoded baseline JPEG whose scan data stopped early but was closed by a marker: the fraction of
    its rows that had data (0..1); None for every other JPEG.

    libjpeg decodes such a file without an error (a warning Pillow does not pass on): the blocks past
    the cut are all-zero coefficients, rows of exact mid-grey (128) to the bottom, and the model would
    classify the fill. A real photo almost never ends in exact 128 rows, but a grey band can (a
    screenshot's #808080 footer), so exact-grey bottom rows, at least ``iMCU + max(iMCU, 4)`` of them
    (an iMCU row: 8 x the vertical sampling factor, times the decode scale), are judged by decoding the
    file again without its final EOI: there rows that have data come out as decoded (128) and rows past
    a cut are never written (0). Without EOI the decoder also holds back the last iMCU row and its
    context rows (<= iMCU + 2 rows, measured at scales 1 to 1/8 on the shared photos), fewer than the
    rows judged, so a grey band is never taken for a cut. A cut inside those last rows is not caught
    (32 of a 512-row photo's rows at full scale; 8 of a 12 MP photo's 756 at the 1/4 scale it is
    decoded at): a little grey fill at the bottom. Progressive JPEGs (their scans refine the whole
    image: a cut leaves it blurred, not grey) and CMYK are not judged; nor a file that does not end in EOI.
    """
    if img.mode not in ("L", "RGB") or "progressive" in img.info or "progression" in img.info:
        return None
    if not data.endswith(b"\xff\xd9"):
        return None
    try:
        width, height = img.size
        if _row_values(img.im, height - 1) != {(_JPEG_FILL, _JPEG_FILL)}:
            return None  # every photo but the rare one ends here: one row looked at
        rows = np.asarray(img).reshape(height, -1)
        kept = np.flatnonzero(~(rows == _JPEG_FILL).all(axis=1))
        grey = height - (int(kept[-1]) + 1 if kept.size else 0)
        imcu = 8 * max((layer[2] for layer in getattr(img, "layer", [])), default=2) * height / header_height
        if grey < imcu + max(imcu, 4):
            return None
        again = Image.open(io.BytesIO(data[:-2]), formats=("JPEG",))
        draft(again)  # the scale ``img`` was decoded at
        try:
            again.load()  # raises at the end of the data; the rows decoded until then are in again.im
        except OSError:
            pass
        if again.size != img.size or _row_values(again.im, height - grey) != {(0, 0)}:
            return None  # the grey rows have data: a grey band, not a cut
        return (height - grey) / height
    except Exception as exc:  # a check must never fail a photo the decoder read
        log.debug("JPEG cut check skipped: %s: %s", type(exc).__name__, exc)
        return None


def container_cut(data: bytes) -> tuple[int, int] | None:
    """``(bytes the container needs, bytes there are)`` for a RIFF (WebP) or ISO BMFF (AVIF, HEIF) file shorter
    than its own sizes say: RIFF's size field (RIFF + 8 bytes); the top-level boxes' sizes in turn (a box
    of size 1 has a 64-bit size, of size 0 runs to the end). None for a whole file, another format, or
    sizes that make no sense (a damaged header, not a cut one)."""
    if data[:4] == b"RIFF" and len(data) >= 8:
        need = 8 + struct.unpack_from("<I", data, 4)[0]
        return (need, len(data)) if len(data) < need else None
    if data[4:8] != b"ftyp":
        return None
    pos = 0
    while pos + 8 <= len(data):
        size, head = struct.unpack_from(">I", data, pos)[0], 8
        if size == 1:
            if pos + 16 > len(data):
                return (pos + 16, len(data))
            size, head = struct.unpack_from(">Q", data, pos + 8)[0], 16
        if size == 0:
            return None  # the last box runs to the end of the file
        if size < head:
            return None
        if pos + size > len(data):
            return (pos + size, len(data))
        pos += size
    return (pos + 8, len(data)) if 0 < len(data) - pos < 8 else None
