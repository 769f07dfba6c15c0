"""Files that decode but are not whole, told from whole ones: each check returns None for a whole file.

- ``jpeg_rows_decoded``: a baseline JPEG whose scan data was cut and then closed by a marker (EOI),
  which libjpeg decodes without an error, filling the rest with grey;
- ``jpeg_scans_cut``: a progressive JPEG closed by EOI before its scans completed every coefficient, which
  libjpeg decodes without an error as a blurred (or colourless) image;
- ``jpeg_components_cut``: a sequential JPEG whose components come in separate scans, closed by EOI before
  each had its scan, which libjpeg decodes without an error, without that colour.

Files shorter than their own structure says, which Pillow refuses, are ``webapp/cuts.py``'s.

``webapp/imaging.py``'s ``decode`` turns a finding into ``400 undecodable_image`` saying the file was
cut short. Pillow-only (no torch), cheap for a whole photo: one row looked at, a few header bytes read.
"""

from __future__ import annotations

import io
import logging
from typing import Callable

import numpy as np
from PIL import Image

from .formats import NEXT_MARKER, jpeg_segments

log = logging.getLogger(__name__)

# What libjpeg writes where a scan has no data (all-zero coefficients: 128 in every component), as Pillow's
# image holds it per mode: mid-grey for L and RGB; CMYK is read inverted ("CMYK;I", Adobe's convention), so 127
# in each ink, and YCCK (Adobe transform 2) converts to 127 inks and a K of 128, inverted: 128, 128, 128, 127.
_JPEG_FILLS = {"L": ((128,),), "RGB": ((128, 128, 128),), "CMYK": ((127, 127, 127, 127), (128, 128, 128, 127))}


def _row_values(core, y: int) -> set[tuple[int, int]]:
    """The (min, max) of each band of row ``y`` of a Pillow core image (``Image.im``)."""
    return set(_band_extrema(core, y))


def _band_extrema(core, y: int) -> list[tuple[int, int]]:
    """The (min, max) of each band of row ``y`` of a Pillow core image, band by band."""
    row = core.crop((0, y, core.size[0], y + 1))
    return [row.getband(i).getextrema() for i in range(row.bands)]


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
    decoded at): a little grey fill at the bottom. CMYK and YCCK JPEGs are judged by their own fill values
    (``_JPEG_FILLS``: a cut CMYK photo came out flat dark grey, RGB 64, and was classified; tryout19).
    Progressive JPEGs (their scans refine the whole image: a cut leaves it blurred, not grey) are not judged;
    nor a file without EOI. Bytes after the
    EOI (junk, a second JPEG appended) do not hide a cut: the first EOI after the scans is the one judged.
    """
    if img.mode not in _JPEG_FILLS or "progressive" in img.info or "progression" in img.info:
        return None
    try:
        width, height = img.size
        last = _band_extrema(img.im, height - 1)
        fill = next((f for f in _JPEG_FILLS[img.mode] if last == [(v, v) for v in f]), None)
        if fill is None:
            return None  # every photo but the rare one ends here: one row looked at
        eoi = _first_eoi(data)  # what closed the scan: the end of the file, or bytes may follow it (junk, a
        if eoi is None:  # second JPEG): a file judged by its last two bytes alone let those through
            return None
        rows = np.asarray(img).reshape(height, width, len(fill))
        kept = np.flatnonzero(~(rows == np.array(fill, dtype=rows.dtype)).all(axis=(1, 2)))
        grey = height - (int(kept[-1]) + 1 if kept.size else 0)
        imcu = 8 * max((layer[2] for layer in getattr(img, "layer", [])), default=2) * height / header_height
        if grey < imcu + max(imcu, 4):
            return None
        again = Image.open(io.BytesIO(data[:eoi]), formats=("JPEG",))
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


def jpeg_components_cut(data: bytes) -> int | None:
    """For a sequential JPEG whose colour components come in separate scans (non-interleaved: ``cjpeg -scans``),
    closed by EOI before every component had its scan: the number of scans it has; None for every other JPEG.

    libjpeg decodes such a file without an error, the components that never came left at zero: cut after its
    luma scan, a colourless photo the model classifies (tryout12: dog.jpg, "German shepherd" from grey). A cut
    inside a component's scan leaves the rest of that component zero: the luma's is ``jpeg_rows_decoded``'s
    grey fill; the last chroma scan's (a colour cast on the bottom rows) is not caught. An interleaved JPEG,
    every encoder's default, costs nothing here: its first scan header names every component."""
    frame, seen, scans = None, set(), 0
    try:
        for seg in jpeg_segments(data, scans=True):
            payload = data[seg.pos + 4:seg.end]
            if seg.marker == _EOI:
                return scans if frame and not set(frame) <= seen else None
            if seg.marker in (0xC0, 0xC1):  # baseline and extended sequential Huffman frames
                frame = [payload[6 + 3 * i] for i in range(payload[5])]
            elif seg.marker in _PROGRESSIVE or seg.marker in _OTHER_FRAMES:
                return None
            elif seg.marker == _SOS:
                if frame is None:
                    return None
                seen |= set(payload[1:1 + 2 * payload[0]:2])
                scans += 1
                if set(frame) <= seen:
                    return None  # every component has had its scan (a cut inside one: the grey check's)
    except (IndexError, ValueError):  # a damaged header: the decoder judges it
        return None
    return None


def _first_eoi(data: bytes) -> int | None:
    """The offset of the EOI marker that ends JPEG ``data``'s image (its scans walked), or None without one."""
    return next((seg.pos for seg in jpeg_segments(data, scans=True) if seg.marker == _EOI), None)


def primary_jpeg(img: Image.Image, data: bytes) -> tuple[str, bytes]:
    """``(format, bytes)`` of the photo in ``data`` as the JPEG checks judge it: for a file Pillow opened
    (``img``) as ``MPO``, ``("JPEG", its first image's bytes)``; else ``(img.format, data)``.

    Pillow reads a JPEG whose APP2 ``MPF`` index lists more than one image (CIPA DC-007 Multi-Picture
    Format: phones' HDR gain maps and depth maps, cameras' stereo pairs and previews) as ``MPO``. Its
    first image is the photo: a JPEG like any other, which Pillow decodes (frame 0), browsers show
    and ``.jpg`` names. So it is reported as JPEG and gets every JPEG treatment (the fast ``draft``
    decode: 12 MP in 34 ms instead of 72 here; the cut checks, which read the first image's bytes up to
    its own EOI, not the last image's). Its size is the MP index's first entry (``mpinfo[0xB002]``);
    where that does not end in EOI within ``data`` (a file cut short, a damaged index), ``data`` itself."""
    if img.format != "MPO":
        return img.format or "unknown", data
    try:
        size = int(img.mpinfo[0xB002][0]["Size"])
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        size = 0
    return "JPEG", data[:size] if 2 < size <= len(data) and data[size - 2:size] == b"\xff\xd9" else data


# JPEG markers (ITU-T T.81 table B.1): progressive DCT frames (SOF2 Huffman, SOF10 arithmetic), the other
# frames (not judged here), a scan's start, the end of the image.
_PROGRESSIVE = {0xC2, 0xCA}
_OTHER_FRAMES = {0xC0, 0xC1, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCB, 0xCD, 0xCE, 0xCF}
_SOS, _EOI = 0xDA, 0xD9


def jpeg_scans_cut(data: bytes) -> int | None:
    """For a progressive JPEG closed by EOI before its scans brought every coefficient of every component to
    full precision: the number of scans it has; None for a whole one, a baseline JPEG, or one not parsed.

    A progressive JPEG sends the image as a series of scans (T.81 annex G): the DC coefficients first,
    then bands of AC coefficients, each first at reduced precision (successive approximation ``Al`` > 0)
    and refined later down to ``Al`` = 0 (libjpeg's default script has 10 scans; mozjpeg's vary). Cut
    and closed by EOI (what some tools write for a partial download), libjpeg decodes it without an error,
    the coefficients that never came left at zero: a blurred image, often without colour, that the model
    would classify. So the scan headers are read, markers walked by their lengths (``formats.jpeg_segments``:
    an EXIF thumbnail's own markers are inside APP1 and never seen) and entropy-coded data skipped to the
    next marker, and every coefficient 0..63 of every frame component must end at ``Al`` = 0; a scan header
    with no data after it (cut right there) brings nothing. A cut inside the very last scan is not caught
    (every coefficient has arrived by then, only the last refinement of part of the image is missing:
    with libjpeg's script the lowest bit of the luma AC coefficients). Costs one regex pass over
    the file (about a millisecond for 3 MB), and only progressive JPEGs are looked at.
    """
    try:
        frame, scans, closed = None, 0, False
        precision: dict[int, list[int | None]] = {}
        for seg in jpeg_segments(data, scans=True):
            if seg.marker == _EOI:
                closed = True
                break
            segment = data[seg.pos + 4:seg.end]
            if seg.marker in _OTHER_FRAMES:
                return None
            if seg.marker in _PROGRESSIVE:
                frame = [segment[6 + 3 * i] for i in range(segment[5])]
                precision = {c: [None] * 64 for c in frame}
            if seg.marker == _SOS:
                if frame is None:
                    return None
                if NEXT_MARKER.match(data, seg.end):
                    continue  # a scan header and no data: cut right after it (every real scan codes a byte)
                count = segment[0]
                ss, se, approx = segment[1 + 2 * count:4 + 2 * count]
                for c in segment[1:1 + 2 * count:2]:
                    if c not in precision or not ss <= se <= 63:
                        return None
                    precision[c][ss:se + 1] = [approx & 15] * (se + 1 - ss)
                scans += 1
        if not closed or frame is None:
            return None  # no EOI reached (the decoder itself reports the file as truncated), or not progressive
        return None if all(al == 0 for c in frame for al in precision[c]) else scans
    except (IndexError, ValueError):  # a damaged header: the decoder judges it
        return None
