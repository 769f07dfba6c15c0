"""The port answers while no worker can: 503 ``not_ready`` from gunicorn's master until a worker is ready, and
from a stop signal until the master exits.

A gevent worker accepts connections only once its model is built, compiled, warmed up and
self-tested (a minute on a cold cache). Until then a request would wait in the listen backlog
with no answer, and a load balancer could not tell a server that is starting from one that is
dead. So, while no worker has reported ready (``webapp.lifecycle``'s channel), one plain thread in
the master accepts on the listening sockets and answers every request, ``/readyz`` and every other
readiness path included, ``503`` with the error table's JSON body (``not_ready``) and ``Retry-After``.
Once a worker reports ready it stops accepting (the workers take every connection from then on);
should every ready worker exit, it answers again until a replacement is ready.

**Liveness while starting.** The liveness paths (``LIVE_PATHS``: ``GET``/``HEAD /healthz`` and
``/v2/health/live``) get ``200`` from it meanwhile (``live``: "starting", no worker ready yet), as Triton's and
KServe's protocol have it: live means the server process is up and answering, ready that it can serve
inference. Their 503 made tritonclient's ``is_server_live()`` False, and a liveness probe on either path
restarted the container during a cold compile, which then never finished (tryout). Both paths are open on the
workers too (no token). While stopping they get the 503 (stopping) as every request: the process is going away.

**Stopping.** A listening socket accepts connections (the kernel completes the handshake into its
backlog) for as long as any process holds it open, and closing the last copy resets whatever waits in
the backlog. On SIGTERM gunicorn's master closes its own copy at once and the workers close theirs
within ``worker.TICK_S``, while this thread's duplicate stayed open until the master exited (0.1-0.3 s
later, draining requests in flight: up to the graceful timeout): connections made in that gap were
reset unanswered (measured: 1-4 ``curl: (56) Recv failure`` per SIGTERM with 4 clients uploading, 2
workers). So, once the master is stopping, the thread answers every connection still arriving with
``503 not_ready`` ("stopping", ``Retry-After``); it first leaves each one ``STOP_DEFER_S`` to a worker
still accepting, which serves it. Once every worker has exited, gunicorn's ``on_exit`` hook calls
``finish``: it makes the kernel drop new connections (``listen.refuse_new_connections``), answers what waits
in the backlog and closes the duplicates, so the port refuses from then on, not only after the interpreter's
teardown (~0.4 s more in a master that imported torch). Clients reconnecting at once after their 503 had kept
the backlog full until the close reset them, requests sent (5-7 per SIGTERM, 8 clients uploading; now none).

Each answer carries the request's ``X-Request-ID`` (the client's, where sane, else a new one), and is written to
the access log and counted in ``/metrics`` (endpoint ``(master)``) by ``master_answers`` (its ``on_answer``), as
a worker's answers are (the liveness 200s too, ``code`` empty): the 503s of a start, a stop or a crash were in
neither, so a dashboard showed no errors exactly while clients got them.

It runs in the master, which gevent never patches: a plain OS thread (from ``webapp.concurrency``),
``select`` and blocking sockets with short timeouts. It imports neither torch nor Flask. It works on
duplicates of gunicorn's listening sockets, so gunicorn closing its own (a stop) never leaves it
selecting on a closed or reused descriptor; it closes them if gunicorn replaces its listeners (a SIGHUP
with a new bind), and each worker closes its inherited copies right after fork.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import time
from typing import Callable

from .concurrency import Primitives, fork_safe
from .contract import REQUEST_ID_HEADER, request_id_from
from .errors import NotReady, error_body
from .listen import refuse_new_connections
from .redact import hide_uri_secrets

RETRY_AFTER_S = 5
MESSAGE = ("the service is starting: no worker has its model ready yet (a first start compiles it, about a minute "
           "per worker); try again shortly")
STOPPING_MESSAGE = ("the service is stopping: this server takes no new requests (those in flight are being "
                    "answered); try again shortly, on another replica or once it has restarted")
_HEAD_LIMIT = 16384  # bytes of request head read before answering
_READ_S = 0.5  # a slow or silent client is answered anyway after this long (s)
_TICK_S = 0.05  # how often the thread looks at whether the master is stopping (s)
# s: once stopping, how long a waiting connection is left to the workers (each accepts within a
# millisecond while it still listens; the longest wait seen before one closes its copy is worker.TICK_S)
STOP_DEFER_S = 0.02
FINISH_SETTLE_S = 0.05  # s: after the backlog is emptied, for handshakes under way (one round trip) to end
# Liveness paths (GET and HEAD, as the workers' Flask routes answer them): 200 from the master while starting.
LIVE_PATHS = ("/healthz", "/v2/health/live")
# /healthz's "state" from the master while starting
STARTING_STATE = "starting: no worker has its model ready yet (a first start compiles it, about a minute per worker)"


def page(head_bytes: bytes, request_id: str | None = None) -> bytes | None:
    """The 503 as a small page in the browser's language, reloading itself after ``RETRY_AFTER_S``, for a browser
    opening the page (``GET /`` asking for HTML): the README promises the page, not the API's JSON, there. None
    for any other request. The language as the app picks it (``?lang=``, the ``lang`` cookie, Accept-Language)."""
    from html import escape
    from urllib.parse import parse_qs, urlsplit

    from . import i18n

    lines = head_bytes.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) < 2 or parts[0] not in ("GET", "HEAD") or urlsplit(parts[1]).path != "/":
        return None
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    if "text/html" not in fields.get("accept", ""):
        return None
    arg = (parse_qs(urlsplit(parts[1]).query).get("lang") or [None])[0]
    cookie = next((c.split("=", 1)[1] for c in fields.get("cookie", "").split(";") if c.strip().startswith("lang=")),
                  None)
    wanted = [i18n.normalize(x.split(";")[0]) for x in fields.get("accept-language", "").split(",")]
    lang = i18n.normalize(arg) or i18n.normalize(cookie) or next((x for x in wanted if x), i18n.DEFAULT_LANG)
    t = i18n.strings(lang)
    body = (f'<!doctype html><html lang="{i18n.HTML_LANG[lang]}"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta http-equiv="refresh" content="{RETRY_AFTER_S}"><title>{escape(t["title"])}</title></head>'
            f'<body><main><h1>{escape(t["title"])}</h1><p role="status">'
            f'{escape(t["err_not_ready"].format(n=RETRY_AFTER_S))}</p></main></body></html>').encode()
    head = ["HTTP/1.1 503 Service Unavailable", "Content-Type: text/html; charset=utf-8", f"Content-Length: {len(body)}",
            f"Retry-After: {RETRY_AFTER_S}", "Cache-Control: no-store", "X-Content-Type-Options: nosniff",
            "Content-Security-Policy: default-src 'none'", "Vary: Accept, Accept-Language, Cookie", "Connection: close",
            *([f"{REQUEST_ID_HEADER}: {request_id}"] if request_id else [])]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (b"" if parts[0] == "HEAD" else body)


def response(head: bool = False, path: str | None = None, message: str = MESSAGE,
             request_id: str | None = None) -> bytes:
    """The whole HTTP/1.1 503 answer (``head``: without the body, for a HEAD request; ``path``: the request's,
    for the error's shape: the Open Inference Protocol's under ``/v2``; ``message``: ``MESSAGE`` while
    starting, ``STOPPING_MESSAGE`` while stopping; ``request_id``: echoed in ``X-Request-ID``, as every answer)."""
    body = json.dumps(error_body(path, NotReady.code, message, NotReady.status)).encode()
    return _json_answer("503 Service Unavailable", body, head=head, request_id=request_id,
                        extra=(f"Retry-After: {RETRY_AFTER_S}",))


def live_path(head_bytes: bytes) -> str | None:
    """The liveness path (one of ``LIVE_PATHS``) a ``GET`` or ``HEAD`` request ``head_bytes`` asks for, else None
    (any other method or path, ``/healthz/`` included, is not ready: 503, as before)."""
    from urllib.parse import urlsplit

    parts = head_bytes.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
    if len(parts) != 3 or parts[0] not in ("GET", "HEAD") or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        return None  # HTTP/0.9, HTTP/2.0, garbage: a worker's gunicorn refuses them (400), so no 200 here (tryout20)
    path = urlsplit(parts[1]).path
    return path if path in LIVE_PATHS else None


def live_response(path: str, head: bool = False, request_id: str | None = None) -> bytes:
    """The whole HTTP/1.1 200 answer to a liveness probe while the service starts (no worker ready): the process is
    up and answering. ``/v2/health/live``: the protocol's ``{"live": true}`` (plus ``"ready": false``, ``"status":
    "starting"``); ``/healthz``: ``status`` "starting" (a worker's says "ok"), ``ready`` false, ``state``,
    ``answered_by`` "master"; no ``pid`` (the master is no worker: tools that collect workers by pid skip it)."""
    if path == "/v2/health/live":
        fields = {"live": True, "ready": False, "status": "starting"}
    else:
        fields = {"status": "starting", "ready": False, "state": STARTING_STATE, "answered_by": "master"}
    return _json_answer("200 OK", json.dumps(fields).encode(), head=head, request_id=request_id)


def _json_answer(status: str, body: bytes, *, head: bool, request_id: str | None, extra: tuple = ()) -> bytes:
    lines = [f"HTTP/1.1 {status}", "Content-Type: application/json", f"Content-Length: {len(body)}", *extra,
             "Cache-Control: no-store", "X-Content-Type-Options: nosniff", "Connection: close",
             *([f"{REQUEST_ID_HEADER}: {request_id}"] if request_id else [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head else body)


class Responder:
    """Answers 503 on duplicates of ``listeners`` (sockets) while ``needed()`` or ``stopping()`` is true (200 to a
    liveness probe while only ``needed()``: ``live_response``).

    ``wake_fd`` is read-ready when the workers reported something: ``on_wake()`` then reads it
    (and may change ``needed()``). ``stopping()`` says the master is stopping: the thread answers every
    connection a worker has not taken within ``STOP_DEFER_S`` until the process exits. ``ended()`` says
    gunicorn replaced its listeners: the thread closes its duplicates and ends.
    """

    def __init__(self, listeners: list[socket.socket], *, wake_fd: int, on_wake: Callable[[], None],
                 needed: Callable[[], bool], stopping: Callable[[], bool], ended: Callable[[], bool],
                 on_answer: Callable[[dict], None] | None = None):
        self._socks = []
        for lst in listeners:
            dup = socket.socket(lst.family, lst.type, lst.proto, fileno=os.dup(lst.fileno()))
            dup.setblocking(False)  # already so (gunicorn made it non-blocking; the flag is shared)
            self._socks.append(dup)
        self._wake_fd, self._on_wake, self._needed = wake_fd, on_wake, needed
        self._stopping, self._ended, self._on_answer = stopping, ended, on_answer
        self.answered = 0
        self._lock = Primitives.for_this_process().make_lock()  # one accept-and-answer at a time; held by finish()
        self._finished = False

    def start(self) -> None:
        """Run ``serve`` on its own real OS thread."""
        Primitives.for_this_process().start_thread(self.serve, ())

    def serve(self) -> None:
        """Until gunicorn replaces its listeners (or the process exits): accept and answer while no worker is
        ready or the master is stopping, else only watch the channel."""
        try:
            while not self._ended():
                stopping = self._stopping()
                listening = stopping or self._needed()
                fds = [self._wake_fd] + ([s.fileno() for s in self._socks] if listening else [])
                try:
                    readable, _, _ = select.select(fds, [], [], _TICK_S)
                except (OSError, ValueError):  # the wake pipe closed under us: the master is going away
                    return
                if self._finished:
                    return
                if self._wake_fd in readable:
                    self._on_wake()
                if stopping and len(readable) > (self._wake_fd in readable):
                    time.sleep(STOP_DEFER_S)  # a worker still listening takes it and serves it
                with self._lock:
                    if self._finished:
                        return
                    for s in self._socks:
                        if s.fileno() in readable and not self._ended():
                            if stopping:
                                self._answer_one(s, STOPPING_MESSAGE)
                            elif self._needed() and not self._stopping():
                                self._answer_one(s, MESSAGE)
        finally:
            with self._lock:
                self._close()

    def finish(self, within_s: float = 1.0) -> int:
        """In the master, its workers gone (gunicorn's ``on_exit``): refuse new connections, answer every one
        waiting in the backlog 503 (stopping), for at most ``within_s`` s, then close the duplicates: the port
        refuses from now on. Returns how many it answered. The thread takes no connection after this."""
        answered = 0
        with self._lock:
            self._finished = True
            for s in self._socks:  # new connections dropped, those begun still queued: closing resets none
                if not refuse_new_connections(s):
                    with contextlib.suppress(OSError):
                        s.listen(0)  # elsewhere: at most one queued (Linux's rule), new handshakes dropped
            deadline = time.monotonic() + within_s
            for settle in (FINISH_SETTLE_S, 0):  # again once a handshake under way has had a round trip to end
                for s in self._socks:
                    while time.monotonic() < deadline and self._answer_one(s, STOPPING_MESSAGE):
                        answered += 1
                time.sleep(min(settle, max(0.0, deadline - time.monotonic())))
            self._close()
        return answered

    def _answer_one(self, listener: socket.socket, message: str) -> bool:
        """Accept one connection (never blocks) and answer it 503 with ``message`` (while starting, a liveness probe
        200: ``live_response``); False if none waited."""
        try:
            conn, peer = listener.accept()
        except OSError:  # BlockingIOError: a worker took it first; anything else: nothing to answer
            return False
        start, record = time.perf_counter(), None
        try:
            conn.settimeout(_READ_S)
            head = _read_head(conn)
            line = head.split(b"\r\n", 1)[0].decode("latin-1")[:1024]
            target = line.split(" ")
            path = target[1] if len(target) > 1 else None
            rid = request_id_from(_header(head, b"x-request-id"))
            starting, is_head = message == MESSAGE, head.startswith(b"HEAD ")
            live = live_path(head) if starting else None  # stopping: 503 for liveness too (the process is going)
            html = page(head, rid) if starting else None  # starting: a browser gets the page (stopping: JSON)
            answer = (live_response(live, head=is_head, request_id=rid) if live else
                      html or response(head=is_head, path=path, message=message, request_id=rid))
            conn.sendall(answer)
            self.answered += 1
            record = {"request_id": rid, "request_line": line, "method": target[0] if line else "",
                      "path": (path or "").split("?", 1)[0], "query": (path or "").partition("?")[2],
                      "status": 200 if live else 503, "code": "" if live else NotReady.code,
                      "bytes": len(answer) - answer.index(b"\r\n\r\n") - 4,
                      "remote_addr": peer[0] if isinstance(peer, tuple) else str(peer),
                      "forwarded_for": _header(head, b"x-forwarded-for", limit=None),
                      "user_agent": _header(head, b"user-agent")}
            conn.shutdown(socket.SHUT_WR)  # FIN now, even though forked workers may hold a copy
            _discard(conn)  # unread bytes at close would turn into a reset that can eat our answer
        except OSError:
            pass
        finally:
            conn.close()
        if record is not None and self._on_answer is not None:
            try:  # logged and counted as the workers' answers are; never at the cost of answering
                self._on_answer({**record, "duration_ms": round((time.perf_counter() - start) * 1e3, 2)})
            except Exception:
                pass
        return True

    def _close(self) -> None:
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
        self._socks = []

    def close_in_child(self) -> None:
        """In a freshly forked worker: drop the inherited duplicates (the thread does not exist there).

        A worker holding them would keep the port accepting into the backlog after the master closed it.
        """
        for s in self._socks:
            try:
                os.close(s.detach())
            except OSError:
                pass
        self._socks = []


def _header(head: bytes, name: bytes, *, limit: int | None = 512) -> str | None:
    """The value of header ``name`` (lower case) in a request ``head``, or None: repeated lines joined with ``,``
    as gunicorn joins them for the workers; its first ``limit`` characters (None: all, the head being bounded).

    ``X-Forwarded-For`` is read whole: a proxy may add its own line after the client's (HAProxy's ``option
    forwardfor``), and the addresses the proxies vouch for are at its right end, a client's own text at its left
    (its first line alone, or its first 512 characters, let a client choose the address the master logged)."""
    values = [value.strip() for key, _, value in (raw.partition(b":") for raw in head.split(b"\r\n")[1:])
              if key.strip().lower() == name]
    if not values:
        return None
    text = b",".join(values).decode("latin-1")
    return text if limit is None else text[:limit]


def _read_head(conn: socket.socket) -> bytes:
    """Read the request head (up to ``_HEAD_LIMIT`` bytes, ``_READ_S`` s); what arrived, maybe nothing."""
    data = b""
    deadline = time.monotonic() + _READ_S
    while b"\r\n\r\n" not in data and len(data) < _HEAD_LIMIT and (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except (TimeoutError, OSError):
            break
        if not chunk:
            break
        data += chunk
    return data


def _discard(conn: socket.socket, limit: int = 1 << 20, wait_s: float = 0.2) -> None:
    """Read and drop what the client still sends (a body), up to ``limit`` bytes or ``wait_s`` s."""
    deadline = time.monotonic() + wait_s
    while limit > 0 and (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except (TimeoutError, OSError):
            return
        if not chunk:
            return
        limit -= len(chunk)


def client_address(peer: str | None, forwarded_for: str | None, trusted: int) -> str | None:
    """The client's address as the workers log it behind ``trusted`` proxies (``TRUSTED_PROXIES``; Werkzeug's
    ``ProxyFix(x_for=trusted)`` rule): the ``trusted``-th address from the right of ``X-Forwarded-For``, each
    proxy having appended the address it heard from; the connection's ``peer`` where there are fewer, or none.
    The header is split by Werkzeug's own ``parse_list_header``, as ProxyFix splits it (empty parts dropped,
    quoted commas kept), so that both name the same address for any header."""
    if trusted <= 0 or not forwarded_for:
        return peer
    from werkzeug.http import parse_list_header  # (the master's answers only; Flask's, not this module's, import)

    values = parse_list_header(forwarded_for)
    return values[-trusted] if len(values) >= trusted else peer


def master_answers(gunicorn_log, settings) -> Callable[[dict], None]:
    """For the master's own answers, its 503s and its liveness 200s while starting (``Responder``'s
    ``on_answer``; ``code`` empty for a 200, as a worker's): each answer's access log line (in
    gunicorn's text format on ``gunicorn_log.access_log``, or ``ACCESS_LOG=json``'s object, "answered_by":
    "master") and its count in /metrics (endpoint "(master)"), as the workers write theirs. Without them, the
    503s of a start, a stop or a crash were in no log and no metric. The answer is a dict from the responder:
    remote_addr, forwarded_for, request_line, method, path, query, user_agent, status, code, bytes, duration_ms
    (ms), request_id; the address logged is the client's behind ``TRUSTED_PROXIES`` (``client_address``)."""
    made: dict = {}
    fork_guard = fork_safe(Primitives.for_this_process().make_lock())

    def answered(rec: dict) -> None:
        rec = {**rec, "remote_addr": client_address(rec.get("remote_addr"), rec.get("forwarded_for"),
                                                    settings.TRUSTED_PROXIES)}
        # All under fork_guard: locks taken in here (prometheus_client's module lock, the import system's module
        # locks) must not be held by this thread as the master forks a worker, which would wait on them for ever.
        with fork_guard:
            if settings.ACCESS_LOG == "text":
                gunicorn_log.access_log.info('%s %s "%s" %s %s %dms %s', rec["remote_addr"],
                                             time.strftime("[%d/%b/%Y:%H:%M:%S %z]"), hide_uri_secrets(rec["request_line"]),
                                             rec["status"], rec["bytes"], rec["duration_ms"], rec["request_id"])
            elif settings.ACCESS_LOG == "json":
                from .logs import access_fields, configure_access_logger  # (Flask: not at this module's import)

                if "log" not in made:
                    made["log"] = configure_access_logger()
                fields = access_fields(**{k: rec[k] for k in ("request_id", "method", "path", "status", "duration_ms",
                                                              "remote_addr", "query", "user_agent")},
                                       size=rec["bytes"]) | {"answered_by": "master"}
                made["log"].info(json.dumps({k: v for k, v in fields.items() if v is not None}, separators=(",", ":")))
            if settings.METRICS and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                from .metrics import MASTER_ENDPOINT, http_metrics, method_label  # (picks its mode at first import)

                if "metrics" not in made:  # once: each Counter made holds its values for the life of the process
                    from prometheus_client import CollectorRegistry

                    made["metrics"] = http_metrics(CollectorRegistry())
                requests, latency = made["metrics"]
                labels = (MASTER_ENDPOINT, method_label(rec["method"]), str(rec["status"]))
                requests.labels(*labels, rec["code"]).inc()
                latency.labels(*labels).observe(rec["duration_ms"] / 1e3)
    return answered
