"""The baseline our server is measured against: the service as the seed describes it, done plainly.

gunicorn with sync workers, one per core; each worker (after fork) builds eager fp32 ResNet-18
with the same seeded random weights ours serves as ``resnet18_seeded`` (``webapp.models.load_model``
is used for the weights only), ``torch.set_num_threads(1)``; each request: Pillow full decode,
torchvision transforms (Resize 256, CenterCrop 224, ToTensor, Normalize), one forward pass under
``no_grad``, no batching, no compile. Same API shape: ``POST /api/v1/predict`` with multipart
``file``, answering ``{"model", "results": [{"predictions", ...}], "timing_ms"}``; ``GET /healthz``.

This module is also the gunicorn config (``-c python:bench.baseline_app``), so its top level
imports no torch (the master must not); the app comes from the factory, in each worker::

    BASELINE_BIND=127.0.0.1:8001 python -m gunicorn -c python:bench.baseline_app --no-control-socket \\
        'bench.baseline_app:create_app()'

Alone, ``python bench/baseline_app.py`` starts it, classifies the 12-MP photo a few times over
HTTP and reports the latency as a ratio against the same pipeline called in this process
(``--serve`` keeps it serving instead, until Ctrl-C).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __package__ in (None, "") and __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# -- gunicorn settings (read when this module is the config file) -------------------------------
bind = [os.environ.get("BASELINE_BIND", "127.0.0.1:8001")]
worker_class = "sync"
workers = int(os.environ.get("BASELINE_WORKERS") or 0) or len(os.sched_getaffinity(0))
timeout = 120
graceful_timeout = 30
loglevel = "info"
errorlog = "-"

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
# What the baseline serves, as its answers' "model" and /healthz say it.
BASELINE_MODEL = {"name": "resnet18_seeded", "title": "ResNet-18 (untrained, seeded) baseline", "untrained": True,
                  "precision": "fp32", "compiled": False, "input_size": 224, "categories": 1000}


def default_workers(workers: int = 0) -> int:
    """One sync worker per core this process may use, unless told otherwise."""
    return workers or len(os.sched_getaffinity(0))


def command(port: int, *, workers: int = 0) -> tuple[list[str], dict]:
    """(argv, extra env) that start the baseline on ``127.0.0.1:port`` from the repo root."""
    argv = [sys.executable, "-m", "gunicorn", "-c", "python:bench.baseline_app", "--no-control-socket",
            "bench.baseline_app:create_app()"]
    return argv, {"BASELINE_BIND": f"127.0.0.1:{port}", "BASELINE_WORKERS": str(default_workers(workers))}


def start_baseline(log_path: Path, *, workers: int = 0, env: dict | None = None):
    """The baseline on a free port, as a ``bench.servers.Gunicorn`` (``wait_ready(workers)`` next).

    ``workers`` 0: one per core. This process's ``CLASSIFIER_*`` variables are dropped; ``env`` adds others.
    """
    from bench.servers import Gunicorn, classifier_env, free_port

    port = free_port()
    argv, extra = command(port, workers=workers)
    return Gunicorn("baseline", argv, env={**classifier_env(env=env), **extra}, port=port, log_path=log_path)


class Pipeline:
    """Decode (Pillow, full size) -> transforms -> eager fp32 ResNet-18 -> top-k, one image at a time.

    ``threads``: torch intra-op threads (process-wide).
    """

    def __init__(self, threads: int = 1):
        import torch
        from torchvision import transforms

        from webapp import settings
        from webapp.models import IMAGENET_CATEGORIES, load_model

        torch.set_num_threads(threads)
        self.torch = torch
        loaded = load_model(settings.load(environ={}, overrides={"MODEL": "resnet18_seeded"}))
        self.model = loaded.module.eval()  # the seeded weights; from here on plain eager PyTorch
        self.categories = IMAGENET_CATEGORIES
        self.transform = transforms.Compose([
            transforms.Resize(256),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ])

    def classify(self, stream, topk: int = 3) -> tuple[dict, dict]:
        """A file-like image -> (result, timing_ms): the API's result dict (``topk`` predictions) and
        ``{"decode", "queue", "inference", "total"}`` in ms. :raises PIL.UnidentifiedImageError, OSError: not an image."""
        from PIL import Image

        torch = self.torch
        t0 = time.perf_counter()
        img = Image.open(stream)
        fmt = img.format
        img = img.convert("RGB")
        x = self.transform(img).unsqueeze(0)
        t1 = time.perf_counter()
        with torch.no_grad():
            probs = torch.softmax(self.model(x)[0], dim=0)
        t2 = time.perf_counter()
        top = torch.topk(probs, topk)
        preds = [{"label": self.categories[i], "index": i, "probability": round(float(p), 6)}
                 for p, i in zip(top.values.tolist(), top.indices.tolist())]
        result = {"width": img.width, "height": img.height, "format": fmt,
                  "batch_size": 1, "predictions": preds}
        return result, {"decode": round((t1 - t0) * 1e3, 2), "queue": 0.0, "inference": round((t2 - t1) * 1e3, 2),
                        "total": round((time.perf_counter() - t0) * 1e3, 2)}


def create_app():
    """The baseline Flask app (called by gunicorn in each worker, after fork)."""
    from flask import Flask, jsonify, request

    pipeline = Pipeline(threads=1)
    app = Flask(__name__)

    @app.post("/api/v1/predict")
    def predict():
        f = request.files.get("file")
        if f is None or not f.filename:
            return jsonify({"error": {"code": "no_file", "message": "no file", "status": 400}}), 400
        try:
            result, timing = pipeline.classify(f.stream)
        except Exception as exc:  # the seed answered 400 for anything Pillow could not read
            return jsonify({"error": {"code": "undecodable_image", "message": str(exc), "status": 400}}), 400
        return jsonify({"model": BASELINE_MODEL, "results": [{"filename": f.filename, **result}], "timing_ms": timing})

    @app.get("/healthz")
    def healthz():
        return jsonify({"status": "ok", "ready": True, "pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)),
                        "intra_op_threads": pipeline.torch.get_num_threads(), "model": BASELINE_MODEL})

    return app


# -- alone: a smoke check of the baseline ---------------------------------------------------------

def add_arguments(parser) -> None:
    """The smoke check's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--requests", type=int, default=0, help="sequential requests (0: 20, --quick 5)")
    parser.add_argument("--workers", type=int, default=0, help="sync workers (0: one per core)")
    parser.add_argument("--serve", action="store_true", help="just serve (on --port) until Ctrl-C")
    parser.add_argument("--port", type=int, default=8001, help="port for --serve")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def run(args) -> dict:
    """Smoke check: start the baseline, time ``--requests`` sequential uploads of the 12 MP photo (ms) against
    the same pipeline in this process, print the table; return the numbers. ``--serve``: serve until Ctrl-C.

    :raises NotReady: the baseline did not start; RuntimeError: it answered other than 200.
    """
    import io
    import tempfile

    from bench import PHOTO_12MP, log, median, num, photo, ratio, table
    from bench.load import PREDICT, multipart_body
    from bench.servers import http_json

    if args.serve:
        import subprocess

        from bench import ROOT

        argv, extra = command(args.port, workers=args.workers)
        log(f"baseline on http://127.0.0.1:{args.port} ({extra['BASELINE_WORKERS']} sync workers); Ctrl-C stops it")
        try:
            subprocess.run(argv, cwd=ROOT, env={**os.environ, **extra})
        except KeyboardInterrupt:
            pass
        return {}
    n = args.requests or (5 if args.quick else 20)
    path = photo(PHOTO_12MP)
    data = path.read_bytes()
    body, ctype = multipart_body(data, path.name)
    log_path = Path(tempfile.mkdtemp(prefix="baseline_app-")) / "baseline.log"
    srv = start_baseline(log_path, workers=args.workers)
    http_ms, local_ms, server_ms = [], [], []
    try:
        srv.wait_ready(default_workers(args.workers))
        ready_s = max(srv.ready_at.values())
        pipeline = Pipeline(threads=1)  # the same pipeline in this process: the ratio's baseline
        pipeline.classify(io.BytesIO(data))
        for i in range(n + 1):  # interleaved; the first round is a warm-up
            t0 = time.perf_counter()
            status, answer = http_json(srv.port, PREDICT, body=body, headers={"Content-Type": ctype}, timeout=120)
            t1 = time.perf_counter()
            local, _ = pipeline.classify(io.BytesIO(data))
            t2 = time.perf_counter()
            if status != 200 or answer is None:
                raise RuntimeError(f"baseline answered {status}: {answer}")
            if i:
                http_ms.append((t1 - t0) * 1e3)
                local_ms.append((t2 - t1) * 1e3)
                server_ms.append(answer["timing_ms"]["total"])
        top_http = answer["results"][0]["predictions"][0]
        top_local = local["predictions"][0]
    finally:
        code = srv.stop()
    out = {"requests": n, "ready_s": ready_s, "http_ms_median": median(http_ms), "in_process_ms_median": median(local_ms),
           "server_total_ms_median": median(server_ms), "http_over_in_process": ratio(median(http_ms), median(local_ms)),
           "top1_http": top_http["index"], "top1_in_process": top_local["index"], "top1_match": top_http["index"] == top_local["index"],
           "exit_code": code, "log": str(log_path)}
    print(table(["path", "median ms", "x in-process"],
                [["HTTP (baseline server)", num(out["http_ms_median"]), num(out["http_over_in_process"], 2)],
                 ["  server's own timing_ms.total", num(out["server_total_ms_median"]),
                  num(ratio(out["server_total_ms_median"], out["in_process_ms_median"]), 2)],
                 ["in process (same pipeline)", num(out["in_process_ms_median"]), "1.00"]],
                title=f"baseline smoke: {n} sequential requests of {path.name}, interleaved with the same pipeline "
                      f"in this process; ready in {num(ready_s)} s"))
    print(f"top-1 over HTTP {top_http['index']} {top_http['label']}, in process {top_local['index']}: "
          + ("match" if out["top1_match"] else "MISMATCH") + f"; server exit {code}")
    return out


if __name__ == "__main__":
    from bench import main

    main(__doc__, add_arguments, run)
