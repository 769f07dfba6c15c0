"""bench/heavy_bench.py: its heavy photo is what the server puts on the heavy lane, and a window counts what the
server answered, as the server answered it."""

from __future__ import annotations

import io

from PIL import Image

from bench.heavy_bench import HEAVY_SIDE, heavy_photo, report, window
from bench.servers import http_json
from webapp.settings import BY_NAME


def test_the_heavy_photo_is_a_few_kb_of_many_pixels_inside_the_default_limit():
    data = heavy_photo()
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "WEBP" and im.size == (HEAVY_SIDE, HEAVY_SIDE)
    assert len(data) < 10_000 and HEAVY_SIDE ** 2 <= BY_NAME["MAX_PIXELS"].default


def test_a_window_counts_each_kind_of_answer():
    """A stub server: the ordinary photo answered 200, the heavy one 429 with Retry-After 1."""
    import http.server
    import threading

    class Stub(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            status = 429 if body == b"heavy" else 200
            self.send_response(status)
            if status == 429:
                self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert http_json(port, "/api/v1/predict", body=b"x")[0] == 200
        w = window(port, (b"ordinary", "image/jpeg"), (b"heavy", "image/webp"), clients=2, heavy_clients=1,
                   seconds=0.5)
    finally:
        server.shutdown()
        server.server_close()
    assert w["ordinary"]["answered"] > 10 and w["ordinary"]["refused"] == 0 and w["ordinary"]["other"] == 0
    assert w["heavy"]["answered"] == 0 and w["heavy"]["refused"] == 1  # then it waited out its Retry-After
    result = {"settings": {}, "workers": 1, "clients": 2, "heavy_clients": 1, "photo": "dog.jpg", "heavy_bytes": 5,
              "heavy_pixels": 1e6, "rounds": 1, "seconds": 0.5, "ratio_images_per_s": 0.5, "ratio_p99": 2.0,
              "alone": {"ordinary": {"images_per_s": 10.0, "p50_ms": 1.0, "p99_ms": 2.0, "refused": 0, "other": 0},
                        "heavy": {}},
              "beside": {"ordinary": {"images_per_s": 5.0, "p50_ms": 2.0, "p99_ms": 4.0, "refused": 0, "other": 0},
                         "heavy": {"answered": 0, "refused": 1, "p50_ms": float("nan")}}}
    text = report(result)
    assert "beside / alone: 0.50x" in text and "p99 beside / alone: 2.00x" in text
