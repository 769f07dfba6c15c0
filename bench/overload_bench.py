"""2x overload: admission by time (``CLASSIFIER_MAX_WAIT_MS``) vs the same server without it, in one run.

Two of our servers run side by side, as deployed (``gunicorn.conf.py``, ``CLASSIFIER_MODEL=resnet18_seeded``),
identical but for ``MAX_WAIT_MS``: "time" has the budget under test (the setting's default unless
``--budget-ms``), "off" a budget of a day, so only the image-count bound (``QUEUE_SIZE``) refuses there:
the service as it was before admission by time. They are never loaded at once: per photo they take
turns (which goes first alternates), so drifting load from neighbours on this shared machine hits both.

Per photo (the 12 MP phone photo, then a small one, ``dog.jpg``):

1. capacity ``C`` (images/s): the "off" server under closed-loop load that saturates it without
   client timeouts (2 clients per image its workers batch at once);
2. 2x overload: ``2 * C * budget`` clients upload the photo back to back (so without admission by time
   each would wait about twice the budget: 64 clients on 2 workers for the 12 MP photo in the issue's
   measurement). Each gives up after ``--timeout`` s (5: a client-side timeout, its connection closed), and
   on 429 or 503 waits ``Retry-After`` x uniform(1, 1.5) before its next upload, as ``classify --server``.
   The window is split into ``--rounds`` rounds (2 with ``--quick``, else 4), the servers taking turns in
   ABBA order (time, off, off, time, ...), and each server's figures are over all its rounds. One window
   each, in one order, is what this bench did first: on the 2-core Zen 5 box (2026-12-02) the server that
   went second ran 1-9% more images/s than the first in the same pair, whichever it was, which a single
   ordering reads as a difference between the servers. The per-round ratios are reported beside the
   total, so the noise of the comparison shows with it.

Reported per server: images/s (200s inside the window) and its ratio to "off"; admitted (200) latency
p50/p99 and p99 as a ratio to the budget; refused (429) latency p50/p99 (client-side: request sent to
answer read, body upload included; and server-side, from gunicorn's access log); client timeouts; other
errors; the server's CPU time per answer (noise-robust: the neighbours' load changes images/s, not this).
Targets, at 2x overload: refused answered in < 50 ms (p99), admitted p99 <= 1.5x the budget, images/s
not lower than "off"'s, no client timeouts. Latencies in ms, rates in images/s (one photo per request).

Clients send the body with the headers, as Python's ``http.client`` (and ``requests``) do, so a refused
client also uploads the body the server reads and drops after its answer (``webapp/bodies.py``) before it
reads the 429; ``--expect`` makes them curl-like (``Expect: 100-continue``: no body for a refusal).

    python bench/overload_bench.py [--quick] [--expect] [--seconds 60] [--budget-ms 1000] [--json out.json]
"""

from __future__ import annotations

import http.client
import math
import random
import re
import select
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import PHOTO_12MP, log, main, num, percentile, photo, ratio, table
from bench.load import PREDICT, cpu_window, multipart_body, run_load, summarize
from bench.servers import Gunicorn, http_json, ours_plan, parse_settings, start_ours
from webapp.cli.retries import JITTER
from webapp.settings import BY_NAME

OFF_MS = BY_NAME["MAX_WAIT_MS"].high  # a day: admission by time never refuses
SMALL_PHOTO = "dog.jpg"
TARGET_REFUSED_P99_MS = 50.0
TARGET_ADMITTED_P99_X = 1.5
TARGET_THROUGHPUT_X = 1.0


def add_arguments(parser) -> None:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true", help="short windows (15 s; a smoke run)")
    parser.add_argument("--seconds", type=float, default=0, help="timed window per server and photo (0: 60, --quick 15)")
    parser.add_argument("--warmup", type=float, default=0, help="untimed seconds before each window (0: 5, --quick 3)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="rounds per server and photo, in ABBA order, sharing the window (0: 4, --quick 2)")
    parser.add_argument("--budget-ms", type=float, default=0,
                        help=f"MAX_WAIT_MS of the 'time' server (0: the default, {BY_NAME['MAX_WAIT_MS'].default:g})")
    parser.add_argument("--timeout", type=float, default=5.0, help="client-side timeout (s)")
    parser.add_argument("--clients", type=int, default=0, help="overload clients (0: 2 x capacity x budget)")
    parser.add_argument("--expect", action="store_true",
                        help="clients send 'Expect: 100-continue' and the body only after '100 Continue', as curl "
                             "does for bodies over 1 MB (default: the body at once, as Python's http.client does)")
    parser.add_argument("--photos", nargs="+", default=[PHOTO_12MP, SMALL_PHOTO],
                        help="photos to upload (names in ../shared/images, or paths)")
    parser.add_argument("--model", default="resnet18_seeded", help="CLASSIFIER_MODEL of both servers")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                        help="another CLASSIFIER_ setting of both servers, e.g. --set COMPILE=0 (repeatable)")
    parser.add_argument("--log-dir", help="where the servers' logs go (default: a new temp dir)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


@dataclass
class Shot:
    """One upload: ``start``/``end`` in ``time.perf_counter()`` s; ``status`` (HTTP, or -1 no answer);
    ``kind``: ``ok``, ``refused`` (429), ``not_ready`` (503), ``timeout`` (client gave up), ``http_<status>``
    or the exception's name."""

    start: float
    end: float
    status: int
    kind: str


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _send(conn: http.client.HTTPConnection, body: bytes, headers: dict, expect: bool, timeout: float) -> None:
    """Send one upload; with ``expect``, the body only once the server said ``100 Continue`` (a final answer
    instead, e.g. 429, is left for ``getresponse``: no body is sent for it)."""
    if not expect:
        conn.request("POST", PREDICT, body=body, headers=headers)
        return
    conn.putrequest("POST", PREDICT)
    for k, v in {**headers, "Expect": "100-continue"}.items():
        conn.putheader(k, v)
    conn.endheaders()
    if not select.select([conn.sock], [], [], timeout)[0]:
        raise TimeoutError("no interim or final answer")
    if conn.sock.recv(len(_CONTINUE), socket.MSG_PEEK) == _CONTINUE:
        conn.sock.recv(len(_CONTINUE))
        conn.send(body)


def _client(port: int, body: bytes, headers: dict, timeout: float, stop_at: float, out: list,
            go: threading.Event, seed: int, expect: bool = False) -> None:
    """Upload back to back until ``stop_at``; on 429/503 wait Retry-After x uniform(1, 1 + JITTER)."""
    rng = random.Random(seed)
    conn = None
    go.wait()
    while time.perf_counter() < stop_at:
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        t0 = time.perf_counter()
        status, kind, retry_after = -1, "error", None
        try:
            _send(conn, body, headers, expect, timeout)
            resp = conn.getresponse()
            resp.read()
            status, retry_after = resp.status, resp.getheader("Retry-After")
            kind = {200: "ok", 429: "refused", 503: "not_ready"}.get(status, f"http_{status}")
            if resp.will_close:
                conn.close()
                conn = None
        except TimeoutError:
            kind = "timeout"
        except (OSError, http.client.HTTPException) as exc:
            kind = type(exc).__name__
        if status < 0:  # no answer: this connection is done (the server sees the client go)
            conn.close()
            conn = None
        out.append(Shot(t0, time.perf_counter(), status, kind))
        if status in (429, 503):
            wait = min(float(retry_after or 1), 30.0) * rng.uniform(1, 1 + JITTER)
            time.sleep(max(0.0, min(wait, stop_at - time.perf_counter())))
        elif status < 0:
            time.sleep(0.05)  # a refused connection must not become a busy loop
    if conn is not None:
        conn.close()


def overload(port: int, body: bytes, ctype: str, *, clients: int, warmup: float, seconds: float,
             timeout: float, server_pids: list[int], expect: bool = False) -> tuple[list[Shot], float, dict]:
    """``clients`` closed-loop clients for ``warmup`` + ``seconds`` s: the shots that ended inside the window,
    the window (s) and CPU over it (``load.cpu_window``: this process, ``server_pids``, the machine)."""
    headers = {"Content-Type": ctype, "Content-Length": str(len(body))}
    shots: list[Shot] = []
    go = threading.Event()
    t_start = time.perf_counter() + 0.2
    t_window, t_stop = t_start + warmup, t_start + warmup + seconds
    threads = [threading.Thread(target=_client, args=(port, body, headers, timeout, t_stop, shots, go, i, expect),
                                daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, t_start - time.perf_counter()))
    go.set()
    cpu = cpu_window(t_window, t_stop, server_pids)
    for t in threads:
        t.join(t_stop - time.perf_counter() + timeout + 60)
    return [s for s in shots if t_window <= s.end <= t_stop], t_stop - t_window, cpu


def combine_cpu(parts: list[tuple[dict, float]]) -> dict:
    """One ``load.cpu_window`` dict for several windows of one server: each figure (% of one core) the mean
    over the windows weighted by their lengths (s), so ``% x total window`` is the CPU of all of them."""
    total = sum(w for _, w in parts) or 1.0
    out: dict = {"cores": parts[0][0]["cores"], "server_pct_core_by_process": {}}
    for key in ("client_pct_core", "server_pct_core", "machine_pct_core", "others_pct_core"):
        out[key] = sum(c[key] * w for c, w in parts) / total
    for c, w in parts:
        for pid, v in c["server_pct_core_by_process"].items():
            out["server_pct_core_by_process"][pid] = out["server_pct_core_by_process"].get(pid, 0.0) + v * w / total
    return out


def summarize_shots(shots: list[Shot], window_s: float, budget_ms: float, cpu: dict) -> dict:
    """One server's overload run as numbers (ms, images/s, counts, CPU in % of a core); NaN where there is
    nothing to measure. ``server_cpu_ms_per_image``: the server's CPU time per answer (noise-robust: what
    the neighbours take changes the images/s, not this), refusals and their drained bodies included."""
    ok = [(s.end - s.start) * 1e3 for s in shots if s.kind == "ok"]
    refused = [(s.end - s.start) * 1e3 for s in shots if s.kind == "refused"]
    kinds: dict[str, int] = {}
    for s in shots:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    return {
        "images_per_s": len(ok) / window_s, "answers": len(ok), "refused": len(refused),
        "ok_p50_ms": percentile(ok, 50), "ok_p99_ms": percentile(ok, 99), "ok_max_ms": max(ok, default=math.nan),
        "ok_p99_x_budget": ratio(percentile(ok, 99), budget_ms),
        "refused_p50_ms": percentile(refused, 50), "refused_p99_ms": percentile(refused, 99),
        "timeouts": kinds.get("timeout", 0),
        "errors": sum(v for k, v in kinds.items() if k not in ("ok", "refused", "timeout")), "kinds": kinds,
        "cpu": cpu, "server_cpu_ms_per_image": ratio(10 * cpu["server_pct_core"] * window_s, len(ok)),
    }


def server_side_ms(log_text: str, status: int) -> list[float]:
    """Server-side times (ms) of the uploads answered ``status`` in gunicorn's text access log (``gunicorn.conf.py``'s
    format ends ``<bytes> <ms>ms <request id>``): the time inside the server, without the load generator's."""
    return [float(m.group(1)) for m in re.finditer(rf'"POST {PREDICT} HTTP/1\.1" {status} \S+ (\d+)ms', log_text)]


def _warm(srv: Gunicorn, body: bytes, ctype: str, n: int = 4) -> None:
    """A few uploads of this photo, one at a time: the server's measured costs are of it."""
    for _ in range(n):
        status, answer = http_json(srv.port, PREDICT, body=body, headers={"Content-Type": ctype}, timeout=120)
        if status != 200:
            raise RuntimeError(f"{srv.name}: warm-up upload answered {status}: {answer}")


def run(args) -> dict:
    """Start both servers, measure each photo (capacity, then 2x overload, servers taking turns), report.

    :raises NotReady: a server did not start; RuntimeError: a warm-up upload was not answered 200.
    """
    seconds = args.seconds or (15.0 if args.quick else 60.0)
    warmup = args.warmup or (3.0 if args.quick else 5.0)
    rounds = max(1, args.rounds or (2 if args.quick else 4))
    per_round = seconds / rounds
    budget = args.budget_ms or BY_NAME["MAX_WAIT_MS"].default
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="overload_bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    common = {"MODEL": args.model, **parse_settings(args.settings)}
    workers = ours_plan(common).workers
    result: dict = {"budget_ms": budget, "off_ms": OFF_MS, "seconds": seconds, "warmup_s": warmup, "rounds": rounds,
                    "expect": args.expect,
                    "timeout_s": args.timeout, "workers": workers, "settings": common, "photos": {},
                    "log_dir": str(log_dir)}
    servers: dict[str, Gunicorn] = {}
    try:
        for name, wait_ms in (("time", budget), ("off", OFF_MS)):  # one after the other: start-ups compete
            log(f"starting {name} (MAX_WAIT_MS={wait_ms:g}, {common}, {workers} workers)...")
            servers[name] = start_ours(log_dir / f"{name}.log", settings={**common, "MAX_WAIT_MS": wait_ms}, name=name)
            health = servers[name].wait_ready(workers)
        batch = next(iter(health.values()))["max_batch_size"]
        for i, name in enumerate(args.photos):
            path = photo(name)
            body, ctype = multipart_body(path.read_bytes(), path.name)
            for srv in servers.values():
                _warm(srv, body, ctype)
            probe = summarize(run_load(servers["off"].port, body, ctype, concurrency=2 * workers * batch,
                                       warmup=warmup, seconds=max(5.0, seconds / 4), server_pids=servers["off"].pids()))
            capacity = probe["images_per_s"]
            clients = args.clients or max(4, math.ceil(2 * capacity * budget / 1e3))
            log(f"{path.name}: capacity {capacity:.1f} img/s (off, {2 * workers * batch} clients, p50 "
                f"{probe['p50_ms']:.0f} ms); 2x overload: {clients} clients")
            rec = {"body_bytes": len(body), "capacity_images_per_s": capacity, "clients": clients, "servers": {}}
            acc = {n: {"shots": [], "cpus": [], "refused_srv": [], "rounds": []} for n in servers}
            for k in range(rounds):  # ABBA: time, off, off, time, ... (the first server alternates per photo)
                for name_ in (["time", "off"] if (i + k) % 2 == 0 else ["off", "time"]):
                    logged = len(servers[name_].output())
                    shots, window, cpu = overload(servers[name_].port, body, ctype, clients=clients, warmup=warmup,
                                                  seconds=per_round, timeout=args.timeout,
                                                  server_pids=servers[name_].pids(), expect=args.expect)
                    a = acc[name_]
                    a["shots"] += shots
                    a["cpus"].append((cpu, window))
                    a["refused_srv"] += server_side_ms(servers[name_].output()[logged:], 429)  # warm-up included
                    r = summarize_shots(shots, window, budget, cpu)
                    a["rounds"].append(r["images_per_s"])
                    log(f"  {name_:4s} round {k + 1}/{rounds} {r['images_per_s']:6.2f} img/s  ok p50 "
                        f"{r['ok_p50_ms']:6.0f} p99 {r['ok_p99_ms']:6.0f} ms  refused {r['refused']} (p50 "
                        f"{num(r['refused_p50_ms'])} p99 {num(r['refused_p99_ms'])} ms)  timeouts {r['timeouts']}  "
                        f"errors {r['errors']}  server cpu {r['server_cpu_ms_per_image']:.0f} ms/img  others "
                        f"{cpu['others_pct_core']:.0f}% of a core")
                    time.sleep(1.0)
            for name_, a in acc.items():
                window = sum(w for _, w in a["cpus"])
                r = rec["servers"][name_] = summarize_shots(a["shots"], window, budget, combine_cpu(a["cpus"]))
                r["refused_server_p50_ms"] = percentile(a["refused_srv"], 50)
                r["refused_server_p99_ms"] = percentile(a["refused_srv"], 99)
                r["rounds_images_per_s"] = a["rounds"]
            rec["targets"] = targets(rec["servers"], budget)
            result["photos"][path.name] = rec
    finally:
        for name, srv in servers.items():
            code = srv.stop()
            result.setdefault("servers", {})[name] = {"exit_code": code, "log_problems": srv.log_problems()[:20]}
            log(f"{name} stopped (exit {code}); log {srv.log_path}")
    print(report(result))
    return result


def targets(rows: dict[str, dict], budget_ms: float) -> dict:
    """The four targets for one photo, each with its measured figure and whether it was met."""
    t, off = rows["time"], rows["off"]
    x = ratio(t["images_per_s"], off["images_per_s"])
    return {
        "refused_p99_ms": t["refused_p99_ms"],
        "refused_met": bool(t["refused"] and t["refused_p99_ms"] < TARGET_REFUSED_P99_MS),
        "admitted_p99_x_budget": t["ok_p99_x_budget"],
        "admitted_met": bool(t["ok_p99_x_budget"] <= TARGET_ADMITTED_P99_X),
        "throughput_x_off": x, "throughput_met": bool(x == x and x >= TARGET_THROUGHPUT_X),
        "throughput_x_off_rounds": [ratio(a, b) for a, b in zip(t.get("rounds_images_per_s", []),
                                                                 off.get("rounds_images_per_s", []))],
        "cpu_per_image_x_off": ratio(t["server_cpu_ms_per_image"], off["server_cpu_ms_per_image"]),
        "timeouts": t["timeouts"], "timeouts_met": t["timeouts"] == 0,
    }


def _rounds_text(result: dict) -> str:
    n = result.get("rounds", 1)
    return f" per server in {n} ABBA rounds" if n > 1 else ""


def _per_round(t: dict) -> str:
    """The images/s ratio's rounds and, where they fall on both sides of 1, that the total is inside their spread."""
    xs = [x for x in t.get("throughput_x_off_rounds") or [] if x == x]
    if len(xs) < 2:
        return ""
    straddle = min(xs) < TARGET_THROUGHPUT_X <= max(xs)
    return f" (per round {', '.join(num(x, 2) for x in xs)}{': the rounds disagree' if straddle else ''})"


def _cpu_text(t: dict) -> str:
    x = t.get("cpu_per_image_x_off")
    return f", server CPU per answer {num(x, 2)}x off's" if x is not None and x == x else ""


def report(result: dict) -> str:
    """The fixed-width text report of a ``run`` result: one table per photo, then the targets."""
    budget = result["budget_ms"]
    lines = []
    for name, rec in result["photos"].items():
        rows = []
        for srv in ("time", "off"):
            r = rec["servers"][srv]
            rows.append([srv, num(r["images_per_s"], 2),
                         num(ratio(r["images_per_s"], rec["servers"]["off"]["images_per_s"]), 2),
                         num(r["ok_p50_ms"], 0), num(r["ok_p99_ms"], 0), num(r["ok_p99_x_budget"], 2), r["answers"],
                         r["refused"], num(r["refused_p50_ms"]), num(r["refused_p99_ms"]),
                         num(r.get("refused_server_p99_ms")), r["timeouts"], r["errors"],
                         num(r["server_cpu_ms_per_image"]), num(r["cpu"]["client_pct_core"], 0),
                         num(r["cpu"]["others_pct_core"], 0)])
        lines.append(table(["server", "img/s", "x off", "ok p50", "ok p99", "p99/budget", "answers", "refused",
                            "ref p50", "ref p99", "ref p99 srv", "timeouts", "errors", "cpu ms/img", "client %",
                            "others %"], rows,
                           title=f"\n{name} ({rec['body_bytes'] / 1e6:.2f} MB body): {rec['clients']} clients = 2 x "
                                 f"capacity {rec['capacity_images_per_s']:.1f} img/s x budget {budget:g} ms; "
                                 f"{num(result['warmup_s'])} s warm-up + {num(result['seconds'])} s window"
                                 f"{_rounds_text(result)}, "
                                 f"client timeout {num(result['timeout_s'])} s"
                                 f"{', Expect: 100-continue' if result.get('expect') else ''}\n"
                                 f"(time: MAX_WAIT_MS={budget:g}; off: {result['off_ms']:g}; ms client-side, but 'ref p99 "
                                 f"srv': gunicorn's access log, warm-up included; cpu ms/img "
                                 f"= server CPU per answer; client/others = % of one core: this process, the rest)"))
        t = rec["targets"]
        verdict = {True: "MET", False: "NOT MET"}
        lines.append(f"targets: refused p99 {num(t['refused_p99_ms'])} ms < {TARGET_REFUSED_P99_MS:g}: "
                     f"{verdict[t['refused_met']]}; admitted p99 {num(t['admitted_p99_x_budget'], 2)}x budget <= "
                     f"{TARGET_ADMITTED_P99_X:g}: {verdict[t['admitted_met']]}; images/s {num(t['throughput_x_off'], 2)}x "
                     f"off >= {TARGET_THROUGHPUT_X:g}: {verdict[t['throughput_met']]}{_per_round(t)}"
                     f"{_cpu_text(t)}; client timeouts "
                     f"{t['timeouts']}: {verdict[t['timeouts_met']]}")
    for name, s in result.get("servers", {}).items():
        if s["log_problems"] or s["exit_code"] not in (0, None):
            lines.append(f"{name}: exit {s['exit_code']}, {len(s['log_problems'])} log problem line(s), e.g. "
                         f"{s['log_problems'][:1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
