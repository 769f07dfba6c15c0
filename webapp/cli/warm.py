"""``python -m webapp warm``: build the compile caches once, at install time, so the first start is fast.

It runs the very start-up a gunicorn worker runs (``startup.load_engine``: weights -> precision ->
compile/AOTInductor -> warm-up of the batch sizes, then the self-test), pinned as the first worker
of gunicorn's layout would be (``cpu.plan``: same cores, so the same intra-op thread count, which
keys the per-host precision record). What that writes under ``CLASSIFIER_CACHE_DIR`` (the precision
record, the AOTInductor packages and inductor's kernels, whatever engine.py builds) is what a worker then
loads. Safe to run again: the second run finds it all and says so.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

from .. import caches
from .. import settings as settings_mod
from .common import EXIT_FAILED, EXIT_OK, err
from .options import HelpFormatter, add_setting_options, as_environ, given_settings, settings_epilog


def add_parser(sub) -> None:
    """Add the ``warm`` command to ``sub`` (the top parser's subparsers)."""
    p = sub.add_parser(
        "warm", formatter_class=HelpFormatter,
        help="build the compile caches once (install time), so the service's first start is ready in seconds",
        description="Load, compile and warm up the model exactly as a gunicorn worker does, for the precision "
                    "this CPU uses (the per-host decision, recorded in the cache folder) and the thread count of "
                    "the worker layout, and keep what it built in CLASSIFIER_CACHE_DIR. Safe to run again: it "
                    "then says the caches were already there. Run it with the settings the service will have.",
        epilog=settings_epilog())
    p.add_argument("--keep-affinity", action="store_true",
                   help="stay on the cores this process was given instead of gunicorn's worker 0's (a serving "
                        "worker runs warm so to build what its cache lacks, keeping the compiler out of its memory)")
    add_setting_options(p, commands=(settings_mod.SERVE,))
    p.set_defaults(func=cmd_warm)


def snapshot(folder: Path) -> dict[str, int]:
    """``{relative path: size in bytes}`` of every file under ``folder`` (locks and temporaries aside)."""
    if not folder.is_dir():
        return {}
    out = {}
    for p in folder.rglob("*"):
        if p.is_file() and not p.name.endswith((".lock", ".tmp")):
            try:
                out[str(p.relative_to(folder))] = p.stat().st_size
            except OSError:  # removed while we looked (inductor's own temporaries)
                pass
    return out


def cmd_warm(args: argparse.Namespace) -> int:
    """``warm``: ``load_engine`` + self-test in this process, pinned like gunicorn's first worker.

    Prints where the cache is, what was built (files and MB added) or that it was already there,
    the precision and why, and the seconds taken. Returns EXIT_OK, or EXIT_FAILED when start-up
    fails (its one-line reason on stderr, as a worker would log it). A bad setting, or a ``CACHE_DIR`` that
    cannot be made, raises ``SettingsError`` (``main`` makes it exit 2).
    """
    from .. import children

    children.bounded_child()  # where a worker started this: ends with it, compilers and files too, however it ends
    os.environ.update(as_environ(given_settings(args)))
    s = settings_mod.load()
    from .. import cpu

    cores = cpu.usable_cores()
    plan = cpu.plan(cores, workers=s.WORKERS, threads=s.THREADS)
    if not args.keep_affinity:
        os.sched_setaffinity(0, plan.slots[0])  # the cores, hence the thread count, of gunicorn's worker 0
    logging.basicConfig(level=getattr(logging, s.LOG_LEVEL.upper()), format="%(message)s")
    logging.getLogger("webapp").setLevel(logging.WARNING if s.LOG_LEVEL == "info" else s.LOG_LEVEL.upper())

    from ..errors import StartupError
    from ..startup import inductor_cache_dir, load_engine, self_test

    # Made first, as start-up would: one that cannot be made is a setting's fault (SettingsError, exit 2), said
    # before snapshot's pathlib probes would raise for it (a name part over 255 bytes).
    cache = caches.make_cache_dir(s)
    before = snapshot(cache)
    err(f"warming up as gunicorn's worker 0 would start ({cpu.describe(plan, cores)}); "
        f"cache {cache} ...")
    t0 = time.perf_counter()
    try:
        started = load_engine(s, status=lambda phase: err(f"  {phase}"))
        started.engine.thread_init()
        test = self_test(s, started, started.engine.predict)
    except StartupError as exc:
        err(f"error: {exc}")
        return EXIT_FAILED
    took = time.perf_counter() - t0
    after = snapshot(cache)
    added = {k: v for k, v in after.items() if before.get(k) != v}
    e = started.engine
    print(f"model {started.model.name}, {e.precision} ({started.precision_reason}), backend {e.backend}, "
          f"intra-op threads {started.threads}, batch 1..{s.MAX_BATCH_SIZE} warmed in {took:.1f} s")
    if "passed" in test:
        print(f"self-test: {'passed' if test['passed'] else 'FAILED'} (top 3 of {test['photo']}: "
              f"{', '.join(test['top3'])})")
    if not s.COMPILE:
        print(f"compile is off (CLASSIFIER_COMPILE=0): nothing to cache but the precision record; cache {cache}")
    elif added:
        print(f"caches built: {len(added)} files, {sum(added.values()) / 1e6:.1f} MB added in {cache} "
              f"(kernels: {inductor_cache_dir(s)})")
    else:
        print(f"caches were already there: nothing new in {cache} (kernels: {inductor_cache_dir(s)})")
    print(f"the service reads them when started with CLASSIFIER_CACHE_DIR={cache}")
    return EXIT_OK
