"""The classifier one worker serves: decode -> predict -> encode, wired to the batcher.

``Classifier.start()`` loads the model, compiles and warms it, starts the batcher and runs the
self-test (the shipped golden dog photo must come out with a dog breed in its top 3); only
then is the worker ready. ``classify()`` is what every view calls.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import imaging
from .assets import GOLDEN, calibration_files
from .batcher import InferenceBatcher, Offloader, keep_alive
from .engine import Engine, bf16_pays_off, choose_precision, choose_reduce_range, configure_threads
from .errors import NotReady, StartupError
from .models import LoadedModel, load_model

log = logging.getLogger(__name__)

# Our own photos (golden, calibration) are trusted files: the uploads' pixel cap does not apply.
ASSET_MAX_PIXELS = 2**40


@dataclass
class Upload:
    """One uploaded file: its client-side ``name`` (only ever echoed, escaped) and raw ``data``."""

    name: str
    data: bytes


def thumbnail(img, size: int = 320):
    """A copy of ``img`` no larger than ``size`` px on its long side (for the page's preview)."""
    thumb = img.copy()
    thumb.thumbnail((size, size))
    return thumb


def encode(logits: torch.Tensor, categories: list[str], topk: int) -> list[dict]:
    """Logits ``(C,) float32`` -> top-k ``[{"label", "index", "probability"}]`` (softmax, highest first)."""
    probs = torch.softmax(logits.float(), dim=0)
    top = torch.topk(probs, k=min(topk, probs.numel()))
    return [{"label": categories[i], "index": i, "probability": round(float(p), 6)}
            for p, i in zip(top.values.tolist(), top.indices.tolist())]


class Classifier:
    """Everything one worker needs to answer: model, engine, batcher, preprocessing, readiness."""

    def __init__(self, settings):
        self.settings = settings
        self.model: LoadedModel | None = None
        self.engine: Engine | None = None
        self.batcher: InferenceBatcher | None = None
        self.transform = None
        self.threads = 0
        self.precision_reason = ""
        self.status = "not started"  # for people: why not ready
        self.self_test: dict | None = None
        self.startup_s: float | None = None
        self._ready = False
        self.on_death = None  # set by the server: what to do if the inference thread dies
        self.on_outcomes = None  # set by webapp.metrics: called with each request's batcher Results
        self.offloader = None

    # -- start-up ------------------------------------------------------------------------------
    def start(self, heartbeat=None) -> None:
        """Load, compile, warm up, start the batcher, self-test. Idempotent.

        ``heartbeat`` (gunicorn's ``worker.notify``) is called from a real thread during start-up.

        :raises StartupError: no weights (with fallback off), a bad weights file, or a failed self-test.
        """
        if self.batcher is not None:
            return
        s = self.settings
        t0 = time.perf_counter()
        stop_beats = keep_alive(heartbeat, limit=s.STARTUP_TIMEOUT_S) if heartbeat else None
        try:
            warm = self.load()
            self.batcher = InferenceBatcher(self.engine.predict, max_batch_size=s.MAX_BATCH_SIZE,
                                            batch_timeout=s.BATCH_TIMEOUT_MS / 1e3, queue_size=s.QUEUE_SIZE,
                                            request_timeout=s.REQUEST_TIMEOUT_S, on_death=self._died,
                                            thread_init=self.engine.thread_init)
            self.batcher.start()
            self.offloader = Offloader(max_threads=max(2, self.threads))
            self._run_self_test()
        finally:
            if stop_beats:
                stop_beats()
        self.mark_ready(time.perf_counter() - t0, warm)

    def load(self) -> float:
        """Load the model, choose the precision, compile and warm up batch 1..``MAX_BATCH_SIZE``.

        Everything ``start`` does before the batcher; a Ray Serve replica (webapp/cluster.py) calls
        it and batches with ``@serve.batch`` instead. Returns the warm-up time in seconds.

        :raises StartupError: no weights (with fallback off), a bad weights file, int8 without
            calibration photos.
        """
        s = self.settings
        self.status = "loading model"
        self.threads = configure_threads(s.THREADS)
        self.model = load_model(s)
        self.transform = imaging.build_transform(self.model.preprocessing)
        precision, self.precision_reason = choose_precision(s.PRECISION)
        if s.PRECISION == "auto" and precision == "bf16":  # oneDNN says native: check it pays off here
            ok, measured = bf16_pays_off(self.model.module, self._golden_batch())
            precision = "bf16" if ok else "fp32"
            self.precision_reason = (f"{self.precision_reason}; {measured}" if ok else
                                     f"auto: oneDNN claims native bf16 but {measured}, so fp32")
        cache = self._cache_dir()
        calibration = self._calibration() if precision == "int8" else []
        self.status = "compiling" if s.COMPILE else "warming up"
        self.engine = Engine(self.model.module, input_size=self.model.preprocessing.crop, compile=s.COMPILE,
                             precision=precision, calibration=calibration,
                             reduce_range=choose_reduce_range(s.INT8_REDUCE_RANGE),
                             cache_dir=cache, cache_id=f"{self.model.name}|{self.model.weights}|{self._calib_id}")
        log.info("model %s (%s), %s (%s), compile=%s, %d intra-op threads, cores %s: warming up batch 1..%d",
                 self.model.name, self.model.weights, precision, self.precision_reason, s.COMPILE, self.threads,
                 sorted(os.sched_getaffinity(0)), s.MAX_BATCH_SIZE)
        return self.engine.warm_up(s.MAX_BATCH_SIZE)

    def mark_ready(self, startup_s: float, warm_s: float) -> None:
        """Record the start-up time (s) and report ready (logged with the model's fallback note, if any)."""
        self.startup_s = startup_s
        self._ready = True
        self.status = "ready"
        if self.model.note():
            log.warning("serving %s: %s", self.model.name, self.model.note())
        log.info("ready in %.1f s (warm-up %.1f s)", self.startup_s, warm_s)

    def _golden_batch(self) -> torch.Tensor:
        """The golden photo and its mirror image, preprocessed: ``(4, 3, S, S) float32`` for start-up checks."""
        from PIL import ImageOps

        img = imaging.decode(GOLDEN.read_bytes(), max_pixels=ASSET_MAX_PIXELS, name=GOLDEN.name).image
        views = [img, ImageOps.mirror(img)] * 2
        return torch.stack([imaging.preprocess(v, self.transform) for v in views])

    def _cache_dir(self) -> Path:
        """The persistent cache (inductor's compiled kernels, the int8 program); survives restarts.

        ``TORCHINDUCTOR_CACHE_DIR`` already set in the environment wins for inductor.
        """
        cache = Path(self.settings.CACHE_DIR or Path.home() / ".cache" / "photo-classifier").expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        # Importing torchvision already sets the variable to torch's default (/tmp/torchinductor_<user>,
        # gone after a reboot): only a value the user chose wins over ours.
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        return cache

    _calib_id = "none"

    def _calibration(self) -> list[torch.Tensor]:
        """Preprocessed calibration photos for int8 (``CALIBRATION_DIR`` or the shipped set)."""
        files = calibration_files(self.settings.CALIBRATION_DIR)
        if not files:
            raise StartupError(f"int8 needs calibration photos; none found in {self.settings.CALIBRATION_DIR}")
        tensors, names = [], []
        for f in files:
            d = imaging.decode(f.read_bytes(), max_pixels=ASSET_MAX_PIXELS, name=f.name)
            tensors.append(imaging.preprocess(d.image, self.transform))
            names.append(f"{f.name}:{f.stat().st_size}")
        self._calib_id = "|".join(names)
        return tensors

    def _run_self_test(self) -> None:
        if not self.self_test_enabled():
            return
        self.status = "self-test"
        answer = self.classify([Upload(GOLDEN.name, GOLDEN.read_bytes())], topk=3, _starting=True)
        try:
            self.judge_self_test(answer["results"][0]["predictions"])
        except StartupError:
            self.batcher.stop()
            raise

    def self_test_enabled(self) -> bool:
        """Whether start-up runs the self-test (``SELF_TEST`` on, or auto with trained weights); when
        not, ``self_test`` records why it was skipped."""
        mode = self.settings.SELF_TEST
        enabled = mode == "on" or (mode == "auto" and not self.model.untrained)
        if not enabled:
            self.self_test = {"skipped": "untrained weights" if self.model.untrained else "CLASSIFIER_SELF_TEST=off"}
        return enabled

    def judge_self_test(self, top: list[dict]) -> None:
        """Record the self-test from the golden photo's top-3 predictions (``encode``'s dicts).

        :raises StartupError: no dog breed among them (wrong weights or preprocessing).
        """
        passed = any(p["index"] in self.model.self_test_classes for p in top)
        self.self_test = {"passed": passed, "photo": GOLDEN.name, "top3": [p["label"] for p in top]}
        if not passed:
            self.status = "self-test failed"
            raise StartupError(f"self-test failed: the golden dog photo {GOLDEN} came out as "
                               f"{[p['label'] for p in top]}, no dog breed in the top 3; the weights "
                               f"({self.model.weights}) or preprocessing are wrong")

    def _died(self, exc: BaseException) -> None:
        self._ready = False
        self.status = f"inference thread died: {exc!r}"
        if self.on_death:
            self.on_death(exc)

    def stop(self) -> None:
        """Serve what is queued, then stop the inference thread."""
        self._ready = False
        self.status = "stopping"
        if self.batcher:
            self.batcher.stop()

    # -- serving ---------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """True once warmed up and self-tested, while the inference thread is alive."""
        return self._ready and self.batcher is not None and self.batcher.alive

    def describe(self) -> dict:
        """The ``model`` object of every answer: name, weights, fallback/untrained note, precision."""
        if self.model is None:
            return {"name": self.settings.MODEL, "note": self.status}
        return {**self.model.describe(), "precision": self.engine.precision, "compiled": self.engine.compiled,
                "backend": self.engine.backend}

    def classify(self, uploads: list[Upload], *, topk: int, keep_images: bool = False, _starting: bool = False) -> dict:
        """Decode, preprocess, batch-predict and encode several uploads; all succeed or the request fails.

        Returns ``{"model", "results": [{"filename", "predictions", ...}], "timing_ms": {decode,
        queue, inference, total}}``; with ``keep_images`` each result also holds ``image``, an RGB
        thumbnail (PIL, <= 320 px) for the page.

        :raises ServiceError: the first upload that cannot be decoded (400/413/415), a full queue
            (429), not ready (503), timeout (504), a failed batch (500).
        """
        if not (self.ready or _starting and self.batcher is not None):
            raise NotReady(f"the model is not ready ({self.status}); try again shortly", headers={"Retry-After": "5"})
        start = time.perf_counter()
        self.batcher.check_capacity(len(uploads))  # a full queue answers 429 before any decoding
        decoded, tensors, images = [], [], []
        for up in uploads:
            limit = ASSET_MAX_PIXELS if _starting else self.settings.MAX_PIXELS  # the self-test photo is ours
            d, tensor, image = self.offloader.run(self.decode, up, keep_images, limit)
            decoded.append(d)
            tensors.append(tensor)
            images.append(image)
        decode_ms = (time.perf_counter() - start) * 1e3
        outcomes = self.batcher.classify(tensors)
        if self.on_outcomes is not None and not _starting:
            self.on_outcomes(outcomes)
        return self.answer(uploads, decoded, images, outcomes, topk=topk, keep_images=keep_images,
                           decode_ms=decode_ms, start=start)

    def answer(self, uploads: list[Upload], decoded: list, images: list, outcomes: list, *, topk: int,
               keep_images: bool, decode_ms: float, start: float) -> dict:
        """The JSON answer of ``classify`` from each upload's decode and its batcher ``Result``.

        ``start`` is the request's ``time.perf_counter()`` at arrival; the answer's times are in ms.
        Shared by the Ray Serve replica (webapp/cluster.py), so both paths answer alike.
        """
        results = []
        for up, d, image, out in zip(uploads, decoded, images, outcomes, strict=True):
            item = {"filename": up.name, "width": d.size[0], "height": d.size[1], "format": d.format,
                    "predictions": encode(out.logits, self.model.categories, topk), "batch_size": out.batch_size}
            if keep_images:
                item["image"] = image
            results.append(item)
        return {
            "model": self.describe(),
            "results": results,
            "timing_ms": {
                "decode": round(decode_ms, 2),
                "queue": round(max(o.queue_ms for o in outcomes), 2),
                "inference": round(max(o.inference_ms for o in outcomes), 2),
                "total": round((time.perf_counter() - start) * 1e3, 2),
            },
        }

    def decode(self, up: Upload, keep_image: bool, max_pixels: int):
        """Decode + preprocess one upload; return (``Decoded`` without its image, tensor, thumbnail or None).

        The tensor is ``(3, S, S) float32``, normalized as the model's preprocessing says. Runs on
        an Offloader thread under gunicorn, on a decode pool thread in a Ray replica.

        :raises ServiceError: undecodable (400), too many pixels (413), not an image (415).
        """
        d = imaging.decode(up.data, max_pixels=max_pixels, name=up.name, min_side=self._min_side())
        tensor = imaging.preprocess(d.image, self.transform)
        # Keep only what the answer needs: a full-size image held while the batch waits would
        # multiply memory by the number of requests in flight.
        image = thumbnail(d.image) if keep_image else None
        d.image = None
        return d, tensor, image

    def _min_side(self) -> int | None:
        """With FAST_DECODE, decode big photos only as large as the resize needs (short side >= resize)."""
        return self.model.preprocessing.resize if self.settings.FAST_DECODE else None

    def health(self) -> dict:
        """``/healthz``: liveness plus this worker's pid, pinned cores, threads, model, precision, queue."""
        b = self.batcher
        return {
            "status": "ok",
            "ready": self.ready,
            "state": self.status,
            "pid": os.getpid(),
            "cores": sorted(os.sched_getaffinity(0)),
            "intra_op_threads": torch.get_num_threads(),
            "model": self.describe(),
            "precision": self.engine.precision if self.engine else None,
            "precision_reason": self.precision_reason,
            "int8_reduce_range": self.engine.reduce_range if self.engine else None,
            "self_test": self.self_test,
            "startup_s": None if self.startup_s is None else round(self.startup_s, 2),
            "max_batch_size": self.settings.MAX_BATCH_SIZE,
            "queue_depth": b.queue_depth if b else 0,
            "batches": b.batches if b else 0,
            "images": b.images if b else 0,
        }
