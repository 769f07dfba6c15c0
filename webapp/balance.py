"""Which worker takes a new request: an idle one, where there is one (``CLASSIFIER_IDLE_FIRST``).

gunicorn's workers share one listening socket. A new connection wakes every worker's hub and the
first to call ``accept()`` gets it, busy or not: a worker's hub is idle while its decode and inference
threads work, so a busy worker takes a connection as fast as an idle one. A keep-alive connection
then brings its client's next requests to the same worker, whatever that worker is doing. So at
moderate load requests wait behind a busy worker while another one idles: each worker is a queue
of its own, and at half the peak rate (open loop, 12 MP uploads, 2 single-core workers, 2-core Zen 5,
2026-12-02) the p99 was 3.3x the unloaded p50, what one queue per worker gives at that load.

Two rules move new work to an idle worker instead (both only while another worker is idle, so a
saturated server works as before):

- **accept**: a worker with a request in progress leaves a new connection for ``DEFER_S`` before it
  accepts it itself (``webapp/worker.py``'s ``IdleFirstServer``). An idle worker, woken by the same
  connection, accepts at once; if none does within ``DEFER_S`` (a worker between states), the busy
  one takes it.
- **keep-alive**: a worker that answers a request while it still has others in progress closes that
  client's connection (``Connection: close``, ``webapp/bodies.py``), so its next request connects
  again and the accept rule places it.

The state is a table in shared memory (``Board``): one 4-byte integer per worker, made by gunicorn's
master before it forks (anonymous ``MAP_SHARED``: every worker sees the same pages), each worker
writing only its own entry (an aligned 4-byte store is atomic on every CPU this runs on; a reader
that sees a value a moment old at worst accepts a connection it could have left, or leaves one for
``DEFER_S``). An entry is ``UNUSED``, ``STARTING`` (forked, not serving yet, or stopping: never
counted as idle), or the number of requests with photos in progress in that worker (0: idle). It
counts requests between ``Classifier.admit`` and the end of the request (``begin``/``end``), so
``/healthz``, ``/metrics`` and refusals never make a worker busy. With ``reuse_port`` each worker has
its own socket (the kernel picks the worker), and the rules are off.

Outside gunicorn (tests' clients, the CLI, Ray) there is no board and every function here is a no-op.
"""

from __future__ import annotations

import mmap
import struct

UNUSED, STARTING = -2, -1
DEFER_S = 0.002  # s: how long a busy worker leaves a new connection to an idle one
_INT = struct.Struct("i")


class Board:
    """``size`` 4-byte entries in anonymous shared memory, all ``UNUSED`` at first (see the module docstring).

    :raises ValueError: ``size`` < 1.
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a board needs at least one entry, not {size}")
        self.size = size
        self._mm = mmap.mmap(-1, _INT.size * size)  # MAP_SHARED | MAP_ANONYMOUS: shared with forked children
        for i in range(size):
            self.put(i, UNUSED)

    def put(self, index: int, value: int) -> None:
        """Entry ``index`` becomes ``value``."""
        _INT.pack_into(self._mm, _INT.size * index, value)

    def get(self, index: int) -> int:
        """Entry ``index``'s value now."""
        return _INT.unpack_from(self._mm, _INT.size * index)[0]

    def values(self) -> list[int]:
        """Every entry, in index order."""
        return [self.get(i) for i in range(self.size)]

    def claim(self) -> int | None:
        """In the master, as it forks a worker: the first ``UNUSED`` entry, now ``STARTING``; None when all are held."""
        for i in range(self.size):
            if self.get(i) == UNUSED:
                self.put(i, STARTING)
                return i
        return None

    def idle_other_than(self, index: int | None) -> bool:
        """Whether an entry other than ``index`` is a serving worker with nothing in progress (0)."""
        return any(v == 0 for i, v in enumerate(self.values()) if i != index)


# -- this process's part (set up by gunicorn.conf.py; None elsewhere) ------------------------------------
_board: Board | None = None  # made in the master, inherited by the workers it forks
_me: int | None = None  # this worker's entry
_serving = False
_in_progress = 0


def install(size: int) -> Board:
    """In gunicorn's master, before the first fork: the board every worker will share (``size`` entries:
    room for a reload's old and new workers at once)."""
    global _board
    _board = Board(size)
    return _board


def claim() -> int | None:
    """In the master (``pre_fork``): an entry for the worker about to be forked (None: no board, or full)."""
    return None if _board is None else _board.claim()


def release(index: int | None) -> None:
    """In the master (``child_exit``): worker ``index`` is gone; its entry is free again."""
    if _board is not None and index is not None:
        _board.put(index, UNUSED)


def join(index: int | None) -> None:
    """In a new worker (``post_fork``): its entry (``STARTING`` until ``serving``)."""
    global _me, _serving, _in_progress
    _me, _serving, _in_progress = index, False, 0


def serving(on: bool = True) -> None:
    """This worker starts serving (counted from now: idle while nothing is in progress), or stops (``on``
    False: during its graceful stop it is never taken for idle)."""
    global _serving
    _serving = on
    _publish()


def active() -> bool:
    """Whether this process has an entry on a board (a gunicorn worker with ``IDLE_FIRST`` on)."""
    return _board is not None and _me is not None


def begin() -> None:
    """A request with photos is in progress in this worker (``Classifier.admit``); pair with ``end``."""
    global _in_progress
    _in_progress += 1
    _publish()


def end() -> None:
    """That request ended (answered or failed)."""
    global _in_progress
    _in_progress = max(0, _in_progress - 1)
    _publish()


def in_progress() -> int:
    """Requests with photos in progress in this worker."""
    return _in_progress


def defer_accept() -> bool:
    """Accept rule: this worker has a request in progress and another worker is idle."""
    return active() and _in_progress > 0 and _board.idle_other_than(_me)


def hand_over() -> bool:
    """Keep-alive rule, at an answer (the request answered is still counted): this worker has other requests
    in progress and another worker is idle, so the client's next request should connect again."""
    return active() and _in_progress > 1 and _board.idle_other_than(_me)


def describe() -> dict | None:
    """For ``/healthz`` (None without a board): this worker's ``entry``, its requests ``in_progress``, and
    the whole ``board`` (every worker's entry: ``UNUSED`` -2, ``STARTING`` -1, else requests in progress)."""
    if _board is None:
        return None
    return {"entry": _me, "in_progress": _in_progress, "board": _board.values()}


def _publish() -> None:
    if _board is not None and _me is not None:
        _board.put(_me, _in_progress if _serving else STARTING)
