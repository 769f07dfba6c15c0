"""Whole photos that Pillow refuses for a fault outside their pixels, made decodable; and cut-short files said
in words.

- ``jpeg_with_eoi``: a JPEG whose data stops without the EOI marker (FF D9) that closes it. Some encoders and
  streaming writers leave it out, and so does a copy cut exactly after its last scan byte; browsers show such a
  file. Pillow refuses it ("image file is truncated (35 bytes not processed)": libjpeg waits for the marker).
  With the marker added it decodes, and ``webapp/incomplete.py`` then judges it as any JPEG closed by EOI:
  one cut inside its image data (grey fill, or a progressive one blurred) is still refused, and as there a
  cut in its last few rows (or inside a progressive one's last scan) is let through.
- ``jpeg_mended``: a JPEG whose JFIF, Adobe or ICC segment is too short for its own fields, which libjpeg (and
  so browsers) skips and Pillow's header parser raises on: the segment is dropped.
- ``tiff_mended``: a TIFF whose metadata tag (ImageDescription, Software...) points past the end of the file,
  which libtiff ignores and Pillow's directory reader refused: the tag is dropped.
- ``png_mended``: a PNG whose compressed metadata (``zTXt``, ``iTXt``, ``iCCP``) inflates past Pillow's
  guard (``PngImagePlugin.MAX_TEXT_CHUNK``, 1 MiB per chunk, 64 MiB in all: decompression bombs in metadata).
  The guard is kept; the metadata is dropped and the pixels decoded (the ICC profile is not used anyway:
  see the README's decoding notes). And one with an ancillary chunk whose CRC is wrong (a flipped bit in a
  text chunk): the chunk is dropped, as libpng drops it.
- ``cut_short``: whether a Pillow error means the data ended early ("Truncated File Read", "image file is
  truncated", "not enough image data": a PNM), so that the 400 says so in words instead of quoting Pillow.

Pillow-only, no torch. Each runs only after Pillow refused a file, so whole photos pay nothing.
"""

from __future__ import annotations

import struct
import zlib

from .formats import jpeg_segments

_EOI = b"\xff\xd9"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Ancillary chunks whose compressed payloads Pillow inflates under MAX_TEXT_CHUNK / MAX_TEXT_MEMORY
# (PngImagePlugin.chunk_zTXt, chunk_iTXt, chunk_iCCP; tEXt is counted in MAX_TEXT_MEMORY too).
_TEXT_CHUNKS = {b"tEXt", b"zTXt", b"iTXt", b"iCCP"}
_PILLOW_TEXT_GUARD = ("MAX_TEXT_CHUNK", "MAX_TEXT_MEMORY")
_PILLOW_CUT = ("Truncated File Read", "image file is truncated", "not enough image data")


def cut_short(exc: BaseException) -> bool:
    """Pillow's error ``exc`` says the data ended before the image did."""
    return any(text in str(exc) for text in _PILLOW_CUT)


def jpeg_with_eoi(data: bytes) -> bytes | None:
    """``data`` with the EOI marker appended, for a JPEG Pillow refused that does not end in EOI already;
    else None. ``decode`` then decodes it and judges it with ``webapp/incomplete.py``'s checks.

    Whatever Pillow said: a baseline JPEG cut short is "image file is truncated", but a progressive one cut inside
    its early scans can be "broken data stream when reading image file". Closed by EOI, the cut is told for what
    it is (its scans counted), and a JPEG damaged elsewhere fails again and says so."""
    if data.endswith(_EOI) or not data.startswith(b"\xff\xd8"):
        return None
    return data + _EOI


# Metadata segments libjpeg itself ignores when shorter than their fixed fields (jdmarker.c: a JFIF APP0 under 14
# bytes, an Adobe APP14 under 12) and an ICC APP2 without its sequence bytes (ICC.1 B.4: 14), whose identifier
# Pillow's parser reads past the end of, refusing the photo: (marker, identifier, shortest payload).
_SHORT_APPS = ((0xE0, b"JFIF\x00", 14), (0xEE, b"Adobe", 12), (0xE2, b"ICC_PROFILE\x00", 14))


def jpeg_mended(data: bytes) -> bytes | None:
    """``data`` without the metadata segments too short for their own fields (``_SHORT_APPS``), for a JPEG Pillow
    refused; else None (none there). libjpeg skips such a segment and decodes the photo, and so do browsers;
    Pillow's header parser raised on it ("cannot identify image file", said as damaged). Segments are walked by
    their lengths up to SOS; everything else is kept as it is."""
    if not data.startswith(b"\xff\xd8"):
        return None
    out, pos = [], 0
    for seg in jpeg_segments(data):
        if seg.marker == 0xDA or seg.end > len(data):
            break
        payload = data[seg.pos + 4:seg.end]
        # its identifier (or as much of it as there is, two bytes at least), and too short for its fields
        if any(seg.marker == m and len(payload) < n and payload[:2] == ident[:2] and
               ident.startswith(payload[:len(ident)]) for m, ident, n in _SHORT_APPS):
            out.append(data[pos:seg.pos])
            pos = seg.end
    return b"".join([*out, data[pos:]]) if out else None


def png_mended(data: bytes, exc: BaseException) -> bytes | None:
    """``data`` without the chunks Pillow refused it for (``exc``), where they are outside the pixels; else None
    (also when there was none to drop):

    - its text and ICC chunks (``tEXt``, ``zTXt``, ``iTXt``, ``iCCP``), where they inflate past Pillow's guard;
    - every ancillary chunk whose CRC is wrong: Pillow refuses the file ("broken PNG file (bad header checksum in
      b'tEXt')", seen only as "cannot identify image file"); libpng, and so browsers, drop such a chunk and show
      the photo. A critical chunk's (IHDR, PLTE, IDAT) stays an error there and here.

    Every other chunk, and any bytes after a chunk whose length runs past the end, are kept as they are: a PNG
    damaged elsewhere stays damaged, and says so when decoded again."""
    if not data.startswith(_PNG_SIGNATURE):
        return None
    guard = any(text in str(exc) for text in _PILLOW_TEXT_GUARD)
    out, pos, dropped = [_PNG_SIGNATURE], len(_PNG_SIGNATURE), False
    while pos + 12 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        end = pos + 12 + length  # length, type, payload, CRC
        if end > len(data):
            break
        ancillary = bool(kind[0] & 0x20)  # bit 5 of the type's first byte (PNG spec 5.4)
        if (guard and kind in _TEXT_CHUNKS) or (
                ancillary and zlib.crc32(data[pos + 4:end - 4]) != struct.unpack(">I", data[end - 4:end])[0]):
            dropped = True
        else:
            out.append(data[pos:end])
        pos = end
        if kind == b"IEND":
            break
    out.append(data[pos:])
    return b"".join(out) if dropped else None


# TIFF tags the pixels cannot be read without (TIFF 6.0 and its common extensions: size, samples, compression,
# colour, strips and tiles, planar layout, predictor, sample format, extra samples, colour map, YCbCr, JPEG
# tables, ICC for the mode Pillow picks): never dropped. Any other tag is metadata.
_TIFF_PIXEL_TAGS = {254, 255, 256, 257, 258, 259, 262, 266, 273, 277, 278, 279, 284, 317, 320, 322, 323, 324, 325,
                    330, 332, 338, 339, 340, 341, 347, 529, 530, 531, 532}
_TIFF_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4}


def tiff_mended(data: bytes) -> bytes | None:
    """``data`` without the metadata tags of its first IFD whose values lie past the end of the file (an
    ImageDescription or Software pointer a tool wrote wrong), for a classic TIFF Pillow refused; else None. libtiff
    ignores such a tag with a warning; Pillow's directory reader refused the file ("cannot identify"). The
    remaining entries are written back in place, in order, with the IFD's count and next-IFD offset after them;
    the pixel tags (``_TIFF_PIXEL_TAGS``) are never touched, so a TIFF damaged there stays damaged."""
    if data[:4] not in (b"II*\x00", b"MM\x00*") or len(data) < 8:
        return None
    order = "<" if data[:2] == b"II" else ">"
    ifd = struct.unpack_from(order + "I", data, 4)[0]
    if not 8 <= ifd <= len(data) - 2:
        return None
    count = struct.unpack_from(order + "H", data, ifd)[0]
    if count > 4096 or ifd + 2 + 12 * count + 4 > len(data):
        return None
    kept = []
    for pos in range(ifd + 2, ifd + 2 + 12 * count, 12):
        tag, kind, n, at = struct.unpack_from(order + "HHII", data, pos)
        size = _TIFF_SIZES.get(kind, 1) * n
        if tag not in _TIFF_PIXEL_TAGS and size > 4 and at + size > len(data):
            continue
        kept.append(data[pos:pos + 12])
    if len(kept) == count:
        return None
    out = bytearray(data)
    next_ifd = data[ifd + 2 + 12 * count:ifd + 6 + 12 * count]
    entries = b"".join(kept)
    out[ifd:ifd + 2] = struct.pack(order + "H", len(kept))
    out[ifd + 2:ifd + 2 + len(entries) + 4] = entries + next_ifd
    return bytes(out)
