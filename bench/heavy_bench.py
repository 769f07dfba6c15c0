"""Heavy photos beside ordinary ones: ordinary clients' images/s and latency alone vs beside clients sending
photos of a few bytes that take a core a second or more to decode, on one server, in the same run.

A flat 8900x8900 lossless WebP is 3 KB of 79 MP (inside ``MAX_PIXELS``): ~1-2 s of a core to decode.
Before the heavy lane (``webapp/admission.py``) each such decode counted ahead of every ordinary photo and
refused them: two clients sending them took a 2-worker server from ~1,000 answers to ``dog.jpg`` in 15 s to
9-115 (2026-12-07; tryout28: 594 to 53). Now one such photo at a time per worker decodes on a thread of the
lowest priority, counted for no other request, and a second one waits (429, ``Retry-After``).

One server (ours, as deployed: ``gunicorn.conf.py``, ``CLASSIFIER_MODEL=resnet18_seeded``). ``--clients``
closed-loop clients upload the ordinary photo back to back; in the "beside" windows ``--heavy-clients`` more
upload the heavy WebP back to back. Every client waits ``Retry-After`` x uniform(1, 1.5) after a 429 or 503,
as ``classify --server``. Windows alternate alone, beside, beside, alone (ABBA, ``--rounds`` times), so
drifting load from neighbours on this shared machine hits both. Reported: ordinary images/s (200s inside the
window) and its ratio beside/alone, their p50/p99 (ms) and refusals; the heavy photos answered and refused.
No target: what the heavy clients cost the others, measured.

    python bench/heavy_bench.py [--quick] [--seconds 15] [--clients 4] [--heavy-clients 2] [--json out.json]
"""

from __future__ import annotations

import http.client
import io
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import log, main, num, percentile, photo, ratio, table
from bench.load import PREDICT
from bench.servers import http_json, ours_plan, parse_settings, start_ours
from webapp.cli.retries import JITTER

HEAVY_SIDE = 8900  # px: 79.2 MP, under MAX_PIXELS' default (80 MP)


def add_arguments(parser) -> None:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true", help="short windows, 1 round (a smoke run)")
    parser.add_argument("--seconds", type=float, default=0, help="each mode's time per round (s; 0: 15, --quick 8)")
    parser.add_argument("--rounds", type=int, default=0, help="ABBA rounds (0: 2, --quick 1)")
    parser.add_argument("--clients", type=int, default=4, help="ordinary clients")
    parser.add_argument("--heavy-clients", type=int, default=2, help="clients sending the heavy photo (beside)")
    parser.add_argument("--photo", default="dog.jpg", help="the ordinary photo (name in ../shared/images, or a path)")
    parser.add_argument("--model", default="resnet18_seeded", help="CLASSIFIER_MODEL of the server")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                        help="another CLASSIFIER_ setting of the server (repeatable)")
    parser.add_argument("--log-dir", help="where the server's log goes (default: a new temp dir)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def heavy_photo(side: int = HEAVY_SIDE) -> bytes:
    """A flat grey ``side`` x ``side`` lossless WebP (3 KB at 8900 px)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 130, 140)).save(buf, "WEBP", lossless=True)
    return buf.getvalue()


def _client(port: int, body: bytes, ctype: str, stop_at: float, out: list, seed: int) -> None:
    """Upload ``body`` back to back until ``stop_at``: ``(end, status, seconds)`` per answer (-1: none)."""
    rng, conn = random.Random(seed), None
    while time.perf_counter() < stop_at:
        conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        t0, status, retry_after = time.perf_counter(), -1, None
        try:
            conn.request("POST", PREDICT, body=body, headers={"Content-Type": ctype})
            resp = conn.getresponse()
            resp.read()
            status, retry_after = resp.status, resp.getheader("Retry-After")
            if resp.will_close:
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = None
        out.append((time.perf_counter(), status, time.perf_counter() - t0))
        if status in (429, 503):
            wait = min(float(retry_after or 1), 30.0) * rng.uniform(1, 1 + JITTER)
            time.sleep(max(0.0, min(wait, stop_at - time.perf_counter())))
        elif status < 0:
            time.sleep(0.05)


def window(port: int, ordinary: tuple[bytes, str], heavy: tuple[bytes, str] | None, *, clients: int,
           heavy_clients: int, seconds: float) -> dict:
    """One window: the ordinary clients, and the heavy ones where ``heavy``; counts and latencies (ms)."""
    stop_at = time.perf_counter() + seconds
    shots: dict[str, list] = {"ordinary": [], "heavy": []}
    threads = [threading.Thread(target=_client, args=(port, *ordinary, stop_at, shots["ordinary"], i))
               for i in range(clients)]
    if heavy is not None:
        threads += [threading.Thread(target=_client, args=(port, *heavy, stop_at, shots["heavy"], 100 + i))
                    for i in range(heavy_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    out = {}
    for kind, got in shots.items():
        ok = [s * 1e3 for end, status, s in got if status == 200 and end <= stop_at]
        out[kind] = {"answered": len(ok), "refused": sum(status == 429 for _, status, _ in got),
                     "other": sum(status not in (200, 429) for _, status, _ in got),
                     "p50_ms": percentile(ok, 50), "p99_ms": percentile(ok, 99), "ms": ok}
    return out


def run(args) -> dict:
    """Start the server, teach it both photos' costs, run the ABBA windows; print and return the results."""
    seconds = args.seconds or (8.0 if args.quick else 15.0)
    rounds = args.rounds or (1 if args.quick else 2)
    settings = {"MODEL": args.model, **parse_settings(args.settings)}
    plan = ours_plan(settings)
    ordinary = (photo(args.photo).read_bytes(), "application/octet-stream")
    heavy = (heavy_photo(), "image/webp")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="heavy-bench-"))
    srv = start_ours(log_dir / "server.log", settings=settings)
    result: dict = {"settings": settings, "workers": plan.workers, "seconds": seconds, "rounds": rounds,
                    "clients": args.clients, "heavy_clients": args.heavy_clients, "photo": args.photo,
                    "heavy_bytes": len(heavy[0]), "heavy_pixels": HEAVY_SIDE ** 2}
    merged: dict[str, dict[str, list]] = {m: {"ordinary": [], "heavy": []} for m in ("alone", "beside")}
    counts: dict[str, dict] = {m: {} for m in merged}
    try:
        srv.wait_ready(workers=plan.workers)
        # Both photos' costs measured by every worker, as a running server has them (a worker's first heavy one
        # is not known to be heavy yet: it teaches the cost line); one at a time, so each lands on an idle worker
        for body, ctype in [ordinary, heavy] * (2 * plan.workers):
            status, answer = http_json(srv.port, PREDICT, body=body, headers={"Content-Type": ctype}, timeout=120)
            if status != 200:
                raise RuntimeError(f"a first upload answered {status}: {answer}")
        for r in range(rounds):
            for mode in ("alone", "beside", "beside", "alone") if r % 2 == 0 else ("beside", "alone", "alone", "beside"):
                w = window(srv.port, ordinary, heavy if mode == "beside" else None, clients=args.clients,
                           heavy_clients=args.heavy_clients, seconds=seconds / 2)
                for kind in ("ordinary", "heavy"):
                    merged[mode][kind] += w[kind]["ms"]
                    for key in ("answered", "refused", "other"):
                        counts[mode][(kind, key)] = counts[mode].get((kind, key), 0) + w[kind][key]
                log(f"  {mode:6s} ordinary {w['ordinary']['answered']:5d} answered, p99 "
                    f"{num(w['ordinary']['p99_ms'])} ms; heavy {w['heavy']['answered']} answered, "
                    f"{w['heavy']['refused']} refused")
    finally:
        result["exit_code"], result["log_problems"] = srv.stop(), srv.log_problems()[:20]
    total_s = seconds * rounds  # each mode: two half-windows per round
    for mode, kinds in merged.items():
        result[mode] = {kind: {"answered": counts[mode].get((kind, "answered"), 0),
                               "refused": counts[mode].get((kind, "refused"), 0),
                               "other": counts[mode].get((kind, "other"), 0),
                               "images_per_s": counts[mode].get((kind, "answered"), 0) / total_s,
                               "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}
                        for kind, ms in kinds.items()}
    a, b = result["alone"]["ordinary"], result["beside"]["ordinary"]
    result["ratio_images_per_s"] = ratio(b["images_per_s"], a["images_per_s"])
    result["ratio_p99"] = ratio(b["p99_ms"], a["p99_ms"])
    print(report(result))
    return result


def report(result: dict) -> str:
    """The fixed-width text report of a ``run`` result."""
    rows = []
    for mode in ("alone", "beside"):
        o, h = result[mode]["ordinary"], result[mode]["heavy"]
        rows.append([mode, num(o["images_per_s"], 2), num(o["p50_ms"]), num(o["p99_ms"]), o["refused"], o["other"],
                     h["answered"] if mode == "beside" else "-", h["refused"] if mode == "beside" else "-",
                     num(h["p50_ms"]) if mode == "beside" else "-"])
    out = [table(["ordinary clients", "img/s", "p50 ms", "p99 ms", "429", "other", "heavy answered", "heavy 429",
                  "heavy p50 ms"], rows,
                 title=f"ours ({result['settings']}, {result['workers']} workers): {result['clients']} clients "
                       f"uploading {result['photo']} back to back, alone and beside {result['heavy_clients']} "
                       f"uploading a {result['heavy_bytes']}-byte lossless WebP of {result['heavy_pixels'] / 1e6:.1f} "
                       f"MP; ABBA x {result['rounds']}, {num(result['seconds'])} s per mode and round"),
           f"ordinary images/s beside / alone: {num(result['ratio_images_per_s'], 2)}x; "
           f"p99 beside / alone: {num(result['ratio_p99'], 2)}x"]
    if result.get("log_problems") or result.get("exit_code") not in (0, None):
        out.append(f"server: exit {result.get('exit_code')}, log problems e.g. {result['log_problems'][:1]}")
    return "\n".join(out)


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
