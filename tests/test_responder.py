"""The master's 503 responder (webapp/responder.py) on a plain listening socket, without gunicorn.

The same over a real gunicorn cold start is ``tests/test_lifecycle.py::test_cold_start_answers_503_until_a_worker_serves``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import time

import pytest

from webapp.responder import LIVE_PATHS, RETRY_AFTER_S, STARTING_STATE, STOPPING_MESSAGE, Responder


@pytest.fixture
def listening():
    """A non-blocking listening socket on a free port (as gunicorn leaves its listeners), and the port."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    yield sock, sock.getsockname()[1]
    sock.close()


def ask(port: int, method: str = "GET", path: str = "/readyz", body: bytes | None = None, timeout: float = 2.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_answers_503_while_needed_then_steps_aside(listening):
    sock, port = listening
    state = {"needed": True, "ended": False, "woken": 0}
    r, w = os.pipe()

    def wake():
        os.read(r, 100)
        state["woken"] += 1

    responder = Responder([sock], wake_fd=r, on_wake=wake, needed=lambda: state["needed"],
                          stopping=lambda: False, ended=lambda: state["ended"])
    responder.start()
    try:
        for method, path in [("GET", "/readyz"), ("GET", "/"), ("POST", "/api/v1/predict"), ("POST", "/healthz"),
                             ("GET", "/healthz/")]:
            t0 = time.monotonic()
            status, headers, body = ask(port, method, path, body=b"x" * 100_000 if method == "POST" else None)
            assert time.monotonic() - t0 < 1.0
            assert status == 503 and headers["Retry-After"] == str(RETRY_AFTER_S)
            assert headers["Content-Type"] == "application/json"
            error = json.loads(body)["error"]
            assert error["code"] == "not_ready" and error["status"] == 503 and "starting" in error["message"]
        # Under /v2, the Open Inference Protocol's shape: its clients read "error" as a string.
        for method, path in [("GET", "/v2/health/ready"), ("POST", "/v2/models/classifier/infer")]:
            status, headers, body = ask(port, method, path, body=b"{}" if method == "POST" else None)
            error = json.loads(body)["error"]
            assert status == 503 and isinstance(error, str) and error.startswith("not_ready: the service is starting")
        status, headers, body = ask(port, "HEAD")
        assert status == 503 and body == b"" and int(headers["Content-Length"]) > 0

        # A silent client is answered anyway, after half a second, and holds nobody else up.
        with socket.create_connection(("127.0.0.1", port)) as silent:
            t0 = time.monotonic()
            assert ask(port)[0] == 503
            silent.settimeout(2)
            assert silent.recv(100).startswith(b"HTTP/1.1 503")
            assert time.monotonic() - t0 < 1.5

        # A worker reported ready: the report wakes it, and it no longer takes connections.
        state["needed"] = False
        os.write(w, b"ready 1\n")
        deadline = time.monotonic() + 2
        while not state["woken"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        answered = responder.answered
        with pytest.raises((TimeoutError, socket.timeout)):
            ask(port, timeout=1.0)  # accepted by the kernel, answered by nobody (no worker in this test)
        assert responder.answered == answered
    finally:
        state["ended"] = True
        time.sleep(0.5)
        os.close(r)
        os.close(w)
    assert responder._socks == []  # its duplicates are closed once gunicorn replaced its listeners


def test_while_starting_liveness_is_200_and_readiness_503(listening):
    """Found by a tryout with tritonclient: the master answered /v2/health/live and /healthz 503 while starting, so
    ``is_server_live()`` was False and a liveness probe restarted the container during a cold compile. Live: the
    process is up and answering (200, "starting"); ready: it can serve (503 not_ready, Retry-After). Logged and
    counted as the 503s are (``on_answer``). Stopping: liveness is 503 too."""
    sock, port = listening
    state, seen = {"stopping": False}, []
    with running(sock, needed=lambda: True, stopping=lambda: state["stopping"], on_answer=seen.append):
        status, headers, body = ask(port, "GET", "/healthz?verbose=1")
        assert status == 200 and "Retry-After" not in headers and headers["Content-Type"] == "application/json"
        health = json.loads(body)
        assert health == {"status": "starting", "ready": False, "state": STARTING_STATE, "answered_by": "master"}
        status, headers, body = ask(port, "GET", "/v2/health/live")
        assert status == 200 and json.loads(body) == {"live": True, "ready": False, "status": "starting"}
        for path in LIVE_PATHS:
            status, headers, body = ask(port, "HEAD", path)
            assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
        for method, path in [("GET", "/readyz"), ("GET", "/v2/health/ready"), ("GET", "/v2/models/classifier/ready"),
                             ("POST", "/api/v1/predict"), ("POST", "/v2/models/classifier/infer")]:
            status, headers, body = ask(port, method, path, body=b"{}" if method == "POST" else None)
            assert status == 503 and headers["Retry-After"] == str(RETRY_AFTER_S), (path, body)
        assert [(a["method"], a["path"], a["status"], a["code"]) for a in seen[:4]] == [
            ("GET", "/healthz", 200, ""), ("GET", "/v2/health/live", 200, ""), ("HEAD", "/healthz", 200, ""),
            ("HEAD", "/v2/health/live", 200, "")]
        assert seen[0]["query"] == "verbose=1" and {a["code"] for a in seen[4:]} == {"not_ready"}
        for line in (b"GET /healthz\r\n\r\n", b"GET /healthz HTTP/2.0\r\n\r\n", b"GARBAGE\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # what gunicorn refuses (400)
                raw.sendall(line)  # gets no 200 from the master (tryout20: HTTP/0.9 and 2.0 were "live")
                assert raw.recv(100).startswith(b"HTTP/1.1 503 "), line
        state["stopping"] = True  # the master is going away: live no more
        for path in LIVE_PATHS:
            status, headers, body = ask(port, "GET", path)
            assert status == 503 and "stopping" in body.decode(), (path, body)


def test_tritonclient_sees_the_starting_server_live_and_not_ready(listening):
    """The real client: ``is_server_live()`` True, ``is_server_ready()`` and ``is_model_ready()`` False."""
    import tritonclient.http as httpclient

    sock, port = listening
    with running(sock, needed=lambda: True, stopping=lambda: False):
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=5, network_timeout=5)
        try:
            assert client.is_server_live() is True
            assert client.is_server_ready() is False
            assert client.is_model_ready("classifier") is False
            assert client.is_server_live() is True
        finally:
            client.close()


@contextlib.contextmanager
def running(sock, **kwargs):
    """A started ``Responder`` on ``sock`` (``kwargs``: its ``needed``, ``stopping``, ``on_answer``...), finished
    and its wake pipe closed on the way out."""
    r, w = os.pipe()
    responder = Responder([sock], wake_fd=r, on_wake=lambda: os.read(r, 100), ended=lambda: False, **kwargs)
    responder.start()
    try:
        yield responder
    finally:
        responder.finish()
        time.sleep(2 * 0.05)
        os.close(r)
        os.close(w)


def test_answers_again_when_no_worker_is_ready(listening):
    sock, port = listening
    state = {"needed": False, "ended": False}
    r, w = os.pipe()
    responder = Responder([sock], wake_fd=r, on_wake=lambda: os.read(r, 100), needed=lambda: state["needed"],
                          stopping=lambda: False, ended=lambda: state["ended"])
    responder.start()
    try:
        state["needed"] = True  # every ready worker exited (the master's child_exit dropped them)
        time.sleep(0.5)  # it looks again at least every quarter second
        assert ask(port)[0] == 503
        # The process is up and a replacement starting (gunicorn forks it; one that cannot start, with none
        # serving, stops the server: webapp/reloads.py): live, as during the first start.
        status, _, body = ask(port, path="/healthz")
        assert status == 200 and json.loads(body)["status"] == "starting"
    finally:
        state["ended"] = True
        time.sleep(0.5)
        os.close(r)
        os.close(w)


def test_while_stopping_answers_every_connection_then_finish_closes_the_port(listening):
    """A stopping master: the workers have closed their copies of the listening socket, the master's
    duplicate still holds it open, so the kernel keeps accepting. Each such connection gets 503 (stopping),
    never a reset; ``finish`` (gunicorn's ``on_exit``) answers what waits and closes: then refused."""
    sock, port = listening
    r, w = os.pipe()
    responder = Responder([sock], wake_fd=r, on_wake=lambda: os.read(r, 100), needed=lambda: False,
                          stopping=lambda: True, ended=lambda: False)
    sock.close()  # gunicorn's stop closes its own listener first: only the duplicate is left
    responder.start()
    try:
        for method, path in [("GET", "/readyz"), ("POST", "/api/v1/predict"), ("POST", "/v2/models/classifier/infer")]:
            status, headers, body = ask(port, method, path, body=b"x" * 10_000 if method == "POST" else None)
            assert status == 503 and headers["Retry-After"] == str(RETRY_AFTER_S), body
            error = json.loads(body)["error"]
            message = error if path.startswith("/v2") else error["message"]
            assert "stopping" in message and STOPPING_MESSAGE in message
            assert (error if path.startswith("/v2") else error["code"]).startswith("not_ready")
        # Connections already in the backlog when on_exit comes are answered, not reset, by finish().
        waiting = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        for c in waiting:
            c.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        responder.finish()
        for c in waiting:
            c.settimeout(2)
            assert c.recv(100).startswith(b"HTTP/1.1 503"), "answered, not reset"
            c.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        assert responder._socks == []
    finally:
        os.close(r)
        os.close(w)


def test_finish_under_load_resets_no_connection(listening):
    """Clients that reconnect at once after each 503 (a load generator, a retrying client) kept the backlog full, so
    ``finish`` answered for its whole second and its close reset every connection still queued, each with its
    request sent (tryout over gunicorn: 5-7 resets per SIGTERM with 8 clients uploading). Now a client is answered
    503 or refused, never reset."""
    import threading
    from collections import Counter

    sock, port = listening
    r, w = os.pipe()
    responder = Responder([sock], wake_fd=r, on_wake=lambda: os.read(r, 100), needed=lambda: False,
                          stopping=lambda: True, ended=lambda: False)
    sock.close()
    responder.start()
    outcomes, finished = Counter(), threading.Event()
    lock = threading.Lock()

    def client():
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                    c.sendall(b"POST /api/v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n" +
                              b"x" * 2000)
                    got = c.recv(100)
                    outcome = "503" if got.startswith(b"HTTP/1.1 503") else f"other: {got[:40]!r}"
            except ConnectionRefusedError:
                outcome = "refused"
            except (ConnectionResetError, BrokenPipeError):
                outcome = "reset"
            with lock:
                outcomes[outcome] += 1
            if outcome == "refused" and finished.is_set():
                return

    threads = [threading.Thread(target=client) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        responder.finish()
        finished.set()
        for t in threads:
            t.join(timeout=10)
    finally:
        finished.set()
        os.close(r)
        os.close(w)
    assert outcomes["503"] > 0 and outcomes["refused"] >= 8 and set(outcomes) == {"503", "refused"}, outcomes


def test_a_browser_opening_the_page_while_starting_gets_a_page_in_its_language(listening):
    """A zh browser opening the page during a first start got the API's raw English JSON for a minute (tryout);
    the README promises the page. GET / asking for HTML gets a small page that reloads itself after Retry-After."""
    from webapp import i18n

    sock, port = listening
    r, w = os.pipe()
    responder = Responder([sock], wake_fd=r, on_wake=lambda: os.read(r, 100), needed=lambda: True,
                          stopping=lambda: False, ended=lambda: False)
    responder.start()
    browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}

    def get(path, **headers):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read().decode()
        finally:
            conn.close()

    try:
        for path, extra, lang in [("/", {"Accept-Language": "zh-CN,zh;q=0.9,en;q=0.8"}, "zh"),
                                  ("/?lang=en", {"Accept-Language": "zh-CN"}, "en"),
                                  ("/", {"Cookie": "a=1; lang=zh"}, "zh"), ("/", {}, "en")]:
            status, headers, body = get(path, **browser, **extra)
            assert status == 503 and headers["Content-Type"] == "text/html; charset=utf-8", body
            assert headers["Retry-After"] == str(RETRY_AFTER_S) and f'content="{RETRY_AFTER_S}"' in body
            assert i18n.strings(lang)["err_not_ready"].format(n=RETRY_AFTER_S) in body
            assert f'lang="{i18n.HTML_LANG[lang]}"' in body
        for path, headers in [("/", {"Accept": "application/json"}), ("/readyz", browser), ("/api/v1/models", browser)]:
            status, got, body = get(path, **headers)
            assert status == 503 and got["Content-Type"] == "application/json"
            assert json.loads(body)["error"]["code"] == "not_ready"
    finally:
        responder.finish()
        time.sleep(2 * 0.05)  # its thread sees it within a tick
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("trusted, forwarded, logged", [
    (0, "198.51.100.9, 203.0.113.5", "127.0.0.1"), (1, "198.51.100.9, 203.0.113.5", "203.0.113.5"),
    (2, "198.51.100.9, 203.0.113.5", "198.51.100.9"), (3, "198.51.100.9, 203.0.113.5", "127.0.0.1"),
    (1, None, "127.0.0.1")])
def test_the_masters_access_line_names_the_client_behind_trusted_proxies(listening, trusted, forwarded, logged):
    """The master's 503s were logged with the proxy's address where the workers' lines name the client
    (TRUSTED_PROXIES: ProxyFix's rule, the n-th address from the right; fewer than n: the connection's)."""
    from webapp import settings
    from webapp.responder import client_address, master_answers

    lines = []

    class Log:
        class access_log:
            @staticmethod
            def info(fmt, *args):
                lines.append(fmt % args)

    sock, port = listening
    r, w = os.pipe()
    answered = master_answers(Log, settings.load({"CLASSIFIER_ACCESS_LOG": "text", "CLASSIFIER_METRICS": "0",
                                                  "CLASSIFIER_TRUSTED_PROXIES": str(trusted)}))
    ended = []
    responder = Responder([sock], wake_fd=r, on_wake=lambda: os.read(r, 100), needed=lambda: True,
                          stopping=lambda: False, ended=lambda: bool(ended), on_answer=answered)
    responder.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
        conn.request("GET", "/readyz", headers={"X-Forwarded-For": forwarded} if forwarded else {})
        assert conn.getresponse().status == 503
        conn.close()
        deadline = time.monotonic() + 2.0
        while not lines and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        ended.append(True)
        time.sleep(0.5)
        os.close(r)
        os.close(w)
    assert len(lines) == 1 and lines[0].split()[0] == logged, lines
    assert client_address("10.0.0.1", " , 192.0.2.7 ,", 1) == "192.0.2.7"  # empty parts are no addresses


def test_a_worker_forked_while_the_master_counts_an_answer_starts(tmp_path):
    """prometheus_client's multiprocess values take a module lock on every count. A worker forked while the master's
    responder thread held it (answering a probe during a cold start) inherited it held, and waited on it for ever in
    its first count: one of two workers never started (seen in tests/test_lifecycle.py's cold start). The master's
    counts are guarded so that no fork happens inside one (``concurrency.fork_safe``). Here: a thread counting
    answers without pause, 150 forks, each child counting once under a 5 s alarm."""
    import subprocess
    import sys

    from conftest import ROOT

    script = """
import os, signal, threading
from webapp import settings
from webapp.responder import master_answers

answered = master_answers(None, settings.load({"CLASSIFIER_ACCESS_LOG": "off"}))
rec = {"method": "GET", "status": 503, "code": "not_ready", "duration_ms": 0.1}
stop = threading.Event()
def count():
    while not stop.is_set():
        answered(rec)
threading.Thread(target=count, daemon=True).start()
stuck = 0
for _ in range(150):
    pid = os.fork()
    if pid == 0:
        signal.alarm(5)
        answered(rec)  # a worker's first count: the same module lock
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    stuck += status != 0
stop.set()
print("stuck", stuck)
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == ["stuck", "0"], run.stdout[-500:]


@pytest.mark.parametrize("lines", [
    ["X-Forwarded-For: 6.6.6.6", "X-Forwarded-For: 203.0.113.7"],  # a proxy's own line after the client's
    ["X-Forwarded-For: " + "a" * 400 + "x, 6.6.6.6," + " " * 600 + ", 203.0.113.7"],  # the client's text pads
    ["X-Forwarded-For: 198.51.100.9, 6.6.6.6", "x-forwarded-for: 10.1.1.1, 203.0.113.7"],
    ['X-Forwarded-For: "6.6.6.6, 10.0.0.1", 203.0.113.7'],  # a quoted comma is no separator (ProxyFix's split)
])
@pytest.mark.parametrize("trusted", [1, 2])
def test_the_master_reads_x_forwarded_for_as_the_workers_proxyfix_does(lines, trusted):
    """The master took the first X-Forwarded-For line only, cut to its first 512 characters: the client's own text,
    so a client chose the address its 503 was logged with (tried: 6.6.6.6). It reads the header whole, as gunicorn
    gives it to a worker (repeated lines joined with ','), and splits it as ProxyFix does: the same address."""
    from werkzeug.middleware.proxy_fix import ProxyFix
    from webapp.responder import _header, client_address

    head = ("POST /api/v1/predict HTTP/1.1\r\nHost: x\r\n" + "\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    seen = {}
    ProxyFix(lambda environ, start: seen.update(addr=environ["REMOTE_ADDR"]) or [], x_for=trusted)(
        {"REMOTE_ADDR": "127.0.0.1", "HTTP_X_FORWARDED_FOR": ",".join(v.split(":", 1)[1].strip() for v in lines)},
        lambda *a: None)
    got = client_address("127.0.0.1", _header(head, b"x-forwarded-for", limit=None), trusted)
    assert got == seen["addr"], (got, seen)
    if trusted == 1:  # one proxy: the address it appended, whatever the client wrote before it
        assert got == "203.0.113.7"
