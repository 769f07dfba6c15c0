"""HTTP load on a server under test: closed- and open-loop clients, CPU accounting, and the summary of a run.

Clients are threads of this process, each with its own keep-alive ``http.client`` connection,
uploading one prepared multipart body (built once: the load generator must cost little). A
closed loop keeps ``concurrency`` requests in flight back to back; an open loop sends Poisson
arrivals at a fixed rate whatever the answers do, with latency counted from each arrival (no
coordinated omission). CPU use of this process, of the server's processes and of the whole
machine is read over the timed window (``getrusage``, ``/proc``). Times are in seconds unless a
name says ms; rates in images/s (one image per request).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import random
import resource
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench import median, percentile, ratio

CLK_TCK = os.sysconf("SC_CLK_TCK")
PREDICT = "/api/v1/predict"


def multipart_body(data: bytes, filename: str) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body with one ``file`` part; returns (body, content type)."""
    boundary = "bench" + uuid.uuid4().hex
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            f"Content-Type: image/jpeg\r\n\r\n").encode()
    return head + data + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@dataclass
class Sample:
    """One request: ``start``/``end`` in ``time.perf_counter()`` s, and what the answer said."""

    start: float
    end: float
    status: int  # HTTP status; -1 for a connection error, -2 for a 200 that is not the documented JSON
    batch_size: int | None = None
    timing: dict | None = None


@dataclass
class Load:
    """One run's raw results: the samples inside its ``window_s`` (s), CPU over it, connection errors by type.

    ``concurrency`` is the closed loop's client count (0 for an open loop).
    """

    concurrency: int
    window_s: float
    samples: list[Sample] = field(default_factory=list)
    cpu: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)


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


def _post(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict, errs: dict,
          lock: threading.Lock) -> tuple[int, int | None, dict | None]:
    """One upload on ``conn``: (status or -1 connection error / -2 bad JSON, batch_size, timing_ms).

    A kept-alive connection the server closed meanwhile (gunicorn's ``keepalive``, 5 s idle) fails on
    reuse before any answer; that upload is sent again once on a new connection, as browsers do, and
    counted in ``errs`` as ``retried_stale_keepalive`` (not an error: the server never saw it)."""
    status, bs, timing = -1, None, None
    try:
        reused = conn.sock is not None
        try:
            conn.request("POST", path, body=body, headers=headers)
            resp = conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            if not reused:
                raise
            conn.close()
            with lock:
                errs["retried_stale_keepalive"] = errs.get("retried_stale_keepalive", 0) + 1
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


def cpu_window(t_window: float, t_stop: float, server_pids: list[int]) -> dict:
    """Sleep through [t_window, t_stop] (``perf_counter`` s); CPU over it, in % of one core.

    Keys: ``client_pct_core`` (this process), ``server_pct_core`` (``server_pids`` together) and
    ``server_pct_core_by_process``, ``machine_pct_core``, ``others_pct_core`` (the rest), ``cores``.
    """
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
             server_pids: list[int], path: str = PREDICT) -> Load:
    """Closed loop: ``concurrency`` clients upload ``body`` back-to-back for ``warmup`` + ``seconds``.

    Answers completing inside the window count. CPU over the window: this process (the
    clients), ``server_pids`` (master + workers) and the whole machine, in % of one core.
    ``warmup`` and ``seconds`` in s. Connection errors are counted, never raised.
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
    cpu = cpu_window(t_window, t_stop, server_pids)
    for t in threads:
        t.join()
    inside = [s for s in samples if t_window <= s.end <= t_stop]
    return Load(concurrency=concurrency, window_s=t_stop - t_window, samples=inside, cpu=cpu, errors=errs)


def run_open_loop(port: int, body: bytes, content_type: str, *, rate: float, warmup: float, seconds: float,
                  server_pids: list[int], clients: int = 32, seed: int = 0,
                  path: str = PREDICT) -> Load:
    """Open loop: uploads arrive as a Poisson process of ``rate``/s, whatever the answers do.

    Up to ``clients`` connections carry them; latency runs from each arrival (time spent
    waiting for a free connection included). Requests arriving inside the window count.
    ``rate`` in requests/s, ``warmup`` and ``seconds`` in s; ``seed`` fixes the arrival times.
    """
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
    cpu = cpu_window(t_window, t_stop, server_pids)
    feeder.join()
    for th in threads:
        th.join()
    inside = [s for s in samples if t_window <= s.start < t_stop]
    return Load(concurrency=0, window_s=t_stop - t_window, samples=inside, cpu=cpu, errors=errs)


def summarize(load: Load) -> dict:
    """A run as numbers: ``images_per_s``, ``p50_ms``/``p95_ms``/``p99_ms``/``max_ms`` (client-side, successful
    answers), ``errors`` (and by kind), ``cpu`` (as ``cpu_window``), ``server_cpu_ms_per_image``,
    ``capacity_images_per_s`` (cores * 1000 / that), ``cpu_split_pct``, ``mean_batch_size`` and
    ``server_ms_median`` (medians of the answers' ``timing_ms``) where the answers carry them.
    NaN where there was no successful answer."""
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
        "errors_by_kind": {**bad, **{f"exc:{k}": v for k, v in load.errors.items() if k != "retried_stale_keepalive"}},
        "retried_stale_keepalive": load.errors.get("retried_stale_keepalive", 0),
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

