"""The JSON answer of one request, from its uploads, their decoded ``Prepared`` and their batcher results; the
error of a request whose photos cannot be read (``every_fault``); and the check that a client's ``original_*``
fields can describe the copy it sent. Shared by the gunicorn worker
(``webapp/service.py``) and the Ray Serve replica (``webapp/cluster/replica.py``), so both answer alike.
"""

from __future__ import annotations

import time

from .batcher import Result
from .contract import Upload
from .errors import BadRequest, NoFile, NotAnImage, ServiceError, TooLarge, UndecodableImage
from .imaging import Prepared, limited_size
from .models import encode


def answer(model: dict, categories: list[str], uploads: list[Upload], prepared: list[Prepared],
           outcomes: list[Result], *, topk: int, start: float, decode_ms: float) -> dict:
    """The JSON answer of one request from each upload's ``Prepared`` and its batcher ``Result``.

    ``model`` is the answers' ``model`` object; ``start`` the request's ``time.perf_counter()`` at
    arrival; times in the answer are ms. Shared by the Ray Serve replica, so both paths answer alike.
    Each result's ``width``, ``height`` (px), ``format`` and ``bytes`` describe the photo: the upload,
    or, where the client scaled it before sending (``Upload.original``), the original it describes;
    ``scaled_by_client`` then gives the same four of what was actually received and decoded.
    """
    results = []
    for up, p, out in zip(uploads, prepared, outcomes, strict=True):
        received = {"width": p.size[0], "height": p.size[1], "format": p.format, "bytes": len(up.data)}
        o = up.original
        photo = received if o is None else {"width": o.width, "height": o.height, "format": o.format,
                                            "bytes": o.bytes}
        item = {"filename": up.name, **photo,
                "predictions": encode(out.logits, categories, topk), "batch_size": out.batch_size}
        if o is not None:
            item["scaled_by_client"] = received
        if p.thumbnail is not None:
            item["thumbnail"] = p.thumbnail
        results.append(item)
    return {
        "model": model,
        "results": results,
        "timing_ms": {
            "decode": round(decode_ms, 2),
            "queue": round(max(o.queue_ms for o in outcomes), 2),
            "inference": round(max(o.inference_ms for o in outcomes), 2),
            "total": round((time.perf_counter() - start) * 1e3, 2),
        },
    }


def check_originals(uploads: list[Upload], prepared: list[Prepared], max_pixels: int | None = None) -> None:
    """Refuse ``original_*`` fields that cannot describe the copy received: a client scales a photo down before
    upload (``static/scale.js``, ``classify --server``: the short side to ``send_short_side``, of a strip over 2:1
    its central 2:1 only), so the copy is never wider or taller than its original (both upright, px; one pixel
    of rounding allowed), and has its shape: the original's width to height (a strip over 2:1: its own or its
    central 2:1's), each side within two pixels of rounding. Such values were reported as the photo's without a
    word (a portrait 3024x4032 original beside a landscape 768x576 copy too: tryout22). And the photo is the
    original: one over ``max_pixels`` (``MAX_PIXELS``) is refused as it is sent whole (the page classified an 85 MP
    photo it had scaled, which curl and ``classify --server`` got 413 for: tryout25).

    :raises BadRequest: the first upload whose original is smaller than what arrived, or of another shape (400,
        naming it). :raises TooLarge: the first whose original, fit otherwise, is over ``max_pixels`` (413).
    """
    for up, p in zip(uploads, prepared, strict=True):
        o = up.original
        if o is None:
            continue
        (w, h), say = p.size, f"{up.name}: original_width x original_height is {o.width}x{o.height}"
        if w > o.width + 1 or h > o.height + 1:
            raise BadRequest(f"{say}, smaller than the {w}x{h} photo received; a scaled copy is never larger than "
                             f"its original (both upright, in px)")
        # w/h against ow/oh, each copy side +-2 px; a strip's copy may be of the whole or its central 2:1
        shapes = {(o.width, o.height), limited_size(o.width, o.height)}
        if all(abs(w * oh - h * ow) > 2 * (ow + oh) for ow, oh in shapes):
            raise BadRequest(f"{say}, not the shape of the {w}x{h} photo received (a scaled copy keeps its "
                             f"original's width to height, of a strip over 2:1 its central 2:1's); both upright, in px")
        if max_pixels is not None and o.width * o.height > max_pixels:  # the message a whole upload would get
            raise TooLarge(f"{up.name}: {o.width}x{o.height} is {o.width * o.height:,} pixels; the limit is "
                           f"{max_pixels:,} (CLASSIFIER_MAX_PIXELS; original_width x original_height: the photo "
                           f"before the client scaled it)")


# What a photo's own bytes can be refused for as it is decoded (``imaging.prepare``): said per photo.
PHOTO_FAULTS = (NoFile, UndecodableImage, TooLarge, NotAnImage)


def every_fault(faults: list[ServiceError], photos: int) -> ServiceError:
    """The error of a request of ``photos`` uploads whose photos ``faults`` (in request order, each the photo's own
    ``PHOTO_FAULTS`` error, its message starting with the photo's name) cannot be read: the first one's class,
    status and code, its message naming every such photo. A request of 8 photos, 2 of them cut short, named only
    the first, and was refused again for the second once that was mended (tryout32).
    """
    first = faults[0]
    if len(faults) == 1:
        return first
    error = type(first).__new__(type(first))
    error.__dict__.update(first.__dict__)
    error.message = (f"{len(faults)} of the {photos} photos cannot be used: "
                     + "; ".join(f"({i}) {f.message}" for i, f in enumerate(faults, 1)))
    error.args = (error.message,)
    return error
