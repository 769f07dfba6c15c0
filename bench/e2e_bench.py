"""End to end: our server vs the seed-style baseline under the same closed-loop HTTP load.

Ours: the real gunicorn (``gunicorn.conf.py``: gevent workers pinned to their cores, batching,
``torch.compile``, default precision ``auto`` and CPU plan) with ``CLASSIFIER_MODEL=resnet18_seeded``.
Baseline: ``bench/baseline_app.py`` (gunicorn sync workers, one per core, Pillow full decode,
torchvision transforms, eager fp32 ResNet-18 with the same seeded weights, 1 thread per worker).

Both start on free localhost ports and run side by side but are never loaded at once: for each
concurrency level the two take turns (which goes first alternates per level), so drifting load
from other processes on this shared machine hits both. Load: N client threads in this process,
each uploading the same photo (read once, multipart body built once) back-to-back over its own
keep-alive connection (``http.client``; the sync baseline closes after each answer, so its clients
reconnect) for a warm-up, then a timed window. Only answers that complete inside the window
count. CPU use of this client process, of the server under test and of the whole machine is
read over the window (``getrusage``, ``/proc``), so it shows how much the load generator and the
neighbours took.

Ray Serve (``ray``, when Ray is installed): ``python -m webapp serve --cluster`` on a local Ray
with the same settings as ours and as many model replicas (1 CPU each by default) as ours has
workers, under the same load in the same turns: what the Ray path costs on one box (its
proxy, HTTP replica and object store hop), as a ratio to ours.

Targets: (a) at saturation ours serves >= 8x the baseline's images/s (peak vs peak);
(b) our p99 at half load (half the lowest concurrency that reaches 95% of our peak) is <= 1.5x
our unloaded p50 (concurrency 1). A half-load level not in the sweep is measured after it.

    python bench/e2e_bench.py [--quick] [--json out.json] [--levels 1 2 4 8 16] [--seconds 20]
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import PHOTO_12MP, ROOT, log, main, median, num, percentile, photo, ratio, table

READY_TIMEOUT_S = 900
TARGET_THROUGHPUT_X = 8.0
TARGET_P99_X = 1.5
SATURATION_FRACTION = 0.95
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- servers -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (gunicorn: its workers; a local Ray: GCS, raylet, replicas...)."""
    out, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _proc_ticks(pid: int) -> int:
    """utime + stime of one process (all its threads), in clock ticks; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot (``/proc/stat``; steal counts as busy)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals[:8]) - idle, sum(vals[:8])


def http_get_json(port: int, path: str, timeout: float = 3.0) -> tuple[int, dict | None]:
    """GET on a fresh connection (so successive calls can land on different workers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        body = resp.read()
        try:
            return resp.status, json.loads(body)
        except ValueError:
            return resp.status, None
    finally:
        conn.close()


class Gunicorn:
    """A gunicorn master started as a subprocess (log to a file); ``wait_ready`` polls ``/healthz``."""

    def __init__(self, name: str, argv: list[str], *, env: dict, port: int, log_path: Path):
        self.name, self.port, self.log_path = name, port, Path(log_path)
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(self.log_path, "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.ready_at: dict[int, float] = {}  # worker pid -> seconds from start until first seen ready
        self.health: dict[int, dict] = {}

    def tail(self, chars: int = 3000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, workers: int, timeout: float = READY_TIMEOUT_S, poll: float = 0.1) -> dict[int, dict]:
        """Poll ``/healthz`` until ``workers`` distinct worker pids said ready; return their health by pid.

        :raises RuntimeError: the server exited, or not all workers were ready within ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: gunicorn exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                status, health = http_get_json(self.port, "/healthz")
                if status == 200 and health and health.get("ready"):
                    pid = health["pid"]
                    self.ready_at.setdefault(pid, time.monotonic() - self.started)
                    self.health[pid] = health
                    if len(self.health) >= workers:
                        return self.health
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(poll)
        raise RuntimeError(f"{self.name}: {len(self.health)}/{workers} workers ready after {timeout:g} s:\n"
                           f"{self.tail()}")

    def worker_pids(self) -> list[int]:
        return _descendants(self.proc.pid)

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM the master, wait (SIGKILL after ``timeout`` s); return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def log_problems(self) -> list[str]:
        """Lines of the log that look wrong (tracebacks, criticals, worker timeouts)."""
        text = self.log_path.read_text(errors="replace")
        keys = ("Traceback", "[CRITICAL]", "WORKER TIMEOUT", "Worker (pid", "[ERROR]")
        return [line for line in text.splitlines() if any(k in line for k in keys)]


def ours_workers(settings: dict) -> int:
    """How many workers our gunicorn.conf.py will start with these settings (webapp/cpu.py's plan)."""
    from webapp import cpu

    return cpu.plan(cpu.usable_cores(), workers=int(settings.get("WORKERS", 0) or 0),
                    threads=int(settings.get("THREADS", 0) or 0)).workers


def start_ours(log_path: Path, *, settings: dict | None = None, env: dict | None = None,
               args: tuple[str, ...] = ()) -> Gunicorn:
    """Our real server (``gunicorn -c gunicorn.conf.py wsgi:app``) with ``CLASSIFIER_*`` settings, on a free port.

    ``CLASSIFIER_*`` variables of this process are dropped (only ``settings`` count); ``env`` adds
    others (``LD_PRELOAD``, ``TORCHINDUCTOR_CACHE_DIR``...).
    """
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("CLASSIFIER_")}
    full = {**base, **(env or {}), **{f"CLASSIFIER_{k}": str(v) for k, v in (settings or {}).items()}}
    full["CLASSIFIER_BIND"] = f"127.0.0.1:{port}"
    # --no-control-socket: gunicorn's default control socket is one path per user, and several
    # gunicorns (ours, the baseline, other people's tests) run at once on this machine.
    argv = [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--no-control-socket", *args, "wsgi:app"]
    return Gunicorn("ours", argv, env=full, port=port, log_path=log_path)


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("a2wsgi") is not None


def start_ray(log_path: Path, *, settings: dict, replicas: int, threads: int) -> Gunicorn:
    """``python -m webapp serve --cluster`` (a local Ray: no ``RAY_ADDRESS``) with ours' settings, on a free port.

    ``replicas`` model replicas of ``threads`` intra-op threads each (as many CPUs reserved).
    Ready once ``/healthz`` has shown every replica ready (its ``pid`` is the replica's).
    """
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CLASSIFIER_", "RAY_ADDRESS"))}
    values = {**settings, "CLUSTER_REPLICAS": replicas, "THREADS": threads, "BIND": f"127.0.0.1:{port}"}
    env = {**base, **{f"CLASSIFIER_{k}": str(v) for k, v in values.items()}}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return Gunicorn("ray", [sys.executable, "-m", "webapp", "serve", "--cluster"], env=env, port=port,
                    log_path=log_path)


def start_baseline(log_path: Path, *, workers: int = 0, env: dict | None = None) -> Gunicorn:
    """The seed-style baseline (``bench/baseline_app.py``), on a free port."""
    from bench import baseline_app

    port = free_port()
    argv, extra = baseline_app.command(port, workers=workers)
    base = {k: v for k, v in os.environ.items() if not k.startswith("CLASSIFIER_")}
    return Gunicorn("baseline", argv, env={**base, **(env or {}), **extra}, port=port, log_path=log_path)


# -- load ----------------------------------------------------------------------------------------

def multipart_body(data: bytes, filename: str) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body with one ``file`` part; returns (body, content type)."""
    boundary = "bench" + uuid.uuid4().hex
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            f"Content-Type: image/jpeg\r\n\r\n").encode()
    return head + data + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@dataclass
class Sample:
    start: float
    end: float
    status: int  # HTTP status; -1 for a connection error
    batch_size: int | None = None
    timing: dict | None = None


@dataclass
class Load:
    """One closed-loop run's raw results."""

    concurrency: int
    window_s: float
    samples: list[Sample] = field(default_factory=list)
    cpu: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)


def _post(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict, errs: dict,
          lock: threading.Lock) -> tuple[int, int | None, dict | None]:
    """One upload on ``conn``: (status or -1 connection error / -2 bad JSON, batch_size, timing_ms)."""
    status, bs, timing = -1, None, None
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        status = resp.status
        if resp.will_close:
            conn.close()  # http.client reopens on the next request
        if status == 200:
            try:
                r = json.loads(raw)
                bs = r["results"][0].get("batch_size")
                timing = r.get("timing_ms")
            except (ValueError, KeyError, IndexError, TypeError):
                status = -2  # a 200 that is not the documented JSON
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        with lock:
            errs[type(exc).__name__] = errs.get(type(exc).__name__, 0) + 1
        time.sleep(0.05)  # a refused connection must not become a busy loop
    return status, bs, timing


def _closed_client(port: int, path: str, body: bytes, headers: dict, stop_at: float, out: list, errs: dict,
                   lock: threading.Lock, go: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    go.wait()
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            status, bs, timing = _post(conn, path, body, headers, errs, lock)
            out.append(Sample(t0, time.perf_counter(), status, bs, timing))
    finally:
        conn.close()


def _open_client(port: int, path: str, body: bytes, headers: dict, jobs, out: list, errs: dict,
                 lock: threading.Lock) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        while (due := jobs.get()) is not None:
            status, bs, timing = _post(conn, path, body, headers, errs, lock)
            out.append(Sample(due, time.perf_counter(), status, bs, timing))  # from the arrival: no coordinated omission
    finally:
        conn.close()


def _cpu_window(t_window: float, t_stop: float, server_pids: list[int]) -> dict:
    """Sleep through [t_window, t_stop]; CPU of this process, of ``server_pids`` and of the machine over it."""
    def snap():
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return (time.perf_counter(), ru.ru_utime + ru.ru_stime, [_proc_ticks(p) for p in server_pids],
                _machine_ticks())

    time.sleep(max(0.0, t_window - time.perf_counter()))
    a = snap()
    time.sleep(max(0.0, t_stop - time.perf_counter()))
    b = snap()
    wall = b[0] - a[0]
    busy, total = b[3][0] - a[3][0], b[3][1] - a[3][1]
    ncpu = os.cpu_count() or 1
    per_pid = [100 * (y - x) / CLK_TCK / wall for x, y in zip(a[2], b[2])]
    cpu = {
        "client_pct_core": 100 * (b[1] - a[1]) / wall,
        "server_pct_core": sum(per_pid),
        "server_pct_core_by_process": {str(p): v for p, v in zip(server_pids, per_pid)},
        "machine_pct_core": 100 * ncpu * busy / total if total else float("nan"),
        "cores": ncpu,
    }
    cpu["others_pct_core"] = cpu["machine_pct_core"] - cpu["client_pct_core"] - cpu["server_pct_core"]
    return cpu


def run_load(port: int, body: bytes, content_type: str, *, concurrency: int, warmup: float, seconds: float,
             server_pids: list[int], path: str = "/api/v1/predict") -> Load:
    """Closed loop: ``concurrency`` clients upload ``body`` back-to-back for ``warmup`` + ``seconds``.

    Answers completing inside the window count. CPU over the window: this process (the
    clients), ``server_pids`` (master + workers) and the whole machine, in % of one core.
    """
    headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
    samples: list[Sample] = []
    errs: dict = {}
    lock, go = threading.Lock(), threading.Event()
    t_start = time.perf_counter() + 0.2
    t_window, t_stop = t_start + warmup, t_start + warmup + seconds
    threads = [threading.Thread(target=_closed_client, daemon=True,
                                args=(port, path, body, headers, t_stop, samples, errs, lock, go))
               for _ in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, t_start - time.perf_counter()))
    go.set()
    cpu = _cpu_window(t_window, t_stop, server_pids)
    for t in threads:
        t.join()
    inside = [s for s in samples if t_window <= s.end <= t_stop]
    return Load(concurrency=concurrency, window_s=t_stop - t_window, samples=inside, cpu=cpu, errors=errs)


def run_open_loop(port: int, body: bytes, content_type: str, *, rate: float, warmup: float, seconds: float,
                  server_pids: list[int], clients: int = 32, seed: int = 0,
                  path: str = "/api/v1/predict") -> Load:
    """Open loop: uploads arrive as a Poisson process of ``rate``/s, whatever the answers do.

    Up to ``clients`` connections carry them; latency runs from each arrival (time spent
    waiting for a free connection included). Requests arriving inside the window count.
    """
    import queue
    import random

    headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
    samples: list[Sample] = []
    errs: dict = {}
    lock, jobs = threading.Lock(), queue.SimpleQueue()
    rng = random.Random(seed)
    t_start = time.perf_counter() + 0.2
    t_window, t_stop = t_start + warmup, t_start + warmup + seconds
    arrivals, t = [], t_start
    while (t := t + rng.expovariate(rate)) < t_stop:
        arrivals.append(t)
    threads = [threading.Thread(target=_open_client, args=(port, path, body, headers, jobs, samples, errs, lock),
                                daemon=True) for _ in range(clients)]
    for th in threads:
        th.start()

    def dispatch():
        for due in arrivals:
            time.sleep(max(0.0, due - time.perf_counter()))
            jobs.put(due)
        for _ in threads:
            jobs.put(None)

    feeder = threading.Thread(target=dispatch, daemon=True)
    feeder.start()
    cpu = _cpu_window(t_window, t_stop, server_pids)
    feeder.join()
    for th in threads:
        th.join()
    inside = [s for s in samples if t_window <= s.start < t_stop]
    return Load(concurrency=0, window_s=t_stop - t_window, samples=inside, cpu=cpu, errors=errs)


def summarize(load: Load) -> dict:
    """images/s, latency percentiles (ms, successful answers), errors, server timing, CPU."""
    ok = [s for s in load.samples if s.status == 200]
    lat = [(s.end - s.start) * 1e3 for s in ok]
    bad: dict[str, int] = {}
    for s in load.samples:
        if s.status != 200:
            key = {-1: "conn", -2: "bad_json"}.get(s.status, str(s.status))
            bad[key] = bad.get(key, 0) + 1
    server_cpu_s = load.cpu["server_pct_core"] / 100 * load.window_s
    out = {
        "concurrency": load.concurrency,
        "window_s": load.window_s,
        "answers": len(ok),
        "images_per_s": len(ok) / load.window_s,
        "p50_ms": percentile(lat, 50),
        "p95_ms": percentile(lat, 95),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat) if lat else float("nan"),
        "errors": sum(bad.values()),
        "errors_by_kind": {**bad, **{f"exc:{k}": v for k, v in load.errors.items()}},
        "cpu": load.cpu,
        # Noise-robust: the server's CPU time per answer, and the images/s that would give on all cores.
        "server_cpu_ms_per_image": 1e3 * server_cpu_s / len(ok) if ok else float("nan"),
    }
    out["capacity_images_per_s"] = ratio(1e3 * (load.cpu.get("cores") or 1), out["server_cpu_ms_per_image"])
    shares = sorted(load.cpu["server_pct_core_by_process"].values(), reverse=True)
    if load.cpu["server_pct_core"] > 0:  # the busiest processes' share of the server's CPU (workers first)
        out["cpu_split_pct"] = [100 * v / load.cpu["server_pct_core"] for v in shares if v > 0.5]
    sizes = [s.batch_size for s in ok if s.batch_size]
    if sizes:
        out["mean_batch_size"] = sum(sizes) / len(sizes)
    timings = [s.timing for s in ok if s.timing]
    if timings:
        out["server_ms_median"] = {k: median([t[k] for t in timings if k in t]) for k in timings[0]}
    return out


# -- the benchmark -------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="levels 1 and 8, short windows (a smoke run)")
    parser.add_argument("--levels", type=int, nargs="+", help="concurrency levels (default 1 2 4 8 16; --quick 1 8)")
    parser.add_argument("--seconds", type=float, default=0, help="timed window per run (0: 12, --quick 6)")
    parser.add_argument("--warmup", type=float, default=0, help="untimed seconds before each window (0: 3, --quick 2)")
    parser.add_argument("--photo", default=PHOTO_12MP, help="photo to upload (name in ../shared/images, or a path)")
    parser.add_argument("--model", default="resnet18_seeded", help="CLASSIFIER_MODEL of our server")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                        help="another CLASSIFIER_ setting of our server, e.g. --set PRECISION=fp32 (repeatable)")
    parser.add_argument("--baseline-workers", type=int, default=0, help="baseline sync workers (0: one per core)")
    parser.add_argument("--servers", nargs="+", choices=("baseline", "ours", "ray"), default=None,
                        help="which servers to measure (default: baseline ours, and ray where Ray is installed)")
    parser.add_argument("--no-open-loop", action="store_true",
                        help="skip the extra open-loop run of ours at half its peak rate (Poisson arrivals)")
    parser.add_argument("--log-dir", help="where the servers' logs go (default: a new temp dir)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def parse_settings(pairs: list[str]) -> dict:
    out = {}
    for p in pairs:
        name, sep, value = p.partition("=")
        if not sep:
            raise SystemExit(f"--set {p!r}: expected NAME=VALUE")
        out[name.removeprefix("CLASSIFIER_")] = value
    return out


def saturation(rows: dict[int, dict], levels: list[int]) -> tuple[int, float]:
    """(lowest of ``levels`` reaching SATURATION_FRACTION of their peak images/s, that peak images/s)."""
    swept = {c: r for c, r in rows.items() if c in levels}
    peak = max(r["images_per_s"] for r in swept.values())
    level = min(c for c, r in swept.items() if r["images_per_s"] >= SATURATION_FRACTION * peak)
    return level, peak


def run(args) -> dict:
    levels = sorted(set(args.levels or ([1, 8] if args.quick else [1, 2, 4, 8, 16])))
    seconds = args.seconds or (6.0 if args.quick else 12.0)
    warmup = args.warmup or (2.0 if args.quick else 3.0)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="e2e_bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    path = photo(args.photo)
    body, ctype = multipart_body(path.read_bytes(), path.name)
    ours_settings = {"MODEL": args.model, **parse_settings(args.settings)}
    log(f"e2e_bench: {path.name} ({len(body) / 1e6:.2f} MB body), levels {levels}, {warmup:g} s warm-up + "
        f"{seconds:g} s per run, logs in {log_dir}")

    if args.servers is None:
        args.servers = ["baseline", "ours"] + (["ray"] if ray_available() else [])
    servers: dict[str, Gunicorn] = {}
    result: dict = {"photo": path.name, "body_bytes": len(body), "levels": levels, "seconds": seconds,
                    "warmup_s": warmup, "cores": os.cpu_count(), "servers": {}, "log_dir": str(log_dir)}
    try:
        # Started one after the other: their start-ups must not compete for the cores either.
        if "ours" in args.servers:
            workers = ours_workers(ours_settings)
            log(f"starting ours ({ours_settings}, {workers} workers; compiles at start)...")
            servers["ours"] = start_ours(log_dir / "ours.log", settings=ours_settings)
            health = servers["ours"].wait_ready(workers)
            h = next(iter(health.values()))
            result["servers"]["ours"] = {
                "workers": len(health), "ready_s": max(servers["ours"].ready_at.values()),
                "model": h["model"]["name"], "precision": h["precision"], "compiled": h["model"].get("compiled"),
                "intra_op_threads": h["intra_op_threads"], "cores": {str(p): x["cores"] for p, x in health.items()},
                "max_batch_size": h["max_batch_size"], "startup_s": {str(p): x["startup_s"] for p, x in health.items()},
            }
            log(f"ours ready in {result['servers']['ours']['ready_s']:.1f} s: {result['servers']['ours']}")
        if "baseline" in args.servers:
            from bench import baseline_app

            workers = baseline_app.default_workers(args.baseline_workers)
            log(f"starting baseline ({workers} sync workers)...")
            servers["baseline"] = start_baseline(log_dir / "baseline.log", workers=workers)
            servers["baseline"].wait_ready(workers)
            result["servers"]["baseline"] = {"workers": workers, "ready_s": max(servers["baseline"].ready_at.values()),
                                             "model": "resnet18_seeded", "precision": "fp32", "compiled": False,
                                             "intra_op_threads": 1}
            log(f"baseline ready in {result['servers']['baseline']['ready_s']:.1f} s")
        if "ray" in args.servers:
            from webapp import cpu

            plan = cpu.plan(cpu.usable_cores(), workers=int(ours_settings.get("WORKERS", 0) or 0),
                            threads=int(ours_settings.get("THREADS", 0) or 0))
            log(f"starting ray ({ours_settings}, {plan.workers} replicas x {plan.threads} CPU; compiles at start)...")
            servers["ray"] = start_ray(log_dir / "ray.log", settings=ours_settings, replicas=plan.workers,
                                       threads=plan.threads)
            health = servers["ray"].wait_ready(plan.workers)
            h = next(iter(health.values()))
            result["servers"]["ray"] = {
                "workers": len(health), "ready_s": max(servers["ray"].ready_at.values()), "model": h["model"]["name"],
                "precision": h["precision"], "compiled": h["model"].get("compiled"),
                "intra_op_threads": h["intra_op_threads"], "max_batch_size": h["max_batch_size"],
            }
            log(f"ray ready in {result['servers']['ray']['ready_s']:.1f} s: {result['servers']['ray']}")
        for name, srv in servers.items():  # one answer each: the API shape, and the top-1 for the record
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
            conn.request("POST", "/api/v1/predict", body=body, headers={"Content-Type": ctype})
            resp = conn.getresponse()
            answer = json.loads(resp.read())
            conn.close()
            if resp.status != 200:
                raise RuntimeError(f"{name}: smoke request answered {resp.status}: {answer}")
            top = answer["results"][0]["predictions"][0]
            result["servers"][name]["top1"] = {"index": top["index"], "label": top["label"]}

        rows: dict[str, dict[int, dict]] = {n: {} for n in servers}

        def measure(name: str, c: int) -> None:
            srv = servers[name]
            pids = [srv.proc.pid, *srv.worker_pids()]
            load = run_load(srv.port, body, ctype, concurrency=c, warmup=warmup, seconds=seconds, server_pids=pids)
            rows[name][c] = summarize(load)
            r = rows[name][c]
            log(f"  {name:8s} c={c:<3d} {r['images_per_s']:7.2f} img/s  p50 {r['p50_ms']:7.1f}  "
                f"p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}  client {r['cpu']['client_pct_core']:.0f}%  "
                f"server {r['cpu']['server_pct_core']:.0f}%  others {r['cpu']['others_pct_core']:.0f}% of a core")
            time.sleep(0.5)

        for i, c in enumerate(levels):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in order:
                measure(name, c)
        if "ours" in rows:
            sat, _ = saturation(rows["ours"], levels)
            half = max(1, sat // 2)
            if half not in rows["ours"]:
                log(f"ours saturates at c={sat}: measuring half load c={half}")
                measure("ours", half)
            if not args.no_open_loop:  # half load as half the utilization: arrivals at half the peak rate
                _, peak = saturation(rows["ours"], levels)
                srv = servers["ours"]
                o = summarize(run_open_loop(srv.port, body, ctype, rate=peak / 2, warmup=warmup, seconds=seconds,
                                            server_pids=[srv.proc.pid, *srv.worker_pids()]))
                o["rate_per_s"] = peak / 2
                result["servers"]["ours"]["open_loop_half"] = o
                log(f"  ours     open loop {peak / 2:.2f}/s: {o['images_per_s']:.2f} img/s  p50 {o['p50_ms']:.1f}  "
                    f"p99 {o['p99_ms']:.1f} ms  errors {o['errors']}")
    finally:
        for name, srv in servers.items():
            code = srv.stop()
            result["servers"].setdefault(name, {})["exit_code"] = code
            result["servers"][name]["log_problems"] = srv.log_problems()[:20]
            log(f"{name} stopped (exit {code}); log {srv.log_path}")
    for name in rows:
        result["servers"][name]["levels"] = {str(c): r for c, r in sorted(rows[name].items())}
    result["targets"] = targets(rows, levels, result["servers"].get("ours", {}).get("open_loop_half"))
    print(report(result))
    return result


def targets(rows: dict[str, dict[int, dict]], levels: list[int], open_half: dict | None = None) -> dict:
    """The two targets; saturation is judged on the sweep ``levels`` only (not the extra half-load run)."""
    out: dict = {}
    if "ours" in rows:
        sat, peak = saturation(rows["ours"], levels)
        half = max(1, sat // 2)
        p50_1 = rows["ours"].get(1, {}).get("p50_ms", float("nan"))
        p99_half = rows["ours"][half]["p99_ms"] if half in rows["ours"] else float("nan")
        x = ratio(p99_half, p50_1)
        out["ours_saturation_concurrency"] = sat
        out["ours_peak_images_per_s"] = peak
        out["b_half_load_concurrency"] = half
        out["b_p99_half_load_ms"] = p99_half
        out["b_p50_unloaded_ms"] = p50_1
        out["b_ratio"] = x
        out["b_met"] = bool(x == x and x <= TARGET_P99_X)
        if open_half:
            out["b_open_rate_per_s"] = open_half["rate_per_s"]
            out["b_open_p99_ms"] = open_half["p99_ms"]
            out["b_open_ratio"] = ratio(open_half["p99_ms"], p50_1)
            out["b_open_met"] = bool(out["b_open_ratio"] == out["b_open_ratio"] and out["b_open_ratio"] <= TARGET_P99_X)
    if "ours" in rows and "ray" in rows:  # the Ray path's cost on one box: ratios to ours, same load
        rsat, rpeak = saturation(rows["ray"], levels)
        out["ray_saturation_concurrency"] = rsat
        out["ray_peak_images_per_s"] = rpeak
        out["ray_peak_ratio"] = ratio(rpeak, out["ours_peak_images_per_s"])
        out["ray_p50_unloaded_ratio"] = ratio(rows["ray"].get(1, {}).get("p50_ms", float("nan")),
                                              out["b_p50_unloaded_ms"])
        out["ray_cpu_ratio"] = ratio(rows["ray"][rsat]["server_cpu_ms_per_image"],
                                     rows["ours"][out["ours_saturation_concurrency"]]["server_cpu_ms_per_image"])
    if "ours" in rows and "baseline" in rows:
        bsat, bpeak = saturation(rows["baseline"], levels)
        x = ratio(out["ours_peak_images_per_s"], bpeak)
        out["baseline_saturation_concurrency"] = bsat
        out["baseline_peak_images_per_s"] = bpeak
        out["a_ratio"] = x
        out["a_met"] = bool(x == x and x >= TARGET_THROUGHPUT_X)
        same = out["ours_saturation_concurrency"]
        out["a_ratio_cpu"] = ratio(rows["baseline"][bsat]["server_cpu_ms_per_image"],
                                   rows["ours"][out["ours_saturation_concurrency"]]["server_cpu_ms_per_image"])
        out["a_ratio_same_concurrency"] = ratio(rows["ours"][same]["images_per_s"],
                                                rows["baseline"].get(same, {}).get("images_per_s", float("nan")))
    return out


def report(result: dict) -> str:
    servers = result["servers"]
    names = [n for n in ("baseline", "ours", "ray") if "levels" in servers.get(n, {})]
    levels = sorted({int(c) for n in names for c in servers[n]["levels"]})
    perf, cost = [], []
    for c in levels:
        for n in names:
            r = servers[n]["levels"].get(str(c))
            if not r:
                continue
            base = servers.get("baseline", {}).get("levels", {}).get(str(c)) if n != "baseline" else None
            sm = r.get("server_ms_median", {})
            split = "/".join(f"{v:.0f}" for v in r.get("cpu_split_pct", [])[:4])
            perf.append([f"{n} c={c}", num(r["images_per_s"], 2),
                         num(ratio(r["images_per_s"], base["images_per_s"]), 2) if base else "",
                         num(r["p50_ms"]), num(r["p95_ms"]), num(r["p99_ms"]), r["answers"], r["errors"],
                         num(r.get("mean_batch_size"), 2)])
            cost.append([f"{n} c={c}", num(sm.get("decode")), num(sm.get("queue")), num(sm.get("inference")),
                         num(sm.get("total")), num(r["server_cpu_ms_per_image"]),
                         num(ratio(base["server_cpu_ms_per_image"], r["server_cpu_ms_per_image"]), 2) if base else "",
                         num(r["capacity_images_per_s"]), split, num(r["cpu"]["client_pct_core"], 0),
                         num(r["cpu"]["server_pct_core"], 0), num(r["cpu"]["others_pct_core"], 0)])
    o = servers.get("ours", {}).get("open_loop_half")
    if o:
        sm = o.get("server_ms_median", {})
        perf.append([f"ours open {num(o['rate_per_s'], 1)}/s", num(o["images_per_s"], 2), "", num(o["p50_ms"]),
                     num(o["p95_ms"]), num(o["p99_ms"]), o["answers"], o["errors"], num(o.get("mean_batch_size"), 2)])
        cost.append([f"ours open {num(o['rate_per_s'], 1)}/s", num(sm.get("decode")), num(sm.get("queue")),
                     num(sm.get("inference")), num(sm.get("total")), num(o["server_cpu_ms_per_image"]), "",
                     num(o["capacity_images_per_s"]), "/".join(f"{v:.0f}" for v in o.get("cpu_split_pct", [])[:4]),
                     num(o["cpu"]["client_pct_core"], 0), num(o["cpu"]["server_pct_core"], 0),
                     num(o["cpu"]["others_pct_core"], 0)])
    desc = []
    for n in names:
        s = servers[n]
        desc.append(f"{n}: {s['workers']} workers x {s.get('intra_op_threads')} thread(s), {s.get('model')} "
                    f"{s.get('precision')}, compiled={s.get('compiled')}, ready in {num(s.get('ready_s'))} s, "
                    f"top-1 {s.get('top1', {}).get('index')}")
    lines = [table(["server / clients", "img/s", "x base", "p50 ms", "p95 ms", "p99 ms", "answers", "errors",
                    "batch"], perf,
                   title=f"closed loop, {result['photo']} ({result['body_bytes'] / 1e6:.2f} MB), "
                         f"{num(result['warmup_s'])} s warm-up + {num(result['seconds'])} s window per run, "
                         f"{result['cores']} cores; servers take turns per level\n" + "\n".join(desc) +
                         "\n(latency = client-side, successful answers; batch = mean batch_size of our answers)")]
    lines += ["", table(["server / clients", "dec ms", "queue ms", "infer ms", "total ms", "cpu ms/img",
                         "x base", "cap img/s", "cpu split %", "client %", "server %", "others %"], cost,
                        title="where the time goes: dec/queue/infer/total = medians of the answers' timing_ms; "
                              "cpu ms/img = server CPU time per answer\n(x base: baseline's cpu ms/img over ours; "
                              "cap img/s = cores * 1000 / cpu ms/img, about the rate with all cores to itself; "
                              "cpu split = share of the server's CPU per process, busiest first; client/server/"
                              "others = % of one core over the window, others = the rest of the machine)")]
    t = result.get("targets", {})
    if "a_ratio" in t:
        a = t["a_ratio"]
        lines.append("")
        lines.append(f"(a) peak throughput: ours {num(t['ours_peak_images_per_s'], 2)} img/s "
                     f"(c={t['ours_saturation_concurrency']}) vs baseline {num(t['baseline_peak_images_per_s'], 2)} "
                     f"img/s (c={t['baseline_saturation_concurrency']}) = {num(a, 2)}x; target >= "
                     f"{TARGET_THROUGHPUT_X:g}x: " + ("MET" if t["a_met"] else "NOT MET") +
                     f" ({num(a / TARGET_THROUGHPUT_X, 2)} of the target); same concurrency "
                     f"c={t['ours_saturation_concurrency']}: {num(t['a_ratio_same_concurrency'], 2)}x; "
                     f"by CPU per image at saturation (noise-robust): {num(t['a_ratio_cpu'], 2)}x")
    if "b_ratio" in t:
        b = t["b_ratio"]
        lines.append(f"(b) ours p99 at half load (c={t['b_half_load_concurrency']}) {num(t['b_p99_half_load_ms'])} ms "
                     f"vs unloaded p50 (c=1) {num(t['b_p50_unloaded_ms'])} ms = {num(b, 2)}x; target <= "
                     f"{TARGET_P99_X:g}x: " + ("MET" if t["b_met"] else "NOT MET") +
                     f" ({num(b / TARGET_P99_X, 2)} of the limit)")
    if "b_open_ratio" in t:
        b = t["b_open_ratio"]
        lines.append(f"(b') same, half load as half the peak rate (open loop, Poisson {num(t['b_open_rate_per_s'], 2)}/s): "
                     f"p99 {num(t['b_open_p99_ms'])} ms = {num(b, 2)}x; " + ("MET" if t["b_open_met"] else "NOT MET") +
                     f" ({num(b / TARGET_P99_X, 2)} of the limit)")
    if "ray_peak_ratio" in t:
        lines.append(f"(ray) Ray Serve on this box: peak {num(t['ray_peak_images_per_s'], 2)} img/s "
                     f"(c={t['ray_saturation_concurrency']}) = {num(t['ray_peak_ratio'], 2)}x ours; unloaded p50 "
                     f"{num(t['ray_p50_unloaded_ratio'], 2)}x ours; server CPU per image at saturation "
                     f"{num(t['ray_cpu_ratio'], 2)}x ours (Ray's proxy, HTTP replica and object store hop)")
    for n in names:
        probs = servers[n].get("log_problems") or []
        if probs or servers[n].get("exit_code") not in (0, None):
            lines.append(f"{n}: exit {servers[n].get('exit_code')}, {len(probs)} log problem line(s), e.g. "
                         f"{probs[:1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
