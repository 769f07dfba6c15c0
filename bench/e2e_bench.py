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

Before: ours as it was before the batch loop waited only for company and the master shared the
libraries (``BATCH_WAIT=fixed``, ``PRELOAD_LIBRARIES=0``), in the same turns: the same-run baseline of
(c) and (d).

Targets: (a) at saturation ours serves >= 8x the baseline's images/s (peak vs peak);
(b) our p99 at half load (half the lowest concurrency that reaches 95% of our peak) is <= 1.5x
our unloaded p50 (concurrency 1). A half-load level not in the sweep is measured after it.
(c) no idle wait: our unloaded p50 >= 4 ms below before's, our peak images/s not below before's,
our p99 at half load <= 2x our unloaded p50. (d) memory: every worker of ours holds <= 150 MB
private (``Private_Dirty``; ``/healthz``'s ``memory_mb``, read at ready and right after the heaviest level), with its
Pss and the master's, against before's.

    python bench/e2e_bench.py [--quick] [--json out.json] [--levels 1 2 4 8 16] [--seconds 20]
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import PHOTO_12MP, log, main, median, num, percentile, photo, ratio, table
from bench.baseline_app import BASELINE_MODEL, default_workers, start_baseline
from bench.load import PREDICT, multipart_body, run_load, run_open_loop, summarize
from bench.servers import Gunicorn, http_json, ours_plan, parse_settings, ray_available, start_ours, start_ray
from webapp.settings import BY_NAME

TARGET_THROUGHPUT_X = 8.0
TARGET_P99_X = 1.5
TARGET_P50_SAVED_MS = 4.0  # (c)
TARGET_HALF_P99_X = 2.0  # (c)
TARGET_WORKER_PRIVATE_MB = 150.0  # (d)
BEFORE = {"BATCH_WAIT": "fixed", "PRELOAD_LIBRARIES": "0"}  # ours before (c) and (d)
SATURATION_FRACTION = 0.95


def add_arguments(parser) -> None:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true", help="levels 1 2 4 8, short windows (a smoke run)")
    parser.add_argument("--levels", type=int, nargs="+", help="concurrency levels (default 1 2 4 8 16; --quick 1 2 4 8)")
    parser.add_argument("--seconds", type=float, default=0, help="timed window per run (0: 12, --quick 6)")
    parser.add_argument("--warmup", type=float, default=0, help="untimed seconds before each window (0: 3, --quick 2)")
    parser.add_argument("--photo", default=PHOTO_12MP, help="photo to upload (name in ../shared/images, or a path)")
    parser.add_argument("--model", default="resnet18_seeded", help="CLASSIFIER_MODEL of our server")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                        help="another CLASSIFIER_ setting of our server, e.g. --set PRECISION=fp32 (repeatable)")
    parser.add_argument("--baseline-workers", type=int, default=0, help="baseline sync workers (0: one per core)")
    parser.add_argument("--servers", nargs="+", choices=("baseline", "ours", "before", "ray"), default=None,
                        help="which servers to measure (default: baseline ours before, and ray where Ray is "
                             "installed; before = ours with " + " ".join(f"{k}={v}" for k, v in BEFORE.items()) + ")")
    parser.add_argument("--paired-seconds", type=float, default=0,
                        help="(c): seconds of one-at-a-time requests alternating between ours and before, per photo "
                             "(0: 15, --quick 6)")
    parser.add_argument("--no-open-loop", action="store_true",
                        help="skip the extra open-loop run of ours at half its peak rate (Poisson arrivals)")
    parser.add_argument("--log-dir", help="where the servers' logs go (default: a new temp dir)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


PAIRED_PHOTOS = (PHOTO_12MP, "dog.jpg")  # (c)'s unloaded p50, paired: the 12 MP photo and the issue's small one


def paired_unloaded(ports: dict[str, int], body: bytes, ctype: str, *, seconds: float) -> dict:
    """One request at a time, to each server in turn (A B B A A B ...: each pair's order alternates), for
    ``seconds``: the servers' unloaded latencies under the same moment-to-moment noise of this shared box.

    Returns ``{name: {"p50_ms", "p90_ms", "queue_ms_median", "n"}, "diff_ms_median": median over pairs of
    (other's ms - first's ms)}`` (client-side ms of 200 answers, a new connection each, so a request lands on either worker).
    """
    names = list(ports)
    took: dict[str, list[float]] = {n: [] for n in names}
    queue: dict[str, list[float]] = {n: [] for n in names}
    pairs: list[float] = []
    end, i = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        got = {}
        for n in (names if i % 2 == 0 else names[::-1]):
            # A fresh connection each time: it lands on either worker, so neither server keeps the quieter core.
            conn = http.client.HTTPConnection("127.0.0.1", ports[n], timeout=60)
            try:
                t0 = time.perf_counter()
                conn.request("POST", PREDICT, body=body, headers={"Content-Type": ctype, "Connection": "close"})
                resp = conn.getresponse()
                raw = resp.read()
                ms = (time.perf_counter() - t0) * 1e3
            finally:
                conn.close()
            if resp.status == 200:
                got[n] = ms
                took[n].append(ms)
                queue[n].append(json.loads(raw)["timing_ms"]["queue"])
        if len(got) == len(names):
            pairs.append(got[names[1]] - got[names[0]])
        i += 1
    out: dict = {n: {"p50_ms": median(took[n]), "p90_ms": percentile(took[n], 90),
                     "queue_ms_median": median(queue[n]), "n": len(took[n])} for n in names}
    out["diff_ms_median"] = median(pairs)
    return out


def saturation(rows: dict[int, dict], levels: list[int]) -> tuple[int, float]:
    """(lowest of ``levels`` reaching SATURATION_FRACTION of their peak images/s, that peak images/s)."""
    swept = {c: r for c, r in rows.items() if c in levels}
    peak = max(r["images_per_s"] for r in swept.values())
    level = min(c for c, r in swept.items() if r["images_per_s"] >= SATURATION_FRACTION * peak)
    return level, peak


def _record(srv: Gunicorn, health: dict[int, dict], *, per_worker: bool) -> dict:
    """What a started server says of itself in ``/healthz`` (``per_worker``: also cores and startup_s by pid)."""
    h = next(iter(health.values()))
    rec = {"workers": len(health), "ready_s": max(srv.ready_at.values()), "model": h["model"]["name"],
           "precision": h["precision"], "compiled": h["model"].get("compiled"),
           "intra_op_threads": h["intra_op_threads"]}
    if per_worker:
        rec["cores"] = {str(p): x["cores"] for p, x in health.items()}
    rec["max_batch_size"] = h["max_batch_size"]
    if per_worker:
        rec["startup_s"] = {str(p): x["startup_s"] for p, x in health.items()}
        rec["memory_ready"] = {"workers": {str(p): x.get("memory_mb", {}) for p, x in health.items()},
                               "master": master_memory(srv)}
    return rec


def master_memory(srv: Gunicorn) -> dict:
    """The master's memory in MB (2**20 bytes) from its ``/proc/PID/smaps_rollup``: private, pss, rss...."""
    from webapp.preload import memory

    return {k.removesuffix("_bytes"): round(v / 2**20, 1) for k, v in memory(srv.proc.pid).items()}


def memory_now(srv: Gunicorn, workers: int, timeout: float = 20.0) -> dict:
    """Every worker's ``/healthz`` ``memory_mb`` (by pid; fresh connections until all ``workers`` answered or
    ``timeout`` s passed) and the master's (``master_memory``)."""
    seen: dict[str, dict] = {}
    end = time.monotonic() + timeout
    while len(seen) < workers and time.monotonic() < end:
        try:
            status, h = http_json(srv.port, "/healthz", headers={"Connection": "close"})
        except OSError:
            status, h = 0, None
        if status == 200 and isinstance(h, dict) and h.get("memory_mb"):
            seen[str(h["pid"])] = h["memory_mb"]
    return {"workers": seen, "master": master_memory(srv)}


def run(args) -> dict:
    """Start the servers, sweep the levels (servers taking turns), print the report; return every number.

    :raises NotReady: a server did not start; RuntimeError: a server's first answer was not a 200.
    """
    # --quick keeps 2 and 4: with 1 and 8 alone the saturation found was 8 and "half load" c=4, which on
    # 2 cores already is the peak.
    levels = sorted(set(args.levels or ([1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16])))
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
        args.servers = ["baseline", "ours", "before"] + (["ray"] if ray_available() else [])
    servers: dict[str, Gunicorn] = {}
    result: dict = {"photo": path.name, "body_bytes": len(body), "levels": levels, "seconds": seconds,
                    "warmup_s": warmup, "cores": os.cpu_count(), "servers": {}, "log_dir": str(log_dir)}
    try:
        # Started one after the other: their start-ups must not compete for the cores either.
        if "ours" in args.servers:
            workers = ours_plan(ours_settings).workers
            log(f"starting ours ({ours_settings}, {workers} workers; compiles at start)...")
            servers["ours"] = start_ours(log_dir / "ours.log", settings=ours_settings)
            result["servers"]["ours"] = _record(servers["ours"], servers["ours"].wait_ready(workers), per_worker=True)
            log(f"ours ready in {result['servers']['ours']['ready_s']:.1f} s: {result['servers']['ours']}")
        if "before" in args.servers:
            workers = ours_plan(ours_settings).workers
            log(f"starting before ({BEFORE}, {workers} workers)...")
            servers["before"] = start_ours(log_dir / "before.log", settings={**ours_settings, **BEFORE}, name="before")
            result["servers"]["before"] = _record(servers["before"], servers["before"].wait_ready(workers),
                                                  per_worker=True)
            log(f"before ready in {result['servers']['before']['ready_s']:.1f} s")
        if "baseline" in args.servers:
            workers = default_workers(args.baseline_workers)
            log(f"starting baseline ({workers} sync workers)...")
            servers["baseline"] = start_baseline(log_dir / "baseline.log", workers=workers)
            servers["baseline"].wait_ready(workers)
            result["servers"]["baseline"] = {"workers": workers, "ready_s": max(servers["baseline"].ready_at.values()),
                                             "model": BASELINE_MODEL["name"], "precision": BASELINE_MODEL["precision"],
                                             "compiled": BASELINE_MODEL["compiled"], "intra_op_threads": 1}
            log(f"baseline ready in {result['servers']['baseline']['ready_s']:.1f} s")
        if "ray" in args.servers:
            plan = ours_plan(ours_settings)
            log(f"starting ray ({ours_settings}, {plan.workers} replicas x {plan.threads} CPU; compiles at start)...")
            servers["ray"] = start_ray(log_dir / "ray.log", settings=ours_settings, replicas=plan.workers,
                                       threads=plan.threads)
            result["servers"]["ray"] = _record(servers["ray"], servers["ray"].wait_ready(plan.workers),
                                               per_worker=False)
            log(f"ray ready in {result['servers']['ray']['ready_s']:.1f} s: {result['servers']['ray']}")
        for name, srv in servers.items():  # one answer each: the API shape, and the top-1 for the record
            status, answer = http_json(srv.port, PREDICT, body=body, headers={"Content-Type": ctype}, timeout=120)
            if status != 200 or answer is None:
                raise RuntimeError(f"{name}: smoke request answered {status}: {answer}")
            top = answer["results"][0]["predictions"][0]
            result["servers"][name]["top1"] = {"index": top["index"], "label": top["label"]}

        rows: dict[str, dict[int, dict]] = {n: {} for n in servers}
        unloaded_ms: dict[str, list[float]] = {}  # c=1: every 200's client-side latency, for ideal_fcfs_p99

        def measure(name: str, c: int) -> None:
            srv = servers[name]
            load = run_load(srv.port, body, ctype, concurrency=c, warmup=warmup, seconds=seconds,
                            server_pids=srv.pids())
            rows[name][c] = summarize(load)
            if c == 1:
                unloaded_ms[name] = [(x.end - x.start) * 1e3 for x in load.samples if x.status == 200]
            if c == max(levels) and name in ("ours", "before"):  # (d) loaded: right after the heaviest level
                result["servers"][name]["memory_loaded"] = memory_now(srv, result["servers"][name]["workers"])
            r = rows[name][c]
            log(f"  {name:8s} c={c:<3d} {r['images_per_s']:7.2f} img/s  p50 {r['p50_ms']:7.1f}  "
                f"p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}  client {r['cpu']['client_pct_core']:.0f}%  "
                f"server {r['cpu']['server_pct_core']:.0f}%  others {r['cpu']['others_pct_core']:.0f}% of a core")
            time.sleep(0.5)

        if "ours" in servers and "before" in servers:  # (c): unloaded, the two servers' requests interleaved
            result["paired_unloaded"] = {}
            for name in PAIRED_PHOTOS:
                pbody, pctype = multipart_body(photo(name).read_bytes(), name)
                got = paired_unloaded({"before": servers["before"].port, "ours": servers["ours"].port}, pbody, pctype,
                                      seconds=args.paired_seconds or (6.0 if args.quick else 15.0))
                result["paired_unloaded"][name] = got
                log(f"  paired c=1 {name}: ours p50 {got['ours']['p50_ms']:.1f} ms (queue {got['ours']['queue_ms_median']:.2f})"
                    f" vs before {got['before']['p50_ms']:.1f} ms (queue {got['before']['queue_ms_median']:.2f}); "
                    f"median paired difference {got['diff_ms_median']:.1f} ms over {got['ours']['n']} pairs")
        for i, c in enumerate(levels):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in order:
                measure(name, c)
        if "ours" in rows:
            sat, _ = saturation(rows["ours"], levels)
            half = max(1, sat // 2)
            if half not in rows["ours"]:
                log(f"ours saturates at c={sat}: measuring half load c={half}")
                for name in [n for n in ("ours", "before") if n in rows]:
                    measure(name, half)
            if not args.no_open_loop:  # half load as half the utilization: arrivals at half the peak rate
                _, peak = saturation(rows["ours"], levels)
                for name in [n for n in ("ours", "before") if n in rows]:  # before: the same arrival rate, for (c)
                    srv = servers[name]
                    o = summarize(run_open_loop(srv.port, body, ctype, rate=peak / 2, warmup=warmup, seconds=seconds,
                                                server_pids=srv.pids()))
                    o["rate_per_s"] = peak / 2
                    o["ideal_fcfs_p99_ms"] = ideal_fcfs_p99(unloaded_ms.get(name, []), peak / 2,
                                                            result["servers"][name]["workers"])
                    result["servers"][name]["open_loop_half"] = o
                    log(f"  {name:8s} open loop {peak / 2:.2f}/s: {o['images_per_s']:.2f} img/s  p50 {o['p50_ms']:.1f}  "
                        f"p99 {o['p99_ms']:.1f} ms  errors {o['errors']}  (one shared queue: p99 "
                        f"{o['ideal_fcfs_p99_ms']:.1f} ms)")
        if "ours" in servers:  # (d) once idle: TRIM_IDLE_S after the load, the workers hand freed memory back
            time.sleep(float(ours_settings.get("TRIM_IDLE_S", BY_NAME["TRIM_IDLE_S"].default)) + 2)
            result["servers"]["ours"]["memory_idle"] = memory_now(servers["ours"], result["servers"]["ours"]["workers"])
    finally:
        for name, srv in servers.items():
            code = srv.stop()
            result["servers"].setdefault(name, {})["exit_code"] = code
            result["servers"][name]["log_problems"] = srv.log_problems()[:20]
            log(f"{name} stopped (exit {code}); log {srv.log_path}")
    for name in rows:
        result["servers"][name]["levels"] = {str(c): r for c, r in sorted(rows[name].items())}
    result["targets"] = targets(rows, levels, result["servers"].get("ours", {}).get("open_loop_half"),
                                result["servers"].get("before", {}).get("open_loop_half"))
    result["targets"].update(memory_targets(result["servers"]))
    for name, got in (result.get("paired_unloaded") or {}).items():  # (c), paired: before - ours
        result["targets"][f"c_paired_{name}"] = {"ours_p50_ms": got["ours"]["p50_ms"],
                                                 "before_p50_ms": got["before"]["p50_ms"],
                                                 "saved_ms": -got["diff_ms_median"],
                                                 "met": bool(-got["diff_ms_median"] >= TARGET_P50_SAVED_MS)}
    print(report(result))
    return result


def ideal_fcfs_p99(service_ms: list[float], rate_per_s: float, servers: int, *, arrivals: int = 100_000,
                   seed: int = 0) -> float:
    """p99 (ms) of the answer time of an ideal dispatcher at this load: Poisson arrivals at ``rate_per_s``
    into one shared first-come-first-served queue over ``servers`` identical servers, each request's service
    time drawn from ``service_ms`` (the unloaded, c=1, latencies), nothing else slowing anyone down.

    The scale the open-loop half-load p99 is held against: the M/G/k queue of queueing theory, simulated
    (no closed form for a p99). For constant service times s at utilization 0.5 on 2 servers its p99 is
    ~2.5 s: "p99 <= 2x the unloaded p50" at half the peak rate asks more than one ideal first-come queue
    gives. (A short window's p99 is nearly its slowest answer, so a measured one may land either side.)
    NaN without service times.
    """
    import heapq
    import random

    if not service_ms or rate_per_s <= 0 or servers < 1:
        return float("nan")
    rng = random.Random(seed)
    free = [0.0] * servers  # when each server is next free (s)
    t, took = 0.0, []
    for _ in range(arrivals):
        t += rng.expovariate(rate_per_s)
        start = max(t, heapq.heappop(free))
        end = start + rng.choice(service_ms) / 1e3
        heapq.heappush(free, end)
        took.append((end - t) * 1e3)
    return percentile(took, 99)


def targets(rows: dict[str, dict[int, dict]], levels: list[int], open_half: dict | None = None,
            before_open_half: dict | None = None) -> dict:
    """The two targets (and the Ray and baseline ratios); saturation is judged on the sweep ``levels`` only (not the extra half-load run)."""
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
            out["b_open_ideal_p99_ms"] = open_half.get("ideal_fcfs_p99_ms", float("nan"))
            out["b_open_ideal_ratio"] = ratio(out["b_open_ideal_p99_ms"], p50_1)
    if "ours" in rows and "before" in rows:  # (c): the same levels, the same turns
        ours, before = rows["ours"], rows["before"]
        half = out["b_half_load_concurrency"]
        p50_before = before.get(1, {}).get("p50_ms", float("nan"))
        _, before_peak = saturation(before, levels)
        out["c_p50_unloaded_before_ms"] = p50_before
        out["c_p50_saved_ms"] = p50_before - out["b_p50_unloaded_ms"]
        out["c_p50_ratio"] = ratio(out["b_p50_unloaded_ms"], p50_before)
        out["c_queue_ms_unloaded"] = ours.get(1, {}).get("server_ms_median", {}).get("queue")
        out["c_queue_ms_unloaded_before"] = before.get(1, {}).get("server_ms_median", {}).get("queue")
        out["c_peak_before_images_per_s"] = before_peak
        out["c_peak_ratio"] = ratio(out["ours_peak_images_per_s"], before_peak)
        out["c_cpu_ratio"] = ratio(before[max(levels)]["server_cpu_ms_per_image"],
                                   ours[max(levels)]["server_cpu_ms_per_image"])
        out["c_half_ratio"] = out["b_ratio"]
        out["c_half_ratio_before"] = ratio(before.get(half, {}).get("p99_ms", float("nan")), p50_before)
        out["c_met"] = {"p50": bool(out["c_p50_saved_ms"] >= TARGET_P50_SAVED_MS),
                        "peak": bool(out["c_peak_ratio"] >= 1.0),
                        "half_p99": bool(out["c_half_ratio"] <= TARGET_HALF_P99_X)}
        if open_half:  # half load as half the peak rate (open loop): ours, and before at the same rate
            out["c_open_ratio"] = out["b_open_ratio"]
            out["c_open_ratio_before"] = ratio((before_open_half or {}).get("p99_ms", float("nan")), p50_before)
            out["c_met"]["half_p99_open"] = bool(out["c_open_ratio"] <= TARGET_HALF_P99_X)
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


def memory_targets(servers: dict) -> dict:
    """(d): the largest worker private MB and Pss MB of ours and before (at ready and after the load), the
    masters' Pss, each server's total Pss (master + workers: what the whole server costs)."""
    out: dict = {}
    for name in ("ours", "before"):
        for when in ("ready", "loaded", "idle"):
            mem = servers.get(name, {}).get(f"memory_{when}")
            if not mem or not mem.get("workers"):
                continue
            ws = list(mem["workers"].values())
            out[f"d_{name}_{when}_worker_private_mb"] = max(w.get("private", float("nan")) for w in ws)
            out[f"d_{name}_{when}_worker_pss_mb"] = max(w.get("pss", float("nan")) for w in ws)
            out[f"d_{name}_{when}_master_pss_mb"] = mem["master"].get("pss", float("nan"))
            out[f"d_{name}_{when}_total_pss_mb"] = sum(w.get("pss", 0.0) for w in ws) + mem["master"].get("pss", 0.0)
    worst = [out[k] for k in ("d_ours_ready_worker_private_mb", "d_ours_loaded_worker_private_mb") if k in out]
    if worst:
        out["d_met"] = bool(max(worst) <= TARGET_WORKER_PRIVATE_MB)
    return out


def memory_table(servers: dict) -> str:
    """(d)'s table: per worker private and Pss MB of ours and before, at ready and after the load, and the master."""
    rows = []
    for name in ("before", "ours"):
        for when in ("ready", "loaded", "idle"):
            mem = servers.get(name, {}).get(f"memory_{when}")
            if not mem:
                continue
            for pid, w in sorted(mem.get("workers", {}).items()):
                rows.append([f"{name} {when}", f"worker {pid}", num(w.get("private")), num(w.get("pss")),
                             num(w.get("rss"))])
            m = mem.get("master", {})
            rows.append([f"{name} {when}", "master", num(m.get("private")), num(m.get("pss")), num(m.get("rss"))])
    return table(["server", "process", "private MB", "Pss MB", "RSS MB"], rows,
                 title="memory per process (MB = 2**20 bytes; private = Private_Dirty of /proc/PID/smaps_rollup, what "
                       "each process alone costs; Pss = its share with shared pages split; ready = after start-up, "
                       "loaded = right after the sweep, idle = TRIM_IDLE_S later)")


def report(result: dict) -> str:
    """The fixed-width text report of a ``run`` result: the load table, where the time goes, the targets."""
    servers = result["servers"]
    names = [n for n in ("baseline", "ours", "before", "ray") if "levels" in servers.get(n, {})]
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
    if any(servers.get(n, {}).get("memory_ready") for n in ("ours", "before")):
        lines += ["", memory_table(servers)]
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
        if t.get("b_open_ideal_p99_ms", float("nan")) == t.get("b_open_ideal_p99_ms"):  # runs since 2026-12-02
            lines.append(f"     one shared first-come queue over the workers, with c=1's latencies as service "
                         f"times, would give p99 {num(t['b_open_ideal_p99_ms'])} ms = {num(t['b_open_ideal_ratio'], 2)}x "
                         "at this rate (M/G/k queueing, bench.e2e_bench.ideal_fcfs_p99: the scale of what a 2x target asks)")
    if "c_met" in t:
        m = t["c_met"]
        lines.append(f"(c) no idle wait, vs before ({', '.join(f'{k}={v}' for k, v in BEFORE.items())}): unloaded p50 "
                     f"{num(t['b_p50_unloaded_ms'])} ms vs {num(t['c_p50_unloaded_before_ms'])} ms = "
                     f"{num(t['c_p50_saved_ms'])} ms less ({num(t['c_p50_ratio'], 2)}x; queue median "
                     f"{num(t['c_queue_ms_unloaded'], 2)} vs {num(t['c_queue_ms_unloaded_before'], 2)} ms); target "
                     f">= {TARGET_P50_SAVED_MS:g} ms less: " + ("MET" if m["p50"] else "NOT MET"))
        for key in [k for k in t if k.startswith("c_paired_")]:
            pt = t[key]
            lines.append(f"    paired (one request at a time, ours and before in turn), {key[len('c_paired_'):]}: p50 "
                         f"{num(pt['ours_p50_ms'])} vs {num(pt['before_p50_ms'])} ms, median paired saving "
                         f"{num(pt['saved_ms'])} ms; target >= {TARGET_P50_SAVED_MS:g} ms: " +
                         ("MET" if pt["met"] else "NOT MET"))
        lines.append(f"    peak {num(t['ours_peak_images_per_s'], 2)} vs {num(t['c_peak_before_images_per_s'], 2)} img/s "
                     f"= {num(t['c_peak_ratio'], 2)}x (CPU per image at c={max(levels)}: before/ours "
                     f"{num(t['c_cpu_ratio'], 2)}x); target not lower: " + ("MET" if m["peak"] else "NOT MET"))
        lines.append(f"    p99 at half load (c={t['b_half_load_concurrency']}) / unloaded p50: {num(t['c_half_ratio'], 2)}x "
                     f"(before {num(t['c_half_ratio_before'], 2)}x); target <= {TARGET_HALF_P99_X:g}x: " +
                     ("MET" if m["half_p99"] else "NOT MET"))
        if "half_p99_open" in m:
            lines.append(f"    p99 at half the peak rate (open loop, {num(t['b_open_rate_per_s'], 2)}/s) / unloaded p50: "
                         f"{num(t['c_open_ratio'], 2)}x (before at the same rate {num(t['c_open_ratio_before'], 2)}x); "
                         f"target <= {TARGET_HALF_P99_X:g}x: " + ("MET" if m["half_p99_open"] else "NOT MET"))
    if "d_met" in t:
        lines.append(f"(d) memory: largest worker private {num(t.get('d_ours_ready_worker_private_mb'))} MB at ready, "
                     f"{num(t.get('d_ours_loaded_worker_private_mb'))} MB loaded, "
                     f"{num(t.get('d_ours_idle_worker_private_mb'))} MB idle after TRIM_IDLE_S (before "
                     f"{num(t.get('d_before_ready_worker_private_mb'))} / {num(t.get('d_before_loaded_worker_private_mb'))} MB); "
                     f"Pss {num(t.get('d_ours_loaded_worker_pss_mb'))} MB (before {num(t.get('d_before_loaded_worker_pss_mb'))}); "
                     f"whole server Pss {num(t.get('d_ours_loaded_total_pss_mb'))} MB (before "
                     f"{num(t.get('d_before_loaded_total_pss_mb'))}); target <= {TARGET_WORKER_PRIVATE_MB:g} MB "
                     "private per worker: " + ("MET" if t["d_met"] else "NOT MET"))
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
