"""Files shorter than their own structure says, told from damaged ones: each check returns ``(bytes needed,
bytes there are)`` for a cut file and None for a whole one, another format, or sizes that make no sense.

- ``container_cut``: a WebP (RIFF), AVIF (ISO BMFF boxes) or TIFF (its first IFD and the strips or tiles it
  points to) shorter than its container says, which Pillow reports only as a header it cannot read ("could
  not create decoder object"; a TIFF whose IFD is written last, as libtiff does, "cannot identify");
- ``header_cut``: a JPEG, PNG, GIF, BMP or PNM that ends inside the header Pillow reads to open it, which
  Pillow reports as "Truncated File Read", "Reached EOF while reading header" or a header it cannot
  identify (a 20 KB phone JPEG's EXIF block is a header a slow upload can be cut in).

``webapp/imaging.py``'s ``decode`` turns a finding into ``400 undecodable_image`` saying the file was cut
short, with the two byte counts. Pure bytes (struct), no Pillow, no torch; asked only on a failure path.
"""

from __future__ import annotations

import struct

from .formats import jpeg_segments


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
    pos, mdat = 0, False
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
        mdat = mdat or data[pos + 4:pos + 8] == b"mdat"
        pos += size
    if pos == len(data) and not mdat:  # whole boxes, but not the one the coded image is in: cut between boxes
        return pos + 8, len(data)
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


_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*")


def header_cut(data: bytes) -> tuple[int, int] | None:
    """``(bytes the header needs at least, bytes there are)`` for a JPEG, PNG, GIF, BMP or PNM file that ends
    inside the part Pillow reads to open it (what Pillow reports as "Truncated File Read", "Reached EOF while
    reading header", or a header it cannot identify); None for a file whose header is whole, another format,
    or a header whose structure makes no sense (damage, not a cut). What each format's header is:

    - JPEG: its marker segments (each ``FF xx`` and a 2-byte length, ITU T.81 B.1.1) up to and including SOS,
      and a byte of scan data after it;
    - PNG: its chunks (length, type, data, CRC; PNG spec 5.3) up to the first IDAT;
    - GIF: the screen descriptor, global colour table and extension blocks up to the first image descriptor
      and its local colour table (GIF89a 18-23);
    - BMP: the file header, the DIB header its own size gives, bit masks and the colour table;
    - PNM (P1-P6): width, height and maxval (P1/P4: no maxval), comments between them, and the one whitespace
      byte after the last (Netpbm's format pages); a cut there needs at least one byte more. Pillow opens a
      PPM cut inside its maxval ("P6 160 120 2" of "255") and fails only on its pixels;
    - any of them, and TIFF, cut inside its signature (2 or more of its bytes): the signature's length.
    """
    for magic in _MAGIC:  # cut inside its signature ("\\x89PNG"): the signature's length at least
        if 2 <= len(data) < len(magic) and magic.startswith(data):
            return len(magic), len(data)
    try:
        if data[:3] == b"\xff\xd8\xff":
            return _jpeg_header_cut(data)
        if data[:8] == b"\x89PNG\r\n\x1a\n":
            return _png_header_cut(data)
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return _gif_header_cut(data)
        if data[:2] == b"BM":
            return _bmp_header_cut(data)
        if data[:1] == b"P" and data[1:2] in b"123456" and len(data) >= 2:
            return _pnm_header_cut(data)
    except (struct.error, IndexError, ValueError):  # asked on a failure path: never raise there
        return None
    return None


# The identifiers APP0 and APP1 segments start with (JFIF, JFXX, Motion JPEG's AVI1; EXIF, XMP and extended XMP):
# random bytes after FF E0 or FF E1 would otherwise be read as a length, and damage called a cut.
_JPEG_APP_IDS = {0xE0: (b"JFIF\x00", b"JFXX\x00", b"AVI1"),
                 0xE1: (b"Exif\x00", b"http://ns.adobe.com/")}


def _jpeg_header_cut(data: bytes) -> tuple[int, int] | None:
    n = len(data)
    for seg in jpeg_segments(data):
        known = _JPEG_APP_IDS.get(seg.marker)  # (checked on as much of the identifier as arrived)
        if known and not any(i.startswith(data[seg.pos + 4:seg.pos + 4 + len(i)]) for i in known):
            return None  # APP0/APP1 whose identifier is not one of theirs: damage read as a length
        if seg.end > n:
            return seg.end, n
        if seg.marker == 0xD9:
            return None  # EOI before any scan: not a cut
        if seg.marker == 0xDA:  # SOS: the header is whole; the scan data follows (at least a byte of it)
            return (seg.end + 1, n) if seg.end == n else None
    return None  # junk between segments, or a length under 2: damage


def _png_header_cut(data: bytes) -> tuple[int, int] | None:
    pos, n = 8, len(data)
    while True:
        if pos + 8 > n:
            return pos + 8, n
        length, kind = struct.unpack_from(">I4s", data, pos)
        if length > 0x7FFFFFFF:
            return None
        if kind in (b"IDAT", b"IEND"):
            return None
        end = pos + 12 + length
        if end > n:
            return end, n
        pos = end


def _gif_header_cut(data: bytes) -> tuple[int, int] | None:
    n = len(data)
    if n < 13:
        return 13, n
    flags = data[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    while True:
        if pos + 1 > n:
            return pos + 1, n
        block = data[pos]
        if block == 0x2C:  # image descriptor (10 bytes), its local colour table, the LZW code size
            if pos + 10 > n:
                return pos + 10, n
            local = data[pos + 9]
            end = pos + 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0) + 1
            return (end, n) if end > n else None
        if block != 0x21:  # the trailer (no image) or junk: not a cut
            return None
        pos += 2  # introducer and label, then data sub-blocks up to a 0-size one
        while True:
            if pos + 1 > n:
                return pos + 1, n
            size = data[pos]
            pos += 1 + size
            if size == 0:
                break
            if pos > n:
                return pos, n


_BMP_DIB_SIZES = (12, 16, 40, 52, 56, 64, 108, 124)


def _bmp_header_cut(data: bytes) -> tuple[int, int] | None:
    n = len(data)
    if n < 18:
        return 18, n
    dib = struct.unpack_from("<I", data, 14)[0]
    if dib not in _BMP_DIB_SIZES:
        return None
    need = 14 + dib
    if n < need:
        return need, n
    if dib == 12:
        bits, colours, compression = struct.unpack_from("<H", data, 24)[0], 0, 0
    else:
        bits, compression = struct.unpack_from("<HI", data, 28)
        colours = struct.unpack_from("<I", data, 46)[0] if dib >= 40 else 0
    if dib == 40 and compression in (3, 6):  # BI_BITFIELDS, BI_ALPHABITFIELDS: the masks follow the header
        need += 12 if compression == 3 else 16
    if bits <= 8:
        count = colours or 1 << bits
        if count > 1 << bits:
            return None
        need += count * (3 if dib == 12 else 4)
    return (need, n) if need > n else None


_PNM_SPACE = b" \t\r\n\x0b\x0c"


def _pnm_header_cut(data: bytes) -> tuple[int, int] | None:
    n, pos = len(data), 2
    for _ in range(2 if data[1:2] in b"14" else 3):
        while pos < n and (data[pos] in _PNM_SPACE or data[pos] == 0x23):  # whitespace and # comments
            if data[pos] == 0x23:
                newline = min((i for i in (data.find(b"\n", pos), data.find(b"\r", pos)) if i >= 0), default=-1)
                if newline < 0:
                    return n + 1, n
                pos = newline
            pos += 1
        if pos >= n:
            return n + 1, n
        start = pos
        while pos < n and 0x30 <= data[pos] <= 0x39:
            pos += 1
        if pos == start:
            return None  # not a number: damage
        if pos >= n:
            return n + 1, n  # a number with nothing after it: the file may go on
    return None
