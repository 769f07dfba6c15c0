"""bench/load.py: the load generator's clients behave as real ones do on a kept-alive connection."""

from __future__ import annotations

import http.client
import json
import socket
import threading

from bench.load import _post


def _serve(listener: socket.socket, answers: int) -> None:
    """Answer ``answers`` requests, each on its own connection: 200, kept alive, then closed by the server
    (as gunicorn does after its ``keepalive`` idle seconds)."""
    body = json.dumps({"results": [{"batch_size": 1}], "timing_ms": {"total": 1.0}}).encode()
    for _ in range(answers):
        conn, _ = listener.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, rest = data.split(b"\r\n\r\n", 1)
        length = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
        while len(rest) < length:
            rest += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        conn.close()


def test_a_connection_the_server_closed_is_retried_once_and_not_counted_as_an_error():
    listener = socket.create_server(("127.0.0.1", 0))
    t = threading.Thread(target=_serve, args=(listener, 2), daemon=True)
    t.start()
    conn = http.client.HTTPConnection("127.0.0.1", listener.getsockname()[1], timeout=10)
    errs: dict = {}
    headers = {"Content-Type": "application/octet-stream", "Content-Length": "5"}
    assert _post(conn, "/x", b"hello", headers, errs, threading.Lock())[0] == 200
    t_closed = threading.Event()
    threading.Timer(0.2, t_closed.set).start()
    t_closed.wait()  # the server has closed the kept-alive connection by now
    status, batch, timing = _post(conn, "/x", b"hello", headers, errs, threading.Lock())
    assert (status, batch, timing) == (200, 1, {"total": 1.0}) and errs == {"retried_stale_keepalive": 1}
    t.join(10)
    listener.close()
