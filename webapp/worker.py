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
  a line over its limit, bad chunked framing) are answered in the API's JSON error shape
  (``write_json_error``), not gunicorn's HTML page; under ``/v2``, where the path got that far, in the
  Open Inference Protocol's (``errors.error_body``).
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
import json
import logging
import os
import re
import signal
import struct
import termios
import time
from http import HTTPStatus

import gevent
from gevent.server import StreamServer
from gunicorn.workers import ggevent
from gunicorn import util as gunicorn_util
from gunicorn.http import message as gunicorn_message
from gunicorn.workers.ggevent import GeventWorker

from . import balance, bodies, children
from .bodies import drain_socket
from .errors import OTHER_HTTP_CODE, error_body
from .logs import ACCESS_LOGGER, REQUEST_ID_HEADER, access_fields, request_id_from


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

    def run(self):
        """gunicorn's gevent loop, ticking every ``TICK_S``; its servers are ``IdleFirstServer`` where the
        accept rule applies (``GeventWorker.run`` makes them from its module's ``StreamServer`` name)."""
        if balance.active() and not self.cfg.reuse_port:
            ggevent.StreamServer = IdleFirstServer
        ggevent.gevent = QuickTicks(self)
        gunicorn_util.write_error = write_json_error  # what Worker.handle_error sends on a parse error
        self.log.access = functools.partial(_access_after_answer, self.log.access)
        bodies.stop_time_left = self.stop_time_left  # while stopping: answers say Connection: close, drains end early
        super().run()

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
        """gunicorn's, with what ``write_json_error`` needs of the refused request known to it: its path (for
        its error shape) and its ``X-Request-ID`` (echoed where sane, as the app does; else a new one)."""
        who = getattr(req, "method", None) or getattr(getattr(exc, "req", None), "method", None), \
            addr[0] if isinstance(addr, tuple) else None, _request_header(req, exc, "User-Agent")
        _REFUSED[id(client)] = (_request_path(req, exc), request_id_from(_request_header(req, exc, REQUEST_ID_HEADER)),
                                *who)
        try:
            super().handle_error(req, client, addr, exc)
        finally:
            _REFUSED.pop(id(client), None)
            if (held := _HELD.pop(id(client), None)) is not None:  # the answer was not written: the line as it is
                held[0](*held[1:])

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


# gunicorn's statuses for what it refuses itself -> the error table's code (webapp/errors.py); the
# others have no row there and get "http_error", as the app's handler gives Werkzeug's unlisted ones.
_PARSE_CODES = {400: "bad_request"}


# id(client socket) -> (path, request id, method, client address, User-Agent) of the request gunicorn refused on it,
# from Worker.handle_error to write_json_error, which it calls (same greenlet, same call: the entry is removed right
# after).
_REFUSED: dict[int, tuple] = {}
# id(client socket) -> (gunicorn's access, resp, req, environ, request_time): the text access line of such a request,
# held from gunicorn's handle_error (which logs it before the answer exists) until write_json_error has its size and id.
_HELD: dict[int, tuple] = {}
_LINE_START = re.compile(rb"^[A-Za-z]+ (/[^ \r\n?]*)")


def _request_header(req, exc: BaseException, name: str) -> str | None:
    """A header of the refused request where gunicorn got as far as its headers (its request object), else None."""
    for candidate in (req, getattr(exc, "req", None)):
        for key, value in getattr(candidate, "headers", None) or ():
            if isinstance(key, str) and key.upper() == name.upper():
                return value
    return None


def _request_path(req, exc: BaseException) -> str | None:
    """The path of a request gunicorn could not parse, as far as it got: its request object (``req``, or the
    one the error carries, or the one being parsed in the traceback), else the start of the request line it
    was reading (a line over the limit). None where nothing says."""
    for candidate in (req, getattr(exc, "req", None)):
        if isinstance(getattr(candidate, "path", None), str):
            return candidate.path
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == gunicorn_message.__file__:  # gunicorn's parser, outer frames first
            local = tb.tb_frame.f_locals
            owner, line = local.get("self"), local.get("data")
            if isinstance(owner, gunicorn_message.Request) and isinstance(getattr(owner, "path", None), str):
                return owner.path
            if isinstance(line, (bytes, bytearray)) and (m := _LINE_START.match(bytes(line[:512]))):
                return m.group(1).decode("latin-1")  # read_line: the request line, too long to parse
        tb = tb.tb_next
    return None


class ClientFaultsAtInfo(logging.Filter):
    """On gunicorn's error log: its "Invalid request from ip=..." (a request it could not parse: the client's fault,
    answered 4xx by ``write_json_error``) at INFO, not WARNING, so that warnings stay the server's own (tryout23: a
    malformed Content-Length logged as a warning); dropped where INFO is off."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and str(record.msg).startswith("Invalid request from ip="):
            record.levelno, record.levelname = logging.INFO, "INFO"
            return self.logger.isEnabledFor(logging.INFO)
        return True


def _access_after_answer(access, resp, req, environ, request_time) -> None:
    """gunicorn's access logging (``Logger.access``, bound as ``access``), but for a request gunicorn refused: its
    line is held (``_HELD``) for ``write_json_error``, so that it shows the answer's bytes and X-Request-ID, as every
    other line does, not gunicorn's 0 bytes and no id (tryout23)."""
    if id(getattr(resp, "sock", None)) in _REFUSED:
        _HELD[id(resp.sock)] = (access, resp, req, environ, request_time)
    else:
        access(resp, req, environ, request_time)


_RAW_LINE = re.compile(r"Invalid HTTP request line: '(.*?)'+$", re.S)


def _in_words(mesg: str) -> str:
    """gunicorn's message for a request it refused, with what to send instead where it says too little."""
    if "CONTENT-LENGTH" in mesg.upper():
        # gunicorn says only "CONTENT-LENGTH" for all three faults: not a size, given twice, or beside chunked.
        return (f"{mesg}: Content-Length must be the body's size in bytes, a whole number >= 0, given once, "
                f"and not together with Transfer-Encoding: chunked")
    if (m := _RAW_LINE.search(mesg)) and re.search(r"[\x80-\xff]|\\x[89a-f][0-9a-f]", m.group(1)):
        # A raw UTF-8 byte in the URL (a hand-made client): gunicorn shows it decoded as Latin-1 ("Ã©" for "é").
        raw = re.sub(r"\\x([0-9a-f]{2})", lambda h: chr(int(h.group(1), 16)), m.group(1))
        line = raw.encode("latin-1", "replace").decode("utf-8", "replace")
        return (f"the request line is not ASCII ({line!r}): a URL's other characters are sent percent-encoded "
                f"(RFC 3986 2.1: é as %C3%A9; curl -G --data-urlencode 'name=value' encodes a query value)")
    return mesg


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn's ``util.write_error`` (same arguments: the socket, status, reason phrase, message) in
    the API's error shape: ``{"error": {"code", "message", "status"}}``, ``Connection: close``.

    Called by gunicorn's ``Worker.handle_error`` for a request it could not parse (400, 414, 417, 431, 501...)
    before the app saw it. A Content-Length that is not a number of bytes, is repeated, or comes with
    ``Transfer-Encoding: chunked`` says what Content-Length must be, in words. Every answer carries an
    ``X-Request-ID``, as the app's do, and with ``ACCESS_LOG=json`` its access line (duration unknown: null), as
    every request has one. Then what the client still sends is read and dropped, bounded
    (``bodies.drain_socket``), so that closing does not reset the connection under an answer not yet read."""
    message = _in_words(mesg)
    path, request_id, method, remote, agent = _REFUSED.get(id(sock), (None,) * 5)
    request_id = request_id or request_id_from(None)
    body = json.dumps(error_body(path, _PARSE_CODES.get(status_int, OTHER_HTTP_CODE), message, status_int)).encode()
    try:  # gunicorn 27 names its 501 (a transfer coding it does not know) "Bad Request"
        reason = HTTPStatus(status_int).phrase
    except ValueError:
        pass
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{REQUEST_ID_HEADER}: {request_id}\r\n\r\n").encode("latin-1")
    if (held := _HELD.pop(id(sock), None)) is not None:  # the text access line (ACCESS_LOG=text), now complete
        log_access, resp, *rest = held
        resp.sent, resp.headers = len(body), [(REQUEST_ID_HEADER, request_id)]
        log_access(resp, *rest)
    gunicorn_util.write_nonblock(sock, head + body)
    if (access := logging.getLogger(ACCESS_LOGGER)).handlers:  # ACCESS_LOG=json: its line, as every request has
        access.info(json.dumps(access_fields(request_id=request_id, method=method, path=path, status=status_int,
                                             duration_ms=None, size=len(body), remote_addr=remote, query="",
                                             user_agent=agent), separators=(",", ":")))
    drain_socket(sock)
