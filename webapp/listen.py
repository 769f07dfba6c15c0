"""Can gunicorn listen on its addresses, and what ``CLASSIFIER_BIND`` may say (``parse_bind``, the settings table's
parser)? Checked in ``on_starting``, before the master imports torch.

A busy or impossible address (in use, a port below 1024 without root, a host this machine is not, a unix socket
path in a missing folder or held by a live server) is one line naming it and why, and exit status 5
(``lifecycle.EXIT_LISTEN``), not gunicorn's five retries a second apart and exit 1. An address in use is tried
``LISTEN_ATTEMPTS`` times, ``LISTEN_PAUSE_S`` apart: a server that is just stopping may hold it a moment longer.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import stat
import time
from typing import Callable

LISTEN_ATTEMPTS, LISTEN_PAUSE_S = 4, 0.5


def _why(exc: OSError, address) -> str:
    """Why ``address`` cannot be bound, in words; a unix socket's reason is ``_probe``'s own (its EACCES is a
    folder it cannot write in: "ports below 1024 need root" misled there, tryout26)."""
    if not isinstance(address, tuple):
        return exc.strerror or str(exc)
    reasons = {errno.EADDRINUSE: "the address is in use (another server listens there)",
               errno.EACCES: "permission denied (ports below 1024 need root)",
               errno.EADDRNOTAVAIL: "no such address on this host"}
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror})"
    return reasons.get(exc.errno, exc.strerror or str(exc))


def _probe(address) -> None:
    """Bind ``address`` (gunicorn's form: ``(host, port)`` or a unix path) as gunicorn will, then let go.

    :raises OSError: why it cannot be bound.
    """
    if isinstance(address, tuple):
        host, port = address
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(info[0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn: a TIME_WAIT port is free
            s.bind(info[4])
        return
    path = address
    if path.startswith("\0"):
        return
    # sun_path's 108 bytes end with a NUL (unix(7)): a longer path was gunicorn's 5 retries and exit 1 (tryout26)
    if (size := len(os.fsencode(path))) >= 108:
        raise OSError(errno.ENAMETOOLONG, f"a unix socket path holds at most 107 bytes, this one {size}")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise OSError(errno.ENOENT, f"no folder {directory}") from None
        if not os.access(directory, os.W_OK):
            raise OSError(errno.EACCES, f"cannot write in {directory}") from None
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # gunicorn would remove it: is it live?
        try:
            s.connect(path)
        except OSError:
            return  # a stale socket file: gunicorn replaces it
    raise OSError(errno.EADDRINUSE, "in use")


def show(address) -> str:
    """``address`` as people write it: ``127.0.0.1:8000``, ``[::1]:8000``, ``unix:/run/x.sock``."""
    if isinstance(address, tuple):
        host, port = address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"fd://{address}" if isinstance(address, int) else f"unix:{address}"


def check_listen(addresses, *, sleep: Callable[[float], None] = time.sleep) -> str | None:
    """Whether gunicorn will be able to listen on every address of ``addresses`` (``cfg.address``).

    Returns None, or one line saying which address cannot be used and why. An address in use is
    tried ``LISTEN_ATTEMPTS`` times, ``LISTEN_PAUSE_S`` apart (a server stopping just now).
    Inherited sockets (``fd://``, systemd, a USR2 re-exec) are not checked: they are bound already.
    """
    if os.environ.get("GUNICORN_FD") or os.environ.get("LISTEN_FDS"):
        return None
    for address in addresses:
        if isinstance(address, int):
            continue
        for attempt in range(LISTEN_ATTEMPTS):
            try:
                _probe(address)
                break
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE and attempt + 1 < LISTEN_ATTEMPTS:
                    sleep(LISTEN_PAUSE_S)
                    continue
                return (f"cannot listen on {show(address)}: {_why(exc, address)}; choose another address with "
                        f"CLASSIFIER_BIND (or gunicorn's -b)")
    return None


# -- CLASSIFIER_BIND --------------------------------------------------------------------------------------------
BIND_RULE = ("a port (8000: 127.0.0.1:8000), HOST:PORT (0.0.0.0:8000), [IPv6]:PORT ([::1]:8000) or unix:PATH "
             "(port 1 to 65535)")


def parse_bind(text: str) -> str:
    """A listening address in gunicorn's forms; a bare port means ``127.0.0.1:PORT`` (localhost unless opened).

    gunicorn itself reads a bare ``8010`` as the host ``8010`` on port 8000 and retries binding it.
    """
    value = str(text).strip()

    def port_of(digits: str) -> str:  # ASCII digits: int() reads any script's ("٨٦٠١" listened on 8601: tryout26)
        if not (digits.isascii() and digits.isdigit()) or not 0 < int(digits) < 65536:
            raise ValueError(f"{digits!r} is not a port")
        return str(int(digits))

    if value.isascii() and value.isdigit():
        return f"127.0.0.1:{port_of(value)}"
    if value.startswith("unix:"):
        if not value[5:].strip():
            raise ValueError("unix: needs a path")
        return value
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
        if not sep:
            raise ValueError("no port after the ]")
        return f"[{host}]:{port_of(port)}"
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError("no port" if not sep else "no host before the :")
    if ":" in host:
        raise ValueError("an IPv6 address goes in brackets")
    if not all(part and part.replace("-", "").isalnum() for part in host.split(".")):
        raise ValueError(f"{host!r} is not a host name or address")
    return f"{host}:{port_of(port)}"


# Classic BPF (linux/filter.h: code, jt, jf, k) for a TCP listening socket, whose programs see a segment from its TCP
# header: drop a segment whose flags say SYN without ACK (a new connection), keep every other (a handshake already
# under way completing with its ACK). Read elsewhere (e.g. from the IP header) it keeps everything: harmless.
_NEW_HANDSHAKES_DROPPED = ((0x30, 0, 0, 13),  # ldb [13]: the TCP flags byte
                           (0x54, 0, 0, 0x12),  # and #0x12: SYN and ACK
                           (0x15, 0, 1, 0x02),  # jeq #0x02 (SYN alone): next, else skip one
                           (0x06, 0, 0, 0),  # ret #0: drop
                           (0x06, 0, 0, 0xFFFFFFFF))  # ret #-1: keep
_SO_ATTACH_FILTER = 26  # asm-generic/socket.h


def refuse_new_connections(sock: socket.socket) -> bool:
    """Make the kernel drop new connections to the listening TCP socket ``sock`` (their SYNs) while it keeps
    completing those already begun into its backlog, so that the backlog can be emptied and the socket then closed
    without resetting a connection whose request was sent: closing a listening socket resets every connection
    waiting in its backlog. A client whose SYN was dropped sends it again (TCP: after 1 s) and, the port closed by
    then, is refused, its request unsent. Linux only (a socket filter); True if attached, else False (other systems,
    a unix socket: the caller then empties the backlog as it can)."""
    import ctypes
    import struct
    import sys

    if not sys.platform.startswith("linux") or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    program = b"".join(struct.pack("HBBI", *insn) for insn in _NEW_HANDSHAKES_DROPPED)
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HL", len(_NEW_HANDSHAKES_DROPPED), ctypes.addressof(buf))  # struct sock_fprog
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
    except OSError:
        return False
    return True
