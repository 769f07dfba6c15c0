"""Scale-out on a Ray cluster: Ray Serve replicas behind the same HTTP API, Ray Data for bulk folders.

The only module that imports Ray (``pip install -r requirements-cluster.txt``); one box with
gunicorn needs none of it. Everything a photo meets is the code gunicorn runs: the settings
table, the model specs and weights resolution (models.py), decode/preprocess (imaging.py), the
compiled engine (engine.py) and the answer (``Classifier.decode`` / ``answer``); only who forms
the batches changes.

Ray Serve (``build_app``; ``python -m webapp serve --cluster``, or ``serve run/deploy`` with
deploy/ray-serve.yaml)::

    Ray's HTTP proxy (one per node)
      -> HTTP replicas   the Flask app of create_app(), run by a2wsgi: same routes, forms, JSON,
                         errors, token, page; its classifier is a RemoteClassifier
      -> model replicas  Classifier.load() (model, precision, compile, warm-up, self-test),
                         decode on real threads, @serve.batch(max_batch_size, batch_wait_timeout_s)

Each model replica reserves ``num_cpus`` = its intra-op threads, so Ray places replicas on free
cores across nodes. Back-pressure: a model replica takes ``CLUSTER_MAX_ONGOING_REQUESTS``; past
those, each HTTP replica queues ``CLUSTER_MAX_QUEUED_REQUESTS`` and refuses more with the
gunicorn app's 429 + ``Retry-After`` (the proxy does the same in front of the HTTP replicas).

Ray Data (``classify_to_parquet``; ``python -m webapp classify --cluster SRC --out DEST.parquet``):
``read_binary_files`` -> ``map_batches(BulkClassifier)`` on an actor pool of ``CLUSTER_ACTORS``
-> one Parquet file written as rows arrive. A file that cannot be decoded is an error row.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import threading
import time
from pathlib import Path

import ray
from ray import serve

from . import settings as settings_mod
from .errors import InferenceFailed, InferenceTimeout, NotReady, Overloaded, ServiceError, StartupError, TooLarge
from .errors import from_dict as error_from_dict

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
APP_NAME = "classifier"
# Shipped to the cluster as the job's working_dir (Ray also skips what .gitignore lists).
WORKING_DIR_EXCLUDES = [".git", ".venv", "bench/results", "tests", "**/__pycache__"]
# Settings that name files: made absolute where the command runs, since replicas run elsewhere.
PATH_SETTINGS = ("WEIGHTS", "CACHE_DIR", "CALIBRATION_DIR")


# -- settings ------------------------------------------------------------------------------------------
def replica_settings(args: dict | None = None, environ=None) -> dict:
    """The settings every replica and actor gets, resolved once where the app is built.

    ``CLASSIFIER_*`` variables of ``environ`` (default ``os.environ``), then ``args`` (setting
    names without the prefix, as in the Serve config's ``args``). ``THREADS`` 0 becomes 1 (a
    replica reserves that many CPUs); relative paths become absolute.

    :raises SettingsError: a bad value, or ``CLUSTER_MIN_REPLICAS`` > ``CLUSTER_MAX_REPLICAS``.
    """
    s = settings_mod.load(os.environ if environ is None else environ, args or {})
    if s.CLUSTER_REPLICAS == 0 and s.CLUSTER_MIN_REPLICAS > s.CLUSTER_MAX_REPLICAS:
        raise settings_mod.SettingsError(
            f"CLASSIFIER_CLUSTER_MIN_REPLICAS={s.CLUSTER_MIN_REPLICAS} is above "
            f"CLASSIFIER_CLUSTER_MAX_REPLICAS={s.CLUSTER_MAX_REPLICAS}")
    values = dict(s)
    values["THREADS"] = s.THREADS or 1
    for name in PATH_SETTINGS:
        if values[name]:
            values[name] = str(Path(values[name]).expanduser().resolve())
    return values


def _load(values: dict):
    # Replicas take the resolved values only: their own environment must not change them.
    return settings_mod.load({}, values)


def startup_failure(text: str) -> StartupError | None:
    """The ``StartupError`` a replica or actor died of, found in Ray's error text (a remote traceback).

    Ray reports a constructor that raised as a traceback string; its last ``StartupError:`` line
    holds our message (no weights, bad weights file, failed self-test), which says what to do.
    """
    lines = [line.split("StartupError:", 1)[1].strip() for line in text.splitlines() if "StartupError:" in line]
    return StartupError(lines[-1]) if lines else None


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (unit tests)
        return f"pid-{os.getpid()}"


# -- Ray Serve: model replicas ---------------------------------------------------------------------------
@serve.deployment(name="Model")
class ModelReplica:
    """One model replica: the gunicorn worker's model, engine and decode, batched by ``@serve.batch``.

    Images are ``(3, S, S) float32`` after decode; a batch is ``(N, 3, S, S) float32``, N <=
    ``MAX_BATCH_SIZE``, formed within ``BATCH_TIMEOUT_MS`` of its first image; logits ``(N, C)``.
    """

    def __init__(self, values: dict):
        from .batcher import decode_executor, inference_executor
        from .service import Classifier

        t0 = time.perf_counter()
        self.settings = s = _load(values)
        self.clf = Classifier(s)
        warm = self.clf.load()
        self.infer_pool = inference_executor(self.clf.engine.thread_init)
        self.decode_pool = decode_executor(max(2, self.clf.threads))
        self.predict_batch.set_max_batch_size(s.MAX_BATCH_SIZE)
        self.predict_batch.set_batch_wait_timeout_s(s.BATCH_TIMEOUT_MS / 1e3)
        self.replica = _replica_id()
        self.batches = self.images = self.ongoing = 0
        self._self_test()
        self.clf.mark_ready(time.perf_counter() - t0, warm)

    def _self_test(self) -> None:
        """The gunicorn worker's self-test, on this replica's inference thread.

        :raises StartupError: no dog breed in the golden photo's top 3 (the replica does not start).
        """
        from .assets import GOLDEN
        from .service import ASSET_MAX_PIXELS, Upload, encode

        clf = self.clf
        if not clf.self_test_enabled():
            return
        _, tensor, _ = clf.decode(Upload(GOLDEN.name, GOLDEN.read_bytes()), False, ASSET_MAX_PIXELS)
        logits = self.infer_pool.submit(clf.engine.predict, tensor[None]).result()
        clf.judge_self_test(encode(logits[0], clf.model.categories, 3))

    async def classify(self, uploads: list, topk: int, keep_images: bool = False) -> dict:
        """Classify one request's uploads (``service.Upload``); all succeed or the request fails.

        Returns ``{"answer": <the gunicorn app's JSON answer>, "served_by": replica id}``, or
        ``{"error": {code, message, status}, "headers": {...}}``: errors cross the process
        boundary as data and are raised again, as the same class, in the HTTP replica.
        """
        self.ongoing += 1
        try:
            return {"answer": await self._classify(uploads, topk, keep_images), "served_by": self.replica}
        except ServiceError as exc:
            return {"error": exc.to_dict()["error"], "headers": exc.headers, "served_by": self.replica}
        finally:
            self.ongoing -= 1

    async def _classify(self, uploads: list, topk: int, keep_images: bool) -> dict:
        s, clf = self.settings, self.clf
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(*(loop.run_in_executor(self.decode_pool, clf.decode, up, keep_images,
                                                           s.MAX_PIXELS) for up in uploads), return_exceptions=True)
        for item in done:  # the first bad upload in request order, as the gunicorn app reports it
            if isinstance(item, BaseException):
                raise item
        decoded, tensors, images = (list(col) for col in zip(*done))
        decode_ms = (time.perf_counter() - start) * 1e3
        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(self.predict_batch((t, time.monotonic())) for t in tensors)),
                timeout=s.REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise InferenceTimeout(f"no result within {s.REQUEST_TIMEOUT_S:g} s (CLASSIFIER_REQUEST_TIMEOUT_S); "
                                   f"the cluster is overloaded, try again later") from None
        return clf.answer(uploads, decoded, images, outcomes, topk=topk, keep_images=keep_images,
                          decode_ms=decode_ms, start=start)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)  # both set from the settings in __init__
    async def predict_batch(self, items: list[tuple]) -> list:
        """``[(image (3, S, S) float32, enqueued time.monotonic() s)]`` -> one ``batcher.Result`` each.

        :raises InferenceFailed: the model raised, or returned a row count other than the batch's
            (every request of the batch gets the 500, as with the gunicorn batcher).
        """
        import torch

        from .batcher import Result, checked_predict

        now = time.monotonic()
        batch = torch.stack([t for t, _ in items])
        t0 = time.perf_counter()
        logits = await asyncio.get_running_loop().run_in_executor(self.infer_pool, checked_predict,
                                                                  self.clf.engine.predict, batch)
        took = time.perf_counter() - t0
        self.batches += 1
        self.images += len(items)
        return [Result(logits=logits[i].clone(), queue_ms=(now - enq) * 1e3, inference_ms=took * 1e3,
                       batch_size=len(items)) for i, (_, enq) in enumerate(items)]

    def describe(self) -> dict:
        """The answers' ``model`` object (name, weights, precision, ...)."""
        return self.clf.describe()

    def health(self) -> dict:
        """The gunicorn worker's ``/healthz`` fields for this replica, plus its ``replica`` id."""
        return {**self.clf.health(), "ready": True, "state": self.clf.status, "replica": self.replica,
                "intra_op_threads": self.clf.threads, "queue_depth": self.ongoing, "batches": self.batches,
                "images": self.images}

    def check_health(self) -> None:
        """Ray Serve's periodic health check: the inference thread must still take work.

        :raises RuntimeError: it did not run a no-op within 10 s (Ray then replaces the replica).
        """
        self.infer_pool.submit(lambda: None).result(timeout=10)


# -- Ray Serve: HTTP replicas ----------------------------------------------------------------------------
class RemoteClassifier:
    """What the Flask app calls ``classifier`` on an HTTP replica: forwards to the model replicas.

    Offers what the views use (``classify``, ``ready``, ``status``, ``describe``, ``health``,
    ``self_test``, ``model``, ``settings``). Runs on a2wsgi's real OS threads, where a blocking
    ``DeploymentHandle`` ``result()`` is allowed.
    """

    def __init__(self, handle, settings):
        self.handle = handle
        self.settings = settings
        self._model: dict | None = None
        self._health: tuple[float, dict | None, str] = (0.0, None, "starting")
        # Recent model call time, s: what Retry-After says. Updated from several threads without a
        # lock: a lost update only nudges an estimate.
        self.ewma_s = 0.0

    def classify(self, uploads: list, *, topk: int, keep_images: bool = False) -> dict:
        """Send one request's uploads to a model replica and return its answer (see ``ModelReplica.classify``).

        :raises ServiceError: the replica's error as its own class; ``Overloaded`` (429, with
            ``Retry-After``) when every replica is busy and this replica's queue is full;
            ``NotReady`` (503) when no replica can take it; ``InferenceTimeout`` (504).
        """
        from flask import g
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        t0 = time.monotonic()
        response = self.handle.classify.remote(uploads, topk, keep_images)
        try:
            reply = response.result(timeout_s=self.settings.REQUEST_TIMEOUT_S + 5)
        except BackPressureError:
            wait = max(1, math.ceil(self.ewma_s))
            raise Overloaded(f"server busy: every model replica is full and {self.settings.CLUSTER_MAX_QUEUED_REQUESTS} "
                             f"requests are queued; try again in {wait} s", headers={"Retry-After": str(wait)}) from None
        except TimeoutError:
            response.cancel()
            raise InferenceTimeout(f"no result within {self.settings.REQUEST_TIMEOUT_S:g} s "
                                   f"(CLASSIFIER_REQUEST_TIMEOUT_S); the cluster is overloaded, try again later") from None
        except (DeploymentUnavailableError, RayActorError) as exc:
            log.warning("no model replica could answer: %r", exc)
            raise NotReady("no model replica could take the request (starting, failed or restarting); "
                           "try again shortly", headers={"Retry-After": "5"}) from None
        took = time.monotonic() - t0
        self.ewma_s = took if not self.ewma_s else 0.8 * self.ewma_s + 0.2 * took
        g.served_by = reply.get("served_by", "")
        if "error" in reply:
            raise error_from_dict(reply["error"], reply.get("headers"))
        self._model = reply["answer"]["model"]
        return reply["answer"]

    def _probe(self) -> tuple[dict | None, str]:
        """One model replica's health (cached 1 s), or None and why not."""
        now = time.monotonic()
        when, health, why = self._health
        if now - when < 1.0:
            return health, why
        try:
            health, why = self.handle.health.remote().result(timeout_s=5), "ready"
            self._model = health["model"]
        except Exception as exc:  # no replica yet, all failed, or busy past the timeout
            health, why = None, f"no model replica answered: {type(exc).__name__}"
        self._health = (now, health, why)
        return health, why

    @property
    def ready(self) -> bool:
        """True while at least one model replica answers."""
        return self._probe()[0] is not None

    @property
    def status(self) -> str:
        """``ready``, or why no model replica answers."""
        return self._probe()[1]

    @property
    def self_test(self) -> dict | None:
        """The self-test of the replica that last answered a health probe."""
        health = self._probe()[0]
        return health["self_test"] if health else None

    @property
    def model(self) -> dict | None:
        """The served model's description once a replica has given it, else None."""
        if self._model is None:
            self._probe()
        return self._model

    def describe(self) -> dict:
        """The answers' ``model`` object, as a model replica gives it."""
        return self.model or {"name": self.settings.MODEL, "note": self.status}

    def health(self) -> dict:
        """``/healthz``: one model replica's health, plus this HTTP replica's pid and id under ``ingress``."""
        health, why = self._probe()
        ingress = {"pid": os.getpid(), "replica": _replica_id()}
        if health is None:
            return {"status": "ok", "ready": False, "state": why, "model": self.describe(), "ingress": ingress}
        return {**health, "ingress": ingress}


@serve.deployment(name="HTTP")
@serve.ingress()
class Ingress:
    """An HTTP replica: the Flask app (``create_app``) over a ``RemoteClassifier``, served by a2wsgi.

    ``capacity`` is the number of requests it works on at once (a2wsgi threads, each waiting for a
    model replica). ``/metrics`` is off here: Ray exports its own metrics per node.
    """

    def __init__(self, model, values: dict, capacity: int):
        self.settings = _load({**values, "METRICS": False})
        self.remote = RemoteClassifier(model, self.settings)
        self.capacity = capacity

    def __serve_build_asgi_app__(self):
        from a2wsgi import WSGIMiddleware
        from flask import request
        from ray.exceptions import TaskCancelledError

        from . import create_app

        app = create_app(dict(self.settings), classifier=self.remote)

        @app.errorhandler(TaskCancelledError)
        def client_gone(exc):  # the client hung up mid-request and Ray cancelled it: nothing to answer
            log.info("client went away during %s %s", request.method, request.path)
            return "", 499

        return WSGIMiddleware(behind_ray_proxy(app), workers=self.capacity)


def behind_ray_proxy(app):
    """Fit the Flask ``app`` to Ray's proxy and a2wsgi (wraps its ``wsgi_app``; returns ``app``).

    - a2wsgi's ``wsgi.input`` ends where the HTTP body ends, so a chunked upload (no
      Content-Length) may be read to its end: say so (``wsgi.input_terminated``), as gunicorn does,
      else Werkzeug reads such a body as empty.
    - Ray's proxy sets ``X-Request-ID`` on every answer itself (the client's id, or its own, the
      one in Ray's logs) and hands it to the app: the app's copy would be a second header.
    """
    inner = app.wsgi_app

    def wsgi(environ, start_response):
        environ["wsgi.input_terminated"] = True

        def start(status, headers, exc_info=None):
            return start_response(status, [(k, v) for k, v in headers if k.lower() != "x-request-id"], exc_info)

        return inner(environ, start)

    app.wsgi_app = wsgi
    return app


def build_app(args: dict):
    """The Ray Serve application builder: ``import_path: webapp.cluster:build_app`` in a Serve config.

    ``args``: the config's ``args``, setting names without the prefix (``{"MODEL":
    "efficientnet_lite0", "CLUSTER_REPLICAS": 2}``), over the ``CLASSIFIER_*`` variables where
    the application is built (a ``runtime_env``'s ``env_vars`` included).

    :raises SettingsError: a bad setting.
    """
    return application(replica_settings(args))


def application(values: dict):
    """HTTP replicas in front of model replicas, with options from ``values`` (``replica_settings``)."""
    s = _load(values)
    model_options: dict = {
        "ray_actor_options": {"num_cpus": values["THREADS"]},
        "max_ongoing_requests": s.CLUSTER_MAX_ONGOING_REQUESTS,
        "max_queued_requests": s.CLUSTER_MAX_QUEUED_REQUESTS,
        "graceful_shutdown_timeout_s": s.REQUEST_TIMEOUT_S,
    }
    if s.CLUSTER_REPLICAS:
        model_options["num_replicas"] = s.CLUSTER_REPLICAS
        most = s.CLUSTER_REPLICAS
    else:  # a replica counts as busy once a full batch is in flight
        model_options["autoscaling_config"] = {"min_replicas": s.CLUSTER_MIN_REPLICAS,
                                               "max_replicas": s.CLUSTER_MAX_REPLICAS,
                                               "target_ongoing_requests": s.MAX_BATCH_SIZE}
        most = s.CLUSTER_MAX_REPLICAS
    if s.CLUSTER_MAX_ONGOING_REQUESTS < s.MAX_BATCH_SIZE:
        log.warning("CLASSIFIER_CLUSTER_MAX_ONGOING_REQUESTS=%d is below CLASSIFIER_MAX_BATCH_SIZE=%d: batches "
                    "cannot fill", s.CLUSTER_MAX_ONGOING_REQUESTS, s.MAX_BATCH_SIZE)
    model = ModelReplica.options(**model_options).bind(values)
    # Every request the model replicas may hold or queue for this HTTP replica has a thread to wait
    # in, and as many again answer the overflow at once with the JSON 429 (not the proxy's text one).
    capacity = 2 * (most * s.CLUSTER_MAX_ONGOING_REQUESTS + s.CLUSTER_MAX_QUEUED_REQUESTS)
    return Ingress.options(
        num_replicas=s.CLUSTER_INGRESS_REPLICAS, ray_actor_options={"num_cpus": 0},
        # The proxy's queue also holds a burst's requests for the moment before each is routed:
        # as deep as the HTTP replicas' threads, so only a real overflow gets the proxy's 429.
        max_ongoing_requests=capacity, max_queued_requests=capacity * s.CLUSTER_INGRESS_REPLICAS,
        backpressure_config={"status_code": 429, "retry_after_s": 1},
        graceful_shutdown_timeout_s=s.REQUEST_TIMEOUT_S + 10,  # SIGTERM: answer what is in flight
    ).bind(model, values, capacity)


def connect(address: str | None = None, *, log_to_driver: bool = True) -> bool:
    """``ray.init``: join ``address`` (or ``$RAY_ADDRESS``), else start a local Ray on this host.

    The project's code travels as the job's ``working_dir``, so nodes need only its requirements.
    Returns True when a cluster was joined, False when a local one was started.

    :raises ConnectionError: nothing accepts a TCP connection at the address within 5 s.
    """
    target = address or os.environ.get("RAY_ADDRESS")
    joined = bool(target)
    if joined and target != "auto":  # Ray itself retries an address where nothing listens for minutes
        host, _, port = target.split("://", 1)[-1].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            raise ConnectionError(f"no Ray cluster answers at {target} (--address / RAY_ADDRESS): {exc}") from None
    if not ray.is_initialized():
        ray.init(address=address or None, log_to_driver=log_to_driver,
                 runtime_env={"working_dir": str(ROOT), "excludes": WORKING_DIR_EXCLUDES})
    return joined


def serve_forever(values: dict, *, address: str | None, host: str, port: int) -> None:
    """Deploy the application as ``classifier`` at ``/`` and keep it until SIGINT or SIGTERM.

    On a cluster that was joined only the application is deleted at the end; a local Ray started
    here is shut down with it.

    :raises StartupError: the model replicas cannot start (the replica's message).
    :raises RuntimeError: the deployment failed otherwise.
    """
    import signal

    joined = connect(address)
    # After ray.init, which installs its own fatal-signal handler in this process: ours must win.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(application(values), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as exc:  # the deployment failed: say why in one line if a replica said it
            status = serve.status().applications.get(APP_NAME)
            messages = [d.message for d in status.deployments.values()] if status else []
            raise startup_failure("\n".join([*messages, str(exc)])) or exc from None
        log.info("serving on http://%s:%d (Ray Serve application %r); Ctrl-C stops it", host, port, APP_NAME)
        stop.wait()
        log.info("stopping: answering the requests in flight, then removing %r", APP_NAME)
    finally:
        try:
            serve.delete(APP_NAME)  # replicas drain first (graceful_shutdown_timeout_s) ...
            if not joined:
                serve.shutdown()  # ... then the proxy goes, with the Ray started here
        finally:
            ray.shutdown()


# -- Ray Data: bulk classification ------------------------------------------------------------------------
def parquet_schema():
    """The rows of ``classify --cluster``: one per file, errors included (Arrow schema)."""
    import pyarrow as pa

    return pa.schema([
        ("path", pa.string()), ("model", pa.string()),
        ("width", pa.int32()), ("height", pa.int32()), ("format", pa.string()),
        ("labels", pa.list_(pa.string())), ("indices", pa.list_(pa.int32())),
        ("probabilities", pa.list_(pa.float64())),
        ("error_code", pa.string()), ("error", pa.string()),
    ])


class BulkClassifier:
    """Ray Data ``map_batches`` callable class: one per actor, each with the engine loaded once.

    Input batch: ``{"path": (N,) str, "bytes": (N,) object}`` (``read_binary_files``); output: a
    ``parquet_schema()`` table of N rows. Decoded images are predicted ``MAX_BATCH_SIZE`` at a
    time as ``(n, 3, S, S) float32``. A file that cannot be decoded, or is over
    ``MAX_UPLOAD_BYTES``, gets an error row with the code and message the API would answer.
    """

    def __init__(self, values: dict):
        from .batcher import decode_executor
        from .service import Classifier

        self.settings = _load(values)
        self.clf = Classifier(self.settings)
        self.clf.load()
        self.clf.engine.thread_init()
        self.decode_pool = decode_executor(max(1, self.clf.threads))

    def _decode(self, path: str, data: bytes):
        from .service import Upload

        s = self.settings
        if len(data) > s.MAX_UPLOAD_BYTES:
            raise TooLarge(f"the file is {len(data):,} bytes; the limit is {s.MAX_UPLOAD_BYTES:,} "
                           f"(CLASSIFIER_MAX_UPLOAD_BYTES)")
        return self.clf.decode(Upload(Path(path).name, data), False, s.MAX_PIXELS)

    def __call__(self, batch: dict):
        import pyarrow as pa
        import torch

        from .batcher import checked_predict
        from .service import encode

        s, clf = self.settings, self.clf
        paths = [str(p) for p in batch["path"]]
        futures = [self.decode_pool.submit(self._decode, p, bytes(b)) for p, b in zip(paths, batch["bytes"])]
        rows = []
        for path, fut in zip(paths, futures):
            row = {"path": path, "model": clf.model.name, "width": None, "height": None, "format": None,
                   "labels": [], "indices": [], "probabilities": [], "error_code": None, "error": None}
            try:
                d, tensor, _ = fut.result()
                row.update(width=d.size[0], height=d.size[1], format=d.format, _tensor=tensor)
            except ServiceError as exc:
                row.update(error_code=exc.code, error=exc.message.removeprefix(f"{Path(path).name}: "))
            except Exception as exc:  # a bug: report it on this file, go on with the others
                log.exception("unexpected error on %s", path)
                row.update(error_code="internal_error", error=f"{type(exc).__name__}: {exc}")
            rows.append(row)
        ok = [r for r in rows if "_tensor" in r]
        for i in range(0, len(ok), s.MAX_BATCH_SIZE):
            chunk = ok[i:i + s.MAX_BATCH_SIZE]
            try:
                logits = checked_predict(clf.engine.predict, torch.stack([r.pop("_tensor") for r in chunk]))
            except InferenceFailed as exc:
                for r in chunk:
                    r.update(error_code=exc.code, error=exc.message)
                continue
            for r, row_logits in zip(chunk, logits):
                top = encode(row_logits, clf.model.categories, s.TOP_K)
                r.update(labels=[p["label"] for p in top], indices=[p["index"] for p in top],
                         probabilities=[p["probability"] for p in top])
        for r in rows:
            r.pop("_tensor", None)
        return pa.Table.from_pylist(rows, schema=parquet_schema())


def classify_to_parquet(values: dict, sources: list[str], out: str, *, address: str | None = None,
                        extensions: list[str] | None = None, progress: bool = True) -> dict:
    """Classify every file under ``sources`` with Ray Data and write one Parquet file at ``out``.

    ``sources``: files, folders (recursive; Ray Data skips names starting with ``.`` or ``_``
    directly under them) or anything ``ray.data.read_binary_files`` reads (``s3://``, ``gs://``,
    ``abfs://`` with pyarrow's credentials). ``extensions`` (no dot) keeps only those file names;
    None reads every file. ``out`` may be a local path or such a URI.
    Returns ``{"files", "failed", "seconds"}``.

    :raises FileNotFoundError: a source does not exist, or holds no file to read.
    :raises StartupError: the actors cannot start the model (their message).
    """
    import pyarrow.fs
    import pyarrow.parquet as pq
    from tqdm import tqdm

    connect(address, log_to_driver=True)
    s = _load(values)
    if not log.isEnabledFor(logging.INFO):  # Ray Data's own chatter (plans, "progress bars disabled")
        logging.getLogger("ray.data").setLevel(logging.ERROR)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # ours below counts files written
    ctx.execution_options.preserve_order = True  # rows in the order of the files: reruns diff cleanly
    # Reading is I/O: its tasks reserve no CPU, so the model actors can have every core without
    # starving the read that feeds them (with 1 CPU each, reads and actors deadlock on a full node).
    try:
        ds = ray.data.read_binary_files(sources, include_paths=True, file_extensions=extensions, num_cpus=0)
    except (ValueError, OSError) as exc:  # nothing there, no such bucket, no credentials
        raise FileNotFoundError(f"cannot list {' '.join(sources[:3])}{' ...' if len(sources) > 3 else ''}: "
                                f"{exc}") from None
    total = len(ds.input_files()) or None
    ds = ds.map_batches(BulkClassifier, fn_constructor_args=(values,), batch_size=s.MAX_BATCH_SIZE,
                        batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=s.CLUSTER_ACTORS),
                        num_cpus=values["THREADS"])
    fs, where = pyarrow.fs.FileSystem.from_uri(out) if "://" in out else (None, str(Path(out).resolve()))
    if fs is None:
        Path(where).parent.mkdir(parents=True, exist_ok=True)
    start, files, failed = time.perf_counter(), 0, 0
    bar = tqdm(total=total, unit="file", disable=not progress, desc="classify", mininterval=0.5, dynamic_ncols=True)
    try:
        with pq.ParquetWriter(where, parquet_schema(), filesystem=fs) as writer:
            for table in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                writer.write_table(table.cast(parquet_schema()))
                files += table.num_rows
                failed += table.num_rows - table.column("error_code").null_count
                bar.set_postfix(failed=failed, refresh=False)
                bar.update(table.num_rows)
    except Exception as exc:  # an actor could not start its model: one line that says why
        raise startup_failure(str(exc)) or exc from None
    finally:
        bar.close()
    return {"files": files, "failed": failed, "seconds": time.perf_counter() - start}
