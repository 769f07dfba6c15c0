"""The port answers while no worker can: 503 ``not_ready`` from gunicorn's master until a worker is ready.

A gevent worker accepts connections only once its model is built, compiled, warmed up and
self-tested (a minute on a cold cache). Until then a request would wait in the listen backlog
with no answer, and a load balancer could not tell a server that is starting from one that is
dead. So, while no worker has reported ready (``webapp.lifecycle``'s channel), one plain thread in
the master accepts on the listening sockets and answers every request, ``/readyz`` and
``/healthz`` included, ``503`` with the error table's JSON body (``not_ready``) and ``Retry-After``.
Once a worker reports ready it stops accepting (the workers take every connection from then on);
should every ready worker exit, it answers again until a replacement is ready.

It runs in the master, which gevent never patches: a plain OS thread (from ``webapp.concurrency``),
``select`` and blocking sockets with short timeouts. It imports neither torch nor Flask. It works on
duplicates of gunicorn's listening sockets, so gunicorn closing its own (a stop) never leaves it
selecting on a closed or reused descriptor; it closes them as soon as the master stops, and each
worker closes its inherited copies right after fork.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from typing import Callable

from .errors import NotReady, error_body

RETRY_AFTER_S = 5
MESSAGE = ("the service is starting: no worker has its model ready yet (a first start compiles it, about a minute "
           "per worker); try again shortly")
_HEAD_LIMIT = 16384  # bytes of request head read before answering
_READ_S = 0.5  # a slow or silent client is answered anyway after this long (s)
_TICK_S = 0.25  # how often the thread looks at whether the master is stopping (s)


def response(head: bool = False, path: str | None = None) -> bytes:
    """The whole HTTP/1.1 503 answer (``head``: without the body, for a HEAD request; ``path``: the request's,
    for the error's shape: the Open Inference Protocol's under ``/v2``)."""
    body = json.dumps(error_body(path, NotReady.code, MESSAGE, NotReady.status)).encode()
    lines = ["HTTP/1.1 503 Service Unavailable", "Content-Type: application/json",
             f"Content-Length: {len(body)}", f"Retry-After: {RETRY_AFTER_S}", "Cache-Control: no-store",
             "X-Content-Type-Options: nosniff", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head else body)


class Responder:
    """Answers 503 on duplicates of ``listeners`` (sockets) while ``needed()`` is true.

    ``wake_fd`` is read-ready when the workers reported something: ``on_wake()`` then reads it
    (and may change ``needed()``). ``stopped()`` says the master is stopping: the thread closes its
    sockets and ends.
    """

    def __init__(self, listeners: list[socket.socket], *, wake_fd: int, on_wake: Callable[[], None],
                 needed: Callable[[], bool], stopped: Callable[[], bool]):
        self._socks = []
        for lst in listeners:
            dup = socket.socket(lst.family, lst.type, lst.proto, fileno=os.dup(lst.fileno()))
            dup.setblocking(False)  # already so (gunicorn made it non-blocking; the flag is shared)
            self._socks.append(dup)
        self._wake_fd, self._on_wake, self._needed, self._stopped = wake_fd, on_wake, needed, stopped
        self.answered = 0

    def start(self) -> None:
        """Run ``serve`` on its own real OS thread."""
        from .concurrency import Primitives

        Primitives.for_this_process().start_thread(self.serve, ())

    def serve(self) -> None:
        """Until the master stops: accept and answer while no worker is ready, else only watch the channel."""
        try:
            while not self._stopped():
                listening = self._needed()
                fds = [self._wake_fd] + ([s.fileno() for s in self._socks] if listening else [])
                try:
                    readable, _, _ = select.select(fds, [], [], _TICK_S)
                except (OSError, ValueError):  # closed under us: the master is going away
                    return
                if self._wake_fd in readable:
                    self._on_wake()
                for s in self._socks:
                    if s.fileno() in readable and self._needed() and not self._stopped():
                        self._answer_one(s)
        finally:
            self._close()

    def _answer_one(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:  # BlockingIOError: a worker took it first; anything else: nothing to answer
            return
        try:
            conn.settimeout(_READ_S)
            head = _read_head(conn)
            target = head.split(b"\r\n", 1)[0].split(b" ")
            path = target[1].decode("latin-1") if len(target) > 1 else None
            conn.sendall(response(head=head.startswith(b"HEAD "), path=path))
            self.answered += 1
            conn.shutdown(socket.SHUT_WR)  # FIN now, even though forked workers may hold a copy
            _discard(conn)  # unread bytes at close would turn into a reset that can eat our answer
        except OSError:
            pass
        finally:
            conn.close()

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


def _read_head(conn: socket.socket) -> bytes:
    """Read the request head (up to ``_HEAD_LIMIT`` bytes, ``_READ_S`` s); what arrived, maybe nothing."""
    data = b""
    deadline = time.monotonic() + _READ_S
    while b"\r\n\r\n" not in data and len(data) < _HEAD_LIMIT:
        left = deadline - time.monotonic()
        if left <= 0:
            break
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
    while limit > 0:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except (TimeoutError, OSError):
            return
        if not chunk:
            return
        limit -= len(chunk)
