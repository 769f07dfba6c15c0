"""Time to ready of our server: cold compile cache vs warm.

Start 1 (cold): ``CLASSIFIER_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` point at fresh empty
folders in a temp dir; time from launching gunicorn until every worker has said ``ready`` in
``/healthz`` (polled on fresh connections every 0.1 s), then stop it. Start 2 (warm): the same,
now filled, folders. Also each worker's own ``startup_s`` from ``/healthz`` (load, compile,
warm-up, self-test: from ``post_worker_init`` on, so without the imports before it). With
``--rounds N`` the warm start is repeated N times (median). The warm/cold ratio is the answer
(both measured in this run); the target is <= 10 s per worker warm.

    python bench/ready_bench.py [--quick] [--json out.json] [--model resnet18_seeded] [--precision auto]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import log, main, median, num, ratio, table
from bench.servers import ours_plan, parse_settings, start_ours

TARGET_WARM_S = 10.0


def add_arguments(parser) -> None:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true", help="one warm start (the default too; kept for symmetry)")
    parser.add_argument("--model", default="resnet18_seeded", help="CLASSIFIER_MODEL")
    parser.add_argument("--precision", default="auto", help="CLASSIFIER_PRECISION (auto, fp32, bf16, int8)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                        help="another CLASSIFIER_ setting, e.g. --set MAX_BATCH_SIZE=4 (repeatable)")
    parser.add_argument("--rounds", type=int, default=0, help="warm starts (0: 2, --quick 1)")
    parser.add_argument("--only-classifier-cache", action="store_true",
                        help="set only CLASSIFIER_CACHE_DIR (not TORCHINDUCTOR_CACHE_DIR): checks the service "
                             "puts inductor's cache under it by itself")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (caches and logs)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def _dir_size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def start_once(label: str, tmp: Path, settings: dict, env: dict, workers: int) -> dict:
    """Start our server once (log ``tmp/<label>.log``), time it to ready (s), stop it; return the numbers.

    :raises NotReady: it did not start.
    """
    srv = start_ours(tmp / f"{label}.log", settings=settings, env=env)
    t0 = srv.started
    try:
        health = srv.wait_ready(workers)
        all_ready = time.monotonic() - t0
    finally:
        code = srv.stop()
    problems = srv.log_problems()
    out = {
        "ready_s": all_ready,
        "first_worker_ready_s": min(srv.ready_at.values()),
        "workers": {str(pid): {"seen_ready_s": srv.ready_at[pid], "startup_s": h.get("startup_s"),
                               "precision": h.get("precision"), "cores": h.get("cores")}
                    for pid, h in health.items()},
        "max_startup_s": max(h.get("startup_s") or 0 for h in health.values()),
        "precision": next(iter(health.values())).get("precision"),
        "exit_code": code,
        "log_problems": problems[:10],
    }
    log(f"  {label}: all {workers} workers ready in {all_ready:.1f} s; startup_s "
        f"{[w['startup_s'] for w in out['workers'].values()]}; exit {code}")
    return out


def run(args) -> dict:
    """One cold start, then ``rounds`` warm ones, on fresh cache folders; print the report; return every number (s)."""
    settings = {"MODEL": args.model, "PRECISION": args.precision, **parse_settings(args.settings)}
    workers = ours_plan(settings).workers
    rounds = args.rounds or (1 if args.quick else 2)
    tmp = Path(tempfile.mkdtemp(prefix="ready_bench-"))
    cache, inductor = tmp / "cache", tmp / "inductor"
    settings["CACHE_DIR"] = str(cache)
    env = {} if args.only_classifier_cache else {"TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    log(f"ready_bench: {settings}, {workers} workers, caches in {tmp}")
    out = {"settings": settings, "workers": workers, "tmp": str(tmp), "target_warm_s": TARGET_WARM_S}
    try:
        out["cold"] = start_once("cold", tmp, settings, env, workers)
        out["cache_files"], out["cache_bytes"] = _dir_size(tmp)
        out["warm_runs"] = [start_once(f"warm{i + 1}", tmp, settings, env, workers) for i in range(rounds)]
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    warm_ready = median([w["ready_s"] for w in out["warm_runs"]])
    warm_startup = median([w["max_startup_s"] for w in out["warm_runs"]])
    out["warm_ready_s_median"] = warm_ready
    out["warm_max_startup_s_median"] = warm_startup
    out["warm_over_cold_ready"] = ratio(warm_ready, out["cold"]["ready_s"])
    out["warm_over_cold_startup"] = ratio(warm_startup, out["cold"]["max_startup_s"])
    out["target_met_startup"] = warm_startup <= TARGET_WARM_S
    out["target_met_ready"] = warm_ready <= TARGET_WARM_S
    print(report(out))
    return out


def report(out: dict) -> str:
    """The fixed-width text report of a ``run`` result."""
    rows = []
    cold = out["cold"]
    for label, r in [("cold", cold)] + [(f"warm {i + 1}", w) for i, w in enumerate(out["warm_runs"])]:
        for j, (pid, w) in enumerate(sorted(r["workers"].items(), key=lambda kv: kv[1]["seen_ready_s"])):
            rows.append([f"{label}" if j == 0 else "", num(r["ready_s"]) if j == 0 else "",
                         num(ratio(r["ready_s"], cold["ready_s"]), 2) if j == 0 else "",
                         pid, str(w["cores"]), num(w["seen_ready_s"]), num(w["startup_s"]),
                         num(ratio(w["startup_s"], cold["max_startup_s"]), 2)])
    s = out["settings"]
    lines = [table(["start", "all ready s", "x cold", "worker", "cores", "seen ready s", "startup_s", "x cold max"],
                   rows, title=f"time to ready: {s['MODEL']}, precision {s['PRECISION']} -> {cold['precision']}, "
                               f"{out['workers']} workers; cache {out.get('cache_files')} files, "
                               f"{(out.get('cache_bytes') or 0) / 1e6:.1f} MB after the cold start\n"
                               "(all ready = launch to the last worker seen ready in /healthz; startup_s = the "
                               "worker's own build+compile+warm-up+self-test)")]
    lines.append("")
    lines.append(f"warm (median of {len(out['warm_runs'])}): all ready {num(out['warm_ready_s_median'])} s "
                 f"= {num(out['warm_over_cold_ready'], 2)}x cold; slowest worker startup_s "
                 f"{num(out['warm_max_startup_s_median'])} s = {num(out['warm_over_cold_startup'], 2)}x cold")
    lines.append(f"target <= {TARGET_WARM_S:g} s per worker warm: startup_s "
                 + ("MET" if out["target_met_startup"] else "NOT MET")
                 + f" ({num(out['warm_max_startup_s_median'] / TARGET_WARM_S, 2)}x the target); launch-to-ready "
                 + ("MET" if out["target_met_ready"] else "NOT MET")
                 + f" ({num(out['warm_ready_s_median'] / TARGET_WARM_S, 2)}x)")
    for label, r in [("cold", cold)] + [(f"warm {i + 1}", w) for i, w in enumerate(out["warm_runs"])]:
        if r["log_problems"] or r["exit_code"] != 0:
            lines.append(f"{label}: exit {r['exit_code']}, log: {r['log_problems'][:2]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
