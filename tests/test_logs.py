"""Request ids (``X-Request-ID``) and the JSON access log (``CLASSIFIER_ACCESS_LOG=json``): through Flask's
test client, and once through a real gunicorn, where the JSON lines replace gunicorn's text ones."""

from __future__ import annotations

import json
import logging
import re
import socket

import pytest
import requests
from PIL import Image

from conftest import png_bytes
from serving import Server
from webapp.logs import ACCESS_LOGGER, RequestIdFilter, request_id_from

PNG = png_bytes(Image.new("RGB", (40, 30), (10, 200, 90)))
FIELDS = {"time", "request_id", "method", "path", "status", "duration_ms", "bytes", "remote_addr", "pid"}
UUID_HEX = re.compile(r"[0-9a-f]{32}")


@pytest.mark.parametrize("given, kept", [
    ("abc-123", True), ("0f" * 64, True), ("a.b_c:d+e/f=g@h~i-j", True),
    ("x" * 129, False), ("", False), (None, False), ("has space", False), ("new\nline", False),
    ('quote"s', False), ("<script>", False), ("ünïcode", False), ("semi;colon", False),
])
def test_request_id_from_header(given, kept):
    rid = request_id_from(given)
    assert rid == given if kept else UUID_HEX.fullmatch(rid)


def test_every_response_echoes_a_request_id(client):
    resp = client.post("/api/v1/predict", data=PNG, content_type="image/png", headers={"X-Request-ID": "trace-42"})
    assert resp.status_code == 200 and resp.headers["X-Request-ID"] == "trace-42"
    first, second = client.get("/healthz"), client.get("/healthz")
    assert UUID_HEX.fullmatch(first.headers["X-Request-ID"]) and first.headers["X-Request-ID"] != \
        second.headers["X-Request-ID"]
    bad = client.get("/readyz", headers={"X-Request-ID": "evil\tvalue " + "x" * 200})
    assert UUID_HEX.fullmatch(bad.headers["X-Request-ID"])
    for resp in (client.post("/api/v1/predict?topk=0", data=PNG, content_type="image/png"),  # errors too
                 client.get("/api/v1/nope"), client.get("/api/v1/predict")):
        assert resp.status_code >= 400 and UUID_HEX.fullmatch(resp.headers["X-Request-ID"])


def test_refused_by_the_token_check_still_has_an_id(make_app):
    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, API_TOKEN="t0ken")
    resp = app.test_client().post("/api/v1/predict", data=PNG, content_type="image/png",
                                  headers={"X-Request-ID": "no-token-1"})
    assert resp.status_code == 401 and resp.headers["X-Request-ID"] == "no-token-1"


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def json_app(make_module_app):
    return make_module_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, ACCESS_LOG="json")


@pytest.fixture
def access_lines():
    log = logging.getLogger(ACCESS_LOGGER)
    handler = Lines()
    log.addHandler(handler)
    yield handler.records
    log.removeHandler(handler)


def test_json_access_log_lines(json_app, access_lines):
    client = json_app.test_client()
    resp = client.post("/api/v1/predict?topk=2", data=PNG, content_type="image/png",
                       headers={"X-Request-ID": "req-1"},
                       environ_overrides={"HTTP_USER_AGENT": 'curl/8 "quoted"\n{"forged": 1}'})
    assert resp.status_code == 200
    client.post("/api/v1/predict", data=b"nope", content_type="text/plain")
    client.get('/no/such/"path"')
    lines = [json.loads(r.getMessage()) for r in access_lines]
    assert len(lines) == 3 and all("\n" not in r.getMessage() for r in access_lines)
    ok, refused, missing = lines
    assert FIELDS <= set(ok)
    assert ok["request_id"] == "req-1" and ok["method"] == "POST" and ok["path"] == "/api/v1/predict"
    assert ok["status"] == 200 and ok["query"] == "topk=2" and ok["bytes"] == len(resp.data) > 0
    assert ok["duration_ms"] > 0 and ok["remote_addr"] == "127.0.0.1" and ok["user_agent"] == 'curl/8 "quoted"\n{"forged": 1}'
    assert refused["status"] == 415 and UUID_HEX.fullmatch(refused["request_id"]) and "query" not in refused
    assert missing["status"] == 404 and missing["path"] == '/no/such/"path"'


def test_the_masters_json_line_is_a_workers_line(access_lines):
    """The master's own 503s (a start, a stop: webapp/responder.py) are written as the workers write theirs:
    the same fields, cut the same way, plus who answered."""
    import types

    from webapp.responder import master_answers

    answered = master_answers(None, types.SimpleNamespace(ACCESS_LOG="json", METRICS=False, TRUSTED_PROXIES=0))
    answered({"remote_addr": "10.0.0.7", "request_line": "GET /readyz HTTP/1.1", "status": 503, "bytes": 120,
              "duration_ms": 0.4321, "request_id": "probe-1", "method": "GET", "path": "/readyz",
              "query": "q" * 5000, "user_agent": 'curl/8 "x"' + "a" * 900, "code": "not_ready"})
    answered({"remote_addr": "10.0.0.7", "request_line": "GET /healthz HTTP/1.1", "status": 503, "bytes": 120,
              "duration_ms": 1.0, "request_id": "probe-2", "method": "GET", "path": "/healthz", "query": "",
              "user_agent": None, "code": "not_ready"})
    first, second = (json.loads(r.getMessage()) for r in access_lines)
    assert set(first) == FIELDS | {"query", "user_agent", "answered_by"} and set(second) == FIELDS | {"answered_by"}
    assert first["answered_by"] == "master" and first["status"] == 503 and first["duration_ms"] == 0.43
    assert first["query"] == "q" * 1024 and first["user_agent"] == ('curl/8 "x"' + "a" * 900)[:512]
    assert first["request_id"] == "probe-1" and first["remote_addr"] == "10.0.0.7" and first["bytes"] == 120


def test_text_and_off_write_no_json(client, access_lines):
    client.get("/healthz")  # the shared app runs ACCESS_LOG=text: gunicorn's line, none from the app
    assert access_lines == []


def test_service_log_lines_carry_the_request_id(json_app, monkeypatch):
    """An unexpected error is logged (with its traceback) by the app: the line names the request."""
    clf = json_app.extensions["classifier"]
    handler = Lines()
    handler.addFilter(RequestIdFilter())
    webapp_log = logging.getLogger("webapp")
    webapp_log.addHandler(handler)

    def broken(*args, **kwargs):
        logging.getLogger("webapp.service").warning("about to fail on %d file(s)", len(args[0]))
        raise RuntimeError("boom")

    monkeypatch.setattr(clf, "classify", broken)
    try:
        resp = json_app.test_client().post("/api/v1/predict", data=PNG, content_type="image/png",
                                           headers={"X-Request-ID": "trace-500"})
    finally:
        webapp_log.removeHandler(handler)
    assert resp.status_code == 500 and resp.get_json()["error"]["code"] == "internal_error"
    messages = [r.getMessage() for r in handler.records]
    assert "about to fail on 1 file(s) [request_id=trace-500]" in messages
    assert any(m.startswith("unhandled error on POST /api/v1/predict") and m.endswith("[request_id=trace-500]")
               for m in messages), messages
    assert all(r.request_id == "trace-500" for r in handler.records)


def test_no_request_no_id():
    record = logging.LogRecord("webapp.service", logging.INFO, __file__, 1, "started %s", ("ok",), None)
    assert RequestIdFilter().filter(record) and record.getMessage() == "started ok" and record.request_id == "-"


# ------------------------------------------------------------------------------------ real gunicorn
def _refused_by_gunicorn(port: int, request_id: str) -> bytes:
    """A request gunicorn refuses before the app sees it (Content-Length not a number): its whole raw answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /api/v1/predict HTTP/1.1\r\nHost: x\r\nX-Request-ID: " + request_id.encode()
                     + b"\r\nUser-Agent: raw-test\r\nContent-Length: abc\r\n\r\n")
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"Content-Length: (\d+)", raw).group(1)):
            raw += sock.recv(65536)
    return raw


@pytest.mark.server
def test_gunicorn_text_access_line_of_a_refused_request(tmp_path):
    """Found by fresh-user tryouts: with the default text access log, a request gunicorn refused showed 0 bytes
    and no request id (gunicorn logs it before its answer exists), and one it refused before it had a request object
    (a 417, a lowercase method) had no line at all; each has its line, with the answer's bytes and id."""
    srv = Server(tmp_path / "server.log", MODEL="resnet18_seeded", COMPILE=0, PRECISION="fp32", WORKERS=1,
                 THREADS=1, MAX_BATCH_SIZE=1, METRICS=0)
    try:
        srv.wait_ready(workers=1)
        raw = _refused_by_gunicorn(srv.port, "text-bad")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:  # gunicorn has no request object
            sock.sendall(b"POST /api/v1/predict HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\nX-Request-ID: text-417\r\n"
                         b"Content-Length: 0\r\n\r\n")
            expect = sock.recv(65536)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(b"get /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            lower = sock.recv(65536)
        ok = requests.post(srv.url + "/api/v1/predict", data=PNG, headers={"Content-Type": "image/png",
                                                                           "X-Request-ID": "text-ok"}, timeout=30)
        # a credential put in the URL by mistake (tryout28: written in clear to the access log)
        leak = requests.post(srv.url + "/api/v1/predict?topk=2&access_token=s3cret-tok", data=PNG, timeout=30,
                             headers={"Content-Type": "image/png", "X-Request-ID": "text-leak"})
    finally:
        code = srv.stop()
    out = srv.output()
    assert code == 0 and "Traceback" not in out and raw.startswith(b"HTTP/1.1 400 "), out[-3000:]
    size = len(raw.split(b"\r\n\r\n", 1)[1])
    assert re.search(rf'"POST /api/v1/predict HTTP/1.1" 400 {size} \d+ms text-bad$', out, re.M), out[-3000:]
    assert re.search(rf'"POST /api/v1/predict HTTP/1.1" 200 {len(ok.content)} \d+ms text-ok$', out, re.M)
    assert leak.status_code == 200 and "s3cret" not in out, out[-3000:]
    assert re.search(r'"POST /api/v1/predict\?topk=2&access_token=\[hidden\] HTTP/1.1" 200 \d+ \d+ms text-leak$', out, re.M)
    # No line from gunicorn where it had no request object (tryout24): one is written, with the client's id if sent.
    assert expect.startswith(b"HTTP/1.1 417 ") and b"X-Request-ID: text-417\r\n" in expect, expect
    size = len(expect.split(b"\r\n\r\n", 1)[1])
    # its request line as sent, as gunicorn's parser had read it (it said "- /api/v1/predict -": tryout25)
    assert re.search(rf'"POST /api/v1/predict HTTP/1.1" 417 {size} 0ms text-417$', out, re.M), out[-3000:]
    lower_id = re.search(rb"X-Request-ID: (\w+)", lower).group(1).decode()
    assert lower.startswith(b"HTTP/1.1 400 ") and re.search(rf'" 400 \d+ 0ms {lower_id}$', out, re.M), out[-3000:]


@pytest.mark.server
def test_gunicorn_json_access_log(tmp_path):
    """ACCESS_LOG=json under gunicorn: one JSON object per request on stdout, no text access lines;
    METRICS=0: no /metrics (404) and no metrics folder needed."""
    srv = Server(tmp_path / "server.log", MODEL="resnet18_seeded", COMPILE=0, PRECISION="fp32", WORKERS=1,
                 THREADS=1, MAX_BATCH_SIZE=1, ACCESS_LOG="json", METRICS=0)
    try:
        (pid,) = srv.wait_ready(workers=1)
        ok = requests.post(srv.url + "/api/v1/predict", data=PNG, headers={"Content-Type": "image/png",
                                                                           "X-Request-ID": "gunicorn-7"}, timeout=30)
        assert ok.status_code == 200 and ok.headers["X-Request-ID"] == "gunicorn-7"
        bad = requests.post(srv.url + "/api/v1/predict?topk=x", data=PNG, headers={"Content-Type": "image/png"},
                            timeout=30)
        assert bad.status_code == 400 and UUID_HEX.fullmatch(bad.headers["X-Request-ID"])
        leak = requests.post(srv.url + "/api/v1/predict?api_key=s3cret-key", data=PNG, timeout=30,
                             headers={"Content-Type": "image/png", "X-Request-ID": "json-leak"})
        assert leak.status_code == 200
        assert requests.get(srv.url + "/metrics", timeout=10).status_code == 404
        # gunicorn refuses it before the app sees it: it had no access line at all (tryout23)
        raw = _refused_by_gunicorn(srv.port, "gunicorn-bad")
        assert raw.startswith(b"HTTP/1.1 400 ") and b"X-Request-ID: gunicorn-bad" in raw
    finally:
        code = srv.stop()
    out = srv.output()
    assert code == 0 and "Traceback" not in out, out[-3000:]
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    by_id = {r["request_id"]: r for r in lines}
    unparsed = by_id["gunicorn-bad"]
    assert (unparsed["status"], unparsed["method"], unparsed["path"], unparsed["remote_addr"]) == \
        (400, "POST", "/api/v1/predict", "127.0.0.1")
    assert unparsed["bytes"] == len(raw.split(b"\r\n\r\n", 1)[1]) and unparsed["user_agent"] == "raw-test"
    # the client's fault, said at INFO: warnings stay the server's own
    assert "[INFO] Invalid request from ip=127.0.0.1" in out and "[WARNING] Invalid request" not in out, out[-3000:]
    good = by_id["gunicorn-7"]
    assert FIELDS <= set(good) and good["method"] == "POST" and good["path"] == "/api/v1/predict"
    assert good["status"] == 200 and good["pid"] == pid and good["bytes"] == len(ok.content)
    assert good["remote_addr"] == "127.0.0.1" and good["duration_ms"] > 0
    refused = by_id[bad.headers["X-Request-ID"]]
    assert refused["status"] == 400 and refused["query"] == "topk=x"
    assert by_id["json-leak"]["query"] == "api_key=[hidden]" and "s3cret" not in out  # tryout28
    assert not re.search(r'"POST /api/v1/predict[^"]*" \d{3}', out), "gunicorn's text access line is still on"
