"""InferenceBatcher: dynamic batching in front of the model, on one real OS thread.

Requests put one preprocessed image each into a bounded FIFO and wait on their own future. One real OS thread takes up
to ``max_batch_size`` images, stacks them, calls ``predict`` once and hands each request its own row (LitServe's names
and shape). Only that thread ever calls the model after start-up. It waits for company (at most ``batch_timeout`` after
the first image) only while more images are on their way: a request counts its images with ``coming`` while it decodes
them, so a lone request runs at once instead of waiting the whole timeout for nobody (``wait="fixed"`` restores the
fixed wait, for benchmarks). A batch that fails runs again one image at a time, so that only the image that fails is
refused.

The thread, queue, lock and future types come from ``webapp.concurrency``, which says which are real OS threads under
gunicorn's gevent worker and why. On a Ray cluster Ray forms the batches (``@serve.batch``, Ray Data's ``map_batches``);
every path checks its batches with ``checked_predict``.
"""

from __future__ import annotations

import logging
import math
import queue as _queue_mod
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .concurrency import Primitives
from .errors import ClientGone, InferenceFailed, InferenceTimeout, NotReady, Overloaded, ServiceError

log = logging.getLogger(__name__)

_STOP = object()
_WAKE = object()  # put when the images on their way drop to none without arriving: the loop stops waiting
WAITS = ("company", "fixed")


@dataclass
class Result:
    """One image's answer: ``logits`` ``(C,) float32``; times in ms; the size of the batch it ran in."""

    logits: torch.Tensor
    queue_ms: float
    inference_ms: float
    batch_size: int


def results(logits: torch.Tensor, enqueued: list[float], *, now: float, took: float) -> list[Result]:
    """One ``Result`` per image of a batch: row i of ``logits`` ``(N, C) float32`` (a copy, so no request holds the
    whole batch), its wait from ``enqueued[i]`` to ``now`` (``time.monotonic()`` s) and the forward pass's ``took``
    (s), both reported in ms. Every batching path uses it."""
    return [Result(logits=logits[i].clone(), queue_ms=(now - enq) * 1e3, inference_ms=took * 1e3,
                   batch_size=len(enqueued)) for i, enq in enumerate(enqueued)]


@dataclass(eq=False)
class _Request:
    tensor: torch.Tensor
    deadline: float  # time.monotonic() seconds
    future: object
    enqueued: float = field(default_factory=time.monotonic)
    abandoned: bool = False  # the waiter gave up (timeout): skip it, never run it
    gone: Callable[[], bool] | None = None  # True once its client hung up: skip it, never run it
    timeout: float = 0.0  # s from submission to deadline: the request timeout, or start-up's own bound


@dataclass(eq=False)
class Coming:
    """``n`` images a request is decoding for the batcher (see ``InferenceBatcher.coming``)."""

    n: int
    batcher: "InferenceBatcher"

    def cancel(self) -> None:
        """They will not come (a decode error, the client hung up, a refusal): stop counting them. Idempotent, and a
        no-op once ``submit`` queued them; call it in a ``finally``."""
        self.batcher._arrive(self, queued=False)


class InferenceBatcher:
    """Dynamic batching in front of ``predict`` on one real OS thread.

    ``predict`` maps ``(N, 3, H, W) float32`` to logits ``(N, C) float32`` for 1 <= N <= ``max_batch_size``;
    ``batch_timeout`` is in seconds (LitServe's names), ``queue_size`` bounds the images waiting, ``request_timeout``
    (s) is each image's deadline from submission. ``on_death`` is called (on the inference thread) if the loop dies
    unexpectedly, so the host process can stop and be replaced; ``thread_init`` runs first thing on the inference
    thread; ``on_idle`` runs there once per idle spell, ``idle_s`` s after the last image with none since. ``wait``:
    ``"company"`` waits up to ``batch_timeout`` after the first image only while images counted by ``coming`` are on
    their way and the batch is not full; ``"fixed"`` always waits it out (the behaviour before, for benchmarks).

    :raises ValueError: ``wait`` is not one of ``WAITS``.
    """

    def __init__(self, predict: Callable[[torch.Tensor], torch.Tensor], *, max_batch_size: int,
                 batch_timeout: float, queue_size: int, request_timeout: float,
                 on_death: Callable[[BaseException], None] | None = None,
                 thread_init: Callable[[], None] | None = None, wait: str = "company",
                 on_idle: Callable[[], None] | None = None, idle_s: float = 1.0):
        if wait not in WAITS:
            raise ValueError(f"wait must be one of {WAITS}, not {wait!r}")
        self.wait_for = wait
        self.predict, self.thread_init = predict, thread_init
        self.max_batch_size, self.batch_timeout = max_batch_size, batch_timeout
        self.queue_size, self.request_timeout = queue_size, request_timeout
        self.on_death, self.on_idle, self.idle_s = on_death, on_idle, idle_s
        self._p = Primitives.for_this_process()
        self._queue = self._p.make_queue()
        self._lock = self._p.make_lock()
        self._waiting = 0  # images in the queue, guarded by _lock
        self._coming = 0  # images being decoded for the queue (``coming``), guarded by _lock
        self._in_batch = 0  # images in the forward pass running now (written by the inference thread only)
        self._accepting, self._running, self.died = False, False, None  # died: the error that ended the loop
        # Held while the inference thread runs; stop() waits on it. A real lock, not a gevent future: at gunicorn's
        # worker_exit the hub has nothing left to run, and a greenlet wait there ends in LoopExit while a batch runs.
        self._ended = self._p.make_lock()
        # Measured, for Retry-After and admission (ewma_batch_cpu: the inference thread's CPU time): EWMAs.
        self.ewma_queue_wait = self.ewma_batch_time = self.ewma_batch_cpu = self.ewma_batch_images = 0.0
        self.batches = self.images = 0
        self.cpu_s = 0.0  # the inference thread's CPU time in forward passes, in all (s)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the inference thread (a real OS thread, also under gevent)."""
        if self._running:
            return
        self._running = True
        self._accepting = True
        self._ended.acquire()
        self._p.start_thread(self._run, ())

    @property
    def alive(self) -> bool:
        """True while the inference thread runs and takes requests."""
        return self._running and self._accepting and self.died is None

    @property
    def queue_depth(self) -> int:
        """Images waiting for a batch right now."""
        return self._waiting

    @property
    def coming_images(self) -> int:
        """Images counted by ``coming`` that are not queued yet (being decoded now)."""
        return self._coming

    @property
    def running_images(self) -> int:
        """Images in the forward pass running right now (0 between batches)."""
        return self._in_batch

    @property
    def image_ms(self) -> float:
        """Measured forward-pass cost per image (ms): EWMA of the inference thread's CPU time per batch / EWMA
        batch size; 0 before any batch. CPU, not wall time: see ``webapp/admission.py`` for why."""
        return 1e3 * self.ewma_batch_cpu / self.ewma_batch_images if self.ewma_batch_images else 0.0

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new work, serve everything already queued, then end the thread (waits up to ``timeout`` s)."""
        with self._lock:
            if not self._accepting:
                return
            self._accepting = False
        if not self._running:
            return
        self._queue.put(_STOP)  # FIFO: everything queued before it is still served
        if self._ended.acquire(timeout=timeout):
            self._ended.release()
        else:
            log.warning("inference thread did not stop within %.1f s", timeout)

    # -- requests --------------------------------------------------------------------------
    def check_capacity(self, n: int) -> None:
        """Refuse early, before any decoding, when ``n`` more images would not fit (``submit`` checks again).

        :raises Overloaded: 429 with ``Retry-After``. :raises NotReady: 503 when not serving.
        """
        if not self.alive:
            raise NotReady("the model is not serving (starting, stopping or failed); try again shortly",
                           headers={"Retry-After": "1"})
        if self._waiting + n > self.queue_size:
            drain = math.ceil(self._waiting / self.max_batch_size) * (self.ewma_batch_time or 0.05)
            wait = max(1, math.ceil(max(drain, self.ewma_queue_wait)))  # s: the measured time to drain the queue
            raise Overloaded(f"server busy: {self._waiting} images queued (limit {self.queue_size}); "
                             f"try again in {wait} s", headers={"Retry-After": str(wait)})

    def coming(self, n: int) -> Coming:
        """Count ``n`` images as on their way (decoding) until ``submit(..., coming=)`` queues them or
        ``Coming.cancel`` drops them: while any are counted, the loop waits up to ``batch_timeout`` for
        them to join the batch it is forming; with none, it runs what it has at once."""
        handle = Coming(n, self)
        with self._lock:
            self._coming += n
        return handle

    def _arrive(self, handle: Coming, *, queued: bool) -> None:
        """Stop counting ``handle``'s images (queued: by ``submit``, under ``_lock``; else cancelled)."""
        if queued:
            self._coming, handle.n = self._coming - handle.n, 0
            return
        with self._lock:
            n, handle.n = handle.n, 0
            self._coming -= n
            none_left = n and self._coming == 0
        if none_left:  # the loop may be waiting for exactly these: end its wait now
            self._queue.put(_WAKE)

    def submit(self, tensors: list[torch.Tensor], gone: Callable[[], bool] | None = None,
               coming: Coming | None = None, timeout: float | None = None) -> list[_Request]:
        """Queue images ``(3, H, W) float32`` all together or not at all, each due within ``timeout`` s
        (None: ``request_timeout``; start-up's self-test gives its own, not a client's deadline).

        ``gone`` (asked on the inference thread just before a batch runs) says whether the client hung
        up; such an image is not run and its waiter gets ``ClientGone``. ``coming``: the handle that
        counted these images while they were decoded; they stop counting as they are queued (a refusal
        leaves it to the caller's ``Coming.cancel``).

        :raises Overloaded: the queue has no room for all of them (429, with ``Retry-After``).
        :raises NotReady: the batcher is stopping, stopped or dead (503).
        """
        timeout = self.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        reqs = [_Request(t, deadline, self._p.make_future(), gone=gone, timeout=timeout) for t in tensors]
        with self._lock:
            self.check_capacity(len(reqs))
            self._waiting += len(reqs)
            for r in reqs:
                self._queue.put(r)
            if coming is not None:  # in the same step: the loop never sees them neither coming nor queued
                self._arrive(coming, queued=True)
        return reqs

    def wait(self, req: _Request) -> Result:
        """Wait for one submitted image's result until its deadline.

        :raises InferenceTimeout: the deadline passed (504); the image is dropped if not yet run.
        :raises ServiceError: the error its batch ended with (e.g. ``InferenceFailed``).
        """
        try:
            return req.future.wait(req.deadline - time.monotonic())
        except TimeoutError:
            req.abandoned = True
            raise InferenceTimeout.after(req.timeout) from None

    def infer(self, tensors: list[torch.Tensor], gone: Callable[[], bool] | None = None,
              coming: Coming | None = None, timeout: float | None = None) -> list[Result]:
        """Run images ``(3, H, W) float32`` through the model; return their ``Result``s in the same order.

        Submits all of them at once (they may share a batch) and waits for every one; ``gone``,
        ``coming`` and ``timeout`` as ``submit``.

        :raises Overloaded: no room in the queue (429). :raises NotReady: not serving (503).
        :raises InferenceTimeout: past ``timeout`` (504). :raises InferenceFailed: the batch failed (500).
        :raises ClientGone: the client hung up before its batch ran (499; nothing was run for it).
        """
        reqs = self.submit(tensors, gone, coming, timeout)
        try:
            return [self.wait(r) for r in reqs]
        finally:
            for r in reqs:  # one failed: the others' results are no longer wanted
                r.abandoned = True

    # -- the inference thread --------------------------------------------------------------
    def _take(self, block: bool, timeout: float | None = None):
        item = self._queue.get(block, timeout) if block else self._queue.get_nowait()
        if item is not _STOP and item is not _WAKE:
            with self._lock:
                self._waiting -= 1
        return item

    def _collect(self) -> tuple[list[_Request], bool]:
        """Block for the first image, then gather more: what is queued, and, while images are on their way
        (``wait="fixed"``: always), what arrives until full or ``batch_timeout`` after the first."""
        try:
            first = self._take(True, self.idle_s if self.on_idle else None)
        except _queue_mod.Empty:  # idle for idle_s: on_idle once, then wait as long as it takes
            self.on_idle()
            first = self._take(True)
        while first is _WAKE:  # a wake-up left from a wait that had already ended
            first = self._take(True)
        if first is _STOP:
            return [], True
        batch = [first]
        close_at = time.monotonic() + self.batch_timeout
        while len(batch) < self.max_batch_size:
            try:
                item = self._take(False)
            except _queue_mod.Empty:
                remaining = close_at - time.monotonic()
                if remaining <= 0 or (self.wait_for == "company" and self._coming <= 0):
                    break  # nothing queued and nothing on its way (or no time left): run what we have
                try:
                    item = self._take(True, remaining)
                except _queue_mod.Empty:
                    break
            if item is _STOP:
                return batch, True
            if item is not _WAKE:
                batch.append(item)
        return batch, False

    def _run_batch(self, batch: list[_Request]) -> None:
        now = time.monotonic()
        live = []
        for r in batch:
            if r.abandoned:
                continue
            if now > r.deadline:  # past its deadline: drop it before inference
                r.future.reject(InferenceTimeout("deadline passed while queued; the server is overloaded"))
                continue
            if r.gone is not None and r.gone():  # no one to answer: its row would be computed for nobody
                r.abandoned = True
                r.future.reject(ClientGone.before("its batch ran"))
                continue
            live.append(r)
        if not live:
            return
        for r in live:
            self.ewma_queue_wait = 0.9 * self.ewma_queue_wait + 0.1 * (now - r.enqueued)
        start, cpu = time.perf_counter(), time.thread_time()
        self._in_batch = len(live)
        try:
            logits = checked_predict(self.predict, torch.stack([r.tensor for r in live]))
        except Exception as exc:  # the stack's own errors too: raised out of here, one would end this thread
            if len(live) > 1:  # perhaps one image's rows: each runs alone, so that the others still get answers
                for r in live:
                    self._run_batch([r])
                return
            if not isinstance(exc, InferenceFailed):
                log.exception("inference failed for a batch of 1 image")
                exc = InferenceFailed("the model failed on this batch; the error is logged on the server")
            live[0].future.reject(exc)
            return
        finally:
            self._in_batch = 0
        took, cpu = time.perf_counter() - start, time.thread_time() - cpu
        self.ewma_batch_time = took if not self.batches else 0.8 * self.ewma_batch_time + 0.2 * took
        self.ewma_batch_cpu = cpu if not self.batches else 0.8 * self.ewma_batch_cpu + 0.2 * cpu
        self.ewma_batch_images = len(live) if not self.batches else 0.8 * self.ewma_batch_images + 0.2 * len(live)
        self.batches, self.images, self.cpu_s = self.batches + 1, self.images + len(live), self.cpu_s + cpu
        for r, result in zip(live, results(logits, [r.enqueued for r in live], now=now, took=took)):
            r.future.resolve(result)

    def _fail_queued(self, exc: ServiceError) -> None:
        while True:
            try:
                item = self._take(False)
            except _queue_mod.Empty:
                return
            if item is not _STOP and item is not _WAKE:
                item.future.reject(exc)

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread
        if self.thread_init:
            self.thread_init()  # e.g. intra-op threads, which are per calling thread too
        batch: list[_Request] = []
        try:
            while True:
                batch, stop = self._collect()
                if batch:
                    self._run_batch(batch)
                batch = []
                if stop:
                    break
        except BaseException as exc:  # a bug in the loop itself: never leave a request waiting
            self.died = exc
            log.critical("inference thread died: %r", exc, exc_info=exc)
            with self._lock:
                self._accepting = False
            dead = NotReady("the inference thread failed; this worker is restarting")
            for r in batch:  # the batch it died on: already off the queue (no-op for those resolved)
                r.future.reject(dead)
            self._fail_queued(dead)
            if self.on_death:
                self.on_death(exc)
        finally:
            with self._lock:
                self._accepting = False
            self._fail_queued(NotReady("the server is shutting down; try again shortly"))
            self._running = False
            self._ended.release()


def checked_predict(predict: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    """``predict(batch)``: ``(N, 3, S, S) float32`` -> ``(N, C)`` logits, checked to hold one row per image.

    Every batch runs through it: this batcher's, a Ray Serve replica's, a Ray Data actor's.

    :raises InferenceFailed: the model raised, or returned another number of rows (logged with
        its traceback; the message sent to clients says only that it failed).
    """
    try:
        logits = predict(batch)
        if logits.shape[0] != batch.shape[0]:
            raise RuntimeError(f"model returned {logits.shape[0]} rows for a batch of {batch.shape[0]} images")
    except Exception:
        log.exception("inference failed for a batch of %d images", batch.shape[0])
        raise InferenceFailed("the model failed on this batch; the error is logged on the server") from None
    return logits


