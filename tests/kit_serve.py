"""Start an installed kit's service and classify one photo over loopback; print one JSON line.

Run by tests/test_kit.py inside ``unshare --net`` (a network namespace with nothing but loopback),
with the kit venv's own Python, so it imports nothing from the project or the test tools (stdlib only):

    python kit_serve.py KIT_SRC GUNICORN PHOTO PORT [GUNICORN FLAG...]

It proves the namespace has no route out (a connection to a public address must fail), starts
``GUNICORN -c gunicorn.conf.py wsgi:app`` in ``KIT_SRC`` on 127.0.0.1:PORT, times it to the first
200 from ``/readyz`` (s, and the CPU seconds its processes used by then), POSTs PHOTO to ``/api/v1/predict``, stops it with SIGTERM, and prints
``{"ready_s", "ready_cpu_s", "status", "answer", "exit", "log", "outside"}``. Exit status 0 unless it could not
run at all.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid


def no_route_out() -> str:
    """Why a TCP connection to a public address (PyPI's, by number: no DNS here) fails; '' if it connects."""
    try:
        socket.create_connection(("151.101.0.223", 443), timeout=3).close()
        return ""
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live children (gunicorn's master and workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in [pid, *(int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split())]:
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except OSError:
            pass
    return round(total, 2)


def post_photo(url: str, path: str) -> tuple[int, dict]:
    """POST ``path`` as multipart field ``file``; return (status, JSON body)."""
    boundary = uuid.uuid4().hex
    with open(path, "rb") as fh:
        data = fh.read()
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{os.path.basename(path)}\"\r\n"
            f"Content-Type: image/jpeg\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def main(src: str, gunicorn: str, photo: str, port: str, *extra: str) -> int:
    outside = no_route_out()
    env = {**os.environ, "CLASSIFIER_BIND": f"127.0.0.1:{port}"}
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kit-serve-{port}.log")
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen([gunicorn, "-c", "gunicorn.conf.py", *extra, "wsgi:app"], cwd=src, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        ready_s = ready_cpu_s = None
        while time.monotonic() - t0 < 600 and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
                    if resp.status == 200:
                        ready_s = round(time.monotonic() - t0, 2)
                        ready_cpu_s = tree_cpu_s(proc.pid)
                        break
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(0.1)
        status, answer = post_photo(f"http://127.0.0.1:{port}/api/v1/predict", photo) if ready_s else (None, {})
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    print(json.dumps({"ready_s": ready_s, "ready_cpu_s": ready_cpu_s, "status": status, "answer": answer, "exit": code, "log": text[-20000:],
                      "outside": outside}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
