"""Every thread, queue, lock, future and pool the service uses: the one module that picks them.

Why this module exists. gunicorn's gevent worker runs ``monkey.patch_all()`` before the app is imported, so
``threading.Thread``, ``queue.Queue``, locks and ``time.sleep`` become cooperative greenlet versions: a forward pass
or a photo decode on such a "thread" blocks the worker's hub (every request, ``/healthz`` and gunicorn's heartbeat
included). ``shared/notes/gevent-threads.md`` has the measurements. So every primitive is chosen here, by asking
``gevent_active()``:

Real OS threads (they run torch and Pillow, which release the GIL, so the hub keeps serving; an AOTInductor package
runs through ``aoti._CApi`` for that reason, as torch's own runner keeps the GIL):

- ``Primitives.start_thread``: under gevent the *original* ``_thread.start_new_thread`` (``get_original("threading",
  "Thread")`` is not enough: its ``start`` calls the patched module). The batcher's inference thread,
  ``keep_alive``'s heartbeat and ``call_with_timeout`` use it.
- ``Offloader``: a gevent ``ThreadPool`` (real threads) for decoding uploads (one past its request's deadline runs
  on: ``StillRunning``), its free threads counted by a gevent ``BoundedSemaphore`` that request greenlets wait on
  until their deadline; outside gevent it calls the function in the caller's own thread. With
  ``DECODE_CORES=server`` its threads may run on any of the server's cores (``widen_this_thread``), the inference
  thread only on its worker's.
- ``client_pool``, ``inference_executor``, ``decode_executor``: ``concurrent.futures`` pools for callers that are
  never under gevent (the CLI's ``classify``, a Ray replica's asyncio loop).

Priorities. The heavy threads (decode, inference) run ``WORK_NICE`` steps below the worker's main thread
(``lower_this_thread``: Linux niceness is per thread), so that when the hub has something to do (a new connection, a
refusal, ``/healthz``, reading an upload) the kernel runs it first instead of sharing the worker's core three ways.
Measured at 2x overload on 2 cores (``bench/overload_bench.py``, small photos): refusals answered in 8 ms p99 server-
side instead of 70, and the images/s of the busy worker no longer drop under a stream of refusals (1.01x the server
without admission, was 0.94x). It costs nothing when the hub is idle: the heavy threads then have the core to
themselves. Lowering a priority needs no privilege; raising one would, so the hub's stays as it is.

Not threads, but safe between the two worlds:

- ``Primitives.make_queue`` / ``make_lock``: the original ``queue.SimpleQueue`` and ``_thread`` lock. The real
  thread blocks on them; request greenlets only put / hold them for microseconds.
- ``Primitives.make_future``: under gevent a ``gevent.event.AsyncResult`` resolved from the real thread through
  ``hub.loop.run_callback_threadsafe`` (the one thread-safe way into the hub), so the waiting greenlet yields to
  others; elsewhere a ``concurrent.futures.Future``.
- ``peer_closed``, ``peer_sending``: has the client hung up, is its upload arriving? A zero-timeout poll on the
  original ``select.poll``, safe from the hub and from real threads.
- ``fork_safe``: a lock no ``os.fork`` copies while held, for the gunicorn master's threads.
- ``blocking_sleep``: the original ``time.sleep``, for code that may run in the hub (a signal handler);
  ``let_others_run``: a greenlet's turn given up, for long Python work on bytes already there (de-chunking).

Outside gevent (tests, the CLI, Ray) everything is plain ``threading`` / ``concurrent.futures``.
"""

from __future__ import annotations

import _thread
import os
import queue as _queue_mod
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable


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
        import gevent.event
        self._hub = gevent.get_hub()  # the waiting greenlet's hub: the worker's main thread
        self._result = gevent.event.AsyncResult()

    def resolve(self, value) -> None:
        self._hub.loop.run_callback_threadsafe(self._set, value, None)

    def reject(self, exc: BaseException) -> None:
        self._hub.loop.run_callback_threadsafe(self._set, None, exc)

    def _set(self, value, exc) -> None:  # runs in the hub's thread
        if not self._result.ready():
            self._result.set(value) if exc is None else self._result.set_exception(exc)

    def wait(self, timeout: float):
        """Yield to other greenlets up to ``timeout`` s; raise the request's error, or ``TimeoutError``."""
        import gevent

        try:
            return self._result.get(timeout=max(timeout, 0.0))
        except gevent.Timeout:
            raise TimeoutError from None


def fork_safe(lock):
    """``lock`` (``make_lock``'s), held by no fork: ``os.fork`` waits for its holder, and both sides go on with it free.
    For the master's calls into a library whose own lock is not fork-safe (prometheus_client's multiprocess values): a
    worker forked while the 503 responder held that one waited on it for ever (one of two never started). -> ``lock``"""
    os.register_at_fork(before=lock.acquire, after_in_parent=lock.release, after_in_child=lock.release)
    return lock


def lower_this_thread(steps: int) -> None:
    """Run the calling OS thread ``steps`` niceness steps lower (at most 19), for good: on Linux niceness is per thread
    (``setpriority`` on the thread's id). 0 changes nothing; so does a platform or sandbox that refuses (the thread
    then simply keeps its priority). See the module docstring."""
    try:
        if steps <= 0:
            return
        tid = _thread.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
    except (OSError, AttributeError):
        pass


@dataclass
class Primitives:
    """The thread, queue, lock and future types this process must use (see module docstring)."""

    start_thread: Callable
    make_queue: Callable
    make_lock: Callable
    make_future: Callable

    @classmethod
    def for_this_process(cls) -> "Primitives":
        if gevent_active():
            from gevent import monkey

            return cls(start_thread=monkey.get_original("_thread", "start_new_thread"),
                       make_queue=monkey.get_original("queue", "SimpleQueue"),
                       make_lock=monkey.get_original("_thread", "allocate_lock"),
                       make_future=_GeventFuture)
        return cls(start_thread=_thread.start_new_thread, make_queue=_queue_mod.SimpleQueue,
                   make_lock=threading.Lock, make_future=_ThreadFuture)


@contextmanager
def time_limit(seconds: float):
    """Raise ``TimeoutError`` in this greenlet if the block runs longer than ``seconds`` (s): under gevent a
    ``gevent.Timeout``, which interrupts a greenlet blocked on a socket read (an upload that stalls). Elsewhere no
    limit: nothing blocks there (the test client and Ray's a2wsgi hand the app bodies already in memory)."""
    if not gevent_active():
        yield
        return
    import gevent

    with gevent.Timeout(seconds, TimeoutError):
        yield


def peer_closed(sock) -> bool:
    """True when the client at the other end of ``sock`` (a connected socket: gunicorn's ``gunicorn.socket``) has
    closed or reset the connection, or ``sock`` is closed here. A client that only half-closes (shuts down its
    sending side and still reads) counts as gone: HTTP clients keep both sides open while they wait for an answer.
    See ``_poll_now``."""
    events = _poll_now(sock)
    return events is None or bool(events & _GONE)


def peer_sending(sock) -> bool:
    """True when bytes the client at the other end of ``sock`` sent are waiting to be read, and it has not hung up: its
    upload is arriving (False for one that stalled). See ``_poll_now``."""
    events = _poll_now(sock)
    return events is not None and bool(events & _IN) and not events & _GONE


def _poll_now(sock) -> int | None:
    """``sock``'s poll events now (None where it is closed here): a zero-timeout ``poll`` on the *original*
    ``select.poll`` (gevent's ``patch_select`` removes ``poll``, and its cooperative ``select`` would switch
    greenlets). One syscall that never blocks, so the hub and real threads (a decode thread, the inference thread)
    may call it. It reads nothing: what the client sent is left for the server."""
    from gevent import monkey

    make_poll = monkey.get_original("select", "poll")  # select.poll itself where gevent has not patched it
    try:
        fd = sock.fileno()
        if fd < 0:
            return None
        poller = make_poll()
        poller.register(fd, _IN | _GONE)
        return sum(events for _, events in poller.poll(0))
    except (OSError, ValueError):  # closed meanwhile
        return None


_IN = 0x1  # POLLIN (Linux values: the select module under gevent may lack its constants)
_GONE = 0x2000 | 0x10 | 0x8 | 0x20  # POLLRDHUP | POLLHUP | POLLERR | POLLNVAL


def let_others_run() -> None:
    """Under gevent ``gevent.sleep(0)``: the hub runs the other greenlets now (Python work on bytes already received
    never waits, so it never yields by itself); elsewhere nothing."""
    if gevent_active():
        __import__("gevent").sleep(0)


def blocking_sleep(seconds: float) -> None:
    """Sleep ``seconds`` s holding this OS thread, even under gevent (the original ``time.sleep``): for code that may
    run in the hub itself, a signal handler's, where gevent's cooperative sleep raises ``BlockingSwitchOutError``."""
    from gevent import monkey

    monkey.get_original("time", "sleep")(seconds)  # time.sleep itself where gevent has not patched it


def keep_alive(notify: Callable[[], None], *, every: float = 1.0, limit: float) -> Callable[[], None]:
    """Call ``notify`` every ``every`` s from a real OS thread for at most ``limit`` s; return a stop function.

    Used while a gunicorn worker builds its model: the compile blocks the worker's main thread (and its heartbeat
    greenlet), and the arbiter would kill a worker merely busy compiling. Past ``limit`` the beats stop, so a start-up
    that hangs is still killed. The stop function returns once the thread has made its last call (a worker whose
    start-up failed closes its heartbeat file right after: a later beat raised ``ValueError``); a ``notify`` that
    raises (``ValueError``, ``OSError``: the worker is exiting) ends the beats quietly."""
    p = Primitives.for_this_process()
    done, finished = p.make_lock(), p.make_lock()
    done.acquire()
    finished.acquire()

    def beat() -> None:
        try:
            end = time.monotonic() + limit
            while time.monotonic() < end:
                try:
                    notify()
                except (ValueError, OSError):  # the heartbeat file is closed: the worker is on its way out
                    return
                if done.acquire(True, every):
                    return
        finally:
            finished.release()

    stopped: list[bool] = []

    def stop() -> None:
        if not stopped:
            stopped.append(True)
            done.release()
            finished.acquire(True, every + 5.0)  # the last beat is done (it takes microseconds; never hang on it)

    p.start_thread(beat, ())
    return stop


def client_pool(workers: int):
    """A ``concurrent.futures`` pool of ``workers`` real OS threads for the CLI's ``classify`` (never under gevent):
    each submits one file's image and waits on it, so the inference thread sees several at once and forms batches."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="classify")


def inference_executor(thread_init: Callable[[], None] | None = None):
    """One real OS thread for every forward pass of a Ray replica (``loop.run_in_executor``): batches run one at a
    time, as the batcher's, and ``thread_init`` (intra-op threads) runs once on it first."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference", initializer=thread_init)


def decode_executor(max_threads: int):
    """A pool of ``max_threads`` real OS threads that decode uploads in a Ray replica (Pillow releases the GIL)."""
    return ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="decode")


def call_with_timeout(fn: Callable[[], object], timeout: float, *,
                      give_up: Callable[[], bool] | None = None) -> tuple[bool, object]:
    """Run ``fn`` on a real OS thread; return ``(True, result)``, or ``(False, None)`` after ``timeout`` s.

    For blocking calls with no timeout of their own (``socket.getaddrinfo`` when the DNS server is unreachable; Ray
    Serve's ``serve.delete`` when Ray's own processes were stopped under it). ``give_up``, if given, is asked every
    0.2 s: True stops the wait early, as a timeout does. The thread is left to finish on its own (it is not joined
    at exit); it holds nothing. ``fn``'s exception is raised here."""
    p = Primitives.for_this_process()
    done, box = p.make_lock(), []
    done.acquire()

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # handed back to the caller
            box.append(exc)
        done.release()

    p.start_thread(run, ())
    end = time.monotonic() + timeout
    while True:
        left = max(0.0, end - time.monotonic())
        if done.acquire(True, min(left, 0.2) if give_up else left):
            break
        if time.monotonic() >= end or (give_up is not None and give_up()):
            return False, None
    if isinstance(box[0], BaseException):
        raise box[0]
    return True, box[0]


class Offloader:
    """Runs CPU-heavy request work (decoding a photo) on real OS threads, at most ``max_threads`` at once.

    Under gevent, decoding in the request greenlet would hold the worker's hub (80 MP uploads held a worker, its
    ``/healthz`` and heartbeat included, for a minute). Pillow and torch release the GIL, so on a gevent
    ``ThreadPool`` the greenlet waits cooperatively and the hub keeps serving; ``max_threads`` bounds how many decodes
    compete with the model for the worker's cores. ``cores`` (``DECODE_CORES=server``: ``cpu.SERVER_CORES``) widens
    each pool thread's affinity to those, so a busy worker's decodes run on an idle neighbour's core instead of
    queueing on one; the inference thread stays pinned (its oneDNN caches). Outside gevent ``run`` calls the function.
    """

    def __init__(self, max_threads: int, nice: int = 0, cores: list[int] | None = None):
        self.max_threads, self._pool = max_threads, None
        self.nice = nice  # niceness steps below the hub for its threads (lower_this_thread)
        self.cores = sorted(cores) if cores else None
        self._lowered: set[int] = set()  # the pool threads already set up (by native thread id)
        if gevent_active():
            from gevent.lock import BoundedSemaphore
            from gevent.threadpool import ThreadPool

            # A free thread, taken before spawn: the pool's spawn itself waits for one, without limit, so a decode
            # waiting there had its 504 a whole decode late (and was still decoded for nobody).
            self._pool, self._free = ThreadPool(maxsize=max_threads), BoundedSemaphore(max_threads)

    def run(self, fn: Callable, *args, within: float | None = None, **kwargs):
        """``fn(*args, **kwargs)`` on a decode thread, its exception re-raised in the caller.

        :raises StillRunning: under gevent, no result within ``within`` s (None: no limit); the thread cannot be
            stopped and runs on, its result dropped (the caller's deadline is what the client was promised)."""
        if self._pool is None:
            return fn(*args, **kwargs)
        if within is None:  # (start-up's measurement: no requests yet to share the threads with)
            ok, value = self._pool.apply(self._on_pool_thread, (fn, args, kwargs))
        else:
            import gevent

            end = time.monotonic() + max(0.0, within)
            if not self._free.acquire(timeout=max(0.0, within)):
                late = StillRunning(f"no decode thread free within {within:.3g} s")
                late.when_done = lambda then: then()  # nothing of it runs
                raise late
            work = self._pool.spawn(self._on_pool_thread, fn, args, kwargs)  # a thread is free: never waits
            work.rawlink(lambda _result: self._free.release())
            try:
                ok, value = work.get(timeout=max(0.0, end - time.monotonic()))
            except gevent.Timeout:
                late = StillRunning(f"no result within {within:.3g} s")
                late.when_done = lambda then: work.rawlink(lambda _result: then())
                raise late from None
        if not ok:  # re-raised here: gevent's pool would print it as an unhandled traceback
            raise value
        return value

    def _on_pool_thread(self, fn: Callable, args: tuple, kwargs: dict) -> tuple[bool, object]:
        tid = _thread.get_native_id()
        if tid not in self._lowered:  # the pool starts its threads lazily: set each up once
            self._lowered.add(tid)
            lower_this_thread(self.nice)  # 0: nothing
            if self.cores:
                widen_this_thread(self.cores)
        return _capture(fn, args, kwargs)


class StillRunning(TimeoutError):
    """``Offloader.run`` gave up waiting and the work runs on: ``when_done(fn)`` calls ``fn()`` (in the hub) once its
    thread is free, so that what it still costs (CPU, a pool thread) can count until then."""


def widen_this_thread(cores: list[int]) -> bool:
    """Let the calling OS thread run on ``cores`` (Linux ``sched_setaffinity`` with pid 0 is per thread; the others keep
    theirs). False where the OS refuses it or has no such call (the thread stays: slower at half load, never wrong)."""
    try:
        os.sched_setaffinity(0, cores)
        return True
    except (AttributeError, OSError, ValueError):
        return False


def _capture(fn: Callable, args: tuple, kwargs: dict) -> tuple[bool, object]:
    try:
        return True, fn(*args, **kwargs)
    except Exception as exc:
        return False, exc
