"""What ``classify --server`` sends of a file, and which upload limit it holds it to.

The limit is the server's, where it publishes it: its ``CLASSIFIER_MAX_UPLOAD_BYTES`` is in its ``GET
/openapi.json`` (the predict operation's ``x-max-upload-bytes``; the ``/api/v1/models`` entries do not carry it). ``--max-upload-bytes``, given, is the client's own limit and wins. A
server that publishes none (an older one, a proxy that passes only the API) is sent every file: its 413 is the
answer, as curl would get it (the client's own default of 32 MiB refused a 42 MB file a server set to 100 MB
takes: tryout). The client's ``CLASSIFIER_MAX_UPLOAD_BYTES`` variable is the server's setting, not the client's.

Memory stays bounded whatever the limit: a file of up to ``HELD_BYTES`` is read whole (a JPEG may be scaled
first); a larger one is sent from disk in ``BLOCK_BYTES`` blocks, never held (nor scaled): at most ``--jobs`` x
``HELD_BYTES`` of files are held at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, NamedTuple

HELD_BYTES = 32 * 2**20  # the most of one file held in memory (the settings' default MAX_UPLOAD_BYTES)
BLOCK_BYTES = 2**20  # a larger file is sent in blocks of this size, read as they are sent


class Limit(NamedTuple):
    """An upload limit in bytes (``None``: none known, every file is sent) and where it comes from, as a file's
    ``too_large`` message names it."""
    bytes: int | None
    source: str = ""


SERVERS = "the server's CLASSIFIER_MAX_UPLOAD_BYTES"
OPTION = "--max-upload-bytes"


def published_limit(doc: dict) -> int | None:
    """The upload limit a server's ``/openapi.json`` (``doc``, parsed) publishes, or None: the predict operation's
    ``x-max-upload-bytes`` (webapp/openapi.py). Raises nothing."""
    try:
        value = doc["paths"]["/api/v1/predict"]["post"]["x-max-upload-bytes"]
    except (KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def published_topk(doc: dict) -> int | None:
    """The labels per photo a server gives when not asked (its ``TOP_K``), from its ``/openapi.json`` (``doc``,
    parsed): the predict operation's multipart ``topk`` field's default, or (a server from before 2026-12-07) its
    ``topk`` query parameter's; None where absent. Raises nothing."""
    try:
        op = doc["paths"]["/api/v1/predict"]["post"]
        form = op["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]["topk"]
        value = form.get("default") or next(p["schema"]["default"] for p in op["parameters"]
                                            if p.get("name") == "topk" and p.get("in") == "query")
    except (KeyError, TypeError, AttributeError, StopIteration):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 10 else None


class FileBody(NamedTuple):
    """A file sent from disk, not held: ``size`` bytes of ``path`` (its size when it was looked at)."""
    path: Path
    size: int

    def chunks(self) -> Iterator[bytes]:
        """The file's ``size`` bytes, ``BLOCK_BYTES`` at a time, read as they are sent (a fresh reading for each
        try). A file that shrank since raises OSError (the request then fails as a dropped connection would); one
        that grew is sent as it was (``size`` bytes: the Content-Length said)."""
        with open(self.path, "rb") as f:
            left = self.size
            while left > 0:
                block = f.read(min(BLOCK_BYTES, left))
                if not block:
                    raise OSError(f"{self.path} shrank while it was sent")
                left -= len(block)
                yield block


def too_large(size: int, limit: Limit, *, scaled: bool = False) -> str:
    """The ``too_large`` message for a file of ``size`` bytes over ``limit`` (``scaled``: its scaled copy is),
    naming where the limit comes from."""
    whose = "the server's limit" if limit.source == SERVERS else "the limit"
    what = "scaled, the photo is still" if scaled else "the file is"
    return f"{what} {size:,} bytes; {whose} is {limit.bytes:,} ({limit.source})"


def read_upload(path: Path, limit: Limit) -> bytes | FileBody:
    """What to send of the file at ``path``: its bytes (up to ``HELD_BYTES``), or a ``FileBody`` for a larger one.

    A file over ``limit`` (by its size, from ``fstat`` of the opened file) is refused unread: ``ValueError`` with
    ``too_large``'s message. No more than ``HELD_BYTES`` + 1 bytes are read: a file that grew past that since it
    was looked at is sent from disk as well, or refused where it is now over the limit.

    :raises ValueError: over the limit (the message says so).
    :raises OSError: the file cannot be opened or read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if limit.bytes is not None and size > limit.bytes:
            raise ValueError(too_large(size, limit))
        data = f.read(HELD_BYTES + 1) if size <= HELD_BYTES else None
        if data is not None and len(data) <= HELD_BYTES:
            return data
        size = os.fstat(f.fileno()).st_size
    if limit.bytes is not None and size > limit.bytes:
        raise ValueError(too_large(size, limit))
    return FileBody(path, size)
