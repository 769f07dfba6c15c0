"""webapp/mangled.py: photos a client changed on the way as if they were text (curl -d, a string read as UTF-8 or
Latin-1, a text-mode copy), and base64 or hex text of a photo sent where its bytes belong, told beyond doubt, and
nothing else taken for them. Over HTTP with real curl: tests/test_http_inputs.py."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image

from webapp.errors import NotAnImage, UndecodableImage
from webapp.imaging import decode
from webapp.mangled import how_mangled

from conftest import SHARED_IMAGES, shared_image

pytestmark = pytest.mark.unit


def encode_jpeg(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG")
    return out.getvalue()


def _png() -> bytes:
    out = io.BytesIO()
    Image.open(shared_image("dog.jpg")).save(out, "PNG")
    return out.getvalue()


# How each client mangles bytes: what it does, as code.
MANGLINGS = {
    "curl -d (CR and LF stripped)": lambda b: b.replace(b"\r", b"").replace(b"\n", b""),
    "read as UTF-8 text": lambda b: b.decode("utf-8", "replace").encode(),
    "read as Latin-1 text": lambda b: b.decode("latin-1").encode(),
    "read as Windows-1252 text": lambda b: b.decode("cp1252", "replace").encode(),
    "LF to CR LF": lambda b: b.replace(b"\n", b"\r\n"),
}
SAID = {"curl -d (CR and LF stripped)": "stripped", "read as UTF-8 text": "U+FFFD",
        "read as Latin-1 text": "Latin-1", "read as Windows-1252 text": "Windows-1252", "LF to CR LF": "CR LF"}


@pytest.mark.parametrize("mangling", list(MANGLINGS))
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_photo_changed_as_text_is_400_saying_how_and_what_to_send(mangling, fmt):
    whole = shared_image("dog.jpg").read_bytes() if fmt == "JPEG" else _png()
    changed = MANGLINGS[mangling](whole)
    assert changed != whole
    said, photo = how_mangled(changed)
    assert photo and said.startswith(f"a {fmt} changed on the way") and SAID[mangling] in said
    assert "--data-binary" in said and "not -d" in said
    with pytest.raises(UndecodableImage, match=re.escape(f"sent.jpg: a {fmt} changed on the way: ") + ".*" +
                       re.escape(SAID[mangling])):
        decode(changed, max_pixels=10**8, name="sent.jpg")


@pytest.mark.parametrize("path", sorted(SHARED_IMAGES.glob("*.jpg")), ids=lambda p: p.name)
@pytest.mark.parametrize("mangling", ["curl -d (CR and LF stripped)", "LF to CR LF", "LF to CR", "CR to LF",
                                      "CR dropped"])
def test_every_shared_jpeg_copied_as_text_is_400_even_where_libjpeg_would_decode_it(path, mangling):
    """libjpeg decodes many of these without an error, into noise (tryout19: phone-12mp.jpg with each LF made CR LF
    answered 200 "radio"); the marks in its coded data decide before the decode (``mangled.jpeg_copied_as_text``),
    whatever a CR put into a header segment's length. Only LFs that do not follow a CR become CR LF, as a text copy
    of a file with some CR LF already in it does."""
    whole = path.read_bytes()
    one_gone = {"LF to CR": (lambda b: b.replace(b"\n", b"\r"), "no LF byte at all"),
                "CR to LF": (lambda b: b.replace(b"\r", b"\n"), "no CR byte at all"),
                "CR dropped": (lambda b: b.replace(b"\r", b""), "no CR byte at all")}  # tryout20: 200s for noise
    if mangling in one_gone:
        changed, said = one_gone[mangling][0](whole), one_gone[mangling][1]
    else:
        said = SAID[mangling]
        changed = (re.sub(rb"(?<!\r)\n", b"\r\n", whole) if mangling == "LF to CR LF" else MANGLINGS[mangling](whole))
    with pytest.raises(UndecodableImage, match=re.escape(f"{path.name}: a JPEG changed on the way: ") + ".*" +
                       re.escape(said)):
        decode(changed, max_pixels=10**8, name=path.name, min_side=224)


@pytest.mark.parametrize("size", [(768, 576), (1200, 900), (4000, 3000)])
def test_a_flat_picture_whose_coded_data_has_no_line_break_is_not_a_text_copy(size):
    """A flat picture's coded data repeats (no CR or LF in 17 KB of it): the odds that make a photo without them a
    stripped copy do not hold there, so it decodes (found by the suite's own flat test JPEGs)."""
    data = encode_jpeg(Image.new("RGB", size, (90, 120, 30)))
    assert decode(data, max_pixels=10**8, min_side=224).size == size


def test_png_line_end_conversions_each_say_which():
    png = _png()
    assert "CR LF bytes became LF" in how_mangled(png.replace(b"\r\n", b"\n"))[0]
    assert "LF bytes became CR LF" in how_mangled(png.replace(b"\n", b"\r\n"))[0]


@pytest.mark.parametrize("wrap", ["base64", "base64 at 76 columns", "urlsafe base64", "data URL", "hex"])
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_text_of_a_photo_is_415_saying_what_it_is(wrap, fmt):
    whole = shared_image("dog.jpg").read_bytes() if fmt == "JPEG" else _png()
    text = {"base64": base64.b64encode(whole), "base64 at 76 columns": base64.encodebytes(whole),
            "urlsafe base64": base64.urlsafe_b64encode(whole),
            "data URL": b"data:image/" + fmt.lower().encode() + b";base64," + base64.b64encode(whole),
            "hex": whole.hex().encode()}[wrap]
    said, photo = how_mangled(text)
    what = "a data: URL" if wrap == "data URL" else "hex text" if wrap == "hex" else "base64 text"
    assert not photo and said.startswith(f"it is {what} of a {fmt}, not the {fmt}'s bytes")
    with pytest.raises(NotAnImage, match=f"it is {what} of a {fmt}"):
        decode(text, max_pixels=10**8)


def test_whole_photos_and_other_faults_are_not_taken_for_text():
    """Only where the bytes leave no doubt: a whole photo, one cut short, one with a damaged byte, text that is not
    a photo's, a small JPEG that happens to hold no CR or LF byte: None (their own refusals stand)."""
    for path in sorted(SHARED_IMAGES.glob("*.jpg")):
        data = path.read_bytes()
        assert how_mangled(data) is None and how_mangled(data[:len(data) // 2]) is None, path.name
    dog = shared_image("dog.jpg").read_bytes()
    damaged = bytearray(dog)
    damaged[5000:5100] = bytes(100)
    assert how_mangled(bytes(damaged)) is None and how_mangled(_png()[:-100]) is None
    for text in (b"hello, a text file\n" * 20, b"QUJD", b"ffff", b"data:text/plain;base64,aGVsbG8=", b""):
        assert how_mangled(text) is None, text
    tiny = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 200, np.uint8)).save(tiny, "JPEG")
    plain = MANGLINGS["curl -d (CR and LF stripped)"](tiny.getvalue())  # under 4 KB: as likely chance
    assert len(plain) < 4096 and how_mangled(plain) is None
    few = dog[:3] + dog[3:].replace(b"\n", b"\r\n", 3)  # three LFs after a CR: by chance, not a text copy
    assert how_mangled(few) is None
