"""webapp/formats.py's JPEG marker walk (``jpeg_segments``), shared by the cut, mend and scan checks, and the frame
it finds (``jpeg_frame``): checked on JPEGs that Pillow writes here, so each segment's place is known."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from conftest import jpeg_with_scans, jpeg_with_segments, png_bytes, png_chunk, png_with_chunks
from webapp.formats import MAX_DATA_BLOCKS, MAX_JPEG_SCANS, MAX_PARTS, jpeg_frame, jpeg_segments, too_many_parts

pytestmark = pytest.mark.unit

SOI, SOF0, SOF2, DHT, DQT, SOS, EOI, APP0, APP1 = 0xD8, 0xC0, 0xC2, 0xC4, 0xDB, 0xDA, 0xD9, 0xE0, 0xE1


def _jpeg(progressive: bool = False, exif: bytes = b"") -> bytes:
    """A 40x30 JPEG with detail (noise), baseline or progressive, with an EXIF block if given."""
    pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90, progressive=progressive, exif=exif)
    return out.getvalue()


def _walk(data: bytes, **kw) -> list[tuple[int, int | None, int]]:
    return [tuple(seg) for seg in jpeg_segments(data, **kw)]


def test_the_header_is_walked_to_sos_and_each_segment_ends_where_the_next_begins():
    data = _jpeg(exif=Image.Exif().tobytes() + b"\x00" * 300)
    segments = _walk(data)
    assert [m for _, m, _ in segments][:2] == [APP0, APP1] and segments[-1][1] == SOS
    assert {SOF0, DHT, DQT} <= {m for _, m, _ in segments}
    assert segments[0][0] == 2 and all(a[2] == b[0] for a, b in zip(segments, segments[1:]))
    for pos, marker, end in segments:  # each end is its own 2-byte length after the marker
        assert data[pos] == 0xFF and data[pos + 1] == marker
        assert end == pos + 2 + int.from_bytes(data[pos + 2:pos + 4], "big")


def test_with_scans_every_scan_of_a_progressive_jpeg_is_walked_to_eoi():
    data = _jpeg(progressive=True)
    segments = _walk(data, scans=True)
    markers = [m for _, m, _ in segments]
    assert markers[-1] == EOI and segments[-1] == (len(data) - 2, EOI, len(data))
    assert markers.count(SOS) >= 6  # libjpeg's progressive script: 10 scans for colour (6 at least in any)
    assert _walk(data).count(segments[markers.index(SOS)]) == 1 and _walk(data)[-1][1] == SOS  # without: stops


@pytest.mark.parametrize("fill", [1, 3])
def test_fill_bytes_before_a_marker_are_skipped(fill):
    data = _jpeg()
    first = _walk(data)[1]  # the segment after APP0
    filled = data[:first[0]] + b"\xff" * fill + data[first[0]:]
    assert [m for _, m, _ in _walk(filled)] == [m for _, m, _ in _walk(data)]
    assert _walk(filled)[1] == (first[0] + fill, first[1], first[2] + fill)


def test_a_cut_yields_the_segment_it_lands_in_with_its_end_past_the_data():
    data = _jpeg()
    for pos, marker, end in _walk(data)[:-1]:
        for cut in (pos + 1, pos + 3, (pos + end) // 2):
            last = _walk(data[:cut])[-1]
            assert last[0] == pos and last[2] > cut, (cut, last)
            assert last[1] == (marker if cut >= pos + 2 else None)
            assert last[2] == (end if cut >= pos + 4 else pos + 2 if cut < pos + 2 else pos + 4)


def test_damage_ends_the_walk_without_a_segment_past_the_data():
    data = _jpeg()
    second = _walk(data)[1]
    junk = data[:second[0]] + b"\x00junk" + data[second[0]:]  # a byte that is not FF where a marker must be
    assert _walk(junk) == _walk(data)[:1]
    zero = data[:second[0] + 2] + b"\x00\x01" + data[second[0] + 4:]  # a length under 2
    assert _walk(zero) == _walk(data)[:1]


def test_the_frame_is_the_first_sof_with_its_precision():
    assert tuple(jpeg_frame(_jpeg())) == (SOF0, 8, ()) and tuple(jpeg_frame(_jpeg(progressive=True))) == (SOF2, 8, ())
    assert not jpeg_frame(_jpeg()).arithmetic and jpeg_frame(_jpeg()).undecodable is None
    sof = next(seg for seg in jpeg_segments(_jpeg()) if seg.marker == SOF0)
    data = _jpeg()
    twelve = data[:sof.pos + 4] + b"\x0c" + data[sof.pos + 5:]
    lossless = data[:sof.pos + 1] + b"\xc3" + data[sof.pos + 2:sof.pos + 4] + b"\x10" + data[sof.pos + 5:]
    assert jpeg_frame(twelve).undecodable == "a 12-bit JPEG"
    assert jpeg_frame(lossless).undecodable == "a lossless 16-bit JPEG"
    for bits in (0, 7, 9, 16, 255):  # no DCT frame has these (T.81 B.2.2: 8 or 12): damage, not a kind (415)
        assert jpeg_frame(data[:sof.pos + 4] + bytes([bits]) + data[sof.pos + 5:]).undecodable is None
    assert jpeg_frame(lossless[:sof.pos + 4] + b"\x11" + lossless[sof.pos + 5:]).undecodable is None  # 17 bits
    arithmetic = data[:sof.pos + 1] + b"\xc9" + data[sof.pos + 2:]
    assert jpeg_frame(arithmetic).arithmetic and jpeg_frame(arithmetic).undecodable is None
    assert jpeg_frame(data[:sof.pos + 4]) is None  # cut before its precision byte
    assert jpeg_frame(b"\x89PNG\r\n\x1a\n" + data[2:]) is None


def _zeroed(data: bytes, table: int, entries: range = range(1)) -> bytes:
    """JPEG ``data`` with ``entries`` (zigzag places; 0 is DC) of quantization table ``table`` set to 0, as
    damage would leave them (encoders clamp 0 to 1, so it is written here by hand)."""
    out = bytearray(data)
    for seg in jpeg_segments(data):
        if seg.marker == DQT:
            at = seg.pos + 4
            while at < seg.end:
                size = 2 if out[at] >> 4 else 1
                if out[at] & 0x0F == table:
                    for k in entries:
                        out[at + 1 + k * size:at + 1 + (k + 1) * size] = bytes(size)
                at += 1 + 64 * size
    return bytes(out)


def _zero_dc(data: bytes) -> list[int]:
    frame = jpeg_frame(data)
    return list(frame.zero_dc) if frame else []


@pytest.mark.parametrize("progressive", [False, True])
def test_a_table_with_0_for_the_dc_is_found_for_the_components_that_use_it(progressive):
    data = _jpeg(progressive=progressive)  # Y uses table 0; Cb and Cr share table 1
    assert _zero_dc(data) == []
    assert _zero_dc(_zeroed(data, 0)) == [0] and _zero_dc(_zeroed(data, 0, range(64))) == [0]
    assert _zero_dc(_zeroed(data, 1)) == [1, 2] and _zero_dc(_zeroed(_zeroed(data, 1), 0)) == [0, 1, 2]
    assert _zero_dc(_zeroed(data, 0, range(1, 64))) == []  # AC entries 0, the DC kept: not found
    wide = io.BytesIO()  # an entry over 255: Pillow writes the table with 16-bit entries (Pq 1)
    Image.fromarray(np.full((16, 16, 3), 90, np.uint8)).save(wide, "JPEG", qtables=[[300] * 64, [2] * 64])
    assert _zero_dc(wide.getvalue()) == [] and _zero_dc(_zeroed(wide.getvalue(), 0)) == [0]
    damaged = _zeroed(data, 0)
    assert _zero_dc(damaged[:damaged.index(b"\xff\xc0" if not progressive else b"\xff\xc2")]) == []  # no frame yet
    assert _zero_dc(b"\x89PNG\r\n\x1a\n" + damaged[2:]) == []


def test_a_file_of_far_more_parts_than_a_photo_has_is_named_and_a_photo_is_not():
    """Scans past ``MAX_JPEG_SCANS``, JPEG segments or PNG chunks past ``MAX_PARTS``: words; at the limit: None
    (tryout21: a 489 KB JPEG of 3,000 scans took 13-17 s to decode, 1,000,000 empty COM segments 7-10 s)."""
    progressive = _jpeg(progressive=True)
    scans = [m for _, m, _ in _walk(progressive, scans=True)].count(SOS)
    assert too_many_parts(progressive) is None and too_many_parts(_jpeg()) is None
    assert too_many_parts(jpeg_with_scans(progressive, MAX_JPEG_SCANS - scans)) is None
    said = too_many_parts(jpeg_with_scans(progressive, MAX_JPEG_SCANS - scans + 1))
    assert said.startswith(f"the JPEG has more than {MAX_JPEG_SCANS} scans") and "save it again" in said
    segments = len(_walk(_jpeg(), scans=True))  # to EOI
    assert too_many_parts(jpeg_with_segments(_jpeg(), MAX_PARTS - segments)) is None
    assert "more than 10,000 marker segments" in too_many_parts(jpeg_with_segments(_jpeg(), MAX_PARTS - segments + 1))
    png = png_bytes(Image.new("RGB", (8, 8)))  # IHDR, IDAT, IEND: IHDR is a part, IDAT image data
    assert too_many_parts(png_with_chunks(png, MAX_PARTS - 1)) is None
    assert "more than 10,000 chunks besides its image data" in too_many_parts(png_with_chunks(png, MAX_PARTS))
    # Image data in small chunks, as streaming encoders write it (a 12 MP photo in 1 KB IDAT chunks: 18,000), is a
    # photo; only the walk's bound applies to them.
    ihdr, iend = png[:33], png[-12:]
    idat = lambda n: png_chunk(b"IDAT", zlib.compress(bytes(8 * 25))[:1]) * n  # noqa: E731 (data never decoded)
    assert too_many_parts(ihdr + idat(20_000) + iend) is None
    assert "or 200,000 image data chunks" in too_many_parts(ihdr + idat(MAX_DATA_BLOCKS + 1) + iend)
    for other in (b"BM" + b"\x00" * 100, b"", b"\xff\xd8", b"\x89PNG\r\n\x1a\n\xff\xff\xff\xff", b"GIF89a\x01"):
        assert too_many_parts(other) is None  # other formats, and damage, are decode's to judge


def _gif(frames: int = 3, comment: bytes = b"") -> bytes:
    """An animated GIF of ``frames`` 64x48 noise frames (local palettes), with a comment extension if given."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).convert("P") for _ in range(frames)]
    out = io.BytesIO()
    images[0].save(out, "GIF", save_all=True, append_images=images[1:], duration=100, loop=0, comment=comment)
    return out.getvalue()


def _with_comment_blocks(gif: bytes, blocks: int, size: int = 1) -> bytes:
    """``gif`` with one comment extension of ``blocks`` data sub-blocks of ``size`` bytes before its trailer."""
    return gif[:-1] + b"\x21\xfe" + (bytes([size]) + b"c" * size) * blocks + b"\x00" + gif[-1:]


def test_a_gif_of_far_more_extension_blocks_than_a_photo_has_is_named():
    """GIF: extension sub-blocks past ``MAX_PARTS`` (tryout21: 2,000,000 comment sub-blocks, 1.3 s), or blocks in
    all past ``MAX_DATA_BLOCKS``: words. Animated GIFs with comments, global or local palettes, and one of
    12,000 frames: None; the walk reaches their trailer."""
    gif = _gif(comment=b"x" * 600)
    assert gif[-1:] == b"\x3b" and too_many_parts(gif) is None and too_many_parts(_gif(40)) is None
    with Image.open(io.BytesIO(_with_comment_blocks(gif, 100))) as im:  # what the test builds is a GIF Pillow reads
        assert im.n_frames == 3
    # The GIF's own parts: its extensions' sub-blocks after their first (a 600-byte comment's): under 10.
    assert too_many_parts(_with_comment_blocks(gif, MAX_PARTS - 10)) is None
    frame = b"\x21\xf9\x04\x00\x0a\x00\x00\x00" + b"\x2c" + bytes(4) + b"\x01\x00\x01\x00\x00\x02\x02\x44\x01\x00"
    with Image.open(io.BytesIO(gif[:-1] + frame * 5 + gif[-1:])) as im:  # a graphic control and a 1x1 frame
        assert im.n_frames == 8
    assert too_many_parts(gif[:-1] + frame * 12_000 + gif[-1:]) is None
    said = too_many_parts(_with_comment_blocks(gif, MAX_PARTS))
    assert said.startswith("the GIF has more than 10,000 extension blocks") and "save it again" in said
    # Image data sub-blocks are not parts, but the walk is bounded by them too.
    big = _gif(1)
    assert too_many_parts(big[:-1] + b"\x2c" + bytes(9) + b"\x08" + b"\x01\x00" * MAX_DATA_BLOCKS + b"\x00\x3b")
