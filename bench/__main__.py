"""Run every benchmark in one go and write one JSON file: ``python -m bench [--quick] [--only a,b]``.

Parts, each a module here that also runs alone (``python bench/<part>_bench.py --help``):

- engine: bs1 latency and bs8 images/s of eager fp32 (the baseline), ours at fp32/bf16/int8,
  ONNX Runtime and OpenVINO at their precisions; logit error and top-1 agreement with fp32.
- preprocess: full vs fast (reduced-scale) decode of the 12 MP phone photo.
- e2e: our gunicorn server vs a baseline server (sync workers, full decode, eager fp32, no
  batching) under the same closed-loop load of 12 MP uploads: images/s, p50/p95/p99; and vs ours
  before (batches always waiting the batch timeout, libraries imported by each worker): the
  unloaded p50 (paired requests), peak images/s, p99 at half load, each worker's private memory and Pss.
- ready: time to ready with a cold and a warm compile cache; then, per precision (fp32, bf16,
  int8, fp32 capped to AVX2), the worker's start-up alone (``python -m webapp warm``), cold and warm.
- page: the page path, 12 MP photo: our server's images/s at saturation when uploads are the JPEG
  the page scales in the browser vs the original photo.
- overload: 2x overload, 12 MP and small photos: admission by time (``MAX_WAIT_MS``) vs the same
  server without it: refused and admitted latency, images/s, client timeouts.
- heavy: ordinary uploads alone vs beside clients sending photos of a few bytes that take a second or more
  to decode (79 MP lossless WebPs): the ordinary clients' images/s and p99 (the heavy lane's effect).
- fidelity: bf16 against fp32, layer group by layer group (eager autocast, the bf16 policy with each
  set of layers kept in fp32, torch.compile, the AOTInductor package): top-1 agreement, top-1
  probability change, ties, and speed as a ratio to fp32 of the same kind.
- int8: int8 mixed precision (layer groups left in fp32) against fp32: top-1 agreement, top-1
  probability change, logit error, and speed as ratios to our fp32 and bf16.

- engine-avx2, int8-range: the engine (ours only) and int8 with 8- vs 7-bit activations as an old
  AVX2-only server runs them (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``, in a child process
  so the cap applies before torch loads).

Every timing is a ratio against a baseline measured in the same run (the machine may be shared).
``--readme`` then rewrites README.md's benchmark tables from this run (``bench/readme.py``): every
table there is a part's own report of one such run, with a line naming the run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
PARTS = {"engine": "bench.engine_bench", "preprocess": "bench.preprocess_bench",
         "e2e": "bench.e2e_bench", "ready": "bench.ready_bench", "page": "bench.page_bench",
         "overload": "bench.overload_bench", "heavy": "bench.heavy_bench", "fidelity": "bench.fidelity_bench",
         "int8": "bench.int8_bench", "engine-avx2": "bench.engine_bench", "int8-range": "bench.int8_range_bench"}
CAP = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# Parts run in a child process with the CPU capped to AVX2, and their extra arguments: the cap binds
# torch's kernels only (ONNX Runtime and OpenVINO pick their own), so the capped engine runs ours alone.
CAPPED = {"engine-avx2": ["--runtimes", "ours-fp32,ours-bf16,ours-int8", "--no-offline"], "int8-range": []}


def machine() -> dict:
    """The CPU this run is on, for the line naming it (``bench/readme.py``): model, vector ISA, cores, load."""
    from webapp.cpu import cpu_info

    info = cpu_info()
    flags = [f for f, present in info["flags"].items() if present]
    isa = next((f for f in ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx2") if f in flags), "no AVX2")
    return {"cpu": info["model"], "isa": isa, "flags": flags, "cores": len(os.sched_getaffinity(0)),
            "load_avg": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen parts (each prints its tables), write all results to one JSON file; 0.

    :raises SystemExit: unknown parts (usage error); subprocess.CalledProcessError: a capped part failed."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test, minutes not tens of minutes)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    parser.add_argument("--readme", action="store_true",
                        help="then rewrite README.md's tables of the parts run from this run (bench/readme.py)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/bench-<time>.json)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or HERE / "results" / f"bench-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "quick": args.quick,
                     "machine": machine()}
    for part in parts:
        print(f"\n===== {part} =====", flush=True)
        extra = ["--quick"] if args.quick else []
        if part in CAPPED:
            tmp = out.with_suffix(f".{part}.json")
            subprocess.run([sys.executable, "-m", PARTS[part], *extra, *CAPPED[part], "--json", str(tmp)], check=True,
                           env={**os.environ, **CAP}, cwd=HERE.parent)
            results[part] = json.loads(tmp.read_text())
            tmp.unlink()
            out.write_text(json.dumps(results, indent=2, default=str))  # after each part: a later failure keeps it
            continue
        module = importlib.import_module(PARTS[part])
        sub = argparse.ArgumentParser(prog=part)
        module.add_arguments(sub)
        results[part] = module.run(sub.parse_args(extra))
        out.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {out}")
    if args.readme:
        from bench import readme

        done = readme.write(json.loads(out.read_text()))
        print(f"rewrote README.md's tables: {', '.join(done) or 'none (no part of this run has a table there)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
