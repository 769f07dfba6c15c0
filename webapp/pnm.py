"""The PNM (PBM/PGM/PPM) pixel data Pillow decodes in pure Python, decoded with numpy instead.

Pillow reads binary PGM/PPM with the C ``raw`` decoder only where the maxval is 255 (or 65535 for a grey
image); any other maxval (16-bit colour, a 12-bit scanner's 4095, an 8-bit file saying 100), and every
plain (ASCII: P2, P3) file, go through Python loops in ``PpmImagePlugin`` that handle one sample at a time:
measured on the 2-core box, a 16-bit PPM decoded at ~0.44 s per MB and a plain PPM at ~0.28 s per MB, against
~0.015 s per MB for a JPEG. One 32 MiB upload inside every limit (a 5.6 MP 16-bit PPM) then held a decode
thread for 15-20 s (tryout, 2026-12-04). These decoders give the same bytes as Pillow's (same rounding:
``round(value / maxval * out_max)`` in float64, half to even; the same errors for out-of-range values, and
an error where Pillow's binary loop clamped a sample over maxval) at numpy speed, in bands of rows so a big image never needs more than a few MB at once. Plain PBM (P1) stays
with Pillow: its loop works on whole blocks and is fast.

``install()`` registers them with Pillow under its own decoder names (``ppm``, ``ppm_plain``), so
``Image.open`` and ``load`` use them with no other change; ``webapp.imaging`` calls it before decoding.
"""

from __future__ import annotations

import re

import numpy as np
from PIL import Image, ImageFile, PpmImagePlugin

_ROWS = 256  # rows decoded at a time (binary): a 8000 px wide 16-bit RGB band is ~12 MB of input
_CHUNK = 1 << 22  # bytes of text parsed at a time (plain): ~4 MB, ~50 MB of numpy temporaries
_COMMENT = re.compile(rb"#[^\r\n]*[\r\n]?")  # to the end of its line, the line break included (as Pillow)
_MAX_DIGITS = 10  # Pillow's longest token


def _scale(values: np.ndarray, maxval: int, mode: str) -> bytes:
    """Samples (any integer dtype) -> Pillow's output bytes: 8-bit, or little-endian int32 for mode ``I``."""
    out_max, dtype = (65535, "<i4") if mode == "I" else (255, "u1")
    scaled = np.minimum(out_max, np.round(values.astype(np.float64) / maxval * out_max))
    return scaled.astype(dtype).tobytes()


def _within(values: np.ndarray, maxval: int) -> None:
    """:raises ValueError: a sample over the file's maxval (Netpbm: every sample is 0..maxval)."""
    if values.size and (top := int(values.max())) > maxval:
        raise ValueError(f"a sample is {top}, above the file's maxval {maxval}")


class BinaryDecoder(ImageFile.PyDecoder):
    """Pillow's ``ppm`` decoder (binary P5/P6 whose maxval is not 255) in numpy: 1 or 2 big-endian bytes a
    sample, scaled to 0..255 (0..65535 for mode ``I``); a short file decodes whole pixels only and Pillow then
    raises ``ValueError("not enough image data")``, as before. A sample over maxval raises ``ValueError``, as
    the plain decoder (and Netpbm's own tools) do: Pillow's Python loop clamped it, so a damaged or
    mislabelled file (a 16-bit body under an 8-bit maxval) was classified as a white-clipped photo."""

    _pulls_fd = True

    def decode(self, buffer):
        maxval = self.args[-1]
        dtype = np.dtype(">u2" if maxval > 255 else "u1")
        bands = Image.getmodebands(self.mode)
        row = self.state.xsize * bands
        out = bytearray()
        for top in range(0, self.state.ysize, _ROWS):
            want = min(_ROWS, self.state.ysize - top) * row
            raw = self.fd.read(want * dtype.itemsize)
            count = len(raw) // (dtype.itemsize * bands) * bands
            values = np.frombuffer(raw, dtype, count)
            _within(values, maxval)
            out += _scale(values, maxval, self.mode)
            if count < want:
                break
        self.set_as_raw(bytes(out), "I;32" if self.mode == "I" else self.mode)
        return -1, 0


class PlainDecoder(PpmImagePlugin.PpmPlainDecoder):
    """Pillow's ``ppm_plain`` decoder with its per-token loop (``_decode_blocks``: P2, P3) in numpy; P1 (bitonal)
    as Pillow. The same checks: a token over 10 characters, a negative value, one over maxval or anything
    but digits raises ``ValueError``; fewer values than pixels is a short image (Pillow then raises)."""

    def _decode_blocks(self, maxval: int) -> bytearray:
        need = self.state.xsize * self.state.ysize * Image.getmodebands(self.mode)
        out, got, carry = bytearray(), 0, b""
        while got < need:
            block = self.fd.read(_CHUNK)
            text = carry + block
            if block:  # keep a token (or comment) cut by the chunk's end for the next round
                cut = max(text.rfind(b" "), text.rfind(b"\n"), text.rfind(b"\r"), text.rfind(b"\t"))
                if cut < 0 and len(text) > 2 * _CHUNK:
                    raise ValueError("no whitespace in the pixel data")
                text, carry = (text[:cut + 1], text[cut + 1:]) if cut >= 0 else (b"", text)
                hash_at = text.rfind(b"#")
                if hash_at >= 0 and not re.search(rb"[\r\n]", text[hash_at:]):
                    text, carry = text[:hash_at], text[hash_at:] + carry  # a comment still open
            values = _tokens(_COMMENT.sub(b"", text), need - got)
            _within(values, maxval)
            out += _scale(values, maxval, self.mode)
            got += values.size
            if not block:
                break
        return out


def _tokens(text: bytes, limit: int) -> np.ndarray:
    """The first ``limit`` whitespace-separated decimal numbers in ``text``, as int64, vectorised (no Python
    object a token); what follows them is not looked at, as Pillow's loop stops there.

    :raises ValueError: one of them holds anything but digits, or has over 10 characters.
    """
    arr = np.frombuffer(text, np.uint8)
    word = ~((arr == 32) | ((arr >= 9) & (arr <= 13)))
    edges = np.diff(np.concatenate(([False], word, [False])).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1)[:limit], np.flatnonzero(edges == -1)[:limit]
    if not starts.size:
        return np.zeros(0, np.int64)
    if (ends - starts).max() > _MAX_DIGITS:
        raise ValueError("Token too long found in data")
    arr = arr[:ends[-1]]
    where = np.flatnonzero(word[:ends[-1]])
    chars = arr[where]
    if ((chars < 48) | (chars > 57)).any():
        bad = bytes([int(chars[(chars < 48) | (chars > 57)][0])])
        raise ValueError(f"Invalid token in plain PNM data: {bad!r}")
    token = np.repeat(np.arange(starts.size), ends - starts)
    terms = (chars - 48).astype(np.int64) * 10 ** (ends[token] - 1 - where).astype(np.int64)
    return np.add.reduceat(terms, np.concatenate(([0], np.cumsum(ends - starts)[:-1])))


def install() -> None:
    """Register both decoders with Pillow (idempotent; cheap)."""
    Image.register_decoder("ppm", BinaryDecoder)
    Image.register_decoder("ppm_plain", PlainDecoder)
