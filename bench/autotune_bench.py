"""Inductor's ``max_autotune`` (the C++ GEMM template) in our AOTInductor packages, against the packages as built.

Issue #14 target 6 asks to measure it (with ``cpp_wrapper``, moot for a package: C++ throughout). Both variants
are built as ``webapp/aoti.py`` builds them (``torch.export`` of a channels_last input, a static batch-1 package
and one with a dynamic batch from 2, ``freezing``), one with ``max_autotune`` and
``max_autotune_gemm_backends="CPP,ATEN"`` besides. Then, in one process at ``--threads``: each package's logits
against the plain dynamic package's on the same random batch (max |difference| / max |logit|, top-1 agreement), and
batch-1 latency (ms) and batch-8 throughput (images/s), timed round-robin (every package once per round, so a
neighbour's load hits all alike), medians, as ratios to the plain packages. ResNet-18 with seeded weights, at
fp32 and at the bf16 policy the service runs (``webapp.bf16.bf16_policy``, classifier in fp32).

Packages are kept in ``--workdir`` and reused by a later run (their build time is then 0).

    python bench/autotune_bench.py [--precisions fp32,bf16] [--rounds 6] [--threads 2] [--workdir DIR] [--json out.json]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import log, main, median, num, ratio, table

VARIANTS = {"plain": {"freezing": True},
            "autotune": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}}


def add_arguments(parser) -> None:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16 (the bf16 policy)")
    parser.add_argument("--rounds", type=int, default=6, help="round-robin timing rounds")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument("--workdir", help="where the packages are built and kept (default: a new temp dir)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def _build(module, path: Path, batch: int, dynamic: bool, config: dict) -> float:
    """Package ``module`` for ``(batch, 3, 224, 224)`` channels_last float32 inputs into ``path`` as serving does
    (``webapp.aoti._build``: the batch dynamic from 2 where ``dynamic``) with inductor ``config``; the seconds it
    took (0 where ``path`` exists)."""
    from webapp.aoti import _build as build

    if path.exists():
        return 0.0
    t0 = time.perf_counter()
    build(module, path, 224, batch, dynamic, inductor_configs=config)
    return time.perf_counter() - t0


def run(args) -> dict:
    """Build, compare and time both variants per precision; the results (ms, images/s, ratios, logit error)."""
    import torch
    import torchvision

    from webapp.bf16 import bf16_policy, keep_fp32_for

    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="autotune_bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    runners, out = {}, {"threads": args.threads, "rounds": args.rounds, "torch": torch.__version__, "rows": {}}
    for prec in precisions:
        module = model if prec == "fp32" else bf16_policy(model, keep_fp32_for("resnet18_seeded"))
        for variant, config in VARIANTS.items():
            built = 0.0
            for dynamic in (False, True):
                path = workdir / f"{prec}-{variant}-{'dyn' if dynamic else 'b1'}.pt2"
                built += _build(module, path, 2 if dynamic else 1, dynamic, config)
                runners[prec, variant, dynamic] = torch._inductor.aoti_load_package(str(path))
            out["rows"][f"{prec} {variant}"] = {"build_s": built}
            log(f"{prec} {variant}: packages ready ({built:.0f} s of building)")
    x1 = torch.randn(1, 3, 224, 224).contiguous(memory_format=torch.channels_last)
    x8 = torch.randn(8, 3, 224, 224).contiguous(memory_format=torch.channels_last)
    t1: dict = {k: [] for k in runners}
    t8: dict = {k: [] for k in runners}
    with torch.no_grad():
        for prec in precisions:
            ref = runners[prec, "plain", True](x8)
            for variant in VARIANTS:
                worst, agree = 0.0, 1.0
                for dynamic in (False, True):
                    run_ = runners[prec, variant, dynamic]
                    got = run_(x8) if dynamic else torch.cat([run_(x8[i:i + 1]) for i in range(8)])
                    worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
                    agree = min(agree, (got.argmax(1) == ref.argmax(1)).float().mean().item())
                out["rows"][f"{prec} {variant}"].update(logit_err=worst, top1_agree=agree)
        for key, run_ in runners.items():  # warm-up
            for _ in range(3):
                run_(x8 if key[2] else x1)
        for _ in range(args.rounds):
            for key, run_ in runners.items():
                for _ in range(4 if key[2] else 10):
                    t0 = time.perf_counter()
                    run_(x8 if key[2] else x1)
                    dt = time.perf_counter() - t0
                    (t8 if key[2] else t1)[key].append(8 / dt if key[2] else dt * 1e3)
    for prec in precisions:
        for variant in VARIANTS:
            row = out["rows"][f"{prec} {variant}"]
            row.update(bs1_ms=median(t1[prec, variant, False]), bs8_images_per_s=median(t8[prec, variant, True]))
        base = out["rows"][f"{prec} plain"]
        for variant in VARIANTS:
            row = out["rows"][f"{prec} {variant}"]
            row.update(bs1_speedup=ratio(base["bs1_ms"], row["bs1_ms"]),
                       bs8_speedup=ratio(row["bs8_images_per_s"], base["bs8_images_per_s"]))
    print(report(out))
    return out


def report(out: dict) -> str:
    """The fixed-width text report of a ``run`` result."""
    rows = [[name, num(r["bs1_ms"], 2), num(r["bs1_speedup"], 3), num(r["bs8_images_per_s"]),
             num(r["bs8_speedup"], 3), f"{r['logit_err']:.1e}", f"{100 * r['top1_agree']:.0f}%", num(r["build_s"], 0)]
            for name, r in out["rows"].items()]
    return table(["ResNet-18 package", "bs1 ms", "x plain", "bs8 img/s", "x plain", "logit err", "top-1 =",
                  "build s"], rows,
                 title=f"max_autotune (C++ GEMM template) vs the packages as built, {out['threads']} threads, medians "
                       f"of {out['rounds']} round-robin rounds (x plain: speed-up, higher is better; logit err and "
                       f"top-1 = against the plain dynamic package)")


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
