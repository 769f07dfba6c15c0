"""webapp/listen.py: whether gunicorn can listen on its addresses, said in one line before it tries."""

from __future__ import annotations

import socket

from webapp import listen

from serving import free_port


def test_check_listen_names_a_busy_address_and_passes_a_free_one():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        slept = []
        problem = listen.check_listen([("127.0.0.1", port)], sleep=slept.append)
    assert problem.startswith(f"cannot listen on 127.0.0.1:{port}: the address is in use")
    assert slept == [listen.LISTEN_PAUSE_S] * (listen.LISTEN_ATTEMPTS - 1)  # a stopping server gets a moment
    assert listen.check_listen([("127.0.0.1", free_port())]) is None


def test_check_listen_on_unix_sockets(tmp_path):
    assert listen.check_listen([str(tmp_path / "new.sock")]) is None
    assert "no folder" in listen.check_listen([str(tmp_path / "missing" / "x.sock")])
    (tmp_path / "file").write_text("x")
    assert "is not a socket" in listen.check_listen([str(tmp_path / "file")])
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(tmp_path / "live.sock"))
        live.listen()
        assert "in use" in listen.check_listen([str(tmp_path / "live.sock")], sleep=lambda s: None)
    # the same file, nobody listening any more: a stale socket gunicorn replaces
    assert listen.check_listen([str(tmp_path / "live.sock")]) is None
    # a path too long for sun_path was gunicorn's 5 retries and exit 1 (tryout26); 107 bytes still fit
    deep = tmp_path / ("d" * (107 - len(str(tmp_path)) - len("//x.sock")))
    deep.mkdir()
    assert len(str(deep / "x.sock")) == 107 and listen.check_listen([str(deep / "x.sock")]) is None
    said = listen.check_listen([str(deep / "xy.sock")])
    assert said.startswith(f"cannot listen on unix:{deep / 'xy.sock'}: a unix socket path holds at most 107 bytes, "
                           "this one 108;"), said


def test_a_unix_socket_in_a_folder_it_cannot_write_is_not_said_to_be_a_port(tmp_path, monkeypatch):
    """"permission denied (ports below 1024 need root)" was said for a socket in a read-only folder (tryout26)."""
    monkeypatch.setattr(listen.os, "access", lambda path, mode: False)  # the tests run as root, who writes anywhere
    said = listen.check_listen([str(tmp_path / "x.sock")])
    assert said.startswith(f"cannot listen on unix:{tmp_path / 'x.sock'}: cannot write in {tmp_path};") and \
        "1024" not in said, said


def test_refuse_new_connections_drops_new_ones_and_keeps_those_queued():
    """The filter ``Responder.finish`` attaches before it empties the backlog (Linux): a connection queued before is
    still accepted and read; a new one is not taken (its SYN dropped: the client's connect waits), and once the
    socket closes it is refused. That the program reads the TCP flags (and not, say, the IP header, where it would
    keep everything) shows in the dropped SYN."""
    import sys
    import time

    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip("a Linux socket filter")
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(16)
        port = lst.getsockname()[1]
        queued = socket.create_connection(("127.0.0.1", port), timeout=2)
        assert listen.refuse_new_connections(lst)
        started = time.monotonic()
        with pytest.raises((TimeoutError, socket.timeout)):
            socket.create_connection(("127.0.0.1", port), timeout=0.3)
        assert time.monotonic() - started >= 0.25  # waited for an answer that never came: dropped, not refused
        conn, _ = lst.accept()
        queued.sendall(b"still here")
        with conn:
            assert conn.recv(100) == b"still here"
        queued.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_refuse_new_connections_is_false_where_it_cannot_apply(tmp_path):
    with socket.socket(socket.AF_UNIX) as lst:
        lst.bind(str(tmp_path / "s"))
        lst.listen()
        assert listen.refuse_new_connections(lst) is False
