"""Time to ready of our server: cold compile cache vs warm.

Start 1 (cold): ``CLASSIFIER_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` point at fresh empty
folders in a temp dir; time from launching gunicorn until every worker has said ``ready`` in
``/healthz`` (polled on fresh connections every 0.1 s), then stop it. Start 2 (warm): the same,
now filled, folders. Also each worker's own ``startup_s`` from ``/healthz`` (load, compile,
warm-up, self-test: from ``post_worker_init`` on, so without the imports before it). With
``--rounds N`` the warm start is repeated N times (median). The warm/cold ratio is the answer
(both measured in this run); the target is <= 10 s per worker warm.

Then **per precision** (``--precisions``, default fp32, bf16, int8 and fp32 with the CPU capped to
AVX2, as an old server runs it, also with the package refused: torch.compile, the baseline): the
worker's start-up path alone, ``python -m webapp warm`` (weights,
precision, compile or AOTInductor package, warm-up of every batch size, self-test) in a fresh process
on an empty cache folder (cold), then again on the cache it filled (warm); seconds from launch to
done, imports included, and the warm/cold ratio. Target <= ``TARGET_ENGINE_WARM_S`` warm on every one.

    python bench/ready_bench.py [--quick] [--json out.json] [--model resnet18_seeded] [--precision auto]
"""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import ROOT, log, main, median, num, ratio, table
from bench.servers import classifier_env, ours_plan, parse_settings, start_ours

TARGET_WARM_S = 10.0
TARGET_ENGINE_WARM_S = 5.0
CAP = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# `python -m webapp warm` with the package refused: the engine's fallback, torch.compile (the baseline).
JIT_ONLY = ("import sys, webapp.engine as e\n"
            "def refuse(*a, **k):\n    raise RuntimeError('baseline: JIT only')\n"
            "e.load_or_build_aoti = refuse\nfrom webapp.cli import main\nsys.exit(main(['warm']))")


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
    parser.add_argument("--precisions", default="fp32,bf16,int8,fp32-avx2,fp32-avx2-jit",
                        help="per-precision start-up timing (cold and warm) of these ('-avx2': CPU capped to AVX2; "
                             "'-jit': the package refused, torch.compile as before, the baseline; '' skips it)")
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


def warm_command(label: str, cache: Path, settings: dict, log_path: Path) -> dict:
    """``python -m webapp warm`` once with ``label``'s precision ('-avx2': under the AVX2 cap; '-jit': the
    AOTInductor package refused, so the engine compiles with torch.compile, as fp32 and int8 did before) and cache
    folder ``cache`` (its own inductor cache inside); returns ``{"s": launch to exit, "cpu_s": its CPU
    time (user + system, children included), "built": bool, "backend": str, "exit_code": int}`` (seconds).
    On a shared box the CPU time is the steadier figure: a start that waits for a core grows in wall time only."""
    precision, *flags = label.split("-")
    cap = "avx2" in flags
    env = classifier_env({**settings, "PRECISION": precision, "CACHE_DIR": str(cache)}, CAP if cap else {},
                         drop=("TORCHINDUCTOR_CACHE_DIR", *(() if cap else tuple(CAP))))
    argv = ["-m", "webapp", "warm"]
    if "jit" in flags:
        argv = ["-c", JIT_ONLY]
    t0, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path, "wb") as f:
        code = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, stdout=f,
                              stderr=subprocess.STDOUT, check=False).returncode
    took, after = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = log_path.read_text(errors="replace")
    backend = re.search(r"backend (\w+)", text)
    return {"s": took, "cpu_s": cpu, "built": "caches built" in text, "backend": backend.group(1) if backend else None,
            "exit_code": code, **({"log_tail": text[-400:]} if code else {})}


def engine_starts(labels: list[str], settings: dict, tmp: Path, rounds: int) -> dict:
    """Per precision label: one cold ``warm_command`` on an empty folder, then ``rounds`` warm ones on it."""
    out = {}
    for label in labels:
        cache = tmp / f"engine-{label}"
        cold = warm_command(label, cache, settings, tmp / f"engine-{label}-cold.log")
        warm = [warm_command(label, cache, settings, tmp / f"engine-{label}-warm{i}.log") for i in range(rounds)]
        w, wc = median([r["s"] for r in warm]), median([r["cpu_s"] for r in warm])
        out[label] = {"cold": cold, "warm_runs": warm, "warm_s": w, "warm_over_cold": ratio(w, cold["s"]),
                      "warm_cpu_s": wc, "warm_over_cold_cpu": ratio(wc, cold["cpu_s"]),
                      "target_met": w <= TARGET_ENGINE_WARM_S and all(r["exit_code"] == 0 for r in warm),
                      "target_met_cpu": wc <= TARGET_ENGINE_WARM_S}
        log(f"  engine start {label}: cold {cold['s']:.1f} s, warm {w:.1f} s ({out[label]['warm_over_cold']:.2f}x), "
            f"CPU cold {cold['cpu_s']:.1f} s warm {wc:.1f} s, "
            f"backend {warm[-1]['backend'] if warm else '-'}")
    return out


def engine_report(out: dict) -> str:
    """The per-precision start-up table of ``engine_starts``."""
    rows = [[label, num(r["cold"]["s"]), num(r["warm_s"]), num(r["warm_over_cold"], 2), num(r["cold"]["cpu_s"]),
             num(r["warm_cpu_s"]), num(r["warm_over_cold_cpu"], 2),
             (r["warm_runs"] or [r["cold"]])[-1]["backend"] or "-",
             f"wall {'yes' if r['target_met'] else 'NO'}, CPU {'yes' if r['target_met_cpu'] else 'NO'}",
             "" if r["cold"]["exit_code"] == 0 else f"cold exit {r['cold']['exit_code']}"] for label, r in out.items()]
    return table(["precision", "cold s", "warm s", "x cold", "cold CPU s", "warm CPU s", "x cold", "backend",
                  f"warm <= {TARGET_ENGINE_WARM_S:g} s", "notes"],
                 rows, title="start-up per precision: `python -m webapp warm` in a fresh process, launch to ready "
                             "(imports, weights, compile or package load, warm-up, self-test), cold vs warm cache;\n"
                             "CPU s: its CPU time (steadier than wall time on a shared box; a cold start's leaves out inductor's "
                             "compile worker processes)")


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
        labels = [p.strip() for p in args.precisions.split(",") if p.strip()]
        base = {k: v for k, v in settings.items() if k not in ("PRECISION", "CACHE_DIR")}
        out["engine_starts"] = engine_starts(labels, base, tmp, rounds) if labels else {}
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
    if out.get("engine_starts"):
        lines += ["", engine_report(out["engine_starts"])]
    for label, r in [("cold", cold)] + [(f"warm {i + 1}", w) for i, w in enumerate(out["warm_runs"])]:
        if r["log_problems"] or r["exit_code"] != 0:
            lines.append(f"{label}: exit {r['exit_code']}, log: {r['log_problems'][:2]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
