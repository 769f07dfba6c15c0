"""``python -m webapp classify --server URL``: the remote bulk client (webapp/cli/remote.py).

Against a real gunicorn with a small queue (QUEUE_SIZE=2, 8 connections: 429s happen): every file is
answered, the shared photos get the same labels as local ``classify``, bad files the same error codes;
a dead server is one error line and exit 1. The retry timing (Retry-After, jitter, the bound) is shown
against a stub server that refuses on purpose; the local scaling on the shared photos.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import random
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from conftest import ROOT, SHARED_IMAGES, encode, shared_image, small_png
from serving import Server, as_a_terminal_job, free_port
from webapp.cli import remote, retries, scaling
from webapp.settings import PREFIX

QUICK = ("--model", "efficientnet_lite0", "--no-compile", "--precision", "fp32", "--max-batch-size", "4")
# The pixel limit of the server, local classify and the --server client in the folder runs: over.jpg is over it.
PIXELS = {"CLASSIFIER_MAX_PIXELS": "13000000"}  # the 12 MP phone photos fit


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**{k: v for k, v in os.environ.items() if not k.startswith(PREFIX) and "proxy" not in k.lower()},
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "webapp", "classify", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The shared photos, six more copies of dog.jpg (more files than connections), a truncated JPEG, a text
    file named .jpg, and two the server refuses that a scaled copy would hide (classify --server used to
    send a good copy of them): dog.jpg cut at half and closed by EOI (libjpeg fills the rest with grey), and
    a JPEG over the pixel limit (``PIXELS``)."""
    if not SHARED_IMAGES.is_dir():
        pytest.skip(f"{SHARED_IMAGES} is absent (the shared photos live in ../shared/images)")
    out = tmp_path_factory.mktemp("remote")
    for p in sorted(SHARED_IMAGES.glob("*.jpg")):
        (out / p.name).write_bytes(p.read_bytes())
    for i in range(6):
        (out / f"copy-{i}.jpg").write_bytes((SHARED_IMAGES / "dog.jpg").read_bytes())
    (out / "broken.jpg").write_bytes((SHARED_IMAGES / "dog.jpg").read_bytes()[:3000])
    (out / "notes.jpg").write_text("not a photo")
    dog = (SHARED_IMAGES / "dog.jpg").read_bytes()
    (out / "cut.jpg").write_bytes(dog[:len(dog) // 2] + b"\xff\xd9")
    big = Image.open(SHARED_IMAGES / "dog.jpg").resize((4200, 3150))  # 13.2 MP
    (out / "over.jpg").write_bytes(encode(big, "JPEG", quality=30))
    return out


@pytest.fixture(scope="module")
def busy(tmp_path_factory):
    """A real server whose queue holds 2 images: 8 connections at once overflow it."""
    srv = Server(tmp_path_factory.mktemp("busy") / "server.log", args=("--no-control-socket",),
                 MODEL="efficientnet_lite0", COMPILE=0, PRECISION="fp32", WORKERS=1, MAX_BATCH_SIZE=2, QUEUE_SIZE=2,
                 MAX_PIXELS=PIXELS["CLASSIFIER_MAX_PIXELS"])
    try:
        srv.wait_ready(workers=1)
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="module")
def local(folder) -> dict[str, dict]:
    """Local classify's JSON results, by path."""
    out = run_cli(str(folder), "--format", "json", "-q", *QUICK, env=PIXELS)
    assert out.returncode == 1, out.stderr  # the four bad files
    return {r["path"]: r for r in json.loads(out.stdout)}


def remote_run(srv, folder, *extra: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    out = run_cli(str(folder), "--server", srv.url, "--format", "json", "--jobs", "8", *extra, env=PIXELS)
    return out, {r["path"]: r for r in json.loads(out.stdout)}


def assert_same_answers(local: dict, got: dict, *, probability_tol: float) -> None:
    assert set(got) == set(local)
    for path, mine in local.items():
        theirs = got[path]
        assert theirs["model"] == mine["model"] == "efficientnet_lite0"
        assert list(theirs) == list(mine), (path, theirs, mine)  # the same JSON, key order too
        if mine["error"]:
            assert theirs["error"]["code"] == mine["error"]["code"], (path, theirs["error"], mine["error"])
            assert theirs["predictions"] == []
            continue
        assert theirs["error"] is None, (path, theirs["error"])
        # each prediction's keys came sorted from the server (tryout25)
        assert [list(p) for p in theirs["predictions"]] == [list(p) for p in mine["predictions"]], path
        assert (theirs["width"], theirs["height"], theirs["format"]) == (mine["width"], mine["height"], mine["format"])
        assert [p["label"] for p in theirs["predictions"]] == [p["label"] for p in mine["predictions"]], path
        assert [p["probability"] for p in theirs["predictions"]] == pytest.approx(
            [p["probability"] for p in mine["predictions"]], abs=probability_tol), path


@pytest.mark.server
@pytest.mark.extended  # a busy server's 429s through a whole folder (~16 s): with `-m extended`
def test_every_file_answered_through_429s_like_local_classify(busy, folder, local):
    out, got = remote_run(busy, folder)
    assert out.returncode == 1, out.stderr  # the four bad files, as locally
    assert len(got) == len(local) == 19
    # Big photos go scaled as the server's own decode would: the same labels and probabilities
    # (up to the batch each image ran in, in another process).
    assert_same_answers(local, got, probability_tol=1e-4)
    assert got[str(folder / "broken.jpg")]["error"]["code"] == "undecodable_image"
    assert got[str(folder / "notes.jpg")]["error"]["code"] == "unsupported_media_type"
    assert got[str(folder / "cut.jpg")]["error"]["code"] == "undecodable_image"  # as sent: not a copy of grey fill
    assert got[str(folder / "over.jpg")]["error"]["code"] == "too_large"  # the server's 413
    summary = out.stderr.strip().splitlines()[-1]
    assert summary.startswith("19 files: 15 classified, 4 failed; ")
    repeated = int(summary.split("; ")[-1].split(" tries repeated")[0])
    assert repeated > 0, f"the small queue never said 429: {out.stderr[-2000:]}"
    log = busy.output()
    assert '" 429 ' in log or " 429 " in log, "the server's access log shows no 429"


@pytest.mark.server
def test_no_scale_sends_the_originals(busy, folder, local):
    out, got = remote_run(busy, folder, "--no-scale", "--topk", "3")
    assert out.returncode == 1, out.stderr
    # The very same bytes through the same decode and model: the same probabilities (batching aside).
    assert_same_answers(local, got, probability_tol=1e-4)


@pytest.mark.server
def test_table_and_csv_outputs_match_local(busy, folder):
    for fmt in ("table", "csv"):
        mine = run_cli(str(folder / "dog.jpg"), str(folder / "broken.jpg"), "--format", fmt, "-q", *QUICK)
        theirs = run_cli(str(folder / "dog.jpg"), str(folder / "broken.jpg"), "--format", fmt, "-q", "--no-scale",
                         "--server", busy.url)
        assert (mine.returncode, theirs.returncode) == (1, 1)
        # The same lines, up to the last digits of the probabilities (another process's batch).
        strip = lambda text: [line.rsplit(",", 2)[0] if fmt == "csv" else line.split()[0] for line in text.splitlines()]  # noqa: E731
        assert strip(theirs.stdout) == strip(mine.stdout)
        assert theirs.stdout.count("error") == mine.stdout.count("error") == 1


@pytest.mark.cli
def test_dead_server_is_one_error_line_a_row_per_file_and_exit_1(folder):
    """Each file still gets its row, unsent (exit 1: "each has its error line"): with -f json stdout was empty, not
    a list, and the | jq after it broke (tryout32)."""
    url = f"http://127.0.0.1:{free_port()}"
    out = run_cli(str(folder / "dog.jpg"), str(folder / "copy-0.jpg"), "-f", "json", "--server", url, timeout=60)
    assert out.returncode == 1
    rows = json.loads(out.stdout)
    assert len(rows) == 2 and all(r["error"]["code"] == "connection_error" for r in rows), rows
    assert all(r["error"]["message"].startswith(f"not sent: cannot reach the server at {url}: ") for r in rows)
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: cannot reach the server at {url}: "), out.stderr
    assert "refused" in lines[0].lower() and "0 classified, 2 failed" in lines[-1], out.stderr


@pytest.mark.cli
@pytest.mark.parametrize("extra, message", [
    (("--model", "resnet18"), "error: --model does not go with --server: the server's own settings decide"),
    (("--cluster", "--out", "x.parquet"), "error: --cluster, --out do not go with --server: they run classify over "
                                          "a Ray cluster"),
    (("--no-compile", "--precision", "fp32"), "error: --no-compile, --precision do not go with --server"),
    (("--compile",), "error: --compile does not go with --server"),
])
def test_server_settings_are_refused(folder, extra, message):
    out = run_cli(str(folder / "dog.jpg"), "--server", "http://127.0.0.1:9", *extra, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith(message), out.stderr


@pytest.mark.cli
def test_server_settings_in_the_environment_are_named_not_ignored_unsaid(folder):
    """Options of the server's are refused with --server; as variables (one shell may also start a local server)
    they are named on stderr, while the client's own (TOP_K, API_TOKEN) are not."""
    env = {f"{PREFIX}PRECISION": "fp32", f"{PREFIX}WORKERS": "4", f"{PREFIX}TOP_K": "5", f"{PREFIX}API_TOKEN": "t" * 16}
    out = run_cli(str(folder / "dog.jpg"), "--server", f"http://127.0.0.1:{free_port()}", env=env, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) >= 2, out.stderr
    assert lines[0] == (f"note: {PREFIX}PRECISION, {PREFIX}WORKERS are set here but are settings of the server: "
                        f"with --server the server's own values apply"), lines[0]
    assert lines[1].startswith("error: cannot reach the server at ")
    quiet = run_cli(str(folder / "dog.jpg"), "-q", "--server", f"http://127.0.0.1:{free_port()}", env=env,
                    timeout=60)
    assert "note:" not in quiet.stderr and quiet.returncode == 1


@pytest.mark.cli
def test_server_must_be_a_url(folder):
    out = run_cli(str(folder / "dog.jpg"), "--server", "localhost:8000", timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: --server must be an http:// or https:// URL")


@pytest.mark.cli
@pytest.mark.parametrize("url, message", [
    ("", "error: --server must be an http:// or https:// URL, got ''"),  # --server "$URL" with URL unset
    ("http://127.0.0.1:8000/api/v1/predict", "error: --server 'http://127.0.0.1:8000/api/v1/predict' ends in the "
                                             "API's path '/api/v1/predict', which classify adds itself; give "
                                             "'http://127.0.0.1:8000'"),  # tryout13: "not a photo classifier"
    ("https://h/proxy/api/v1/", "error: --server 'https://h/proxy/api/v1/' ends in the API's path '/api/v1', which "
                                "classify adds itself; give 'https://h/proxy'"),
    ("http://127.0.0.1:99999", "error: --server 'http://127.0.0.1:99999' is not a valid URL: bad port (port out of "
                               "range 0-65535)"),
    ("http://127.0.0.1:0", "error: --server 'http://127.0.0.1:0' is not a valid URL: bad port"),
    ("http://[::1", "error: --server 'http://[::1' is not a valid URL: bad host (invalid IPv6 URL)"),
    ("http://bad host", "error: --server 'http://bad host' is not a valid URL: bad host (host 'bad host' contains "
                        "invalid character ' ')"),
    ("http://:8000", "error: --server 'http://:8000' is not a valid URL: it names no host"),
    ("http://127.0.0.1:8123?x=1", "error: --server 'http://127.0.0.1:8123?x=1' is not a server's URL: it has a "
                                  "query (?...) or fragment (#...)"),
    ("http://127.0.0.1:8123/#top", "error: --server 'http://127.0.0.1:8123/#top' is not a server's URL"),
])
def test_an_empty_or_malformed_server_url_is_a_usage_error(folder, url, message):
    """Never a local run (an empty --server), nor "cannot reach the server" (exit 1) for a URL that names no
    place a server could be: exit 2 with what is wrong, before any model starts or anything is sent."""
    quick = {f"{PREFIX}MODEL": "efficientnet_lite0", f"{PREFIX}COMPILE": "0"}  # should it run locally after all
    out = run_cli(str(folder / "dog.jpg"), "--server", url, "-q", timeout=120, env=quick)
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    assert out.stderr.startswith(message) and len(out.stderr.splitlines()) == 1, out.stderr


def test_well_formed_server_urls_pass():
    for url in ("http://127.0.0.1:8000", "https://[::1]:8443/", "http://classifier.internal/prefix",
                "HTTP://LOCALHOST:8000", "Https://classifier.internal"):  # a scheme is case-insensitive (tryout24)
        assert remote.url_problem(url) is None, url


# -- retries against a stub that refuses on purpose -----------------------------------------------------------
NOT_READY = {"code": "not_ready", "status": 503, "message": "the model is not ready (starting); try again shortly"}


class Stub(http.server.ThreadingHTTPServer):
    """Answers POST /api/v1/predict with ``plan`` (a list of (status, Retry-After)), then 200 (or, ``stall``, never);
    records arrival times.
    GET /api/v1/models answers ``starting`` times as a starting server does (503 not_ready, Retry-After:
    ``retry_after``) first; ``probes`` records those GETs' arrival times. Listens on ``port`` (0: any free one).
    ``stall_from``: answer that many uploads, then stall as ``stall``; ``delay``: seconds before each answer.
    ``limit``, ``topk``: GET /openapi.json is the real server's document with CLASSIFIER_MAX_UPLOAD_BYTES=limit and
    CLASSIFIER_TOP_K=topk (both None: the models answer, as for any GET: nothing published); ``sizes`` records each
    upload's size, ``paths`` its request target."""

    def __init__(self, plan: list[tuple[int, str | None]], *, starting: int = 0, retry_after: str = "1",
                 stall: bool = False, port: int = 0, stall_from: int | None = None, delay: float = 0.0,
                 limit: int | None = None, topk: int | None = None):
        self.plan, self.arrivals, self.probes, self.starting = list(plan), [], [], starting
        self.sizes: list[int] = []
        self.paths: list[str] = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # /api/v1/models, enough for the CLI to start (and /openapi.json, for its limit)
                if self.path != "/openapi.json":
                    stub.probes.append(time.monotonic())
                if stub.starting:  # as the real server's master answers before a worker is ready
                    stub.starting -= 1
                    data = json.dumps({"error": NOT_READY}).encode()
                    self.send_response(503)
                    self.send_header("Retry-After", retry_after)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                data = json.dumps({"requested": "stub", "serving": "stub", "models": [
                    {"name": "stub", "title": "Stub", "precision": "fp32", "send_short_side": 256,
                     "send_resample": "bilinear", "serving": True}]}).encode()
                if (limit is not None or topk is not None) and self.path == "/openapi.json":
                    from webapp import openapi, settings
                    spec = openapi.build_spec(settings.load({f"{PREFIX}{name}": str(value) for name, value in
                                                             (("MAX_UPLOAD_BYTES", limit), ("TOP_K", topk)) if value}))
                    data = json.dumps(spec).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                left = int(self.headers["Content-Length"])
                while left > 0:  # (in blocks: a big file is not held here either)
                    block = self.rfile.read(min(left, 2**20))
                    if not block:
                        break
                    left -= len(block)
                stub.sizes.append(int(self.headers["Content-Length"]) - left)
                stub.paths.append(self.path)
                stub.arrivals.append(time.monotonic())
                time.sleep(delay)
                if stall or stall_from is not None and len(stub.arrivals) > stall_from:  # takes the upload and
                    # never answers (a stuck server), from the first upload or after ``stall_from`` answered
                    time.sleep(3600)
                if stub.plan:
                    status, after, *code = stub.plan.pop(0)  # (a third item: the error's code)
                    body = {"error": {"code": code[0] if code else "overloaded", "message": "server busy",
                                      "status": status}}
                else:
                    status, after = 200, None
                    body = {"results": [{"width": 1, "height": 1, "format": "PNG", "batch_size": 1,
                                         "predictions": [{"label": "kite", "index": 21, "probability": 0.5}]}]}
                data = json.dumps(body).encode()
                self.send_response(status)
                if after is not None:
                    self.send_header("Retry-After", after)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        super().__init__(("127.0.0.1", port), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.mark.parametrize("status, body, said", [
    (200, b"<html>a web server's page</html>", "200 OK (32 bytes, Content-Type: none); first line: <html>a web "
                                                "server's page</html>"),
    (200, b"[1, 2]", "200 OK (6 bytes, Content-Type: none); first line: [1, 2]"),
    (200, b'{"serving": "x", "models": ["x"]}', "200 OK (33 bytes, Content-Type: none); first line: "
                                                 '{"serving": "x", "models": ["x"]}'),
    (200, b"\xff\xfe not text", "200 OK (11 bytes, Content-Type: none, not UTF-8 text)"),
    # a --server URL with a path the host does not serve (tryout: "answered 404 b'<!doctype html>\\n...'")
    (404, b"\n<!doctype html>\n<title>404</title>", "404 Not Found (35 bytes, Content-Type: text/html); first line: "
                                                    "<!doctype html>"),
    (404, b"\x1b]0;pwned\x07" + b"x" * 100, "404 Not Found (110 bytes, Content-Type: text/html); first line: "
                                            "\\x1b]0;pwned\\x07" + "x" * 70 + "..."),
    (404, b"", "404 Not Found (an empty body, Content-Type: text/html)"),
])
def test_a_server_that_is_not_a_photo_classifier_is_said_to_be_so(status, body, said):
    """``GET /api/v1/models`` answered with something not this service's (another web server on that port, or a
    path it does not serve): one clear line naming the URL and what came back in words (status, reason, size,
    content type, first line of text, escaped and bounded), not a traceback nor a bytes repr
    (``Client.serving_model``)."""
    class Other(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(status)
            if status != 200:
                self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(remote.Unreachable) as raised:
            remote.Client(url, jobs=1).serving_model()
    finally:
        server.shutdown()
    assert str(raised.value) == f"{url} is not a photo classifier: GET /api/v1/models answered {said}"


def tiny_file(tmp_path) -> Path:
    path = tmp_path / "x.png"
    Image.new("RGB", (4, 4)).save(path)
    return path


def test_429_is_retried_after_retry_after_with_jitter(tmp_path):
    stub = Stub([(429, "1"), (503, "2")])
    try:
        result = remote.classify_one(remote.Client(stub.url, jobs=1), tiny_file(tmp_path), topk=3, short_side=None,
                                     max_bytes=2**20)
    finally:
        stub.shutdown()
    assert "error" not in result
    assert result["predictions"][0]["label"] == "kite" and result["retries"] == 2
    first, second = (b - a for a, b in zip(stub.arrivals, stub.arrivals[1:]))
    assert 1.0 <= first <= 1.0 * (1 + retries.JITTER) + 0.5, first
    assert 2.0 <= second <= 2.0 * (1 + retries.JITTER) + 0.5, second


def test_the_services_own_504_is_an_answer_not_tried_again(tmp_path):
    """Only a proxy's 502/504 (not the service's JSON) is tried again: the service's own 504 ``timeout`` would be the
    same for the same upload (tests/test_proxy.py has the proxy's, from a real nginx)."""
    stub = Stub([(504, None, "timeout")])
    try:
        result = remote.classify_one(remote.Client(stub.url, jobs=1), tiny_file(tmp_path), topk=3, short_side=None,
                                     max_bytes=2**20)
    finally:
        stub.shutdown()
    assert len(stub.arrivals) == 1 and result == {"error": {"code": "timeout", "message": "server busy"},
                                                  "retries": 0}


@pytest.mark.cli
def test_the_progress_bar_counts_the_files_that_failed_before_upload(tmp_path):
    """Its total was the files sent (1/1 here) while the summary counted every file (2 files: 1 failed;
    tryout17): both count 2 now."""
    tiny_file(tmp_path)
    (tmp_path / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")  # a broken link: an error row, never sent
    stub = Stub([])
    try:
        out = run_cli(str(tmp_path), "--server", stub.url, "--no-scale", timeout=60)
    finally:
        stub.shutdown()
    assert out.returncode == 1 and len(stub.arrivals) == 1, out.stderr
    bar = out.stderr.replace("\r", "\n").splitlines()
    assert any("classify: 100%" in line and "2/2" in line for line in bar), out.stderr
    assert "2 files: 1 classified, 1 failed" in out.stderr


def test_retries_are_bounded_and_end_in_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(retries, "MAX_TRIES", 3)
    stub = Stub([(429, "0")] * 5)
    try:
        result = remote.classify_one(remote.Client(stub.url, jobs=1), tiny_file(tmp_path), topk=3, short_side=None,
                                     max_bytes=2**20)
    finally:
        stub.shutdown()
    assert len(stub.arrivals) == 3 and result["retries"] == 2
    assert result["error"] == {"code": "overloaded", "message": "server busy (gave up after 3 tries, 0 s of waiting)"}


@pytest.mark.cli
def test_a_file_over_the_upload_limit_is_too_large_unread_as_locally(tmp_path):
    """A 40 MB sparse file (no real bytes on disk) is refused by its size, over the server's published limit (its
    default), before anything is read or sent; the other file is classified and the run exits 1, as locally."""
    from webapp import settings

    huge = tmp_path / "huge.jpg"
    with open(huge, "wb") as f:
        f.truncate(40_000_000)
    stub = Stub([], limit=settings.load({}).MAX_UPLOAD_BYTES)
    try:
        out = run_cli(str(huge), str(tiny_file(tmp_path)), "--server", stub.url, "--format", "json", timeout=60)
    finally:
        stub.shutdown()
    assert out.returncode == 1, out.stderr
    got = {Path(r["path"]).name: r for r in json.loads(out.stdout)}
    assert got["huge.jpg"]["error"] == {"code": "too_large", "message": "the file is 40,000,000 bytes; the server's "
                                        "limit is 33,554,432 (the server's CLASSIFIER_MAX_UPLOAD_BYTES)"}
    assert got["x.png"]["error"] is None and len(stub.arrivals) == 1  # only x.png was sent


def sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.mark.cli
def test_the_servers_own_upload_limit_applies_not_the_clients_default(tmp_path, monkeypatch):
    """A server started with CLASSIFIER_MAX_UPLOAD_BYTES=100000000 takes a 42 MB BMP (curl gets 200), which
    classify --server refused as too_large by the client's own default, 32 MiB (tryout). The limit is the one the
    server publishes (its /openapi.json); a file over it is refused unread, saying whose limit it is; the one under
    it is sent whole, from disk (not held: over uploading.HELD_BYTES). --max-upload-bytes, given, is the limit."""
    from webapp.cli import uploading

    ok, over = sparse(tmp_path / "scan.bmp", 42_000_000), sparse(tmp_path / "over.bmp", 100_000_001)
    assert isinstance(uploading.read_upload(ok, uploading.Limit(None)), uploading.FileBody)
    stub = Stub([], limit=100_000_000)
    try:
        out = run_cli(str(ok), str(over), "--server", stub.url, "--format", "json", timeout=120)
        option = run_cli(str(ok), "--server", stub.url, "--format", "json", "--max-upload-bytes", "40000000",
                         timeout=60)
    finally:
        stub.shutdown()
    assert out.returncode == 1, out.stderr
    got = {Path(r["path"]).name: r for r in json.loads(out.stdout)}
    assert got["scan.bmp"]["error"] is None and stub.sizes == [42_000_000], (got, stub.sizes)
    assert got["over.bmp"]["error"] == {"code": "too_large", "message": "the file is 100,000,001 bytes; the server's "
                                        "limit is 100,000,000 (the server's CLASSIFIER_MAX_UPLOAD_BYTES)"}
    assert option.returncode == 1 and json.loads(option.stdout)[0]["error"] == {
        "code": "too_large", "message": "the file is 42,000,000 bytes; the limit is 40,000,000 (--max-upload-bytes)"}
    assert len(stub.sizes) == 1  # neither refused file was sent


@pytest.mark.cli
def test_the_servers_own_topk_applies_not_the_clients_default(tmp_path):
    """With no --topk (nor CLASSIFIER_TOP_K) the labels per photo are the server's (its TOP_K, published in its
    /openapi.json), as curl gets them, not this client's default of 3 (found and left in an earlier closing note);
    given, the client's value is asked for."""
    photo = tmp_path / "a.png"
    photo.write_bytes(small_png())
    stub = Stub([], topk=5)
    try:
        table = run_cli(str(photo), "--server", stub.url, "--quiet", timeout=60)
        option = run_cli(str(photo), "--server", stub.url, "--quiet", "--topk", "2", timeout=60)
        variable = run_cli(str(photo), "--server", stub.url, "--quiet", env={f"{PREFIX}TOP_K": "4"}, timeout=60)
        older = Stub([])  # publishes nothing: the client's default
        try:
            assert run_cli(str(photo), "--server", older.url, "--quiet", timeout=60).returncode == 0
        finally:
            older.shutdown()
    finally:
        stub.shutdown()
    assert [table.returncode, option.returncode, variable.returncode] == [0, 0, 0], (table.stderr, option.stderr)
    assert stub.paths == ["/api/v1/predict?topk=5", "/api/v1/predict?topk=2", "/api/v1/predict?topk=4"]
    assert older.paths == ["/api/v1/predict?topk=3"]
    assert table.stdout.splitlines()[0].split()[-1] == "top-5", table.stdout


def test_an_empty_topk_variable_names_the_servers_default_not_3(tmp_path, monkeypatch, capsys):
    """``CLASSIFIER_TOP_K=$K`` with K unset is refused as locally, but unsetting it with --server gives the server's
    default (above), so the message says so instead of naming the table's 3; --help says the same."""
    from webapp import cli

    monkeypatch.setenv(f"{PREFIX}TOP_K", "")
    assert cli.main(["classify", str(tiny_file(tmp_path)), "--server", "http://127.0.0.1:9"]) == 2
    said = capsys.readouterr().err
    assert "TOP_K='' is not valid" in said and "the server's default" in said and "3" not in said, said
    with pytest.raises(SystemExit):
        cli.main(["classify", "--help"])
    assert "With --server, where neither this nor the variable is given: the server's default." in \
        " ".join(capsys.readouterr().out.split())


@pytest.mark.cli
def test_with_no_limit_published_every_file_is_sent_for_the_server_to_judge(tmp_path):
    """A server that publishes no limit (an older one; a proxy that passes only the API) is sent a file over the
    client's default, read from disk as it is sent, for its own answer (its 413, or its labels); the client's
    CLASSIFIER_MAX_UPLOAD_BYTES is the server's setting, noted, not a limit here."""
    big = sparse(tmp_path / "big.bmp", 40_000_000)
    stub = Stub([])
    try:
        out = run_cli(str(big), "--server", stub.url, "--format", "json", timeout=120,
                      env={f"{PREFIX}MAX_UPLOAD_BYTES": "2048"})
    finally:
        stub.shutdown()
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["error"] is None and stub.sizes == [40_000_000]
    assert f"note: {PREFIX}MAX_UPLOAD_BYTES is set here but is a setting of the server" in out.stderr, out.stderr


@pytest.mark.cli
def test_a_photo_is_held_to_the_limit_as_it_is_sent_scaled(tmp_path):
    """A server set to 2 MB took the 3.25 MB phone photo from the page (scaled in the browser to ~115 KB) while
    classify --server refused it unread as too_large (tryout22): the limit holds what is sent. A scaled copy still
    over it says so; with --no-scale the file itself is judged, unread and unsent, as before."""
    photo = shared_image("phone-12mp.jpg")
    size = photo.stat().st_size
    stub = Stub([], limit=2_000_000)
    try:
        out = run_cli(str(photo), "--server", stub.url, "--format", "json", timeout=120)
        raw = run_cli(str(photo), "--server", stub.url, "--format", "json", "--no-scale", timeout=60)
        tiny = run_cli(str(photo), "--server", stub.url, "--format", "json", "--max-upload-bytes", "50000",
                       timeout=120)
    finally:
        stub.shutdown()
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["error"] is None and len(stub.sizes) == 1 and stub.sizes[0] < 200_000
    assert raw.returncode == 1 and json.loads(raw.stdout)[0]["error"] == {
        "code": "too_large", "message": f"the file is {size:,} bytes; the server's limit is 2,000,000 (the server's "
                                        f"CLASSIFIER_MAX_UPLOAD_BYTES)"}
    message = json.loads(tiny.stdout)[0]["error"]["message"]
    assert tiny.returncode == 1 and re.fullmatch(r"scaled, the photo is still [0-9,]+ bytes; the limit is 50,000 "
                                                 r"\(--max-upload-bytes\)", message), message
    assert len(stub.sizes) == 1  # neither refused one was sent


# -- the first probe (GET /api/v1/models): a server still starting, one that never answers -------------------
def test_the_clients_own_limits_can_be_raised_for_a_server_set_higher(tmp_path):
    """--max-upload-bytes was refused with --server ("the server's own settings decide") while the client applied
    its default to every file (tryout17): a server that takes bigger files could not be sent them."""
    from webapp import cli

    big = tmp_path / "big.png"
    Image.effect_noise((64, 64), 100).convert("RGB").save(big)
    assert big.stat().st_size > 2048
    stub = Stub([])
    try:
        refused = cli.main(["classify", "-q", str(big), "--server", stub.url, "--max-upload-bytes", "2048"])
        sent = cli.main(["classify", "-q", str(big), "--server", stub.url, "--max-upload-bytes", "100000000",
                         "--max-pixels", "100000000"])
    finally:
        stub.shutdown()
    assert (refused, sent) == (1, 0) and len(stub.arrivals) == 1


@pytest.mark.cli
@pytest.mark.extended  # a server still starting, rare (~7 s): with `-m extended`
def test_a_server_still_starting_is_waited_for(tmp_path):
    """503 not_ready + Retry-After on the probe is waited out as an upload's 429/503 is (with the jitter), saying
    so on stderr (not with -q); then the run goes on as usual."""
    for quiet in (False, True):
        stub = Stub([], starting=2)
        try:
            out = run_cli(str(tiny_file(tmp_path)), "--server", stub.url, *(["-q"] if quiet else []), timeout=60)
        finally:
            stub.shutdown()
        assert out.returncode == 0, out.stderr
        assert "kite" in out.stdout and len(stub.probes) == 3 and len(stub.arrivals) == 1
        for a, b in zip(stub.probes, stub.probes[1:]):
            assert 1.0 <= b - a <= 1.0 * (1 + retries.JITTER) + 0.5, b - a
        waits = [line for line in out.stderr.splitlines() if line.startswith("waiting")]
        if quiet:
            assert waits == [] and out.stderr == "", out.stderr
        else:
            assert [re.sub(r"waited \d+ of", "waited N of", w) for w in waits] == [
                f"waiting for the server at {stub.url} to start (503 not_ready: {NOT_READY['message']}); "
                f"trying again in 1 s (waited N of at most 600 s)"] * 2, out.stderr


def test_a_server_that_stays_starting_is_said_to_be_starting(tmp_path, monkeypatch, capsys):
    """The probe waits for a starting server up to START_WAIT_S, and the end says the server is still starting
    (exit 1), not that it is no photo classifier."""
    from webapp import cli

    assert remote.START_WAIT_S == 600  # a first start compiles for a minute or more (tryout17: given up at 41 s)
    monkeypatch.setattr(remote, "START_WAIT_S", 2.0)
    stub = Stub([], starting=10, retry_after="1")
    try:
        status = cli.main(["classify", str(tiny_file(tmp_path)), "--server", stub.url])
    finally:
        stub.shutdown()
    err = capsys.readouterr().err.splitlines()
    assert status == 1 and len(stub.probes) == 2 and stub.arrivals == []
    assert (f"error: the server at {stub.url} is still starting (503 not_ready: {NOT_READY['message']}); "
            f"gave up after 2 tries, 1 s of waiting") in err, err  # (then the file's row, unsent, and the summary)
    assert len([line for line in err if line.startswith("waiting for the server")]) == 1, err


def test_a_server_that_never_answers_the_probe_is_named_within_the_probe_timeout(tmp_path, monkeypatch, capsys):
    """A server that takes the connection and says nothing: an error after PROBE_READ_TIMEOUT_S (30 s; 0.5 here),
    not after the uploads' READ_TIMEOUT_S (120 s; 20 here), exit 1."""
    import socket

    from webapp import cli

    assert remote.PROBE_READ_TIMEOUT_S == 30.0
    monkeypatch.setattr(remote, "PROBE_READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(remote, "READ_TIMEOUT_S", 20.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel takes the connection; nothing ever reads or answers it
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        start = time.monotonic()
        status = cli.main(["classify", str(tiny_file(tmp_path)), "--server", url])
        took = time.monotonic() - start
    finally:
        silent.close()
    assert status == 1 and took < 5, took
    said = capsys.readouterr()
    assert said.err.splitlines()[0] == f"error: no answer from {url} within 0.5 s (GET /api/v1/models)", said.err
    assert "not sent: no answer from" in said.out  # the file's row


def test_a_server_that_takes_uploads_and_never_answers_ends_the_run_soon(tmp_path, monkeypatch, capsys):
    """tryout17: each try waited READ_TIMEOUT_S (300 s) and a timed-out try was tried again, 8 times: ~40 minutes
    per file. Now the file that got no answer fails (``no_answer``), and the files not yet sent fail unsent."""
    from webapp import cli

    assert remote.READ_TIMEOUT_S == 120.0
    monkeypatch.setattr(remote, "READ_TIMEOUT_S", 1.0)
    for i in range(6):
        Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / f"{i}.png")
    stub = Stub([], stall=True)
    try:
        start = time.monotonic()
        status = cli.main(["classify", "-q", "-f", "json", "--jobs", "2", str(tmp_path), "--server", stub.url])
        took = time.monotonic() - start
    finally:
        stub.shutdown()
    out = capsys.readouterr().out
    rows = json.loads(out)
    assert status == 1 and took < 5 and len(stub.arrivals) == 2, (took, len(stub.arrivals))  # one try each, 2 sent
    errors = [r["error"] for r in rows]
    assert len(errors) == 6 and {e["code"] for e in errors} == {"no_answer"}, errors
    assert sum(e["message"].startswith("not sent: ") for e in errors) == 4
    assert all("gave no answer within 1 s" in e["message"] for e in errors)


def test_a_server_gone_for_good_ends_the_files_not_yet_sent_soon(tmp_path, monkeypatch, capsys):
    """tryout30: the server stopped 8 s into 3,000 files, and each file left waited out its 8 tries and ~45 s of
    pauses before its connection_error: hours, where the bar said 27 minutes. Once a file's tries all met no server
    while nothing answered any other file, the files not yet sent end unsent, saying so."""
    from webapp import cli

    monkeypatch.setattr(retries, "MAX_TRIES", 3)
    for i in range(8):
        Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / f"{i}.png")
    stub = Stub([])
    answered = []
    stub.RequestHandlerClass.do_POST = lambda self, post=stub.RequestHandlerClass.do_POST: (
        post(self), answered.append(1), len(answered) == 2 and threading.Thread(target=lambda: (stub.shutdown(), stub.server_close())).start())
    try:
        start = time.monotonic()
        status = cli.main(["classify", "-q", "-f", "json", "--jobs", "1", str(tmp_path), "--server", stub.url])
        took = time.monotonic() - start
    finally:
        stub.server_close()
    rows = json.loads(capsys.readouterr().out)
    errors = [r["error"] for r in rows if r["error"]]
    # (a third upload may be answered on its kept-alive connection as the stub stops)
    assert status == 1 and len(errors) >= 5 and {e["code"] for e in errors} == {"connection_error"}, rows
    tried = [e for e in errors if not e["message"].startswith("not sent: ")]
    assert len(tried) == 1 and "gave up after 3 tries" in tried[0]["message"], errors  # one file waited, not six
    assert all(re.fullmatch(rf"not sent: the server at {re.escape(stub.url)} answered nothing for \d+ s \(.+\)",
                            e["message"]) for e in errors if e not in tried), errors
    assert took < 10, took


def test_a_file_waiting_between_tries_ends_as_soon_as_sending_stops():
    """tryout31: once the server was declared gone, a file still waiting out its backoff (up to 8 s) kept the run
    going that long before it ended. Its wait ends at once now, with its own failure and why it was not tried
    again; a wait with nothing stopping it lasts as long as it was asked to."""
    client = remote.Client("http://127.0.0.1:9", jobs=2)
    start = time.monotonic()
    assert client.pause(0.2) is False and time.monotonic() - start >= 0.2
    woke = []
    waiter = threading.Thread(target=lambda: woke.append((client.pause(30), time.monotonic())))
    waiter.start()
    time.sleep(0.1)
    stopped_at = time.monotonic()
    client.stopped = ("connection_error", "the server at x answered nothing for 9 s (refused)")
    waiter.join(5)
    assert woke and woke[0][0] is True and woke[0][1] - stopped_at < 1.0, woke
    assert client.pause(30) is True  # and every later wait is none


def test_a_missing_token_is_said_once_and_no_more_files_are_sent(tmp_path, capsys):
    """tryout17: without the token each of 10,000 photos would be read, scaled, uploaded and refused with its own
    401. After the first 401 the files not yet sent end unsent, with the server's words."""
    from webapp import cli

    for i in range(6):
        Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / f"{i}.png")
    stub = Stub([(401, None, "unauthorized")] * 6)
    try:
        status = cli.main(["classify", "-q", "-f", "json", "--jobs", "1", str(tmp_path), "--server", stub.url])
    finally:
        stub.shutdown()
    errors = [r["error"] for r in json.loads(capsys.readouterr().out)]
    assert status == 1 and len(stub.arrivals) == 1 and {e["code"] for e in errors} == {"unauthorized"}
    # in the CLI's words: which variable to set (the server's words are for scripts' headers; tryout18)
    said = "the server needs a token: set CLASSIFIER_API_TOKEN to it (it said: server busy)"
    assert sum(e["message"] == f"not sent: {said}" for e in errors) == 5 and said in [e["message"] for e in errors]


@pytest.mark.cli
def test_ctrl_c_ends_a_run_waiting_on_answers_at_once(tmp_path):
    """tryout17: Ctrl-C said "interrupted" and went on waiting for the pool's threads (up to their read timeout);
    a second one printed a traceback."""
    import signal

    stub = Stub([], stall=True)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "webapp", "classify", str(tiny_file(tmp_path)), "--server",
                                 stub.url], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=as_a_terminal_job)  # SIGINT as a terminal's job has it (CI: ignored)
        deadline = time.monotonic() + 60
        while not stub.arrivals and time.monotonic() < deadline:  # the upload is in: it waits on the answer
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        out, errors = proc.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        stub.shutdown()
    assert proc.returncode == 130 and took < 3, (proc.returncode, took, errors[-2000:])
    assert errors.rstrip().endswith("interrupted") and "Traceback" not in errors, errors[-2000:]


@pytest.mark.cli
def test_rows_are_written_as_they_are_ready_and_ctrl_c_keeps_them(tmp_path):
    """Every row was printed at the end of the run: a crash or Ctrl-C near the end lost them all (tryout17). The
    first file's row is out while the second waits on its answer, and after Ctrl-C the output is a whole JSON
    list of the rows done."""
    import signal

    for name in ("a.png", "b.png"):
        Image.new("RGB", (4, 4)).save(tmp_path / name)
    stub = Stub([], stall_from=1)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "webapp", "classify", "-f", "json", "--jobs", "1",
                                 str(tmp_path), "--server", stub.url], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=as_a_terminal_job)
        deadline = time.monotonic() + 60
        while len(stub.arrivals) < 2 and time.monotonic() < deadline:  # a.png answered, b.png waiting on its answer
            time.sleep(0.05)
        # a.png's row is written with the run still going; the "[" before it may come in a write of its own
        first, want, until = "", '"path": "' + str(tmp_path / "a.png") + '"', time.monotonic() + 10
        while want not in first and time.monotonic() < until:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                first += os.read(proc.stdout.fileno(), 1 << 16).decode()
        assert proc.poll() is None and '"path": "' + str(tmp_path / "a.png") + '"' in first, first
        proc.send_signal(signal.SIGINT)
        out, errors = proc.communicate(timeout=30)
    finally:
        stub.shutdown()
    assert proc.returncode == 130, errors[-2000:]
    rows = json.loads(first + out)
    assert [r["path"] for r in rows] == [str(tmp_path / "a.png")] and rows[0]["predictions"][0]["label"] == "kite"


@pytest.mark.cli
@pytest.mark.parametrize("quiet", [True, False])
def test_a_reader_that_leaves_ends_the_run(tmp_path, quiet):
    """``classify ... | head -2``: with rows written as they come, the closed pipe is found at the next row, and the
    run ends there; it sent every file still (the pool's threads, joined at exit) before its one quiet exit. Its
    exit status is 141 (128 + SIGPIPE, as a shell reports it), not 1 ("some files failed"); the progress bar ends
    its line."""
    for i in range(20):
        Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / f"{i:02}.png")
    stub = Stub([], delay=0.2)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "webapp", "classify", *(["-q"] if quiet else []), "-f", "csv",
                                 "--jobs", "1", str(tmp_path), "--server", stub.url], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        head = [proc.stdout.readline(), proc.stdout.readline()]  # the CSV header and the first file's row
        proc.stdout.close()  # as head(1) exits
        start = time.monotonic()
        errors = proc.stderr.read()
        proc.wait(timeout=30)
        took = time.monotonic() - start
    finally:
        stub.shutdown()
    assert head[0].startswith("path,rank") and "00.png" in head[1], head
    assert proc.returncode == 141 and "Traceback" not in errors, errors[-2000:]  # 128 + SIGPIPE: not "files failed"
    assert took < 3 and len(stub.arrivals) <= 6, (took, len(stub.arrivals))
    assert errors == "" if quiet else errors.endswith("img/s, failed=0, retried=0]\n"), errors[-2000:]


# -- local scaling ----------------------------------------------------------------------------------------
def test_big_photos_are_scaled_upright_and_described_as_the_original():
    data = shared_image("phone-12mp-exif-rotated.jpg").read_bytes()
    body, info = remote.scaled(data, 256)
    assert info == {"width": 4032, "height": 3024, "format": "JPEG"}  # upright, as the server reports it
    assert len(body) < len(data) / 20
    with Image.open(io.BytesIO(body)) as im:  # the server's resize of its own 1/4 DCT scale, upright, lossless
        assert im.format == "WEBP" and im.size == (341, 256) and "exif" not in im.info
        mine = im.convert("RGB")
    # The server's own first steps on the original (fast decode, then its Resize): the very same pixels.
    from webapp import imaging
    theirs = imaging.decode(data, max_pixels=10**8, min_side=256).image
    theirs = theirs.resize((341, 256), Image.Resampling.BILINEAR)
    assert mine.tobytes() == theirs.tobytes()
    kite = shared_image("kite.jpg").read_bytes()  # 1352x900: no DCT scale keeps 512 px; resized from full size
    body, _ = remote.scaled(kite, 256)
    with Image.open(io.BytesIO(body)) as im:
        assert im.size == (384, 256) and im.convert("RGB").tobytes() == \
            Image.open(io.BytesIO(kite)).convert("RGB").resize((384, 256), Image.Resampling.BILINEAR).tobytes()


def test_a_strip_is_sent_as_the_part_the_server_keeps():
    """Over 2:1, the server keeps the central 2:1 (imaging.center_limit) before its resize: so does the copy,
    and the model's input from the copy is the original's, value for value."""
    rng = random.Random(1)
    noise = Image.frombytes("RGB", (300, 60), bytes(rng.randrange(256) for _ in range(300 * 60 * 3)))
    strip = encode(noise.resize((3000, 600), Image.Resampling.BICUBIC), "JPEG", quality=95)
    body, info = remote.scaled(strip, 256)
    assert info == {"width": 3000, "height": 600, "format": "JPEG"}
    with Image.open(io.BytesIO(body)) as im:
        assert im.format == "WEBP" and im.size == (512, 256)
        copy = im.convert("RGB")
    from webapp import imaging, models
    transform = imaging.build_transform(models.LITE0_PREPROCESSING)
    want = imaging.preprocess(imaging.decode(strip, max_pixels=10**8, min_side=256).image, transform)
    assert (imaging.preprocess(copy, transform) == want).all()


def test_a_jpeg_with_more_images_after_the_photo_is_scaled_as_the_jpeg_it_is():
    """A phone JPEG with a gain map or depth map after the photo, which Pillow opens as "MPO", travelled as the
    whole file (3 MB for 12 MP) described as MPO, which the server refused as an original_format. It is a JPEG:
    scaled to the very copy of the same JPEG without the images after it, described as JPEG; cut short and
    closed by EOI it goes as it is, for the server to refuse."""
    with Image.open(io.BytesIO(shared_image("phone-12mp-exif-rotated.jpg").read_bytes())) as im:
        plain = encode(im, "JPEG", quality=90, exif=im.getexif())
        out = io.BytesIO()
        im.save(out, format="MPO", quality=90, exif=im.getexif(), save_all=True, append_images=[im.reduce(8)])
    multi = out.getvalue()
    assert Image.open(io.BytesIO(multi)).format == "MPO"
    body, info = remote.scaled(multi, 256)
    assert info == {"width": 4032, "height": 3024, "format": "JPEG"}  # upright, as the server reports it
    assert (body, info) == remote.scaled(plain, 256) and len(body) < len(multi) / 20
    cut = multi[:len(plain) // 2] + b"\xff\xd9"
    assert remote.scaled(cut, 256)[0] == cut


def test_small_or_unreadable_files_are_sent_as_they_are():
    scream = shared_image("scream.jpg").read_bytes()  # 352x448: at or under the size already
    assert remote.scaled(scream, 352) == (scream, {"width": 352, "height": 448, "format": "JPEG"})
    rng = random.Random(0)  # noise at JPEG quality 10: a lossless copy of it would be larger than the file
    noisy = Image.frombytes("RGB", (600, 400), bytes(rng.randrange(256) for _ in range(600 * 400 * 3)))
    small = encode(noisy, "JPEG", quality=10)
    assert remote.scaled(small, 256) == (small, {"width": 600, "height": 400, "format": "JPEG"})
    png = encode(noisy, "PNG")  # not a JPEG: the server's decode has no reduced scale to mirror
    assert remote.scaled(png, 256) == (png, {"width": 600, "height": 400, "format": "PNG"})
    assert remote.scaled(b"not a photo", 256) == (b"not a photo", None)


def test_what_the_server_would_refuse_is_sent_as_it_is_and_pillow_stays_quiet():
    """A copy of a JPEG the server refuses would be a good photo: one cut short and closed by EOI at any point
    the server's check catches, and one over the pixel limit, go unscaled; Pillow's warnings about a damaged
    EXIF block (a tag pointing past the end of the file) never reach the terminal."""
    dog = shared_image("dog.jpg").read_bytes()  # 768x576: scaled to 341x256 when whole
    whole, _ = remote.scaled(dog, 256)
    assert whole != dog
    for kept in (0.2, 0.5, 0.8):
        cut = dog[:int(len(dog) * kept)] + b"\xff\xd9"
        assert remote.scaled(cut, 256) == (cut, {"width": 768, "height": 576, "format": "JPEG"}), kept
    with Image.open(io.BytesIO(dog)) as im:  # progressive and cut before its last scan: blurred, not grey
        progressive = encode(im, "JPEG", quality=90, progressive=True)
    assert remote.scaled(progressive, 256)[0] != progressive
    for kept in (0.1, 0.4):
        cut = progressive[:int(len(progressive) * kept)] + b"\xff\xd9"
        assert remote.scaled(cut, 256) == (cut, {"width": 768, "height": 576, "format": "JPEG"}), kept
    assert remote.scaled(dog, 256, max_pixels=768 * 576) == (whole, remote.scaled(dog, 256)[1])  # at the limit
    assert remote.scaled(dog, 256, max_pixels=768 * 576 - 1)[0] == dog
    exif = b"Exif\0\0II*\0\x08\0\0\0\x02\0" + b"\x0f\x01\x02\0\xff\xff\0\0\0\0\x10\0" \
        + b"\x12\x01\x03\0\x01\0\0\0\x06\0\0\0" + b"\0" * 4  # Make: 65535 bytes past the end; Orientation 6
    damaged = dog[:2] + b"\xff\xe1" + (len(exif) + 2).to_bytes(2, "big") + exif + dog[2:]
    body, info = remote.scaled(damaged, 256)
    assert info == {"width": 576, "height": 768, "format": "JPEG"} and body != damaged  # upright, scaled
    # What reaches a terminal: a fresh process, Python's own warning filters, scaling the file twice (the
    # filters are installed once per process, on the first file).
    script = ("import sys; from webapp.cli import scaling; data = sys.stdin.buffer.read(); "
              "[scaling.scaled(data, 256) for _ in range(2)]; import warnings; "
              "warnings.warn_explicit('a check that warnings print', UserWarning, 'check', 1)")
    out = subprocess.run([sys.executable, "-c", script], input=damaged, cwd=ROOT, capture_output=True, timeout=60)
    seen = [line for line in out.stderr.decode().splitlines() if "Warning" in line]
    assert out.returncode == 0 and seen == ["check:1: UserWarning: a check that warnings print"], out.stderr


def test_a_jpeg_the_server_refuses_though_libjpeg_decodes_it_is_sent_as_it_is():
    """tryout19: a JPEG with a 0 DC quantizer and one whose colour components come in separate scans, cut after
    the luma's, were scaled here into good copies and got labels where the API answers 400; so was a text copy
    (LF made CR LF) of the 12 MP photo, which libjpeg decodes into noise. Each goes as it is now."""
    dog = bytearray(shared_image("dog.jpg").read_bytes())
    zero_dc = bytearray(dog)
    at = zero_dc.index(b"\xff\xdb")
    zero_dc[at + 5] = 0  # the first table's DC entry (8-bit precision: after length and Pq/Tq)
    grey = encode(Image.open(io.BytesIO(bytes(dog))).convert("L"), "JPEG", quality=90)
    sof = grey.index(b"\xff\xc0")  # the grey JPEG's frame made 3-component: its one scan is the luma's
    frame = grey[sof + 4:sof + 9] + bytes([3]) + bytes([1, 0x11, 0, 2, 0x11, 0, 3, 0x11, 0])
    luma_only = grey[:sof + 2] + (len(frame) + 2).to_bytes(2, "big") + frame + grey[sof + 2 + int.from_bytes(
        grey[sof + 2:sof + 4], "big"):]
    text_copy = re.sub(rb"(?<!\r)\n", b"\r\n", shared_image("phone-12mp.jpg").read_bytes())
    for data in (bytes(zero_dc), luma_only, text_copy):
        assert scaling.refused_as_it_is(data)
        assert remote.scaled(data, 256)[0] == data
    assert not scaling.refused_as_it_is(bytes(dog)) and remote.scaled(bytes(dog), 256)[0] != bytes(dog)


@pytest.mark.cli
def test_skipped_photos_are_named_and_no_image_file_is_a_usage_error_as_locally(tmp_path):
    """As local classify: a HEIC in a folder is named with why and counted in the summary; a folder with no
    image file (empty, or only a HEIC) is exit 2 before anything is sent."""
    stub = Stub([])
    try:
        mixed = tmp_path / "mixed"
        mixed.mkdir()
        (mixed / "photo.heic").write_bytes(b"\0\0\0\x18ftypheic" + bytes(100))
        Image.new("RGB", (4, 4)).save(mixed / "tiny.png")
        out = run_cli(str(mixed), "--server", stub.url)
        assert out.returncode == 0, out.stderr
        assert "photo.heic: skipped: HEIC" in out.stderr, out.stderr
        assert "1 file: 1 classified, 0 failed" in out.stderr and "skipped in folders: 1 photo" in out.stderr
        empty, only_heic = tmp_path / "empty", tmp_path / "only"
        empty.mkdir()
        only_heic.mkdir()
        (only_heic / "photo.heic").write_bytes(b"\0\0\0\x18ftypheic" + bytes(100))
        for folder in (empty, only_heic):
            out = run_cli(str(folder), "--server", stub.url)
            assert out.returncode == 2 and "error: no image files in" in out.stderr, out.stderr
        assert "photo.heic: skipped: HEIC" in out.stderr and "skipped in folders: 1 photo" in out.stderr
        assert len(stub.arrivals) == 1  # only tiny.png was ever sent
    finally:
        stub.shutdown()
