"""A Ray Serve model replica: the gunicorn worker's start-up, decode and answer, batched by ``@serve.batch``."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from ray import serve

from .. import imaging, startup
from ..batcher import checked_predict, results
from ..concurrency import decode_executor, inference_executor
from ..contract import Upload
from ..errors import InferenceTimeout, ServiceError
from ..answers import PHOTO_FAULTS, answer, check_originals, every_fault
from ..sizes import Size, check_request_pixels
from .config import load_values, replica_id

log = logging.getLogger(__name__)


@serve.deployment(name="Model")
class ModelReplica:
    """One model replica: ``startup.load_engine`` (model, precision, compile, warm-up, self-test),
    decode on real threads, batches from ``@serve.batch``.

    Images are ``(3, S, S) float32`` after decode; a batch is ``(N, 3, S, S) float32``, N <=
    ``MAX_BATCH_SIZE``, formed within ``BATCH_TIMEOUT_MS`` of its first image; logits ``(N, C)``.
    """

    def __init__(self, values: dict):
        t0 = time.perf_counter()
        self.settings = s = load_values(values)
        self.started = started = startup.load_engine(s)
        self.infer_pool = inference_executor(started.engine.thread_init)
        self.decode_pool = decode_executor(max(2, started.threads))
        self.predict_batch.set_max_batch_size(s.MAX_BATCH_SIZE)
        self.predict_batch.set_batch_wait_timeout_s(s.BATCH_TIMEOUT_MS / 1e3)
        self.replica = replica_id()
        self.batches = self.images = self.ongoing = 0
        # The gunicorn worker's self-test, on this replica's inference thread.
        self.self_test = startup.self_test(s, started, self._predict_now)
        self.model = started.describe()
        self.startup_s = time.perf_counter() - t0
        log.info("ready in %.1f s (warm-up %.1f s)", self.startup_s, started.warm_s)

    def _predict_now(self, batch):
        """``(N, 3, S, S) float32`` -> ``(N, C)`` logits on the inference thread, outside any batch."""
        return self.infer_pool.submit(self.started.engine.predict, batch).result()

    async def classify(self, uploads: list[Upload], topk: int, keep_images: bool = False) -> dict:
        """Classify one request's uploads; all succeed or the request fails.

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

    async def _classify(self, uploads: list[Upload], topk: int, keep_images: bool) -> dict:
        s, started = self.settings, self.started
        start = time.perf_counter()
        loop = asyncio.get_running_loop()

        def prepare(up: Upload, size: Size):
            return imaging.prepare(up.data, name=up.name, transform=started.transform, max_pixels=s.MAX_PIXELS,
                                   min_side=started.min_side(s.FAST_DECODE), thumbnail=keep_images, size=size)

        read = check_request_pixels(uploads, limit=s.MAX_REQUEST_PIXELS,
                                    min_side=started.min_side(s.FAST_DECODE))
        done = await asyncio.gather(*(loop.run_in_executor(self.decode_pool, prepare, up, size)
                                      for up, size in zip(uploads, read)), return_exceptions=True)
        if faults := [item for item in done if isinstance(item, BaseException)]:  # as the gunicorn app says them
            if unexpected := [f for f in faults if not isinstance(f, PHOTO_FAULTS)]:
                raise unexpected[0]
            raise every_fault(faults, len(uploads))
        check_originals(uploads, list(done), s.MAX_PIXELS)
        decode_ms = (time.perf_counter() - start) * 1e3
        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(self.predict_batch((p.tensor, time.monotonic())) for p in done)),
                timeout=s.REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise InferenceTimeout.after(s.REQUEST_TIMEOUT_S, "cluster") from None
        return answer(self.model, started.model.categories, uploads, list(done), outcomes, topk=topk, start=start,
                      decode_ms=decode_ms)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)  # both set from the settings in __init__
    async def predict_batch(self, items: list[tuple]) -> list:
        """``[(image (3, S, S) float32, enqueued time.monotonic() s)]`` -> one ``batcher.Result`` each.

        :raises InferenceFailed: the model raised, or returned a row count other than the batch's
            (every request of the batch gets the 500, as with the gunicorn batcher).
        """
        import torch

        now = time.monotonic()
        batch = torch.stack([t for t, _ in items])
        t0 = time.perf_counter()
        logits = await asyncio.get_running_loop().run_in_executor(self.infer_pool, checked_predict,
                                                                  self.started.engine.predict, batch)
        took = time.perf_counter() - t0
        self.batches += 1
        self.images += len(items)
        return results(logits, [enq for _, enq in items], now=now, took=took)

    def describe(self) -> dict:
        """The answers' ``model`` object (name, weights, precision, ...)."""
        return self.model

    def health(self) -> dict:
        """The gunicorn worker's ``/healthz`` fields for this replica, plus its ``replica`` id."""
        engine = self.started.engine
        return {"status": "ok", "ready": True, "state": "ready", "pid": os.getpid(),
                "cores": sorted(os.sched_getaffinity(0)), "intra_op_threads": self.started.threads,
                "model": self.model, "precision": engine.precision, "precision_reason": self.started.precision_reason,
                "int8_reduce_range": engine.reduce_range, "self_test": self.self_test,
                "startup_s": round(self.startup_s, 2), "max_batch_size": self.settings.MAX_BATCH_SIZE,
                "queue_depth": self.ongoing, "batches": self.batches, "images": self.images, "replica": self.replica}

    def check_health(self) -> None:
        """Ray Serve's periodic health check: the inference thread must still take work.

        :raises RuntimeError: it did not run a no-op within 10 s (Ray then replaces the replica).
        """
        self.infer_pool.submit(lambda: None).result(timeout=10)
