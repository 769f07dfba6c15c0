"""EXIF orientation (webapp/exif.py): read from the raw block alone, so damage elsewhere never drops it."""

import io
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from PIL import Image, ImageOps

from bench.exif_blocks import (ASCII, DAMAGED, DAMAGED_GPS, LONG, SHORT, Entry, avif_stored_turned, block,
                               damaged_blocks, orientation, stored_sideways)
from webapp import exif, imaging


def landscape() -> Image.Image:
    """A 96x64 landscape whose every pixel differs, so any wrong turn shows."""
    y, x = np.mgrid[0:64, 0:96]
    return Image.fromarray(np.stack([x * 2, y * 3, (x + y) % 256], -1).astype(np.uint8), "RGB")


def decoded(data: bytes) -> np.ndarray:
    return np.asarray(imaging.decode(data, max_pixels=10**8).image)


@pytest.mark.parametrize("value", range(1, 9))
@pytest.mark.parametrize("order", ["<", ">"])
def test_every_orientation_in_both_byte_orders(value, order):
    assert exif.orientation_from_block(block([orientation(value, order)], order=order)) == value
    assert exif.orientation_from_block(block([orientation(value, order)], order=order, prefix=False)) == value


@pytest.mark.parametrize("value", range(1, 9))
def test_turn_matches_pillows_exif_transpose_on_intact_exif(value):
    img = landscape()
    raw = Image.Exif()
    raw[0x0112] = value
    buf = io.BytesIO()
    img.save(buf, format="PNG", exif=raw.tobytes())
    ours = decoded(buf.getvalue())
    pillows = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue()))).convert("RGB"))
    assert np.array_equal(ours, pillows)


def test_a_png_exif_chunk_that_holds_the_jpeg_prefix_itself_still_turns():
    """An ``eXIf`` chunk that starts with ``Exif\\0\\0`` (the JPEG prefix, against the PNG spec) is read through,
    as Pillow's ``getexif`` and the page's ``strip.js`` read it: the API classified it sideways (tryout29)."""
    data = stored_sideways(landscape(), b"Exif\x00\x00" + block([orientation()]), "PNG")
    assert b"eXIfExif\x00\x00" in data  # Pillow took one prefix off: the chunk holds the other
    assert Image.open(io.BytesIO(data)).getexif().get(0x0112) == 6
    assert np.array_equal(decoded(data), np.asarray(landscape()))


@pytest.mark.parametrize("name", sorted(DAMAGED) + sorted(DAMAGED_GPS))
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_damage_elsewhere_keeps_the_orientation(name, fmt):
    ifd0, gps = DAMAGED_GPS[name] if name in DAMAGED_GPS else (DAMAGED[name], None)
    raw = block(ifd0, gps)
    data = stored_sideways(landscape(), raw, fmt)
    with pytest.raises(Exception):  # the kind of damage the old path swallowed, leaving the photo sideways
        ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    d = imaging.decode(data, max_pixels=10**8)
    assert d.size == (96, 64) and d.image.size == (96, 64)
    intact = stored_sideways(landscape(), block([orientation()]), fmt)
    assert np.array_equal(np.asarray(d.image), decoded(intact))  # same pixels as with an intact block
    if fmt == "PNG":  # lossless: exactly the upright photo
        assert np.array_equal(np.asarray(d.image), np.asarray(landscape()))


@pytest.mark.parametrize("entry", [
    Entry(0x0112, LONG, 1, struct.pack("<I", 6)),  # wrong type
    Entry(0x0112, SHORT, 2, struct.pack("<HH", 6, 6)),  # wrong count
    Entry(0x0112, SHORT, 1, struct.pack("<H", 9)),  # out of range
    Entry(0x0112, SHORT, 1, struct.pack("<H", 0)),
    Entry(0x0112, ASCII, 2, b"6\0"),
], ids=["long", "count-2", "nine", "zero", "ascii"])
def test_a_bad_orientation_entry_is_no_rotation(entry, caplog):
    caplog.set_level("DEBUG", logger="webapp.exif")
    assert exif.orientation_from_block(block([entry])) is None
    assert "no rotation" in caplog.text
    data = stored_sideways(landscape(), block([entry]), "PNG")
    assert decoded(data).shape == (96, 64, 3)  # stored sideways, left as stored, never an error


@pytest.mark.parametrize("raw", [
    b"", b"Exif\0\0", b"Exif\0\0II*\0", b"XX*\0\x08\0\0\0\0\0",
    b"II*\0\xff\xff\xff\x7f",  # IFD0 offset past the end
    b"II+\0\x08\0\0\0\x01\0",  # not TIFF's 42
    b"II*\0\x08\0\0\0\xff\xff",  # 65535 entries announced, none there
], ids=["empty", "prefix-only", "truncated-header", "bad-byte-order", "offset-past-end", "bad-magic", "count-past-end"])
def test_truncated_or_garbage_blocks_are_no_orientation(raw):
    assert exif.orientation_from_block(raw) is None


def test_an_ifd_loop_does_not_hang():
    # IFD0's next-IFD pointer points at itself: only IFD0 is ever read.
    raw = bytearray(block([Entry(0x010F, ASCII, 4, b"abc\0"), orientation()], prefix=False))
    raw[8 + 2 + 2 * 12:8 + 2 + 2 * 12 + 4] = struct.pack("<I", 8)
    assert exif.orientation_from_block(bytes(raw)) == 6


@pytest.mark.parametrize("value", range(2, 9))
@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "damaged"])
def test_an_avif_turned_by_its_container_is_upright_whatever_its_exif(value, damaged):
    """Pillow writes an AVIF's irot/imir into its EXIF block on open, re-writing the block: a damaged tag
    elsewhere in it made the open raise, so a good photo was refused 400 (undecodable)."""
    data = avif_stored_turned(landscape(), value, damaged=damaged)
    d = imaging.decode(data, max_pixels=10**8)
    assert d.size == (96, 64) and d.image.size == (96, 64)
    assert np.abs(np.asarray(d.image, dtype=int) - np.asarray(landscape(), dtype=int)).mean() < 4


def test_tiff_orientation_is_its_own_tag():
    buf = io.BytesIO()
    landscape().transpose(Image.Transpose.ROTATE_90).save(buf, format="TIFF", exif=block([orientation()]))
    assert np.array_equal(decoded(buf.getvalue()), np.asarray(landscape()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged_blocks())
def test_damage_anywhere_never_fails_and_an_intact_entry_always_turns(case):
    raw, intact = case
    value = exif.orientation_from_block(raw)  # never raises
    assert value is None or 1 <= value <= 8
    if intact:
        assert value == 6
    data = stored_sideways(landscape(), raw, "PNG")
    d = imaging.decode(data, max_pixels=10**8)  # never a ServiceError, never a crash
    if intact:
        assert np.array_equal(np.asarray(d.image), np.asarray(landscape()))
