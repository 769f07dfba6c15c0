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
- fidelity: bf16 against fp32, layer group by layer group (eager autocast, the bf16 policy with each
  set of layers kept in fp32, torch.compile, the AOTInductor package): top-1 agreement, top-1
  probability change, ties, and speed as a ratio to fp32 of the same kind.
- int8: int8 mixed precision (layer groups left in fp32) against fp32: top-1 agreement, top-1
  probability change, logit error, and speed as ratios to our fp32 and bf16.

Every timing is a ratio against a baseline measured in the same run (the machine may be shared).
``--cap-avx2`` runs the engine part as an old AVX2-only server would (``ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2``, in a child process so the cap applies before torch loads).
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
         "overload": "bench.overload_bench", "fidelity": "bench.fidelity_bench",
         "int8": "bench.int8_bench"}
CAP = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen parts (each prints its tables), write all results to one JSON file; 0.

    :raises SystemExit: unknown parts (usage error); subprocess.CalledProcessError: the capped engine run failed."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test, minutes not tens of minutes)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    parser.add_argument("--cap-avx2", action="store_true", help="run the engine part with the CPU capped to AVX2")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/bench-<time>.json)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or HERE / "results" / f"bench-{stamp}{'-avx2' if args.cap_avx2 else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "quick": args.quick,
                     "cap_avx2": args.cap_avx2}
    for part in parts:
        print(f"\n===== {part} =====", flush=True)
        extra = ["--quick"] if args.quick else []
        if part == "engine" and args.cap_avx2:
            tmp = out.with_suffix(".engine.json")
            subprocess.run([sys.executable, "-m", PARTS[part], *extra, "--json", str(tmp)], check=True,
                           env={**os.environ, **CAP}, cwd=HERE.parent)
            results[part] = json.loads(tmp.read_text())
            tmp.unlink()
            continue
        module = importlib.import_module(PARTS[part])
        sub = argparse.ArgumentParser(prog=part)
        module.add_arguments(sub)
        results[part] = module.run(sub.parse_args(extra))
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
