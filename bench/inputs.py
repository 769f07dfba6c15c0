"""The engine benchmarks' inputs: real photos, decoded and preprocessed with the service's own pipeline.

``shared_photos`` decodes every photo in ``../shared/images`` as the service decodes uploads;
``augmented`` makes deterministic variants of them (crops, mirrors, rescales) for top-1 agreement;
``make_inputs`` turns both, and the shipped calibration photos, into one model's float32 NCHW
tensors. Used by ``engine_bench.py``, ``runtimes.py`` and ``int8_range_bench.py``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from PIL import Image, ImageOps

from bench import IMAGES
from webapp import assets, imaging, models

BATCH = 8  # the bs8 of the throughput figures; also the chunk size of the fidelity runs


def shared_photos() -> list[tuple[str, Image.Image]]:
    """Every photo in ``../shared/images`` as (file name, RGB image), decoded as the service decodes uploads
    (fast decode on); scene photos first.

    :raises SystemExit: the folder is absent.
    """
    if not IMAGES.is_dir():
        raise SystemExit(f"no shared photos at {IMAGES}: this benchmark needs real photos")
    out = []
    for path in sorted(IMAGES.iterdir()):
        if path.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"):
            d = imaging.decode(path.read_bytes(), max_pixels=80_000_000, name=path.name, min_side=256)
            out.append((path.name, d.image))
    # Scene photos first (the two 12 MP files are dog.jpg again): bs8 and bs1 use varied photos.
    out.sort(key=lambda item: (item[0].startswith("phone"), item[0]))
    return out


def augmented(photos: list[Image.Image], n: int, *, seed: int) -> list[Image.Image]:
    """``n`` deterministic variants of ``photos``: a random crop (35-100 % of the area, aspect 3:4..4:3),
    a mirror half the time, and a rescale of the result to a short side of 96..640 px (bicubic),
    so the pipeline sees zoomed-in, mirrored, low- and high-resolution views."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        img = photos[k % len(photos)]
        w, h = img.size
        area = rng.uniform(0.35, 1.0) * w * h
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw = min(w, max(16, round(math.sqrt(area * aspect))))
        ch = min(h, max(16, round(math.sqrt(area / aspect))))
        x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
        view = img.crop((x0, y0, x0 + cw, y0 + ch))
        if rng.random() < 0.5:
            view = ImageOps.mirror(view)
        short = rng.randint(96, 640)
        scale = short / min(view.size)
        view = view.resize((max(1, round(view.width * scale)), max(1, round(view.height * scale))),
                           Image.Resampling.BICUBIC)
        out.append(view)
    return out


@dataclass
class Inputs:
    """One model's inputs, all ``float32`` NCHW (``S`` = the model's crop), preprocessed by its own transform.

    ``fixed``: (P, 3, S, S), the shared photos (the logit-error batch); ``fidelity``: (P + extra, 3, S, S),
    they and the augmentations (the top-1 agreement set); ``calibration``: (3, S, S) each, the shipped
    calibration photos; ``bs1``: (1, 3, S, S); ``bs8``: (BATCH, 3, S, S), the photos repeated as needed.
    """

    names: list[str]
    fixed: torch.Tensor        # the shared photos: the logit-error batch
    fidelity: torch.Tensor     # shared photos + augmentations: the top-1 agreement set
    calibration: list[torch.Tensor]
    bs1: torch.Tensor
    bs8: torch.Tensor


def make_inputs(loaded: models.LoadedModel, photos: list[tuple[str, Image.Image]], extra: list[Image.Image]) -> Inputs:
    """``loaded``'s inputs from ``shared_photos()`` and ``extra`` images (fidelity only; may be empty)."""
    transform = imaging.build_transform(loaded.preprocessing)
    fixed = torch.stack([imaging.preprocess(img, transform) for _, img in photos])
    fidelity = torch.cat([fixed, torch.stack([imaging.preprocess(img, transform) for img in extra])]) if extra else fixed
    calibration = []
    for path in assets.calibration_files():
        d = imaging.decode(path.read_bytes(), max_pixels=80_000_000, name=path.name)
        calibration.append(imaging.preprocess(d.image, transform))
    if len(fixed) < BATCH:
        fixed_bs8 = fixed.repeat((BATCH + len(fixed) - 1) // len(fixed), 1, 1, 1)[:BATCH]
    else:
        fixed_bs8 = fixed[:BATCH]
    return Inputs(names=[n for n, _ in photos], fixed=fixed, fidelity=fidelity, calibration=calibration,
                  bs1=fixed[:1].clone(), bs8=fixed_bs8.clone())

