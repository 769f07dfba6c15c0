"""EXIF orientation, read on its own from the raw EXIF block and applied without re-writing EXIF.

Phones store photos sideways and say so in EXIF tag 0x0112 (Orientation, 1..8). Pillow's
``ImageOps.exif_transpose`` re-writes the whole EXIF block while rotating and raises on a damaged
tag elsewhere in it (a rational stored as UNDEFINED, a date as RATIONAL...), so a photo with one
such tag would be classified sideways. Here only the one entry is read, from IFD0 of the TIFF
structure inside the block (TIFF 6.0, section 2; EXIF 2.32, section 4.6.4), with every offset
bounds-checked: damage anywhere else (wrong types and counts, offsets past the end, IFD loops,
truncated blocks) cannot stop it. An entry of the wrong type or count, or a value outside 1..8,
means "no rotation" and is logged at debug.

AVIF: Pillow reads the container's own rotation and mirroring (HEIF ``irot``/``imir``) as an
orientation and, on open, re-writes the whole EXIF block to carry it, which raises on the same kinds
of damage: a good photo would be refused as undecodable. ``SturdyAvifImageFile`` (registered in
Pillow's place) keeps the block as it came and the container's orientation beside it.
"""

from __future__ import annotations

import logging
import struct
import warnings

from PIL import AvifImagePlugin, Image

log = logging.getLogger(__name__)

ORIENTATION_TAG = 0x0112
# img.info key of an AVIF's container orientation (1..8), where Pillow could not write it into the EXIF block.
CONTAINER_ORIENTATION = "container_orientation"
_SHORT = 3  # TIFF field type of Orientation: one unsigned 16-bit integer
# Orientation -> the transpose that makes the stored pixels upright (as Pillow's exif_transpose does).
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def silence_pillow_warnings() -> None:
    """Pillow warns about uploads (corrupt EXIF, decompression bombs, palette transparency) where
    decode either raises a ServiceError or carries on correctly: such warnings would only leak into
    logs, or onto ``classify --server``'s terminal. Process-wide filters, set once on import of
    ``imaging`` (and by ``cli/scaling.py``), not with catch_warnings per call, which is not thread-safe
    (decodes run on several threads, batcher.Offloader; the client scales on its ``--jobs`` threads).
    Also called by bench/fuzz.py, which judges decode with exactly the service's filters."""
    warnings.filterwarnings("ignore", module=r"PIL(\.|$)")
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    # torchvision 0.29 warns on every decode_jpeg call that its decoders are deprecated (for TorchCodec); the
    # arithmetic-coded JPEGs Pillow cannot decode go through it (imaging._decode_arithmetic). Pinned: it works.
    warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                            category=DeprecationWarning)


def orientation_from_block(raw: bytes) -> int | None:
    """The Orientation value (1..8) in a raw EXIF block, or None when absent, damaged or out of range.

    ``raw`` is the TIFF structure, with or without JPEG's ``Exif\\0\\0`` prefix (Pillow's
    ``img.info["exif"]`` for JPEG, PNG's ``eXIf`` and WebP), or with two: Pillow puts one before a PNG's
    ``eXIf`` chunk, and some writers put one in the chunk itself (against the PNG spec, but Pillow's own
    ``getexif`` and the page's ``strip.js`` read through it: with one taken off, the API classified such a photo
    sideways where the page turned it: tryout29). Never raises.
    """
    for _ in range(2):
        if raw.startswith(b"Exif\x00\x00"):
            raw = raw[6:]
    if len(raw) < 8 or raw[:2] not in (b"II", b"MM"):
        return None
    order = "<" if raw[:2] == b"II" else ">"
    magic, ifd0 = struct.unpack(order + "HI", raw[2:8])
    if magic != 42 or ifd0 < 8 or ifd0 + 2 > len(raw):
        return None
    (count,) = struct.unpack(order + "H", raw[ifd0:ifd0 + 2])
    first = ifd0 + 2
    for i in range(min(count, (len(raw) - first) // 12)):  # a count past the end stops at the end
        tag, kind, n = struct.unpack(order + "HHI", raw[first + 12 * i:first + 12 * i + 8])
        if tag != ORIENTATION_TAG:
            continue
        if kind != _SHORT or n != 1:
            log.debug("EXIF orientation entry has type %d, count %d (expected SHORT, 1): no rotation", kind, n)
            return None
        (value,) = struct.unpack(order + "H", raw[first + 12 * i + 8:first + 12 * i + 10])
        if not 1 <= value <= 8:
            log.debug("EXIF orientation %d is outside 1..8: no rotation", value)
            return None
        return value
    return None


def orientation(img: Image.Image) -> int | None:
    """The photo's EXIF orientation (1..8) from its raw EXIF block (JPEG, PNG, WebP...), or None.

    A TIFF's orientation is one of its own tags, and Pillow's TIFF reader already turns the image
    on open (and drops the tag on load), so TIFF has no block here and is never turned twice. An
    AVIF's is its container's (``irot``/``imir``), which Pillow writes into the block, or, where a
    damaged block could not take it, ``SturdyAvifImageFile`` keeps beside it. Never raises.
    """
    container = img.info.get(CONTAINER_ORIENTATION)  # an AVIF's irot/imir: the truth there, as Pillow takes it
    if isinstance(container, int):
        return container if 1 <= container <= 8 else None
    raw = img.info.get("exif")
    return orientation_from_block(raw) if isinstance(raw, bytes) else None


class SturdyAvifImageFile(AvifImagePlugin.AvifImageFile):
    """Pillow's AVIF reader, except that a damaged EXIF block cannot stop it opening (see the module's words).

    Where Pillow's open fails after the file itself was read (its decoder answers), the EXIF block stays
    as it came and ``info[CONTAINER_ORIENTATION]`` holds the container's orientation (1..8). A file the
    decoder cannot read raises as in Pillow (``SyntaxError``, ``ValueError``...).
    """

    def _open(self) -> None:
        try:
            super()._open()
            return
        except Exception as exc:  # the EXIF re-write raises whatever its damaged tag makes it raise
            failure = exc
        try:
            *_, raw, value, _xmp = self._decoder.get_info()
        except Exception:
            raise failure from None
        log.debug("AVIF EXIF block cannot carry the container orientation (%s): kept beside it", failure)
        if raw:
            self.info["exif"] = raw
        self.info[CONTAINER_ORIENTATION] = value
        self.seek(0)


Image.register_open(AvifImagePlugin.AvifImageFile.format, SturdyAvifImageFile, AvifImagePlugin._accept)


def turn(img: Image.Image, value: int | None) -> Image.Image:
    """``img`` turned as orientation ``value`` (2..8) says; as stored for None or 1.

    Only the pixels are transposed: the EXIF block is neither parsed beyond that one entry nor
    re-written, so damage elsewhere in it changes nothing.
    """
    method = _TRANSPOSE.get(value or 1)
    return img.transpose(method) if method is not None else img
