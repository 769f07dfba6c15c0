"""Photos the package ships, and the functions that cut them out of ``../shared/images``.

- ``golden/dog.jpg``: the self-test photo; every ImageNet model should call it a dog breed.
- ``calibration/*.jpg``: real photos for int8 calibration (activation ranges) and for ``auto``'s
  start-up judgement of bf16's fidelity (``bf16.judge_bf16``), 256x256 crops
  and mirror images of the seven shared scene photos; ``CLASSIFIER_CALIBRATION_DIR`` can
  point at a user's own photos instead (better for a narrow domain, e.g. one factory line).

Both are product assets, not test fixtures: an air-gapped host has no ``../shared``.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageOps

from . import paths

HERE = Path(__file__).parent
GOLDEN = HERE / "golden" / "dog.jpg"
CALIBRATION = HERE / "calibration"
# The square around the dog in dog.jpg (768x576), resized to 224x224.
GOLDEN_BOX = (60, 196, 440, 576)
# How /readyz and /healthz name it: not "dog.jpg", which a user takes for the shared photo of that name (whose
# answer, German shepherd, this crop does not share: tryout16).
GOLDEN_SHOWN = "webapp/golden/dog.jpg (224x224 crop of the shared dog.jpg)"
CALIBRATION_SOURCES = ("dog.jpg", "eagle.jpg", "giraffe.jpg", "horses.jpg", "kite.jpg", "person.jpg", "scream.jpg")


def make_golden(source: Path, dest: Path = GOLDEN) -> None:
    """Cut the golden self-test photo (224x224 JPEG, quality 92) out of ``source`` (the shared dog.jpg)."""
    with Image.open(source) as img:
        golden = img.convert("RGB").crop(GOLDEN_BOX).resize((224, 224), Image.Resampling.LANCZOS)
    dest.parent.mkdir(parents=True, exist_ok=True)
    golden.save(dest, format="JPEG", quality=92)


def make_calibration(shared: Path, dest: Path = CALIBRATION) -> list[Path]:
    """Write 4 views of each shared scene photo (center, mirrored, two corners; 256x256 JPEG q90) to ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in CALIBRATION_SOURCES:
        with Image.open(shared / name) as img:
            img = ImageOps.exif_transpose(img).convert("RGB")
        scale = 320 / min(img.size)
        big = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.LANCZOS)
        w, h = big.size
        center = big.crop(((w - 256) // 2, (h - 256) // 2, (w + 256) // 2, (h + 256) // 2))
        views = {"center": center, "mirror": ImageOps.mirror(center),
                 "topleft": big.crop((0, 0, 256, 256)), "bottomright": big.crop((w - 256, h - 256, w, h))}
        for view, crop in views.items():
            path = dest / f"{Path(name).stem}-{view}.jpg"
            crop.save(path, format="JPEG", quality=90)
            written.append(path)
    return written


CALIBRATION_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def calibration_files(directory: str | Path | None = None) -> list[Path]:
    """The calibration photos: every image file in ``directory`` (or the shipped set), sorted.

    :raises OSError: ``directory`` cannot be listed (``calibration_problem`` says why in words).
    """
    folder = paths.expand(directory) if directory else CALIBRATION
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in CALIBRATION_SUFFIXES)


def calibration_problem(directory: str) -> str | None:
    """Why ``directory`` (``CLASSIFIER_CALIBRATION_DIR``) cannot serve as calibration photos, in words, or None:
    it does not exist, is not a folder, cannot be listed (the OS's reason: permission denied, name too
    long...), or holds no file named as a JPEG, PNG or WebP photo. Never raises."""
    folder = paths.expand(directory)
    try:
        what = paths.kind(folder)
        if what != "folder":
            return "no such folder" if what is None else "it exists and is not a folder"
        if not calibration_files(folder):
            return f"no {'/'.join(s[1:].upper() for s in CALIBRATION_SUFFIXES)} photo in it"
    except OSError as exc:  # paths.Unusable, or the listing itself
        return f"it cannot be read: {paths.reason(exc)}"
    return None
