"""Admission by time: refuse at once the request this worker would answer too late.

A worker under overload that admits everything until its image queue is full makes every client
wait (``QUEUE_SIZE`` 12 MP photos are seconds of work), and clients that give up meanwhile are
decoded and classified for nobody. So before a request's body is read, ``Admission.admit``
predicts its time to answer in this worker from what is already in it and what that has been
measured to cost, and refuses it (``429 overloaded``, ``Retry-After`` from the same prediction)
where that is over the latency budget (``CLASSIFIER_MAX_WAIT_MS``). ``QUEUE_SIZE`` stays the
backstop (``InferenceBatcher.check_capacity``).

The prediction, in ms, for a request of ``nbytes`` body bytes and ``images`` photos::

    ahead = (a * uploads_ahead + b * bytes_ahead) / decode_threads  +  uploads_ahead * image_ms
            + queued * (image_ms + (a + b * mean_bytes) / decode_threads)
    own   = a * images + b * nbytes                                  +  images * image_ms

- ``uploads_ahead``, ``bytes_ahead``: the photos of requests in ``classify`` that are not decoded yet
  (``Decoding``), and requests admitted whose bodies are still arriving (their ``Ticket``: one photo of
  Content-Length bytes each, while its client is sending, until ``classify`` takes it or the budget has
  passed). A stalled upload, or headers with no body, counts for nothing: it may never come (and a
  client that could make the worker refuse others by declaring bodies it never sends would be a
  cheap attack), while a burst of uploads arriving together counts in full;
- ``a`` (ms per photo) and ``b`` (ms per byte): ``DecodeCost``, a line fitted to this worker's measured
  decode + preprocess CPU times by each photo's decode size: its bytes, or its decoded pixels where more
  (``classify``; by its bytes, a 3 KB lossless WebP of 79 MP, 1.3 s of decode, moved ``b`` from 17.5 to 462
  ms per MB, and ordinary photos were refused for ~50 requests: tryout21). A request whose decode size is over
  its body's is judged again before it is decoded (``admit(replacing=...)``);
- ``decode_threads``: how many photos this worker decodes side by side: its decode threads
  (``concurrency.Offloader``), at most as many as the cores it is pinned to;
- ``queued``: images in the batcher's queue and in the forward pass running now (all of it counted:
  an upper bound); ``image_ms``: its measured forward-pass cost per image (EWMA of the inference
  thread's CPU time per batch / EWMA batch size, ``InferenceBatcher.image_ms``). A queued image is
  decoded already, yet it counts a decode of recent mean size (``mean_bytes``) besides its forward
  pass: the decode threads run on the worker's own cores, so while the queue drains they decode the
  requests admitted after it, and under overload there always are some. In that steady state every
  image ahead costs the cores a decode and a forward pass, and the wait is their sum (Little's law:
  images ahead over images/s). Counted as forward passes only, a queue of small photos (ResNet-18
  bf16, ``dog.jpg``: 6 ms of decode, 12 of forward pass per image) took 1.45x its prediction to drain,
  and admitted answers' p99 was 1.84x the budget (2-core Zen 5, 2026-12-02). Where the load stops,
  the queue drains faster than predicted, which refuses nobody: nothing arrives to be refused.

Costs are CPU time (``time.thread_time`` of the decode or inference thread), times the worker's
``Overhead``, not wall time. Wall time counts whatever else shared the core meanwhile: other decodes,
and above all the request-handling thread answering refusals, which runs at a higher priority
(``CLASSIFIER_WORK_NICE``). Fed back into the prediction, that made a spiral: more refusals stretched
the measured costs, which refused more. A fresh worker hammered at once by clients that ignore
``Retry-After`` (8 clients, 12 MP photos, 2 workers; 4 each fit the budget four times over) refused ~500
requests a second and fell to a quarter of its images/s (7 vs 30), and stayed there until the load
eased. CPU time is the work itself, which no neighbour stretches. But the worker also spends CPU around
that work (reading bodies, parsing, answering, refusing: ~12% more at 2x overload with 12 MP photos), and
CPU time alone predicted answers ~20% early: admitted p99 1.27x the budget instead of 0.75x. ``Overhead``
scales the costs by the worker's whole CPU time per CPU second of measured work, measured each second and
capped at ``Overhead.MAX``, so that the refusals' own work can stretch the prediction at most that much.

A request is admitted when ``ahead + min(own, budget / 2) <= budget``: what it waits for must fit,
and a photo whose own cost is over half the budget counts as half, so a big photo is never refused
for its own size alone (on an idle worker, ``ahead`` is 0, everything is admitted and measured).
Refused, it is told ``Retry-After`` in whole seconds, at least 1: when the work ahead of it will have
shrunk enough for it to fit, *counting the clients refused before it*. Each refusal is remembered as work
(``min(own, budget / 2)``) coming back at the time it was given; the next refused client gets the first
second ``r`` at which ``judged - budget + (work told to come back by then) <= 1000 * r``. Without that,
every client refused within a second is told the same second, they return together and most are refused
again: at 2x overload the refusals cost the busy worker ~10% of its images/s (~5 ms of CPU each). A client
that does not come back costs nothing but a later client's longer wait: only ``Retry-After`` counts them, and
never beyond ``SPREAD_X`` times a refused client's own wait plus ``SPREAD_S``: clients that retry at once are
counted again at every refusal, and they had the clients that waited as told wait 60 s.

The heavy lane: an upload predicted to take over half the budget to decode on its own (``heavy``: a few KB of
flat lossless WebP can hold 79 MP, 1.3 s of a core) is decoded on a thread of its own at the lowest priority
(``concurrency``'s niceness 19, ``service``), one at a time, and counts for no other request: ordinary decodes take
the core from it, so it delays them by a small share of the core instead of its whole decode, and predicting
it ahead of them refused them. Such a request is judged by the heavy lane's work alone: admitted where that
lane is free, else ``429`` with ``Retry-After`` for when it will be. Two clients sending such photos back to back
took a 2-worker server from ~1,000 answers to ordinary photos in 15 s to 9-115 (tryout28's: 594 to 53).

Torch-free and Flask-free. State changes happen under one lock (a real ``_thread`` lock from ``concurrency.Primitives``;
held for microseconds), so request greenlets, the CLI's threads and a dev server's threads may all call in.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from .concurrency import Primitives
from .costs import DecodeCost, Overhead
from .errors import Overloaded


@dataclass(eq=False)
class Ticket:
    """One admitted request whose photos have not reached a decode thread yet.

    ``nbytes``: its body's bytes (Content-Length, or recent uploads' mean where unknown); ``images``:
    photos it counts for (1: how many a body holds is known only once it is read); ``expires``: clock
    s after which it no longer counts (a request that has not reached decoding within the budget is
    late already, or was refused for its body); ``predicted_ms``: ahead + own at admission;
    ``gone``: asks whether its client has hung up; ``sending``: whether body bytes are waiting to be read (it
    counts only then); either None where that cannot be known (it then always counts)."""

    nbytes: float
    images: int
    expires: float
    predicted_ms: float
    gone: Callable[[], bool] | None = None
    sending: Callable[[], bool] | None = None
    live: bool = True


@dataclass(eq=False)
class Decoding:
    """A request in ``classify`` whose photos are being decoded: what of them is still to decode; ``heavy``: on
    the heavy lane (``Admission.heavy``)."""

    uploads: int
    nbytes: int
    heavy: bool = False

    def add(self, uploads: int, nbytes: int) -> None:
        """Count ``uploads`` more photos of ``nbytes`` more bytes (negative: fewer). Under ``Admission._lock``."""
        self.uploads, self.nbytes = self.uploads + uploads, self.nbytes + nbytes


@dataclass(frozen=True)
class Prediction:
    """A request's predicted time to answer (ms): ``ahead`` (waiting for others) and ``own`` (its work)."""

    ahead_ms: float
    own_ms: float

    @property
    def total_ms(self) -> float:
        """``ahead_ms + own_ms``: the predicted time from now to its answer (ms)."""
        return self.ahead_ms + self.own_ms


MAX_RETRY_AFTER_S = 60  # s: the longest Retry-After (a client told more may as well try elsewhere)
# The clients told to come back push a refused one's Retry-After at most to SPREAD_X times its own wait plus SPREAD_S
# (s). Clients that retry at once, ignoring Retry-After, are counted again at each refusal: 28 of them piled up
# thousands of promises, and the clients that waited as told were told 60 s (1 answer in 20 s for 8 of them, beside
# 165 for 20 that retried at once: tryout32). A 2x overload's crowd spreads over 1-3 s.
SPREAD_X, SPREAD_S = 2, 2


class Admission:
    """One worker's admission by time: ``admit`` (before the body), ``decoding`` (in ``classify``).

    ``budget_ms``: the latency budget (``MAX_WAIT_MS``); ``decode_threads``: photos decoded side by
    side; ``image_ms()``: measured forward-pass ms per image; ``queued()``: images in the batcher's
    queue and its running batch; ``clock()``: seconds, monotonic (a fake one in tests);
    ``inference_cpu()``: s of CPU in forward passes so far and ``process_cpu()``: the process's, for
    ``Overhead`` (None: no overhead measured, factor 1).
    """

    def __init__(self, *, budget_ms: float, decode_threads: int, image_ms: Callable[[], float],
                 queued: Callable[[], int], clock: Callable[[], float] = time.monotonic,
                 inference_cpu: Callable[[], float] | None = None,
                 process_cpu: Callable[[], float] = time.process_time):
        self.budget_ms = float(budget_ms)
        self.decode_threads = max(1, int(decode_threads))
        self.decode = DecodeCost()
        self._decode_cpu_s = 0.0  # CPU of the decodes measured so far (s), for Overhead
        self.overhead = None if inference_cpu is None else Overhead(
            lambda: self._decode_cpu_s + inference_cpu(), clock, process_cpu)
        self._image_ms, self._queued, self._clock = image_ms, queued, clock
        self._lock = Primitives.for_this_process().make_lock()
        self._tickets: deque[Ticket] = deque()  # live ones, in admission order (= expiry order)
        self._owed: dict[int, list] = {}  # tenth of a s -> [ms, clients] told to come back then (not a list of each)
        self._decoding = Decoding(uploads=0, nbytes=0)  # every photo in classify not decoded yet, and their bytes
        self._heavy = Decoding(uploads=0, nbytes=0, heavy=True)  # those of them on the heavy lane
        self.admitted = self.refused = self.gone = 0  # gone: clients who left before their photos were decoded

    # -- the prediction --------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        while self._tickets and (not self._tickets[0].live or self._tickets[0].expires <= now):
            self._tickets.popleft().live = False
        for tenth in [t for t in self._owed if t < 10 * (now - self.budget_ms / 1e3)]:  # back (or not) long ago
            del self._owed[tenth]

    def _ahead(self, heavy: bool = False) -> tuple[int, float]:
        """``(uploads, bytes)`` ahead of a new request: photos being decoded, and tickets whose bodies are
        arriving (a zero-timeout poll each, under the lock: microseconds). Of a heavy one: the heavy lane's."""
        if heavy:
            return self._heavy.uploads, float(self._heavy.nbytes)
        uploads, nbytes = self._decoding.uploads, float(self._decoding.nbytes)
        for t in self._tickets:
            if t.live and (t.sending is None or t.sending()):
                uploads += t.images
                nbytes += t.nbytes
        return uploads, nbytes

    def predict(self, nbytes: float | None, images: int = 1) -> Prediction:
        """What a request of ``nbytes`` body bytes (None: unknown) and ``images`` photos would wait
        for and cost here now (see the module docstring)."""
        with self._lock:
            self._expire(self._clock())
            return self._predict(nbytes, images)

    def _predict(self, nbytes: float | None, images: int, heavy: bool = False) -> Prediction:
        f = 1.0 if self.overhead is None else self.overhead.factor()
        a, b = (f * c for c in self.decode.line())
        image_ms = f * max(0.0, float(self._image_ms() or 0.0))
        own_bytes = self.decode.mean_bytes * images if nbytes is None else float(nbytes)
        own = a * images + b * own_bytes + images * image_ms
        if heavy:  # the heavy lane's one thread: what it decodes before this, and this
            uploads, ahead_bytes = self._ahead(heavy=True)
            return Prediction(ahead_ms=a * uploads + b * ahead_bytes + uploads * image_ms, own_ms=own)
        uploads, ahead_bytes = self._ahead()
        # A queued image: its forward pass, and the decode of a later request the cores do meanwhile.
        queued_ms = image_ms + (a + b * self.decode.mean_bytes) / self.decode_threads
        ahead = ((a * uploads + b * ahead_bytes) / self.decode_threads + uploads * image_ms
                 + self._queued() * queued_ms)
        return Prediction(ahead_ms=ahead, own_ms=own)

    def heavy(self, size: float) -> bool:
        """Whether one upload of decode size ``size`` (bytes, or decoded pixels where more: ``classify``) is
        predicted to take over half the budget to decode: it then goes to the heavy lane (module docstring).
        Never before the measured decodes differ enough in size for a line (``DecodeCost.line``)."""
        with self._lock:
            f = 1.0 if self.overhead is None else self.overhead.factor()
            a, b = self.decode.line()
            return b > 0 and f * (a + b * size) > self.budget_ms / 2

    def judge(self, p: Prediction) -> tuple[bool, int]:
        """``(admitted, retry_after_s)`` for prediction ``p``: admitted when ``ahead + min(own, budget/2)``
        fits the budget; otherwise ``Retry-After`` is the seconds by which it does not, rounded up, >= 1
        (before counting the clients already told to come back: ``admit`` adds those)."""
        judged = p.ahead_ms + min(p.own_ms, self.budget_ms / 2)
        if judged <= self.budget_ms:
            return True, 0
        return False, max(1, math.ceil((judged - self.budget_ms) / 1e3))

    def _come_back(self, p: Prediction, now: float) -> int:
        """Seconds (>= 1, <= ``MAX_RETRY_AFTER_S``) after which refused ``p`` fits, the work of the clients
        refused before it that will be back by then included, up to ``SPREAD_X`` times its own wait plus
        ``SPREAD_S``; remembered for the next (module docstring)."""
        own = min(p.own_ms, self.budget_ms / 2)
        over = p.ahead_ms + own - self.budget_ms
        r = min(MAX_RETRY_AFTER_S, max(1, math.ceil(over / 1e3)))
        longest = min(MAX_RETRY_AFTER_S, SPREAD_X * r + SPREAD_S)
        tenths, owed, i = sorted(self._owed), 0.0, 0  # the work back by now + r: one walk (<= ~600 tenths) as r grows
        while True:
            while i < len(tenths) and tenths[i] <= 10 * (now + r):
                owed += self._owed[tenths[i]][0]
                i += 1
            if r >= longest or over + owed <= 1e3 * r:
                break
            r += 1
        slot = self._owed.setdefault(math.floor(10 * (now + r)), [0.0, 0])
        slot[0], slot[1] = slot[0] + own, slot[1] + 1
        return r

    # -- requests --------------------------------------------------------------------------------
    def admit(self, nbytes: float | None, images: int = 1, *, gone: Callable[[], bool] | None = None,
              sending: Callable[[], bool] | None = None, replacing: Ticket | None = None,
              heavy: bool = False) -> Ticket:
        """Admit a request of ``nbytes`` body bytes (None: unknown) and ``images`` photos, or refuse it.

        The returned ``Ticket`` counts its photo as ahead of later requests while ``sending()`` (None: always) until
        ``decoding`` takes it, ``release`` drops it, or the budget has passed; ``gone`` goes with it to ``classify``
        (``Ticket``). ``replacing``: its earlier ticket, judged again by its decode size (``classify``), uncounted.
        ``heavy``: judged by the heavy lane's work ahead instead (``heavy``); its ticket counts for no other request.

        :raises Overloaded: the predicted time is over the budget (429, ``Retry-After`` in s, >= 1).
        """
        with self._lock:
            now = self._clock()
            if replacing is not None:
                replacing.live = False
            self._expire(now)
            p = self._predict(nbytes, images, heavy)
            ok, retry_after = self.judge(p)
            if not ok and heavy:  # back once the lane is free (not owed: it comes back into no other's work)
                retry_after = min(MAX_RETRY_AFTER_S, max(1, math.ceil(p.ahead_ms / 1e3)))
                self.refused += 1
                raise Overloaded(f"server busy: this request's photos take about {p.own_ms / 1e3:.1f} s to decode (many "
                                 f"pixels), and such photos are decoded one at a time here, after the others; the one "
                                 f"decoding now has about {p.ahead_ms / 1e3:.1f} s left; try again in {retry_after} s",
                                 headers={"Retry-After": str(retry_after)})
            if not ok:
                retry_after = self._come_back(p, now)
                self.refused += 1
                raise Overloaded(f"server busy: an answer would take about {p.total_ms / 1e3:.1f} s here, over "
                                 f"the {self.budget_ms / 1e3:g} s budget (CLASSIFIER_MAX_WAIT_MS); try again in "
                                 f"{retry_after} s", headers={"Retry-After": str(retry_after)})
            size = self.decode.mean_bytes * images if nbytes is None else float(nbytes)
            t = Ticket(nbytes=size, images=images, expires=now + self.budget_ms / 1e3, predicted_ms=p.total_ms,
                       gone=gone, sending=sending)
            if not heavy:
                self._tickets.append(t)
            self.admitted += 1
            return t

    def release(self, ticket: Ticket | None) -> None:
        """Stop counting ``ticket`` (its request ended before decoding, e.g. a 400); no-op if already done."""
        if ticket is not None:
            with self._lock:
                ticket.live = False

    def decoding(self, ticket: Ticket | None, sizes: list[int], heavy: bool = False) -> Decoding:
        """A request starts decoding its uploads of ``sizes`` bytes (on the heavy lane: ``heavy``): they replace its
        ticket (if any, and still counted) among the work ahead of later requests. Pair with ``finish``."""
        with self._lock:
            if ticket is not None:
                ticket.live = False
            job = Decoding(uploads=len(sizes), nbytes=sum(sizes), heavy=heavy)
            self._lane(job).add(job.uploads, job.nbytes)
            return job

    def _lane(self, job: Decoding) -> Decoding:
        return self._heavy if job.heavy else self._decoding

    def decoded(self, job: Decoding, nbytes: int, ms: float) -> None:
        """One upload of ``job`` (``nbytes`` bytes) was decoded in ``ms`` (CPU time of its decode thread)."""
        with self._lock:
            self.decode.observe(nbytes, ms)
            self._decode_cpu_s += ms / 1e3
            if job.uploads > 0:
                job.add(-1, -nbytes)
                self._lane(job).add(-1, -nbytes)

    def abandon(self, job: Decoding, nbytes: int) -> Callable[[], None]:
        """One upload of ``job`` (``nbytes``) outlived its request and its decode thread runs on: it stays counted
        ahead of later requests (past ``finish``) until the returned function is called, when that thread ends."""
        with self._lock:
            job.add(-1, -nbytes)
        return lambda: self.finish(Decoding(uploads=1, nbytes=nbytes, heavy=job.heavy))

    def finish(self, job: Decoding) -> None:
        """``job``'s decoding ended (done or failed): whatever of it is left stops counting."""
        with self._lock:
            self._lane(job).add(-job.uploads, -job.nbytes)
            job.add(-job.uploads, -job.nbytes)

    def note_gone(self) -> None:
        """Count a request dropped because its client hung up (``/healthz`` shows the count)."""
        with self._lock:
            self.gone += 1

    def describe(self) -> dict:
        """For ``/healthz``: the budget and measured costs (ms), the work ahead now (``ahead_ms``), what a
        request of recent mean size would be predicted to take (``predicted_ms``), and the counts (``decodes``: uploads decoded and
        measured, start-up's one included)."""
        with self._lock:
            self._expire(self._clock())
            a, b = self.decode.line()
            p = self._predict(None, 1)
            uploads, _ = self._ahead()
            return {"budget_ms": self.budget_ms, "decode_ms_per_upload": round(a, 3),
                    "decode_ms_per_mb": round(b * 1e6, 3), "image_ms": round(float(self._image_ms() or 0.0), 3),
                    "decode_threads": self.decode_threads, "uploads_ahead": uploads,
                    "heavy_uploads_ahead": self._heavy.uploads,
                    "ahead_ms": round(p.ahead_ms, 1), "predicted_ms": round(p.total_ms, 1), "admitted": self.admitted, "refused": self.refused,
                    "client_gone": self.gone, "decodes": self.decode.count,
                    "overhead": round(self.overhead.value, 3) if self.overhead else 1.0,
                    "told_to_return": sum(clients for _, clients in self._owed.values())}
