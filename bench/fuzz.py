"""Fuzz the upload path for a fixed time: ``webapp.imaging.decode`` directly, and the real HTTP endpoint.

Hypothesis generates (a) arbitrary bytes and (b) mutations of small valid photos in every format
the service decodes (byte sets and bit flips, 16/32-bit "interesting" values written into the
header, inserted junk, deleted or duplicated runs, truncations (some closed by a JPEG EOI marker), splices of two files; PNG chunk
CRCs are re-fixed half the time so a mutated IHDR really reaches the decoder). The same inputs go

* to ``decode`` + ``preprocess`` in this process (thousands a second): anything but the documented
  errors (``NoFile``/``UndecodableImage`` 400, ``TooLarge`` 413, ``NotAnImage`` 415) is a failure,
  and so is a warning that gets past the service's own warning filters (which silence Pillow's: a
  "Corrupt EXIF data" on a broken TIFF says nothing the answer does not), a result that is not RGB
  or is over the pixel cap, or a tensor that is not ``(3, 224, 224)`` finite float32. A failure is
  a failure of the service, never of this harness;
* to ``POST /api/v1/predict`` of a gunicorn server, as multipart ``file`` (fuzzed filename) or as a
  raw body (``image/jpeg``, ``image/png``, ``application/octet-stream``), with a fuzzed ``topk``
  now and then: a status outside {200, 400, 413, 415}, a body that is not the documented JSON
  (``{"model", "results", "timing_ms"}`` or ``{"error": {"code", "message", "status"}}``), a
  connection error, or a worker replaced while fuzzing (a crash; several workers answering in turn
  are not one) is a failure.

By default it starts its own server (``bench/servers.py``'s ``start_ours``: the offline
EfficientNet-Lite0, eager, 1 worker) and at the end also fails if the server did not exit 0 or
its log holds a ``Traceback`` or a Pillow warning.

Usage (repo root, venv active)::

    python bench/fuzz.py                          # 300 s, decode + HTTP, own server
    python bench/fuzz.py --seconds 60
    python bench/fuzz.py --url http://127.0.0.1:8000   # a running server (its log is not checked)
    python bench/fuzz.py --targets decode         # decode only (no server); EXIF damage included
    python bench/fuzz.py --targets http --model resnet18_seeded

The summary gives, per target, the examples run and every outcome seen (``ok:<format>`` or the
error class for decode, ``<status>[:<code>]`` for HTTP) and the slowest example (slow is not a
failure; its input is saved when it took over 0.5 s). Each failure is shrunk by hypothesis; its
smallest input is saved under ``$TMPDIR/webapp-fuzz/`` and the path printed (a ``.json`` next to
it says how it was sent). Replay one with ``python bench/fuzz.py --replay PATH [--url URL]``.
libtiff prints its own decode errors to stderr; they are not failures (``2>/dev/null`` hides
them). Exit status: 0 no failure, 1 failures, 2 the server did not start.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import struct
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import requests
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

if __package__ in (None, ""):  # run as `python bench/fuzz.py`: the bench package is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.exif_blocks import damaged_blocks, stored_sideways  # noqa: E402
from bench.servers import NotReady, start_ours  # noqa: E402
from webapp import imaging  # noqa: E402
from webapp.errors import NoFile, NotAnImage, ServiceError, TooLarge, UndecodableImage  # noqa: E402
from webapp.models import LITE0_PREPROCESSING  # noqa: E402
from webapp.settings import BY_NAME  # noqa: E402

MAX_PIXELS = BY_NAME["MAX_PIXELS"].default
ALLOWED_ERRORS = {NoFile: 400, UndecodableImage: 400, TooLarge: 413, NotAnImage: 415}
ALLOWED_STATUSES = {200, 400, 413, 415}
ERROR_CODES = {400: {"no_file", "undecodable_image", "bad_request"}, 413: {"too_large"},
               415: {"unsupported_media_type"}}
LEAK_MARKERS = ("Traceback", "UserWarning", "DecompressionBombWarning", "Palette images with Transparency",
                "RuntimeWarning", "DeprecationWarning")
SLOW_S = 5.0


# ------------------------------------------------------------------------------------------- inputs

def _encode(img: Image.Image, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def make_seeds() -> dict[str, bytes]:
    """Small valid files in every decoded format and the modes/features that take other code paths."""
    rng = np.random.default_rng(7)
    base = np.zeros((12, 16, 3), np.uint8)
    base[..., 0] = np.arange(16) * 16
    base[..., 1] = (np.arange(12) * 21)[:, None]
    base[..., 2] = rng.integers(0, 256, (12, 16))
    im = Image.fromarray(base, "RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    frames = [im, ImageOps.mirror(im), ImageOps.invert(im)]
    seeds = {
        "png": _encode(im, "PNG"),
        "png-rgba": _encode(im.convert("RGBA"), "PNG"),
        "png-la": _encode(im.convert("LA"), "PNG"),
        "png-p-trns": _encode(im.convert("P"), "PNG", transparency=0),
        "png-1bit": _encode(im.convert("1"), "PNG"),
        "png-i16": _encode(Image.fromarray((np.asarray(im.convert("L")).astype(np.uint16) * 257)), "PNG"),
        "png-optimized": _encode(im, "PNG", optimize=True),
        "jpeg": _encode(im, "JPEG", quality=80),
        "jpeg-progressive": _encode(im, "JPEG", quality=80, progressive=True),
        "jpeg-exif6": _encode(im, "JPEG", quality=80, exif=exif.tobytes()),
        "jpeg-cmyk": _encode(im.convert("CMYK"), "JPEG", quality=80),
        "jpeg-gray": _encode(im.convert("L"), "JPEG", quality=80),
        "gif-anim": _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0),
        "webp-lossy": _encode(im, "WEBP", quality=70),
        "webp-lossless": _encode(im.convert("RGBA"), "WEBP", lossless=True),
        "webp-anim": _encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=50, lossless=True),
        "bmp": _encode(im, "BMP"),
        "bmp-p": _encode(im.convert("P"), "BMP"),
        "tiff": _encode(im, "TIFF"),
        "tiff-lzw": _encode(im, "TIFF", compression="tiff_lzw"),
        "tiff-deflate-i16": _encode(Image.fromarray(np.asarray(im.convert("L")).astype(np.uint16) * 257),
                                    "TIFF", compression="tiff_adobe_deflate"),
        "tiff-f": _encode(Image.fromarray(np.asarray(im.convert("L"), np.float32) / 255), "TIFF"),
        "ppm": _encode(im, "PPM"),
        "pgm": _encode(im.convert("L"), "PPM"),
    }
    try:
        seeds["avif"] = _encode(im, "AVIF", quality=60)
    except Exception:  # Pillow built without AVIF
        pass
    return seeds


SEEDS = make_seeds()
INTERESTING = [0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000,
               0xFFFFFFFF, 9500, 20000, 65535, 100000]


def fix_png_crcs(data: bytes) -> bytes:
    """Recompute every chunk CRC of a PNG (so a mutated chunk reaches the decoder)."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return data
    out = bytearray(data)
    pos = 8
    while pos + 12 <= len(out):
        length = struct.unpack(">I", out[pos:pos + 4])[0]
        end = pos + 8 + length
        if end + 4 > len(out):
            break
        out[end:end + 4] = struct.pack(">I", zlib.crc32(bytes(out[pos + 4:end])))
        pos = end + 4
    return bytes(out)


@st.composite
def mutated(draw) -> bytes:
    """A seed file with 1..8 mutations, biased towards its header (past the magic bytes, mostly)."""
    name = draw(st.sampled_from(sorted(SEEDS)))
    data = bytearray(SEEDS[name])
    for _ in range(draw(st.integers(1, 8))):
        if not data:
            break
        n = len(data)
        pos = min(draw(st.one_of(st.integers(8, 127), st.integers(0, n - 1))), n - 1)
        op = draw(st.sampled_from(["set", "flip", "value", "insert", "delete", "dup", "truncate", "cut_closed",
                                   "splice"]))
        if op == "set":
            data[pos] = draw(st.integers(0, 255))
        elif op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "value":
            value = draw(st.sampled_from(INTERESTING))
            fmt = draw(st.sampled_from([">H", "<H", ">I", "<I"]))
            packed = struct.pack(fmt, value & (0xFFFF if fmt[1] == "H" else 0xFFFFFFFF))
            data[pos:pos + len(packed)] = packed
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=32))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        elif op == "dup":
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 256))]
        elif op == "truncate":
            del data[pos:]
        elif op == "cut_closed":  # cut, then closed by a JPEG EOI marker, as some tools save a partial file
            data[pos:] = b"\xff\xd9"
        else:
            other = SEEDS[draw(st.sampled_from(sorted(SEEDS)))]
            data[pos:] = other[min(pos, len(other) - 1):]
    out = bytes(data)
    if draw(st.booleans()):
        out = fix_png_crcs(out)
    return out


@st.composite
def damaged_exif(draw) -> bytes:
    """A small photo stored sideways (Orientation 6) in JPEG, PNG or WebP, its EXIF block damaged at
    random: wrong types and counts, offsets past the end, flipped bytes, cut blocks (bench/exif_blocks.py)."""
    raw, _ = draw(damaged_blocks())
    fmt = draw(st.sampled_from(["JPEG", "PNG", "WEBP"]))
    return stored_sideways(EXIF_BASE, raw if fmt != "WEBP" else raw.removeprefix(b"Exif\0\0"), fmt)


EXIF_BASE = Image.fromarray(np.arange(16 * 12 * 3, dtype=np.uint8).reshape(12, 16, 3) * 5, "RGB")
FUZZ_BYTES = st.one_of(st.binary(max_size=4096), mutated(), mutated(), damaged_exif())

FILENAMES = st.one_of(st.just("x.jpg"), st.text(max_size=40).map(lambda s: s + ".jpg"))
# Mostly no topk (so the bytes reach the decoder), now and then a strange one.
TOPK = st.integers(0, 9).flatmap(lambda n: st.none() if n < 8 else st.one_of(
    st.sampled_from(["1", "10", "0", "11", "-1", "2.5", " 3", "\uff13", "9" * 5000]), st.text(max_size=6)))


@st.composite
def http_requests(draw) -> dict:
    """How one upload is sent: multipart (with a fuzzed filename) or a raw body (with a content type), and a ``topk`` (None: none)."""
    how = draw(st.sampled_from(["multipart", "raw"]))
    req = {"how": how, "topk": draw(TOPK)}
    if how == "multipart":
        req["filename"] = draw(FILENAMES)
        req["part_name"] = draw(st.sampled_from(["file", "file", "file", "photo", "", None]))  # None: no name= (was 500)
    else:
        req["content_type"] = draw(st.sampled_from(["image/jpeg", "image/png", "application/octet-stream"]))
    return req


# ------------------------------------------------------------------------------------------ targets

class Failure(AssertionError):
    """An outcome the documentation does not allow (its message says which); hypothesis shrinks it."""
    pass


@dataclass
class Target:
    """One fuzz target's tally: examples run, outcomes seen, the slowest example (s), failures."""
    name: str
    examples: int = 0
    outcomes: Counter = field(default_factory=Counter)
    slowest: float = 0.0
    slow: int = 0
    failures: list = field(default_factory=list)
    last_failing: tuple | None = None  # (data, meta, message): hypothesis replays the shrunk one last
    slowest_input: tuple | None = None  # (data, meta)

    def timed(self, elapsed: float, data: bytes, meta: dict) -> None:
        """Count one example that took ``elapsed`` s (kept as the slowest when it is)."""
        self.examples += 1
        if elapsed > self.slowest:
            self.slowest, self.slowest_input = elapsed, (data, meta)
        self.slow += elapsed > SLOW_S


TRANSFORM = imaging.build_transform(LITE0_PREPROCESSING)


def check_decode(data: bytes) -> str:
    """Run decode + preprocess; return the outcome's name, raise Failure on anything undocumented."""
    with warnings.catch_warnings(record=True) as caught:
        # Everything recorded every time, except what the service's own filters silence in the service
        # too (set again here: an import inside someone's catch_warnings block would have lost them).
        warnings.simplefilter("always")
        imaging.silence_pillow_warnings()
        try:
            d = imaging.decode(data, max_pixels=MAX_PIXELS, name="fuzz")
            x = imaging.preprocess(d.image, TRANSFORM)
        except ServiceError as exc:
            if ALLOWED_ERRORS.get(type(exc)) != exc.status:
                raise Failure(f"undocumented {type(exc).__name__} {exc.status}: {exc.message}") from None
            if not exc.message:
                raise Failure(f"{type(exc).__name__} without a message") from None
            outcome = type(exc).__name__
        except Exception as exc:
            raise Failure(f"{type(exc).__name__} escaped decode/preprocess: {exc}\n"
                          f"{''.join(traceback.format_exc(limit=-6))}") from None
        else:
            w, h = d.image.size
            if d.image.mode != "RGB" or not 1 <= w * h <= MAX_PIXELS:
                raise Failure(f"decoded to mode {d.image.mode} size {d.image.size}")
            if tuple(x.shape) != (3, 224, 224) or x.dtype != torch.float32 or not bool(x.isfinite().all()):
                raise Failure(f"preprocess gave {tuple(x.shape)} {x.dtype}, finite={bool(x.isfinite().all())}")
            outcome = f"ok:{d.format}"
    if caught:
        raise Failure("warnings escaped: " + "; ".join(f"{w.category.__name__}: {w.message}" for w in caught))
    return outcome


def check_body(status: int, body) -> None:
    """Check an answer's JSON against the documented shapes. :raises Failure: it does not match."""
    if not isinstance(body, dict):
        raise Failure(f"{status}: body is not a JSON object: {body!r:.200}")
    if status == 200:
        if set(body) != {"model", "results", "timing_ms"} or not body["results"]:
            raise Failure(f"200 body has keys {sorted(body)}")
        for r in body["results"]:
            preds = r.get("predictions")
            if not isinstance(r.get("filename"), str) or not preds or not all(
                    set(p) == {"label", "index", "probability"} and 0 <= p["index"] < 1000 for p in preds):
                raise Failure(f"200 result malformed: {r!r:.300}")
        return
    err = body.get("error") if set(body) == {"error"} else None
    if not isinstance(err, dict) or set(err) != {"code", "message", "status"}:
        raise Failure(f"{status}: error body malformed: {body!r:.300}")
    if err["status"] != status or err["code"] not in ERROR_CODES.get(status, ()) or not err["message"]:
        raise Failure(f"{status}: error body disagrees: {err!r:.300}")


def _now_ticks() -> int:
    """Clock ticks since boot now (``/proc/uptime``), the unit of ``_started_ticks``."""
    return int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _started_ticks(pid: int) -> int | None:
    """When process ``pid`` of this machine started, in clock ticks since boot (``/proc/<pid>/stat`` field
    22); None when there is no such process here."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


class Http:
    """The HTTP target: a server at ``url``, and the worker pids seen answering.

    A crash is a worker that started after the fuzzing began (gunicorn replaced one that died), read
    from ``/proc`` for a server on this machine; several workers answering in turn is not one. For a
    server elsewhere a crash shows only as connection errors.

    :raises requests.RequestException: the server does not answer ``/healthz``."""
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.session = requests.Session()
        self.local = urlparse(self.url).hostname in ("127.0.0.1", "localhost", "::1")
        self.since = _now_ticks()
        self.pids = {self.health()["pid"]}

    def health(self) -> dict:
        """``/healthz`` of the server. :raises requests.RequestException, ValueError: no JSON answer within 10 s."""
        return requests.get(self.url + "/healthz", timeout=10).json()

    def send(self, data: bytes, req: dict) -> requests.Response:
        """Upload ``data`` as ``req`` says (see ``http_requests``); 60 s timeout. :raises requests.RequestException."""
        params = {} if req["topk"] is None else {"topk": req["topk"]}
        if req["how"] == "multipart" and req.get("part_name", "file") == "file":
            return self.session.post(self.url + "/api/v1/predict", params=params, timeout=60,
                                     files={"file": (req["filename"], data, "application/octet-stream")})
        if req["how"] == "multipart":  # another part name, or none: a body requests cannot make
            named = b"" if req["part_name"] is None else b'name="%s"; ' % req["part_name"].encode()
            body = (b"--fuzzXX\r\nContent-Disposition: form-data; " + named + b'filename="x.jpg"\r\n\r\n' + data
                    + b"\r\n--fuzzXX--\r\n")
            return self.session.post(self.url + "/api/v1/predict", params=params, data=body, timeout=60,
                                     headers={"Content-Type": "multipart/form-data; boundary=fuzzXX"})
        return self.session.post(self.url + "/api/v1/predict", params=params, data=data, timeout=60,
                                 headers={"Content-Type": req["content_type"]})

    def check(self, data: bytes, req: dict) -> str:
        """Upload and check the answer; return the outcome (``<status>[:<code>]``). :raises Failure: anything undocumented."""
        try:
            resp = self.send(data, req)
        except requests.RequestException as exc:
            self.session = requests.Session()
            raise Failure(f"connection error: {exc!r}") from None
        if resp.status_code not in ALLOWED_STATUSES:
            raise Failure(f"status {resp.status_code}: {resp.text[:300]}")
        try:
            body = resp.json()
        except ValueError:
            raise Failure(f"{resp.status_code}: body is not JSON: {resp.text[:200]!r}") from None
        check_body(resp.status_code, body)
        return str(resp.status_code) + ("" if resp.status_code == 200 else ":" + body["error"]["code"])

    def check_alive(self) -> None:
        """Ask ``/healthz`` which worker answers. :raises Failure: one that started after the fuzzing began (a crash)."""
        pid = self.health()["pid"]
        if pid in self.pids:
            return
        self.pids.add(pid)
        started = _started_ticks(pid) if self.local else None
        if started is not None and started > self.since:
            raise Failure(f"worker {pid} started after the fuzzing began: a worker died and was replaced (a crash)")

    def wait_ready(self, limit: float = 300) -> None:
        """Wait up to ``limit`` s for ``/healthz`` to say ready again, and take the (new) worker pid."""
        end = time.monotonic() + limit
        while time.monotonic() < end:
            try:
                h = self.health()
                if h["ready"]:
                    self.pids.add(h["pid"])
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)


def save_input(data: bytes, meta: dict) -> Path:
    """Save an input under ``$TMPDIR/webapp-fuzz/`` (and its ``meta`` as JSON next to it); return its path."""
    digest = hashlib.sha256(data).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / "webapp-fuzz"
    folder.mkdir(exist_ok=True)
    path = folder / f"{meta['target']}-{digest}.bin"
    path.write_bytes(data)
    path.with_suffix(".json").write_text(json.dumps(meta, ensure_ascii=False, indent=1))
    return path


# ---------------------------------------------------------------------------------------- the loop

class TimeUp(BaseException):
    """Ends a round when its time slice is spent (a BaseException: hypothesis neither catches nor shrinks it)."""


def run_round(target: Target, body, strategy, until: float, rng_seed: int) -> None:
    """Run hypothesis on ``body`` until the monotonic time ``until``; a failure is shrunk, then recorded."""
    target.last_failing = None

    @seed(rng_seed)
    @settings(max_examples=10**9, deadline=None, database=None, derandomize=False,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False, print_blob=False)
    @given(strategy)
    def prop(args):
        if target.last_failing is None and time.monotonic() > until:
            raise TimeUp
        body(*args)

    try:
        prop()
    except TimeUp:
        pass
    except Exception as exc:  # hypothesis re-raises the shrunk failure
        data, meta, message = target.last_failing or (b"", {"target": target.name}, f"{type(exc).__name__}: {exc}")
        key = (target.name, message.splitlines()[0][:120])
        if key not in {(f["target"], f["message"].splitlines()[0][:120]) for f in target.failures}:
            path = save_input(data, {**meta, "message": message})
            target.failures.append({"target": target.name, "message": message, "input": str(path)})
            print(f"  FAILURE [{target.name}] {message.splitlines()[0][:200]}\n    input saved: {path}", flush=True)


def make_decode_body(target: Target):
    """The hypothesis body of the decode target: check one input, tally it, remember it when it fails."""
    def body(data):
        start = time.perf_counter()
        try:
            outcome = check_decode(data)
        except Failure as exc:
            target.last_failing = (data, {"target": target.name}, str(exc))
            raise
        finally:
            target.timed(time.perf_counter() - start, data, {"target": target.name})
        target.outcomes[outcome] += 1
    return body


def make_http_body(target: Target, http: Http):
    """The hypothesis body of the HTTP target: send one input, tally it, remember it when it fails."""
    def body(data, req):
        start = time.perf_counter()
        try:
            outcome = http.check(data, req)
        except Failure as exc:
            target.last_failing = (data, {"target": target.name, **req}, str(exc))
            raise
        finally:
            target.timed(time.perf_counter() - start, data, {"target": target.name, **req})
        target.outcomes[outcome] += 1
    return body


def replay(path: Path, url: str | None) -> int:
    """Re-run one saved input (over HTTP to ``url`` if it was an HTTP one); print the outcome; 0 fine, 1 failure, 2 no URL."""
    data = path.read_bytes()
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"target": "decode"}
    try:
        if meta.get("target") == "http":
            if not url:
                print("an HTTP input: give --url of a running server")
                return 2
            print(Http(url).check(data, meta))
        else:
            print(check_decode(data))
    except Failure as exc:
        print(f"FAILURE: {exc}")
        return 1
    print("no failure")
    return 0


def main(argv=None) -> int:
    """Fuzz for ``--seconds``, print the summary; exit status 0 no failure, 1 failures, 2 the server did not start."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300, help="how long to fuzz, in all (default 300)")
    ap.add_argument("--url", help="a running server to fuzz (default: start our own)")
    ap.add_argument("--targets", default="decode,http", help="comma-separated: decode, http (default both)")
    ap.add_argument("--model", default="efficientnet_lite0", help="CLASSIFIER_MODEL of our own server")
    ap.add_argument("--seed", type=int, default=None, help="seed of the first round (default: from the clock)")
    ap.add_argument("--replay", type=Path, help="re-run one saved input and say what it gives")
    args = ap.parse_args(argv)
    if args.replay:
        return replay(args.replay, args.url)
    torch.set_num_threads(1)  # the in-process target: small tensors, and no OpenMP spinning against the server
    wanted = {t.strip() for t in args.targets.split(",") if t.strip()}
    if not wanted <= {"decode", "http"} or not wanted:
        ap.error("--targets takes decode and/or http")

    server = http = None
    targets: dict[str, Target] = {}
    if "decode" in wanted:
        targets["decode"] = Target("decode")
    if "http" in wanted:
        targets["http"] = Target("http")
        url = args.url
        if not url:
            log = Path(tempfile.mkdtemp(prefix="webapp-fuzz-server-")) / "server.log"
            print(f"starting gunicorn ({args.model}, eager, 1 worker); log: {log}", flush=True)
            server = start_ours(log, settings={"MODEL": args.model, "COMPILE": 0, "WORKERS": 1, "MAX_BATCH_SIZE": 4,
                                               "MAX_UPLOAD_BYTES": 4 * 1024 * 1024}, name="gunicorn")
            try:
                server.wait_ready(workers=1, poll=0.2)
            except (NotReady, KeyboardInterrupt) as exc:
                print(f"the server did not start: {exc}\n{server.output()[-3000:]}")
                server.stop()
                return 2
            url = server.url
        http = Http(url)

    start = time.monotonic()
    deadline = start + args.seconds
    rng_seed = args.seed if args.seed is not None else int(time.time())
    print(f"fuzzing {', '.join(targets)} for {args.seconds:.0f} s (first seed {rng_seed}); "
          f"{len(SEEDS)} seed files: {', '.join(sorted(SEEDS))}", flush=True)
    # Each 10 s: 3.5 s in-process decode (thousands of examples), 6.5 s over HTTP (tens a second).
    slices = {"decode": 3.5, "http": 6.5} if len(targets) == 2 else {name: 10.0 for name in targets}
    rounds = 0
    try:
        while time.monotonic() < deadline:
            for name, target in targets.items():
                until = min(deadline, time.monotonic() + slices[name])
                if until <= time.monotonic():
                    break
                if name == "decode":
                    run_round(target, make_decode_body(target), st.tuples(FUZZ_BYTES), until, rng_seed + rounds)
                else:
                    run_round(target, make_http_body(target, http), st.tuples(FUZZ_BYTES, http_requests()),
                              until, rng_seed + rounds)
                    try:
                        http.check_alive()
                    except (Failure, requests.RequestException) as exc:
                        target.failures.append({"target": "http", "message": str(exc), "input": "(see above)"})
                        print(f"  FAILURE [http] {exc}", flush=True)
                        http.wait_ready()
                rounds += 1
            elapsed = time.monotonic() - start
            print(f"  {elapsed:5.0f} s: " + ", ".join(f"{t.name} {t.examples}" for t in targets.values()), flush=True)
    except KeyboardInterrupt:
        print("interrupted")
    finally:
        fuzzed_s = time.monotonic() - start
        server_problems = []
        if server is not None:
            code = server.stop()
            out = server.output()
            if code != 0:
                server_problems.append(f"gunicorn exited with {code}")
            for marker in LEAK_MARKERS:
                if marker in out:
                    i = out.index(marker)
                    server_problems.append(f"server log holds {marker!r}: ...{out[max(0, i - 300):i + 300]}...")

    print("\n==== summary ====")
    print(f"fuzzed {fuzzed_s:.0f} s, {rounds} rounds")
    failed = bool(server_problems)
    for t in targets.values():
        print(f"[{t.name}] {t.examples} examples; slowest {t.slowest * 1e3:.0f} ms, {t.slow} over {SLOW_S:.0f} s")
        if t.slowest_input and t.slowest > 0.5:
            data, meta = t.slowest_input
            path = save_input(data, {**meta, "message": f"slowest example: {t.slowest:.2f} s"})
            print(f"    slowest input ({len(data)} bytes) saved: {path}")
        for outcome, n in sorted(t.outcomes.items(), key=lambda kv: -kv[1]):
            print(f"    {n:7d}  {outcome}")
        for f in t.failures:
            failed = True
            print(f"  FAILURE {f['message'][:600]}\n    input: {f['input']}")
    for p in server_problems:
        print(f"  SERVER: {p[:1200]}")
    print("FAILED" if failed else "OK: no 500, no undocumented error, no crash, no leak")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
