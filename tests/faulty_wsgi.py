"""Test-only WSGI app: the real ``webapp.create_app()``, with two faults planted for tests/test_faults.py.

Serve it with gunicorn from the repo root, with ``tests/`` importable (``PYTHONPATH=tests``)::

    PYTHONPATH=tests gunicorn -c gunicorn.conf.py faulty_wsgi:app

1. **Poison image**: a solid RGB(13, 17, 211) image (the test sends it at 13x17 pixels;
   ``FAULTY_POISON_RGB`` and ``FAULTY_POISON_SIZE`` in the environment change them). When a batch
   that holds it reaches the inference thread, ``InferenceBatcher._run_batch`` raises
   ``InferenceLoopKilled``, a ``BaseException`` that is *not* an ``Exception``: the batcher's
   per-batch ``except Exception`` does not catch it, so it leaves the loop and the inference
   thread dies, exactly as a bug in the loop itself would. Detection compares each queued tensor
   with the preprocessed poison image exactly (``torch.equal``): a solid image stays exactly
   solid through resize, crop and normalize, so any solid image of that colour matches (whatever
   its size) and no photo does.
2. **A start that fails on demand**: while the file named by ``FAULTY_FAIL_START`` exists, a worker's start-up
   fails (``StartupError``, its reason the file's text), as a full cache disk or a damaged weights file fails
   a reload or a replacement worker (tests/test_reloads.py).
3. ``GET /api/_test/boom`` raises a plain ``RuntimeError`` with ``FAULTY_SECRET`` in its message (an
   unexpected server error), and ``GET /api/_test/flags`` shows ``app.debug`` and
   ``PROPAGATE_EXCEPTIONS`` as the worker sees them.

Nothing else differs from ``wsgi:app``: same settings, same gunicorn.conf.py hooks.
"""

from __future__ import annotations

import os

import torch
from PIL import Image

from webapp import create_app, imaging
from webapp.batcher import InferenceBatcher
from webapp.errors import StartupError

# The test passes these in the environment (it never imports this module: importing it builds a model).
POISON_SIZE = tuple(int(v) for v in os.environ.get("FAULTY_POISON_SIZE", "13,17").split(","))
POISON_COLOUR = tuple(int(v) for v in os.environ.get("FAULTY_POISON_RGB", "13,17,211").split(","))
SECRET = os.environ.get("FAULTY_SECRET", "secret internal detail 0xDEADBEEF")


class InferenceLoopKilled(BaseException):
    """Raised in the inference loop on the poison image: a BaseException, so only the loop's last resort sees it."""


def poison_image() -> Image.Image:
    return Image.new("RGB", POISON_SIZE, POISON_COLOUR)


app = create_app()
_classifier = app.extensions["classifier"]
_poison: torch.Tensor | None = None


def _is_poison(t: torch.Tensor) -> bool:
    global _poison
    if _poison is None:  # first batch: the classifier's transform exists once the worker started it
        _poison = imaging.preprocess(poison_image(), _classifier.started.transform)
    return t.shape == _poison.shape and torch.equal(t, _poison)


_original_run_batch = InferenceBatcher._run_batch


def _run_batch(self, batch):
    if any(_is_poison(r.tensor) for r in batch):
        raise InferenceLoopKilled(f"poison image in a batch of {len(batch)} (pid {os.getpid()})")
    return _original_run_batch(self, batch)


InferenceBatcher._run_batch = _run_batch
_original_start = _classifier.start


def _start(*args, **kwargs):
    planted = os.environ.get("FAULTY_FAIL_START")
    if planted and os.path.exists(planted):
        with open(planted) as f:
            raise StartupError(f.read().strip() or "planted start-up failure")
    return _original_start(*args, **kwargs)


_classifier.start = _start


@app.get("/api/_test/boom")
def boom():
    raise RuntimeError(SECRET)


@app.get("/api/_test/flags")
def flags():
    return {"pid": os.getpid(), "debug": app.debug, "propagate_exceptions": app.config.get("PROPAGATE_EXCEPTIONS")}
