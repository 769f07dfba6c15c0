"""bench/page_bench.py makes the page's upload with Pillow: the scaled copy (upright, short side as
asked, no EXIF) and the multipart body with the ``original_*`` fields, which the server reads as the page's."""

from __future__ import annotations

import io

from PIL import Image, ImageOps

from bench.page_bench import form_body, scaled_like_the_page
from conftest import encode, shared_image


def test_the_bench_sends_what_the_page_sends(client):
    raw = shared_image("phone-12mp-exif-rotated.jpg").read_bytes()  # stored 3024x4032, EXIF Orientation=6
    scaled, fields = scaled_like_the_page(raw, 256)
    with Image.open(io.BytesIO(scaled)) as im:
        assert im.format == "WEBP" and im.size == (341, 256) and not im.getexif()  # upright, no EXIF
        # lossless: the pixels of the page's copy (Pillow's bilinear resize of the upright full decode)
        upright = ImageOps.exif_transpose(Image.open(io.BytesIO(raw))).convert("RGB")
        assert im.convert("RGB").tobytes() == upright.resize((341, 256), Image.Resampling.BILINEAR).tobytes()
    assert fields == {"original_width": "4032", "original_height": "3024", "original_format": "JPEG",
                      "original_bytes": str(len(raw))}
    body, ctype = form_body(scaled, "phone.jpg", fields, "image/webp")
    (res,) = client.post("/api/v1/predict", data=body, content_type=ctype).get_json()["results"]
    assert (res["width"], res["height"], res["bytes"]) == (4032, 3024, len(raw))
    assert res["scaled_by_client"] == {"width": 341, "height": 256, "format": "WEBP", "bytes": len(scaled)}


def test_a_photo_no_larger_than_the_size_goes_as_it_is():
    small = encode(Image.new("RGB", (320, 256), (10, 90, 200)), "JPEG")
    assert scaled_like_the_page(small, 256) == (small, {})
