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
