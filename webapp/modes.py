"""Any decoded Pillow image to the RGB picture a person sees: the frame of an animation that shows
(``visible_frame``), and every mode to RGB (``to_rgb``: alpha on white, 16-bit, 32-bit and float samples
scaled from the range they use, CMYK converted). ``webapp/imaging.py``'s ``decode`` calls both; numpy
and Pillow only, no torch.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageStat

from .errors import UndecodableImage

_FRAMES_JUDGED = 8  # an animation's first frames looked at for a visible one
# Pixels decoded in all while looking (each frame after the first is decoded whole): a 414-byte animated WebP of
# eight 8900x8900 frames took 9.5 s of CPU here (tryout19); with this bound such frames judge the first alone.
_FRAME_PIXELS_JUDGED = 64_000_000


def _visible(img: Image.Image) -> float:
    """How much of the loaded frame shows: its mean alpha (0..255; 255 for a frame without transparency)."""
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):  # its own alpha band, read by histogram: no copy of it
        return ImageStat.Stat(img.getchannel(img.getbands()[-1])).mean[0]
    if "transparency" not in img.info:
        return 255.0
    return ImageStat.Stat(img.convert("RGBA").getchannel("A")).mean[0]


def visible_frame(img: Image.Image) -> None:
    """Move an animation whose first frame is mostly transparent (under half: mean alpha < 128, the start of a
    fade-in) to its first frame that is at least half visible, among its first ``_FRAMES_JUDGED`` (fewer where
    their pixels would pass ``_FRAME_PIXELS_JUDGED``), else to the most visible of them. Composited on white, a
    transparent first frame was classified as a blank page. A still image, or an animation whose first frame shows, stays as it is (nothing else decoded)."""
    if not getattr(img, "is_animated", False) or (best := (_visible(img), 0))[0] >= 128:
        return
    frames = min(_FRAMES_JUDGED, _FRAME_PIXELS_JUDGED // max(1, img.width * img.height))
    if frames < 2:
        return  # frames too large to look through: the first, as a still image's
    for i in range(1, min(img.n_frames, frames)):
        img.seek(i)
        img.load()
        if (seen := _visible(img)) >= 128:
            return
        best = max(best, (seen, i))
    img.seek(best[1])
    img.load()


def _reduced(img: Image.Image) -> bool:
    """Whether the TIFF page loaded is not the photo: marked a reduced-resolution copy of another or a transparency
    mask (NewSubfileType, tag 254, bits 0 and 2), or a reduced-resolution copy by the older SubfileType (tag 255: 2)."""
    try:
        tags = getattr(img, "tag_v2", {})
        return bool(int(tags.get(254, 0)) & 0b101) or int(tags.get(255, 1)) == 2
    except (TypeError, ValueError):
        return False


def main_page(img: Image.Image) -> None:
    """Move a TIFF whose first page is marked a reduced-resolution copy (NewSubfileType bit 0, TIFF 6.0 section 8:
    a thumbnail or preview written first) to its first page that is neither that nor a mask, among its first
    ``_FRAMES_JUDGED``; a file with no such page, or whose next page Pillow cannot read, stays on its first (a
    later page's error was a 500 that failed the request's other photos: tryout20). Only IFDs are read (tryout19: a
    96x72 thumbnail page before the photo was classified, and reported as the photo's size). Call it before the
    size is judged: the page changes."""
    if getattr(img, "format", None) != "TIFF" or not _reduced(img):
        return
    try:
        for i in range(1, _FRAMES_JUDGED):
            img.seek(i)
            if not _reduced(img):
                return
    except Exception:  # EOFError, or a page Pillow cannot read (float64, a next-page offset past the end: tryout20)
        pass
    try:
        img.seek(0)  # no page but the first: the first, as before
    except Exception:  # the decode judges the file (a 400 where it cannot read it)
        pass


_BAND = 256  # rows converted at a time from 16-bit and float images (an 8000 px wide band: ~16 MB in float64)


def _bands(img: Image.Image):
    """``img``'s rows as numpy arrays ``(<= _BAND, W)``, top to bottom (``np.asarray`` of the whole image
    would copy it twice: its bytes, then the array)."""
    for top in range(0, img.height, _BAND):
        yield np.asarray(img.crop((0, top, img.width, min(img.height, top + _BAND))))


def _to_l(img: Image.Image, convert) -> Image.Image:
    """A one-band ``img`` to an RGB image of its grey levels, ``convert`` (a band of rows -> uint8) run a band of
    ``_BAND`` rows at a time, so no whole-image intermediate is ever made. Samples equal to its transparency key
    (a 16-bit grey PNG's tRNS: ``info["transparency"]``, in its own sample units) are white, composited as the
    8-bit modes' are (tryout19: left black, they moved the answer 5 points)."""
    key = img.info.get("transparency")
    key = key if isinstance(key, int) and not isinstance(key, bool) else None
    out = np.empty((img.height, img.width), np.uint8)
    for i, band in zip(range(0, img.height, _BAND), _bands(img)):
        out[i:i + _BAND] = convert(band)
        if key is not None:
            out[i:i + _BAND][band == key] = 255
    return Image.fromarray(out, "L").convert("RGB")


def _declared(img: Image.Image) -> tuple[int, bool]:
    """(bits, signed) of a mode-I image's samples, as its TIFF declares them (tags 258 BitsPerSample, 339
    SampleFormat); (16, False) for every other file (16-bit PNG, PGM/PPM)."""
    tags = getattr(img, "tag_v2", None)
    if tags is None:
        return 16, False
    bits, fmt = tags.get(258, (16,)), tags.get(339, (1,))
    bits, fmt = (bits[0] if isinstance(bits, tuple) else bits), (fmt[0] if isinstance(fmt, tuple) else fmt)
    return (bits, fmt == 2) if bits in (16, 32) else (16, False)


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB, deterministically.

    Alpha (RGBA, LA, PA, P or RGB/L/I;16 with a transparency key) is composited on white; 16-bit
    grayscale (I;16*, I) is scaled by 1/257 so mid-grey stays mid-grey (signed 16-bit from 0..32767); a
    32-bit integer TIFF (what Pillow writes for a mode-I image) as 8-bit or 16-bit where its samples fit, else
    from 0 to its maximum (samples over 65535 were clipped white); negatives are black;
    float (F, which declares no range) from [0, 1] or [0, 255] where its maximum fits, else from [0, maximum]
    (a 32-bit float TIFF of 16-bit data was clipped white); 1, L, P, CMYK,
    YCbCr, ... use Pillow's conversion (CMYK JPEGs are normalised to plain CMYK in ``decode`` first).

    :raises UndecodableImage: for a mode Pillow cannot convert to RGB.
    """
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img
    if mode.startswith("I;16") or mode == "I":
        bits, signed = _declared(img)
        if bits == 32 or signed:
            def wide(band):  # uint32 samples arrive in Pillow's int32: read their bits back as unsigned
                return band.astype(np.int64) & 0xFFFFFFFF if bits == 32 and not signed else band.astype(np.int64)

            peak = max((int(wide(band).max()) for band in _bands(img) if band.size), default=0)
            # 8-bit data (Pillow's convert("I") of a photo, saved) was read as 16-bit: near black (tryout27)
            white = 32767 if bits == 16 else 255 if peak <= 255 else 65535 if peak <= 65535 else peak
            return _to_l(img, lambda band: np.rint(np.clip(wide(band), 0, white) * (255 / white)).astype(np.uint8))
        # rint(v / 257) clipped to 0..255, as (v + 128) // 257 on v clipped to 0..65535 (equal: 257 is odd,
        # so v / 257 is never a half), a band of rows at a time: a whole-image float64 copy cost ~1.6 GB
        # for an 80 MP 16-bit PNG of 155 KB.
        return _to_l(img, lambda band: ((np.clip(band, 0, 65535).astype(np.uint32) + 128) // 257).astype(np.uint8))
    if mode == "F":
        def finite(band):
            # A signalling NaN (any bit pattern a file may hold) raises numpy's "invalid value" on the cast:
            # it becomes 0 like every NaN, without the warning.
            with np.errstate(invalid="ignore"):
                return np.nan_to_num(band.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)

        peak = max((float(finite(band).max()) for band in _bands(img) if band.size), default=0.0)
        white = 1.0 if peak <= 1.0 else 255.0 if peak <= 255.0 else peak
        scale = 255.0 / white
        return _to_l(img, lambda band: np.clip(np.rint(finite(band) * scale), 0, 255).astype(np.uint8))
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    try:
        if has_alpha:
            rgba = img if mode == "RGBA" else img.convert("RGBA")
            if rgba.getextrema()[3][0] == 255:  # fully opaque: skip the composite (and its copies)
                return rgba.convert("RGB")
            out = Image.new("RGB", rgba.size, (255, 255, 255))
            # rgb * a + white * (1 - a), the mask being rgba's own alpha band: no copy of it (80 MB at 80 MP)
            out.paste(rgba, mask=rgba)
            return out
        return img.convert("RGB")
    except (ValueError, OSError) as exc:
        raise UndecodableImage(f"cannot convert colour mode {mode} to RGB: {exc}") from None
