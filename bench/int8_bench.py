"""int8 mixed precision: which layers to leave in fp32 so that int8 keeps the model's answers, and what it costs.

For each int8 configuration (``--configs``: layer groups of ``webapp.quantize.layer_names`` left in
fp32, ``none`` = everything int8), our compiled int8 ``Engine`` (as served: AOTInductor package with a
cache folder) is compared with eager fp32 of the same real weights (EfficientNet-Lite0) on:

* **top-1 agreement** with fp32 over the fidelity photos: the shared photos, each also centre-cropped
  (60 %), mirrored and at half size, the shipped calibration photos, and deterministic random
  crops/flips/rescales up to ``--photos`` in all; also on the photos that are not calibration photos;
* **max change of the top-1 probability** (fp32's top-1 class, softmax, percentage points) and the
  logit error (max |logits - fp32| / max |fp32|);
* **speed**: bs1 latency and bs8 throughput, timed round-robin in the same run as our compiled fp32
  and bf16, as ratios to both; and ``set``: images/s over the whole fidelity set at bs8, which is what
  the served int8's ``+recheck`` row costs (its close calls, ``rechecked``, run again in fp32:
  ``Engine.add_recheck``, ``CLASSIFIER_INT8_RECHECK_PTS``), where one fixed batch would not say. With
  one intra-op thread (the default, as each worker of a 2-core server runs) each call is timed in the CPU
  time of the calling thread, which a busy shared box does not stretch; with more threads, in wall time.

ResNet-18 (seeded weights: no meaningful top-1) gets its int8 logit error and speed only.
``INT8_KEEP_FP32`` in ``webapp/quantize.py`` is what the service uses; the target is >= 98 % top-1
agreement, and int8 >= 1.3x bf16's speed for ``auto`` to consider it.

    python bench/int8_bench.py [--quick] [--json out.json] [--configs none,depthwise,depthwise+stem+head]

``--sweep``: the per-block sensitivity sweep instead. For EfficientNet-Lite0, each block (the stem conv,
every MBConv block ``blocks.i.j``, the head conv, the classifier; ``sweep_units``) alone in int8, the rest
fp32, in the reference (eager, simulated q/dq) graph, against eager fp32 on the same photos; then
everything in int8; then only the weights on int8's grid (``round_weights_int8``: activations in float32). Where int8's answers are lost, block by block (``--threads 0``: about 20 s a block on 2 cores).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import ImageOps

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import log, main, num, table  # noqa: E402
from bench.inputs import BATCH, Inputs, augmented, make_inputs, shared_photos  # noqa: E402
from bench.runtimes import Runner, short_error  # noqa: E402
from webapp import models, settings  # noqa: E402
from webapp.bf16 import keep_fp32_for  # noqa: E402
from webapp.engine import Engine, choose_reduce_range, configure_threads  # noqa: E402
from webapp.quantize import INT8_KEEP_FP32  # noqa: E402

TARGET_TOP1 = 0.98
TARGET_X_BF16 = 1.3
DEFAULT_CONFIGS = "none,depthwise,project,depthwise+project,depthwise+stem+head"


def add_arguments(parser) -> None:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true", help="the served configuration and 'none' only, few rounds")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated int8 configurations, each '+'-joined groups left in fp32 or 'none' "
                             f"(default {DEFAULT_CONFIGS}; --quick: none and the served one)")
    parser.add_argument("--photos", type=int, default=256, help="fidelity photos in all (at least the fixed views)")
    parser.add_argument("--rounds", type=int, default=0, help="round-robin timing rounds (0: 8, --quick 5)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (0: the cores this process may use; 1: timed in thread CPU time)")
    parser.add_argument("--sweep", action="store_true",
                        help="per-block sensitivity sweep: each block alone in int8 (reference graph), no timing")
    parser.add_argument("--bits", choices=("auto", "8", "7"), default="auto",
                        help="--sweep: activation bits (auto: 7 where oneDNN has no VNNI, as served; 8: what a VNNI CPU "
                             "runs, the reference graph simulates it on any CPU)")
    parser.add_argument("--recheck-pts", type=float, default=settings.BY_NAME["INT8_RECHECK_PTS"].default,
                        help="the served int8's +recheck row: close calls under this many points run again in fp32")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "photo-classifier"),
                        help="where the engines' packages and int8 programs are kept across runs, as the service keeps them")


def fidelity_views(photos: list) -> list:
    """Each shared photo centre-cropped (60 % of its short side), mirrored and at half size: ``3 x len(photos)`` images."""
    def centre(img):
        w, h = img.size
        s = 0.6 * min(w, h)
        return img.crop((round((w - s) / 2), round((h - s) / 2), round((w + s) / 2), round((h + s) / 2)))
    return ([centre(i) for i in photos] + [ImageOps.mirror(i) for i in photos]
            + [i.resize((max(1, i.width // 2), max(1, i.height // 2))) for i in photos])


def compare(got: torch.Tensor, ref: torch.Tensor, n_own: int) -> dict:
    """Fidelity of logits ``got`` (N, C) against ``ref`` (N, C): top-1 agreement (all rows, and the first ``n_own``,
    which are not calibration photos), max top-1 probability change (points), logit error; and the agreement
    split by how sure fp32 was: where fp32's top-1 probability is >= 0.5 (issue 14's bf16 criterion, target
    100%), and where its top two are >= 1 point apart (a near-tie below that flips on any rounding)."""
    top = ref.argmax(1)
    same = got.argmax(1) == top
    probs = ref.softmax(1)
    p_ref = probs.gather(1, top[:, None])
    p_got = got.softmax(1).gather(1, top[:, None])
    two = probs.topk(2, 1).values
    sure, apart = two[:, 0] >= 0.5, (two[:, 0] - two[:, 1]) >= 0.01
    return {"top1_agree": float(same.float().mean()), "top1_agree_not_calibration": float(same[:n_own].float().mean()),
            "top1_n": len(top), "max_top1_prob_change_pts": float(100 * (p_got - p_ref).abs().max()),
            "rel_err": float((got - ref).abs().max() / ref.abs().max()),
            "top1_agree_p50": float(same[sure].float().mean()) if sure.any() else float("nan"),
            "n_p50": int(sure.sum()),
            "top1_agree_margin1": float(same[apart].float().mean()) if apart.any() else float("nan"),
            "n_margin1": int(apart.sum())}


def fidelity_photos(n: int) -> tuple[list, list]:
    """The fidelity set's photos: ``shared_photos()`` and the extra images (``fidelity_views`` and
    deterministic augmentations) that, with the 28 calibration photos, make ``n`` in all."""
    photos = shared_photos()
    imgs = [img for _, img in photos]
    views = fidelity_views(imgs)
    return photos, views + augmented(imgs[:7], max(0, n - len(photos) - len(views) - 28), seed=0)


def reference(name: str, photos: list, extra: list) -> tuple:
    """Model ``name`` loaded, its ``Inputs``, ``x`` (N, 3, S, S) float32: the fidelity set then the calibration
    photos, and eager fp32's logits for ``x`` (N, 1000) float32: what every configuration is compared with."""
    loaded = models.load_model(settings.load(environ={}, overrides={"MODEL": name}))
    inputs = make_inputs(loaded, photos, extra)
    x = torch.cat([inputs.fidelity, torch.stack(inputs.calibration)])
    with torch.inference_mode():
        ref = torch.cat([loaded.module(x[i:i + BATCH]) for i in range(0, len(x), BATCH)])
    return loaded, inputs, x, ref


def build(loaded, precision: str, keep: tuple[str, ...], inputs: Inputs, cache_dir: Path | None) -> Runner:
    """Our compiled ``Engine`` at ``precision`` (int8 with ``keep`` left in fp32), warmed up to ``BATCH``."""
    key = f"ours-{precision}" + (f"[{'+'.join(keep) or 'none'}]" if precision == "int8" else "")
    t0 = time.perf_counter()
    try:
        torch.compiler.set_stance("default")  # a previous Engine's warm-up left "fail_on_recompile" on
        engine = Engine(copy.deepcopy(loaded.module), input_size=loaded.preprocessing.crop, compile=True,
                        precision=precision, calibration=inputs.calibration,
                        reduce_range=choose_reduce_range("auto"), cache_dir=cache_dir,
                        cache_id=f"int8_bench|{loaded.name}|{loaded.weights}", int8_keep_fp32=keep,
                        bf16_keep_fp32=keep_fp32_for(loaded.name))
        engine.warm_up(BATCH)
    except Exception as exc:  # reported in the table, the others still run
        log(f"  {key} FAILED: {short_error(exc)}")
        return Runner(key=key, runtime="ours", precision=precision, error=short_error(exc))
    log(f"  {key}: built in {time.perf_counter() - t0:.0f} s, backend {engine.backend}")
    return Runner(key=key, runtime="ours", precision=precision, predict=lambda x: engine.predict(x).numpy(),
                  keep=engine, build_s=time.perf_counter() - t0, config={"backend": engine.backend, "keep_fp32": keep})


def timing(runners: dict[str, Runner], inputs: Inputs, photos: torch.Tensor, *, rounds: int, iters1: int,
           iters8: int) -> dict[str, dict]:
    """Round-robin medians by key: ``bs1_ms`` (ms per bs1 call), ``bs8_img_s`` (images/s at bs8) and ``set_img_s``
    (images/s over all of ``photos`` (N, 3, S, S) float32 at bs8, once a round). Each round every runner makes one
    untimed call then ``iters1`` bs1 and ``iters8`` bs8 timed ones and the set, in an order rotated each round.
    One intra-op thread: CPU time of this thread (``time.thread_time``); else wall time."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    live = list(runners.values())
    samples: dict[str, dict[int | str, list[float]]] = {r.key: {1: [], BATCH: [], "set": []} for r in live}
    for rnd in range(rounds):
        for runner in live[rnd % len(live):] + live[:rnd % len(live)]:
            for bs, x, iters in ((1, inputs.bs1, iters1), (BATCH, inputs.bs8, iters8)):
                runner.predict(x)
                for _ in range(iters):
                    t0 = clock()
                    runner.predict(x)
                    samples[runner.key][bs].append(clock() - t0)
            t0 = clock()
            logits(runner, photos)
            samples[runner.key]["set"].append(clock() - t0)
        log(f"  timing round {rnd + 1}/{rounds}")
    return {k: {"bs1_ms": 1e3 * statistics.median(v[1]), "bs8_img_s": BATCH / statistics.median(v[BATCH]),
                "set_img_s": len(photos) / statistics.median(v["set"])} for k, v in samples.items()}


def logits(runner: Runner, x: torch.Tensor) -> torch.Tensor:
    """``runner``'s logits for ``x`` (N, 3, S, S), in chunks of ``BATCH``."""
    return torch.from_numpy(np.concatenate([runner.predict(x[i:i + BATCH]) for i in range(0, len(x), BATCH)]))


def measure(name: str, configs: list[tuple[str, ...]], photos: list, extra: list, args, rounds: int) -> dict:
    """One model: fp32, bf16 and every int8 configuration built, compared with eager fp32, timed round-robin."""
    loaded, inputs, x, ref = reference(name, photos, extra)
    cache = Path(args.cache_dir) if args.cache_dir else None
    runners = {r.key: r for r in [build(loaded, "fp32", (), inputs, cache), build(loaded, "bf16", (), inputs, cache)]
               + [build(loaded, "int8", keep, inputs, cache) for keep in configs]}
    fp32 = runners["ours-fp32"].keep
    # The served int8, as a worker runs it (built only for this): untrained weights get no recheck there either
    # (startup.recheck_points: every photo a near-tie).
    served = (build(loaded, "int8", tuple(INT8_KEEP_FP32), inputs, cache)
              if fp32 is not None and args.recheck_pts > 0 and not loaded.untrained else None)
    if served is not None and served.keep is not None:
        served.keep.add_recheck(fp32, args.recheck_pts)
        served.key += f"+recheck{args.recheck_pts:g}"
        runners[served.key] = served
    rows = {}
    for key, r in runners.items():
        before = getattr(r.keep, "rechecked", 0)
        rows[key] = {"error": r.error} if r.error else {**compare(logits(r, x), ref, len(inputs.fidelity)),
                                                        "build_s": r.build_s, **r.config}
        if getattr(r.keep, "recheck", None) is not None:
            rows[key]["rechecked"] = (r.keep.rechecked - before) / len(x)  # share of the photos fp32 answered
    live = {k: r for k, r in runners.items() if r.predict is not None}
    speed = timing(live, inputs, x, rounds=rounds, iters1=6, iters8=3)
    for key, t in speed.items():
        rows[key].update(t)
    for key, row in rows.items():
        for base in ("fp32", "bf16"):
            b = rows.get(f"ours-{base}", {})
            if "bs1_ms" in row and "bs1_ms" in b:
                row[f"bs1_x_{base}"] = b["bs1_ms"] / row["bs1_ms"]
                row[f"bs8_x_{base}"] = row["bs8_img_s"] / b["bs8_img_s"]
                row[f"set_x_{base}"] = row["set_img_s"] / b["set_img_s"]
    return {"photos": len(x), "not_calibration": len(inputs.fidelity), "rows": rows}


def sweep_units(module: torch.nn.Module) -> list[str]:
    """The blocks of a sweep, by module name, in forward order: each top-level conv or linear (``conv_stem``,
    ``conv_head``, ``classifier``; ResNet's ``conv1``, ``fc``), and each block of a top-level ``Sequential``
    (``blocks.1.0`` in timm's EfficientNet, a Sequential of stages; ``layer1.0`` in ResNet)."""
    units = []
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Sequential):
            for i, block in enumerate(child):
                if isinstance(block, torch.nn.Sequential):
                    units += [f"{name}.{i}.{j}" for j in range(len(block))]
                else:
                    units.append(f"{name}.{i}")
        elif isinstance(child, (torch.nn.Conv2d, torch.nn.Linear)):
            units.append(name)
    return units


def round_weights_int8(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose conv and linear weights are rounded to the int8 grid the quantizer uses
    (symmetric, per output channel: scale = max |w| of the channel / 127), kept in float32, activations
    untouched: what int8 weights alone cost in answers, whatever the activations' calibration. A BatchNorm
    folded into a conv scales each output channel, and so its grid, by one factor: rounding the unfolded
    weights gives the same values as rounding the folded ones."""
    out = copy.deepcopy(module)
    for layer in out.modules():
        if isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)):
            w = layer.weight.data
            scale = w.abs().amax(dim=tuple(range(1, w.dim())), keepdim=True).clamp_min(1e-12) / 127
            layer.weight.data = (w / scale).round().clamp(-127, 127) * scale
    return out


def sweep(args) -> dict:
    """``--sweep``: EfficientNet-Lite0 with one block at a time in int8 (``sweep_units``), then all; print the table."""
    from webapp.quantize import quantize_int8

    photos, extra = fidelity_photos(args.photos)
    loaded, inputs, x, ref = reference("efficientnet_lite0", photos, extra)
    reduce_range = {"auto": choose_reduce_range("auto"), "8": False, "7": True}[args.bits]
    log(f"sweep: {'7' if reduce_range else '8'}-bit activations")
    rows = {}
    for unit in sweep_units(loaded.module) + ["(all)"]:
        t0 = time.perf_counter()
        only = None if unit == "(all)" else (unit,)
        program = quantize_int8(copy.deepcopy(loaded.module), inputs.calibration, input_size=loaded.preprocessing.crop,
                                reduce_range=reduce_range, keep_fp32=(), int8_only=only)
        int8 = program.module()
        with torch.no_grad():
            got = torch.cat([int8(x[i:i + BATCH]) for i in range(0, len(x), BATCH)])
        rows[unit] = compare(got, ref, len(inputs.fidelity))
        log(f"  {unit}: top-1 {100 * rows[unit]['top1_agree']:.1f}% ({time.perf_counter() - t0:.0f} s)")
    # Weights alone: every weight on int8's grid, activations in float32 (no calibration involved).
    rounded = round_weights_int8(loaded.module)
    with torch.no_grad():
        got = torch.cat([rounded(x[i:i + BATCH]) for i in range(0, len(x), BATCH)])
    rows["(int8 weights only)"] = compare(got, ref, len(inputs.fidelity))
    log(f"  int8 weights only: top-1 {100 * rows['(int8 weights only)']['top1_agree']:.1f}%")
    cells = [[u, f"{100 * r['top1_agree']:.1f}%", f"{100 * r['top1_agree_not_calibration']:.1f}%",
              f"{100 * r['top1_agree_margin1']:.1f}%", f"{100 * r['top1_agree_p50']:.1f}%",
              num(r["max_top1_prob_change_pts"]), f"{100 * r['rel_err']:.2f}%"] for u, r in rows.items()]
    any_row = next(iter(rows.values()))
    print(table(["int8 block", "top1", "top1 not calib", f"top1 margin>=1pt ({any_row['n_margin1']})",
                 f"top1 p>=0.5 ({any_row['n_p50']})", "max dp pts", "logit err"], cells,
                title=f"efficientnet_lite0: one block in int8, the rest fp32 (reference graph), vs eager fp32 on "
                      f"{len(x)} photos ({len(inputs.fidelity)} not calibration)"))
    return {"sweep": rows, "photos": len(x), "not_calibration": len(inputs.fidelity)}


def run(args) -> dict:
    """Both models, every configuration; print the tables; return every number (``--sweep``: ``sweep``)."""
    configure_threads(args.threads)
    if args.sweep:
        return sweep(args)
    served = tuple(INT8_KEEP_FP32)
    spec = args.configs or ("none," + "+".join(served) if args.quick else DEFAULT_CONFIGS)
    configs = [tuple(g for g in c.split("+") if g and g != "none") for c in spec.split(",") if c.strip()]
    if served not in configs:
        configs.append(served)
    rounds = args.rounds or (5 if args.quick else 8)  # the set is timed once a round: 3 samples were too few
    photos, extra = fidelity_photos(args.photos)
    out = {"served": list(served), "target_top1": TARGET_TOP1, "target_x_bf16": TARGET_X_BF16,
           "threads": torch.get_num_threads(), "clock": "thread CPU time" if torch.get_num_threads() == 1 else "wall",
           "models": {}}
    for name in ("efficientnet_lite0", "resnet18_seeded"):
        log(f"int8_bench: {name}")
        real = name == "efficientnet_lite0"
        out["models"][name] = measure(name, configs if real else list(dict.fromkeys([(), served])), photos,
                                      extra if real else [], args, rounds)
    print(report(out))
    return out


def report(out: dict) -> str:
    """The fixed-width tables of a ``run`` result, and the verdict on the targets."""
    lines = []
    for name, m in out["models"].items():
        cells = []
        for key, r in m["rows"].items():
            if r.get("error"):
                cells.append([key, "FAILED: " + r["error"][:60]] + [""] * 10)
                continue
            cells.append([key, f"{100 * r['top1_agree']:.1f}%", f"{100 * r['top1_agree_not_calibration']:.1f}%",
                          num(r["max_top1_prob_change_pts"]), f"{100 * r['rel_err']:.2f}%", num(r.get("bs1_ms"), 2),
                          num(r.get("bs8_img_s")), num(r.get("bs8_x_fp32"), 2), num(r.get("bs8_x_bf16"), 2),
                          num(r.get("bs1_x_bf16"), 2), num(r.get("set_x_bf16"), 2),
                          f"{100 * r['rechecked']:.1f}%" if "rechecked" in r else "-"])
        real = name == "efficientnet_lite0"
        lines += ["", table(["engine", "top1", "top1 not calib", "max dp pts", "logit err", "bs1 ms", "bs8 img/s",
                             "bs8 x fp32", "bs8 x bf16", "bs1 x bf16", "set x bf16", "rechecked"], cells,
                            title=f"{name}: vs eager fp32 on {m['photos']} photos ({m['not_calibration']} not calibration); "
                                  f"speed on {out['threads']} thread(s), {out['clock']}"
                                  + ("" if real else " (seeded weights: top-1 is not meaningful, logit error is)"))]
    lite = out["models"].get("efficientnet_lite0", {}).get("rows", {})
    key = f"ours-int8[{'+'.join(out['served']) or 'none'}]"
    served = next((r for k, r in lite.items() if k.startswith(key + "+recheck")), lite.get(key, {}))
    if "top1_agree" in served:
        ok_top1 = served["top1_agree"] >= out["target_top1"]
        ok_speed = (served.get("set_x_bf16") or 0) >= out["target_x_bf16"]
        recheck = f", close calls rechecked in fp32: {100 * served['rechecked']:.1f}%" if "rechecked" in served else ""
        lines.append(f"\nserved int8 ({'+'.join(out['served']) or 'nothing'} left in fp32{recheck}): top-1 "
                     f"{100 * served['top1_agree']:.1f}% ({'MET' if ok_top1 else 'NOT MET'}, target "
                     f">= {100 * out['target_top1']:.0f}%), over the set {num(served.get('set_x_bf16'), 2)}x bf16 "
                     f"({'MET' if ok_speed else 'NOT MET'}, >= {out['target_x_bf16']}x for auto to consider int8)")
    return "\n".join(lines)


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
