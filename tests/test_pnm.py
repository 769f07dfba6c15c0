"""webapp/pnm.py: the numpy PNM decoders give Pillow's own bytes (and its errors) for every variant Pillow
decodes in Python: binary with a maxval other than 255, plain (ASCII) grey and colour."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, PpmImagePlugin

from webapp import imaging, pnm

RNG = np.random.default_rng(1)


def _decode(data: bytes, *, ours: bool):
    """(mode, size, bytes) or the exception's class name, with our decoders registered or Pillow's."""
    if ours:
        pnm.install()
    else:
        Image.register_decoder("ppm", PpmImagePlugin.PpmDecoder)
        Image.register_decoder("ppm_plain", PpmImagePlugin.PpmPlainDecoder)
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.mode, img.size, img.tobytes()
    except Exception as exc:  # noqa: BLE001  the same kind of refusal is part of "the same"
        return type(exc).__name__
    finally:
        pnm.install()


def _binary_cases():
    for magic, bands in ((b"P5", 1), (b"P6", 3)):
        for maxval in (1, 7, 100, 254, 256, 1000, 4095, 65534, 65535):
            w, h = 37, 300  # over one band of rows
            values = RNG.integers(0, maxval + 1, (h, w, bands))  # over maxval: refused (below), Pillow clamps
            body = values.astype(">u2" if maxval > 255 else "u1").tobytes()
            head = magic + b"\n%d %d\n%d\n" % (w, h, maxval)
            yield f"{magic.decode()}-{maxval}", head + body
            yield f"{magic.decode()}-{maxval}-cut", head + body[: len(body) // 2 + 1]


def _plain_cases():
    for magic, bands in ((b"P2", 1), (b"P3", 3)):
        for maxval in (1, 9, 255, 1000, 65535):
            values = RNG.integers(0, maxval + 1, (41, 23, bands)).ravel()
            seps = (b" ", b"\n", b"\t", b"  \r\n")
            body = b"".join(b"%d" % v + seps[i % 4] for i, v in enumerate(values))
            head = magic + b"\n# made by a test\n23 41\n%d\n" % maxval
            name = f"{magic.decode()}-{maxval}"
            yield name, head + body
            yield name + "-comments", head + body[:200] + b"# a comment 1 2 3\n" + body[200:] + b"\n# the end"
            yield name + "-cut", head + body[: len(body) // 2]
            yield name + "-trailing-junk", head + body + b" xyz -5"
            yield name + "-over-maxval", head + b"%d " % (maxval + 1) + body
            yield name + "-not-a-number", head + b"1x " + body
            yield name + "-negative", head + b"-1 " + body
            yield name + "-too-long", head + b"00000000001 " + body
            yield name + "-comment-glued-to-a-number", head + b"1#c\n2 " + body


@pytest.mark.parametrize("name, data", [*_binary_cases(), *_plain_cases()], ids=lambda v: v if isinstance(v, str) else "")
def test_same_bytes_and_errors_as_pillows_own_decoders(name, data):
    ours, pillows = _decode(data, ours=True), _decode(data, ours=False)
    assert ours == pillows, (name, ours if isinstance(ours, str) else ours[:2],
                             pillows if isinstance(pillows, str) else pillows[:2])


@pytest.mark.parametrize("magic, maxval", [(b"P5", 100), (b"P6", 100), (b"P6", 4095), (b"P5", 1000), (b"P6", 1)])
def test_a_binary_sample_over_maxval_is_refused_not_clamped(magic, maxval):
    """Pillow's Python loop clamped a sample over maxval to white: a damaged or mislabelled file (a 16-bit body
    under maxval 4095, an 8-bit photo saying 100) was classified as a clipped photo. Netpbm's own tools and the
    plain decoder refuse it; so does the binary one now, and the service answers 400 naming the sample."""
    bands = 1 if magic == b"P5" else 3
    values = RNG.integers(0, maxval + 1, (40, 30, bands))
    values[39, 29, 0] = maxval + 1  # the very last sample: the whole image is read before it
    body = values.astype(">u2" if maxval > 255 else "u1").tobytes()
    data = magic + b"\n30 40\n%d\n" % maxval + body
    assert _decode(data, ours=True) == "ValueError"
    with pytest.raises(imaging.UndecodableImage, match=rf"the PPM data is damaged .*a sample is {maxval + 1}, "
                                                        rf"above the file's maxval {maxval}"):
        imaging.decode(data, max_pixels=10**6)
    values[39, 29, 0] = maxval
    ok = magic + b"\n30 40\n%d\n" % maxval + values.astype(">u2" if maxval > 255 else "u1").tobytes()
    assert _decode(ok, ours=True) == _decode(ok, ours=False)


def test_a_plain_file_read_in_several_chunks(monkeypatch):
    """Tokens and comments cut by a chunk's end are carried to the next one."""
    monkeypatch.setattr(pnm, "_CHUNK", 97)
    values = RNG.integers(0, 65536, (30, 20, 3)).ravel()
    body = b"".join(b"%d %s" % (v, b"# note 12 34\n" if i % 50 == 7 else b"") for i, v in enumerate(values))
    data = b"P3 20 30 65535\n" + body
    assert _decode(data, ours=True) == _decode(data, ours=False)


def test_the_service_decodes_a_16_bit_ppm_with_these_decoders():
    values = RNG.integers(0, 65536, (48, 64, 3))
    data = b"P6\n64 48\n65535\n" + values.astype(">u2").tobytes()
    assert Image.DECODERS["ppm"] is pnm.BinaryDecoder and Image.DECODERS["ppm_plain"] is pnm.PlainDecoder
    decoded = imaging.decode(data, max_pixels=10**6)
    expected = np.round(values / 65535 * 255).astype(np.uint8)
    assert decoded.format == "PPM" and (np.asarray(decoded.image) == expected).all()
