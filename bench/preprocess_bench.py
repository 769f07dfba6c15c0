"""Full vs fast decode of a 12-MP phone photo: ``imaging.decode`` + ``imaging.preprocess``, in process.

Fast = ``decode(..., min_side=spec.resize)`` (what the service does with ``CLASSIFIER_FAST_DECODE``
on: libjpeg's reduced DCT scale, keeping the short side >= 2x the resize size); full = ``min_side=None``. Both paths run alternately in one
loop (full first on even rounds, fast first on odd ones), so load from other processes on this
shared machine hits both alike; the answer is the ratio of medians. The offline model
(EfficientNet-Lite0, real ImageNet weights, fp32 eager) classifies both tensors: top-1 must match.

    python bench/preprocess_bench.py [--quick] [--json out.json] [--rounds N] [--threads N]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import PHOTO_12MP, PHOTO_12MP_ROTATED, log, main, median, num, percentile, photo, ratio, table


def add_arguments(parser) -> None:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds per photo and path (0: 40, --quick 8)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: what one server worker gets on this machine)")
    parser.add_argument("--photos", nargs="+", default=[PHOTO_12MP, PHOTO_12MP_ROTATED],
                        help="photos (names in ../shared/images, or paths)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def _one(data: bytes, transform, *, max_pixels: int, min_side: int | None):
    from webapp import imaging

    c0, t0 = time.thread_time(), time.perf_counter()
    d = imaging.decode(data, max_pixels=max_pixels, name="bench", min_side=min_side)
    t1 = time.perf_counter()
    x = imaging.preprocess(d.image, transform)
    t2, c2 = time.perf_counter(), time.thread_time()
    return x, d.image.size, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (c2 - c0) * 1e3


def run(args) -> dict:
    """Time full vs fast decode + preprocess of each photo (ms, interleaved rounds) and compare the model's
    top-1 on both; print the report; return every number."""
    import torch

    from webapp import cpu, imaging, settings
    from webapp.models import load_model

    threads = args.threads or cpu.plan(cpu.usable_cores()).threads
    torch.set_num_threads(threads)
    rounds = args.rounds or (8 if args.quick else 40)
    s = settings.load(environ={}, overrides={"MODEL": "efficientnet_lite0"})
    model = load_model(s)
    module = model.module.eval()
    pre = model.preprocessing
    transform = imaging.build_transform(pre)
    paths = {"full": None, "fast": pre.resize}
    log(f"preprocess_bench: {rounds} rounds per photo, {threads} intra-op thread(s), "
        f"fast = min_side {pre.resize}, model {model.name} fp32 eager")

    out = {"threads": threads, "rounds": rounds, "min_side": pre.resize, "model": model.name, "photos": {}}
    for name in args.photos:
        path = photo(name)
        data = path.read_bytes()
        times = {k: {"decode": [], "preprocess": [], "total": [], "cpu": []} for k in paths}
        tensors, sizes = {}, {}
        for k, m in paths.items():  # warm-up: first calls pay for imports, allocations, caches
            tensors[k], sizes[k], _, _, _ = _one(data, transform, max_pixels=s.MAX_PIXELS, min_side=m)
        for i in range(rounds):
            order = ("full", "fast") if i % 2 == 0 else ("fast", "full")
            for k in order:
                _, _, dec, prep, cpu_ms = _one(data, transform, max_pixels=s.MAX_PIXELS, min_side=paths[k])
                times[k]["cpu"].append(cpu_ms)
                times[k]["decode"].append(dec)
                times[k]["preprocess"].append(prep)
                times[k]["total"].append(dec + prep)
        with torch.inference_mode():
            logits = module(torch.stack([tensors["full"], tensors["fast"]])).float()
        probs = torch.softmax(logits, dim=1)
        top5 = torch.topk(probs, 5, dim=1).indices.tolist()
        res = {"bytes": len(data), "tensor_max_abs_diff": float((tensors["full"] - tensors["fast"]).abs().max())}
        for j, k in enumerate(paths):
            t = times[k]
            res[k] = {
                "decoded_size": list(sizes[k]),
                "decode_ms_median": median(t["decode"]),
                "preprocess_ms_median": median(t["preprocess"]),
                "total_ms_median": median(t["total"]),
                "total_ms_p10": percentile(t["total"], 10),
                "total_ms_p90": percentile(t["total"], 90),
                "cpu_ms_median": median(t["cpu"]),
                "top1_index": top5[j][0],
                "top1_label": model.categories[top5[j][0]],
                "top1_probability": float(probs[j, top5[j][0]]),
                "top5": top5[j],
            }
        res["speedup_full_over_fast"] = ratio(res["full"]["total_ms_median"], res["fast"]["total_ms_median"])
        res["cpu_speedup_full_over_fast"] = ratio(res["full"]["cpu_ms_median"], res["fast"]["cpu_ms_median"])
        res["decode_speedup"] = ratio(res["full"]["decode_ms_median"], res["fast"]["decode_ms_median"])
        res["top1_match"] = top5[0][0] == top5[1][0]
        res["top5_overlap"] = len(set(top5[0]) & set(top5[1]))
        res["max_prob_diff"] = float((probs[0] - probs[1]).abs().max())
        out["photos"][path.name] = res
    out["all_top1_match"] = all(r["top1_match"] for r in out["photos"].values())
    print(report(out))
    return out


def report(out: dict) -> str:
    """The fixed-width text report of a ``run`` result."""
    rows = []
    for name, r in out["photos"].items():
        for k in ("full", "fast"):
            p = r[k]
            rows.append([f"{name} {k}", "x".join(map(str, p["decoded_size"])), num(p["decode_ms_median"]),
                         num(p["preprocess_ms_median"]), num(p["total_ms_median"]),
                         f"{num(p['total_ms_p10'])}-{num(p['total_ms_p90'])}",
                         num(ratio(p["total_ms_median"], r["fast"]["total_ms_median"]), 2), num(p["cpu_ms_median"]),
                         f"{p['top1_index']} {p['top1_label']}", num(p["top1_probability"], 3)])
    lines = [table(["photo / path", "decoded", "decode ms", "prep ms", "total ms", "p10-p90", "x fast", "cpu ms",
                    "top-1", "prob"], rows,
                   title=f"decode + preprocess, median of {out['rounds']} interleaved rounds, "
                         f"{out['threads']} thread(s); fast = min_side {out['min_side']} (JPEG short side kept >= {2 * out['min_side']})\n"
                         f"(ms are wall time; cpu ms = this thread's CPU time, less hurt by other load)")]
    summary = []
    for name, r in out["photos"].items():
        summary.append([name, num(r["speedup_full_over_fast"], 2), num(r["decode_speedup"], 2),
                        num(r["cpu_speedup_full_over_fast"], 2),
                        "yes" if r["top1_match"] else "NO", f"{r['top5_overlap']}/5", num(r["max_prob_diff"], 4)])
    lines += ["", table(["photo", "full/fast total", "full/fast decode", "full/fast cpu", "top-1 match", "top-5 overlap",
                         "max |dprob|"], summary,
                        title=f"ratios (same run); top-1 by {out['model']} fp32 eager")]
    lines.append("top-1 of full and fast decode: " + ("match on every photo" if out["all_top1_match"]
                                                       else "MISMATCH (see table)"))
    return "\n".join(lines)


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
