"""Files that decode but are not whole, told from whole ones: each check returns None for a whole file.

- ``jpeg_rows_decoded``: a baseline JPEG whose scan data was cut and then closed by a marker (EOI),
  which libjpeg decodes without an error, filling the rest with grey;
- ``jpeg_scans_cut``: a progressive JPEG closed by EOI before its scans completed every coefficient, which
  libjpeg decodes without an error as a blurred (or colourless) image;
- ``container_cut``: a WebP (RIFF), AVIF (ISO BMFF boxes) or TIFF (its first IFD and the strips or tiles it
  points to) shorter than its own structure says, which Pillow reports only as a header it cannot read
  ("could not create decoder object"; a TIFF whose IFD is written last, as libtiff does, "cannot identify").

``webapp/imaging.py``'s ``decode`` turns a finding into ``400 undecodable_image`` saying the file was
cut short. Pillow-only (no torch), cheap for a whole photo: one row looked at, a few header bytes read.
"""

from __future__ import annotations

import io
import logging
import re
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
# frames (not judged here), a scan's start, the end of the image. Inside a scan's entropy-coded data 0xFF is
# followed by 0x00 (a stuffed byte), a restart marker (D0-D7) or fill (FF); anything else is the next marker.
_PROGRESSIVE = {0xC2, 0xCA}
_OTHER_FRAMES = {0xC0, 0xC1, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCB, 0xCD, 0xCE, 0xCF}
_SOS, _EOI = 0xDA, 0xD9
_NEXT_MARKER = re.compile(rb"\xff(?![\x00\xd0-\xd7\xff])")


def jpeg_scans_cut(data: bytes) -> int | None:
    """For a progressive JPEG closed by EOI before its scans brought every coefficient of every component to
    full precision: the number of scans it has; None for a whole one, a baseline JPEG, or one not parsed.

    A progressive JPEG sends the image as a series of scans (T.81 annex G): the DC coefficients first,
    then bands of AC coefficients, each first at reduced precision (successive approximation ``Al`` > 0)
    and refined later down to ``Al`` = 0 (libjpeg's default script has 10 scans; mozjpeg's vary). Cut
    and closed by EOI (what some tools write for a partial download), libjpeg decodes it without an error,
    the coefficients that never came left at zero: a blurred image, often without colour, that the model
    would classify. So the scan headers are read, markers walked by their lengths (an EXIF thumbnail's own
    markers are inside APP1 and never seen) and entropy-coded data skipped to the next marker, and every
    coefficient 0..63 of every frame component must end at ``Al`` = 0. A cut inside the very last scan is
    not caught (every coefficient has arrived by then, only the last refinement of part of the image is
    missing: with libjpeg's script the lowest bit of the luma AC coefficients). Costs one regex pass over
    the file (about a millisecond for 3 MB), and only progressive JPEGs are looked at.
    """
    try:
        pos, frame, scans = 2, None, 0
        precision: dict[int, list[int | None]] = {}
        while pos + 2 <= len(data):
            if data[pos] != 0xFF:
                return None  # not a marker where one must be: damage, not judged here
            marker = data[pos + 1]
            if marker == 0xFF:  # fill byte before a marker
                pos += 1
                continue
            if marker == _EOI:
                break
            if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # RSTn, TEM: no length
                pos += 2
                continue
            end = pos + 2 + struct.unpack_from(">H", data, pos + 2)[0]
            segment = data[pos + 4:end]
            if marker in _OTHER_FRAMES:
                return None
            if marker in _PROGRESSIVE:
                frame = [segment[6 + 3 * i] for i in range(segment[5])]
                precision = {c: [None] * 64 for c in frame}
            if marker == _SOS:
                if frame is None:
                    return None
                count = segment[0]
                ss, se, approx = segment[1 + 2 * count:4 + 2 * count]
                for c in segment[1:1 + 2 * count:2]:
                    if c not in precision or not ss <= se <= 63:
                        return None
                    precision[c][ss:se + 1] = [approx & 15] * (se + 1 - ss)
                scans += 1
                found = _NEXT_MARKER.search(data, end)
                if found is None:
                    return None  # no EOI: the decoder itself reports the file as truncated
                end = found.start()
            pos = end
        else:
            return None  # no EOI reached
        if frame is None or not scans:
            return None
        return None if all(al == 0 for c in frame for al in precision[c]) else scans
    except (IndexError, ValueError, struct.error):  # a damaged header: the decoder judges it
        return None


def container_cut(data: bytes) -> tuple[int, int] | None:
    """``(bytes the container needs at least, bytes there are)`` for a RIFF (WebP), ISO BMFF (AVIF, HEIF) or TIFF file
    shorter than its own sizes say: RIFF's size field (RIFF + 8 bytes); the top-level boxes' sizes in turn (a
    box of size 1 has a 64-bit size, of size 0 runs to the end); TIFF's first IFD and the last byte of the
    strips or tiles it lists (``_tiff_cut``; an IFD past the end gives only that IFD's offset). None for a
    whole file, another format, or sizes that make no sense (a damaged header, not a cut one)."""
    if data[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        try:
            return _tiff_cut(data)
        except (struct.error, ValueError, OverflowError, MemoryError):  # asked on a failure path: never raise there
            return None
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


# TIFF 6.0 section 2 and BigTIFF: field types that offsets and byte counts come in (SHORT, LONG, LONG8), and
# the (offsets, byte counts) tag pairs of strips (273, 279) and tiles (324, 325).
_TIFF_TYPES = {3: "H", 4: "I", 16: "Q"}
_TIFF_DATA = ((273, 279), (324, 325))


def _tiff_cut(data: bytes) -> tuple[int, int] | None:
    """``(bytes needed, bytes there are)`` for a classic or Big TIFF cut short: its first IFD past the end (libtiff
    writes the IFD after the pixel data, so a cut loses it first), or a strip or tile it lists running past the
    end. None for a whole file or one whose IFD makes no sense (damage, judged by the decoder)."""
    order = "<" if data[:2] == b"II" else ">"
    big = data[2:4] in (b"+\x00", b"\x00+")
    if len(data) < (16 if big else 8):
        return (16 if big else 8), len(data)
    word, n_size, entry = ("Q", 8, 20) if big else ("I", 2, 12)
    ifd = struct.unpack_from(order + word, data, 8 if big else 4)[0]
    if ifd < (16 if big else 8):
        return None
    if ifd + n_size > len(data):
        return ifd + n_size, len(data)
    count = struct.unpack_from(order + ("Q" if big else "H"), data, ifd)[0]
    end = ifd + n_size + count * entry + (8 if big else 4)
    if count > 4096:
        return None
    if end > len(data):
        return end, len(data)
    values: dict[int, tuple[int, ...]] = {}
    for pos in range(ifd + n_size, ifd + n_size + count * entry, entry):
        tag, kind = struct.unpack_from(order + "HH", data, pos)
        if not any(tag in pair for pair in _TIFF_DATA):
            continue
        n = struct.unpack_from(order + word, data, pos + 4)[0]
        char = _TIFF_TYPES.get(kind)
        if char is None or not 0 < n <= 1 << 20:
            return None
        size = n * struct.calcsize(char)
        field = pos + (12 if big else 8)
        at = field if size <= (8 if big else 4) else struct.unpack_from(order + word, data, field)[0]
        if at + size > len(data):
            return at + size, len(data)
        values[tag] = struct.unpack_from(f"{order}{n}{char}", data, at)
    need = 0
    for offsets, counts in _TIFF_DATA:  # a pair of unequal lengths makes no sense: damage, not judged
        starts, sizes = values.get(offsets, ()), values.get(counts, ())
        if len(starts) == len(sizes):
            need = max([need, *(start + size for start, size in zip(starts, sizes))])
    return (need, len(data)) if need > len(data) else None
