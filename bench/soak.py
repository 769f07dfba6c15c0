"""Soak test: mixed traffic against a real gunicorn server for minutes, watching each worker's memory.

By default it starts its own server from the repo's gunicorn.conf.py (``bench/servers.py``'s
``start_ours``; seeded ResNet-18, ``torch.compile`` on, 2 workers, ``MAX_BATCH_SIZE=8``), or it drives
a running one (``--url``; RSS is then read only where that server's workers are on this machine).

Traffic: ``--clients`` threads, each with its own keep-alive session, send back to back:

* photos of varying sizes (thumbnails to the 12 MP originals) and formats (JPEG, PNG, WebP, GIF,
  BMP, TIFF), made once at start from the shared photos (``../shared/images``);
* multipart requests of 1..8 files (and some raw-body ones), so batch sizes vary all the time;
* about 5 % bad inputs, each with the status it must get: a truncated JPEG (400), text and PDF
  bytes posing as photos (415), an empty file (400), ``topk=0`` (400), a raw ``text/plain`` body (415).

Every 200 is checked: one result per file, filenames echoed in order, ``topk`` predictions each.
RSS (``VmRSS`` of ``/proc/<pid>/status``; worker pids from ``/healthz``) is printed at start (after
``--warmup-s`` of traffic, so allocator and batch-size warm-up are not counted as growth), every
minute and at the end, then the growth per worker in MB, the request count by status and kind,
images/s, and p50/p99 latency.

Exit status 1 (after the full report) if: any 5xx other than those in ``--allow`` (none by
default; 429 is back-pressure and always allowed), a connection error, a wrong answer or a bad
input getting another status than its own, a worker replaced during the run (a crash), a
worker's RSS growing more than ``--max-growth-mb``, or (own server) a non-zero exit or a
``Traceback`` in its log. Exit status 2: the server did not start.

Usage (repo root, venv active)::

    python bench/soak.py                                  # 5 min, own server, compiled seeded ResNet-18
    python bench/soak.py --minutes 1 --no-compile         # quick trial (eager: starts in seconds)
    python bench/soak.py --model efficientnet_lite0 --workers 1 --threads 2 --set PRECISION=fp32
    python bench/soak.py --url http://127.0.0.1:8000 --minutes 30 --clients 16
    python bench/soak.py --allow 504 --set REQUEST_TIMEOUT_S=0.5   # overload on purpose: 504s expected
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests
from PIL import Image, ImageOps
from urllib3 import encode_multipart_formdata

if __package__ in (None, ""):  # run as `python bench/soak.py`: the bench package is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import IMAGES, ROOT, percentile  # noqa: E402
from bench.servers import NotReady, parse_settings, rss_mb, start_ours  # noqa: E402
from webapp import catalog  # noqa: E402

MAX_REQUEST_BYTES = 28 * 1024 * 1024  # under the default CLASSIFIER_MAX_UPLOAD_BYTES (32 MiB)


# -- inputs ----------------------------------------------------------------------------------------
@dataclass
class Photo:
    """One upload: file name, bytes, MIME type."""
    name: str
    data: bytes
    mime: str


@dataclass
class Bad:
    """A bad upload and the ``status`` it must get: multipart ``files`` (name, bytes, MIME) or a ``raw`` body."""
    kind: str
    status: int  # the status it must get
    files: list | None = None  # multipart (name, data, mime) parts, or None for a raw body
    raw: bytes = b""
    ctype: str = ""
    query: str = ""


def make_photos(images: Path, rng: random.Random) -> list[Photo]:
    """The shared photos at several sizes and in every format the service decodes."""
    sources = sorted(images.glob("*.jpg"))
    if not sources:
        sys.exit(f"no photos in {images} (the shared photos live in ../shared/images; --images says where)")
    photos = [Photo(p.name, p.read_bytes(), "image/jpeg") for p in sources]  # the originals, 12 MP included
    formats = [("JPEG", "jpg", "image/jpeg", {"quality": 88}), ("PNG", "png", "image/png", {}),
               ("WEBP", "webp", "image/webp", {"quality": 80}), ("GIF", "gif", "image/gif", {}),
               ("BMP", "bmp", "image/bmp", {}), ("TIFF", "tif", "image/tiff", {"compression": "tiff_deflate"})]
    for path in sources:
        img = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
        for long_side in (48, 160, 320, 640, 1280):
            fmt, ext, mime, opts = rng.choice(formats)
            if fmt in ("BMP", "TIFF", "GIF", "PNG") and long_side > 640:
                fmt, ext, mime, opts = formats[0]  # keep uncompressed/slow formats small
            scaled = img.copy()
            scaled.thumbnail((long_side, long_side), Image.Resampling.BILINEAR)
            if rng.random() < 0.3:
                scaled = ImageOps.mirror(scaled)
            out = scaled.convert("P") if fmt == "GIF" else scaled
            buf = io.BytesIO()
            out.save(buf, format=fmt, **opts)
            photos.append(Photo(f"{path.stem}-{long_side}.{ext}", buf.getvalue(), mime))
    return photos


def make_bad(photo: bytes) -> list[Bad]:
    """The bad inputs, built from a valid JPEG's bytes."""
    return [
        Bad("truncated-jpeg", 400, files=[("cut.jpg", photo[: len(photo) // 3], "image/jpeg")]),
        Bad("text-as-photo", 415, files=[("notes.jpg", b"hello, this is not a photo\n" * 20, "image/jpeg")]),
        Bad("pdf-as-photo", 415, files=[("doc.png", b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\n",
                                          "image/png")]),
        Bad("empty-file", 400, files=[("empty.jpg", b"", "image/jpeg")]),
        Bad("bad-topk", 400, files=[("dog.jpg", photo, "image/jpeg")], query="topk=0"),
        Bad("raw-text-body", 415, raw=b"plain text", ctype="text/plain"),
    ]


# -- the server --------------------------------------------------------------------------------------
def start_server(args):
    """Our gunicorn with the command line's settings (log under bench/results unless ``--log``), ready.

    Exits with status 2 (``SystemExit``) when it does not start.
    """
    settings = {"MODEL": args.model, "COMPILE": int(args.compile), "WORKERS": args.workers,
                "MAX_BATCH_SIZE": args.max_batch_size, "THREADS": args.threads}
    settings.update(parse_settings(args.set))
    log_path = Path(args.log) if args.log else ROOT / "bench" / "results" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting gunicorn: {settings} (log {log_path})", flush=True)
    t0 = time.monotonic()
    # control_socket=True: gunicorn's default control socket, as this command has always started it.
    server = start_ours(log_path, settings=settings, control_socket=True, name="gunicorn")
    try:
        server.wait_ready(workers=args.workers, poll=0.2)
    except (NotReady, KeyboardInterrupt) as exc:
        print(f"the server did not start: {exc}", file=sys.stderr)
        server.stop()
        sys.exit(2)
    print(f"ready in {time.monotonic() - t0:.0f} s", flush=True)
    return server


def worker_health(url: str, want: int, timeout: float = 60) -> dict[int, dict]:
    """``/healthz`` of each worker, by pid: asked several at a time until ``want`` pids answered (or ``timeout``)."""
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + timeout

    def one(_):
        try:
            return requests.get(url + "/healthz", timeout=30).json()
        except (requests.RequestException, ValueError):
            return None

    with ThreadPoolExecutor(6) as pool:
        while time.monotonic() < deadline:
            for h in pool.map(one, range(6)):
                if h and "pid" in h:
                    seen[h["pid"]] = h
            if len(seen) >= want:
                break
            time.sleep(0.1)
    return seen


# -- traffic -----------------------------------------------------------------------------------------
class Stats:
    """Requests by status and kind, latencies (s) of 200s and of all, images answered, failures; thread-safe."""
    def __init__(self):
        self.lock = threading.Lock()
        self.by_status: Counter = Counter()
        self.by_kind: dict[str, Counter] = defaultdict(Counter)
        self.latency_ok: list[float] = []
        self.latency_all: list[float] = []
        self.images = 0
        self.failures: list[str] = []

    def add(self, kind: str, status: int | str, secs: float, images: int = 0, failure: str | None = None):
        """Record one request that took ``secs`` s (and answered ``images`` images when a 200)."""
        with self.lock:
            self.by_status[status] += 1
            self.by_kind[kind][status] += 1
            self.latency_all.append(secs)
            if status == 200:
                self.latency_ok.append(secs)
                self.images += images
            if failure and len(self.failures) < 1000:
                self.failures.append(failure)

    def snapshot(self):
        """(requests by status, latencies of the 200s so far in s, images so far), copied."""
        with self.lock:
            return Counter(self.by_status), list(self.latency_ok), self.images


def client(url: str, photos: list[Photo], bad: list[Bad], stats: Stats, stop: threading.Event, seed: int,
           allow: set[int]) -> None:
    """Send requests back to back until ``stop``; an error in this loop itself is a failure, not a silent exit."""
    rng = random.Random(seed)
    session = requests.Session()
    while not stop.is_set():
        try:
            session = one_request(url, photos, bad, stats, rng, session, allow)
        except Exception as exc:  # a bug here, or an answer of an unexpected shape
            stats.add("client", "client-error", 0.0, failure=f"client: {exc!r}"[:300])
            session = requests.Session()


def one_request(url: str, photos: list[Photo], bad: list[Bad], stats: Stats, rng: random.Random,
                session: requests.Session, allow: set[int]) -> requests.Session:
    """One request of a random kind; records it in ``stats``; returns the session to use next."""
    roll = rng.random()
    topk = rng.randint(1, 5)
    query = f"topk={topk}"
    if roll < 0.05:  # a bad input
        b = rng.choice(bad)
        kind, expect, n_files, names = f"bad:{b.kind}", b.status, 0, []
        query = b.query or query
        if b.files is None:
            body, ctype = b.raw, b.ctype
        else:
            body, ctype = encode_multipart_formdata([("file", f) for f in b.files])
    elif roll < 0.15:  # a raw body: one photo
        p = rng.choice(photos)
        kind, expect, n_files, names = "raw", 200, 1, [p.name]
        body, ctype = p.data, p.mime
    else:  # multipart, 1..8 files
        n_files = rng.randint(1, 8)
        chosen, size = [], 0
        for p in rng.sample(photos, n_files):
            if size + len(p.data) > MAX_REQUEST_BYTES:
                continue
            chosen.append(p)
            size += len(p.data)
        n_files = len(chosen)
        names = [f"{i}-{p.name}" for i, p in enumerate(chosen)]
        kind, expect = f"files:{n_files}", 200
        body, ctype = encode_multipart_formdata([("file", (n, p.data, p.mime)) for n, p in zip(names, chosen)])
    headers = {"Content-Type": ctype, "X-Filename": names[0] if kind == "raw" else "upload"}
    t0 = time.monotonic()
    try:
        resp = session.post(f"{url}/api/v1/predict?{query}", data=body, headers=headers, timeout=120)
    except requests.RequestException as exc:
        stats.add(kind, "connection-error", time.monotonic() - t0, failure=f"{kind}: {exc!r}"[:300])
        return requests.Session()
    secs = time.monotonic() - t0
    status = resp.status_code
    failure = None
    try:
        answer = resp.json()
    except ValueError:
        answer = None
        failure = f"{kind}: {status} not JSON: {resp.text[:200]!r}"
    if failure is None:
        if status == 200 and expect == 200:
            results = answer.get("results", [])
            if [r.get("filename") for r in results] != names:
                failure = f"{kind}: filenames {[r.get('filename') for r in results]} != {names}"
            elif any(len(r.get("predictions", [])) != topk for r in results):
                failure = f"{kind}: not {topk} predictions each"
        elif status == 429:
            pass  # back-pressure: the queue was full
        elif status >= 500:
            if status not in allow:
                failure = f"{kind}: {status} {answer.get('error')}"
        elif status != expect:
            failure = f"{kind}: got {status}, expected {expect}: {answer.get('error')}"
    stats.add(kind, status, secs, images=n_files if status == 200 else 0, failure=failure)
    return session


# -- the run -----------------------------------------------------------------------------------------
def kind_order(kind: str):
    """Sort key of request kinds: by kind, then ``files:N`` by N."""
    return kind.split(":")[0], int(kind.split(":")[1]) if kind.startswith("files:") else 0, kind


def fmt_rss(pids: list[int], prefix: str) -> tuple[str, dict[int, float | None]]:
    """A line of each pid's RSS, and the values in MB (None: not on this machine, or gone)."""
    values = {pid: rss_mb(pid) for pid in pids}
    cells = ", ".join(f"{pid}: {'n/a' if v is None else f'{v:.0f} MB'}" for pid, v in values.items())
    return f"{prefix} RSS {cells}", values


def main(argv: list[str] | None = None) -> int:
    """The soak run and its report; exit status 0 fine, 1 failures, 2 the server did not start."""
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--minutes", type=float, default=5.0, help="traffic duration after the warm-up")
    parser.add_argument("--warmup-s", type=float, default=15.0, help="traffic before the start RSS sample")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--max-growth-mb", type=float, default=200.0, help="most RSS growth allowed per worker")
    parser.add_argument("--allow", default="", help="comma-separated 5xx statuses that are expected (e.g. 504)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", default=str(IMAGES), help="folder of source photos (*.jpg)")
    own = parser.add_argument_group("own server (ignored with --url)")
    own.add_argument("--model", default="resnet18_seeded",
                     choices=catalog.NAMES)
    own.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the model")
    own.add_argument("--workers", type=int, default=2)
    own.add_argument("--threads", type=int, default=0, help="intra-op threads per worker (0: from the cores)")
    own.add_argument("--max-batch-size", type=int, default=8)
    own.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                     help="any other CLASSIFIER_* setting, e.g. --set QUEUE_SIZE=128 (repeatable)")
    own.add_argument("--log", help="server log path (default bench/results/soak-<time>.log)")
    args = parser.parse_args(argv)
    allow = {int(s) for s in args.allow.split(",") if s.strip()}

    rng = random.Random(args.seed)
    photos = make_photos(Path(args.images), rng)
    dog = Path(args.images) / "dog.jpg"
    bad = make_bad(dog.read_bytes() if dog.is_file() else photos[0].data)
    print(f"{len(photos)} photos ({sum(len(p.data) for p in photos) / 1e6:.0f} MB), {len(bad)} bad inputs, "
          f"{args.clients} clients, {args.minutes:g} min after {args.warmup_s:g} s warm-up", flush=True)

    server = None if args.url else start_server(args)
    url = args.url or server.url
    want = args.workers if server else 1
    health = worker_health(url, want)
    if args.url:  # learn how many workers a running server has: ask a while longer
        health = worker_health(url, 99, timeout=5) or health
    if not health:
        print(f"{url}/healthz does not answer", file=sys.stderr)
        return 2
    first = next(iter(health.values()))
    print(f"server {url}: {len(health)} workers, model {first['model'].get('name')} "
          f"({first.get('precision')}, compiled={first['model'].get('compiled')}), "
          f"max batch {first.get('max_batch_size')}, cores {[h['cores'] for h in health.values()]}", flush=True)
    pids = sorted(health)

    stats = Stats()
    stop = threading.Event()
    threads = [threading.Thread(target=client, args=(url, photos, bad, stats, stop, args.seed * 1000 + i, allow),
                                daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(args.warmup_s)
    warm_status, warm_lat, warm_images = stats.snapshot()
    line, rss_start = fmt_rss(pids, "[start]")
    print(f"{line}   (after warm-up: {sum(warm_status.values())} requests, {warm_images} images)", flush=True)
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    last_n, last_ok, last_images, last_t = sum(warm_status.values()), len(warm_lat), warm_images, t0
    for minute in range(1, int(args.minutes) + 1):  # a line at every full minute (the last one included)
        time.sleep(max(0.0, t0 + 60 * minute - time.monotonic()))
        status, lat, images = stats.snapshot()
        n, now = sum(status.values()), time.monotonic()
        recent = lat[last_ok:]
        line, _ = fmt_rss(pids, f"[{minute:3d} min]")
        print(f"{line}   {n - last_n} requests, {(images - last_images) / (now - last_t):.1f} images/s, "
              f"p50 {percentile(recent, 50) * 1e3:.0f} ms, p99 {percentile(recent, 99) * 1e3:.0f} ms", flush=True)
        last_n, last_ok, last_images, last_t = n, len(lat), images, now
    time.sleep(max(0.0, end - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(150)
    elapsed = time.monotonic() - t0
    line, rss_end = fmt_rss(pids, "[end]")
    print(line, flush=True)
    after = worker_health(url, len(pids), timeout=30)

    failures = list(stats.failures)
    status, lat, images = stats.snapshot()
    total_images = images - warm_images
    print("\n== requests by status (whole run, warm-up included) ==")
    for s, c in sorted(status.items(), key=lambda kv: str(kv[0])):
        print(f"  {s}: {c}")
    print("== requests by kind (whole run) ==")
    for kind in sorted(stats.by_kind, key=kind_order):
        print(f"  {kind:22s} " + ", ".join(f"{s}: {c}" for s, c in sorted(stats.by_kind[kind].items(), key=str)))
    n_after = sum(status.values()) - sum(warm_status.values())
    print(f"== throughput after warm-up: {total_images / elapsed:.1f} images/s, {n_after / elapsed:.1f} requests/s "
          f"over {elapsed:.0f} s")
    ok = lat[len(warm_lat):]
    every = stats.latency_all[sum(warm_status.values()):]
    print(f"== latency after warm-up: 200s p50 {percentile(ok, 50) * 1e3:.0f} ms, "
          f"p99 {percentile(ok, 99) * 1e3:.0f} ms; all requests p50 {percentile(every, 50) * 1e3:.0f} ms, "
          f"p99 {percentile(every, 99) * 1e3:.0f} ms")
    print("== RSS growth per worker (end - start) ==")
    for pid in pids:
        a, b = rss_start.get(pid), rss_end.get(pid)
        if a is None or b is None:
            print(f"  {pid}: n/a (not on this machine, or gone)")
            continue
        growth = b - a
        print(f"  {pid}: {a:.0f} -> {b:.0f} MB: {growth:+.0f} MB (limit {args.max_growth_mb:g})")
        if growth > args.max_growth_mb:
            failures.append(f"rss: worker {pid} grew {growth:.0f} MB > {args.max_growth_mb:g} MB")
    gone = set(pids) - set(after)
    if gone or len(after) != len(pids):
        failures.append(f"workers: changed during the run, {pids} -> {sorted(after)} (a crash or restart)")
    if after:
        print(f"== batches per worker: " + ", ".join(f"{p}: {h.get('batches')} batches / {h.get('images')} images"
                                                   for p, h in sorted(after.items())))

    if server is not None:
        code = server.stop()
        out = server.output()
        print(f"== server exited {code} (log {server.log_path})")
        if code != 0:
            failures.append(f"server: exited {code}")
        if "Traceback" in out:
            i = out.index("Traceback")
            failures.append(f"server-log: a Traceback\n{out[max(0, i - 300):i + 2000]}")

    if failures:
        counts = Counter(f.split(":")[0] for f in failures)
        print(f"\nFAILED: {len(failures)} problem(s) {dict(counts)}; first ones:")
        for f in failures[:15]:
            print("  " + f)
        return 1
    print("\nOK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
