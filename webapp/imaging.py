"""Decode an upload into an RGB photo, then preprocess it into the model's input tensor.

decode: Pillow, restricted to photo formats (never EPS, which would run Ghostscript); the pixel count is read
from the header and checked before any pixel is decoded; EXIF orientation (webapp/exif.py) is applied; every
mode becomes RGB deterministically (alpha composited on white, 16-bit scaled to 8-bit, CMYK converted).
preprocess: a ``torchvision.transforms.v2`` pipeline from the model spec (Resize with antialias, CenterCrop...).

Both run in the request, before queueing, so a bad image fails only its own request. Every
failure is a ``ServiceError`` with the right status; nothing here raises anything else.
"""

from __future__ import annotations

import io
import math
import re
import time
from dataclasses import dataclass

import torch
from PIL import Image, ImageChops, UnidentifiedImageError
from torchvision.transforms import v2

from . import cuts, exif, incomplete, mangled, pnm, repair
from .exif import silence_pillow_warnings
from .contract import FORMAT_NAMES, FORMATS, Size
from .formats import article, claimed_format, jpeg_arithmetic, jpeg_frame, sniff_format, tiff_samples, too_many_parts
from .modes import main_page, to_rgb, visible_frame
from .errors import NoFile, NotAnImage, TooLarge, UndecodableImage
from .models import Preprocessing

# FORMATS: the only formats Pillow may open here; FORMAT_NAMES: the same for people (the 415 message).
# Both live in contract.py, torch-free, so the CLI names the same list without importing this module.


silence_pillow_warnings()  # exif.py's (torch-free, for the CLI's client too): process-wide, once
pnm.install()  # numpy decoders for the PNM data Pillow decodes in Python (~30x slower per byte): process-wide

# When the long side exceeds this many times the short side, only the center of the long side is
# ever seen by the center crop; cropping it first keeps a 10000x10 strip from becoming a
# 256000x256 intermediate. Photos up to 2:1 (every camera and phone format) are untouched.
_MAX_ASPECT = 2.0
# The page's preview of each photo: long side in px.
THUMBNAIL_PX = 320


@dataclass
class Decoded:
    """An upload decoded to RGB: ``image`` (PIL, mode RGB; smaller than the photo on the fast path),
    ``size`` (the photo's upright width, height in px), the source ``format``, ``decode_ms``."""

    image: Image.Image
    size: tuple[int, int]
    format: str
    decode_ms: float


def decode(data: bytes, *, max_pixels: int, name: str = "upload", min_side: int | None = None,
           size: Size | None = None, _repaired: bool = False) -> Decoded:
    """Decode image bytes into an upright RGB PIL image.

    ``max_pixels`` bounds width x height, checked from the header before pixels are decoded.
    ``size``: the photo's ``Size``, read by the request's pixel check: its parts walk is not done again.
    ``min_side`` (px, the model's resize size) turns on the fast path for large JPEGs: decoded at the
    smallest DCT scale (1/2, 1/4, 1/8; Pillow ``draft``) that keeps its short side >= 2x ``min_side``,
    so the antialiased resize that follows still averages over several source pixels. Other formats
    are decoded at full size: a box pre-reduction by an integer factor (as this did before) moved the
    offline model's top-1 probability by up to 7 points (the 12 MP photo as a PNG: 4.4 points) for
    ~25 ms saved on a ~300 ms PNG decode. None decodes every format at full size.

    Why 2x and not 1x: decoded down to just the resize size, the offline model's top-1
    probability moved by up to 15 points (dog.jpg 40.1% -> 55.1%, decoded at 1/2 scale; the
    12 MP photo 5 points); kept at >= 2x it moves by at most 1.5 points on the shared and
    calibration photos (37), and the 12 MP photo still decodes ~3x faster than at full size
    (1/4 scale: ~55 ms vs ~160 ms here, against ~49 ms at 1/8).

    :raises NoFile: empty upload (400).
    :raises NotAnImage: not a supported image format (415), naming it where recognisable.
    :raises TooLarge: more than ``max_pixels`` pixels, or far more parts than a photo has (413, ``too_many_parts``).
    :raises UndecodableImage: a known format with broken data, e.g. a truncated JPEG (400).

    A whole photo Pillow refuses for a fault outside its pixels (a JPEG without its end marker, a PNG whose
    metadata inflates past Pillow's guard) is decoded again once, mended (``webapp/repair.py``;
    ``_repaired``: this is that second time), and judged as any other.
    """
    start = time.perf_counter()
    if not data:
        raise NoFile(f"{name}: the file is empty (0 bytes)")
    # Before Pillow walks them: seconds of CPU in a few KB (tryout21); ``size``: walked already, by the request's check
    if said := (size.refused if size is not None else too_many_parts(data)):
        raise TooLarge(f"{name}: {said}")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:  # over twice Pillow's own cap, checked from the header
        found = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{int(found.group(1)):,} pixels" if found else f"more than {2 * Image.MAX_IMAGE_PIXELS:,} pixels"
        raise TooLarge(f"{name}: the image is {size}; the limit is {max_pixels:,} "
                       f"(CLASSIFIER_MAX_PIXELS)") from None
    except UnidentifiedImageError as exc:
        if not _repaired and (fixed := repair.png_mended(data, exc) or repair.jpeg_mended(data)
                              or repair.tiff_mended(data)):  # bad CRC, short APPn, a tag past the end
            return _again(fixed, start, max_pixels=max_pixels, name=name, min_side=min_side)
        if changed := _mangled(name, data):
            raise changed from None
        claimed = claimed_format(data)
        if claimed and (cut := _cut(data)):
            raise _cut_short(name, claimed, *cut) from None
        if claimed == "JPEG" and (frame := jpeg_frame(data)) and (kind := frame.undecodable):
            raise _undecodable_jpeg(name, kind) from None
        if claimed == "TIFF" and (kind := tiff_samples(data)):
            raise NotAnImage(f"{name}: {kind}, which the classifier cannot decode (it reads integer samples, and "
                             f"32-bit float ones with one sample a pixel); send it as a 16-bit TIFF or PNG") from None
        if claimed:
            raise UndecodableImage(f"{name}: the {claimed} data is damaged (starts like {claimed}, but its header "
                                   f"cannot be read); send the file as it was saved, or save it again") from None
        fmt = sniff_format(data)
        what = (f"{article(fmt)} {fmt} file, which the classifier cannot decode" if fmt
                else "not an image format the classifier can decode")
        raise NotAnImage(f"{name}: {what}; send {FORMAT_NAMES}") from None
    except Exception as exc:  # Pillow plugins raise assorted errors on malformed headers
        if not _repaired and (fixed := repair.png_mended(data, exc)):  # metadata too large to inflate, a bad CRC
            return _again(fixed, start, max_pixels=max_pixels, name=name, min_side=min_side)
        if changed := _mangled(name, data):
            raise changed from None
        if cut := _cut(data):  # e.g. WebP: "could not create decoder object"; JPEG: "Truncated File Read"
            raise _cut_short(name, claimed_format(data) or "image", *cut) from None
        if repair.cut_short(exc):  # Pillow says the data ended, where no structure holds together to say it was cut
            raise UndecodableImage(f"{name}: the {claimed_format(data) or 'image'} header cannot be read: the data "
                                   f"ends inside it (a damaged file, or one cut short); send the whole file") from None
        claimed = claimed_format(data)  # Pillow's words last, as the detail: "could not create decoder object"
        raise UndecodableImage(f"{name}: the {claimed or 'image'} data is damaged: its header cannot be read "
                               f"({type(exc).__name__}: {exc})") from None
    main_page(img)  # a TIFF's thumbnail page written first: the photo's page instead
    width, height = img.size
    if width * height > max_pixels:
        raise TooLarge(f"{name}: {width}x{height} is {width * height:,} pixels; the limit is {max_pixels:,} "
                       f"(CLASSIFIER_MAX_PIXELS)")
    if width < 1 or height < 1:
        raise UndecodableImage(f"{name}: the image has no pixels ({width}x{height})")
    fmt, data = incomplete.primary_jpeg(img, data)  # a JPEG with more images after the photo (MPO) is a JPEG
    frame = jpeg_frame(data) if fmt == "JPEG" else None  # its SOF: the decoder it needs, or none here
    if frame and (kind := frame.undecodable):
        raise _undecodable_jpeg(name, kind)
    if frame and (zero := frame.zero_dc):
        raise UndecodableImage(f"{name}: the JPEG data is damaged: its quantization table has 0 for each block's "
                               f"average (the standard allows 1 to 255), so it would decode "
                               f"{'as grey' if zero[0] == 0 else 'without its colour'}, not as the photo; send the "
                               f"file as it was saved, or save it again")
    if fmt == "JPEG" and (said := mangled.jpeg_copied_as_text(data)):  # would decode as noise, without an error
        raise UndecodableImage(f"{name}: {said}")
    try:
        orientation = exif.orientation(img)  # read before any conversion drops img.info
        ends = "the file ends there" if _repaired else "a marker closes it early"  # (repaired: EOI added)
        arithmetic = frame is not None and frame.arithmetic
        if arithmetic:  # Pillow's libjpeg has no arithmetic decoder; torchvision's does (same coefficients, same IDCT)
            img = _decode_arithmetic(name, data, img.mode)
        elif min_side and fmt == "JPEG":
            draft(img, min_side)
        img.load()
        if fmt == "JPEG" and not arithmetic and (kept := incomplete.jpeg_rows_decoded(
                img, data, height, lambda im: draft(im, min_side) if min_side else None)) is not None:
            raise UndecodableImage(f"{name}: the JPEG data is incomplete: its scan data stops after about "
                                   f"{kept:.0%} of the image and {ends}, so the rest would be "
                                   f"grey fill (a file cut short); send the whole file")
        if fmt == "JPEG" and not arithmetic and (scans := incomplete.jpeg_components_cut(data)) is not None:
            raise UndecodableImage(f"{name}: the JPEG data is incomplete: its colour components come in separate "
                                   f"scans and {'its data ends' if _repaired else 'a marker closes it'} after "
                                   f"{scans} of them, so it would decode without some of its colour (a file cut "
                                   f"short); send the whole file")
        if fmt == "JPEG" and not arithmetic and ("progressive" in img.info or "progression" in img.info) and (
                scans := incomplete.jpeg_scans_cut(data)) is not None:
            raise UndecodableImage(f"{name}: the JPEG data is incomplete: it is progressive and "
                                   f"{'its data ends' if _repaired else 'a marker closes it'} after {scans} "
                                   f"scan{'s' if scans != 1 else ''}, before every part of the "
                                   f"image has arrived, so it would decode blurred (a file cut short; or, rarely, "
                                   f"saved with a scan script that stops early); send the whole file, or save it "
                                   f"again")
        visible_frame(img)
        if fmt == "BMP" and img.mode == "RGBA" and img.getchannel("A").getextrema() == (0, 0):
            # A 32-bit BMP whose alpha bytes are all 0: writers that leave the 4th byte unset (or mark it
            # as alpha without filling it). Browsers show it opaque (Chromium's BMPImageReader and
            # Firefox's nsBMPDecoder both drop an all-zero alpha channel), and so does the page's own
            # scaled copy; composited on white it would be a blank square classified as whatever.
            img = img.convert("RGB")
        if fmt == "JPEG" and img.mode == "CMYK" and "adobe" not in img.info:
            # Pillow reads every CMYK JPEG as Adobe-inverted; without the Adobe marker the
            # samples are plain CMYK (libvips' convention), so undo that inversion.
            img = ImageChops.invert(img)
        stored = img.size
        img = exif.turn(img, orientation)
        size = (height, width) if img.size != stored else (width, height)  # orientations 5-8 swap
        rgb = to_rgb(img)
    except (UndecodableImage, NotAnImage):
        raise
    except Exception as exc:  # truncated or corrupt data: OSError, SyntaxError, ValueError, EOFError...
        if changed := _mangled(name, data):
            raise changed from None
        if cut := _cut(data):  # a PPM cut inside its maxval opens, and so does a JPEG cut right after SOS
            raise _cut_short(name, fmt, *cut) from None
        fixed = None if _repaired else (repair.jpeg_with_eoi(data) if fmt == "JPEG" else
                                        repair.png_mended(data, exc) if fmt == "PNG" else None)
        if fixed:  # a whole photo without its end marker, or with metadata too large: judged again as it is
            return _again(fixed, start, max_pixels=max_pixels, name=name, min_side=min_side)
        if repair.cut_short(exc):  # in words, not Pillow's ("image file is truncated (35 bytes not processed)")
            raise UndecodableImage(f"{name}: the {fmt} data is incomplete: the file ends before its image does "
                                   f"(a file cut short); send the whole file") from None
        raise UndecodableImage(f"{name}: the {fmt} data is damaged or incomplete: its image data cannot be "
                               f"decoded ({exc}); send the file as it was saved, or save it again") from None
    return Decoded(image=rgb, size=size, format=fmt, decode_ms=(time.perf_counter() - start) * 1e3)


def _mangled(name: str, data: bytes) -> UndecodableImage | NotAnImage | None:
    """The refusal for a photo a client changed on the way as if it were text (``webapp/mangled.py``): 400 where
    its bytes were changed, 415 where the body is base64 or hex text of one; None for every other upload."""
    if found := mangled.how_mangled(data):
        said, photo = found
        return (UndecodableImage if photo else NotAnImage)(f"{name}: {said}")
    return None


def _undecodable_jpeg(name: str, kind: str) -> NotAnImage:
    """The 415 for a JPEG of a kind no decoder here reads (``formats.JpegFrame.undecodable``'s words)."""
    return NotAnImage(f"{name}: {kind}, which the classifier cannot decode (it reads 8-bit lossy JPEGs); send it as "
                      f"PNG or TIFF (16 bits kept to the model's input), or as an 8-bit JPEG")


def _decode_arithmetic(name: str, data: bytes, mode: str) -> Image.Image:
    """An arithmetic-coded JPEG (``jpegtran -arithmetic``: ~8% smaller, lossless) decoded with torchvision's
    libjpeg-turbo, which has the arithmetic decoder Pillow's lacks: pixel for pixel what Pillow gives the same
    photo Huffman-coded (the shared dog.jpg: identical). torchvision 0.29 deprecates its decoders for TorchCodec
    (pinned here, they work; if a later torchvision drops them, such JPEGs are refused again, as "damaged").
    At full size (no DCT-scaled ``draft``); strict where
    Pillow is lenient: a file cut short (its EOI missing too) raises. One cut and then closed by EOI is not
    caught: libjpeg's arithmetic decoder reads zeros past the cut without a warning and fills the rest with
    noise, not grey (measured on the shared dog.jpg cut at 30-99%), so ``incomplete``'s grey check cannot
    see it and torchvision reports nothing.

    :raises NotAnImage: a colour model other than grey and YCbCr/RGB (CMYK) (415).
    :raises UndecodableImage: data torchvision refuses (cut short or damaged) (400).
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    if mode not in ("L", "RGB"):  # a whole file of a kind no decoder here reads: 415, as a 12-bit JPEG
        raise NotAnImage(f"{name}: an arithmetic-coded {mode} JPEG, which the classifier cannot decode; save it "
                         f"Huffman-coded (jpegtran -optimize) or as RGB")
    try:
        pixels = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                             mode=ImageReadMode.GRAY if mode == "L" else ImageReadMode.RGB)
    except RuntimeError as exc:
        if "truncated" in str(exc) or "incomplete" in str(exc):
            raise UndecodableImage(f"{name}: the JPEG data is incomplete: the file ends before its image does (a "
                                   f"file cut short); send the whole file") from None
        said = re.search(r"\.cpp:\d+, (.+)", str(exc))  # "decode_jpeg, /path/decode_jpeg.cpp:171, <libjpeg's words>"
        raise UndecodableImage(f"{name}: the JPEG data (arithmetic-coded) is damaged "
                               f"({(said.group(1) if said else str(exc)).strip()[:120]})") from None
    return Image.fromarray(pixels.permute(1, 2, 0).squeeze(-1).numpy())  # (H, W) uint8: L; (H, W, 3): RGB


def _again(fixed: bytes, start: float, **kwargs) -> Decoded:
    """``decode`` of ``repair``'s fixed bytes (once: never repaired twice), timed from the first attempt."""
    d = decode(fixed, _repaired=True, **kwargs)
    d.decode_ms = (time.perf_counter() - start) * 1e3
    return d


def _cut(data: bytes) -> tuple[str, int, int] | None:
    """``(part, bytes needed, bytes there are)`` where ``data`` is shorter than its container or the header Pillow
    opens says (``webapp/cuts.py``); ``part`` is "container" or "header". None otherwise."""
    if cut := cuts.container_cut(data):
        return ("container", *cut)
    if cut := cuts.header_cut(data):
        return ("header", *cut)
    return None


def _cut_short(name: str, fmt: str, part: str, need: int, got: int) -> UndecodableImage:
    """The 400 for a file shorter than its own structure says (``_cut``'s part and bytes)."""
    return UndecodableImage(f"{name}: the {fmt} data is incomplete: its {part} needs at least {need:,} bytes, "
                            f"{got:,} arrived (a file cut short); send the whole file")


def draft(img: Image.Image, min_side: int) -> None:
    """Ask libjpeg for the smallest DCT-scaled decode of JPEG ``img`` whose short side is still >= 2x ``min_side`` px
    (see ``decode``): sets the size it will decode at, in place; decodes nothing."""
    w, h = img.size
    scale = 2 * min_side / min(w, h)
    if scale < 1:
        img.draft(img.mode, (math.ceil(w * scale), math.ceil(h * scale)))


def build_transform(pre: Preprocessing) -> v2.Compose:
    """The spec's preprocessing as a v2 pipeline: RGB PIL image -> ``(3, crop, crop) float32``.

    Resize (short side, antialiased) and CenterCrop run on the PIL image, exactly as the
    weights' reference ``transforms()`` do, then ToImage, ToDtype(scale) and Normalize.
    """
    return v2.Compose([
        v2.Resize(pre.resize, interpolation=pre.interpolation, antialias=True),
        v2.CenterCrop(pre.crop), v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=list(pre.mean), std=list(pre.std)),
    ])


def center_limit(img: Image.Image) -> Image.Image:
    """Crop the long side of an extreme strip (over 2:1) to 2x the short side, centered.

    Resize + center-crop only ever sees the central ``short * crop / resize`` of the long side,
    so this changes nothing the model sees beyond sub-pixel rounding, and bounds memory.
    """
    w, h = img.size
    kept = limited_size(w, h)
    if kept == (w, h):
        return img
    left, top = (w - kept[0]) // 2, (h - kept[1]) // 2
    return img.crop((left, top, left + kept[0], top + kept[1]))


def limited_size(width: int, height: int) -> tuple[int, int]:
    """The (width, height) px ``center_limit`` keeps of a ``width`` x ``height`` photo: a strip over 2:1 cut to
    2x its short side (``int``, as the crop does), else the whole. Also the shape a client's scaled copy may have
    (``answers.check_originals``)."""
    short, long = min(width, height), max(width, height)
    if long <= _MAX_ASPECT * short:
        return width, height
    keep = int(_MAX_ASPECT * short)
    return (keep, height) if width > height else (width, keep)


def preprocess(img: Image.Image, transform: v2.Compose) -> torch.Tensor:
    """RGB PIL image -> model input ``(3, crop, crop) float32`` (a plain tensor, contiguous)."""
    out = transform(center_limit(img))
    return out.as_subclass(torch.Tensor).contiguous()


def thumbnail_jpeg(img: Image.Image, size: int = THUMBNAIL_PX, quality: int = 80) -> bytes:
    """RGB PIL image -> JPEG bytes no larger than ``size`` px on its long side (the page's preview)."""
    thumb = img.copy()
    thumb.thumbnail((size, size))
    buf = io.BytesIO()
    thumb.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


@dataclass
class Prepared:
    """One upload ready for the model: ``tensor`` ``(3, S, S) float32``; the photo's upright ``size``
    (width, height px), ``format`` and ``decode_ms``; ``thumbnail`` (JPEG bytes) when asked for."""

    tensor: torch.Tensor
    size: tuple[int, int]
    format: str
    decode_ms: float
    thumbnail: bytes | None = None


def prepare(data: bytes, *, name: str, transform: v2.Compose, max_pixels: int, min_side: int | None,
            thumbnail: bool = False, size: Size | None = None) -> Prepared:
    """Decode and preprocess one upload (``decode`` then ``preprocess``), keeping only what the answer needs.

    A full-size image held while the batch waits would multiply memory by the requests in flight,
    so only the tensor, the size, the format and (``thumbnail``) a small JPEG are kept. ``size``: as ``decode``'s.

    :raises ServiceError: as ``decode``: empty (400), too many pixels or parts (413), not an image (415), damaged (400).
    """
    d = decode(data, max_pixels=max_pixels, name=name, min_side=min_side, size=size)
    tensor = preprocess(d.image, transform)
    return Prepared(tensor=tensor, size=d.size, format=d.format, decode_ms=d.decode_ms,
                    thumbnail=thumbnail_jpeg(d.image) if thumbnail else None)
