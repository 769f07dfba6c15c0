"""systemd's readiness protocol (sd_notify(3), ``Type=notify`` in deploy/photo-classifier.service) for gunicorn's
master: ``READY=1`` once a worker serves, not as the master boots.

gunicorn sends ``READY=1`` itself as soon as its master has booted, a minute before a cold start can answer: so
``systemctl start`` returned, and the unit showed active, while every request got ``503 not_ready``. So the socket
is taken from the environment at the first read of ``gunicorn.conf.py`` (gunicorn then sends nothing; no worker
inherits it), and the master sends ``READY=1`` when the start-up channel (``webapp/lifecycle.py``) reports the first
ready worker. Torch- and Flask-free, for the master.
"""

from __future__ import annotations

import os
import socket

_notify_socket: str | None = None


def take_notify_socket() -> None:
    """At the first read of ``gunicorn.conf.py``: keep systemd's ``NOTIFY_SOCKET`` (``Type=notify``) for
    ``notify_systemd`` and take it out of the environment, so gunicorn does not send ``READY=1`` as its master
    boots (a minute before a cold start serves: ``systemctl start`` returned, and the unit showed active, while
    every request got 503) and no worker inherits it."""
    global _notify_socket
    _notify_socket = os.environ.pop("NOTIFY_SOCKET", None) or _notify_socket


def notify_systemd(state: str) -> bool:
    """Send ``state`` (``READY=1``, ``STATUS=...``, newline-separated) to systemd's notify socket (sd_notify(3)'s
    datagram); False where there is none (not under systemd's ``Type=notify``) or it cannot be reached."""
    if not _notify_socket:
        return False
    address = "\0" + _notify_socket[1:] if _notify_socket.startswith("@") else _notify_socket  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError:
        return False


def tell_stops(server) -> None:
    """In the master (``when_ready``): ``STOPPING=1`` to systemd as a stop begins (gunicorn's ``Arbiter.stop``, which
    SIGTERM, SIGINT and SIGQUIT reach), before the workers finish their requests in flight (up to graceful_timeout):
    ``systemctl status`` says the unit is stopping, also for a stop systemd did not ask for (``kill``, a failed
    start); only ``READY=1`` was sent (found in tryout26, left then). Not ``RELOADING=1``: systemd would then wait for
    a ``READY=1`` each reload."""
    stop = server.stop

    def stopping(graceful: bool = True) -> None:
        notify_systemd("STOPPING=1\nSTATUS=stopping: finishing the requests in flight")
        stop(graceful)

    server.stop = stopping
