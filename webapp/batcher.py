"""InferenceBatcher: the only module with threads, queues and locks.

Requests put one preprocessed image each into a bounded FIFO and wait on their own future.
One real OS thread takes up to ``max_batch_size`` images, waiting at most ``batch_timeout``
after the first, stacks them, calls ``predict`` once and hands each request its own row.
Only that thread ever calls the model after start-up.

Which primitives are real, and why. gunicorn's gevent worker runs ``monkey.patch_all()``
before the app is imported, so ``threading.Thread``, ``queue.Queue`` and locks become greenlet
versions: a forward pass on such a "thread" would block the worker's hub (every request,
``/healthz`` included). So, under gevent (``_Primitives.for_this_process``):

- the inference thread comes from the *original* ``_thread.start_new_thread`` (a real OS thread;
  ``get_original("threading", "Thread")`` is not enough, its ``start`` uses the patched module);
- the queue is the original ``queue.SimpleQueue`` and the lock the original ``_thread`` lock: the
  real thread blocks on them, the request greenlets only ever put / hold them for microseconds;
- each request waits on a ``gevent.event.AsyncResult``, resolved from the real thread through
  ``hub.loop.run_callback_threadsafe`` (the one thread-safe way into the hub), so the waiting
  greenlet yields to others instead of blocking the worker.

Outside gevent (tests, the CLI, a sync server) the same code runs on ``threading`` primitives and
``concurrent.futures.Future``. Torch releases the GIL inside kernels, so the hub keeps serving
while the model runs.

On a Ray cluster (webapp/cluster.py) nothing is monkey-patched and Ray forms the batches
(``@serve.batch``, or Ray Data's ``map_batches``), so ``InferenceBatcher`` is not used there. A
model replica's requests are coroutines on its asyncio loop; the forward pass runs on the one
real OS thread of ``inference_executor`` (so ``thread_init`` holds, and the loop never blocks on
torch) and decoding on the real threads of ``decode_executor``. The HTTP replica runs the Flask
app on a2wsgi's pool of real OS threads, each blocking on its model replica's answer.
"""

from __future__ import annotations

import logging
import math
import queue as _queue_mod
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import InferenceFailed, InferenceTimeout, NotReady, Overloaded, ServiceError

log = logging.getLogger(__name__)

_STOP = object()


def gevent_active() -> bool:
    """True when gevent has monkey-patched ``threading`` in this process (gunicorn's gevent worker)."""
    try:
        import gevent.monkey
    except ImportError:
        return False
    return gevent.monkey.is_module_patched("threading")


class _ThreadFuture:
    """Per-request future for plain threads: ``concurrent.futures.Future`` is already thread-safe."""

    def __init__(self):
        self._f: Future = Future()

    def resolve(self, value) -> None:
        if not self._f.done():
            self._f.set_result(value)

    def reject(self, exc: BaseException) -> None:
        if not self._f.done():
            self._f.set_exception(exc)

    def wait(self, timeout: float):
        """Block up to ``timeout`` s; raise the request's error, or ``TimeoutError``."""
        try:
            return self._f.result(timeout=max(timeout, 0.0))
        except FutureTimeout:
            raise TimeoutError from None


class _GeventFuture:
    """Per-request future under gevent: an ``AsyncResult`` set from the real thread via the hub's loop."""

    def __init__(self):
        import gevent
        import gevent.event

        self._hub = gevent.get_hub()  # the waiting greenlet's hub: the worker's main thread
        self._result = gevent.event.AsyncResult()

    def resolve(self, value) -> None:
        self._hub.loop.run_callback_threadsafe(self._set, value, None)

    def reject(self, exc: BaseException) -> None:
        self._hub.loop.run_callback_threadsafe(self._set, None, exc)

    def _set(self, value, exc) -> None:  # runs in the hub's thread
        if self._result.ready():
            return
        if exc is None:
            self._result.set(value)
        else:
            self._result.set_exception(exc)

    def wait(self, timeout: float):
        """Yield to other greenlets up to ``timeout`` s; raise the request's error, or ``TimeoutError``."""
        import gevent

        try:
            return self._result.get(timeout=max(timeout, 0.0))
        except gevent.Timeout:
            raise TimeoutError from None


@dataclass
class _Primitives:
    """The thread, queue, lock and future types this process must use (see module docstring)."""

    start_thread: Callable
    make_queue: Callable
    make_lock: Callable
    make_future: Callable

    @classmethod
    def for_this_process(cls) -> "_Primitives":
        if gevent_active():
            from gevent import monkey

            return cls(start_thread=monkey.get_original("_thread", "start_new_thread"),
                       make_queue=monkey.get_original("queue", "SimpleQueue"),
                       make_lock=monkey.get_original("_thread", "allocate_lock"),
                       make_future=_GeventFuture)
        import _thread

        return cls(start_thread=_thread.start_new_thread, make_queue=_queue_mod.SimpleQueue,
                   make_lock=threading.Lock, make_future=_ThreadFuture)


@dataclass
class Result:
    """One image's answer: ``logits`` ``(C,) float32``; times in ms; the size of the batch it ran in."""

    logits: torch.Tensor
    queue_ms: float
    inference_ms: float
    batch_size: int


@dataclass(eq=False)
class _Request:
    tensor: torch.Tensor
    deadline: float  # time.monotonic() seconds
    future: object
    enqueued: float = field(default_factory=time.monotonic)
    abandoned: bool = False  # the waiter gave up (timeout): skip it, never run it


class InferenceBatcher:
    """Dynamic batching in front of ``predict`` on one real OS thread.

    ``predict`` maps ``(N, 3, H, W) float32`` to logits ``(N, C) float32`` for 1 <= N <=
    ``max_batch_size``; ``batch_timeout`` is in seconds (LitServe's names), ``queue_size`` bounds
    the images waiting, ``request_timeout`` (s) is each image's deadline from submission.
    ``on_death`` is called (on the inference thread) if the loop dies unexpectedly, so the host
    process can stop and be replaced; ``thread_init`` runs first thing on the inference thread.
    """

    def __init__(self, predict: Callable[[torch.Tensor], torch.Tensor], *, max_batch_size: int,
                 batch_timeout: float, queue_size: int, request_timeout: float,
                 on_death: Callable[[BaseException], None] | None = None,
                 thread_init: Callable[[], None] | None = None):
        self.predict = predict
        self.thread_init = thread_init
        self.max_batch_size = max_batch_size
        self.batch_timeout = batch_timeout
        self.queue_size = queue_size
        self.request_timeout = request_timeout
        self.on_death = on_death
        self._p = _Primitives.for_this_process()
        self._queue = self._p.make_queue()
        self._lock = self._p.make_lock()
        self._waiting = 0  # images in the queue, guarded by _lock
        self._accepting = False
        self._running = False
        self.died: BaseException | None = None
        # Held while the inference thread runs; stop() waits on it. A real lock, not a gevent
        # future: at gunicorn's worker_exit the hub has nothing left to run, and a greenlet
        # wait there ends in LoopExit ("would block forever") while a batch is still running.
        self._ended = self._p.make_lock()
        # Measured, for Retry-After: exponential moving averages in seconds.
        self.ewma_queue_wait = 0.0
        self.ewma_batch_time = 0.0
        self.batches = 0
        self.images = 0

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
    def retry_after(self) -> int:
        """Seconds a refused client should wait: the measured time to drain the queue, at least 1."""
        per_batch = self.ewma_batch_time or 0.05
        drain = math.ceil(self._waiting / self.max_batch_size) * per_batch
        return max(1, math.ceil(max(drain, self.ewma_queue_wait)))

    def check_capacity(self, n: int) -> None:
        """Refuse early, before any decoding, when ``n`` more images would not fit (``submit`` checks again).

        :raises Overloaded: 429 with ``Retry-After``. :raises NotReady: 503 when not serving.
        """
        if not self.alive:
            raise NotReady("the model is not serving (starting, stopping or failed); try again shortly",
                           headers={"Retry-After": "1"})
        if self._waiting + n > self.queue_size:
            wait = self.retry_after()
            raise Overloaded(f"server busy: {self._waiting} images queued (limit {self.queue_size}); "
                             f"try again in {wait} s", headers={"Retry-After": str(wait)})

    def submit(self, tensors: list[torch.Tensor]) -> list[_Request]:
        """Queue images ``(3, H, W) float32`` all together or not at all.

        :raises Overloaded: the queue has no room for all of them (429, with ``Retry-After``).
        :raises NotReady: the batcher is stopping, stopped or dead (503).
        """
        deadline = time.monotonic() + self.request_timeout
        reqs = [_Request(t, deadline, self._p.make_future()) for t in tensors]
        with self._lock:
            self.check_capacity(len(reqs))
            self._waiting += len(reqs)
            for r in reqs:
                self._queue.put(r)
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
            raise InferenceTimeout(f"no result within {self.request_timeout:g} s (CLASSIFIER_REQUEST_TIMEOUT_S); "
                                   f"the server is overloaded, try again later") from None

    def classify(self, tensors: list[torch.Tensor]) -> list[Result]:
        """Submit images and wait for all of their results (same order as ``tensors``)."""
        reqs = self.submit(tensors)
        try:
            return [self.wait(r) for r in reqs]
        finally:
            for r in reqs:  # one failed: the others' results are no longer wanted
                r.abandoned = True

    # -- the inference thread --------------------------------------------------------------
    def _take(self, block: bool, timeout: float | None = None):
        item = self._queue.get(block, timeout) if block else self._queue.get_nowait()
        if item is not _STOP:
            with self._lock:
                self._waiting -= 1
        return item

    def _collect(self) -> tuple[list[_Request], bool]:
        """Block for the first image, then gather more until full or ``batch_timeout`` after the first."""
        first = self._take(True)
        if first is _STOP:
            return [], True
        batch = [first]
        close_at = time.monotonic() + self.batch_timeout
        while len(batch) < self.max_batch_size:
            remaining = close_at - time.monotonic()
            try:
                item = self._take(remaining > 0, remaining) if remaining > 0 else self._take(False)
            except _queue_mod.Empty:
                break
            if item is _STOP:
                return batch, True
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
            live.append(r)
        if not live:
            return
        for r in live:
            self.ewma_queue_wait = 0.9 * self.ewma_queue_wait + 0.1 * (now - r.enqueued)
        start = time.perf_counter()
        try:
            logits = checked_predict(self.predict, torch.stack([r.tensor for r in live]))
        except InferenceFailed as exc:
            for r in live:
                r.future.reject(exc)
            return
        took = time.perf_counter() - start
        self.ewma_batch_time = took if not self.batches else 0.8 * self.ewma_batch_time + 0.2 * took
        self.batches += 1
        self.images += len(live)
        for i, r in enumerate(live):
            r.future.resolve(Result(logits=logits[i].clone(), queue_ms=(now - r.enqueued) * 1e3,
                                    inference_ms=took * 1e3, batch_size=len(live)))

    def _fail_queued(self, exc: ServiceError) -> None:
        while True:
            try:
                item = self._take(False)
            except _queue_mod.Empty:
                return
            if item is not _STOP:
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


def keep_alive(notify: Callable[[], None], *, every: float = 1.0, limit: float) -> Callable[[], None]:
    """Call ``notify`` every ``every`` s from a real OS thread for at most ``limit`` s; return a stop function.

    Used while a gunicorn worker builds and compiles its model: the compile blocks the worker's
    main thread (and so its heartbeat greenlet), and the arbiter would kill a worker that is
    merely busy compiling. Past ``limit`` the beats stop, so a start-up that hangs is still killed.
    """
    p = _Primitives.for_this_process()
    done = p.make_lock()
    done.acquire()

    def beat() -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            notify()
            if done.acquire(True, every):
                return

    def stop() -> None:
        try:
            done.release()
        except RuntimeError:  # already stopped
            pass

    p.start_thread(beat, ())
    return stop


def client_pool(workers: int):
    """A ``concurrent.futures`` pool of ``workers`` real OS threads that submit work and wait on it.

    For callers outside a server (the CLI's ``classify``): each thread submits one file's image
    and blocks on its future, so the inference thread sees several at once and forms batches.
    Never used under gevent (a server's requests are already concurrent greenlets).
    """
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="classify")


def inference_executor(thread_init: Callable[[], None] | None = None):
    """A pool of exactly one real OS thread for every forward pass of a Ray replica.

    One thread, as the batcher's: batches run one at a time, and ``thread_init`` (intra-op
    threads) runs once on it first. Used with ``loop.run_in_executor`` from an asyncio replica.
    """
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference", initializer=thread_init)


def decode_executor(max_threads: int):
    """A pool of ``max_threads`` real OS threads that decode uploads in a Ray replica (Pillow releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="decode")


def call_with_timeout(fn: Callable[[], object], timeout: float) -> tuple[bool, object]:
    """Run ``fn`` on a real OS thread; return ``(True, result)``, or ``(False, None)`` after ``timeout`` s.

    For blocking calls with no timeout of their own (``socket.getaddrinfo`` when the DNS server
    is unreachable). The thread is left to finish on its own; it holds nothing.
    """
    p = _Primitives.for_this_process()
    done = p.make_lock()
    done.acquire()
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # handed back to the caller
            box.append(exc)
        finally:
            done.release()

    p.start_thread(run, ())
    if not done.acquire(True, timeout):
        return False, None
    if isinstance(box[0], BaseException):
        raise box[0]
    return True, box[0]


class Offloader:
    """Runs CPU-heavy request work (decoding a photo) on real OS threads, at most ``max_threads`` at once.

    Under gevent, decoding in the request greenlet would hold the worker's hub: no other request,
    not even ``/healthz`` or gunicorn's heartbeat, is served until it ends (80 MP uploads held a
    worker for a minute). Pillow and torch release the GIL while they work, so on a gevent
    ``ThreadPool`` (real threads) the greenlet waits cooperatively and the hub keeps serving;
    ``max_threads`` bounds how many decodes compete with the model for the worker's cores.
    Outside gevent ``run`` just calls the function: there the caller is already a thread.
    """

    def __init__(self, max_threads: int):
        self.max_threads = max_threads
        self._pool = None
        if gevent_active():
            from gevent.threadpool import ThreadPool

            self._pool = ThreadPool(maxsize=max_threads)

    def run(self, fn: Callable, *args):
        """``fn(*args)``, its exception re-raised in the caller."""
        if self._pool is None:
            return fn(*args)
        ok, value = self._pool.apply(_capture, (fn, args))
        if not ok:
            raise value  # re-raised here: gevent's pool would print it as an unhandled traceback
        return value


def _capture(fn: Callable, args: tuple) -> tuple[bool, object]:
    try:
        return True, fn(*args)
    except Exception as exc:
        return False, exc
