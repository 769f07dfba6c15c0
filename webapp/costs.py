"""What a worker's work costs, measured: decodes by their size (``DecodeCost``), and the worker's whole CPU per
CPU second of that work (``Overhead``). ``webapp.admission`` predicts a request's time to answer from them (its
module docstring says why CPU time and not wall time, and why a line through sizes).

Torch-free and Flask-free; not thread-safe on their own (``Admission`` calls them under its lock).
"""

from __future__ import annotations

import time
from typing import Callable


class DecodeCost:
    """Measured decode + preprocess CPU time of one upload, as a line ``ms = a + b * bytes``.

    An exponentially weighted least-squares fit (each new decode weighs ``ALPHA``, older ones fade)
    over ``(bytes, ms)`` pairs. Where the recent sizes hardly differ (spread under ``SPREAD`` of their
    mean) a line cannot be told from noise: every upload is then guessed to cost their mean time,
    whatever its size. Where the fit comes out with a negative slope or intercept it is not trusted:
    the measured ms per byte through the origin instead.

    Why a size never seen is guessed at the mean time and not scaled by its bytes: a guess too high
    refuses, and a refused photo is never decoded, so it teaches nothing; a guess too low admits it
    and its decode corrects the line at once. The one size a worker has measured at start-up is its
    small golden photo; scaled by bytes to a 3 MB phone photo it predicted ~1 s of decoding (35 ms
    measured) and a fresh worker refused every client but the first two until one of them got in.
    """

    ALPHA = 0.1
    SPREAD = 0.05

    def __init__(self):
        self.count = 0  # decodes observed
        self._mx = self._my = self._mxx = self._mxy = 0.0

    def observe(self, nbytes: int, ms: float) -> None:
        """One decode of ``nbytes`` bytes that took ``ms`` (CPU time of its decode thread)."""
        x, y = float(nbytes), float(ms)
        w = 1.0 if self.count == 0 else self.ALPHA
        self._mx += w * (x - self._mx)
        self._my += w * (y - self._my)
        self._mxx += w * (x * x - self._mxx)
        self._mxy += w * (x * y - self._mxy)
        self.count += 1

    @property
    def mean_bytes(self) -> float:
        """Recent uploads' mean size (bytes): the guess for a body of unknown length (0 before any)."""
        return self._mx

    def line(self) -> tuple[float, float]:
        """``(a, b)``: ms per upload and ms per byte; ``(0, 0)`` before any decode was measured; ``(mean ms, 0)``
        while the sizes measured hardly differ."""
        if self.count == 0 or self._mx <= 0:
            return 0.0, 0.0
        var = self._mxx - self._mx * self._mx
        if var <= (self.SPREAD * self._mx) ** 2:
            return self._my, 0.0
        b = (self._mxy - self._mx * self._my) / var
        a = self._my - b * self._mx
        return (a, b) if b > 0 and a >= 0 else (0.0, self._my / self._mx)

    def predict(self, nbytes: float, uploads: int = 1) -> float:
        """Predicted decode CPU time (ms) of ``uploads`` uploads of ``nbytes`` bytes in all."""
        a, b = self.line()
        return a * uploads + b * nbytes


class Overhead:
    """The worker's whole CPU time per CPU second of measured work (decodes and forward passes): >= 1.

    ``process_cpu()``: s of CPU of the whole process, all threads (``time.process_time``); ``work_cpu()``:
    s of CPU of the measured work so far. ``factor()`` re-measures when ``WINDOW_S`` have passed on
    ``clock`` with at least ``MIN_WORK_S`` of work in them (an idle worker keeps its last figure), as an
    EWMA (weight ``ALPHA``) of the window's ratio clamped to ``[1, MAX]``: the cap bounds the feedback of
    refusals, whose CPU is part of it (module docstring).
    """

    WINDOW_S, MIN_WORK_S, ALPHA, MAX = 1.0, 0.05, 0.3, 2.0

    def __init__(self, work_cpu: Callable[[], float], clock: Callable[[], float],
                 process_cpu: Callable[[], float] = time.process_time):
        self._work, self._clock, self._process = work_cpu, clock, process_cpu
        self._since = (clock(), process_cpu(), work_cpu())
        self.value = 1.0
        self.windows = 0

    def factor(self) -> float:
        """The current factor (1.0 until a window with work has been measured)."""
        now = self._clock()
        t0, p0, w0 = self._since
        if now - t0 < self.WINDOW_S:
            return self.value
        p, w = self._process(), self._work()
        self._since = (now, p, w)
        if w - w0 >= self.MIN_WORK_S:
            r = min(self.MAX, max(1.0, (p - p0) / (w - w0)))
            self.value = r if not self.windows else self.value + self.ALPHA * (r - self.value)
            self.windows += 1
        return self.value
