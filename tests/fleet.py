"""The gunicorn servers of tests/test_faults.py, and the helpers its tests use to load and watch them.

``SERVERS`` says what each server runs; ``start`` starts some of them at once (one boot of torch
per worker, overlapped on the cores), ``wait_ready`` waits for them; ``stop`` sends every one
SIGTERM at once and says what went wrong (exit codes, tracebacks). The rest: requests (``post``,
``burst``, ``multipart``, raw sockets that hang up), photos (``small_photo``, ``distinct_photos``),
and what the servers show (``healths``, ``access_lines``) or /proc shows (``alive``, ``all_accepted``).
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from PIL import Image, ImageOps
from urllib3 import encode_multipart_formdata

from conftest import SHARED_IMAGES, encode, shared_image
from serving import Server

TESTS = Path(__file__).resolve().parent

# tests/faulty_wsgi.py: a solid image of this colour kills the inference loop; /api/_test/boom raises with SECRET.
# (Never imported here: importing it builds a model.)
POISON = Image.new("RGB", (13, 17), (13, 17, 211))
SECRET = "secret internal detail 0xDEADBEEF"

# name -> (app, workers it must report ready, gunicorn args, extra env, CLASSIFIER_* settings).
# "main" runs fp32: the 500-photo test compares it with fp32 references made in the test process
# (PRECISION's default, auto, picks bf16 where the CPU has it).
# NO_TIME_LIMIT: admission by time off (a day's budget), for the servers whose tests are about something
# else and must see no 429 (webapp/admission.py would refuse their bursts, as it should in production).
NO_TIME_LIMIT = 86_400_000
SERVERS = {
    "main": ("wsgi:app", 2, [], {}, dict(MODEL="efficientnet_lite0", WORKERS=2, QUEUE_SIZE=1024, MAX_BATCH_SIZE=8,
                                         PRECISION="fp32", MAX_WAIT_MS=NO_TIME_LIMIT)),
    "queue": ("wsgi:app", 1, [], {}, dict(MODEL="resnet18_seeded", WORKERS=1, THREADS=1, QUEUE_SIZE=2,
                                          MAX_BATCH_SIZE=1)),
    "timeout": ("wsgi:app", 1, [], {}, dict(MODEL="resnet18_seeded", WORKERS=1, MAX_BATCH_SIZE=4,
                                            REQUEST_TIMEOUT_S=0.05, QUEUE_SIZE=256, MAX_WAIT_MS=NO_TIME_LIMIT,
                                            MAX_REQUEST_PIXELS=2**40)),  # no 429; 8 x 80 MP PNGs decoded, not 413
    "drain": ("wsgi:app", 2, [], {}, dict(MODEL="resnet18_seeded", WORKERS=2, MAX_BATCH_SIZE=4,
                                          MAX_WAIT_MS=NO_TIME_LIMIT)),
    "faulty": ("faulty_wsgi:app", 1, [], {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),  # gunicorn imports it
        "FLASK_DEBUG": "1", "FAULTY_SECRET": SECRET, "FAULTY_POISON_RGB": "13,17,211", "FAULTY_POISON_SIZE": "13,17"},
        dict(MODEL="efficientnet_lite0", WORKERS=1, MAX_BATCH_SIZE=4, BATCH_TIMEOUT_MS=50, REQUEST_TIMEOUT_S=120,
             MAX_WAIT_MS=NO_TIME_LIMIT)),  # its burst around the poison is about isolation: no 429
    "preload": ("wsgi:app", 2, ["--preload"], {}, dict(MODEL="efficientnet_lite0", WORKERS=2, MAX_BATCH_SIZE=2)),
}


# -- the servers -------------------------------------------------------------------------------------
def start(names, logs: Path) -> dict[str, Server]:
    """Start the servers ``names`` (eager: ``COMPILE=0``) all at once, each logging to ``logs/<name>.log``."""
    servers = {}
    for name in sorted(names):
        app, _, args, env, settings = SERVERS[name]
        servers[name] = Server(logs / f"{name}.log", app=app, args=args, env=env, COMPILE=0, **settings)
        servers[name].name = name
    return servers


def wait_ready(servers: dict[str, Server]) -> None:
    """Wait until each server reports its workers ready; ``srv.health`` is then its /healthz by worker pid."""
    for name, srv in servers.items():
        srv.health = srv.wait_ready(workers=SERVERS[name][1])


def stop(servers: dict[str, Server]) -> list[str]:
    """SIGTERM every server first (they drain in parallel), then wait for each; return the problems:
    an exit code other than 0, or a traceback in the log of any but the faulty server (it logs them on purpose)."""
    for srv in servers.values():
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGTERM)
    problems = []
    for name, srv in servers.items():
        code = finish(srv)
        out = srv.output()
        if code != 0:
            problems.append(f"{name}: exit {code}\n{out[-3000:]}")
        if name != "faulty" and "Traceback" in out:
            problems.append(f"{name}: Traceback in the log\n{out[-6000:]}")
    return problems


def finish(srv, timeout: float = 90) -> int:
    """Wait for a server already sent SIGTERM (once: a second one could land after Python restored SIG_DFL at exit)."""
    try:
        srv.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        srv.proc.wait()
    srv.log.close()
    return srv.proc.returncode


# -- requests -----------------------------------------------------------------------------------------
def multipart(files: list[tuple[str, bytes, str]]) -> tuple[bytes, str]:
    """Encode ``[(filename, data, content_type)]`` as one multipart body of ``file`` parts (done once, not per send)."""
    return encode_multipart_formdata([("file", f) for f in files])


def post(srv, body: bytes, ctype: str, *, topk: int = 3, timeout: float = 60) -> requests.Response:
    return requests.post(f"{srv.url}/api/v1/predict?topk={topk}", data=body, headers={"Content-Type": ctype},
                         timeout=timeout)


def burst(srv, body: bytes, ctype: str, n: int, timeout: float = 60) -> list[tuple[int, float, dict, dict]]:
    """``n`` requests released together; (status, client-side seconds, JSON, headers) for each."""
    gate = threading.Barrier(n)

    def one(_):
        gate.wait(30)
        t0 = time.monotonic()
        resp = post(srv, body, ctype, timeout=timeout)
        return resp.status_code, time.monotonic() - t0, resp.json(), resp.headers

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n), timeout=timeout + 30))


def raw_request(port: int, body: bytes, ctype: str) -> bytes:
    return (f"POST /api/v1/predict HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def hang_up(port: int, data: bytes, *, reset: bool = False, keep: list | None = None) -> None:
    """Connect, send ``data``, then close (FIN), reset (RST) or, with ``keep``, leave it open and silent."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    if keep is not None:
        keep.append(s)
        return
    if reset:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()


def top(answer: dict, i: int = 0) -> list[int]:
    return [p["index"] for p in answer["results"][i]["predictions"]]


# -- photos -------------------------------------------------------------------------------------------
def small_photo(size: int = 224) -> bytes:
    """dog.jpg cut to a small square: cheap to decode, so the model is the bottleneck."""
    img = Image.open(shared_image("dog.jpg")).convert("RGB")
    return encode(img.crop((60, 196, 440, 576)).resize((size, size)), "JPEG", quality=90)


def distinct_photos(n: int, seed: int = 20261130) -> dict[str, bytes]:
    """``n`` different JPEGs made from the shared photos: random crops, flips, rotations, scales and qualities."""
    rng = random.Random(seed)
    sources = []
    for path in sorted(SHARED_IMAGES.glob("*.jpg")):
        img = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
        img.thumbnail((720, 720), Image.Resampling.LANCZOS)
        sources.append((path.stem, img))
    photos: dict[str, bytes] = {}
    seen: set[bytes] = set()
    i = 0
    while len(photos) < n:
        stem, img = sources[i % len(sources)]
        i += 1
        w, h = img.size
        cw, ch = int(w * rng.uniform(0.55, 1.0)), int(h * rng.uniform(0.55, 1.0))
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        out = img.crop((x, y, x + cw, y + ch))
        tags = [f"c{x}-{y}-{cw}x{ch}"]
        if rng.random() < 0.5:
            out = ImageOps.mirror(out)
            tags.append("flip")
        angle = rng.choice([0, 0, 90, 180, 270, rng.uniform(-20, 20)])
        if angle:
            out = out.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=(127, 127, 127))
            tags.append(f"r{angle:.0f}")
        long_side = rng.randint(160, 560)
        scale = long_side / max(out.size)
        out = out.resize((max(1, round(out.width * scale)), max(1, round(out.height * scale))),
                         Image.Resampling.BILINEAR)
        data = encode(out, "JPEG", quality=rng.randint(72, 95))
        if data in seen:
            continue
        seen.add(data)
        photos[f"{len(photos):03d}-{stem}-{'-'.join(tags)}-s{long_side}.jpg"] = data
    return photos


# -- what the servers and /proc say --------------------------------------------------------------------
def healthz(srv, *, timeout: float = 30) -> dict:
    """``/healthz`` of whichever worker answers, on a connection of its own."""
    return requests.get(srv.url + "/healthz", timeout=timeout).json()


def healths(srv, pids=None, *, count: int = 2, timeout: float = 60) -> dict[int, dict]:
    """``/healthz`` by worker pid, asked 4 at a time (so every worker answers) until ``pids`` (or ``count``) did."""
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + timeout

    def one(_):
        try:
            return requests.get(srv.url + "/healthz", timeout=10).json()
        except requests.RequestException:
            return None

    with ThreadPoolExecutor(4) as pool:
        while time.monotonic() < deadline:
            for h in pool.map(one, range(4)):
                if h and "pid" in h:  # not the master's 503 while no worker is ready (webapp/responder.py)
                    seen[h["pid"]] = h
            if (set(pids) <= set(seen)) if pids is not None else len(seen) >= count:
                return seen
            time.sleep(0.05)
    raise AssertionError(f"/healthz never answered from {pids or count} workers within {timeout} s; saw {sorted(seen)}")


def access_lines(srv, path: str = "/api/v1/predict") -> list[tuple[int, int]]:
    """(status, server-side ms) of every logged request to ``path`` (gunicorn.conf.py's access format)."""
    pat = re.compile(r'"POST ' + re.escape(path) + r'[^"]*" (\d{3}) \S+ (\d+)ms')
    return [(int(m.group(1)), int(m.group(2))) for m in pat.finditer(srv.output())]


def tcp_sockets() -> list[tuple[int, int, str, int]]:
    """IPv4 TCP sockets: (local port, remote port, state, rx queue); a LISTEN socket's rx queue is its backlog."""
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        rows.append((int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16), f[3], int(f[4].split(":")[1], 16)))
    return rows


def all_accepted(port: int, clients: int) -> bool:
    """True when ``clients`` connections to ``port`` are established and none waits in the accept backlog."""
    rows = tcp_sockets()
    established = sum(1 for lp, rp, st, _ in rows if rp == port and st == "01")
    backlog = sum(rx for lp, rp, st, rx in rows if lp == port and st == "0A")
    return established >= clients and backlog == 0


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
