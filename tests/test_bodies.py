"""What the headers decide is answered before the body; stalled uploads are bounded (webapp/bodies.py).

Raw sockets against a real gunicorn: an HTTP client library would hide exactly what is tested here
(when the answer arrives relative to the body, whether ``100 Continue`` is sent, when the
connection closes).
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from PIL import Image

from conftest import encode, small_png
from serving import Server
from webapp.bodies import DRAIN_SECONDS

LIMIT = 1024 * 1024  # MAX_UPLOAD_BYTES of the server under test
BODY_TIMEOUT = 2.0
TOKEN = "body-test-token"
AUTH = f"Authorization: Bearer {TOKEN}\r\n"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("bodies") / "server.log", args=("--no-control-socket",),
                    MODEL="resnet18_seeded", COMPILE=0, WORKERS=1, THREADS=1, MAX_BATCH_SIZE=2,
                    MAX_UPLOAD_BYTES=LIMIT, BODY_TIMEOUT_S=BODY_TIMEOUT, API_TOKEN=TOKEN)
    try:
        server.wait_ready(workers=1)
        yield server
    finally:
        server.stop()


def connect(srv) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(path: str = "/api/v1/predict", *, length: int | None = None, ctype: str = "image/png", extra: str = AUTH,
         chunked: bool = False, expect: bool = False) -> bytes:
    lines = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n{extra}"
    lines += "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {length}\r\n"
    lines += "Expect: 100-continue\r\n" if expect else ""
    return (lines + "\r\n").encode()


def read_status(sock: socket.socket, timeout: float = 5.0) -> tuple[int, bytes]:
    """The status of the first response that arrives within ``timeout`` s, and all bytes read: its head and, where it
    gives a Content-Length, its body, whichever of them came (they may come apart: a check of a 400's words read its
    head alone once, in CI). Raises the socket's timeout where not even its first line came."""
    sock.settimeout(timeout)
    data = b""
    while not (b"\r\n" in data and _whole(data)):
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if b"\r\n" not in data:
                raise
            break
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]), data


def _whole(data: bytes) -> bool:
    """Whether ``data`` holds a response's whole head and as many body bytes as its Content-Length says."""
    if b"\r\n\r\n" not in data:
        return False
    head, rest = data.split(b"\r\n\r\n", 1)
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(rest) >= int(line.split(b":", 1)[1])
    return True


def read_answer(sock: socket.socket, timeout: float) -> tuple[int, bytes]:
    """The status (0 where what arrived is not the start of an answer) and every byte read from ``sock`` until
    the server closes it, at most ``timeout`` s."""
    sock.settimeout(timeout)
    data = b""
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, socket.timeout, ConnectionResetError):
        pass
    return (int(data.split(b" ", 2)[1]) if data[:5] == b"HTTP/" else 0), data


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the server closes the connection within ``seconds`` (reading and dropping what it sends)."""
    sock.settimeout(seconds)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if not sock.recv(65536):
                return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True
    return False


def test_over_limit_content_length_is_answered_before_the_body(srv):
    with connect(srv) as sock:
        sock.sendall(head(length=64 * 1024 * 1024))
        sent = time.monotonic()
        sock.sendall(b"\0" * 65536)  # some of the body, then nothing more
        status, data = read_status(sock)
        took = time.monotonic() - sent
        assert status == 413 and b'"too_large"' in data + sock.recv(65536)
        assert took < 0.5, f"413 after {took:.3f} s"
        assert closed_within(sock, 5.0), "the connection stays open after a refusal"


def test_a_body_shorter_than_its_content_length_is_400_saying_so(srv):
    """The client sends 100 of 1,000 declared bytes and closes its side: 400 ``bad_request`` naming both
    numbers (not 499: the client is there to read it), and the connection closes (it cannot be reused)."""
    with connect(srv) as sock:
        sock.sendall(head(length=1000) + small_png()[:100])
        sock.shutdown(socket.SHUT_WR)
        status, data = read_status(sock)
        data += sock.recv(65536)
        assert status == 400 and b'"bad_request"' in data, data
        assert b"ended after 100 of the 1000 bytes" in data, data
        assert b"Connection: close" in data
        assert closed_within(sock, 5.0)


@pytest.mark.parametrize("headers", ["Content-Length: abc", "Content-Length: -5", "Content-Length: 1e3",
                                     "Content-Length: 10\r\nContent-Length: 10",
                                     "Content-Length: 10\r\nTransfer-Encoding: chunked"])
def test_a_content_length_that_is_not_a_size_gets_a_json_400(srv, headers):
    """gunicorn refuses it before the app sees the request; the answer is still the API's JSON shape, and
    its words cover each fault gunicorn reports the same way (not a size, twice, beside chunked)."""
    head_part, body = _raw_answer(srv, f"POST /api/v1/predict HTTP/1.1\r\nHost: x\r\n{headers}\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 400 ") and b"Content-Type: application/json" in head_part, raw
    error = json.loads(body)["error"]
    assert error["code"] == "bad_request" and error["status"] == 400
    assert "Content-Length must be the body's size in bytes" in error["message"], error
    assert "given once" in error["message"] and "Transfer-Encoding: chunked" in error["message"]


def _raw_answer(srv, request_text: str) -> tuple[bytes, bytes]:
    """Send ``request_text`` on a new connection; the answer's head and body, read to its Content-Length
    (or to the server's close without one). Not to the close alone: after a refusal the server drains what
    the client may still send for up to ``DRAIN_SECONDS`` before it closes, 2 s a test for nothing here."""
    with connect(srv) as sock:
        sock.sendall(request_text.encode())
        sock.settimeout(5.0)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
            head_part, sep, body = raw.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^Content-Length:\s*(\d+)\r?$", head_part) if sep else None
            if length and len(body) >= int(length.group(1)):
                break
    head_part, _, body = raw.partition(b"\r\n\r\n")
    return head_part, body


_REFUSED_BY_GUNICORN = [  # (request line's method and path -> the whole request, status)
    (lambda p: f"GET {p}" + "a" * 9000 + " HTTP/1.1\r\nHost: x\r\n\r\n", 414),  # over limit_request_line
    (lambda p: f"GET {p} HTTP/1.1\r\nHost: x\r\n" + "".join(f"X-H{i}: v\r\n" for i in range(150)) + "\r\n", 431),
    (lambda p: f"POST {p} HTTP/1.1\r\nHost: x\r\nExpect: foo\r\nContent-Length: 0\r\n\r\n", 417),
]


@pytest.mark.parametrize("make, status", _REFUSED_BY_GUNICORN)
def test_what_gunicorn_refuses_without_a_row_is_http_error_in_the_json_shape(srv, make, status):
    """A request line or headers over gunicorn's limits never reach the app: the answer is still the API's
    JSON, with its own status and the table's last row's code (``http_error``, webapp/errors.py)."""
    from webapp.errors import OTHER_HTTP_CODE

    head_part, body = _raw_answer(srv, make("/healthz"))
    assert head_part.startswith(f"HTTP/1.1 {status} ".encode()) and b"application/json" in head_part, head_part
    error = json.loads(body)["error"]
    assert error["code"] == OTHER_HTTP_CODE == "http_error" and error["status"] == status and error["message"]


@pytest.mark.parametrize("make, status", [*_REFUSED_BY_GUNICORN, (
    lambda p: f"POST {p} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: abc\r\n\r\n{{}}",
    400)])
def test_what_gunicorn_refuses_under_v2_is_in_the_protocols_error_shape(srv, make, status):
    """Found by a fresh-user tryout: under /v2 the Open Inference Protocol's clients read ``error`` as a
    string; gunicorn's refusals there came in the API's nested shape. The path is read as far as gunicorn got."""
    head_part, body = _raw_answer(srv, make("/v2/models/classifier/infer"))
    assert head_part.startswith(f"HTTP/1.1 {status} ".encode()), head_part
    error = json.loads(body)["error"]
    assert isinstance(error, str) and error.split(":")[0] in ("http_error", "bad_request"), error


@pytest.mark.parametrize("request_text, status, echoed", [
    ("POST /api/v1/predict HTTP/1.1\r\nHost: x\r\nX-Request-ID: tryout-42\r\nContent-Length: 12x\r\n\r\n", 400, True),
    ("POST /api/v1/predict HTTP/1.1\r\nHost: x\r\nExpect: foo\r\nContent-Length: 2000000\r\n\r\n", 417, False),
    (f"POST /api/v1/predict HTTP/1.1\r\nHost: x\r\n{'X-H: v' * 2000}\r\nContent-Length: 2000000\r\n\r\n", 431, False),
], ids=["bad-content-length", "expect-foo", "header-too-long"])
def test_what_gunicorn_refuses_has_a_request_id_and_never_resets_a_body_still_coming(srv, request_text, status, echoed):
    """Found by a fresh-user tryout: gunicorn's own refusals had no X-Request-ID (the README: every response
    has one), and closing with the client's body unread reset the connection under a client still uploading
    (a stack that drops received data on a reset loses the answer). Now the id is there (the client's own
    where gunicorn parsed it) and the rest of the upload is read and dropped, bounded, before the close."""
    with connect(srv) as sock:
        sock.sendall(request_text.encode())
        sock.sendall(b"x" * 1_000_000)  # raised ConnectionResetError / BrokenPipeError before
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(5.0)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head_part, _, body = raw.partition(b"\r\n\r\n")
    assert head_part.startswith(f"HTTP/1.1 {status} ".encode()), raw[:300]
    request_id = dict(line.split(": ", 1) for line in head_part.decode().split("\r\n")[1:])["X-Request-ID"]
    assert request_id == "tryout-42" if echoed else len(request_id) == 32, request_id
    assert json.loads(body)["error"]["status"] == status


@pytest.mark.parametrize("request_text", [
    "POST /api/v1/predict HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: abc\r\n\r\n",
    "POST /api/v1/predict HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 200-ok\r\nContent-Length: 9\r\n\r\n",
], ids=["bad-content-length", "expect-200-ok"])
def test_what_gunicorn_refuses_ends_the_connection_at_once_for_a_client_reading_to_its_end(srv, request_text):
    """tryout27: a client that sent no body and reads until the connection ends (``Connection: close``) got its
    400/417 and then waited 2 s (the bounded drain of a body that never came) for the end. The answer's side is
    closed as soon as it is written; the drain still reads what a client uploading anyway sends."""
    with connect(srv) as sock:
        sock.sendall(request_text.encode())
        sock.settimeout(5.0)
        t0, raw = time.monotonic(), b""
        while chunk := sock.recv(65536):
            raw += chunk
        took = time.monotonic() - t0
    assert raw.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 417 ")) and raw.endswith(b"}"), raw[:200]
    assert took < 1.0, f"the connection ended {took:.2f} s after the request"


_PNG_CHUNK = b"%x\r\n" % len(small_png()) + small_png()


@pytest.mark.parametrize("ctype", ["image/png", "multipart/form-data; boundary=xyz"])
@pytest.mark.parametrize("body, closes", [
    (b"zz\r\n" + small_png() + b"\r\n0\r\n\r\n", False),  # chunk size not hex
    (b"-5\r\n" + small_png() + b"\r\n0\r\n\r\n", False),  # negative chunk size
    (_PNG_CHUNK + b"XX0\r\n\r\n", False),  # no CRLF after the chunk's data
    (b"%x;;\r\n" % len(small_png()) + small_png() + b"\r\n0\r\n\r\n", False),  # malformed chunk extension
    (b"%x\n" % len(small_png()) + small_png() + b"\n0\n\n", False),  # bare LF line ends
    (_PNG_CHUNK + b"\r\n0\r\nnot a trailer\r\n\r\n", False),  # malformed trailer
    (b"1" + b" " * 9000 + b"\r\n", False),  # a chunk-size line with no end
    (_PNG_CHUNK + b"\r\n0\r\n", True),  # cut off after the last chunk, then the client closes its side
    (_PNG_CHUNK[:100], True),  # cut off inside a chunk, then the client closes its side
], ids=["not-hex", "negative", "no-crlf", "bad-extension", "bare-lf", "bad-trailer", "endless-size-line",
        "cut-after-last-chunk", "cut-in-chunk"])
def test_a_malformed_chunked_body_is_a_400_not_a_500(srv, ctype, body, closes):
    """A chunked body gunicorn cannot de-chunk (RFC 9112 section 7.1) is the client's error: 400 ``bad_request``
    saying so, and the connection closes (the reader cannot find where a next request would start)."""
    with connect(srv) as sock:
        sock.sendall(head(chunked=True, ctype=ctype) + body)
        if closes:
            sock.shutdown(socket.SHUT_WR)
        status, data = read_status(sock)
        data += sock.recv(65536)
        assert status == 400 and b'"bad_request"' in data, data[:400]
        assert b"chunked" in data.partition(b"\r\n\r\n")[2], data[:400]  # the message says what was wrong
        assert b"Connection: close" in data
        assert closed_within(sock, DRAIN_SECONDS + 2)


def test_a_body_in_tiny_chunks_is_a_400_at_once_and_one_in_8_kb_chunks_is_answered(srv):
    """Tiny chunks cost the server far more than their bytes (tryout21: a 3 MB photo in 1-byte chunks, 12.5 s of
    CPU, with /healthz waiting 7-9 s behind two of them): once the first 4,096 average under 128 bytes, 400
    naming that, read by the client still sending (no reset), and the connection closes. A body in 8 KB chunks
    (http.client's), or in 200-byte ones, is answered as any."""
    from webapp.bodies import CHUNKS_JUDGED

    photo = np.random.default_rng(3).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    png = encode(Image.fromarray(photo), "PNG")
    assert len(png) > 2 * CHUNKS_JUDGED
    tiny = b"".join(b"1\r\n%c\r\n" % b for b in png) + b"0\r\n\r\n"
    with connect(srv) as sock:
        start = time.monotonic()
        sock.sendall(head(chunked=True) + tiny)
        status, data = read_status(sock)
        data += sock.recv(65536)
        assert time.monotonic() - start < 2.0
        assert status == 400 and b'"bad_request"' in data and b"chunks of 1 bytes on average" in data, data[:600]
        assert b"Connection: close" in data
    larger = encode(Image.fromarray(np.random.default_rng(4).integers(0, 256, (500, 560, 3), dtype=np.uint8)), "PNG")
    for photo, size in ((png, 8192), (larger, 200)):  # http.client's 8 KB; a binary file sent line by line: ~256
        assert len(photo) // size > CHUNKS_JUDGED or size > 256
        body = b"".join(b"%x\r\n%s\r\n" % (len(photo[i:i + size]), photo[i:i + size])
                        for i in range(0, len(photo), size))
        with connect(srv) as sock:
            sock.sendall(head(chunked=True, extra=AUTH + "Connection: close\r\n") + body + b"0\r\n\r\n")
            status, data = read_answer(sock, 30)
            assert status == 200 and b'"predictions"' in data, (size, data[:600])


def test_tiny_chunks_after_ordinary_ones_are_a_400_too_and_healthz_is_not_held(srv):
    """Found by a fresh-user tryout (tryout24): the average was judged once, at the 4,096th piece, so 4,096 chunks of
    160 bytes and then the rest of a photo in 1-byte ones were de-chunked for 9.7 s of CPU, with /healthz held 9 s.
    The average is judged at every piece from the 4,096th on: 400 at once, and the hub keeps answering."""
    from webapp.bodies import CHUNKS_JUDGED

    photo = np.random.default_rng(5).integers(0, 256, 2_000_000, dtype=np.uint8).tobytes()
    first = CHUNKS_JUDGED * 160
    body = b"".join(b"a0\r\n%s\r\n" % photo[i:i + 160] for i in range(0, first, 160))
    body += b"".join(b"1\r\n%c\r\n" % b for b in photo[first:]) + b"0\r\n\r\n"
    with connect(srv) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 2**20)
        start = time.monotonic()
        sender = threading.Thread(target=lambda: _send_quietly(sock, head(chunked=True) + body), daemon=True)
        sender.start()
        health = requests.get(srv.url + "/healthz", timeout=10)  # answered meanwhile (a timing: loose, shared box)
        assert health.status_code == 200 and health.elapsed.total_seconds() < 5.0, health.elapsed
        status, data = read_status(sock, timeout=10)
        assert status == 400 and b"bytes on average" in data, data[:600]  # was 200, after 9.7 s of de-chunking
        assert time.monotonic() - start < 8.0


@pytest.mark.parametrize("size", [LIMIT + 1, 2**80])
def test_a_chunk_declared_over_the_limit_is_a_413_at_once(srv, size):
    """Found by fresh-user tryouts: a chunk size line of 2^80 bytes, then a stall, got 408 when the body timeout
    ran out (30 s by default), where a Content-Length as large is a 413 at once. The size line decides it."""
    with connect(srv) as sock:
        start = time.monotonic()
        sock.sendall(head(chunked=True) + b"%x\r\n" % size + b"abc")  # and nothing more
        status, data = read_answer(sock, BODY_TIMEOUT + 5)
        assert status == 413 and b'"too_large"' in data and f"the limit is {LIMIT:,}".encode() in data, data[:600]
        assert time.monotonic() - start < BODY_TIMEOUT  # not the 408 of a stalled body
        assert b"Connection: close" in data


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    """``sock.sendall(data)``, where the server may close before it has all of it."""
    try:
        sock.sendall(data)
    except OSError:
        pass


def test_a_malformed_chunked_body_left_unread_is_dropped_quietly(srv):
    """A request answered without reading its body (``GET /healthz``) has the rest drained after the answer;
    a malformed chunked body there ends the drain (and the connection) with no error logged."""
    before = srv.output().count("Traceback")
    with connect(srv) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n")
        status, _ = read_status(sock)
        assert status == 200
        assert closed_within(sock, DRAIN_SECONDS + 2)
    time.sleep(0.3)  # the drain runs after the answer is written
    assert srv.output().count("Traceback") == before, srv.output()[-3000:]


@pytest.mark.parametrize("case, status", [
    ("over-limit", 413), ("wrong-type", 415), ("no-token", 401),
])
def test_expect_100_continue_gets_the_refusal_instead_of_100(srv, case, status):
    length = 64 * 1024 * 1024 if case == "over-limit" else 1000
    ctype = "text/plain" if case == "wrong-type" else "image/png"
    extra = "" if case == "no-token" else AUTH
    with connect(srv) as sock:
        started = time.monotonic()
        sock.sendall(head(length=length, ctype=ctype, extra=extra, expect=True))
        got, data = read_status(sock)
        assert got == status, data[:200]
        assert b"100 Continue" not in data
        assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("path", ["/", "/api/v1/predict"])
@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_body_type_no_photo_comes_in_is_415_before_the_body(srv, path, ctype):
    """A form posted without ``enctype="multipart/form-data"`` (urlencoded) carries no photo, only its name: the
    headers say so, on the page as on the API, so the 415 comes at once, not after reading the body (or a 408)."""
    with connect(srv) as sock:
        started = time.monotonic()
        sock.sendall(head(path, length=100_000, ctype=ctype, expect=True))
        status, data = read_status(sock)
        assert status == 415 and b"100 Continue" not in data, data[:300]
        assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("path, ctype", [("/api/v1/predict", "image/jpeg"), ("/api/v1/predict", "multipart/form-data; "
                                          "boundary=b"), ("/", "multipart/form-data; boundary=b")])
def test_a_compressed_upload_is_415_before_the_body_naming_what_is_taken(srv, path, ctype):
    """``Content-Encoding: gzip`` on an upload: the gzip bytes were read as the photo ("a gzip file") or as a
    malformed multipart body, and a client that labels a plain body gzip was answered as if it had not. Decidable
    from the headers: 415 at once, ``Accept-Encoding: identity`` (RFC 9110 15.5.16), the message saying to send
    the photo as it is. (/v2's JSON, which compresses, takes gzip and deflate: tests/test_v2.py.)"""
    with connect(srv) as sock:
        started = time.monotonic()
        sock.sendall(head(path, length=100_000, ctype=ctype, extra=AUTH + "Content-Encoding: gzip\r\n", expect=True))
        status, data = read_status(sock)
        data += sock.recv(65536)
        assert status == 415 and b"100 Continue" not in data, data[:300]
        assert time.monotonic() - started < 0.5
        assert b"Accept-Encoding: identity" in data and b"Content-Encoding gzip is not accepted" in data, data[:600]


@pytest.mark.parametrize("coding, status, start", [
    ("deflate, chunked", 415, b"HTTP/1.1 415 "), ("compress, chunked", 415, b"HTTP/1.1 415 "),
    # one HTTP does not know: gunicorn's own 501, under its right name (it said "501 Bad Request"; tryout18)
    ("foo, chunked", 501, b"HTTP/1.1 501 Not Implemented\r\n")])
def test_each_transfer_coding_is_refused_as_the_error_table_says(srv, coding, status, start):
    with connect(srv) as sock:
        sock.sendall(head(chunked=True).replace(b"Transfer-Encoding: chunked", f"Transfer-Encoding: {coding}".encode())
                     + b"5\r\nhello\r\n0\r\n\r\n")
        got, data = read_status(sock)
        assert got == status and data.startswith(start), data[:300]


@pytest.mark.parametrize("path", ["/api/v1/predict", "/v2/models/classifier/infer"])
def test_a_body_gzipped_as_its_transfer_coding_is_415_not_read_as_the_photo(srv, path):
    """gunicorn takes ``Transfer-Encoding: gzip, chunked`` and undoes the chunking only: the gzip bytes were read as
    the photo (a plain body so labelled was classified). 415 from the headers, saying what to send."""
    with connect(srv) as sock:
        ctype = "application/json" if path.startswith("/v2") else "image/png"
        gzipped = head(path, chunked=True, ctype=ctype).replace(b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked")
        sock.sendall(gzipped + b"5\r\nhello\r\n0\r\n\r\n")
        status, data = read_status(sock)
        data += sock.recv(65536)
        assert status == 415 and b"Transfer-Encoding gzip, chunked is not accepted here" in data, data[:600]


def test_expect_100_continue_gets_100_when_the_body_is_wanted(srv):
    body = small_png()
    with connect(srv) as sock:
        sock.sendall(head(length=len(body), expect=True))
        status, data = read_status(sock)
        assert status == 100 and data.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        rest = data[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
        if not rest:
            status, rest = read_status(sock)
        assert rest.startswith(b"HTTP/1.1 200"), rest[:200]


def test_an_http_1_0_client_never_gets_100_continue(srv):
    """RFC 9110 section 10.1.1: a server MUST ignore a 100-continue expectation in an HTTP/1.0 request (and never
    sends a 1xx to an HTTP/1.0 client, section 15.2): such a client would read ``100`` as its final answer."""
    body = small_png()
    with connect(srv) as sock:
        sock.sendall(head(length=len(body), expect=True).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1) + body)
        status, data = read_status(sock)
        assert status == 200 and b"100 Continue" not in data, data[:200]


@pytest.mark.parametrize("path, ctype", [("/api/v1/predict", "image/png"), ("/api/v1/predict", "multipart/form-data; "
                                          "boundary=b"), ("/", "multipart/form-data; boundary=b"),
                                          ("/v2/models/resnet18_seeded/infer", "application/json")])
def test_an_http_1_0_body_without_content_length_is_411(srv, path, ctype):
    """HTTP/1.0 has no chunked encoding: a body it sends without Content-Length cannot be delimited, and gunicorn
    reads it as none. The photo that client did send was answered "the file is empty (0 bytes)"; now 411 says
    what to send. With Content-Length the same request is answered."""
    body = small_png() * 20  # ~100 KB the server never reads as the body: drained after the answer, not reset
    request = f"POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: {ctype}\r\n{AUTH}\r\n".encode()
    with connect(srv) as sock:
        sock.sendall(request + body)
        start, data = time.monotonic(), b""
        while chunk := sock.recv(65536):  # as an HTTP/1.0 client reads: to the end of the connection, no reset
            data += chunk
        assert time.monotonic() - start < DRAIN_SECONDS, "the server held the connection open after its answer"
        assert data.startswith(b"HTTP/1.0 411 "), data[:300]
        assert b"length_required" in data and b"Content-Length" in data, data[:600]
    with connect(srv) as sock:
        sock.sendall(head(length=len(body)).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1) + body)
        assert read_status(sock)[0] == 200


def test_chunked_body_over_the_limit_gets_a_413_the_client_receives(srv):
    with connect(srv) as sock:
        sock.sendall(head(chunked=True))
        chunk = b"\0" * 65536
        sent = 0
        try:
            while sent <= LIMIT + 2 * len(chunk):
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: the answer is already on its way
        status, data = read_status(sock)
        assert status == 413 and b"too_large" in data + (sock.recv(65536) or b"")


@pytest.mark.parametrize("size, status, code", [(200_000, 401, "unauthorized"), (12 * LIMIT, 413, "too_large")])
def test_a_client_that_sends_its_whole_body_first_reads_the_refusal(srv, size, status, code):
    """Python's ``http.client`` sends every byte of the body before it reads (and, unlike urllib3, gives up on
    a reset while sending): the refusal, answered before the body, must still reach it after the server
    drained the rest (more than the sockets' buffers hold), and later requests are served as before."""
    headers = {"Content-Type": "image/png", **({} if status == 401 else {"Authorization": f"Bearer {TOKEN}"})}
    for _ in range(3):
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        try:
            conn.request("POST", "/api/v1/predict", body=b"\0" * size, headers=headers)
            resp = conn.getresponse()
            body = json.loads(resp.read())
        finally:
            conn.close()
        assert resp.status == status and body["error"]["code"] == code, body
        assert resp.getheader("Connection") == "close"
    assert _normal_request(srv) < 30


def test_a_stalled_upload_gets_408_within_the_timeout(srv):
    with connect(srv) as sock:
        sock.sendall(head(length=100_000) + b"\x89PNG" + b"\0" * 996)
        started = time.monotonic()
        status, data = read_status(sock, timeout=BODY_TIMEOUT + 5)
        took = time.monotonic() - started
        assert status == 408 and b'"body_timeout"' in data + sock.recv(65536)
        assert BODY_TIMEOUT - 0.2 <= took <= BODY_TIMEOUT + 2.0, took
        assert closed_within(sock, 5.0)


def _multipart(photo: bytes) -> tuple[str, bytes]:
    return "multipart/form-data; boundary=b0undary", (
        b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="slow.png"\r\n'
        b"Content-Type: image/png\r\n\r\n" + photo + b"\r\n--b0undary--\r\n")


@pytest.mark.parametrize("form", ["raw", "multipart"])
def test_a_slow_upload_that_never_pauses_long_is_answered_not_timed_out(srv, form):
    """The body timeout is the longest pause between bytes, as its setting says, not the longest read: an upload
    over a slow link (a 3 MB photo at 60 KB/s takes 50 s) whose bytes keep coming is answered. It got 408 once the
    whole body had taken BODY_TIMEOUT_S, pauses of a fifth of it notwithstanding (the limit was on the app's read,
    which gunicorn's reader serves with as many socket reads as the bytes need)."""
    ctype, body = ("image/png", small_png()) if form == "raw" else _multipart(small_png())
    pieces = 10
    step = -(-len(body) // pieces)
    with connect(srv) as sock:
        sock.sendall(head(length=len(body), ctype=ctype))
        started = time.monotonic()
        for at in range(0, len(body), step):
            sock.sendall(body[at:at + step])
            time.sleep(BODY_TIMEOUT / 5)
        assert time.monotonic() - started > BODY_TIMEOUT * 1.5  # the whole upload outlasts the timeout
        status, data = read_status(sock, timeout=10)
        assert status == 200, data[:300]


def _normal_request(srv) -> float:
    t0 = time.perf_counter()
    resp = requests.post(srv.url + "/api/v1/predict", data=small_png(), timeout=30,
                         headers={"Content-Type": "image/png", "Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200, resp.text[:200]
    return time.perf_counter() - t0


def test_fifty_stalled_uploads_do_not_slow_the_others(srv):
    before = sorted(_normal_request(srv) for _ in range(8))[4]
    stalled = [connect(srv) for _ in range(50)]
    try:
        for sock in stalled:
            sock.sendall(head(length=500_000) + b"\0" * 1000)
        started = time.monotonic()
        during = sorted(_normal_request(srv) for _ in range(8))[4]
        # Generous: the point is "not held up by 50 stalled uploads", not a speed figure.
        assert during < max(1.0, 5 * before), (before, during)
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda s: read_status(s, timeout=BODY_TIMEOUT + 10)[0], stalled))
        assert statuses == [408] * 50
        assert time.monotonic() - started < BODY_TIMEOUT + 5
    finally:
        for sock in stalled:
            sock.close()


@pytest.mark.server
@pytest.mark.extended  # SIGTERM beside stalled uploads, rare (~10 s): with `-m extended`
def test_sigterm_does_not_wait_on_stalled_uploads_past_the_body_timeout(tmp_path):
    server = Server(tmp_path / "server.log", args=("--no-control-socket",), MODEL="resnet18_seeded", COMPILE=0,
                    WORKERS=1, THREADS=1, MAX_BATCH_SIZE=1, BODY_TIMEOUT_S=BODY_TIMEOUT)
    stalled = []
    try:
        server.wait_ready(workers=1)
        for _ in range(10):
            sock = connect(server)
            sock.sendall(head(length=500_000, extra="") + b"\0" * 1000)
            stalled.append(sock)
        time.sleep(0.3)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # The worker's graceful drain ends with gunicorn's "Worker exiting": what stalled uploads could stretch.
        while "Worker exiting" not in server.output() and time.monotonic() - started < BODY_TIMEOUT + 30:
            time.sleep(0.05)
        took = time.monotonic() - started
        assert server.proc.wait(timeout=60) == 0, server.output()[-2000:]
        assert took < BODY_TIMEOUT + DRAIN_SECONDS + 2, f"the worker took {took:.1f} s to stop with stalled uploads"
    finally:
        for sock in stalled:
            sock.close()
        server.stop()


@pytest.mark.server
@pytest.mark.extended  # SIGTERM beside uploads still arriving, rare (~12 s): with `-m extended`
@pytest.mark.parametrize("graceful", [5, 1])
def test_uploads_still_arriving_when_a_stop_ends_get_503_not_a_reset(tmp_path, graceful):
    """A stalled upload (BODY_TIMEOUT_S as long as the stop's wait, the defaults: 30 and 30) and one crawling in
    were reset when the master killed the worker at graceful_timeout, and it logged the stalled one as cut
    although its 408 had gone out a moment before. Both now get 503 not_ready before the wait ends, and the
    worker exits on its own: the master kills nothing, even where the wait (1 s) is shorter than a refusal's drain
    (DRAIN_SECONDS: it was cut then, and the master logged requests cut that had their answers: tryout)."""
    server = Server(tmp_path / "server.log", args=("--no-control-socket", "--graceful-timeout", str(graceful)),
                    MODEL="resnet18_seeded", COMPILE=0, WORKERS=1, THREADS=1, BODY_TIMEOUT_S=30)
    opened = []
    try:
        server.wait_ready(workers=1)
        stalled, crawling = connect(server), connect(server)
        opened += [stalled, crawling]
        stalled.sendall(head(length=500_000, extra="") + b"\x89PNG" + b"\0" * 996)
        crawling.sendall(head(length=500_000, extra="") + b"\x89PNG")
        time.sleep(0.3)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        answers = {}
        with ThreadPoolExecutor(1) as pool:
            def stalled_answer_and_when():
                status, first = read_status(stalled, graceful + 5)
                took = time.monotonic() - started
                return (status, first + read_answer(stalled, 2.0)[1]), took

            stalled_answer = pool.submit(stalled_answer_and_when)
            crawling.settimeout(0.05)
            while time.monotonic() - started < graceful + 5:
                try:
                    crawling.sendall(b"\0" * 100)  # 100 bytes every 50 ms: never a pause the body timeout cuts
                    first = crawling.recv(65536)
                except (TimeoutError, socket.timeout):
                    continue
                except OSError:  # reset
                    first = b""
                answers["crawling"] = (int(first.split(b" ", 2)[1]) if first else 0,
                                       first + read_answer(crawling, 2.0)[1] if first else b""), \
                    time.monotonic() - started
                break
            answers["stalled"] = stalled_answer.result()
        assert server.proc.wait(timeout=graceful + 10) == 0
        for name, ((status, data), took) in answers.items():
            assert status == 503 and b"server is stopping" in data, (name, data[:400])
            assert took < graceful, (name, took)
        assert "killed, cutting" not in server.output(), server.output()[-2000:]
    finally:
        for sock in opened:
            sock.close()
        server.stop()


pytestmark = pytest.mark.server


class _TLSLikeSocket:
    """A socket that, like ``ssl.SSLSocket``, refuses ``recv_into`` flags; it holds ``data`` to be read."""

    def __init__(self, data: bytes):
        self.data, self.calls, self.shut = data, [], None

    def shutdown(self, how):
        self.shut = how

    def recv_into(self, buf, nbytes=0, flags=0):
        self.calls.append(flags)
        if flags:
            raise ValueError("non-zero flags not allowed in calls to recv_into() on <class 'ssl.SSLSocket'>")
        n = min(nbytes or len(buf), len(self.data))
        buf[:n], self.data = self.data[:n], self.data[n:]
        return n


@pytest.mark.parametrize("length", [700_000, None])  # Content-Length, and chunked (to the client's close)
def test_a_drain_on_a_socket_that_takes_no_flags_copies_instead(length):
    """Where the connection closes, a drain discards in the kernel (MSG_TRUNC); a TLS socket (gunicorn's
    --certfile) refuses that flag, and the drain then reads the rest the plain way instead of giving up."""
    from webapp.bodies import GuardedInput

    sock = _TLSLikeSocket(b"\0" * 700_000)
    body = GuardedInput(None, sock=sock, expect_continue=False, content_length=length, idle_s=5)
    body.closing = True
    assert body.drain() is True and sock.data == b""
    assert 0 in sock.calls  # read with no flags after the refusal
    assert sock.shut == socket.SHUT_WR  # its answer's end told (half-close) before the drain waits for the client


def test_a_body_cut_by_a_stop_is_not_said_to_be_the_whole_servers_stop():
    """A slow upload on an old worker during a reload was told "the server is stopping" (tryout26), though the
    server served on with its new workers: the words name the worker, the stop or the reload, and what to do."""
    from webapp.bodies import cut_by_stop

    refusal = cut_by_stop(27.14)
    assert refusal.status == 503 and refusal.headers == {"Retry-After": "1"}
    assert refusal.message.startswith("the worker reading it is stopping (the server is stopping, or reloading: ")
    assert "had not all arrived 27.1 s after the stop began; send the request again" in refusal.message
