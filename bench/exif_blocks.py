"""Raw EXIF blocks built byte by byte, damaged the ways phones and editors damage them (tests and bench/fuzz.py).

Pillow's own writer cannot make a wrong type or count (that is the point), so the TIFF structure
(TIFF 6.0 section 2: header, IFD of 12-byte entries, values over 4 bytes at offsets) is written here.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

from hypothesis import strategies as st
from PIL import Image

BYTE, ASCII, SHORT, LONG, RATIONAL, UNDEFINED, DOUBLE = 1, 2, 3, 4, 5, 7, 12
SIZES = {BYTE: 1, ASCII: 1, SHORT: 2, LONG: 4, RATIONAL: 8, UNDEFINED: 1, DOUBLE: 8}


@dataclass
class Entry:
    """One IFD entry: ``tag``, TIFF field ``kind``, ``count`` and the value's raw bytes (any length)."""

    tag: int
    kind: int
    count: int
    data: bytes


def orientation(value: int = 6, order: str = "<") -> Entry:
    return Entry(0x0112, SHORT, 1, struct.pack(order + "H", value))


def block(ifd0: list[Entry], gps: list[Entry] | None = None, order: str = "<", prefix: bool = True) -> bytes:
    """A little- (``<``) or big-endian (``>``) TIFF structure with IFD0 and, optionally, a GPS IFD."""
    entries = list(ifd0)
    if gps is not None:
        entries.append(Entry(0x8825, LONG, 1, b"\0\0\0\0"))  # offset patched below
    head = (b"II" if order == "<" else b"MM") + struct.pack(order + "HI", 42, 8)

    def ifd(items: list[Entry], at: int) -> tuple[bytes, bytes]:
        table, extra = struct.pack(order + "H", len(items)), b""
        data_at = at + 2 + 12 * len(items) + 4
        for e in items:
            if len(e.data) <= 4:
                value = e.data.ljust(4, b"\0")
            else:
                value = struct.pack(order + "I", data_at + len(extra))
                extra += e.data + (b"\0" if len(e.data) % 2 else b"")
            table += struct.pack(order + "HHI", e.tag, e.kind, e.count) + value
        return table + b"\0\0\0\0", extra

    table0, extra0 = ifd(entries, 8)
    body = head + table0 + extra0
    if gps is not None:
        gps_at = len(body)
        pointer = body.index(struct.pack(order + "HHI", 0x8825, LONG, 1)) + 8
        body = body[:pointer] + struct.pack(order + "I", gps_at) + body[pointer + 4:]
        table1, extra1 = ifd(gps, gps_at)
        body += table1 + extra1
    return (b"Exif\0\0" if prefix else b"") + body


# The examples: each breaks Pillow's exif_transpose (it re-writes EXIF while rotating).
DAMAGED = {
    "xresolution-undefined": [Entry(0x011A, UNDEFINED, 4, b"\x48\0\0\0"), orientation()],
    "datetime-rational": [Entry(0x0132, RATIONAL, 1, struct.pack("<II", 2024, 1)), orientation()],
    "copyright-double": [Entry(0x8298, DOUBLE, 1, struct.pack("<d", 1.5)), orientation()],
}
DAMAGED_GPS = {"gpsversion-ascii": ([orientation()], [Entry(0x0000, ASCII, 4, b"2.2\0")])}


def stored_sideways(upright: Image.Image, raw_exif: bytes, fmt: str = "JPEG") -> bytes:
    """``upright`` stored as a phone stores it for Orientation 6 (turned 90° clockwise back), with ``raw_exif``."""
    sideways = upright.transpose(Image.Transpose.ROTATE_90)
    buf = io.BytesIO()
    sideways.save(buf, format=fmt, exif=raw_exif, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()



# Orientation -> the transpose that stores an upright picture as that orientation says (the inverse of
# the one that turns it upright: webapp/exif.py).
STORE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
         5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
         8: Image.Transpose.ROTATE_270}


def avif_stored_turned(upright: Image.Image, value: int = 6, *, damaged: bool = True, quality: int = 100) -> bytes:
    """``upright`` stored as orientation ``value`` says, as an AVIF. Pillow's writer turns the EXIF
    Orientation into the container's own rotation and mirroring (HEIF ``irot``/``imir``) and keeps the
    rest of the block; ``damaged``: the block's DateTime entry is then re-typed RATIONAL in the file's
    bytes (Pillow's writer would refuse to write that block itself)."""
    raw = block([Entry(0x0132, ASCII, 20, b"2024:01:01 00:00:00\0"), orientation(value)])
    buf = io.BytesIO()
    upright.transpose(STORE[value]).save(buf, format="AVIF", exif=raw, quality=quality)
    data = buf.getvalue()
    if damaged:
        intact = struct.pack("<HHI", 0x0132, ASCII, 20)
        assert data.count(intact) == 1, "the DateTime entry is not in the file once"
        data = data.replace(intact, struct.pack("<HHI", 0x0132, RATIONAL, 1))
    return data

KINDS = [BYTE, ASCII, SHORT, LONG, RATIONAL, UNDEFINED, DOUBLE, 0, 13, 0xFFFF]


@st.composite
def damaged_blocks(draw):
    """A block with Orientation=6 among random entries of random (often wrong) types, counts and data;
    then maybe bytes flipped or the block cut, possibly through the orientation entry itself."""
    others = draw(st.lists(st.builds(Entry, st.integers(0, 0xFFFF).filter(lambda t: t != 0x0112),
                                     st.sampled_from(KINDS), st.integers(0, 2**32 - 1), st.binary(max_size=24)),
                           max_size=6))
    at = draw(st.integers(0, len(others)))
    order = draw(st.sampled_from(["<", ">"]))
    entries = others[:at] + [orientation(6, order)] + others[at:]
    raw = bytearray(block(entries, order=order))
    where = 6 + 8 + 2 + 12 * at  # the orientation entry's 12 bytes
    intact_upto = len(raw)
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(6, len(raw) - 1))
        raw[i] = draw(st.integers(0, 255))
        if where <= i < where + 12 or i < 6 + 8 + 2:  # the header, count or the entry itself was hit
            intact_upto = -1
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(raw)))
        raw = raw[:cut]
        if cut < where + 12:
            intact_upto = -1
    return bytes(raw), intact_upto >= 0
