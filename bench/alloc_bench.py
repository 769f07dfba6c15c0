"""Our server's throughput with the default allocator (glibc malloc) vs jemalloc vs tcmalloc (``LD_PRELOAD``).

One server per allocator (our real gunicorn, ``MODEL=resnet18_seeded``, defaults otherwise; the
preload goes to the master and so to every worker, never to this load generator), all started
first, one after the other; then the same closed-loop load as ``e2e_bench.py`` at one saturating
concurrency, in rounds, the servers taking turns in a rotating order, so drifting load from
other processes hits all alike. Reported per allocator: median images/s, p50/p99, server CPU
per image, worker RSS after the load, and the ratios against the default allocator. Each worker's
``/proc/PID/maps`` is checked to hold the preloaded library.

Debian packages: ``apt-get install libjemalloc2 libtcmalloc-minimal4``.

    python bench/alloc_bench.py [--quick] [--json out.json] [--concurrency 8] [--rounds 3]
"""

from __future__ import annotations

import glob
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import PHOTO_12MP, log, main, median, num, photo, ratio, table
from bench.load import multipart_body, run_load, summarize
from bench.servers import ours_plan, parse_settings, rss_mb, start_ours

LIBS = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc2"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc-minimal4"),
}
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib", "/lib/x86_64-linux-gnu")


def find_lib(soname: str) -> str | None:
    """Absolute path of a shared library by soname in the usual places, else None."""
    for d in LIB_DIRS:
        hits = sorted(glob.glob(f"{d}/{soname}"))
        if hits:
            return hits[0]
    return None


def _maps_has(pid: int, soname: str) -> bool:
    """Whether the library (by soname, version dropped) is mapped into the process."""
    try:
        return soname.split(".so")[0] in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def add_arguments(parser) -> None:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true", help="one short round (a smoke run)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients (one level that saturates our server)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds over the allocators (0: 3, --quick 1)")
    parser.add_argument("--seconds", type=float, default=0, help="timed window per run (0: 20, --quick 6)")
    parser.add_argument("--warmup", type=float, default=0, help="untimed seconds before each window (0: 3, --quick 2)")
    parser.add_argument("--allocators", nargs="+", default=["default", "jemalloc", "tcmalloc"],
                        choices=("default", "jemalloc", "tcmalloc"))
    parser.add_argument("--malloc-conf", default="", help="MALLOC_CONF for jemalloc, e.g. background_thread:true")
    parser.add_argument("--photo", default=PHOTO_12MP, help="photo to upload")
    parser.add_argument("--model", default="resnet18_seeded", help="CLASSIFIER_MODEL")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                        help="another CLASSIFIER_ setting (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def run(args) -> dict:
    """Start one server per allocator, load them in rotating rounds, print the report; return every number.

    :raises NotReady: a server did not start.
    """
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.seconds or (6.0 if args.quick else 20.0)
    warmup = args.warmup or (2.0 if args.quick else 3.0)
    settings = {"MODEL": args.model, **parse_settings(args.settings)}
    workers = ours_plan(settings).workers
    path = photo(args.photo)
    body, ctype = multipart_body(path.read_bytes(), path.name)
    log_dir = Path(tempfile.mkdtemp(prefix="alloc_bench-"))

    variants: dict[str, dict] = {}
    skipped = {}
    for name in args.allocators:
        if name == "default":
            variants[name] = {"env": {}, "lib": None}
            continue
        soname, package = LIBS[name]
        lib = find_lib(soname)
        if not lib:
            skipped[name] = f"{soname} not found: apt-get install {package}"
            log(f"skipping {name}: {skipped[name]}")
            continue
        env = {"LD_PRELOAD": lib}
        if name == "jemalloc" and args.malloc_conf:
            env["MALLOC_CONF"] = args.malloc_conf
        variants[name] = {"env": env, "lib": lib}
    log(f"alloc_bench: {list(variants)}, c={args.concurrency}, {rounds} round(s) of {warmup:g}+{seconds:g} s, "
        f"logs in {log_dir}")

    servers = {}
    runs: dict[str, list[dict]] = {n: [] for n in variants}
    out: dict = {"concurrency": args.concurrency, "rounds": rounds, "seconds": seconds, "settings": settings,
                 "skipped": skipped, "allocators": {}}
    try:
        for name, v in variants.items():  # one after the other: start-ups must not compete either
            log(f"starting ours with {name} {v['lib'] or ''}...")
            srv = start_ours(log_dir / f"{name}.log", settings=settings, env=v["env"])
            servers[name] = srv
            srv.wait_ready(workers)
            pids = srv.worker_pids()
            v["preloaded"] = all(_maps_has(p, Path(v["lib"]).name) for p in pids) if v["lib"] else None
            log(f"  ready in {max(srv.ready_at.values()):.1f} s; preload in every worker: {v['preloaded']}")
        order = list(variants)
        for r in range(rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                srv = servers[name]
                s = summarize(run_load(srv.port, body, ctype, concurrency=args.concurrency, warmup=warmup,
                                       seconds=seconds, server_pids=srv.pids()))
                s["worker_rss_mb"] = [rss_mb(p, default=float("nan")) for p in srv.worker_pids()]
                runs[name].append(s)
                log(f"  round {r + 1} {name:9s} {s['images_per_s']:7.2f} img/s  p50 {s['p50_ms']:7.1f}  "
                    f"p99 {s['p99_ms']:7.1f} ms  cpu {s['server_cpu_ms_per_image']:.1f} ms/img  errors {s['errors']}")
    finally:
        for name, srv in servers.items():
            variants[name]["exit_code"] = srv.stop()
            variants[name]["log_problems"] = srv.log_problems()[:10]
    for name, v in variants.items():
        rs = runs[name]
        out["allocators"][name] = {
            "lib": v["lib"], "preloaded": v.get("preloaded"), "exit_code": v.get("exit_code"),
            "log_problems": v.get("log_problems"),
            "images_per_s": median([r["images_per_s"] for r in rs]),
            "p50_ms": median([r["p50_ms"] for r in rs]),
            "p99_ms": median([r["p99_ms"] for r in rs]),
            "server_cpu_ms_per_image": median([r["server_cpu_ms_per_image"] for r in rs]),
            "errors": sum(r["errors"] for r in rs),
            "worker_rss_mb": max((max(r["worker_rss_mb"]) for r in rs), default=float("nan")),
            "others_pct_core": median([r["cpu"]["others_pct_core"] for r in rs]),
            "runs": rs,
        }
    base = out["allocators"].get("default")
    for name, a in out["allocators"].items():
        a["images_per_s_vs_default"] = ratio(a["images_per_s"], base["images_per_s"]) if base else None
        a["cpu_per_image_vs_default"] = ratio(a["server_cpu_ms_per_image"], base["server_cpu_ms_per_image"]) \
            if base else None
        a["p99_vs_default"] = ratio(a["p99_ms"], base["p99_ms"]) if base else None
    print(report(out))
    return out


def report(out: dict) -> str:
    """The fixed-width text report of a ``run`` result."""
    rows = []
    for name, a in out["allocators"].items():
        rows.append([name, num(a["images_per_s"], 2), num(a["images_per_s_vs_default"], 3), num(a["p50_ms"]),
                     num(a["p99_ms"]), num(a["p99_vs_default"], 2), num(a["server_cpu_ms_per_image"]),
                     num(a["cpu_per_image_vs_default"], 3), num(a["worker_rss_mb"], 0), a["errors"],
                     num(a["others_pct_core"], 0), "-" if a["preloaded"] is None else num(a["preloaded"])])
    lines = [table(["allocator", "img/s", "x default", "p50 ms", "p99 ms", "p99 x def", "cpu ms/img", "cpu x def",
                    "RSS MB", "errors", "others %", "preloaded"], rows,
                   title=f"our server at c={out['concurrency']}, median of {out['rounds']} rotating round(s) of "
                         f"{num(out['seconds'])} s; {out['settings']}\n(cpu ms/img = server CPU time per answer, "
                         "lower is better and less hurt by other load; RSS = largest worker after the load; "
                         "others % = the rest of the machine, % of one core)")]
    for name, why in out["skipped"].items():
        lines.append(f"{name}: skipped, {why}")
    for name, a in out["allocators"].items():
        if a["log_problems"] or a["exit_code"] not in (0, None):
            lines.append(f"{name}: exit {a['exit_code']}, log: {a['log_problems'][:2]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
