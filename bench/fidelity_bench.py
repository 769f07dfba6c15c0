"""bf16 fidelity, layer group by layer group: where bf16 loses the model's answers, and what keeping it costs.

``python -m bench --only fidelity [--quick]`` or ``python bench/fidelity_bench.py [--quick] [--json out.json]``.

For each model (``efficientnet_lite0``, real weights; ``resnet18_seeded``, seeded weights: its top-1
means nothing, so only its logit error and speed count), every variant is compared with eager fp32
of the same weights on the same inputs:

* **eager**: fp32 (the reference); ``autocast`` (the whole model under bf16 autocast, logits in bf16:
  what the JIT path did before ``webapp/bf16.py``); the bf16 policy (``webapp.bf16.bf16_policy``) with
  each set of layer groups kept in fp32 (``stem``, ``head``, ``depthwise``, ``project``, ...).
* **compiled**: ``torch.compile`` (inductor, ``freezing``: BatchNorm folded into the conv weights,
  channels_last) of fp32 (the speed reference of compiled rows), of autocast and of the policy.
* **aoti**: the AOTInductor package (freezing on, as ``engine.load_or_build_aoti`` builds it) of
  autocast and of the policy: what a worker with a cache directory serves; and the policy's package with
  its close calls (top two under ``BF16_RECHECK_PTS`` points apart) answered by fp32's package, as served
  (``+recheck``; ``rechecked``, the share of the inputs fp32 answered).

Inputs: real photos decoded and preprocessed with the service's pipeline: the shared photos
(``../shared/images``, 9) and the shipped calibration photos (``webapp/calibration``, 28), each as is,
centre-cropped square, mirrored and halved (148 inputs; ``--quick``: the shared ones in 4 views and
the calibration ones as is, 64).

Columns: ``top-1`` agreement with fp32 (share); ``sure`` the agreement where fp32's top-1
probability is >= 0.5 (the target is 100%); ``max pts`` / ``mean pts`` the change of fp32's top-1
class probability (percentage points) over every input, ``shared pts`` over the shared photos'
views only (target: <= 2); ``ties`` inputs whose top-3 holds two equal probabilities at the 6
decimals the API answers; ``logit err`` max |logits - fp32| / max |fp32|; ``bs`` the largest change
(points) of any probability in a shared photo's top-3 between batch 1 and batch 8 (compiled rows);
``x fp32``: batch-8 images/s over fp32's of the same kind (eager rows vs eager fp32, compiled and
aoti rows vs compiled fp32), medians of round-robin timing in this run, with one intra-op thread
(as each pinned worker runs) in that thread's CPU time by default (``--threads``); ``set x fp32`` the same
over all the inputs in batches of 8, for compiled fp32 and the policy's package with and without rechecks
(what they cost depends on the photo). Targets (issue #14 item 1): top-1 >= 99%, sure 100%, shared pts
<= 2, no ties, x fp32 (set x fp32 where measured) >= 1.3.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from PIL import Image, ImageOps

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import log, num, table  # noqa: E402
from bench import main as bench_main  # noqa: E402
from bench.inputs import shared_photos  # noqa: E402
from webapp import assets, bf16, imaging, models, settings  # noqa: E402

OFFLINE_MODEL = "efficientnet_lite0"
SEEDED_MODEL = "resnet18_seeded"
BATCH = 8
# Layer groups kept in fp32, per eager variant (each model's policy: webapp/bf16.py keep_fp32_for).
EAGER_SWEEP = {
    "policy: none": (),
    "policy: head": ("head",),
    "policy: stem+head": ("stem", "head"),
    "policy: head+depthwise": ("head", "depthwise"),
    "policy: head+early_depthwise": ("head", "early_depthwise"),
    "policy: stem+head+early_depthwise": ("stem", "head", "early_depthwise"),
    "policy: stem+head+early_depthwise+bn": ("stem", "head", "early_depthwise", "bn"),
    "policy: stem+head+depthwise": ("stem", "head", "depthwise"),
    "policy: stem+head+depthwise+bn": ("stem", "head", "depthwise", "bn"),
    "policy: stem+head+depthwise+project": ("stem", "head", "depthwise", "project"),
}
QUICK_SWEEP = ("policy: stem+head", "policy: stem+head+early_depthwise", "policy: stem+head+early_depthwise+bn")
# Compiled (and packaged) rows besides fp32, autocast and the policy: the policy without its BN group
# (inductor's freezing then folds BN into the bf16 conv weights and a bf16 bias), and more groups in fp32.
COMPILED_SWEEP = {"stem+head+early_depthwise": ("stem", "head", "early_depthwise"),
                  "stem+head+depthwise+bn": ("stem", "head", "depthwise", "bn")}
QUICK_COMPILED = ("stem+head+early_depthwise",)
RECHECK_PTS = settings.BY_NAME["BF16_RECHECK_PTS"].default  # the served bf16's close calls, run again in fp32


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

def views(img: Image.Image) -> list[Image.Image]:
    """``img`` as is, centre-cropped to a square, mirrored, and at half size (bicubic)."""
    w, h = img.size
    s = min(w, h)
    square = img.crop(((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s))
    half = img.resize((max(1, w // 2), max(1, h // 2)), Image.Resampling.BICUBIC)
    return [img, square, ImageOps.mirror(img), half]


def make_inputs(loaded: models.LoadedModel, *, quick: bool) -> tuple[torch.Tensor, int, list[str]]:
    """``(N, 3, S, S) float32`` inputs (module docstring), how many of the first are the shared photos'
    views, and a name per input."""
    transform = imaging.build_transform(loaded.preprocessing)
    shared = shared_photos()
    calib = [(p.name, imaging.decode(p.read_bytes(), max_pixels=2**40, name=p.name).image)
             for p in assets.calibration_files()]
    kinds = ("", "square", "mirror", "half")
    images, names = [], []
    for name, img in shared:
        for kind, v in zip(kinds, views(img)):
            images.append(v)
            names.append(f"{name} {kind}".strip())
    n_shared = len(images)
    for name, img in calib:
        for kind, v in zip(kinds, [img] if quick else views(img)):
            images.append(v)
            names.append(f"{name} {kind}".strip())
    x = torch.stack([imaging.preprocess(v, transform) for v in images])
    return x.contiguous(memory_format=torch.channels_last), n_shared, names


# --------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------

def eager(fn: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` run under inference mode, logits as fp32."""
    def predict(x):
        with torch.inference_mode():
            return fn(x).float()
    return predict


def compiled(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``torch.compile`` with freezing, as ``webapp.engine.Engine`` compiles; every call pads to ``BATCH``
    rows (one graph; batch 1 gets its own, as warm-up gives it one)."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    fn = torch.compile(module, backend="inductor")

    def predict(x):
        n = len(x)
        if 1 < n < BATCH:
            x = torch.cat([x, x[:1].expand(BATCH - n, -1, -1, -1)])
        with torch.inference_mode():
            return fn(x.contiguous(memory_format=torch.channels_last)).float()[:n]
    return predict


def aoti(module: torch.nn.Module, size: int, workdir: Path, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An AOTInductor package of ``module`` (a ``bf16_policy``), built as ``engine.load_or_build_aoti`` builds one."""
    from torch.export import Dim, export

    path = workdir / f"{name}.pt2"
    example = torch.zeros(2, 3, size, size).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        program = export(module, (example,), dynamic_shapes=({0: Dim("batch", min=1, max=1024)},), strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs={"freezing": True})
    fn = torch._inductor.aoti_load_package(str(path))

    def predict(x):
        with torch.inference_mode():
            return fn(x.contiguous(memory_format=torch.channels_last)).float()
    return predict


def build_variants(module: torch.nn.Module, size: int, *, quick: bool, compile: bool, real: bool,
                   workdir: Path, policy: tuple[str, ...] = bf16.BF16_KEEP_FP32,
                   ) -> dict[str, tuple[str, Callable | None, str | None, float]]:
    """name -> (kind, predict or None, error or None, build s). ``real``: weights with a meaningful top-1;
    ``policy``: the model's own bf16 policy (``bf16.keep_fp32_for``); where it is not the default one
    (``bf16.BF16_KEEP_FP32``), that one gets a compiled row too, to compare."""
    specs: list[tuple[str, str, Callable[[], Callable]]] = [
        ("eager fp32", "eager", lambda: eager(module)),
        ("eager autocast", "eager", lambda: eager(bf16.bf16_policy(module, ()))),
    ]
    sweep = [k for k in EAGER_SWEEP if not quick or k in QUICK_SWEEP] if real else ["policy: head", "policy: stem+head"]
    specs += [(f"eager {k}", "eager", lambda k=k: eager(bf16.bf16_policy(module, EAGER_SWEEP[k]))) for k in sweep]
    if compile:
        specs += [("compiled fp32", "compiled", lambda: compiled(module)),
                  ("compiled autocast", "compiled", lambda: compiled(bf16.bf16_policy(module, ()))),
                  (f"compiled policy ({'+'.join(policy)})", "compiled", lambda: compiled(bf16.bf16_policy(module, policy)))]
        specs += [(f"compiled {k}", "compiled", lambda k=k: compiled(bf16.bf16_policy(module, COMPILED_SWEEP[k])))
                  for k in COMPILED_SWEEP if real and (not quick or k in QUICK_COMPILED) and COMPILED_SWEEP[k] != policy]
        if policy != bf16.BF16_KEEP_FP32:
            default = bf16.BF16_KEEP_FP32
            specs.append((f"compiled {'+'.join(default)}", "compiled", lambda: compiled(bf16.bf16_policy(module, default))))
        if real:
            if not quick:
                specs.append(("aoti autocast", "aoti", lambda: aoti(bf16.bf16_policy(module, ()), size, workdir, "autocast")))
            specs.append((f"aoti policy ({'+'.join(policy)})", "aoti",
                          lambda: aoti(bf16.bf16_policy(module, policy), size, workdir, "policy")))
    out = {}
    for name, kind, make in specs:
        t0 = time.perf_counter()
        log(f"  building {name}")
        try:
            fn = make()
            fn(torch.zeros(BATCH, 3, size, size))  # compiles here, not while timed
            fn(torch.zeros(1, 3, size, size))
            out[name] = (kind, fn, None, time.perf_counter() - t0)
        except Exception as exc:  # one variant that fails is reported, the others still run
            log(f"  {name} FAILED: {type(exc).__name__}: {exc}")
            out[name] = (kind, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", time.perf_counter() - t0)
    served = next((n for n in out if n.startswith("aoti policy")), None)
    if served and out[served][1] is not None:
        # bf16 as a worker serves it: the package, its close calls answered by fp32's package (startup.recheck_engine),
        # which takes any batch size (compiled fp32 here pads 2..7 rows to 8: a recheck would cost a whole batch)
        t0 = time.perf_counter()
        log("  building aoti fp32 (the rechecks')")
        try:
            fp32 = aoti(module, size, workdir, "fp32")
            out[f"{served} +recheck{RECHECK_PTS:g}"] = ("aoti", rechecked(out[served][1], fp32), None,
                                                      time.perf_counter() - t0)
        except Exception as exc:  # reported like any variant that fails
            out[f"{served} +recheck{RECHECK_PTS:g}"] = ("aoti", None, f"{type(exc).__name__}: {exc}"[:200],
                                                      time.perf_counter() - t0)
    return out


def rechecked(fn: Callable, fp32: Callable, pts: float | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` with its close calls (top two probabilities under ``pts`` points apart, default ``RECHECK_PTS``)
    answered by ``fp32``, as ``engine.Engine.add_recheck`` serves them; ``.count`` counts the rows rechecked."""
    pts = RECHECK_PTS if pts is None else pts

    def predict(x):
        out = fn(x)
        close = bf16.close_calls(out, pts)
        if len(close):
            out = out.clone()
            out[close] = fp32(x[close])
            predict.count += len(close)
        return out
    predict.count = 0
    return predict


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------

def logits(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    """``fn``'s logits ``(N, C) float32`` for ``x``, in batches of ``BATCH``."""
    return torch.cat([fn(x[i:i + BATCH]) for i in range(0, len(x), BATCH)])


def batch_change(fn: Callable, x: torch.Tensor) -> float:
    """Largest change (points) of any probability among each input's top-3 between batch 1 and batch 8."""
    at8 = logits(fn, x).softmax(1)
    at1 = torch.cat([fn(x[i:i + 1]) for i in range(len(x))]).softmax(1)
    top = at8.topk(3, dim=1).indices
    return float((at8.gather(1, top) - at1.gather(1, top)).abs().max() * 100)


def timing(fns: dict[str, Callable], x: torch.Tensor, *, rounds: int, iters: int,
           clock: Callable[[], float] = time.perf_counter, only: list[str] | None = None,
           whole: bool = False) -> dict[str, float]:
    """Round-robin batch-8 timing (order rotated each round, one untimed call first): name -> median images/s
    of ``clock`` time (with one intra-op thread, ``time.thread_time``: CPU time, which other processes on a
    shared box do not stretch). ``only``: these names; ``whole``: each timed call is all of ``x`` in batches
    of 8 (what rechecks cost depends on the photo), else the first 8 inputs."""
    batch = x[:BATCH].contiguous(memory_format=torch.channels_last)
    names = list(only or fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            fns[name](batch)
            for _ in range(iters):
                t0 = clock()
                n = len(logits(fns[name], x)) if whole else len(fns[name](batch))
                samples[name].append(n / (clock() - t0))
    return {n: statistics.median(s) for n, s in samples.items()}


def measure_model(model_name: str, *, quick: bool, compile: bool, rounds: int, iters: int, workdir: Path) -> dict:
    """Every variant of one model: fidelity figures against eager fp32, speed against fp32 of its kind."""
    loaded = models.load_model(settings.load(environ={}, overrides={"MODEL": model_name}))
    module = loaded.module.eval().to(memory_format=torch.channels_last)
    for p in module.parameters():
        p.requires_grad_(False)
    real = not loaded.untrained
    x, n_shared, names = make_inputs(loaded, quick=quick)
    log(f"{model_name}: {len(x)} inputs ({n_shared} from the shared photos)")
    variants = build_variants(module, loaded.preprocessing.crop, quick=quick, compile=compile, real=real,
                              workdir=workdir, policy=bf16.keep_fp32_for(model_name))
    ref = logits(variants["eager fp32"][1], x)
    top2 = ref.softmax(1).topk(2, dim=1).values
    margin = ((top2[:, 0] - top2[:, 1]) * 100).tolist()
    rows: dict[str, dict] = {}
    for name, (kind, fn, error, build_s) in variants.items():
        row: dict = {"kind": kind, "build_s": round(build_s, 1)}
        if fn is None:
            rows[name] = {**row, "error": error}
            continue
        before = getattr(fn, "count", None)
        got = logits(fn, x)
        if before is not None:
            row["rechecked"] = (fn.count - before) / len(x)  # share of the inputs fp32 answered
        row.update(bf16.fidelity(ref, got))
        row["shared_max_change_pts"] = bf16.fidelity(ref[:n_shared], got[:n_shared])["max_change_pts"]
        flips = (got.argmax(1) != ref.argmax(1)).nonzero()[:, 0].tolist()
        # Each changed input with fp32's own margin between its top two (points): near-ties flip on any noise.
        row["flipped"] = [f"{names[i]} ({margin[i]:.2f})" for i in flips] if real else []
        if kind != "eager":
            row["batch_change_pts"] = batch_change(fn, x[:n_shared])
        rows[name] = row
    log(f"  timing {len(rows)} variants, {rounds} rounds")
    live = {n: v[1] for n, v in variants.items() if v[1] is not None}
    one = torch.get_num_threads() == 1  # the work runs on this thread: its CPU time is the cost
    speed = timing(live, x, rounds=rounds, iters=iters, clock=time.thread_time if one else time.perf_counter)
    for name, img_s in speed.items():
        base = speed.get("compiled fp32" if rows[name]["kind"] != "eager" else "eager fp32")
        rows[name].update(img_s=img_s, x_fp32=img_s / base if base else None)
    # Rechecks depend on the photo: the served bf16, with and without them, timed over the whole set too.
    whole = [n for n in live if n == "compiled fp32" or n.startswith("aoti policy")]
    if any("+recheck" in n for n in whole):
        log(f"  timing {len(whole)} variants over the whole set, {rounds} rounds")
        on_set = timing(live, x, rounds=rounds, iters=1, clock=time.thread_time if one else time.perf_counter,
                        only=whole, whole=True)
        for name, img_s in on_set.items():
            rows[name]["set_x_fp32"] = img_s / on_set["compiled fp32"]
    return {"inputs": len(x), "shared_inputs": n_shared, "real_weights": real, "rows": rows,
            "policy": list(bf16.keep_fp32_for(model_name))}


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def meets(row: dict) -> bool:
    """The targets: faithful (``bf16.faithful``, with the 2-point limit on the shared photos) and >= 1.3x fp32."""
    return (bf16.faithful({**row, "max_change_pts": row["shared_max_change_pts"]})
            and (row.get("set_x_fp32", row.get("x_fp32")) or 0) >= bf16.MIN_SPEEDUP)


def format_table(result: dict) -> str:
    """One table per model, then the rows that missed a target and why."""
    out = []
    for model_name, m in result["models"].items():
        real = m["real_weights"]
        headers = ["variant", "top-1", "sure", "max pts", "mean pts", "shared pts", "ties", "logit err", "bs",
                   "x fp32", "img/s", "set x fp32", "rechecked", "targets"]
        rows = []
        for name, r in m["rows"].items():
            if "error" in r:
                rows.append([name, "failed: " + r["error"][:60]] + [""] * (len(headers) - 2))
                continue
            fp32 = name.endswith("fp32")
            rows.append([name, num(100 * r["top1_agree"]) + "%" if real else "-",
                         num(100 * r["sure_agree"], 0) + "%" if real else "-",
                         num(r["max_change_pts"], 2) if real else "-", num(r["mean_change_pts"], 2) if real else "-",
                         num(r["shared_max_change_pts"], 2) if real else "-", r["ties"],
                         f"{100 * r['logit_err']:.2f}%", num(r.get("batch_change_pts"), 2),
                         num(r.get("x_fp32"), 2), num(r.get("img_s"), 1), num(r.get("set_x_fp32"), 2),
                         f"{100 * r['rechecked']:.1f}%" if "rechecked" in r else "-",
                         "ref" if fp32 else ("met" if meets(r) else "missed") if real else "-"])
        out.append(table(headers, rows, title=f"{model_name}: {m['inputs']} inputs ({m['shared_inputs']} from "
                                             f"the shared photos){'' if real else ', seeded weights: logit error and speed only'}"))
        flips = [f"  {name}: {', '.join(r['flipped'])}" for name, r in m["rows"].items() if r.get("flipped")]
        if flips:
            out.append("top-1 changed on (fp32's margin between its top two, points):\n" + "\n".join(flips))
    return "\n\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true",
                        help="64 inputs, 2 eager sweep rows, compiled fp32/autocast/policy and the policy's AOTI "
                             "package only (~5 min on 2 quiet cores, most of it compiling)")
    parser.add_argument("--models", default=f"{OFFLINE_MODEL},{SEEDED_MODEL}", help="comma-separated model names")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only (a minute)")
    parser.add_argument("--rounds", type=int, help="round-robin timing rounds (None: 10; --quick 4)")
    parser.add_argument("--iters", type=int, default=3, help="timed batch-8 calls per variant per round")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1: as each pinned worker of the service runs, timed in CPU time of "
                             "the one thread doing the work, which a shared box does not stretch; 0: every core, wall time)")
    return parser


def run(args: argparse.Namespace) -> dict:
    """Measure every model's variants, print the tables; return every number (JSON-serialisable)."""
    defaults = vars(add_arguments(argparse.ArgumentParser()).parse_args([]))
    args = argparse.Namespace(**{**defaults, **vars(args)})
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    torch._dynamo.config.cache_size_limit = 64  # one graph per variant wrapper: more than the default 8
    rounds = args.rounds or (4 if args.quick else 10)
    t0 = time.perf_counter()
    result: dict = {"quick": bool(args.quick), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "load_avg_start": os.getloadavg()[0], "models": {}}
    with tempfile.TemporaryDirectory(prefix="fidelity-bench-") as tmp:
        for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
            result["models"][model_name] = measure_model(model_name, quick=args.quick, compile=not args.no_compile,
                                                         rounds=rounds, iters=args.iters, workdir=Path(tmp))
            log("done:\n" + format_table({"models": {model_name: result["models"][model_name]}}))  # before the next model
    result["load_avg_end"] = os.getloadavg()[0]
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["table"] = format_table(result)
    print(result["table"])
    print(f"\n(load average {result['load_avg_start']:.1f} at start, {result['load_avg_end']:.1f} at end, "
          f"{result['seconds']:.0f} s)")
    return result


def main(argv: list[str] | None = None) -> int:
    """``python bench/fidelity_bench.py [--quick] [--json out.json]``."""
    bench_main(__doc__, add_arguments, run, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
