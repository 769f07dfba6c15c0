"""The install kit's own files, for ``python -m webapp bundle``: lock, manifest, target, size summary, tar.

A kit is a folder (see ``bundle``): ``wheels/``, ``src/``, ``weights/``, ``install.sh``, ``deploy/``,
``Containerfile``, and the files written here:

- ``requirements.lock``: one ``name==version --hash=sha256:...`` line per wheel in ``wheels/``, every
  transitive dependency pinned exactly, as ``pip install --require-hashes`` needs.
- ``TARGET``: ``key=value`` lines install.sh reads in POSIX sh (Python version, machine, the newest
  glibc any wheel needs), so a wrong host is refused before pip is run.
- ``MANIFEST.sha256``: ``sha256sum`` format (``<hex>  <path>``) over every other file of the kit, so
  ``sha256sum -c`` checks it anywhere coreutils exist.

Nothing here imports torch: the functions take paths and return text or numbers (sizes in bytes).
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .common import plural

MANIFEST = "MANIFEST.sha256"
LOCK = "requirements.lock"
TARGET = "TARGET"

# PEP 427: {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")
# The wheels only torch's CUDA build pulls in (the CPU-only build from download.pytorch.org/whl/cpu has none).
_CUDA = re.compile(r"^(nvidia[-_]|cuda[-_]|triton-)", re.IGNORECASE)


@dataclass(frozen=True)
class Wheel:
    """One wheel file: ``name`` (normalized, PEP 503), ``version``, its ``platforms`` tags, ``size`` (bytes)."""

    path: Path
    name: str
    version: str
    platforms: tuple[str, ...]
    size: int

    @property
    def cuda(self) -> bool:
        """True for the CUDA libraries torch's default PyPI build depends on (nvidia-*, cuda-*, triton)."""
        return bool(_CUDA.match(self.path.name))


def parse_wheel(path: Path) -> Wheel:
    """Read name, version and platform tags from a wheel's file name.

    :raises ValueError: ``path`` is not named like a wheel (PEP 427).
    """
    m = _WHEEL.match(path.name)
    if not m:
        raise ValueError(f"{path.name} is not a wheel file name (name-version-python-abi-platform.whl)")
    name = re.sub(r"[-_.]+", "-", m["name"]).lower()
    return Wheel(path=path, name=name, version=m["version"], platforms=tuple(m["plat"].split(".")),
                 size=path.stat().st_size)


def wheels_in(folder: Path) -> list[Wheel]:
    """Every ``*.whl`` in ``folder``, sorted by name.

    :raises ValueError: two versions of one project (the lock pins exactly one), or a non-wheel file name.
    """
    wheels = sorted((parse_wheel(p) for p in folder.glob("*.whl")), key=lambda w: w.name)
    seen: dict[str, Wheel] = {}
    for w in wheels:
        if w.name in seen:
            raise ValueError(f"two wheels of {w.name} in {folder}: {seen[w.name].path.name}, {w.path.name}")
        seen[w.name] = w
    return wheels


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (a 1 GB wheel never sits in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def lock_text(wheels: list[Wheel], hashes: dict[Path, str]) -> str:
    """``requirements.lock``: ``name==version --hash=sha256:<hex>`` per wheel (``hashes``: path -> hex)."""
    head = ["# Every package of the kit, pinned and hash-checked: pip install --no-index --find-links wheels "
            "--require-hashes -r requirements.lock"]
    return "\n".join(head + [f"{w.name}=={w.version} --hash=sha256:{hashes[w.path]}" for w in wheels]) + "\n"


def glibc_needed(wheels: list[Wheel]) -> tuple[int, int] | None:
    """The newest glibc any wheel needs (``(2, 28)`` for a ``manylinux_2_28`` wheel), None if all are pure.

    A wheel with several tags (``manylinux2014_x86_64.manylinux_2_17_x86_64``) needs the oldest of them.
    """
    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
    need = None
    for w in wheels:
        versions = []
        for tag in w.platforms:
            m = re.match(r"manylinux_(\d+)_(\d+)_", tag)
            if m:
                versions.append((int(m[1]), int(m[2])))
            elif tag.split("_")[0] in legacy:
                versions.append(legacy[tag.split("_")[0]])
        if versions:
            need = max(need or (0, 0), min(versions))
    return need


def machine_needed(wheels: list[Wheel]) -> str | None:
    """The CPU architecture the platform wheels are built for (``x86_64``), None if all are pure.

    :raises ValueError: wheels for two architectures in one kit.
    """
    arches = {re.sub(r"^(manylinux\d*(_\d+_\d+)?|musllinux_\d+_\d+|linux)_", "", tag)
              for w in wheels for tag in w.platforms if tag != "any"}
    if len(arches) > 1:
        raise ValueError(f"wheels for several architectures in one kit: {sorted(arches)}")
    return arches.pop() if arches else None


def target_text(python: str, wheels: list[Wheel], platform: str) -> str:
    """``TARGET``: what install.sh checks before anything else (``python=3.11``, ``machine``, ``glibc``)."""
    glibc = glibc_needed(wheels)
    return (f"# What this kit needs (install.sh checks it first): CPython {python}, Linux on "
            f"{machine_needed(wheels) or 'any CPU'}, glibc >= {'.'.join(map(str, glibc)) if glibc else 'any'}\n"
            f"python={python}\nmachine={machine_needed(wheels) or ''}\n"
            f"glibc={'.'.join(map(str, glibc)) if glibc else ''}\nplatform={platform}\n")


def kit_files(kit: Path) -> list[Path]:
    """Every regular file under ``kit`` (relative, sorted), but the manifest itself and an installed venv."""
    out = []
    for dirpath, dirnames, filenames in os.walk(kit):
        rel = Path(dirpath).relative_to(kit)
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames if d != "venv"]
        dirnames.sort()
        out += [rel / f for f in sorted(filenames) if not (rel == Path(".") and f == MANIFEST)]
    return sorted(out, key=str)


def manifest_text(kit: Path, known: dict[Path, str] | None = None) -> str:
    """``MANIFEST.sha256`` for ``kit``: ``<sha256>  <relative path>`` per file (``known``: hashes already
    computed, by absolute path, so a 1 GB wheel is read once)."""
    known = known or {}
    lines = []
    for rel in kit_files(kit):
        if "\n" in str(rel) or "\\" in str(rel):
            raise ValueError(f"{rel}: a file name sha256sum -c cannot read back")
        lines.append(f"{known.get(kit / rel) or sha256_file(kit / rel)}  {rel}")
    return "\n".join(lines) + "\n"


def human(n: float) -> str:
    """Bytes as ``1.2 GB`` / ``340 MB`` / ``12 kB`` (decimal units, as ``du --si`` and pip say them)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def size_summary(kit: Path, wheels: list[Wheel], *, biggest: int = 5) -> str:
    """The kit's size in words: total, wheels, the ``biggest`` wheels, and the CUDA libraries' share."""
    total = sum((kit / rel).stat().st_size for rel in kit_files(kit))
    wheel_bytes = sum(w.size for w in wheels)
    cuda = [w for w in wheels if w.cuda]
    cuda_bytes = sum(w.size for w in cuda)
    lines = [f"kit {kit}: {human(total)} in all; {plural(len(wheels), 'wheel')} {human(wheel_bytes)}"]
    for w in sorted(wheels, key=lambda w: -w.size)[:biggest]:
        lines.append(f"  {human(w.size):>9}  {w.path.name}")
    if cuda:
        lines.append(f"CUDA libraries torch's PyPI build pulls in ({plural(len(cuda), 'wheel')}: nvidia-*, cuda-*, triton): "
                     f"{human(cuda_bytes)}, {100 * cuda_bytes / max(wheel_bytes, 1):.0f}% of the wheels, never used "
                     f"on a CPU server. A kit built with --index-url https://download.pytorch.org/whl/cpu "
                     f"--extra-index-url https://pypi.org/simple has none of them (and a smaller torch wheel).")
    return "\n".join(lines)


def write_tar(kit: Path, dest: Path) -> Path:
    """One uncompressed ``.tar`` of ``kit`` (its folder name at the top; wheels do not compress further).

    Written to a temporary name and renamed, so a half-written tar is never taken for a kit.
    """
    tmp = dest.with_name(dest.name + ".part")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(kit, arcname=kit.name, filter=lambda ti: None if ti.name == f"{kit.name}/venv" else ti)
    os.replace(tmp, dest)
    return dest
