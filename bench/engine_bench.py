"""Our ``Engine`` against eager PyTorch, ONNX Runtime and OpenVINO: speed and fidelity, in one run.

What it measures, all in one process, on the same inputs and the same thread count:

* **Speed** (ResNet-18, seeded weights, 224x224; ``--time-offline`` adds EfficientNet-Lite0):
  batch-1 latency (median ms) and batch-8 throughput (median images/s) of every runtime and
  precision below, each after its own warm-up. Runtimes are timed **round-robin**: every round
  runs a short block of bs1 then bs8 calls of each runtime, in an order rotated each round, and
  the medians are taken over all rounds. A machine that gets busier or quieter mid-run then
  slows every runtime alike, so the ratios stay meaningful even where absolute times are noisy.
  The first call of each block is not timed (it lets the thread pool of the runtime that ran
  before go back to sleep, and this one's wake up).
* **Speed-up** against the baseline, eager fp32 (bs1: its latency / ours; bs8: ours / its
  throughput), and **against OpenVINO at the same precision** (bs1: latency / OV's, lower is
  better; bs8: throughput / OV's, higher is better).
* **Logit error**: ``max |logits - ref| / max |ref|`` against eager fp32 of the same weights, over
  a fixed batch: the shared photos (``../shared/images``), decoded and preprocessed with our own
  pipeline (``webapp.imaging``, fast decode as served).
* **Top-1 agreement with fp32** of the real-weight offline model (EfficientNet-Lite0): on the
  shared photos plus deterministic crops / flips / rescales of them generated in memory (256
  photos in all; 32 with ``--quick``), the share whose top-1 class equals eager fp32's.
  (ResNet-18's seeded weights have no meaningful top-1, so only its logit error is reported.)

The runtimes and their configuration (eager fp32, ours fp32/bf16/int8, ONNX Runtime fp32/int8,
OpenVINO fp32/bf16/int8; ``threads`` = ``--threads``, default every core this process may use)
are described in ``bench/runtimes.py``, which builds them. Each runtime's effective configuration
(and, for OV, what it resolved: streams, threads, precision, pinning) lands in the result under
``configs``. A runtime or export that fails is reported in the table and the JSON with its error,
never hidden; the others still run.

Usage (repo root, venv with ``requirements-bench.txt``)::

    python bench/engine_bench.py --quick                 # smoke test: ~1.5 min on 2 quiet cores, warm caches
    python bench/engine_bench.py --json bench.json       # full run
    python bench/engine_bench.py --runtimes ours-bf16,ov-bf16 --rounds 30   # eager fp32 always runs

The first run compiles every Engine (and quantizes int8) and takes a few minutes more. Run it on
a quiet machine: under CPU contention torch's OpenMP threads, which spin-wait at every op's
barrier, slow down far more than ORT's and OV's pools (seen here: eager bs1 4-10x slower under
a load average of 5-15 on 2 cores, while ORT and OV slowed ~2x), which round-robin timing cannot
cancel; the table warns when the load average was high.

Importable: ``add_arguments(parser)`` and ``run(args) -> dict`` (JSON-serialisable; its
``table`` is the printed text).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import log, num, table  # noqa: E402
from bench import main as bench_main  # noqa: E402
from bench.inputs import BATCH, Inputs, augmented, make_inputs, shared_photos  # noqa: E402
from bench.runtimes import BASELINE, LABELS, OPSET, RUNTIMES, Env, Runner, build_all, short_error, versions  # noqa: E402
from webapp import models, settings  # noqa: E402
from webapp import engine as engine_mod  # noqa: E402
from webapp.cpu import cpu_info  # noqa: E402

TIMED_MODEL = "resnet18_seeded"
OFFLINE_MODEL = "efficientnet_lite0"
# Base vector ISA flags (of webapp.cpu.CPU_FLAGS): the report's header names only the extensions beyond them.
BASE_ISA = ("avx", "avx2", "fma", "avx512f", "avx512bw")


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------

def run_batched(runner: Runner, x: torch.Tensor) -> np.ndarray:
    """``runner``'s logits (N, C) float32 for ``x`` (N, 3, S, S) float32, in chunks of ``BATCH``."""
    return np.concatenate([runner.predict(x[i:i + BATCH].contiguous()) for i in range(0, len(x), BATCH)])


def fidelity(runners: dict[str, Runner], inputs: Inputs, *, top1: bool) -> dict[str, dict]:
    """Logit error on the fixed batch and (``top1``) top-1 agreement on the fidelity set, vs eager fp32.

    By key: ``rel_err`` (max |logits - ref| / max |ref|), ``top1_agree`` (share, 0..1), ``fidelity_s``
    (s); or ``error``. Empty where the baseline failed.
    """
    ref_runner = runners.get(BASELINE)
    if ref_runner is None or ref_runner.predict is None:
        return {}
    ref_fixed = run_batched(ref_runner, inputs.fixed)
    ref_top = run_batched(ref_runner, inputs.fidelity).argmax(1) if top1 else None
    out = {}
    for key, runner in runners.items():
        if runner.predict is None:
            continue
        t0 = time.perf_counter()
        try:
            logits = run_batched(runner, inputs.fixed)
            row = {"rel_err": float(np.abs(logits - ref_fixed).max() / np.abs(ref_fixed).max()),
                   "photos": len(inputs.fixed)}
            if top1:
                top = run_batched(runner, inputs.fidelity).argmax(1)
                agree = int((top == ref_top).sum())
                row.update(top1_agree=agree / len(ref_top), top1_n=len(ref_top), top1_agree_count=agree)
            row["fidelity_s"] = round(time.perf_counter() - t0, 2)
        except Exception as exc:
            log(f"  fidelity of {key} FAILED: {short_error(exc)}")
            row = {"error": short_error(exc)}
        out[key] = row
    return out


def _stats(samples: list[float]) -> dict:
    """median, p10, p90 (``statistics.quantiles``, deciles) and n of ``samples``, in their own unit."""
    qs = statistics.quantiles(samples, n=10) if len(samples) >= 2 else [samples[0]] * 9
    return {"median": statistics.median(samples), "p10": qs[0], "p90": qs[-1], "n": len(samples)}


def timing(runners: dict[str, Runner], inputs: Inputs, *, rounds: int, iters1: int, iters8: int) -> dict[str, dict]:
    """Round-robin timing: each round, every runner does 1 untimed + ``iters1`` bs1 calls, then 1 + ``iters8`` bs8.

    By key: ``bs1_ms`` (latency stats, ms) and ``bs8_img_s`` (throughput stats, images/s), as ``_stats``.
    """
    live = [r for r in runners.values() if r.predict is not None]
    samples = {r.key: {1: [], BATCH: []} for r in live}
    clock = time.perf_counter
    for rnd in range(rounds):
        k = rnd % len(live)
        order = live[k:] + live[:k]
        if rnd % 2:
            order.reverse()  # who runs after whom changes too
        for runner in order:
            for bs, x, iters in ((1, inputs.bs1, iters1), (BATCH, inputs.bs8, iters8)):
                runner.predict(x)
                for _ in range(iters):
                    t0 = clock()
                    runner.predict(x)
                    samples[runner.key][bs].append(clock() - t0)
        if rnd == 0 or (rnd + 1) % max(1, rounds // 5) == 0:
            log(f"  timing round {rnd + 1}/{rounds}")
    out = {}
    for key, by_bs in samples.items():
        lat = _stats([s * 1e3 for s in by_bs[1]])
        thr = _stats([BATCH / s for s in by_bs[BATCH]])
        out[key] = {"bs1_ms": lat, f"bs{BATCH}_img_s": thr}
    return out


def ratios(rows: dict[str, dict]) -> None:
    """Add speed-up vs the baseline (``speedup_bs1``: its ms / ours, ``speedup_bs8``: ours img/s / its) and
    ratios to OpenVINO at the same precision (``vs_ov_bs1_latency``, ``vs_ov_bs8_throughput``), in place."""
    base = rows.get(BASELINE, {})
    tkey = f"bs{BATCH}_img_s"
    for key, row in rows.items():
        if "bs1_ms" not in row:
            continue
        lat, thr = row["bs1_ms"]["median"], row[tkey]["median"]
        if "bs1_ms" in base:
            row["speedup_bs1"] = base["bs1_ms"]["median"] / lat
            row[f"speedup_bs{BATCH}"] = thr / base[tkey]["median"]
        ov = rows.get(f"ov-{row['precision']}", {})
        if "bs1_ms" in ov:
            row["vs_ov_bs1_latency"] = lat / ov["bs1_ms"]["median"]
            row[f"vs_ov_bs{BATCH}_throughput"] = thr / ov[tkey]["median"]


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def _err(value) -> str:
    """A relative error (fraction) as a percentage cell."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value * 100:.3f}%" if value < 0.1 else f"{value * 100:.1f}%"


def _pct(v) -> str:
    """A share (0..1) as a percentage cell."""
    return "-" if v is None else f"{v * 100:.1f}%"


def _model_table(result: dict, name: str, footnotes: list[list]) -> str:
    """One timed model's rows; notes and failures become numbered footnotes."""
    tkey = f"bs{BATCH}_img_s"
    rows = result["models"][name]["rows"]
    off = result["models"].get(OFFLINE_MODEL, {}).get("rows", {}) if name == TIMED_MODEL else {}
    headers = ["runtime", "bs1 ms", "x eager", "/OV", f"bs{BATCH} img/s", "x eager", "/OV", "logit err"]
    if off:
        headers += ["L0 top1", "L0 err"]
    headers += ["build s", "notes"]
    cells = []

    def mark(label: str, text: str) -> str:  # one footnote per distinct text, naming every row it concerns
        for i, (labels, seen) in enumerate(footnotes, 1):
            if seen == text:
                if label not in labels:
                    labels.append(label)
                return f"[{i}]"
        footnotes.append([[label], text])
        return f"[{len(footnotes)}]"

    for runtime, precision in RUNTIMES:
        key = f"{runtime}-{precision}"
        if key not in rows:
            continue
        r, o = rows[key], off.get(key, {})
        marks = []
        if r.get("error"):
            line = ["FAILED"] + ["-"] * 6
            marks.append(mark(f"{LABELS[runtime]} {precision}", r["error"]))
        else:
            line = [num(r.get("bs1_ms", {}).get("median"), 2), num(r.get("speedup_bs1"), 2),
                    num(r.get("vs_ov_bs1_latency"), 2), num(r.get(tkey, {}).get("median"), 1),
                    num(r.get(f"speedup_bs{BATCH}"), 2), num(r.get(f"vs_ov_bs{BATCH}_throughput"), 2),
                    "ref" if key == BASELINE else _err(r.get("rel_err"))]
            marks += [mark(f"{LABELS[runtime]} {precision}", n) for n in r.get("notes", [])]
        if off:
            if o.get("error"):
                line += ["FAILED", "-"]
                marks.append(mark(f"EfficientNet-Lite0 {LABELS[runtime]} {precision}", o["error"]))
            else:
                line += ["ref", "ref"] if key == BASELINE else [_pct(o.get("top1_agree")), _err(o.get("rel_err"))]
                marks += [mark(f"EfficientNet-Lite0 {LABELS[runtime]} {precision}", n)
                          for n in o.get("notes", []) if n not in r.get("notes", [])]
        cells.append([f"{LABELS[runtime]} {precision}"] + line + [num(r.get("build_s"), 0), " ".join(marks)])
    title = {TIMED_MODEL: "ResNet-18 (seeded weights)", OFFLINE_MODEL: "EfficientNet-Lite0 (real weights)"}.get(name, name)
    return table(headers, cells, title=f"{title}, 224x224: batch 1 latency, batch {BATCH} throughput (medians)")


def format_table(result: dict) -> str:
    """The fixed-width text report of a ``run`` result."""
    host, s = result["host"], result["settings"]
    flags = ", ".join(f for f, on in host["cpu_flags"].items() if on and f not in BASE_ISA) or "none"
    lines = [
        f"Engine benchmark {result['date']}: {host['cpu_model']} ({flags}; oneDNN native bf16: "
        f"{'yes' if host['onednn_native_bf16'] else 'no'}), {result['threads']} threads for every runtime",
        "  " + "  ".join(f"{k} {v}" for k, v in result["versions"].items() if v),
        f"  timing: {s['rounds']} round-robin rounds x ({s['iters_bs1']} bs1 + {s['iters_bs8']} bs{BATCH}) timed calls "
        f"per runtime{' (--quick)' if s['quick'] else ''}",
    ]
    for name, ld in result.get("load", {}).items():
        busy = ld["loadavg_1min_after"]  # includes this run's own ~threads
        if busy > (host["cpu_count"] or 1) + 1:
            lines.append(f"  WARNING: load average {busy:.1f} on {host['cpu_count']} CPUs after timing {name}: other work "
                         f"was running. Torch's OpenMP threads (active spin-waits) slow down far more than ORT's or "
                         f"OV's under contention, so the ratios are biased against torch: rerun on a quiet machine.")
    footnotes: list[list] = []  # [[row labels], text]
    timed = [m for m in result["models"] if result["models"][m].get("timed")]
    for name in timed:
        lines += ["", _model_table(result, name, footnotes)]
    lines += ["",
              "x eager: speed-up over eager fp32 (bs1: its latency / this one; bs8: this throughput / its).",
              "/OV: ratio to OpenVINO at the same precision: bs1 latency ratio (lower is better), "
              "bs8 throughput ratio (higher is better).",
              f"logit err: max|logits - eager fp32| / max|eager fp32| over the {len(result['photos'])} shared photos."]
    if TIMED_MODEL in timed and OFFLINE_MODEL in result["models"]:
        lines.append(f"L0 top1, L0 err: EfficientNet-Lite0 (real weights): top-1 agreement with its eager fp32 on "
                     f"{result['models'][OFFLINE_MODEL]['fidelity_photos']} photos (shared + crops/flips/rescales), "
                     f"and its logit error as above.")
    for name, m in result["models"].items():
        if m.get("timed") or (name == OFFLINE_MODEL and TIMED_MODEL in timed):
            continue
        lines += ["", f"{name}: fidelity only ({m.get('fidelity_photos')} photos for top-1)"]
        for key, r in m["rows"].items():
            msg = f"FAILED: {r['error']}" if r.get("error") else f"top1 {_pct(r.get('top1_agree'))}, err {_err(r.get('rel_err'))}"
            lines.append(f"  {key:<12} {msg}")
    for name, m in result["models"].items():
        if (m.get("onnx_export") or "").startswith("failed"):
            lines.append(f"{name}: ONNX export {m['onnx_export']}")
    if footnotes:
        lines += [""] + [f"[{i}] {', '.join(labels)}: {text}" for i, (labels, text) in enumerate(footnotes, 1)]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 3 rounds of few calls, 32 fidelity photos (< 3 min on 2 quiet cores, warm caches)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON here")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads for every runtime; 0: the cores this process may use")
    parser.add_argument("--rounds", type=int, help="round-robin timing rounds (None: 8; --quick 3)")
    parser.add_argument("--iters-bs1", type=int, help="timed bs1 calls per runtime per round (None: 10; --quick 4)")
    parser.add_argument("--iters-bs8", type=int, help="timed bs8 calls per runtime per round (None: 4; --quick 2)")
    parser.add_argument("--fidelity-photos", type=int,
                        help="photos for top-1 agreement: the shared ones + generated variants (None: 256; --quick 32)")
    parser.add_argument("--runtimes", default="all",
                        help="comma-separated subset of: " + ",".join(f"{r}-{p}" for r, p in RUNTIMES)
                             + " (eager-fp32, the reference, always runs)")
    parser.add_argument("--time-offline", action="store_true", help="also time EfficientNet-Lite0 (default: fidelity only)")
    parser.add_argument("--no-offline", action="store_true", help="skip EfficientNet-Lite0 altogether")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated photo variants")
    parser.add_argument("--workdir", type=Path, help="where ONNX files go (default: a temporary directory)")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "photo-classifier"),
                        help="ours: inductor kernels (unless TORCHINDUCTOR_CACHE_DIR is set) and int8 programs are "
                             "kept here across runs, as the service keeps them ('' quantizes int8 afresh every run)")
    return parser


def run(args: argparse.Namespace) -> dict:
    """Build every runtime, measure, print the table; return every number (JSON-serialisable)."""
    t_start = time.perf_counter()
    defaults = vars(add_arguments(argparse.ArgumentParser()).parse_args([]))
    args = argparse.Namespace(**{**defaults, **vars(args)})  # a caller's Namespace may lack some options
    quick = bool(args.quick)
    rounds = args.rounds or (3 if quick else 8)
    iters1 = args.iters_bs1 or (4 if quick else 10)
    iters8 = args.iters_bs8 or (2 if quick else 4)
    n_fid = args.fidelity_photos or (32 if quick else 256)
    if not logging.getLogger().handlers:  # the engine says where its int8 program came from, and compile times
        logging.basicConfig(level=logging.WARNING, format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("webapp").setLevel(logging.INFO)
    affinity_before = sorted(os.sched_getaffinity(0))
    threads = engine_mod.configure_threads(args.threads or len(affinity_before))
    keys = [f"{r}-{p}" for r, p in RUNTIMES]
    if args.runtimes != "all":
        wanted = {k.strip() for k in args.runtimes.split(",") if k.strip()}
        unknown = wanted - set(keys)
        if unknown:
            raise SystemExit(f"unknown runtimes {sorted(unknown)}; known: {', '.join(keys)}")
        keys = [k for k in keys if k in wanted or k == BASELINE]

    log(f"{threads} threads, cores {affinity_before}; decoding photos")
    photos = shared_photos()
    scenes = [img for name, img in photos if not name.startswith("phone")] or [img for _, img in photos]
    extra = augmented(scenes, max(0, n_fid - len(photos)), seed=args.seed)  # the phone photos are dog.jpg again

    cpu = cpu_info()
    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"cpu_model": cpu["model"] or platform.processor() or "unknown", "cpu_flags": cpu["flags"],
                 "onednn_native_bf16": engine_mod.native_bf16(), "int8_vnni": engine_mod.int8_vnni(),
                 "cores_allowed": affinity_before, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                 "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "GOMP_", "ONEDNN_"))}},
        "threads": threads,
        "versions": versions(),
        "settings": {"quick": quick, "rounds": rounds, "iters_bs1": iters1, "iters_bs8": iters8,
                     "fidelity_photos": len(photos) + len(extra), "seed": args.seed, "runtimes": keys,
                     "batch": BATCH, "opset_requested": OPSET},
        "photos": [n for n, _ in photos],
        "models": {},
        "configs": {},
        "load": {},
    }
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else None
    if cache_dir:  # as the service does: its compiled kernels (and our int8 programs) survive runs
        cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    result["settings"]["cache_dir"] = str(cache_dir) if cache_dir else None
    model_names = [TIMED_MODEL] + ([] if args.no_offline else [OFFLINE_MODEL])
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="engine-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        env = Env(threads, workdir, cache_dir)
        for name in model_names:
            loaded = models.load_model(settings.load(environ={}, overrides={"MODEL": name}))
            inputs = make_inputs(loaded, photos, extra if name == OFFLINE_MODEL else [])
            runners = build_all(loaded, inputs, env, keys)
            top1 = name == OFFLINE_MODEL
            log(f"{name}: fidelity ({len(inputs.fixed)} photos for logit error"
                + (f", {len(inputs.fidelity)} for top-1)" if top1 else ")"))
            fid = fidelity(runners, inputs, top1=top1)
            timed = name == TIMED_MODEL or args.time_offline
            times = {}
            if timed:
                load_before = os.getloadavg()
                log(f"{name}: timing {sum(r.predict is not None for r in runners.values())} runtimes round-robin")
                times = timing(runners, inputs, rounds=rounds, iters1=iters1, iters8=iters8)
                result["load"][name] = {"loadavg_1min_before": load_before[0], "loadavg_1min_after": os.getloadavg()[0]}
            rows = {}
            for key, r in runners.items():
                row = {"runtime": r.runtime, "precision": r.precision, "build_s": r.build_s, "notes": r.notes}
                if r.error:
                    row["error"] = r.error
                row.update(fid.get(key, {}))
                row.update(times.get(key, {}))
                rows[key] = row
                result["configs"][f"{name}:{key}"] = r.config
            ratios(rows)
            onnx = env.onnx.get(name)
            result["models"][name] = {"rows": rows, "timed": timed, "weights": loaded.weights,
                                      "fidelity_photos": len(inputs.fidelity) if top1 else None,
                                      "onnx_export": (f"failed: {short_error(onnx)}" if isinstance(onnx, BaseException)
                                                      else env.onnx.get(name + ":exporter"))}
            del runners, inputs
            gc.collect()
    affinity_after = sorted(os.sched_getaffinity(0))
    if affinity_after != affinity_before:
        result["host"]["affinity_changed_to"] = affinity_after
        log(f"WARNING: this process's CPU affinity changed during the run: {affinity_before} -> {affinity_after}")
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    result["table"] = format_table(result)
    print(result["table"])
    print(f"\n(wall time {result['wall_s']} s)")
    return result


def main(argv=None) -> int:
    """``python bench/engine_bench.py ...``: parse, run, print, write ``--json``; 0."""
    bench_main(__doc__, add_arguments, run, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
