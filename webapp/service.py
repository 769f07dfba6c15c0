"""The classifier one process serves: decode -> predict -> encode, wired to the batcher.

``Classifier.start()`` runs start-up (``webapp/startup.py``: model, precision, compile, warm-up),
starts the batcher and runs the self-test; only then is the worker ready. ``admit()`` (before the
body is read: readiness, admission by time in ``webapp/admission.py``, the queue bound) and
``classify()`` are what every view calls (``contract.ClassifierLike``). A photo's path through it:
``imaging.prepare`` on a decode thread (``concurrency.Offloader``) -> ``InferenceBatcher.infer`` ->
``encode`` -> ``answer``; a client that hung up meanwhile is not decoded or run (``ClientGone``).
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from functools import partial
from typing import Callable, Mapping

import torch

from . import balance, cpu, imaging, preload, startup
from .admission import Admission, Ticket
from .batcher import InferenceBatcher
from .concurrency import Offloader, StillRunning, keep_alive, lower_this_thread, peer_closed, peer_sending
from .contract import Upload
from .errors import ClientGone, InferenceTimeout, NotReady, ServiceError, StartupError, TooLarge
from .formats import claimed_format
from .answers import PHOTO_FAULTS, answer, check_originals, every_fault
from .imaging import Prepared
from .sizes import check_request_pixels
from .models import encode

log = logging.getLogger(__name__)

__all__ = ["Classifier", "Upload", "answer", "encode"]

# The admitted request's ``Ticket``, from ``admit`` to its ``classify`` (the same request greenlet or
# thread: each has its own context, as Flask's own request context relies on).
_TICKET: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("admission_ticket", default=None)
# Whether this request counts as in progress for webapp/balance.py (from admit to end_request).
_COUNTED: contextvars.ContextVar[bool] = contextvars.ContextVar("counted_in_progress", default=False)
HEAVY_NICE = 19  # niceness steps below the hub of the heavy lane's thread: the lowest there is (capped at 19)


class Classifier:
    """Everything one worker needs to answer: model, engine, batcher, preprocessing, readiness."""

    def __init__(self, settings):
        self.settings = settings
        self.started: startup.Started | None = None
        self.batcher: InferenceBatcher | None = None
        self.offloader: Offloader | None = None
        self.heavy_lane: Offloader | None = None
        self.admission: Admission | None = None
        self.status = "not started"  # for people: why not ready
        self.self_test: dict | None = None
        self.startup_s: float | None = None
        self._ready = False
        self._described: dict | None = None
        self.on_death = None  # set by the server: what to do if the inference thread dies
        self.on_outcomes = None  # set by webapp.metrics: called with each request's batcher Results

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
            # A child process compiles what is not in the cache yet, so this worker never holds the compiler.
            self.started = started = startup.load_engine(s, status=self._set_status,
                                                         build_elsewhere=startup.build_in_child(s))
            self.batcher = InferenceBatcher(started.engine.predict, max_batch_size=s.MAX_BATCH_SIZE,
                                            batch_timeout=s.BATCH_TIMEOUT_MS / 1e3, queue_size=s.QUEUE_SIZE,
                                            request_timeout=s.REQUEST_TIMEOUT_S, on_death=self._died,
                                            thread_init=partial(_inference_thread_init, started.engine,
                                                                s.WORK_NICE), wait=s.BATCH_WAIT,
                                            on_idle=preload.trim if s.TRIM_IDLE_S else None, idle_s=s.TRIM_IDLE_S)
            self.batcher.start()
            self.offloader = Offloader(max_threads=max(2, started.threads), nice=s.WORK_NICE,
                                       cores=cpu.SERVER_CORES if s.DECODE_CORES == "server" else None)
            # The heavy lane (webapp/admission.py): one photo at a time, at the lowest priority, behind the others
            self.heavy_lane = Offloader(max_threads=1, nice=HEAVY_NICE, cores=self.offloader.cores)
            # Decodes run side by side only as far as the worker has cores for them (CPU-time costs).
            self.admission = Admission(budget_ms=s.MAX_WAIT_MS, decode_threads=min(
                                           self.offloader.max_threads, len(os.sched_getaffinity(0))),
                                       image_ms=lambda: self.batcher.image_ms,
                                       queued=lambda: self.batcher.queue_depth + self.batcher.running_images,
                                       inference_cpu=lambda: self.batcher.cpu_s)
            self.status = "self-test"
            try:
                self.self_test = startup.self_test(s, started, self._predict_on_batcher)
            except StartupError:
                self.status = "self-test failed"
                self.batcher.stop()
                raise
            self._measure_costs(started)
        finally:
            if stop_beats:
                stop_beats()
        self.mark_ready(time.perf_counter() - t0)

    def _set_status(self, status: str) -> None:
        self.status = status

    def _measure_costs(self, started: startup.Started) -> None:
        """Give admission measured costs before the first request: the golden photo (small: it fixes the
        decode cost per upload) decoded twice on a decode thread, the second timed (the first pays one-off
        set-up), and, where the self-test was skipped, one forward pass of it through the batcher (a failed
        one is only logged: this is a measurement)."""
        data = startup.GOLDEN.read_bytes()
        for _ in range(2):
            prepared, ms = self.offloader.run(_timed_prepare, data, name=startup.GOLDEN.name,
                                              transform=started.transform, max_pixels=startup.ASSET_MAX_PIXELS,
                                              min_side=started.min_side(self.settings.FAST_DECODE))
        self.admission.decode.observe(len(data), ms)
        if not self.batcher.batches:
            try:
                self.batcher.infer([prepared.tensor], timeout=self.settings.STARTUP_TIMEOUT_S)
            except ServiceError as exc:  # a measurement, never a failed start
                log.debug("no forward pass measured at start-up (%s); admission counts from the first batch",
                          exc.message)

    def _predict_on_batcher(self, batch: torch.Tensor) -> torch.Tensor:
        """``(N, 3, S, S) float32`` -> ``(N, C)`` logits through the batcher's thread (the serving path), due within
        ``STARTUP_TIMEOUT_S``: ``REQUEST_TIMEOUT_S`` is a client's deadline, and bounding the self-test by it
        (0.01 s, the documented minimum) failed every start with "the server is overloaded" (exit 3)."""
        return torch.stack([r.logits for r in self.batcher.infer(list(batch), timeout=self.settings.STARTUP_TIMEOUT_S)])

    def mark_ready(self, startup_s: float) -> None:
        """Record the start-up time (s) and report ready (the fallback note was logged by ``startup.load_engine``)."""
        self.startup_s = startup_s
        self._ready = True
        self.status = "ready"
        log.info("ready in %.1f s (warm-up %.1f s)", self.startup_s, self.started.warm_s)

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

    # -- what the views read -------------------------------------------------------------------
    @property
    def model(self):
        """The ``models.LoadedModel`` served, or None before start-up loaded it."""
        return self.started.model if self.started else None

    @property
    def engine(self):
        """The ``engine.Engine``, or None before start-up built it."""
        return self.started.engine if self.started else None

    @property
    def threads(self) -> int:
        """Intra-op threads of the forward pass (0 before start-up)."""
        return self.started.threads if self.started else 0

    @property
    def precision_reason(self) -> str:
        """Why this precision (``auto``'s decision, or the setting)."""
        return self.started.precision_reason if self.started else ""

    @property
    def ready(self) -> bool:
        """True once warmed up and self-tested, while the inference thread is alive."""
        return self._ready and self.batcher is not None and self.batcher.alive

    @property
    def queue_depth(self) -> int:
        """Images waiting in this worker's queue now."""
        return self.batcher.queue_depth if self.batcher else 0

    def describe(self) -> dict:
        """The ``model`` object of every answer: name, weights, fallback/untrained note, precision.

        Fixed once the engine is built, so computed once (every answer and error page shows it).
        """
        if self.started is None:
            return {"name": self.settings.MODEL, "note": self.status}
        if self._described is None:
            self._described = self.started.describe()
        return self._described

    # -- serving ---------------------------------------------------------------------------------
    def admit(self, environ: Mapping | None = None, n: int = 1) -> None:
        """Refuse now what would be refused later, before the views read the body (a refusal costs no upload).

        ``environ``: the request's WSGI environ, for its ``CONTENT_LENGTH`` (bytes: decode cost grows
        with them) and, under gunicorn, ``gunicorn.socket`` (to tell later whether the client hung up);
        ``n``: photos it counts for. Admitted, it counts as work ahead of later requests until its
        ``classify`` decodes it (see ``webapp/admission.py``).

        :raises NotReady: starting, failed or stopping (503, ``Retry-After``).
        :raises Overloaded: its predicted time to answer is over ``MAX_WAIT_MS`` (429, ``Retry-After``
            from that prediction), or the queue has no room for ``n`` more images.
        """
        if not self.ready:
            raise NotReady(f"the model is not ready ({self.status}); try again shortly", headers={"Retry-After": "5"})
        environ = environ or {}
        try:  # no request decodes more than MAX_UPLOAD_BYTES of photos (a larger one gets 413 for its size)
            nbytes = min(int(environ.get("CONTENT_LENGTH") or ""), self.settings.MAX_UPLOAD_BYTES)
        except ValueError:  # absent (chunked) or not a number: admission guesses recent uploads' size
            nbytes = None
        sock = environ.get("gunicorn.socket")
        self.end_request()  # one left by an earlier request of this context, where nothing ended it
        ticket = self.admission.admit(nbytes, n, gone=None if sock is None else (lambda: peer_closed(sock)),
                                      sending=None if sock is None else (lambda: peer_sending(sock)))
        try:
            self.batcher.check_capacity(n)  # the backstop: images, whatever they are predicted to cost
        except Exception:
            self.admission.release(ticket)
            raise
        _TICKET.set(ticket)
        _COUNTED.set(True)
        balance.begin()  # in progress here until end_request: new connections go to an idle worker first

    def end_request(self) -> None:
        """At the end of every request (``create_app`` registers it): an admitted request that ended
        before ``classify`` took its ticket (refused for its size, type or form) stops counting."""
        ticket = _TICKET.get()
        if ticket is not None:
            _TICKET.set(None)
            self.admission.release(ticket)
        if _COUNTED.get():
            _COUNTED.set(False)
            balance.end()

    def _check_serving(self, n: int) -> None:
        if not self.ready:
            raise NotReady(f"the model is not ready ({self.status}); try again shortly", headers={"Retry-After": "5"})
        if n > self.batcher.queue_size:  # a request's images queue together: it would get 429 "try again" for ever
            raise TooLarge.queue(n, self.batcher.queue_size)  # on an idle server (tryout18)
        self.batcher.check_capacity(n)

    def classify(self, uploads: list[Upload], *, topk: int, keep_images: bool = False) -> dict:
        """Decode, preprocess, batch-predict and encode several uploads; all succeed or the request fails.

        Returns ``{"model", "results": [{"filename", "predictions", ...}], "timing_ms": {decode,
        queue, inference, total}}`` (ms); with ``keep_images`` each result also holds ``thumbnail``,
        a JPEG of the photo (bytes, <= 320 px) for the page.

        Called without ``admit`` (the CLI) it is not judged by time, only by the queue bound.

        :raises ServiceError: photos over ``MAX_REQUEST_PIXELS`` together (413, before any is decoded), uploads
            that cannot be decoded (400/413/415: the first one's status and code, every such photo named: ``every_fault``), a full queue
            (429), not ready (503), timeout (504), a failed batch (500), the client hung up before its
            photos were decoded or run (``ClientGone``, 499: logged at info, nothing more done).
        """
        start = time.perf_counter()
        ticket = _TICKET.get()
        _TICKET.set(None)
        s, started = self.settings, self.started
        try:
            self._check_serving(len(uploads))  # a full queue answers 429 before any decoding
            read = check_request_pixels(uploads, limit=s.MAX_REQUEST_PIXELS,
                                        min_side=started.min_side(s.FAST_DECODE))  # headers, walked once: sizes.py
            # What decoding costs grows with the bytes, or with the pixels where those are more (a few KB of flat
            # lossless WebP can hold 79 MP, 1.3 s of decode): the admission measures and counts that size, and a
            # request whose size it now sees is over its body's is judged again (tryout21: 6 such files admitted by
            # their bytes made everyone wait 20 s, and their costs by bytes refused ordinary photos afterwards).
            sizes = [max(len(up.data), r.pixels) for up, r in zip(uploads, read)]
            heavy = bool(sizes) and self.admission.heavy(max(sizes))  # then all its photos go on the heavy lane
            if ticket is not None and (heavy or sum(sizes) > sum(len(up.data) for up in uploads)):
                ticket = self.admission.admit(sum(sizes), len(uploads), gone=ticket.gone, replacing=ticket,
                                              heavy=heavy)
        except Exception:
            if ticket is not None:
                self.admission.release(ticket)
            raise
        gone = ticket.gone if ticket is not None else None
        job = self.admission.decoding(ticket, sizes, heavy)
        lane = self.heavy_lane if heavy else self.offloader
        # On their way to the queue: a batch forming meanwhile waits for them, and only while any are.
        coming = self.batcher.coming(len(uploads))
        # REQUEST_TIMEOUT_S bounds the whole answer, decoding included: a decode that outlasts it (an 80 MP
        # PNG on a busy core) gets its 504 on time, and the queue wait gets only what is left of it.
        deadline = start + s.REQUEST_TIMEOUT_S
        try:
            prepared, unusable = [], []
            for up, size, r in zip(uploads, sizes, read):
                try:
                    p, ms = lane.run(_timed_prepare, up.data, name=up.name, transform=started.transform,
                                     max_pixels=s.MAX_PIXELS, min_side=started.min_side(s.FAST_DECODE),
                                     thumbnail=keep_images, size=r, gone=gone, within=deadline - time.perf_counter())
                except StillRunning as exc:  # its thread, decoding on, counts as work ahead until it ends
                    exc.when_done(self.admission.abandon(job, size))
                    if unusable:  # (what is known wrong with the photos before it, rather than a 504)
                        raise every_fault(unusable, len(uploads)) from None
                    raise InferenceTimeout.decoding(s.REQUEST_TIMEOUT_S, _formats(uploads)) from None
                except PHOTO_FAULTS as exc:  # the others are still read, so that the error names each such photo
                    unusable.append(exc)
                    continue
                self.admission.decoded(job, size, ms)
                prepared.append(p)
            if unusable:
                raise every_fault(unusable, len(uploads))
            check_originals(uploads, prepared, s.MAX_PIXELS)  # impossible original_* (400), or too big (413)
            decode_ms = (time.perf_counter() - start) * 1e3
            if gone is not None and gone():
                raise ClientGone.before("its photos were queued")
            if (left := deadline - time.perf_counter()) <= 0:  # the deadline passed while they decoded
                raise InferenceTimeout.decoding(s.REQUEST_TIMEOUT_S, _formats(uploads))
            try:
                outcomes = self.batcher.infer([p.tensor for p in prepared], gone, coming,
                                              timeout=min(left, self.batcher.request_timeout))
            except InferenceTimeout:  # said with the setting's value, not the part of it left after decoding
                raise InferenceTimeout.after(s.REQUEST_TIMEOUT_S) from None
        except ClientGone as exc:
            self.admission.note_gone()
            log.info("%s", exc.message)
            raise
        finally:
            coming.cancel()  # decode error, client gone, refused: no batch may wait for them (no-op once queued)
            self.admission.finish(job)
        if self.on_outcomes is not None:
            self.on_outcomes(outcomes)
        return answer(self.describe(), started.model.categories, uploads, prepared, outcomes, topk=topk,
                      start=start, decode_ms=decode_ms)

    def health(self) -> dict:
        """``/healthz``: liveness plus this worker's pid, pinned cores, threads, model, precision, queue, and
        ``memory_mb`` (``preload.memory`` in MB = 2**20 bytes: ``private``, ``pss``, ``rss``, ...) and
        ``malloc_arenas`` (``preload.arenas``: glibc's arenas in this worker, capped by ``MALLOC_ARENAS``) and
        ``idle_first`` (``balance.describe``: which workers are idle, under gunicorn with ``IDLE_FIRST``) and
        ``decode_cores`` (where its decode threads may run: ``DECODE_CORES``)."""
        b, engine = self.batcher, self.engine
        return {
            "status": "ok",
            "ready": self.ready,
            "state": self.status,
            "pid": os.getpid(),
            "cores": sorted(os.sched_getaffinity(0)),
            "decode_cores": (self.offloader.cores if self.offloader and self.offloader.cores
                             else sorted(os.sched_getaffinity(0))),
            "intra_op_threads": torch.get_num_threads(),
            "model": self.describe(),
            "precision": engine.precision if engine else None,
            "precision_reason": self.precision_reason,
            "int8_reduce_range": engine.reduce_range if engine else None,
            "self_test": self.self_test,
            "startup_s": None if self.startup_s is None else round(self.startup_s, 2),
            "max_batch_size": self.settings.MAX_BATCH_SIZE,
            "queue_depth": self.queue_depth,
            "coming": b.coming_images if b else 0,
            "batches": b.batches if b else 0,
            "images": b.images if b else 0,
            "rechecked": engine.rechecked if engine else 0,  # of those, answered by fp32 (*_RECHECK_PTS)
            "admission": self.admission.describe() if self.admission else None,
            # This process's memory (MB = 2**20 bytes): private (Private_Dirty, what each worker adds), pss, rss.
            "memory_mb": {k[:-len("_bytes")]: round(v / 2**20, 1) for k, v in preload.memory().items()},
            "malloc_arenas": preload.arenas(),
            "idle_first": balance.describe(),
        }


def _inference_thread_init(engine, nice: int) -> None:
    """First thing on the batcher's inference thread: below the hub by ``nice`` steps (``CLASSIFIER_WORK_NICE``,
    see ``concurrency``), then the engine's own per-thread set-up (intra-op threads)."""
    lower_this_thread(nice)
    engine.thread_init()


def _formats(uploads: list[Upload]) -> list[str | None]:
    """Each upload's format by its first bytes (``formats.claimed_format``), for a 504's words."""
    return [claimed_format(up.data[:64]) for up in uploads]


def _timed_prepare(data: bytes, *, gone: Callable[[], bool] | None = None, **kwargs) -> tuple[Prepared, float]:
    """``imaging.prepare(data, **kwargs)`` on a decode thread, and the CPU time (ms) that thread spent on it,
    for admission: not wall time, which whatever shares the core stretches (see ``InferenceBatcher.image_ms``).

    :raises ClientGone: ``gone()`` says the client hung up while this waited for a decode thread.
    :raises ServiceError: as ``imaging.prepare``.
    """
    if gone is not None and gone():
        raise ClientGone.before("its photos were decoded")
    t0 = time.thread_time()
    prepared = imaging.prepare(data, **kwargs)
    return prepared, (time.thread_time() - t0) * 1e3
