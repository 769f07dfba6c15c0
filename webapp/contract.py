"""What the views need from a classifier, and the data that crosses that line.

The Flask views (``api.py``, ``ui.py``), the error pages and ``/metrics`` talk to a classifier
only through ``ClassifierLike``. Two implement it: ``service.Classifier`` (this process's model,
engine and batcher: a gunicorn worker, the CLI) and ``cluster.ingress.RemoteClassifier`` (forwards
to Ray Serve model replicas). Also the formats the service decodes (``FORMATS``), which the CLI names.
Torch-free and Flask-free, so both sides (and the CLI) can import it.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable


REQUEST_ID_HEADER = "X-Request-ID"
_SANE_ID = re.compile(r"[A-Za-z0-9._:+/=@~-]{1,128}")


def request_id_from(header: str | None) -> str:
    """A request's id: the client's ``X-Request-ID`` if it is a sane token (1..128 of ``A-Z a-z 0-9 . _ : + / = @
    ~ -``), else a new uuid4 hex. Every answer echoes it, the workers' and gunicorn's master's (``webapp/logs.py``,
    ``webapp/responder.py``)."""
    if header and _SANE_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


# Photo formats the service decodes (imaging.decode opens uploads as these only). Others Pillow knows (EPS
# via Ghostscript, PSD, FITS, ...) are refused: less attack surface, and none of them is a photo a person
# uploads. Not ICO: Pillow decodes an icon's embedded image while opening it, before its real size is
# known, so the pixel check could not come first (a 16x16 entry can hide a 13000x13000 PNG).
FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF", "AVIF", "PPM")
# The same formats, for people: the 415 message and classify's words for a HEIC or RAW photo it skips
# (README's table and the page's hint say the same).
FORMAT_NAMES = "JPEG, PNG, WebP, GIF, BMP, TIFF, AVIF or PPM"

# Formats a client may name as the original of a photo it scaled before upload: every one the service decodes
# itself (a PPM scaled by a client was refused, one sent as it is answered), and HEIC/HEIF, which phones and
# Safari decode (so the page can send a JPEG of one) and the service does not. And MPO, Pillow's name for a JPEG
# with more images after the photo (a phone's gain map or depth map: ``incomplete.primary_jpeg``), which the
# service reports as JPEG, and so takes as JPEG here.
ORIGINAL_FORMATS = (*FORMATS, "HEIC", "HEIF", "MPO")


@dataclass(frozen=True)
class Original:
    """What a client says of the photo it scaled before upload (the page does, in the browser).

    ``width``, ``height``: the original's upright size in px (EXIF orientation applied), each
    1..``MAX_SIDE``; ``format``: one of ``ORIGINAL_FORMATS``; ``bytes``: its file size, 1..``MAX_BYTES``.
    Answers report these as the photo's, and mark the result ``scaled_by_client``.
    """

    width: int
    height: int
    format: str
    bytes: int

    MAX_SIDE = 65535  # the largest side JPEG, WebP, HEIC and AVIF can state, and browsers' canvas limit
    MAX_BYTES = 2**40  # 1 TiB: any file a phone or camera writes


@dataclass(frozen=True)
class Size:
    """One photo's cost as ``sizes.read_size`` reads it before decoding: ``pixels`` (the pixels ``decode`` will
    produce at ``min_side`` px, the model's resize size, or None: full size; 0 where the header cannot be read or
    the file is refused unread) and ``refused`` (``formats.too_many_parts``' words: the file is refused, 413,
    without Pillow opening it; None: it is not)."""

    pixels: int
    min_side: int | None
    refused: str | None = None


@dataclass
class Upload:
    """One uploaded file: its client-side ``name`` (only ever echoed, escaped) and raw ``data`` (bytes);
    ``original``: where the client scaled the photo before sending it, what it says of the original;
    ``size``: what ``sizes.check_request_pixels`` read of ``data`` (its pixels, its parts walk's verdict), kept so
    that a second check of the same upload and its decode do not walk it again (None: not read yet)."""

    name: str
    data: bytes
    original: Original | None = None
    size: Size | None = None


@runtime_checkable
class ClassifierLike(Protocol):
    """The classifier the app serves (``app.extensions["classifier"]``).

    - ``admit(environ, n)``: raises ``NotReady`` (503) / ``Overloaded`` (429) before the request body is
      read; ``environ`` is the request's WSGI environ (its ``CONTENT_LENGTH``, bytes, and under gunicorn
      its ``gunicorn.socket``), ``n`` the photos it counts for.
    - ``classify(uploads, topk=, keep_images=)`` -> the JSON answer ``{"model", "results",
      "timing_ms"}`` (ms); with ``keep_images`` each result also carries ``thumbnail``, a JPEG of
      the photo (bytes, <= 320 px) for the page. Raises ``errors.ServiceError`` subclasses only.
    - ``ready`` (bool) and ``status`` (str, why not ready) for ``/readyz``; ``self_test`` (dict or
      None); ``health()`` for ``/healthz``; ``describe()`` -> the answers' ``model`` object;
      ``model`` (None until loaded); ``settings`` (``webapp.settings.Settings``).
    - ``queue_depth`` (images waiting, for ``/metrics``) and ``on_outcomes`` (set by ``/metrics``:
      called with each request's per-image batcher ``Result``s, where there are any).
    """

    settings: Any
    on_outcomes: Callable[[list], None] | None

    def admit(self, environ: Any = None, n: int = 1) -> None: ...

    def classify(self, uploads: list[Upload], *, topk: int, keep_images: bool = False) -> dict: ...

    @property
    def ready(self) -> bool: ...

    @property
    def status(self) -> str: ...

    @property
    def self_test(self) -> dict | None: ...

    @property
    def model(self) -> Any: ...

    @property
    def queue_depth(self) -> int: ...

    def describe(self) -> dict: ...

    def health(self) -> dict: ...
