"""webapp.sizes: what a request's photos cost to decode, read before any pixel is (pixels, parts walk), and the
bound on them together; each photo's parts are walked once a request.

Fixtures are generated here with Pillow (or read from ../shared/images through ``shared_image``).
"""
from __future__ import annotations

import io
import struct

import pytest
from PIL import Image

from webapp import formats, imaging, sizes
from webapp.contract import Upload
from webapp.errors import TooLarge
from webapp.imaging import decode
from webapp.sizes import Size, check_request_pixels, decoded_pixels, read_size

from conftest import encode, inflating_chunk, jpeg_with_segments, png_declaring, shared_image


def _uploads(named) -> list[Upload]:
    """``Upload``s of ``(name, data)`` pairs, as a request's form gives them."""
    return [Upload(name, data) for name, data in named]


def _jpeg_declaring(width: int, height: int) -> bytes:
    """A small valid JPEG whose SOF0 frame header says ``width`` x ``height`` (its pixel data is 8x8)."""
    data = bytearray(encode(Image.new("RGB", (8, 8), (1, 2, 3)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.mark.parametrize("fmt,size", [("PNG", (300, 200)), ("JPEG", (4000, 3000)), ("JPEG", (1200, 900)),
                                      ("JPEG", (600, 400)), ("WEBP", (640, 480)), ("GIF", (50, 40)),
                                      ("TIFF", (1000, 10)), ("BMP", (33, 77))])
def test_decoded_pixels_are_the_pixels_decode_makes(fmt, size):
    """The request budget counts from the header what ``decode`` then decodes: a large JPEG at its reduced DCT
    scale, every other format at full size."""
    data = encode(Image.new("RGB", size, (90, 120, 30)), fmt)
    for min_side in (None, 224, 256):
        w, h = decode(data, max_pixels=10**9, min_side=min_side).image.size
        assert decoded_pixels(data, min_side) == w * h, (fmt, size, min_side)
    assert decoded_pixels(data, None) == size[0] * size[1]


def test_decoded_pixels_read_the_header_alone():
    assert decoded_pixels(png_declaring(8900, 8900), 256) == 8900 * 8900  # no pixel data behind it: not decoded
    assert decoded_pixels(_jpeg_declaring(8000, 6000), 256) == 1000 * 750  # 1/8 keeps the short side >= 512
    assert decoded_pixels(_jpeg_declaring(8000, 6000), None) == 48_000_000
    assert decoded_pixels(b"not an image at all", 256) == 0  # decode names the fault in its turn
    assert decoded_pixels(b"\x89PNG\r\n\x1a\n" + b"\x00" * 10, 256) == 0


def test_a_request_is_bounded_by_its_photos_pixels_together():
    """16 dense 80 MP PNGs of ~600 KB each passed every per-photo and byte limit and held a worker for the
    whole request timeout decoding them; their pixels together are refused before any is decoded."""
    dense = png_declaring(8000, 8000)  # 64 MP each by its header
    four = _uploads((f"p{i}.png", dense) for i in range(4))
    assert [s.pixels for s in check_request_pixels(four, limit=256_000_000, min_side=256)] == [64_000_000] * 4  # = it
    with pytest.raises(TooLarge) as ei:
        check_request_pixels(_uploads((f"p{i}.png", dense) for i in range(5)), limit=256_000_000, min_side=256)
    msg = ei.value.message
    assert ei.value.status == 413 and ei.value.code == "too_large"
    assert "5 photos" in msg and "320,000,000" in msg and "256,000,000" in msg
    assert "CLASSIFIER_MAX_REQUEST_PIXELS" in msg and "several requests" in msg
    # 16 phone JPEGs of 48 MP count at the size they are decoded at: ~12 MP together
    check_request_pixels(_uploads((f"j{i}.jpg", _jpeg_declaring(8000, 6000)) for i in range(16)), limit=256_000_000,
                         min_side=256)
    with pytest.raises(TooLarge, match=r"big\.png: decodes to 64,000,000 pixels; the limit per request is "
                                       r"1,000,000 \(CLASSIFIER_MAX_REQUEST_PIXELS\)"):
        check_request_pixels(_uploads([("big.png", dense)]), limit=1_000_000, min_side=256)
    check_request_pixels(_uploads([("junk.bin", b"junk")] * 16), limit=1, min_side=256)  # unreadable: decode judges
    # a PNG that decode mends (metadata past Pillow's guard) counts as the pixels it will decode
    at = dense.index(b"IDAT") - 4
    mended = dense[:at] + inflating_chunk(b"zTXt") + dense[at:]
    assert decoded_pixels(mended, 256) == 64_000_000
    with pytest.raises(TooLarge):
        check_request_pixels(_uploads((f"m{i}.png", mended) for i in range(5)), limit=256_000_000, min_side=256)


def test_read_size_says_what_decode_will_refuse_unopened_and_decode_takes_its_word():
    """A file of far more parts than a photo is ``refused`` with ``too_many_parts``' words and 0 pixels, unopened;
    ``decode`` given that ``Size`` refuses it with those words (413) and given a clean one does not walk again."""
    flood = jpeg_with_segments(encode(Image.new("RGB", (32, 24), (9, 99, 199)), "JPEG"), formats.MAX_PARTS)
    size = read_size(flood, 224)
    assert size == Size(0, 224, formats.too_many_parts(flood)) and "10,000 marker segments" in size.refused
    with pytest.raises(TooLarge, match=r"^flood\.jpg: the JPEG has more than 10,000 marker segments"):
        decode(flood, max_pixels=10**8, name="flood.jpg", size=size)
    dog = shared_image("dog.jpg").read_bytes()
    assert read_size(dog, None) == Size(768 * 576, None) and read_size(dog, 224).pixels == 768 * 576  # 2x 224 > 576/2


def test_each_photo_is_walked_once_a_request_on_the_api_and_the_page(client, monkeypatch):
    """The parts walk (``too_many_parts``: ~2 ms on a 3 MB phone JPEG) ran for the request's pixel check and again
    in ``decode``, and a third time on the page's several-photo path (its own check, then each photo's request):
    once a photo now, whichever path. A flood among them is still refused (413) in its turn, and one read at
    another ``min_side`` is read again."""
    walked = []
    real = formats.too_many_parts
    monkeypatch.setattr(sizes, "too_many_parts", lambda data: walked.append(len(data)) or real(data))
    monkeypatch.setattr(imaging, "too_many_parts", lambda data: walked.append(len(data)) or real(data))
    dog, eagle = (shared_image(n).read_bytes() for n in ("dog.jpg", "eagle.jpg"))
    resp = client.post("/api/v1/predict", data={"file": [(io.BytesIO(dog), "dog.jpg"), (io.BytesIO(eagle), "e.jpg")]})
    assert resp.status_code == 200 and sorted(walked) == sorted([len(dog), len(eagle)])
    walked.clear()
    resp = client.post("/", data={"file": [(io.BytesIO(dog), "dog.jpg"), (io.BytesIO(eagle), "e.jpg")]})
    assert resp.status_code == 200 and resp.data.count(b'<article class="result">') == 2  # both labelled
    assert sorted(walked) == sorted([len(dog), len(eagle)])
    walked.clear()
    flood = jpeg_with_segments(dog, formats.MAX_PARTS)
    resp = client.post("/api/v1/predict", data={"file": [(io.BytesIO(dog), "dog.jpg"), (io.BytesIO(flood), "f.jpg")]})
    assert resp.status_code == 413 and resp.get_json()["error"]["message"].startswith("f.jpg: the JPEG has more than")
    assert sorted(walked) == sorted([len(dog), len(flood)])
    up = Upload("dog.jpg", dog)
    check_request_pixels([up], limit=10**9, min_side=None)
    first = up.size
    check_request_pixels([up], limit=10**9, min_side=None)
    assert up.size is first and up.size.min_side is None
    check_request_pixels([up], limit=10**9, min_side=224)
    assert up.size is not first and up.size.min_side == 224
