"""The gunicorn worker class: gunicorn's gevent worker, with stops that are quick and quiet.

``gunicorn.conf.py`` names it (``worker_class``). Three things differ from ``GeventWorker``:

- **Before it is ready** (building, compiling, warming up: up to minutes, in the main thread, which
  does not yield to gevent's hub), gunicorn's handlers would only queue the stop for later, so a
  Ctrl-C waited for the compile to end or for the master to SIGKILL the worker after its graceful
  timeout. Here SIGINT, SIGQUIT or SIGTERM then ends the worker at once, with one line and exit 0:
  it holds no request yet, and nothing it was writing is read by anyone unless complete (caches
  are written to a temporary name and renamed).
- **Once serving**, a Ctrl-C in a terminal reaches every process of the group: the worker gets
  SIGINT itself and SIGQUIT from the master. gunicorn's gevent worker handles each by spawning a
  greenlet that raises ``SystemExit``; the second one ran during interpreter shutdown and printed
  a ``SystemExit: 0`` traceback. Here only the first stop signal counts.
- **Requests gunicorn itself refuses** (a request line or header it cannot parse: ``Content-Length: abc``,
  a line over its limit, bad chunked framing) are answered in the API's JSON error shape, not gunicorn's HTML
  page, and logged as the app's requests are (``webapp/refusals.py``).
- **A stop is noticed at once**: gunicorn's loop checks ``alive``, and while stopping whether connections
  are still open, once a second (``gevent.sleep(1.0)``), so every stop waited up to 1 s to begin and up to
  1 s more after its last request; here the loop ticks every ``TICK_S`` (``QuickTicks``). With the clean
  exit of ``lifecycle.leave_if_stopped_cleanly``, an idle worker's SIGTERM-to-exit went from 2.9 s to
  ~0.5 s (measured on the 2-core box). Connections waiting for a next request that has not begun (a
  browser's idle keep-alive, a speculative preconnect) held a stop for gunicorn's ``keepalive`` (5 s);
  a stopping worker ends each such wait that has lasted ``IDLE_GRACE_S`` with nothing to read, as nginx closes idle
  keep-alive connections on a graceful stop (``Worker.end_idle_waits``). A request in flight when the stop
  comes is answered with ``Connection: close`` (``bodies.stopping``, from ``Worker.stop_time_left``), as its
  connection then closes.
- **New connections go to an idle worker first** (``CLASSIFIER_IDLE_FIRST``, ``webapp/balance.py``):
  its servers are ``IdleFirstServer``, which, while this worker has a request in progress and
  another worker is idle, leaves a new connection for ``balance.DEFER_S`` before accepting it.
"""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import struct
import sys
import termios
import time

import gevent
from gevent.server import StreamServer
from gunicorn.workers import ggevent
from gunicorn import util as gunicorn_util
from gunicorn.workers.ggevent import GeventWorker

from . import balance, bodies, children
from .refusals import access_after_answer, refusing, write_json_error


class IdleFirstServer(StreamServer):
    """gevent's ``StreamServer`` that, while ``balance.defer_accept()`` (this worker busy, another idle),
    leaves a ready connection for ``balance.DEFER_S`` s and then accepts it only if it is still waiting:
    the idle worker, woken by the same connection, has taken it by then.

    The listening socket's watcher is stopped meanwhile (as gevent's own back-off after an accept error
    does), so the hub is not woken again and again by the same connection.
    """

    _deferral = None

    def _do_read(self):
        if self._deferral is None and balance.defer_accept():
            self.stop_accepting()
            self._deferral = self.loop.timer(balance.DEFER_S)
            self._deferral.start(self._after_deferral)
            return
        super()._do_read()

    def _after_deferral(self):
        timer, self._deferral = self._deferral, None
        if timer is not None:
            timer.close()
        if self.closed or not self.started:  # stopping: the connection is left to the other workers
            return
        self.start_accepting()
        super()._do_read()  # one accept, without deferring again: a no-op if the idle worker took it


TICK_S = 0.1  # gunicorn's gevent loop: how often it checks alive, and open connections while stopping (s)
# A stopping worker ends a connection's wait for its next request after this long without a byte (s): a
# client racing the stop has its request on the wire within a round trip; an idle keep-alive has nothing.
IDLE_GRACE_S = 0.5


class QuickTicks:
    """``gevent`` as gunicorn's gevent worker module sees it (its ``gevent`` name), with sleeps cut to
    ``TICK_S``: its only sleeps are the 1 s ticks of ``GeventWorker.run``, each a check of a flag or of the
    connection pool, so 10 checks a second cost nothing and a stop waits at most ``TICK_S`` for them.
    Each tick of a stopping ``worker`` (None: plain ticks) also ends its idle waits (``end_idle_waits``)."""

    def __init__(self, worker=None):
        self._worker = worker

    def __getattr__(self, name):
        return getattr(gevent, name)

    def sleep(self, seconds=0, ref=True):
        if self._worker is not None and not self._worker.alive:
            self._worker.end_idle_waits()
        return gevent.sleep(min(seconds, TICK_S), ref)


class NextRequestWait:
    """gunicorn's wait for a connection's next request (what ``timeout_ctx`` returns: a silent ``keepalive``
    timeout around the parse of the request line and headers), on record in ``waits`` while it lasts, with
    its client socket and start time, so that a stopping worker can end it early (``Worker.end_idle_waits``)."""

    def __init__(self, keepalive: float, waits: dict, client):
        self.timeout = gevent.Timeout(keepalive, False)
        self._waits, self._client = waits, client

    def __enter__(self):
        self.timeout.__enter__()
        self._waits[gevent.getcurrent()] = (self.timeout, self._client, time.monotonic())
        return self.timeout

    def __exit__(self, kind, value, tb):
        self._waits.pop(gevent.getcurrent(), None)
        return self.timeout.__exit__(kind, value, tb)  # True for its own expiry: the wait ends quietly


def _bytes_waiting(sock) -> int:
    """Bytes received on ``sock`` and not yet read (``FIONREAD``; never blocks); 1 where it cannot be told."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 1


class Worker(GeventWorker):
    """``GeventWorker`` that leaves at once when stopped before ready, handles one quit only, and serves
    through ``IdleFirstServer`` where ``balance`` is active and gunicorn's ``reuse_port`` is off."""

    _quitting = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._clients: dict = {}  # connection greenlet -> its client socket
        self._waits: dict = {}  # connection greenlet -> (timeout, client socket, monotonic start) of its wait
        self._stop_began: float | None = None  # monotonic time of SIGTERM (or of the first tick of another stop)

    def load_wsgi(self):
        """gunicorn's, but a bad setting met as the app loads is a failed start told to the master (one line): a
        reload's worker, where a setting went bad since the start (a calibration folder moved), exited 3 with a
        traceback, which halts the whole server; told, the master gives the reload up (webapp/reloads.py)."""
        from . import lifecycle
        from .settings import SettingsError

        try:
            super().load_wsgi()
        except SettingsError as exc:
            if not lifecycle.report_failure(self.pid, f"configuration error: {exc}"):
                raise
            sys.stdout.flush()  # out at once, as post_worker_init's failed start: nothing of this worker to keep
            sys.stderr.flush()
            os._exit(0)

    def run(self):
        """gunicorn's gevent loop, ticking every ``TICK_S``; its servers are ``IdleFirstServer`` where the
        accept rule applies (``GeventWorker.run`` makes them from its module's ``StreamServer`` name)."""
        if balance.active() and not self.cfg.reuse_port:
            ggevent.StreamServer = IdleFirstServer
        ggevent.gevent = QuickTicks(self)
        gunicorn_util.write_error = write_json_error  # what Worker.handle_error sends on a parse error
        self.log.access = functools.partial(access_after_answer, self.log.access)
        bodies.stop_time_left = self.stop_time_left  # while stopping: answers say Connection: close, drains end early
        super().run()

    def notify(self):
        """gunicorn's heartbeat, but a master gone (SIGKILLed: the OOM killer, ``kill -9``) is a graceful stop, as
        its SIGTERM would be (``children.signal_on_parent_death`` sends this worker one), to the end: gunicorn's
        ``sys.exit(0)`` here, at the first heartbeat of that stop, reset the requests in flight."""
        super(GeventWorker, self).notify()  # the heartbeat file: GeventWorker's own first step, without its exit
        if self.ppid != os.getppid() and self.alive:
            self.log.info("Parent changed, stopping gracefully: %s", self)
            self.handle_exit(signal.SIGTERM, None)

    def handle(self, listener, client, addr):
        """gunicorn's, with this connection's client socket known to ``timeout_ctx`` (same greenlet)."""
        self._clients[gevent.getcurrent()] = client
        try:
            super().handle(listener, client, addr)
        finally:
            self._clients.pop(gevent.getcurrent(), None)

    def timeout_ctx(self):
        """The wait for a connection's next request: gunicorn's silent ``keepalive`` timeout, on record."""
        return NextRequestWait(self.cfg.keepalive, self._waits, self._clients.get(gevent.getcurrent()))

    def end_idle_waits(self) -> None:
        """While stopping: end each wait for a next request that began ``IDLE_GRACE_S`` or more ago and has no
        byte waiting on its socket, by its own timeout (gunicorn then closes the connection quietly), as the
        timeout itself would after ``keepalive``. A request line and headers still trickling in after that
        long are cut as that timeout cuts them; a body being read is not in a wait. Checked and thrown in
        a callback of the hub, as gevent fires a timeout, so no byte is read in between."""
        hub = gevent.get_hub()
        now = time.monotonic()
        for greenlet, (_, _, since) in list(self._waits.items()):
            if now - since >= IDLE_GRACE_S:
                hub.loop.run_callback(self._end_if_idle, greenlet)
        self.cut_body_reads(now)

    def cut_body_reads(self, now: float) -> None:
        """While stopping: from ``DRAIN_SECONDS`` + 1 s before the stop's wait ends (``graceful_timeout``),
        answer each request whose body is still being read with ``503 not_ready`` (``bodies.cut_by_stop``),
        thrown into its greenlet from a callback of the hub, so that its answer and bounded drain are done before
        the master kills this worker. Its upload stalled or crawled; at the wait's end it was reset instead."""
        if self._stop_began is None:
            self._stop_began = now  # a stop without SIGTERM (max_requests): noticed at its first tick
        waited = now - self._stop_began
        if waited < max(0.0, self.cfg.graceful_timeout - bodies.DRAIN_SECONDS - 1.0):
            return
        hub = gevent.get_hub()
        for greenlet, client in list(self._clients.items()):
            if bodies.reading(client):
                hub.loop.run_callback(self._cut_body_read, greenlet, client, waited)

    def stop_time_left(self) -> float | None:
        """Seconds (s) left of this stop's wait (``graceful_timeout`` from SIGTERM); None while not stopping."""
        if self.alive:
            return None
        began = self._stop_began if self._stop_began is not None else time.monotonic()
        return self.cfg.graceful_timeout - (time.monotonic() - began)

    @staticmethod
    def _cut_body_read(greenlet, client, waited: float) -> None:
        if bodies.reading(client):  # still in its read (it has not moved on since the tick)
            greenlet.throw(bodies.cut_by_stop(waited))

    def _end_if_idle(self, greenlet) -> None:
        entry = self._waits.get(greenlet)
        if entry is None or entry[1] is None or _bytes_waiting(entry[1]):
            return  # it has moved on, or a request is arriving: gunicorn's own wait decides
        greenlet.throw(entry[0])

    def handle_error(self, req, client, addr, exc):
        """gunicorn's, with what ``write_json_error`` needs of the refused request known to it (``refusals.refusing``):
        its path (for its error shape), its ``X-Request-ID`` (echoed where sane, as the app does; else a new one)..."""
        with refusing(req, client, addr, exc, self.log):
            super().handle_error(req, client, addr, exc)

    def handle_quit(self, sig, frame):
        """SIGINT / SIGQUIT: before ready, leave now; after, gunicorn's quick stop, once."""
        if not self.booted:
            leave_before_ready(self.log, sig)
        if self._quitting:
            return
        self._quitting = True
        balance.serving(False)  # stopping: other workers no longer leave connections to this one
        super().handle_quit(sig, frame)

    def handle_exit(self, sig, frame):
        """SIGTERM: before ready, leave now (no request to drain); after, gunicorn's graceful stop."""
        if not self.booted:
            leave_before_ready(self.log, sig)
        if self._stop_began is None:
            self._stop_began = time.monotonic()
        balance.serving(False)
        super().handle_exit(sig, frame)


_leaving = False  # leave_before_ready is under way (it ends in os._exit)


def leave_before_ready(log, sig: int) -> None:
    """One line on gunicorn's ``log``, exit 0, no cleanup hooks: the model was not serving yet
    (``os._exit``: the main thread may be deep inside a compile that would run on for a minute); a compile child
    it runs is stopped first (``children.stop_all``)."""
    global _leaving
    if _leaving:  # a second stop signal (a terminal's SIGINT, then the master's SIGQUIT) while the first is carried out
        return
    _leaving = True
    try:
        log.info("worker %s stopped before it was ready (%s)", os.getpid(), signal.Signals(sig).name)
        children.stop_all()  # its compile child, if one runs: os._exit runs no cleanup, and it would run on
    finally:
        os._exit(0)


def exit_on_stop_signals(log) -> None:
    """In ``post_fork``, before gunicorn installs the worker's own handlers: a stop signal ends the new
    worker at once, as it does later during start-up (the master's inherited handlers would drop it)."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: leave_before_ready(log, signum))
