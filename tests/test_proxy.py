"""Behind a reverse proxy (``CLASSIFIER_TRUSTED_PROXIES``): the README's nginx location, run in a real nginx in
front of a real gunicorn. Each client behind the proxy gets its own rate-limit budget and its own address in
the access log (all of them were the proxy's), a client's own X-Forwarded-For is not believed, a client's own
sane request id (else the one nginx makes) is the one the service logs and echoes, and an over-limit upload gets the service's JSON 413
(not nginx's page)."""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time

import pytest
from PIL import Image

from conftest import ROOT, png_bytes
from serving import Server, free_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
if not os.access(NGINX, os.X_OK):
    pytest.skip("nginx is absent (apt-get install nginx-light; .ci/run installs it)", allow_module_level=True)

PNG = png_bytes(Image.new("RGB", (40, 30), (10, 200, 90)))


def readme_location(upstream_port: int) -> str:
    """The README's nginx ``location`` block, its upstream moved to ``upstream_port``."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- nginx location: checked by tests/test_proxy\.py -->\n```nginx\n(.*?)```", text, re.S)
    assert block, "the README's nginx location block is gone"
    assert "proxy_pass http://127.0.0.1:8000;" in block[1]
    return block[1].replace("127.0.0.1:8000", f"127.0.0.1:{upstream_port}")


def readme_http() -> str:
    """The README's nginx ``http``-level block (the ``map`` that keeps a client's sane ``X-Request-ID``)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- nginx http: checked by tests/test_proxy\.py -->\n```nginx\n(.*?)```", text, re.S)
    assert block, "the README's nginx map block is gone"
    return block[1]


def test_the_readme_nginx_map_keeps_the_ids_the_service_keeps():
    """The map's pattern is the service's own rule for a client's id (``contract._SANE_ID``): a narrower one would
    replace ids the service keeps, a wider one pass ids the service replaces (two ids for one request in the logs)."""
    from webapp.contract import _SANE_ID

    pattern = re.search(r'"~\^(.*)\$"', readme_http())
    assert pattern and pattern[1] == _SANE_ID.pattern, (pattern, _SANE_ID.pattern)


def start_nginx(tmp, port: int, location: str) -> subprocess.Popen:
    """nginx in the foreground on 127.0.0.1:``port`` with ``location`` (and the README's ``map``), its files
    under ``tmp``."""
    conf = tmp / "nginx.conf"
    user = "user root;\n" if os.geteuid() == 0 else ""  # its workers read the bodies it keeps under tmp (0700)
    conf.write_text(f"""{user}worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log;
events {{ worker_connections 64; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
{readme_http()}
    server {{
        listen 127.0.0.1:{port};
{location}
    }}
}}
""")
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-g", "daemon off;"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"nginx did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)


def post(port: int, body: bytes, source: str = "127.0.0.1", **headers) -> tuple[int, dict, dict]:
    """POST ``body`` as a PNG to /api/v1/predict from the address ``source``: status, headers, JSON body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    try:
        conn.request("POST", "/api/v1/predict", body=body, headers={"Content-Type": "image/png", **headers})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(raw) if raw.startswith(b"{") else {"raw": raw[:200]}
    finally:
        conn.close()


@pytest.mark.server
def test_the_readme_nginx_location_in_front_of_the_service(tmp_path):
    srv = Server(tmp_path / "server.log", args=("--no-control-socket",), MODEL="resnet18_seeded", COMPILE=0,
                 WORKERS=1, THREADS=1, MAX_BATCH_SIZE=1, TRUSTED_PROXIES=1, RATE_LIMIT="2/minute", ACCESS_LOG="json")
    nginx = None
    try:
        srv.wait_ready(workers=1)
        port = free_port()
        nginx = start_nginx(tmp_path, port, readme_location(srv.port))
        first = [post(port, PNG) for _ in range(3)]
        spoofed = post(port, PNG, **{"X-Forwarded-For": "198.51.100.9"})  # a made-up address: not a new budget
        other = post(port, PNG, source="127.0.0.2")  # another client of the same nginx: its own budget
        assert [s for s, _, _ in first] == [200, 200, 429] and spoofed[0] == 429, (first, spoofed)
        assert other[0] == 200, other
        assert first[0][2]["results"][0]["predictions"] and first[2][2]["error"]["code"] == "rate_limited"
        too_big = post(port, b"\x89PNG" + bytes(32 * 2**20 - 3), source="127.0.0.3")  # 32 MiB + 1 byte
        assert too_big[0] == 413 and too_big[2]["error"]["code"] == "too_large", too_big
        # over nginx's own limit: its 413 in the API's JSON (its HTML page reached the page's users: tryout23)
        huge = post(port, b"\x89PNG" + bytes(44 * 2**20), source="127.0.0.5")
        assert huge[0] == 413 and huge[1]["Content-Type"] == "application/json", huge
        assert huge[2]["error"]["code"] == "too_large" and "proxy limit" in huge[2]["error"]["message"], huge
        assert re.fullmatch(r"[0-9a-f]{32}", huge[1].get("X-Request-ID", "")), huge[1]  # as every answer (tryout28)
        # a client's own sane id passes nginx, on the service's answers and on nginx's own 413 alike
        own = post(port, PNG, source="127.0.0.6", **{"X-Request-ID": "batch-7/photo:3@cam~1"})
        huge_own = post(port, b"\x89PNG" + bytes(44 * 2**20), source="127.0.0.7", **{"X-Request-ID": "upload-42"})
        assert own[0] == 200 and own[1]["X-Request-ID"] == "batch-7/photo:3@cam~1", own[1]
        assert huge_own[0] == 413 and huge_own[1]["X-Request-ID"] == "upload-42", huge_own[1]
        insane = post(port, PNG, source="127.0.0.8", **{"X-Request-ID": "two words"})  # the service would replace it
        assert insane[0] == 200 and re.fullmatch(r"[0-9a-f]{32}", insane[1]["X-Request-ID"]), insane[1]
        # /v2 takes base64 up to 4/3 of the limit + 64 KiB: a 40 MiB body reaches the service, not nginx's 413 page
        # (client_max_body_size was 33m; tryout18). 30 MiB of zeros: no photo, the protocol's JSON 415.
        v2 = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "parameters": {
            "content_type": "base64"}, "data": [base64.b64encode(bytes(30 * 2**20)).decode()]}]}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120, source_address=("127.0.0.4", 0))
        try:
            conn.request("POST", "/v2/models/classifier/infer", body=v2, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            status, answer = resp.status, json.loads(resp.read())
        finally:
            conn.close()
        assert status == 415 and answer["error"].startswith("unsupported_media_type: "), (status, answer)
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(10)
        assert srv.stop() == 0, srv.output()[-2000:]
    logged = {}
    for line in srv.output().splitlines():
        if line.startswith("{") and '"path":"/api/v1/predict"' in line:
            rec = json.loads(line)
            logged[rec["request_id"]] = rec["remote_addr"]
    ids = [h["X-Request-ID"] for _, h, _ in (*first, spoofed, other, too_big)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids), ids  # nginx's ids
    assert [logged[i] for i in ids] == ["127.0.0.1"] * 4 + ["127.0.0.2", "127.0.0.3"], logged
    assert logged["batch-7/photo:3@cam~1"] == "127.0.0.6" and logged[insane[1]["X-Request-ID"]] == "127.0.0.8"
    assert (tmp_path / "access.log").read_text().count("POST /api/v1/predict") == 10  # its own 413s too


@pytest.mark.server
def test_an_upload_refused_from_its_headers_behind_nginx_gets_the_services_answer_not_a_502(tmp_path):
    """Refused from the headers with 20-40 MB still coming (over the limit, a wrong type): nginx writes the body it
    buffered whole after the answer, and a drain that ended at 16 MiB closed under it: nginx's HTML 502 in place of
    the service's 413 or 415, for about half of them with 2 workers (tryout28; the access log said 413)."""
    srv = Server(tmp_path / "server.log", args=("--no-control-socket",), MODEL="resnet18_seeded", COMPILE=0,
                 WORKERS=2, THREADS=1, MAX_BATCH_SIZE=1, TRUSTED_PROXIES=1)
    nginx = None
    try:
        srv.wait_ready(workers=2)
        port = free_port()
        nginx = start_nginx(tmp_path, port, readme_location(srv.port))
        over = bytes(35 * 10**6)  # over the service's 32 MiB, under nginx's 43m
        got = [post(port, over, **{"Content-Type": "application/octet-stream"})[0] for _ in range(8)]
        got += [post(port, bytes(20 * 10**6), **{"Content-Type": "text/plain"})[0] for _ in range(8)]
        assert got == [413] * 8 + [415] * 8, (got, (tmp_path / "error.log").read_text()[-600:])
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(10)
        assert srv.stop() == 0, srv.output()[-2000:]


@pytest.mark.server
def test_classify_server_waits_out_a_proxys_502_while_the_server_behind_it_is_down(tmp_path):
    """``classify --server`` through the README's nginx, with nothing listening behind it at first (a restart):
    nginx's own 502 page is tried again after a short pause, as a dropped connection is (webapp/cli/retries.py),
    and the photo is classified once the server is back (a stub of its API here), not failed with ``http_error``."""
    from test_cli_remote import Stub, tiny_file

    from webapp.cli import remote

    upstream, port = free_port(), free_port()
    nginx = start_nginx(tmp_path, port, readme_location(upstream))
    stubs: list = []
    back = threading.Timer(2.0, lambda: stubs.append(Stub([], port=upstream)))
    try:
        assert post(port, PNG)[0] == 502  # nginx's page, not the service's JSON
        back.start()
        result = remote.classify_one(remote.Client(f"http://127.0.0.1:{port}", jobs=1), tiny_file(tmp_path), topk=3,
                                     short_side=None, max_bytes=2**20)
        assert "error" not in result, result
        assert result["predictions"][0]["label"] == "kite" and result["retries"] >= 1, result
    finally:
        back.cancel()
        back.join()
        for stub in stubs:
            stub.shutdown()
        nginx.terminate()
        nginx.wait(10)
