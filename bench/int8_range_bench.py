"""int8 with 8-bit vs 7-bit ("reduced range") activations: top-1 agreement with fp32 and speed.

Without VNNI (AVX2-only servers: Haswell/Broadwell Xeon E5 v3/v4, older AMD), oneDNN's u8 x s8
int8 path sums pairs of products in 16 bits, which can saturate; torchao's quantizer offers 7-bit
activations for that. This measures both settings on the real-weight offline model
(EfficientNet-Lite0) over the shared photos plus deterministic crops/flips/rescales, and on seeded
ResNet-18 for speed. Run it as the old CPU runs::

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/int8_range_bench.py [--photos 256] [--json out.json]

and without the variables for this CPU's own path (``python -m bench`` runs it capped, as part ``int8-range``). ``CLASSIFIER_INT8_REDUCE_RANGE=auto`` picks
7 bits exactly where ``webapp.engine.int8_vnni()`` is False.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import main as bench_main, num, table  # noqa: E402
from bench.inputs import BATCH, augmented, make_inputs, shared_photos  # noqa: E402
from webapp import models, settings  # noqa: E402
from webapp.engine import Engine, int8_vnni  # noqa: E402


def predict_all(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn``'s logits (N, C) for ``x`` (N, 3, S, S) float32, in chunks of ``BATCH``."""
    return torch.cat([fn(x[i:i + BATCH]) for i in range(0, len(x), BATCH)])


def throughput(fn, x8: torch.Tensor, rounds: int) -> float:
    """images/s of ``fn`` on the batch ``x8`` (``BATCH``, 3, S, S): after one untimed call, the median of ``rounds`` calls."""
    fn(x8)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(x8)
        times.append(time.perf_counter() - t0)
    return BATCH / sorted(times)[len(times) // 2]


def add_arguments(parser) -> None:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true", help="32 fidelity photos, 4 timed calls (a smoke run)")
    parser.add_argument("--photos", type=int, default=0, help="fidelity photos, shared + augmented (0: 256, --quick 32)")
    parser.add_argument("--rounds", type=int, default=0, help="timed bs8 calls per mode (0: 10, --quick 4)")


def run(args) -> dict:
    """fp32 and int8 with 8- and 7-bit activations for both models; print the table; return every number."""
    n_photos = args.photos or (32 if args.quick else 256)
    rounds = args.rounds or (4 if args.quick else 10)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "native")
    photos = shared_photos()
    extra = augmented([img for _, img in photos[:7]], max(0, n_photos - len(photos)), seed=0)
    result = {"isa_cap": cap, "aten": torch.backends.cpu.get_cpu_capability(), "vnni": int8_vnni(),
              "photos": len(photos) + len(extra), "rows": []}
    for name in ("efficientnet_lite0", "resnet18_seeded"):
        loaded = models.load_model(settings.load(environ={}, overrides={"MODEL": name}))
        inputs = make_inputs(loaded, photos, extra if name == "efficientnet_lite0" else [])
        with torch.inference_mode():
            ref = predict_all(loaded.module, inputs.fidelity)
        fp32 = Engine(loaded.module, input_size=loaded.preprocessing.crop, compile=True, precision="fp32")
        base = throughput(fp32.predict, inputs.bs8, rounds)
        rows = [{"model": name, "mode": "fp32 (compiled)", "images_per_s": base, "top1": 1.0, "logit_err": 0.0,
                 "n": len(inputs.fidelity)}]
        for rr in (False, True):
            torch.compiler.set_stance("default")
            engine = Engine(loaded.module, input_size=loaded.preprocessing.crop, compile=True, precision="int8",
                            calibration=inputs.calibration, reduce_range=rr)
            got = predict_all(engine.predict, inputs.fidelity)
            rows.append({"model": name, "mode": f"int8, {'7' if rr else '8'}-bit activations",
                         "images_per_s": throughput(engine.predict, inputs.bs8, rounds),
                         "top1": float((got.argmax(1) == ref.argmax(1)).float().mean()),
                         "logit_err": float((got - ref).abs().max() / ref.abs().max()), "n": len(inputs.fidelity)})
        for r in rows:
            r["x_fp32"] = r["images_per_s"] / base
        result["rows"] += rows
    print(report(result))
    return result


def report(result: dict) -> str:
    """The fixed-width text report of a ``run`` result (top-1 only where the weights are real)."""
    rows = [[f"{r['model']}  {r['mode']}", num(r["images_per_s"]), num(r["x_fp32"], 2),
             f"{100 * r['top1']:.1f}%" if r["model"] != "resnet18_seeded" else "-", f"{100 * r['logit_err']:.2f}%"]
            for r in result["rows"]]
    title = (f"int8 activations 8 vs 7 bits, bs8 images/s; ISA cap {result['isa_cap']}, ATen {result['aten']}, "
             f"VNNI usable: {result['vnni']}; top-1 vs fp32 on {result.get('photos', '?')} photos")
    return table(["model  mode", "images/s", "x fp32", "top-1 vs fp32", "logit err"], rows, title=title)


if __name__ == "__main__":
    bench_main(__doc__, add_arguments, run)
