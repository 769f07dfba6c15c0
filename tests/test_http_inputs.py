"""Bad and strange uploads, sent over real HTTP to one real gunicorn server.

One server for the module (the offline EfficientNet-Lite0, eager: ready in seconds; 1 worker;
a 2 MiB upload limit) answers every request here with ``requests``; a second, tiny one
(seeded ResNet-18, ``CLASSIFIER_MAX_PIXELS=10000``) shows the pixel cap is a setting. Each test
checks the status and the JSON body: ``{"model", "results", "timing_ms"}``, or
``{"error": {"code", "message", "status"}}`` with the README's codes. At teardown both servers
must exit 0 with no ``Traceback`` and no Pillow warning in their logs, and the worker must be
the one that started (no crash). Decode-level behaviour is in test_imaging.py; this file is
about what reaches the server and what comes back.
"""

from __future__ import annotations

import base64
import io
import os
import re
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from conftest import (DOG_BREEDS, ROOT, encode, jpeg_with_scans, jpeg_with_segments, png_bytes, png_chunk, png_declaring,
                      png_with_chunks, shared_image, small_png)
from bench import exif_blocks
from bench.fuzz import fix_png_crcs
from serving import Server

pytestmark = pytest.mark.server

MAX_UPLOAD = 2 * 1024 * 1024
CAPPED_PIXELS = 10_000
ALLOWED = {200, 400, 413, 415}
# What must never reach the server log: tracebacks, and Pillow warnings about uploads.
LEAKS = re.compile(r"Traceback|\w+Warning\b|Palette images with Transparency|Corrupt EXIF"
                   r"|Image size \(\d+")


# ----------------------------------------------------------------------------------------- servers

def _check_log(srv: Server, code: int) -> None:
    out = srv.output()
    assert code == 0, f"gunicorn exited with {code}:\n{out[-3000:]}"
    leak = LEAKS.search(out)
    assert leak is None, f"the server log leaks {leak.group(0)!r}:\n{out[max(0, leak.start() - 2000):leak.end() + 2000]}"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """The server every test talks to, plus ``srv.capped`` (MAX_PIXELS=10000); started together."""
    tmp = tmp_path_factory.mktemp("http-inputs")
    # --no-control-socket: gunicorn's default control socket is one path per user, shared by
    # every server started at the same time (other test modules, a running service).
    main = Server(tmp / "server.log", args=("--no-control-socket",), MODEL="efficientnet_lite0", COMPILE=0,
                  WORKERS=1, MAX_BATCH_SIZE=4, MAX_UPLOAD_BYTES=MAX_UPLOAD)
    capped = Server(tmp / "capped.log", args=("--no-control-socket",), MODEL="resnet18_seeded", COMPILE=0,
                    WORKERS=1, THREADS=1, MAX_BATCH_SIZE=1, MAX_PIXELS=CAPPED_PIXELS)
    try:
        (main.pid, health), = main.wait_ready(workers=1).items()
        assert health["model"]["name"] == "efficientnet_lite0" and health["self_test"]["passed"] is True
        assert health["self_test"]["photo"].startswith("webapp/golden/dog.jpg (224x224 crop")  # not the shared one
        capped.wait_ready(workers=1)
    except BaseException:
        main.stop()
        capped.stop()
        raise
    main.capped = capped
    yield main
    try:
        pid = requests.get(main.url + "/healthz", timeout=10).json()["pid"]
    finally:
        codes = main.stop(), capped.stop()
    assert pid == main.pid, f"the worker was replaced during the module ({main.pid} -> {pid}): it crashed"
    _check_log(main, codes[0])
    _check_log(capped, codes[1])


# ----------------------------------------------------------------------------------------- helpers

def predict_url(srv) -> str:
    return srv.url + "/api/v1/predict"


def post_file(srv, data: bytes, name: str = "photo.jpg", ctype: str = "application/octet-stream", *,
              topk: int = 3, url: str | None = None) -> requests.Response:
    return requests.post(url or predict_url(srv), params={"topk": topk}, files={"file": (name, data, ctype)},
                         timeout=60)


def post_raw(srv, data, ctype: str = "image/jpeg", **kw) -> requests.Response:
    return requests.post(predict_url(srv), data=data, headers={"Content-Type": ctype, **kw.pop("headers", {})},
                         timeout=60, **kw)


def assert_error(resp: requests.Response, status: int, code: str) -> str:
    """The documented error body, exactly; returns its message."""
    assert resp.status_code == status, resp.text[:500]
    assert resp.headers["Content-Type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "status"}, body
    err = body["error"]
    assert err["status"] == status and err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    return err["message"]


def assert_ok(resp: requests.Response, n: int = 1) -> dict:
    """A 200 answer of the documented shape with ``n`` results; returns the body."""
    assert resp.status_code == 200, resp.text[:500]
    body = resp.json()
    assert set(body) == {"model", "results", "timing_ms"}, sorted(body)
    assert body["model"]["name"] == "efficientnet_lite0"
    assert len(body["results"]) == n
    for r in body["results"]:
        assert {"filename", "width", "height", "format", "predictions", "batch_size"} <= set(r)
        assert r["predictions"] and all(set(p) == {"label", "index", "probability"} for p in r["predictions"])
    return body


def top(body: dict, k: int = 3, i: int = 0) -> list[int]:
    return [p["index"] for p in body["results"][i]["predictions"][:k]]


def size(body: dict, i: int = 0) -> tuple[int, int]:
    return body["results"][i]["width"], body["results"][i]["height"]


def predictions(body: dict) -> list[tuple[int, float]]:
    return [(p["index"], p["probability"]) for p in body["results"][0]["predictions"]]


def classify(srv, data: bytes, name: str = "photo", topk: int = 5) -> dict:
    return assert_ok(post_file(srv, data, name, topk=topk))


def rss_mb(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", status, re.M).group(1)) / 1024 for k in ("VmRSS", "VmHWM")}


def jpeg_declaring(width: int, height: int) -> bytes:
    """A small valid JPEG whose SOF0 frame header is patched to ``width`` x ``height``."""
    data = bytearray(encode(Image.new("RGB", (8, 8), (1, 2, 3)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def gif_declaring(width: int, height: int) -> bytes:
    data = bytearray(encode(Image.new("P", (1, 1)), "GIF"))
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


def strip_app14(jpeg: bytes) -> bytes:
    """Remove the Adobe APP14 segment(s) of a JPEG (everything else byte for byte)."""
    out, i = bytearray(jpeg[:2]), 2
    while i < len(jpeg):
        assert jpeg[i] == 0xFF, i
        marker = jpeg[i + 1]
        if marker == 0xDA:  # start of scan: the rest is entropy-coded data
            out += jpeg[i:]
            break
        length = struct.unpack(">H", jpeg[i + 2:i + 4])[0]
        if marker != 0xEE:
            out += jpeg[i:i + 2 + length]
        i += 2 + length
    return bytes(out)


@pytest.fixture(scope="module")
def dog() -> Image.Image:
    """The shared dog photo, upright RGB (768x576)."""
    with Image.open(shared_image("dog.jpg")) as im:
        return ImageOps.exif_transpose(im).convert("RGB")


@pytest.fixture(scope="module")
def small_dog(dog) -> Image.Image:
    return dog.resize((192, 144), Image.Resampling.LANCZOS)


@pytest.fixture(scope="module")
def upright(srv, dog) -> dict:
    """The answer for the upright dog as a plain JPEG (quality 95): what orientations and CMYK must match."""
    body = classify(srv, encode(dog, "JPEG", quality=95), "upright.jpg")
    assert set(top(body)) & DOG_BREEDS
    return body


# ------------------------------------------------------------------------------- EXIF orientation

# Stored pixels for each tag, given the upright picture (the tag says how to turn them upright).
STORED = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1, :],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, 1),
    7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
    8: lambda a: np.rot90(a, -1),
}


@pytest.mark.parametrize("orientation", sorted(STORED))
def test_exif_orientation_gives_the_upright_answer(srv, dog, upright, orientation):
    stored = Image.fromarray(np.ascontiguousarray(STORED[orientation](np.asarray(dog))), "RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    tagged = encode(stored, "JPEG", quality=95, exif=exif.tobytes())
    with Image.open(io.BytesIO(tagged)) as im:
        assert im.getexif().get(0x0112) == orientation and im.size == stored.size
    body = classify(srv, tagged, f"orientation-{orientation}.jpg")
    assert size(body) == size(upright)  # landscape, like the upright photo
    assert top(body) == top(upright), (orientation, predictions(body), predictions(upright))
    # The check can fail: the same stored pixels without the tag answer differently.
    ignored = classify(srv, encode(stored, "JPEG", quality=95), "untagged.jpg")
    assert (top(ignored), size(ignored)) != (top(upright), size(upright))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("damage", sorted(exif_blocks.DAMAGED) + sorted(exif_blocks.DAMAGED_GPS))
def test_damaged_exif_keeps_its_orientation(srv, dog, upright, damage, fmt):
    """Orientation=6 beside a tag of the wrong type (Pillow's exif_transpose raises on these): still upright."""
    ifd0, gps = exif_blocks.DAMAGED_GPS[damage] if damage in exif_blocks.DAMAGED_GPS else \
        (exif_blocks.DAMAGED[damage], None)
    data = exif_blocks.stored_sideways(dog, exif_blocks.block(ifd0, gps), fmt)
    with Image.open(io.BytesIO(data)) as im, pytest.raises(Exception):
        ImageOps.exif_transpose(im)  # the damage is real: the old path fell back to "as stored"
    body = classify(srv, data, f"{damage}.{fmt.lower()}")
    assert size(body) == size(upright)
    reference = upright if fmt == "JPEG" else classify(srv, encode(dog, "PNG"), "upright.png")
    assert top(body) == top(reference), (damage, fmt, predictions(body), predictions(reference))


def test_a_turned_avif_with_damaged_exif_gets_the_upright_answer(srv, dog):
    """An AVIF stored sideways (the container's irot, as Pillow and libavif write it) with a damaged EXIF tag:
    answered as the upright AVIF, not refused as undecodable (Pillow's open re-writes the block and raised)."""
    data = exif_blocks.avif_stored_turned(dog, 6, damaged=True)  # quality 100: no coding noise between the two
    body = classify(srv, data, "turned.avif")
    reference = classify(srv, encode(dog, "AVIF", quality=100), "upright.avif")
    assert size(body) == size(reference) == dog.size
    assert top(body) == top(reference), (predictions(body), predictions(reference))


# ------------------------------------------------------------------------------------ colour modes

def _adobe_cmyk(img: Image.Image) -> bytes:
    data = encode(img.convert("CMYK"), "JPEG", quality=95)
    with Image.open(io.BytesIO(data)) as im:  # Pillow writes Photoshop-style inverted CMYK with an Adobe marker
        assert im.mode == "CMYK" and "adobe" in im.info
    return data


def _plain_cmyk(img: Image.Image) -> bytes:
    """A CMYK JPEG storing plain (not inverted) ink values, without an Adobe APP14 marker."""
    cmyk = np.asarray(img.convert("CMYK"))
    # Pillow's encoder always writes inverted samples; invert first so the file holds plain values.
    data = strip_app14(encode(Image.fromarray(255 - cmyk, "CMYK"), "JPEG", quality=95))
    with Image.open(io.BytesIO(data)) as im:
        assert im.mode == "CMYK" and "adobe" not in im.info
    return data


@pytest.mark.parametrize("kind", [
    "adobe",
    "plain",
])
def test_cmyk_jpeg_is_not_inverted(srv, dog, upright, kind):
    data = (_adobe_cmyk if kind == "adobe" else _plain_cmyk)(dog)
    body = classify(srv, data, f"cmyk-{kind}.jpg")
    assert body["results"][0]["format"] == "JPEG"
    assert top(body, 1) == top(upright, 1)
    # Top-1 alone cannot tell: this model still calls the negative of the photo a German shepherd
    # (test_inverted_photo_answers_differently); the top-3 can.
    assert set(top(body)) == set(top(upright)), (predictions(body), predictions(upright))


def test_inverted_photo_answers_differently(srv, dog, upright):
    """The control for the CMYK test: a colour-inverted dog has another top-3."""
    inverted = classify(srv, encode(Image.fromarray(255 - np.asarray(dog)), "JPEG", quality=95), "negative.jpg")
    assert set(top(inverted)) != set(top(upright))


def test_16_bit_grayscale_png_answers_like_8_bit(srv, small_dog):
    gray = np.asarray(small_dog.convert("L"))
    eight = png_bytes(Image.fromarray(gray, "L"))
    sixteen = png_bytes(Image.fromarray(gray.astype(np.uint16) * 257))
    with Image.open(io.BytesIO(sixteen)) as im:
        assert im.mode == "I;16"
    a, b = classify(srv, eight, "gray8.png"), classify(srv, sixteen, "gray16.png")
    assert top(b) == top(a)  # mid-grey stays mid-grey (a 16-bit value clipped at 255 would be white)
    for (ia, pa), (ib, pb) in zip(predictions(a), predictions(b)):
        assert ia == ib and abs(pa - pb) < 1e-3


MODES = {
    "P+transparency index": lambda im: png_bytes(im.convert("P"), transparency=0),
    "P+alpha table": lambda im: png_bytes(im.quantize(64), transparency=bytes(range(0, 256, 4))),
    "RGBA": lambda im: png_bytes(im.convert("RGBA")),
    "LA": lambda im: png_bytes(im.convert("LA")),
    "1": lambda im: png_bytes(im.convert("1")),
    "L": lambda im: png_bytes(im.convert("L")),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_colour_mode_is_answered(srv, small_dog, mode):
    data = MODES[mode](small_dog)
    with Image.open(io.BytesIO(data)) as im:
        assert im.mode == mode.split("+")[0]
    body = classify(srv, data, f"{mode}.png")
    r = body["results"][0]
    assert (r["width"], r["height"], r["format"]) == (192, 144, "PNG")
    again = classify(srv, data, f"{mode}.png")
    assert predictions(again) == predictions(body)  # deterministic


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_animated_image_answers_for_its_first_frame(srv, small_dog, fmt):
    frames = [small_dog, ImageOps.mirror(small_dog).rotate(90), Image.new("RGB", small_dog.size, (0, 0, 255))]
    save = {"lossless": True} if fmt == "WEBP" else {}
    anim = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0, **save)
    with Image.open(io.BytesIO(anim)) as im:
        assert im.n_frames == 3
        first = png_bytes(im.convert("RGB"))  # frame 0 exactly as the file holds it
        im.seek(1)
        second = png_bytes(im.convert("RGB"))
    a, b = classify(srv, anim, f"anim.{fmt.lower()}"), classify(srv, anim, f"anim.{fmt.lower()}")
    assert a["results"][0]["format"] == fmt
    assert predictions(a) == predictions(b)  # identical across requests
    assert predictions(a) == predictions(classify(srv, first, "frame0.png"))
    assert top(classify(srv, second, "frame1.png")) != top(a)  # the frames really differ


def test_progressive_jpeg_answers_like_baseline(srv, dog):
    progressive = encode(dog, "JPEG", quality=90, progressive=True)
    with Image.open(io.BytesIO(progressive)) as im:
        assert im.info.get("progressive") or im.info.get("progression")
    a = classify(srv, progressive, "progressive.jpg")
    b = classify(srv, encode(dog, "JPEG", quality=90), "baseline.jpg")
    assert top(a) == top(b)
    assert set(top(a)) & DOG_BREEDS


@pytest.mark.parametrize("size", [(1, 1), (10000, 10), (10, 10000)])
def test_tiny_and_extreme_strips_are_answered_fast(srv, size):
    w, h = size
    grad = (np.add.outer(np.arange(h), np.arange(w)) % 256).astype(np.uint8)
    data = png_bytes(Image.fromarray(np.stack([grad, 255 - grad, np.full_like(grad, 60)], -1), "RGB"))
    start = time.perf_counter()
    body = classify(srv, data, f"{w}x{h}.png")
    assert time.perf_counter() - start < 5.0
    assert (body["results"][0]["width"], body["results"][0]["height"]) == size


# ------------------------------------------------------------------------------ not images at all

def test_zero_byte_upload_is_no_file(srv):
    assert "empty" in assert_error(post_file(srv, b"", "empty.jpg", "image/jpeg"), 400, "no_file")
    assert_error(post_raw(srv, b""), 400, "no_file")


def test_truncated_jpeg_is_undecodable(srv):
    raw = shared_image("dog.jpg").read_bytes()
    msg = assert_error(post_file(srv, raw[: len(raw) // 2], "half.jpg", "image/jpeg"), 400, "undecodable_image")
    assert "half.jpg" in msg


def test_whole_photos_pillow_refused_get_the_photos_answer(srv, small_dog):
    """A JPEG without its final EOI marker, a PNG whose zTXt comment inflates past Pillow's 1 MiB guard, an
    APNG fading in from a transparent frame: each was a 400 (or a blank page's labels); each now gets the answer
    of the photo it holds, the same as the plain file's."""
    whole = shared_image("dog.jpg").read_bytes()
    assert predictions(classify(srv, whole[:-2], "no-eoi.jpg")) == predictions(classify(srv, whole, "dog.jpg"))
    plain = png_bytes(small_dog)
    at = plain.index(b"IDAT") - 4
    comment = png_chunk(b"zTXt", b"Comment\x00\x00" + zlib.compress(b"a" * (2 * 2**20)))
    assert predictions(classify(srv, plain[:at] + comment + plain[at:], "ztxt.png")) == \
        predictions(classify(srv, plain, "plain.png"))
    clear = Image.new("RGBA", small_dog.size, (0, 0, 0, 0))
    fade = encode(clear, "PNG", save_all=True, append_images=[small_dog.convert("RGBA")], duration=100)
    assert predictions(classify(srv, fade, "fade-in.png")) == predictions(classify(srv, plain, "plain.png"))


@pytest.mark.parametrize("data, named", [
    (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n" + b"\x00" * 200, "PDF"),
    (b"hello, this is a text file and not a photo\n" * 20, None),
    (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + b"\x00" * 200, "HEIC"),
], ids=["pdf", "text", "heic"])
def test_non_images_named_jpg_are_415(srv, data, named):
    msg = assert_error(post_file(srv, data, "holiday.jpg", "image/jpeg"), 415, "unsupported_media_type")
    assert "holiday.jpg" in msg
    if named:
        assert named in msg
    msg = assert_error(post_raw(srv, data, "image/jpeg"), 415, "unsupported_media_type")
    if named:
        assert named in msg


def test_multipart_without_a_file_part_is_400(srv):
    resp = requests.post(predict_url(srv), files={"image": ("a.png", small_png(), "image/png")},
                         data={"note": "hi"}, timeout=30)
    assert "'file'" in assert_error(resp, 400, "no_file")
    resp = requests.post(predict_url(srv), files={"note": (None, "only a form field")}, timeout=30)
    assert_error(resp, 400, "no_file")


def _multipart(boundary: bytes, filename: bytes, data: bytes) -> bytes:
    return (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="' + filename
            + b'"\r\nContent-Type: image/png\r\n\r\n' + data + b"\r\n--" + boundary + b"--\r\n")


@pytest.mark.parametrize("ctype, boundary, problem", [
    ("multipart/form-data", b"b0undary", "no boundary parameter"),
    ("multipart/form-data; boundary=other", b"b0undary", "no part is delimited by the boundary 'other'"),
    # the right boundary, but the body stops before its closing delimiter (a cut-off upload)
    ("multipart/form-data; boundary=b0undary", b"b0undary", "it ends before its closing delimiter '--b0undary--'"),
])
def test_broken_multipart_boundary_is_bad_request(srv, ctype, boundary, problem):
    body = _multipart(boundary, b"a.png", small_png())
    if "closing" in problem:
        body = body[:body.rindex(b"\r\n--b0undary--")]
    resp = requests.post(predict_url(srv), data=body, headers={"Content-Type": ctype}, timeout=30)
    assert problem in assert_error(resp, 400, "bad_request")


def test_a_short_body_without_the_boundary_is_bad_request_too(srv):
    """5 bytes of text under a multipart header were ``no_file`` (tryout18): shorter than an empty form, it was taken
    for one; any body that has no delimiter of its boundary is malformed."""
    resp = requests.post(predict_url(srv), data=b"hello", headers={"Content-Type": "multipart/form-data; boundary=xyz"},
                         timeout=30)
    assert "no part is delimited by the boundary 'xyz'" in assert_error(resp, 400, "bad_request")


def test_a_multipart_body_with_no_parts_is_still_no_file(srv):
    resp = requests.post(predict_url(srv), data=b"--b--\r\n", headers={"Content-Type": "multipart/form-data; boundary=b"},
                         timeout=30)
    assert_error(resp, 400, "no_file")


@pytest.mark.parametrize("sent, echoed", [
    (b"caf\xe9.png", "caf\u00e9.png"),  # Latin-1 bytes, as curl -F sends a Latin-1 file name: read as Latin-1
    ("caf\u00e9 \u72d7.png".encode(), "caf\u00e9 \u72d7.png"),  # UTF-8, as browsers send it
])
def test_a_part_header_that_is_not_utf8_still_gets_its_photo_classified(srv, sent, echoed):
    # Werkzeug reads part headers as strict UTF-8 and drops the whole form on one byte that is not.
    body = _multipart(b"XyZ", sent, small_png())
    resp = requests.post(predict_url(srv), data=body, headers={"Content-Type": "multipart/form-data; boundary=XyZ"},
                         timeout=30)
    assert assert_ok(resp)["results"][0]["filename"] == echoed


@pytest.mark.parametrize("sent, echoed", [
    ("\u72d7 caf\u00e9.png".encode(), "\u72d7 caf\u00e9.png"),  # UTF-8 bytes, as curl -H and requests send them
    (b"caf\xe9.png", "caf\u00e9.png"),  # not UTF-8: Latin-1
    (b"plain.png", "plain.png"),
])
def test_a_raw_bodys_x_filename_is_read_as_utf8(srv, sent, echoed):
    resp = post_raw(srv, small_png(), "image/png", headers={"X-Filename": sent})
    assert assert_ok(resp)["results"][0]["filename"] == echoed


def test_parts_with_bare_lf_line_ends_are_read(srv):
    body = (b'--XyZ\nContent-Disposition: form-data; name="file"; filename="a.png"\nContent-Type: image/png\n\n'
            + small_png() + b"\n--XyZ--\n")
    resp = requests.post(predict_url(srv), data=body, headers={"Content-Type": "multipart/form-data; boundary=XyZ"},
                         timeout=30)
    assert assert_ok(resp)["results"][0]["filename"] == "a.png"


@pytest.mark.parametrize("sent, echoed", [
    (b"C:\\Users\\x\\pic.png", "pic.png"),  # bare backslashes, as some Windows clients send them
    (b"C:\\\\Users\\\\x\\\\pic.png", "pic.png"),  # the same, escaped as RFC 7578 quoted-strings
    (b"folder/pic.png", "pic.png"),  # a POSIX path: its last component too (RFC 7578 section 4.2)
    (b"../../etc/pic.png", "pic.png"),
    (b"folder/", "upload"),  # nothing left: the name every nameless photo gets
    (b'a\\"b.png', 'a"b.png'),  # a quote escaped as curl escapes it: not a path (was '"b.png': tryout30)
    (b'C:\\x\\say \\"hi\\".png', 'say "hi".png'),
])
def test_paths_are_echoed_as_their_last_component(srv, sent, echoed):
    body = _multipart(b"XyZ", sent, small_png())
    resp = requests.post(predict_url(srv), data=body, headers={"Content-Type": "multipart/form-data; boundary=XyZ"},
                         timeout=30)
    assert assert_ok(resp)["results"][0]["filename"] == echoed


def test_empty_file_part_is_400(srv):
    # What a browser sends when no photo was chosen: an unnamed, empty part.
    resp = requests.post(predict_url(srv), files={"file": ("", b"", "application/octet-stream")}, timeout=30)
    assert_error(resp, 400, "no_file")


@pytest.mark.parametrize("ctype", ["text/plain", "application/json", "application/x-www-form-urlencoded"])
def test_raw_body_that_is_not_an_image_type_is_415(srv, ctype):
    msg = assert_error(post_raw(srv, small_png(), ctype), 415, "unsupported_media_type")
    assert ctype in msg


# ------------------------------------------------------------------------------------------- names

NAMES = ["fotografía.jpg", "照片.jpg", "🐶.jpg", "../../etc/passwd.jpg", "<img src=x onerror=alert(1)>.jpg"]


def _files_named(names: set[str]) -> list[str]:
    found = []
    for top_dir in (ROOT, Path("/tmp")):
        for dirpath, dirnames, filenames in os.walk(top_dir, onerror=lambda e: None):
            dirnames[:] = [d for d in dirnames if d not in (".venv", ".git")]
            found += [os.path.join(dirpath, f) for f in filenames if f in names]
    return found


def test_filenames_are_echoed_exactly_and_never_used_as_paths(srv, small_dog):
    data = encode(small_dog, "JPEG", quality=90)
    basenames = {os.path.basename(n) for n in NAMES} | set(NAMES)
    echoed = [os.path.basename(n) for n in NAMES]  # a path's last component: the one name that is cut
    before = set(_files_named(basenames))
    for name, want in zip(NAMES, echoed):
        body = assert_ok(post_file(srv, data, name, "image/jpeg"))
        assert body["results"][0]["filename"] == want
    # Several in one request keep their own names, in order.
    resp = requests.post(predict_url(srv), files=[("file", (n, data, "image/jpeg")) for n in NAMES[:4]], timeout=60)
    assert [r["filename"] for r in assert_ok(resp, n=4)["results"]] == echoed[:4]
    # The raw-body form takes its name from X-Filename, cut the same way.
    body = assert_ok(post_raw(srv, data, headers={"X-Filename": "../../etc/passwd.jpg"}))
    assert body["results"][0]["filename"] == "passwd.jpg"
    assert not Path("/etc/passwd.jpg").exists() and not (ROOT / "../../etc/passwd.jpg").resolve().exists()
    assert set(_files_named(basenames)) == before, "an upload's name was used as a path"


def test_page_escapes_filenames(srv, small_dog):
    data = encode(small_dog, "JPEG", quality=90)
    resp = requests.post(srv.url + "/", files=[("file", (n, data, "image/jpeg")) for n in NAMES], timeout=60)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/html")
    page = resp.text
    assert "&lt;img src=x onerror=alert(1)&gt;.jpg" in page and "<img src=x" not in page
    for name in ("fotografía.jpg", "照片.jpg", "🐶.jpg", "passwd.jpg"):
        assert name in page
    assert "../../etc" not in page
    # An error page escapes the name too (it is in the message).
    resp = requests.post(srv.url + "/", files={"file": ("<i onclick=x>bad.jpg", b"%PDF-1.4 x", "image/jpeg")},
                         timeout=30)
    assert resp.status_code == 415 and "&lt;i onclick=x&gt;bad.jpg" in resp.text and "<i onclick" not in resp.text


# ------------------------------------------------------------------------------- pixel bombs, limits

def _real_png_bomb(w: int, h: int) -> bytes:
    """A real ``w`` x ``h`` grayscale PNG of zeros: a few tens of KB that decode to w*h bytes."""
    z = zlib.compressobj(9)
    row = b"\x00" + bytes(w)
    body = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + png_chunk(b"IDAT", body) + png_chunk(b"IEND", b""))


def test_decompression_bombs_are_413_fast_and_memory_stays_bounded(srv):
    bombs = {
        "20000x20000.png": png_declaring(20000, 20000),
        "9500x9500.png": png_declaring(9500, 9500),        # just over the default 80 MP
        "65535x65535.gif": gif_declaring(65535, 65535),
        "60000x60000.jpg": jpeg_declaring(60000, 60000),
        "1x80000001.png": png_declaring(1, 80_000_001),
        "9000x9000-real.png": _real_png_bomb(9000, 9000),  # real pixel data: 81 MP from ~80 KB
    }
    assert len(bombs["9000x9000-real.png"]) < 200_000
    before = rss_mb(srv.pid)
    for name, data in bombs.items():
        start = time.perf_counter()
        msg = assert_error(post_file(srv, data, name, "image/png"), 413, "too_large")
        elapsed = time.perf_counter() - start
        assert elapsed < 1.0, f"{name}: {elapsed:.2f} s"
        assert name in msg and "80,000,000" in msg and "CLASSIFIER_MAX_PIXELS" in msg
    assert "400,000,000" in assert_error(post_file(srv, bombs["20000x20000.png"], "b.png"), 413, "too_large")
    after = rss_mb(srv.pid)
    assert after["VmRSS"] - before["VmRSS"] < 100, (before, after)
    assert after["VmHWM"] - before["VmHWM"] < 100, (before, after)  # not even a transient peak
    # Under the cap the header passes and the missing pixel data is what fails: the cap is the default 80 MP.
    assert_error(post_file(srv, png_declaring(8000, 8000), "64mp.png"), 400, "undecodable_image")


def test_files_of_far_more_scans_segments_or_chunks_than_a_photo_are_413_at_once(srv, small_dog):
    """Valid files built to cost seconds of CPU in few bytes (tryout21: a 489 KB JPEG of 3,000 scans of an 8900x8900
    frame, 13-17 s; 1,000,000 empty COM segments, 7-10 s; here within this server's 2 MiB limit): refused from their
    structure, before Pillow opens them; a file at the scan limit is still answered."""
    from webapp.formats import MAX_JPEG_SCANS, MAX_PARTS

    progressive = encode(small_dog, "JPEG", quality=90, progressive=True)
    scans = progressive.count(b"\xff\xda")
    big = np.zeros((4000, 4000, 3), np.uint8)  # 16 MP: each extra scan a pass over all of it
    big_scans = encode(Image.fromarray(big), "JPEG", progressive=True)
    floods = {"scans.jpg": jpeg_with_scans(big_scans, 10 * MAX_JPEG_SCANS),
              "segments.jpg": jpeg_with_segments(encode(small_dog, "JPEG"), 50 * MAX_PARTS),  # 2 MB
              "chunks.png": png_with_chunks(png_bytes(small_dog), MAX_PARTS + 1),
              "comments.gif": (gif := encode(small_dog.convert("P"), "GIF"))[:-1] + b"\x21\xfe" + b"\x01c" * 500_000
              + b"\x00" + gif[-1:]}  # one comment of 500,000 1-byte data sub-blocks
    for name, data in floods.items():
        assert len(data) < MAX_UPLOAD, (name, len(data))
        start = time.perf_counter()
        msg = assert_error(post_file(srv, data, name), 413, "too_large")
        assert time.perf_counter() - start < 1.0, name
        assert msg.startswith(f"{name}: the ") and "save it again" in msg, msg
    # At the limit: answered (its repeated refinement scan adds its bits again: another picture, so no label check).
    at_limit = classify(srv, jpeg_with_scans(progressive, MAX_JPEG_SCANS - scans), "100-scans.jpg")
    assert at_limit["results"][0]["format"] == "JPEG" and len(top(at_limit)) == 3


def test_pixel_cap_is_a_setting(srv):
    capped = srv.capped
    url = capped.url + "/api/v1/predict"
    resp = post_file(srv, small_png(size=(100, 100)), "100x100.png", url=url)
    assert resp.status_code == 200 and resp.json()["model"]["name"] == "resnet18_seeded"
    msg = assert_error(post_file(srv, small_png(size=(100, 101)), "100x101.png", url=url), 413, "too_large")
    assert "10,100" in msg and "10,000" in msg and "CLASSIFIER_MAX_PIXELS" in msg
    # The same image is fine under the main server's default cap.
    assert_ok(post_file(srv, small_png(size=(100, 101)), "100x101.png"))


def test_the_photos_of_one_request_are_bounded_together_before_any_is_decoded(srv):
    """Each photo under MAX_PIXELS, together over MAX_REQUEST_PIXELS (default 256 MP): 413 at once, from the
    headers. These have no pixel data (decoded, each would be a 400): the 413 shows nothing was decoded."""
    dense = png_declaring(8000, 8000)  # 64 MP by its header, a few hundred bytes
    files = [("file", (f"p{i}.png", dense, "image/png")) for i in range(5)]
    start = time.perf_counter()
    resp = requests.post(predict_url(srv), files=files, timeout=60)
    assert time.perf_counter() - start < 1.0
    msg = assert_error(resp, 413, "too_large")
    assert "320,000,000" in msg and "256,000,000" in msg and "CLASSIFIER_MAX_REQUEST_PIXELS" in msg
    assert "undecodable_image" in requests.post(predict_url(srv), files=files[:4], timeout=60).text  # 256 MP fit
    # The same for /v2 (the protocol's JSON, photos as base64)
    body = {"inputs": [{"name": "image", "shape": [5], "datatype": "BYTES",
                        "data": [base64.b64encode(dense).decode()] * 5}]}
    resp = requests.post(srv.url + "/v2/models/efficientnet_lite0/infer", json=body, timeout=60)
    assert resp.status_code == 413 and "CLASSIFIER_MAX_REQUEST_PIXELS" in resp.text, resp.text[:300]


BIG = 20_000_000


def _chunks(data: bytes, size: int = 256 * 1024):
    for i in range(0, len(data), size):
        yield data[i:i + size]


@pytest.mark.parametrize("how", ["multipart", "raw", "chunked"])
def test_over_the_byte_limit_the_client_reads_the_413(srv, how):
    big = bytes(BIG)
    with requests.Session() as session:
        if how == "multipart":
            resp = session.post(predict_url(srv), files={"file": ("big.jpg", big, "image/jpeg")}, timeout=60)
        elif how == "raw":
            resp = session.post(predict_url(srv), data=big, headers={"Content-Type": "image/jpeg"}, timeout=60)
            assert resp.request.headers["Content-Length"] == str(BIG)
        else:
            resp = session.post(predict_url(srv), data=_chunks(big), headers={"Content-Type": "image/jpeg"},
                                timeout=60)
            assert resp.request.headers.get("Transfer-Encoding") == "chunked"
        msg = assert_error(resp, 413, "too_large")  # received, not a connection reset
        assert f"{MAX_UPLOAD:,}" in msg and "CLASSIFIER_MAX_UPLOAD_BYTES" in msg
        # The next request (same session: the connection is reused if it was kept) is answered.
        assert_ok(session.post(predict_url(srv), files={"file": ("ok.png", small_png(), "image/png")}, timeout=60))
    assert_ok(post_file(srv, small_png(), "ok.png"))


def test_just_under_the_byte_limit_is_answered(srv):
    data = png_bytes(Image.new("RGB", (32, 32), (9, 9, 9)))
    data += b"\x00" * (MAX_UPLOAD - 4096 - len(data))  # trailing bytes after IEND are ignored
    assert_ok(post_raw(srv, data, "image/png"))


# ------------------------------------------------------------------------------ several files, one bad

@pytest.mark.parametrize("bad, status, code", [
    (b"%PDF-1.4\n" + b"x" * 100, 415, "unsupported_media_type"),
    (None, 400, "undecodable_image"),       # a truncated JPEG
    (png_declaring(20000, 20000), 413, "too_large"),
    (b"", 400, "no_file"),
], ids=["pdf", "truncated", "bomb", "empty"])
def test_one_bad_file_among_several_is_named(srv, small_dog, bad, status, code):
    good = encode(small_dog, "JPEG", quality=90)
    if bad is None:
        bad = good[: len(good) // 2]
    files = [("file", ("good-1.jpg", good, "image/jpeg")), ("file", ("the-bad-one.jpg", bad, "image/jpeg")),
             ("file", ("good-2.png", small_png(), "image/png"))]
    msg = assert_error(requests.post(predict_url(srv), files=files, timeout=60), status, code)
    assert "the-bad-one.jpg" in msg and "good-1" not in msg and "good-2" not in msg
    body = assert_ok(requests.post(predict_url(srv), files=[files[0], files[2]], timeout=60), n=2)
    assert [r["filename"] for r in body["results"]] == ["good-1.jpg", "good-2.png"]


# ------------------------------------------------------------------------------------------- fuzzing

def _fuzz_seeds() -> list[bytes]:
    rng = np.random.default_rng(3)
    im = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8), "RGB")
    return [encode(im, "JPEG", quality=80), encode(im, "JPEG", quality=80, progressive=True), png_bytes(im),
            png_bytes(im.convert("P"), transparency=3)]


FUZZ_SEEDS = _fuzz_seeds()


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(FUZZ_SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        if not data:
            break
        pos = min(draw(st.one_of(st.integers(0, 127), st.integers(0, len(data) - 1))), len(data) - 1)
        op = draw(st.sampled_from(["set", "flip", "value", "insert", "delete", "truncate"]))
        if op == "set":
            data[pos] = draw(st.integers(0, 255))
        elif op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "value":  # a size-like field: 0, huge, off by one
            data[pos:pos + 2] = struct.pack(">H", draw(st.sampled_from([0, 1, 0x7FFF, 0x8000, 0xFFFF, 9500])))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=32))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        else:
            del data[pos:]
    return fix_png_crcs(bytes(data)) if draw(st.booleans()) else bytes(data)


def _send_and_check(srv, data: bytes, how: str) -> None:
    if how == "multipart":
        resp = post_file(srv, data, "fuzz.jpg", "image/jpeg")
    else:
        resp = post_raw(srv, data, "image/jpeg")
    assert resp.status_code in ALLOWED, resp.text[:500]
    if resp.status_code == 200:
        assert_ok(resp)
    else:
        code = resp.json()["error"]["code"]
        assert code in {"no_file", "undecodable_image", "too_large", "unsupported_media_type"}, code
        assert_error(resp, resp.status_code, code)


def test_fuzzed_uploads_never_500_and_never_crash_the_worker(srv):
    """Arbitrary bytes and mutated JPEG/PNG files, as multipart and as raw bodies: never a 500."""
    seen = []

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.one_of(st.binary(max_size=2048), mutated(), mutated()), how=st.sampled_from(["multipart", "raw"]))
    def run(data, how):
        _send_and_check(srv, data, how)
        seen.append(how)

    start = time.perf_counter()
    run()
    assert len(seen) >= 60 and set(seen) == {"multipart", "raw"}
    assert time.perf_counter() - start < 30
    health = requests.get(srv.url + "/healthz", timeout=10).json()
    assert health["pid"] == srv.pid and health["ready"] is True, health
    assert_ok(post_file(srv, small_png(), "after.png"))


@pytest.mark.skipif(__import__("shutil").which("curl") is None, reason="curl is not installed (.ci/run installs it)")
def test_curl_d_and_text_of_a_photo_are_told_with_what_to_send(srv, tmp_path):
    """The real curl's ``-d @photo.jpg`` (form data: the file's CR and LF bytes stripped) got "Content-Type
    application/x-www-form-urlencoded is not accepted", and with an image Content-Type, "damaged"; base64 text of
    the photo got "not an image format". Each now says what happened and what to send (webapp/mangled.py)."""
    import json
    import subprocess

    def curl(*args: str) -> dict:
        out = subprocess.run(["curl", "-sS", *args, predict_url(srv)], capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout)["error"]

    dog = shared_image("dog.jpg")
    form = curl("-d", f"@{dog}")
    assert form["status"] == 415 and "curl -d and --data-binary send that" in form["message"] and "--data-binary" in form["message"]
    stripped = curl("-d", f"@{dog}", "-H", "Content-Type: image/jpeg")
    assert (stripped["status"], stripped["code"]) == (400, "undecodable_image")
    assert "no CR or LF byte" in stripped["message"] and "--data-binary @photo.jpg" in stripped["message"]
    text = tmp_path / "dog.b64"
    text.write_bytes(base64.encodebytes(dog.read_bytes()))  # what `base64 dog.jpg > dog.b64` writes
    b64 = curl("--data-binary", f"@{text}", "-H", "Content-Type: image/jpeg")
    assert (b64["status"], b64["code"]) == (415, "unsupported_media_type")
    assert b64["message"].startswith("upload: it is base64 text of a JPEG")
    utf8 = post_file(srv, dog.read_bytes().decode("utf-8", "replace").encode(), "text.jpg", "image/jpeg")
    assert "text.jpg: a JPEG changed on the way: it was read as UTF-8 text" in assert_error(utf8, 400,
                                                                                           "undecodable_image")
    assert predictions(classify(srv, dog.read_bytes(), "dog.jpg"))  # the same bytes unchanged: answered


@pytest.mark.skipif(__import__("shutil").which("curl") is None, reason="curl is not installed (.ci/run installs it)")
def test_the_advice_of_each_refusal_works_as_written(srv):
    """A refusal's advice, done as it says with the real curl and requests, gets the photo answered (tryout16:
    "data=open(path, 'rb')" from the advice got a 415 for its missing Content-Type, and --data-binary without
    -H was told it had used -d)."""
    import json
    import subprocess

    dog = shared_image("dog.jpg")

    def curl(*args: str) -> dict:
        out = subprocess.run(["curl", "-sS", *args, predict_url(srv)], capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout)

    def done_as_said(message: str) -> None:  # each curl and requests way the message names, on dog.jpg
        ways = 0
        if "-F file=@photo.jpg" in message:
            ways += bool(curl("-F", f"file=@{dog}")["results"])
        if said := re.search(r"--data-binary @photo\.jpg -H '([^']+)'", message):
            ways += bool(curl("--data-binary", f"@{dog}", "-H", said[1])["results"])
        if "files={'file': open(path, 'rb')}" in message:
            with open(dog, "rb") as f:
                ways += bool(requests.post(predict_url(srv), files={"file": f}, timeout=60).json()["results"])
        if said := re.search(r"headers=\{'Content-Type': '([^']+)'\}", message):
            ways += bool(requests.post(predict_url(srv), data=dog.read_bytes(), headers={"Content-Type": said[1]},
                                       timeout=60).json()["results"])
        assert ways >= 2, message

    binary = curl("--data-binary", f"@{dog}")["error"]  # curl's default type: form data
    assert binary["status"] == 415 and "--data-binary send that unless told otherwise" in binary["message"]
    done_as_said(binary["message"])
    none = requests.post(predict_url(srv), data=dog.read_bytes(), timeout=60).json()["error"]  # no Content-Type
    assert none["status"] == 415 and "Python requests sends none for data=" in none["message"]
    done_as_said(none["message"])
    stripped = curl("-d", f"@{dog}", "-H", "Content-Type: image/jpeg")["error"]  # the photo's CR and LF bytes gone
    assert stripped["status"] == 400
    done_as_said(stripped["message"])
