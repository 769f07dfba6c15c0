"""What ``classify --server`` sends for a photo: the server's own first steps done here (``scaled``), so a
12 MP phone photo travels as ~130 KB and the model still sees the very pixels it would from the original."""

from __future__ import annotations

import io
import math

_quiet: list[bool] = []  # set once Pillow's warnings are silenced here (exif.silence_pillow_warnings)


def scaled(data: bytes, short_side: int, resample: str = "bilinear",
           max_pixels: int | None = None) -> tuple[bytes, dict | None]:
    """The bytes worth sending for a photo, and its original's upright ``{"width", "height", "format"}``.

    ``short_side`` is ``send_short_side`` (px, the model's resize size) and ``resample`` the model's
    filter (``send_resample``, a Pillow filter name). A JPEG whose short side is over ``short_side``
    goes through the server's own first steps (``imaging.decode`` with its fast path, then the
    ``Resize`` of the model's preprocessing, which is Pillow's ``resize``): decoded at the smallest
    libjpeg DCT scale keeping the short side >= 2x ``short_side`` (``draft``), turned upright, cropped to its central 2:1 where it is a longer strip
    (``imaging.center_limit``), resized to torchvision's size for ``short_side`` and sent as
    lossless WebP (no EXIF). The server's resize of it is then the identity: the model sees the very
    pixels it would have from the original, and answers the same labels and probabilities (a resize
    with another filter or a lossy re-encode moved top-1 probabilities by up to 15 points). Anything
    else (not JPEG, CMYK, a result no smaller) is ``data`` itself. The dict is None where Pillow
    cannot read the file (then the server's answer describes it).

    What the server would refuse is sent as it is, so that the server refuses it: a copy made here
    would be a good photo. A JPEG over ``max_pixels`` (``CLASSIFIER_MAX_PIXELS`` where the client runs:
    the server's own limit is not published; both default to 80 MP), and a JPEG cut short and closed by
    an EOI marker, which libjpeg decodes with grey fill, or blurred where it is progressive
    (``incomplete.jpeg_rows_decoded`` and ``jpeg_scans_cut``, the server's own checks, at the same scale), and
    what ``refused_as_it_is`` finds. Pillow's warnings about the file are silenced as in the server.
    """
    from PIL import Image

    from .. import exif, incomplete  # the server's own reading of EXIF orientation and of a cut: the same photo

    if not _quiet:  # once per process: the filters are process-wide, and re-adding them from every --jobs
        exif.silence_pillow_warnings()  # thread at every file mutated the shared list for nothing
        _quiet.append(True)

    try:
        img = Image.open(io.BytesIO(data))
        width, height = img.size
        orientation = exif.orientation(img)
        fmt, jpeg = incomplete.primary_jpeg(img, data)  # a JPEG with more images after the photo (MPO): a JPEG
    except Exception:  # not an image, damaged, a decompression bomb: the server says which
        return data, None
    turned = orientation in (5, 6, 7, 8)  # the orientations that swap width and height
    info = {"width": height if turned else width, "height": width if turned else height, "format": fmt}
    if fmt != "JPEG" or img.mode not in ("RGB", "L") or min(width, height) <= short_side:
        return data, info
    if max_pixels is not None and width * height > max_pixels:
        return data, info  # the server's 413, not a classified copy
    if refused_as_it_is(jpeg):
        return data, info  # the server's 400, not a good copy of what libjpeg makes of the damage
    try:
        keep = 2 * short_side  # what the server's fast decode keeps (imaging._draft)
        factor = keep / min(width, height)

        def draft(im: Image.Image) -> None:
            im.draft(im.mode, (math.ceil(width * factor), math.ceil(height * factor)))

        draft(img)
        img.load()
        if incomplete.jpeg_rows_decoded(img, jpeg, height, draft) is not None:
            return data, info  # cut short and closed early: the server's 400, not a copy of the grey fill
        if ("progressive" in img.info or "progression" in img.info) and incomplete.jpeg_scans_cut(jpeg) is not None:
            return data, info  # a progressive one cut and closed: the server's 400, not a copy of the blur
        img = exif.turn(img, orientation)
        img = img.convert("RGB")
        w, h = img.size
        if max(w, h) > 2 * min(w, h):  # a strip over 2:1: its central 2:1, as the server's center_limit keeps
            keep = int(2 * min(w, h))
            off = (max(w, h) - keep) // 2
            img = img.crop((off, 0, off + keep, h) if w > h else (0, off, w, off + keep))
            w, h = img.size  # torchvision's Resize(short_side): the long side is int(short * long / short_side)
        size = (short_side, int(short_side * h / w)) if w <= h else (int(short_side * w / h), short_side)
        out = io.BytesIO()
        img.resize(size, Image.Resampling[resample.upper()]).save(out, format="WEBP", lossless=True)
    except Exception:  # damaged data: the server says so for the original
        return data, info
    return (out.getvalue(), info) if out.tell() < len(data) else (data, info)


def refused_as_it_is(jpeg: bytes) -> bool:
    """Whether the server refuses JPEG bytes ``jpeg`` that libjpeg decodes without an error, as the server's own
    checks find it (tryout19: a copy made here got labels where the API answers 400): a 0 DC quantizer
    (``formats.jpeg_frame``), colour components in separate scans closed before all came
    (``incomplete.jpeg_components_cut``), a copy made as text (``mangled.jpeg_copied_as_text``)."""
    from .. import incomplete, mangled
    from ..formats import jpeg_frame

    frame = jpeg_frame(jpeg)
    return bool(frame and frame.zero_dc) or incomplete.jpeg_components_cut(jpeg) is not None \
        or mangled.jpeg_copied_as_text(jpeg) is not None
