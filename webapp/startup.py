"""Start-up: weights -> precision -> calibration -> compile and warm-up -> self-test.

Everything a process does before it can answer, in one place, reused as is by the gunicorn worker
and the CLI (``service.Classifier.start``) and by the Ray Serve replica and Ray Data actor
(``webapp/cluster/``). Only who runs the batches afterwards differs, so the self-test takes the
caller's ``predict``: it must run on the thread that will serve (intra-op threads are per thread).

The start-up time budget: a warm cache (compiled kernels, the bf16 AOTInductor package, the int8
program, all under ``cache_dir``) makes a worker ready in seconds; a cold one compiles (about a
minute on 2 cores).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torchvision.transforms import v2

from . import caches, catalog, children, cpu, imaging
from .assets import GOLDEN, GOLDEN_SHOWN, calibration_files
from .bf16 import judge_bf16, keep_fp32_for
from .engine import (Engine, GraphsDisagree, choose_precision, choose_reduce_range, configure_threads, missing_compiler,
                     native_bf16)
from .errors import StartupError
from .models import LoadedModel, encode, load_model
from .paths import reason
from .quiet import quiet_third_party
from .records import recorded_precision
from .settings import given_as

log = logging.getLogger(__name__)

# Our own photos (golden, calibration) are trusted files: the uploads' pixel cap does not apply.
ASSET_MAX_PIXELS = 2**40


@dataclass
class Started:
    """A model ready to serve: ``engine.predict`` maps ``(N, 3, S, S) float32`` to ``(N, C) float32``
    logits for N = 1..``MAX_BATCH_SIZE`` (all warmed up); ``transform`` makes those inputs from RGB
    photos; ``threads`` intra-op threads; ``precision_reason`` says why this precision; ``warm_s``
    is the compile + warm-up time (s)."""

    model: LoadedModel
    engine: Engine
    transform: v2.Compose
    threads: int
    precision_reason: str
    warm_s: float

    def describe(self) -> dict:
        """The ``model`` object of every answer: name, title, weights, fallback/untrained note, input
        size, categories, and the engine's precision, ``compiled`` and backend."""
        e = self.engine
        return {**self.model.describe(), "precision": e.precision, "compiled": e.compiled, "backend": e.backend}

    def min_side(self, fast_decode: bool) -> int | None:
        """With ``FAST_DECODE``, decode big photos only as large as the resize needs (short side, px)."""
        return self.model.preprocessing.resize if fast_decode else None


def inductor_cache_dir(settings) -> Path:
    """Where inductor's compiled kernels go: ``TORCHINDUCTOR_CACHE_DIR`` if the user set it, else
    ``<cache_dir>/inductor``. What ``use_cache_dir`` applies and ``python -m webapp info`` shows.

    Importing torchvision already sets that variable to torch's default (``/tmp/torchinductor_<user>``,
    gone after a reboot), so only a value other than the default counts as the user's.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given not in (None, "", default_cache_dir()):
        return Path(given)
    return caches.cache_dir(settings) / "inductor"


def use_cache_dir(settings) -> Path:
    """Create the cache folder and point inductor's kernel cache at ``inductor_cache_dir``; return the folder.
    One that cannot be written (a warm cache on a read-only mount) is used as it is, with a warning: what it
    lacks is built at each start and not kept, inductor's kernels in ``$TMPDIR/classifier-inductor-<uid>``.

    :raises SettingsError: the folder cannot be created (``caches.make_cache_dir``).
    """
    cache = caches.make_cache_dir(settings, read_only_ok=True)
    kernels = inductor_cache_dir(settings)
    if why := caches.unwritable(cache):
        log.warning("CLASSIFIER_CACHE_DIR=%s cannot be written (%s): the compiled model and the precision record it "
                    "holds are used; anything it lacks is built at each start, and not kept", cache, why)
        if kernels.is_relative_to(cache):
            kernels = Path(tempfile.gettempdir()) / f"classifier-inductor-{os.getuid()}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(kernels)
    return cache


def calibration(settings, transform: v2.Compose) -> tuple[Callable[[], list[torch.Tensor]], str]:
    """int8 calibration photos (``CALIBRATION_DIR`` or the shipped set): a function that decodes them, each
    ``(3, S, S) float32``, and an id of the set (names and byte sizes) for the int8 program's cache key.

    The decode is left to whoever needs the pixels: a start that loads its int8 package never calls it
    (the 28 shipped photos took ~0.5 s of a ~5 s warm start).

    :raises StartupError: no photo in the folder, or it cannot be read (``given_photos``).
    """
    files = given_photos(settings)
    if not files:
        raise StartupError(f"int8 needs calibration photos; none found in {settings.CALIBRATION_DIR}")

    def tensors() -> list[torch.Tensor]:
        return [imaging.preprocess(imaging.decode(f.read_bytes(), max_pixels=ASSET_MAX_PIXELS, name=f.name).image,
                                   transform) for f in files]

    return tensors, "|".join(f"{f.name}:{f.stat().st_size}" for f in files)


def judged_files(settings) -> list[Path]:
    """The photos ``auto`` judges bf16 on: the calibration photos (``CALIBRATION_DIR``, else the shipped set).

    :raises StartupError: ``CALIBRATION_DIR`` cannot be read (``given_photos``).
    """
    return given_photos(settings) or calibration_files()


def given_photos(settings) -> list[Path]:
    """The photos in ``CALIBRATION_DIR`` (the shipped set where it is empty).

    :raises StartupError: the folder cannot be read: missing, not a folder, a name too long... (the OS's reason,
        in one line, where a traceback would be).
    """
    try:
        return calibration_files(settings.CALIBRATION_DIR)
    except OSError as exc:
        raise StartupError(f"{given_as(settings, 'CALIBRATION_DIR')}={settings.CALIBRATION_DIR} cannot be read: "
                           f"{reason(exc)}") from None


def photos_id(files: list[Path]) -> str:
    """16 hex of the photos' names and byte sizes: a changed set of judged photos measures again."""
    return hashlib.sha256("|".join(f"{f.name}:{f.stat().st_size}" for f in files).encode()).hexdigest()[:16]


def decide_auto_precision(model: LoadedModel, transform: v2.Compose, files: list[Path] | None = None,
                          recheck_pts: float = 0.0) -> tuple[str, str, dict | None]:
    """``auto`` resolved here and now: bf16 only where oneDNN claims native bf16, the model's catalog entry
    does not rule it out (``bf16_auto_off``: a target of the fidelity bench it misses) *and* the bf16
    policy, run eagerly on the calibration photos ``files`` (``bf16.judge_bf16``, 2-4 s of CPU) as it would
    be served (its close calls under ``recheck_pts`` answered by fp32: ``recheck_points``), keeps fp32's
    answers and bf16 kernels are fast here. Returns ``(precision, reason, figures)``; figures is None where nothing was measured."""
    precision, reason = choose_precision("auto")
    if precision != "bf16":
        return precision, reason, None
    off = catalog.BY_NAME[model.name].bf16_auto_off if model.name in catalog.BY_NAME else ""
    if off:
        return "fp32", f"auto: fp32 for {model.name}: {off}", None
    files = files if files is not None else calibration_files()
    photos = torch.stack([imaging.preprocess(imaging.decode(f.read_bytes(), max_pixels=ASSET_MAX_PIXELS,
                                                             name=f.name).image, transform) for f in files])
    # The workers of a server starting together wait for this one's judgement (recorded_precision's lock):
    # its fidelity part may use their cores meanwhile (the speed part stays on this worker's own threads).
    ok, measured, figures = judge_bf16(model.module, photos, cores=cpu.SERVER_CORES,
                                       keep_fp32=keep_fp32_for(model.name), recheck_pts=recheck_pts)
    if ok:
        return "bf16", f"{reason}; {measured}", figures
    if figures.get("faithful"):
        # Faithful, but native bf16 kernels measured slow: on such a CPU that is a neighbour on this core
        # more often than the CPU (two servers started together here measured 0.62x, alone 1.27-1.51x), so
        # the verdict holds for this server start only and the next start measures again (records.py; three
        # starts in a row make it the host's).
        figures = {**figures, "provisional": True}
    return "fp32", f"auto: oneDNN claims native bf16 but {measured}, so fp32", figures


def precision_key(model: LoadedModel, threads: int, photos: str = "", recheck_pts: float = 0.0) -> dict:
    """What ``auto``'s decision depends on: torch's version, the model and its weights, the intra-op
    threads it was measured with, the CPU as this process runs it (its model name, the kernels
    torch picks and oneDNN's ISA cap, both of which the environment can lower, and whether oneDNN
    claims native bf16), the model's bf16 policy (``bf16.keep_fp32_for``), the judged photos (``photos_id``),
    bf16's recheck points (``recheck_points``) and the version of the judgement's rules. Any change of these
    measures again."""
    return {"torch": torch.__version__, "model": model.name, "weights": model.weights, "threads": threads,
            "cpu": cpu.cpu_info()["model"], "capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""), "native_bf16": native_bf16(),
            "bf16_policy": list(keep_fp32_for(model.name)), "photos": photos,
            "recheck_pts": recheck_pts,
            "rules": 3,  # the judgement's rules: 2 made slow bf16 provisional, 3 judges it with its rechecks
            "bf16_auto_off": bool(catalog.BY_NAME[model.name].bf16_auto_off) if model.name in catalog.BY_NAME else False}


def choose_engine_precision(settings, model: LoadedModel, transform: v2.Compose, *, cache: Path | None = None,
                            threads: int = 0) -> tuple[str, str]:
    """``PRECISION``, with ``auto`` resolved (``decide_auto_precision``). With a ``cache`` folder the
    decision is made once per host and CPU and read by every worker (``recorded_precision``;
    ``threads`` is part of its key). Returns ``(precision, reason)`` for the log and ``/healthz``."""
    if settings.PRECISION != "auto":
        return choose_precision(settings.PRECISION)
    files, pts = judged_files(settings), recheck_points(settings, model, "bf16")
    if cache is None:
        return decide_auto_precision(model, transform, files, pts)[:2]
    return recorded_precision(cache, precision_key(model, threads, photos_id(files), pts),
                              lambda: decide_auto_precision(model, transform, files, pts))


def build_in_child(settings) -> Callable[[str], Callable[[list[Path]], None]]:
    """For ``load_engine(build_elsewhere=...)``: absent AOTInductor packages built by a child process,
    ``python -m webapp warm --keep-affinity`` with these settings and the precision this process chose.

    Why: a process that compiles keeps what the compile imported and allocated for the rest of its life.
    Measured after a cold start (e2e bench, 2 workers, ResNet-18 fp32, Zen 3): 320-411 MB private per worker
    at ready, where a worker that loaded the same packages holds 84 MB. The child holds that memory and
    exits; the worker then loads the packages as a warm start does. One process builds at a time (a file
    lock in the cache folder), so the other workers of a server starting cold wait, find the packages built
    and only load them: one compile per host instead of one per worker. If the child fails, its last lines
    are logged and the caller builds in its own process, as before; if it runs past ``STARTUP_TIMEOUT_S``,
    the start fails (building here would take as long again, with the compiler's memory kept in the worker).

    :raises StartupError: (from the returned function) the child ran past ``STARTUP_TIMEOUT_S``.
    """
    from .settings import PREFIX

    def build_for(precision: str) -> Callable[[list[Path]], None]:
        def build(paths: list[Path]) -> None:
            from filelock import FileLock

            env = {**os.environ, **{PREFIX + k: ("1" if v else "0") if isinstance(v, bool) else str(v)
                                    for k, v in settings.items()}, PREFIX + "PRECISION": precision,
                   "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                  os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
            with FileLock(str(caches.cache_dir(settings) / "aoti-build.lock")):
                if all(p.is_file() for p in paths):
                    return  # another worker's child built them while this one waited
                if missing := missing_compiler():  # said at once, not after a child's and this process's tries
                    raise StartupError(missing)
                t0 = time.perf_counter()
                log.info("compiling the %s model ahead of time in a child process (python -m webapp warm): about a "
                         "minute on 2 cores, once; later starts load it from %sCACHE_DIR", precision, PREFIX)
                try:
                    done = children.run_bounded([sys.executable, "-m", "webapp", "warm", "--keep-affinity"],
                                                env=env, timeout_s=settings.STARTUP_TIMEOUT_S)
                except subprocess.TimeoutExpired:  # child and compilers have ended; the setting's promise is kept
                    raise StartupError(
                        f"compiling the {precision} model took longer than {PREFIX}STARTUP_TIMEOUT_S="
                        f"{settings.STARTUP_TIMEOUT_S} s (a first start compiles for about a minute per precision "
                        f"on 2 cores, once: later starts load it from {PREFIX}CACHE_DIR); raise it, or "
                        f"{PREFIX}COMPILE=0 serves the model uncompiled") from None
                except (OSError, subprocess.SubprocessError) as exc:  # could not start
                    done = subprocess.CompletedProcess([], -1, "", str(exc))
            if done.returncode != 0 or not all(p.is_file() for p in paths):
                tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
                # info, not warning: where the child fails, building here most likely fails alike and says why
                log.info("building the packages in a child process failed (exit %s: %s); building them here",
                         done.returncode, tail)
            else:
                log.info("%s AOTInductor packages built in a child process in %.1f s", precision,
                         time.perf_counter() - t0)
        return build
    return build_for


def recheck_points(settings, model: LoadedModel, precision: str) -> float:
    """How close (percentage points between the top two) a call of ``precision`` must be to be answered by fp32:
    ``INT8_RECHECK_PTS`` for int8, ``BF16_RECHECK_PTS`` for bf16; 0 (none) for fp32 and for untrained weights,
    whose every photo is a near-tie (seeded ResNet-18: all of them rechecked, fp32's time and more, for answers
    that mean nothing)."""
    pts = {"int8": settings.INT8_RECHECK_PTS, "bf16": settings.BF16_RECHECK_PTS}.get(precision, 0.0)
    return 0.0 if model.untrained else pts


def recheck_engine(settings, model: LoadedModel, cache: Path | None, precision: str,
                   build_elsewhere: Callable[[str], Callable[[list[Path]], None]] | None) -> tuple[Engine, float] | None:
    """The second opinion of int8 and bf16 (``Engine``'s ``recheck``) and its ``recheck_points``: the model in fp32,
    built as an fp32 server builds it (the same package in ``cache``), where those points are > 0; else None."""
    if (pts := recheck_points(settings, model, precision)) <= 0:
        return None
    return Engine(model.module, input_size=model.preprocessing.crop, compile=settings.COMPILE, precision="fp32",
                  cache_dir=cache, cache_id=f"{model.name}|{model.weights}|none",
                  build_elsewhere=build_elsewhere("fp32") if build_elsewhere else None), pts


@quiet_third_party()  # torch's and torchao's own warnings: once each at debug level (webapp/quiet.py)
def load_engine(settings, *, status: Callable[[str], None] = lambda _: None,
                build_elsewhere: Callable[[str], Callable[[list[Path]], None]] | None = None) -> Started:
    """Load the model, choose the precision, build the engine and warm up batch 1..``MAX_BATCH_SIZE``.

    ``status`` is told each phase (``loading model``, ``compiling``/``warming up``) for ``/readyz``.
    ``build_elsewhere`` (``build_in_child(settings)``, for serving workers) builds absent packages
    in another process, given the precision chosen here.

    :raises StartupError: no weights (with fallback off), a bad weights file, int8 without
        calibration photos.
    """
    status("loading model")
    threads = configure_threads(settings.THREADS)
    model = load_model(settings)
    if model.note():  # said once per process, here, where every path (worker, CLI, Ray) passes
        log.warning("serving %s: %s", model.name, model.note())
    transform = imaging.build_transform(model.preprocessing)
    cache = use_cache_dir(settings)
    precision, reason = choose_engine_precision(settings, model, transform, cache=cache, threads=threads)
    photos, calib_id = calibration(settings, transform) if precision == "int8" else (None, "none")
    # The engine tells status "compiling", or "loading compiled model" where the cache holds its packages.
    engine = Engine(model.module, input_size=model.preprocessing.crop, compile=settings.COMPILE,
                    precision=precision, calibration=photos,
                    reduce_range=choose_reduce_range(settings.INT8_REDUCE_RANGE),
                    bf16_keep_fp32=keep_fp32_for(model.name),
                    cache_dir=cache, cache_id=f"{model.name}|{model.weights}|{calib_id}",
                    build_elsewhere=build_elsewhere(precision) if build_elsewhere else None, status=status)
    if engine.backend != "inductor":  # the JIT compiles as it warms up; packages and eager only run
        status("warming up")
    if (recheck := recheck_engine(settings, model, cache, precision, build_elsewhere)) is not None:
        engine.add_recheck(*recheck)
        pts = recheck[1]
        from .settings import PREFIX

        reason += (f"; close calls (top two under {pts:g} point{'' if pts == 1 else 's'} apart) answered by fp32 "
                   f"({PREFIX}{precision.upper()}_RECHECK_PTS)")
    # Each worker says this: the reason short (a model's bf16_auto_off runs to 400 characters with its figures).
    log.info("model %s (%s), %s (%s), compile=%s, intra-op threads %d, cores %s: warming up batches up to %d",
             model.name, model.weights, precision,
             textwrap.shorten(reason, 160, placeholder=" ... (whole: /healthz, python -m webapp info)"),
             settings.COMPILE, threads,
             sorted(os.sched_getaffinity(0)), settings.MAX_BATCH_SIZE)
    golden = imaging.decode(GOLDEN.read_bytes(), max_pixels=ASSET_MAX_PIXELS, name=GOLDEN.name).image
    try:
        warm_s = engine.warm_up(settings.MAX_BATCH_SIZE, sample=imaging.preprocess(golden, transform)[None])
    except GraphsDisagree as exc:
        raise StartupError(f"the compiled model is damaged: on the golden photo {GOLDEN.name}, {exc}; "
                           f"{(exc.engine or engine).remedy(inductor_cache_dir(settings))}") from None
    if engine.backend == "aoti":  # the packages hold their own weights: the module would be one more copy in
        model.module = None  # every worker (ResNet-18 fp32: 45 MB private each; #7). Eager and JIT still run on it.
    return Started(model=model, engine=engine, transform=transform, threads=threads, precision_reason=reason,
                   warm_s=warm_s)


def self_test_enabled(settings, model: LoadedModel) -> tuple[bool, dict | None]:
    """Whether start-up runs the self-test (``SELF_TEST`` on, or auto with trained weights); when not,
    the record that says why it was skipped."""
    mode = settings.SELF_TEST
    if mode == "on" or (mode == "auto" and not model.untrained):
        return True, None
    return False, {"skipped": "untrained weights" if model.untrained else "CLASSIFIER_SELF_TEST=off"}


def judge_self_test(model: LoadedModel, top: list[dict]) -> dict:
    """The self-test record from the golden photo's top-3 rows (``models.encode``'s dicts).

    :raises StartupError: no dog breed among them (wrong weights or preprocessing).
    """
    passed = any(p["index"] in model.self_test_classes for p in top)
    record = {"passed": passed, "photo": GOLDEN_SHOWN, "top3": [p["label"] for p in top]}
    if not passed:
        raise StartupError(f"self-test failed: the golden dog photo {GOLDEN} came out as "
                           f"{[p['label'] for p in top]}, no dog breed in the top 3; the weights "
                           f"({model.weights}) or preprocessing are wrong")
    return record


def self_test(settings, started: Started, predict: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """Classify the shipped golden dog photo through ``predict`` and judge it (see ``judge_self_test``).

    ``predict`` maps ``(1, 3, S, S) float32`` to ``(1, C)`` logits on the serving path (the batcher's
    thread, a replica's inference thread). Returns the record ``/readyz`` shows, also when skipped.

    :raises StartupError: the self-test failed.
    """
    enabled, skipped = self_test_enabled(settings, started.model)
    if not enabled:
        return skipped
    photo = imaging.prepare(GOLDEN.read_bytes(), name=GOLDEN.name, transform=started.transform,
                            max_pixels=ASSET_MAX_PIXELS, min_side=started.min_side(settings.FAST_DECODE))
    logits = predict(photo.tensor[None])
    return judge_self_test(started.model, encode(logits[0], started.model.categories, 3))
