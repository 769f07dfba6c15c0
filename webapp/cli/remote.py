"""``python -m webapp classify --server URL PATH...``: photos to a running server, over N connections.

The same files as local ``classify`` (``files.collect_files``), the same results, progress bar,
table/JSON/CSV (``output.write_results``) and exit status; the labels come from the server's
``POST /api/v1/predict``. What makes it fit for a big folder and a busy server:

- **Scaled locally first** (unless ``--no-scale``): a JPEG whose short side is over what
  ``GET /api/v1/models`` says is worth sending for the serving model (``send_short_side``: its resize
  size) goes through the server's own first steps here (decoded at reduced scale with Pillow ``draft``
  exactly as the server's fast decode would, turned upright (EXIF), resized with the model's filter
  ``send_resample`` to that short side) and is sent as lossless WebP: the server's resize of it is then
  the identity, so the very same pixels reach the model, and the same answers (``scaled``). A 3.2 MB
  12 MP phone photo is sent as ~130 KB (341x256). The results still report the original's upright size
  and format, as local ``classify`` does. Any other file is sent as it is (the server says what is wrong,
  if anything).
- **N concurrent connections** (``--jobs``, default ``DEFAULT_JOBS``): a thread pool
  (``concurrency.client_pool``) over one urllib3 pool of keep-alive connections.
- **Back-pressure honoured**: a 429 (``overloaded``, ``rate_limited``) or 503 (``not_ready``) is
  tried again after its ``Retry-After`` seconds times 1..1+``JITTER`` (so the clients told the same
  moment do not all return at once), a dropped connection after a short growing pause; at most
  ``MAX_TRIES`` tries and ``MAX_WAIT_S`` seconds of waiting per file.
- **Nothing dropped silently**: every file ends in a result or an error line (the server's code
  and message, or ``connection_error`` / ``read_error``, with how many tries it took). A server
  that cannot be reached at the start is one error line and exit 1.

The token, where the server needs one, is read from ``CLASSIFIER_API_TOKEN`` (not an option: a
command line shows in ``ps``).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import sys
import time
from pathlib import Path

from .. import settings as settings_mod
from .common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, err, plural
from .files import collect_files, no_image_files, report_skipped, skipped_note
from .options import given_settings
from .output import write_results

DEFAULT_JOBS = 8  # connections at once: enough to keep a server's batches full, few enough for its queue
MAX_TRIES = 8  # per file: the first try and up to 7 more after 429/503 or a dropped connection
MAX_WAIT_S = 120.0  # per file: the most seconds spent waiting between tries
JITTER = 0.5  # a wait is Retry-After x uniform(1, 1 + JITTER)
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10.0, 300.0
RETRY_STATUSES = (429, 503)
# Settings the server decides; given with --server they would silently do nothing, so they are refused.
_CLIENT_SETTINGS = ("TOP_K", "LOG_LEVEL")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--server`` and ``--no-scale`` to the ``classify`` parser."""
    parser.add_argument("--server", default=None, metavar="URL",
                        help="classify with a running server (http://host:port) instead of a local model: N "
                             "concurrent connections (--jobs, default %d), photos scaled locally first, 429 and "
                             "Retry-After honoured; same outputs and exit status. Where the server wants a "
                             "token, set its API_TOKEN setting's variable here too (read from the environment)"
                             % DEFAULT_JOBS)
    parser.add_argument("--no-scale", action="store_true",
                        help="with --server: send the files as they are (default: photos larger than the server "
                             "needs are scaled down locally first)")


class Unreachable(Exception):
    """The server cannot be asked at all (refused, no such host, not our API); the message says which."""


class Client:
    """Keep-alive connections to one server (``url``: scheme, host and port), shared by ``jobs`` threads."""

    def __init__(self, url: str, *, jobs: int, token: str = ""):
        import urllib3

        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = urllib3.PoolManager(num_pools=1, maxsize=jobs, block=True, retries=False,
                                        timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S))

    def request(self, method: str, path: str, *, body: bytes | None = None, headers: dict | None = None):
        """One request; returns urllib3's response. Raises urllib3's errors for a failed connection."""
        return self.http.request(method, self.url + path, body=body, headers={**self.headers, **(headers or {})},
                                 preload_content=True)

    def serving_model(self) -> dict:
        """The serving model's ``/api/v1/models`` entry (the one asked for, before the server has loaded one).

        :raises Unreachable: no answer, or not this service's answer.
        """
        import urllib3

        try:
            resp = self.request("GET", "/api/v1/models")
        except urllib3.exceptions.HTTPError as exc:
            raise Unreachable(f"cannot reach the server at {self.url}: {_reason(exc)}") from None
        try:
            doc = json.loads(resp.data)
            serving = doc["serving"] or doc["requested"]
            return next(m for m in doc["models"] if m["name"] == serving)
        except (ValueError, KeyError, TypeError, StopIteration):
            raise Unreachable(f"{self.url} is not a photo classifier: GET /api/v1/models answered {resp.status} "
                              f"{resp.data[:80]!r}") from None


def _reason(exc: Exception) -> str:
    """urllib3's wrapped error in a few words: the OS's reason where there is one."""
    inner = getattr(exc, "reason", None) or exc
    while getattr(inner, "reason", None) is not None and inner.reason is not inner:
        inner = inner.reason
    text = str(inner)
    return text.split(": ", 1)[-1] if "Failed to establish a new connection" in text else text


def scaled(data: bytes, short_side: int, resample: str = "bilinear") -> tuple[bytes, dict | None]:
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
    """
    from PIL import Image

    from .. import exif  # the server's own reading of EXIF orientation: the same upright photo

    try:
        img = Image.open(io.BytesIO(data))
        width, height = img.size
        orientation = exif.orientation(img)
        fmt = img.format or "unknown"
    except Exception:  # not an image, damaged, a decompression bomb: the server says which
        return data, None
    turned = orientation in (5, 6, 7, 8)  # the orientations that swap width and height
    info = {"width": height if turned else width, "height": width if turned else height, "format": fmt}
    if fmt != "JPEG" or img.mode not in ("RGB", "L") or min(width, height) <= short_side:
        return data, info
    try:
        keep = 2 * short_side  # what the server's fast decode keeps (imaging._draft)
        factor = keep / min(width, height)
        img.draft(img.mode, (math.ceil(width * factor), math.ceil(height * factor)))
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


def _error(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def classify_one(client: Client, path: Path, *, topk: int, short_side: int | None,
                 resample: str = "bilinear") -> dict:
    """One file's result: ``{"width", "height", "format", "predictions", "batch_size", "retries"}`` or
    ``{"error": {"code", "message"}, "retries"}``. Never raises for a file, a server's refusal or a
    dropped connection (see the module docstring for the retries)."""
    import urllib3

    try:
        data = path.read_bytes()
    except OSError as exc:
        return {"error": _error("read_error", f"cannot read the file: {exc.strerror or exc}"), "retries": 0}
    body, info = scaled(data, short_side, resample) if short_side else (data, None)
    waited, tries = 0.0, 0
    while True:
        tries += 1
        wait = None
        try:
            resp = client.request("POST", f"/api/v1/predict?topk={topk}", body=body,
                                  headers={"Content-Type": "application/octet-stream"})
        except urllib3.exceptions.HTTPError as exc:  # refused, reset, timed out: the server may be restarting
            failure = _error("connection_error", f"no answer from {client.url}: {_reason(exc)}")
            wait = min(0.5 * 2 ** (tries - 1), 8.0) * random.uniform(1, 1 + JITTER)
        else:
            try:
                doc = json.loads(resp.data)
            except ValueError:
                doc = {}
            if resp.status == 200 and "results" in doc:
                r = doc["results"][0]
                return {**{k: r[k] for k in ("width", "height", "format")}, **(info or {}),
                        "predictions": r["predictions"], "batch_size": r.get("batch_size"), "retries": tries - 1}
            e = doc.get("error") if isinstance(doc.get("error"), dict) else {}
            failure = _error(e.get("code", "http_error"), str(e.get("message") or f"HTTP {resp.status}")
                             .removeprefix("upload: "))  # the server names a raw body "upload"; the path says it
            if resp.status in RETRY_STATUSES:
                after = resp.headers.get("Retry-After", "1")
                wait = (int(after) if after.isdigit() else 1) * random.uniform(1, 1 + JITTER)
        if wait is None:
            return {"error": failure, "retries": tries - 1}
        if tries >= MAX_TRIES or waited + wait > MAX_WAIT_S:
            failure["message"] += f" (gave up after {tries} tries, {waited:.0f} s of waiting)"
            return {"error": failure, "retries": tries - 1}
        time.sleep(wait)
        waited += wait


def classify_remote(args: argparse.Namespace) -> int:
    """``classify --server URL``: print one result per file on stdout; EXIT_OK all classified, EXIT_FAILED
    some failed (or the server cannot be reached), EXIT_USAGE misused options or no image files (as local
    ``classify``; photos skipped in folders, e.g. HEIC, are named with why, as there)."""
    given = given_settings(args)
    misused = [f"--{k.lower().replace('_', '-')}" for k in given if k not in _CLIENT_SETTINGS]
    misused += [flag for flag, on in (("--cluster", args.cluster), ("--out", args.out), ("--address", args.address))
                if on]
    if misused:
        err(f"error: {', '.join(misused)} do(es) not go with --server: the server's own settings decide")
        return EXIT_USAGE
    if not args.server.startswith(("http://", "https://")):
        err(f"error: --server must be an http:// or https:// URL, got {args.server!r}")
        return EXIT_USAGE
    s = settings_mod.load(os.environ, given)
    items, skipped = collect_files(args.paths, all_files=args.all_files)
    report_skipped(skipped)  # as local classify: a HEIC in a folder is named with why, not dropped unsaid
    if not any(path for _, path, _ in items):
        for shown, _, why in items:
            err(f"{shown}: {why}")
        no_image_files(args.paths, skipped)
        return EXIT_USAGE  # as local classify (README's exit table: no image file in the paths)
    jobs = args.jobs or DEFAULT_JOBS
    client = Client(args.server, jobs=jobs, token=s.API_TOKEN)
    try:
        model = client.serving_model()
    except Unreachable as exc:
        err(f"error: {exc}")
        return EXIT_FAILED
    short_side = None if args.no_scale else model.get("send_short_side")
    from PIL import Image

    resample = model.get("send_resample", "bilinear")  # a server from before the field: bilinear, as all here
    if str(resample).upper() not in Image.Resampling.__members__:  # a filter Pillow lacks: send originals
        short_side = None
    if not args.quiet:
        scale = "sent as they are" if short_side is None else f"over {short_side} px scaled locally first"
        err(f"classifying with {client.url}: {model.get('title', model['name'])}, {model.get('precision', '?')}; "
            f"{plural(jobs, 'connection')}, photos {scale}")
    return _run(args, client, model["name"], items, topk=s.TOP_K, short_side=short_side, resample=resample,
                jobs=jobs, skipped=skipped)


def _run(args, client: Client, model: str, items: list, *, topk: int, short_side: int | None, resample: str,
         jobs: int, skipped: list = ()) -> int:
    from concurrent.futures import as_completed

    from tqdm import tqdm

    from ..concurrency import client_pool

    results = []
    for shown, path, why in items:
        error = _error("not_found" if why.startswith("no such") else "not_a_file", why) if why else None
        results.append({"path": shown, "model": model, "width": None, "height": None, "format": None,
                        "predictions": [], "batch_size": None, "error": error, "_path": path})
    todo = [i for i, r in enumerate(results) if r["error"] is None]
    failed, retries = len(results) - len(todo), 0
    start = time.perf_counter()
    pool = client_pool(jobs)
    bar = tqdm(total=len(todo), unit="img", file=sys.stderr, disable=args.quiet, dynamic_ncols=True,
               desc="classify", mininterval=0.2)
    try:
        futures = {pool.submit(classify_one, client, results[i]["_path"], topk=topk, short_side=short_side,
                               resample=resample): i
                   for i in todo}
        for future in as_completed(futures):
            result = results[futures[future]]
            result.update(future.result())
            retries += result.pop("retries")
            failed += result["error"] is not None
            bar.set_postfix(failed=failed, retried=retries, refresh=False)
            bar.update(1)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
        raise
    bar.close()
    pool.shutdown()
    elapsed = time.perf_counter() - start
    for r in results:
        r.pop("_path", None)
    write_results(results, args.format or "table", topk, sys.stdout)
    sys.stdout.flush()
    if not args.quiet:
        done = len(todo) - (failed - (len(results) - len(todo)))
        rate = f", {done / elapsed:.1f} images/s" if elapsed > 0 and done else ""
        err(f"{plural(len(results), 'file')}: {len(results) - failed} classified, {failed} failed; {elapsed:.1f} s"
            f"{rate}; {retries} tries repeated after 429/503 or a dropped connection" + skipped_note(list(skipped)))
    return EXIT_OK if failed == 0 else EXIT_FAILED
