"""Benchmarks of the service; each module runs alone from the repo root (venv active)::

    python bench/preprocess_bench.py [--quick] [--json out.json]

or is imported: ``add_arguments(parser)`` then ``run(args) -> dict`` (JSON-serialisable; ``run``
also prints its fixed-width tables). The machine these run on is shared and noisy, so every
timing is reported as a ratio against a baseline measured in the same run, interleaved where
possible. This package holds only what the modules share: paths, statistics, tables, the log, ``main``;
the shared pieces live in ``servers.py`` (starting servers), ``load.py`` (HTTP load),
``inputs.py`` and ``runtimes.py`` (the engine benchmarks' photos and runtimes).
Torch is never imported here (the server modules must stay cheap to import).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT.parent / "shared" / "images"
PHOTO_12MP = "phone-12mp.jpg"
PHOTO_12MP_ROTATED = "phone-12mp-exif-rotated.jpg"


def photo(name: str) -> Path:
    """Path of a shared photo (``../shared/images``); exits with a message when it is absent."""
    path = Path(name) if "/" in name else IMAGES / name
    if not path.is_file():
        sys.exit(f"{path} is absent (the shared photos live in {IMAGES})")
    return path


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    """The 50th ``percentile``; NaN for no values."""
    return percentile(values, 50)


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN where ``b`` is 0 or either is NaN."""
    if not b or a != a or b != b:
        return math.nan
    return a / b


def num(x, digits: int = 1) -> str:
    """A number for a table cell: fixed decimals, '-' for None/NaN."""
    if x is None or isinstance(x, float) and x != x:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def table(headers: Sequence[str], rows: Iterable[Sequence], title: str | None = None) -> str:
    """A fixed-width text table: the first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [title] if title else []
    out += [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]
    return "\n".join(out)


def clean(obj):
    """Make ``obj`` strictly JSON-serialisable (NaN/inf -> None)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def log(*parts) -> None:
    """Progress for people, on stderr (stdout keeps the tables), after the time of day: ``[HH:MM:SS] ...``."""
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def main(doc: str | None, add_arguments: Callable, run: Callable, argv: list[str] | None = None) -> dict:
    """``python bench/X.py [--quick] [--json out.json] ...``: parse, run (which prints its tables), save JSON."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    if not any(a.dest == "json" for a in parser._actions):
        parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    result = clean(run(args))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        log(f"results written to {args.json}")
    return result
