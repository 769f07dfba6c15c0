"""webapp/cuts.py: files shorter than their own structure says (a container's sizes, the header Pillow opens), told
from damaged ones, and said as a cut in the 400 (``webapp/imaging.py``'s ``decode``)."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image

from webapp.cuts import container_cut, header_cut
from webapp.errors import UndecodableImage
from webapp.imaging import decode

from conftest import encode

pytestmark = pytest.mark.unit

BIG = 10**7
# A baseline JPEG cut inside its last two iMCU rows (16 rows each at 4:2:0) decodes with grey fill there, which is
# not judged (webapp/incomplete.py: the decoder holds back iMCU + 2 rows, so a grey band is never taken for a
# cut); the rows that differ are those and the iMCU row the cut lands in (its blocks after the cut grey), one
# more row for the chroma upsampling's context. The rows above must be the whole file's.
JPEG_UNJUDGED_ROWS = 3 * 16 + 2
# Pillow's own words for a file that ended, which the 400 must not repeat (it says "a file cut short").
PILLOWS_WORDS = ("Truncated File Read", "truncated", "Reached EOF", "cannot read the image header", "not processed",
                 "not enough image data", "broken data stream", "damaged")


def _photo(width: int = 48, height: int = 36, seed: int = 0) -> Image.Image:
    """A generated RGB image with detail everywhere (noise over gradients)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), (x + y) % 256], axis=-1)
    return Image.fromarray(np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8))


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


def _exif() -> bytes:
    exif = Image.Exif()
    exif[0x010E] = "a description long enough to make the EXIF block span a few hundred bytes " * 8  # ImageDescription
    exif[0x0112] = 1  # Orientation
    return exif.tobytes()


def _with_header_chunks() -> dict[str, bytes]:
    """One small whole file per format and header shape, each with metadata before its pixels (EXIF, text chunks,
    comments, colour tables): the parts a cut inside the header lands in."""
    from PIL import PngImagePlugin

    photo = _photo()
    tall = _photo(96, 320)  # JPEG: enough rows that a cut above its last iMCU rows is told from a grey band
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "made by a test " * 40)
    pixels = photo.tobytes()
    return {
        "JPEG with EXIF": _save(tall, "JPEG", exif=_exif(), quality=90),
        "progressive JPEG": _save(tall, "JPEG", progressive=True, exif=_exif()),
        "PNG with tEXt": _save(photo, "PNG", pnginfo=info),
        "palette PNG": _save(photo.convert("P"), "PNG", transparency=0),
        "GIF with a comment": _save(photo.convert("P"), "GIF", comment=b"made by a test " * 20),
        "8-bit BMP": _save(photo.convert("P"), "BMP"),
        "24-bit BMP": _save(photo, "BMP"),
        "P6 with a comment": b"P6\n# made by a test\n48 36\n255\n" + pixels,
        "P5 16-bit": b"P5 48 36 65535\n" + np.asarray(photo.convert("L"), dtype=">u2").tobytes() * 1,
        "P4": _save(photo.convert("1"), "PPM"),
        "P3 plain": b"P3\n48 36\n255\n" + b" ".join(b"%d" % v for v in pixels[:48 * 36 * 3]) + b"\n",
        "TIFF": _save(photo, "TIFF"),
        "WebP": _save(photo, "WEBP", lossless=True),
        **({"AVIF": _save(photo, "AVIF")} if "AVIF" in Image.SAVE else {}),
    }


FILES = _with_header_chunks()


def _judged_rows(whole: bytes, n: int, height: int) -> int:
    """How many rows, from the top, a cut at ``n`` that decodes must leave as the whole file's: all of them, but
    for a baseline JPEG the last ``JPEG_UNJUDGED_ROWS`` and for a progressive one cut inside its last scan none
    (only that scan's refinement is missing there: the lowest bit of the luma AC coefficients; at the model's
    224 px, a real photo's pixels move by 0.3 levels on average, webapp/incomplete.py's ``jpeg_scans_cut``)."""
    if whole[:2] != b"\xff\xd8":
        return height
    if b"\xff\xc2" in whole[:whole.index(b"\xff\xda")]:  # SOF2: progressive
        return 0 if n > whole.rindex(b"\xff\xda") else height
    return height - JPEG_UNJUDGED_ROWS


@pytest.mark.parametrize("name", list(FILES))
def test_every_cut_of_a_whole_file_is_said_to_be_cut_short_or_is_the_whole_photo(name):
    """A file cut anywhere is a 400 saying it was cut short, never Pillow's words ("Truncated File Read", "Reached
    EOF while reading header", "not enough image data", "broken data stream"), never "damaged"; or it decodes to
    the whole file's very pixels (a JPEG without its EOI, a PNG without IEND; see ``_judged_rows``). From the
    third byte (two, "GI" or "P6", say nothing), and from the twelfth for WebP and AVIF ("RIFF" and "ftyp" are
    the containers of other formats too). Found over HTTP: a JPEG cut inside its EXIF block answered "cannot read
    the image header (OSError: Truncated File Read)"."""
    whole = FILES[name]
    want = np.asarray(decode(whole, max_pixels=BIG).image)
    first = 12 if name in ("WebP", "AVIF") else 3
    step = max(1, len(whole) // 60)
    for n in sorted({*range(first, min(len(whole), 1200)), *range(1200, len(whole), step), len(whole) - 1}):
        try:
            got = decode(whole[:n], max_pixels=BIG)
        except UndecodableImage as exc:
            assert "a file cut short" in exc.message, (n, exc.message)
            assert not any(words in exc.message for words in PILLOWS_WORDS), (n, exc.message)
            continue
        rows = _judged_rows(whole, n, want.shape[0])
        assert np.array_equal(np.asarray(got.image)[:rows], want[:rows]), (n, "decoded, but not as the whole file")


def test_the_header_a_cut_lands_in_is_measured_in_bytes():
    jpeg = FILES["JPEG with EXIF"]
    sos = jpeg.index(b"\xff\xda")
    sos_end = sos + 2 + struct.unpack_from(">H", jpeg, sos + 2)[0]
    assert header_cut(jpeg) is None and header_cut(jpeg[:sos_end + 1]) is None  # SOS whole, a byte of scan data
    assert header_cut(jpeg[:sos_end]) == (sos_end + 1, sos_end)  # SOS whole, nothing after it
    assert header_cut(jpeg[:sos_end - 1]) == (sos_end, sos_end - 1)
    app1 = jpeg.index(b"\xff\xe1")
    app1_end = app1 + 2 + struct.unpack_from(">H", jpeg, app1 + 2)[0]
    assert header_cut(jpeg[:app1 + 100]) == (app1_end, app1 + 100)  # inside the EXIF block
    assert header_cut(jpeg[:2]) == (3, 2)  # inside the signature
    png = FILES["PNG with tEXt"]
    text = png.index(b"tEXt") - 4
    assert header_cut(png[:text + 20]) == (text + 12 + struct.unpack_from(">I", png, text)[0], text + 20)
    assert header_cut(b"P6\n# a comment") == (15, 14) and header_cut(b"P6\n48 36\n25") == (12, 11)
    assert header_cut(b"P6\n48 36\n255\n") is None and header_cut(b"P4 48 36\n") is None
    assert header_cut(b"GIF89a" + b"\0" * 3) == (13, 9)
    bmp = FILES["8-bit BMP"]
    colours = struct.unpack_from("<I", bmp, 46)[0] or 256  # biClrUsed: Pillow writes the palette's own length
    assert header_cut(bmp[:200]) == (14 + 40 + colours * 4, 200) and colours * 4 > 200  # inside its colour table


def test_header_structures_that_make_no_sense_are_not_called_a_cut():
    """Damage is said as damage: only a structure that holds together up to the end of the data is a cut."""
    assert header_cut(b"\xff\xd8\xff\xe0\x00\x01") is None  # a segment length under 2
    assert header_cut(b"\xff\xd8\xff\xd9") is None  # EOI before any scan
    assert header_cut(b"\xff\xd8junk") is None
    assert header_cut(b"\x89PNG\r\n\x1a\n" + b"\xff" * 8) is None  # a chunk length past 2^31
    assert header_cut(b"BM" + b"\0" * 12 + struct.pack("<I", 99) + b"\0" * 40) is None  # no such DIB header
    assert header_cut(b"P6\nwidth height\n") is None  # not numbers
    assert header_cut(b"GIF89a" + b"\0" * 7 + b"!") == (16, 14)  # an extension cut...
    assert header_cut(b"GIF89a" + b"\0" * 7 + b";") is None  # ...the trailer, no image: not a cut
    for n in range(120):  # never an exception, whatever the bytes
        header_cut(b"\xff\xd8\xff" + bytes(range(n, n + 40))), header_cut(b"BM" + bytes(range(n, n + 60)))
        header_cut(b"GIF89a" + bytes(range(n, n + 40))), header_cut(b"P5" + bytes(range(n, n + 20)))


def _tiff(entries: list[tuple[int, int, int, bytes]], tail: bytes = b"") -> bytes:
    """A little-endian classic TIFF: header, IFD at 8 with ``(tag, type, count, 4-byte value)`` entries, ``tail``."""
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHI", t, k, n) + v for t, k, n, v in entries)
    return b"II*\x00" + struct.pack("<I", 8) + ifd + b"\x00" * 4 + tail


def test_tiff_structures_that_make_no_sense_are_not_called_a_cut():
    tile = 8 + 2 + 2 * 12 + 4  # where the pixel data starts in these files
    one_strip = [(273, 4, 1, struct.pack("<I", tile)), (279, 4, 1, struct.pack("<I", 100))]
    assert container_cut(_tiff(one_strip, b"x" * 100)) is None
    assert container_cut(_tiff(one_strip, b"x" * 40)) == (tile + 100, tile + 40)
    tiles = [(324, 3, 2, struct.pack("<HH", tile, tile + 10)), (325, 3, 2, struct.pack("<HH", 10, 10))]
    assert container_cut(_tiff(tiles, b"x" * 20)) is None and container_cut(_tiff(tiles, b"x" * 15)) == (tile + 20, tile + 15)
    assert container_cut(b"II*\x00" + struct.pack("<I", 4) + b"\x00" * 20) is None  # IFD inside the header: damage
    assert container_cut(b"II*\x00" + struct.pack("<I", 10**6)) == (10**6 + 2, 8)  # IFD written last, then cut
    assert container_cut(b"MM\x00*\x00\x00\x00\x08\x00\x05") == (8 + 2 + 5 * 12 + 4, 10)  # big-endian, IFD cut
    assert container_cut(_tiff([(273, 2, 1, b"abcd"), (279, 4, 1, b"\0\0\0\1")])) is None  # offsets as ASCII
    assert container_cut(_tiff([(273, 4, 1, struct.pack("<I", 10**9)), (279, 4, 2, b"\0" * 4)])) is None  # 1 vs 2
    for n in range(60):  # every cut of a small whole one, and garbage after its header: never an exception
        whole = _tiff(one_strip, b"x" * 100)
        container_cut(whole[:n]), container_cut(whole[:8] + bytes(range(n, n + 60)))


def test_container_sizes_that_make_no_sense_are_not_called_a_cut():
    webp = encode(_photo(40, 30), "WEBP")
    assert container_cut(webp) is None and container_cut(webp + b"trailing") is None
    assert container_cut(b"RIFF" + struct.pack("<I", 10**6) + b"WEBPVP8 ") == (10**6 + 8, 16)
    ftyp = struct.pack(">I", 16) + b"ftypavif" + b"\0" * 4
    assert container_cut(ftyp + struct.pack(">I", 3) + b"mdat") is None  # a box smaller than its header: damage
    assert container_cut(ftyp + struct.pack(">I", 0) + b"mdat" + b"x" * 10) is None  # size 0: to the end
    assert container_cut(ftyp + struct.pack(">I", 1) + b"mdat" + struct.pack(">Q", 10**9)) == (16 + 10**9, 32)
    assert container_cut(b"\x89PNG\r\n\x1a\n" + b"\0" * 20) is None


def test_bytes_after_a_jpeg_marker_that_are_not_its_segment_are_damage_not_a_cut():
    """``FF D8 FF E0 garbage``: "ga" read as APP0's length would call it a cut needing 26,469 bytes."""
    assert header_cut(b"\xff\xd8\xff\xe0garbage") is None and header_cut(b"\xff\xd8\xff\xe1\x00\x40XMP data") is None
    with pytest.raises(UndecodableImage) as ei:
        decode(b"\xff\xd8\xff\xe0garbage", max_pixels=BIG)
    assert ei.value.message == ("upload: the JPEG header cannot be read: the data ends inside it (a damaged file, or "
                                "one cut short); send the whole file")
    assert header_cut(b"\xff\xd8\xff\xe0\x00\x10JFI") == (20, 9)  # cut inside the identifier: still a cut
