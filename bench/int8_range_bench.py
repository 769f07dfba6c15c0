"""int8 with 8-bit vs 7-bit ("reduced range") activations: top-1 agreement with fp32 and speed.

Without VNNI (AVX2-only servers: Haswell/Broadwell Xeon E5 v3/v4, older AMD), oneDNN's u8 x s8
int8 path sums pairs of products in 16 bits, which can saturate; torchao's quantizer offers 7-bit
activations for that. This measures both settings on the real-weight offline model
(EfficientNet-Lite0) over the shared photos plus deterministic crops/flips/rescales, and on seeded
ResNet-18 for speed. Run it as the old CPU runs::

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/int8_range_bench.py [--photos 256]

and without the variables for this CPU's own path. ``CLASSIFIER_INT8_REDUCE_RANGE=auto`` picks
7 bits exactly where ``webapp.engine.int8_vnni()`` is False.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

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


def main(argv=None) -> int:
    """Measure fp32 and int8 with 8- and 7-bit activations for both models; print a line each; 0."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=256, help="fidelity photos (shared + augmented)")
    parser.add_argument("--rounds", type=int, default=10, help="timed bs8 calls per mode")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "native")
    print(f"CPU as this process runs it: ISA cap {cap}, ATen {torch.backends.cpu.get_cpu_capability()}, "
          f"VNNI usable: {int8_vnni()}", flush=True)
    photos = shared_photos()
    extra = augmented([img for _, img in photos[:7]], max(0, args.photos - len(photos)), seed=0)
    result = {"isa_cap": cap, "aten": torch.backends.cpu.get_cpu_capability(), "vnni": int8_vnni(), "rows": []}
    for name in ("efficientnet_lite0", "resnet18_seeded"):
        loaded = models.load_model(settings.load(environ={}, overrides={"MODEL": name}))
        inputs = make_inputs(loaded, photos, extra if name == "efficientnet_lite0" else [])
        with torch.inference_mode():
            ref = predict_all(loaded.module, inputs.fidelity)
        fp32 = Engine(loaded.module, input_size=loaded.preprocessing.crop, compile=True, precision="fp32")
        base = throughput(fp32.predict, inputs.bs8, args.rounds)
        rows = [{"model": name, "mode": "fp32 (compiled)", "images_per_s": base, "top1": 1.0, "logit_err": 0.0}]
        for rr in (False, True):
            torch.compiler.set_stance("default")
            engine = Engine(loaded.module, input_size=loaded.preprocessing.crop, compile=True, precision="int8",
                            calibration=inputs.calibration, reduce_range=rr)
            got = predict_all(engine.predict, inputs.fidelity)
            rows.append({"model": name, "mode": f"int8 {'7-bit' if rr else '8-bit'} activations",
                         "images_per_s": throughput(engine.predict, inputs.bs8, args.rounds),
                         "top1": float((got.argmax(1) == ref.argmax(1)).float().mean()),
                         "logit_err": float((got - ref).abs().max() / ref.abs().max())})
        for r in rows:
            r["x_fp32"] = r["images_per_s"] / base
            print(f"{r['model']:<20} {r['mode']:<28} {r['images_per_s']:7.1f} img/s  x{r['x_fp32']:.2f} fp32  "
                  f"top-1 vs fp32 {100 * r['top1']:5.1f}% ({len(inputs.fidelity)} photos)  logit err {100 * r['logit_err']:.2f}%",
                  flush=True)
        result["rows"] += rows
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
