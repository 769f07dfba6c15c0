"""``python -m webapp bundle --out DIR``: the air-gapped install kit, built where a package index exists.

The kit (``DIR``, and ``DIR.tar`` with ``--tar``):

- ``wheels/``: every wheel ``requirements.txt`` needs, transitively, for the target (``pip download
  --only-binary=:all:``; default this host's Python and platform, else ``--python-version`` and
  ``--platform``), from the indexes pip is configured with or ``--index-url`` / ``--extra-index-url``;
- ``src/``: the service (``webapp/``, ``static/``, ``templates/``, ``wsgi.py``, ``gunicorn.conf.py``,
  the requirements files, ``deploy/``, README), as git tracks them where this is a git checkout;
- ``weights/``: ResNet-18's weights where the service's own order finds them here
  (``CLASSIFIER_WEIGHTS``, then the torch hub cache), hash-checked; the offline model's are in its wheel;
- ``install.sh``, ``deploy/photo-classifier.service``, ``deploy/photo-classifier.env``, ``Containerfile``
  (and ``.dockerignore``: a kit's venv stays out of a container build's context);
- ``requirements.lock``, ``TARGET``, ``MANIFEST.sha256`` (``webapp/cli/kit.py``).

Progress and the size summary go to stderr; stdout gets the kit's path (and the tar's) only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from .. import settings as settings_mod
from ..paths import expand, kind, not_a_file, reason
from . import kit
from .common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ROOT, err
from .options import path_arg

# What of the repository the service needs at run time (tests, benchmarks and docs stay behind).
SOURCE = ("webapp", "static", "templates", "deploy", "wsgi.py", "gunicorn.conf.py", "README.md",
          "requirements.txt")
TEMPLATES = {"install.sh": "deploy/install.sh", "Containerfile": "deploy/Containerfile",
             "deploy/photo-classifier.service": "deploy/photo-classifier.service",
             "deploy/photo-classifier.env": "deploy/photo-classifier.env"}


def _python_version(text: str) -> str:
    if not re.fullmatch(r"3\.\d{1,2}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: a CPython minor version such as 3.11")
    return text


def _platform_tag(text: str) -> str:
    if not re.fullmatch(r"(manylinux_\d+_\d+|manylinux2014|manylinux2010|manylinux1)_(x86_64|aarch64)", text):
        raise argparse.ArgumentTypeError(f"{text!r}: a manylinux wheel tag such as manylinux_2_28_x86_64")
    return text


def add_parser(sub) -> None:
    """Add the ``bundle`` command to ``sub`` (the top parser's subparsers)."""
    p = sub.add_parser(
        "bundle", help="build the install kit for a host without internet (wheels, source, weights, install.sh)",
        description="Build the air-gapped install kit where a package index is reachable: the wheels of "
                    "requirements.txt with a hash-pinned lock, the service's source, ResNet-18's weights if found "
                    "here, install.sh, the systemd unit and the Containerfile, and a sha256 manifest of it all. "
                    "On the host without network: DIR/install.sh. Progress and sizes go to stderr.")
    p.add_argument("--out", type=path_arg, required=True, metavar="DIR", help="the kit folder to make (new or empty)")
    p.add_argument("--tar", action="store_true", help="also write DIR.tar, one file for the USB stick")
    p.add_argument("--python-version", type=_python_version, default=None, metavar="X.Y",
                   help="CPython version of the target host (default: this one's, %d.%d)" % sys.version_info[:2])
    p.add_argument("--platform", type=_platform_tag, default=None, metavar="TAG",
                   help="wheel platform of the target host, e.g. manylinux_2_28_x86_64 (its glibc 2.28 or newer; "
                        "default: this host's)")
    p.add_argument("--index-url", default=None, metavar="URL",
                   help="package index to use instead of pip's configured one, e.g. "
                        "https://download.pytorch.org/whl/cpu for torch without CUDA (with --extra-index-url "
                        "https://pypi.org/simple for the rest)")
    p.add_argument("--extra-index-url", action="append", default=[], metavar="URL",
                   help="another package index (repeatable)")
    p.add_argument("--requirements", type=path_arg, default=ROOT / "requirements.txt", metavar="FILE",
                   help=argparse.SUPPRESS)  # tests: a small kit
    p.set_defaults(func=cmd_bundle)


def pip_download_command(args: argparse.Namespace, dest: Path) -> list[str]:
    """The ``pip download`` argv for ``args``'s target: wheels only, into ``dest``.

    With ``--python-version`` or ``--platform`` pip resolves for that target (CPython ABI of that
    version); without, for this interpreter and platform.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(dest),
           "--progress-bar", "off", "-r", str(args.requirements)]
    if args.python_version or args.platform:
        version = args.python_version or "%d.%d" % sys.version_info[:2]
        cmd += ["--implementation", "cp", "--python-version", version, "--abi", "cp" + version.replace(".", "")]
        if args.platform:
            cmd += ["--platform", args.platform]
    if args.index_url:
        cmd += ["--index-url", args.index_url]
    for url in args.extra_index_url:
        cmd += ["--extra-index-url", url]
    return cmd


def host_platform() -> str:
    """This host's wheel platform as pip matches it (``manylinux_2_36_x86_64``; ``linux_x86_64`` without glibc)."""
    import platform

    libc, version = platform.libc_ver()
    arch = platform.machine()
    if libc == "glibc" and version:
        major, minor = version.split(".")[:2]
        return f"manylinux_{major}_{minor}_{arch}"
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def source_files(root: Path = ROOT) -> list[Path]:
    """The service's files under ``root`` (relative): in a git checkout, those of ``SOURCE`` git tracks or
    would (``.gitignore``'d caches and scratch stay out), as they are in the working tree; else every file
    there but caches."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                              "--", *SOURCE], capture_output=True, check=True).stdout.decode()
        files = [Path(f) for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for name in SOURCE:
            top = root / name
            found = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]
            files += [p.relative_to(root) for p in found if "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return sorted(f for f in files if (root / f).is_file())


def find_weights() -> tuple[Path | None, str]:
    """ResNet-18's weights as the service would find them here, without downloading: ``CLASSIFIER_WEIGHTS``,
    then the torch hub cache. Returns ``(path or None, what was found, in words)``.

    :raises StartupError: a file is there but fails its sha256 check (a kit never carries a bad one), a
        place cannot be looked at (``CLASSIFIER_WEIGHTS`` with a name too long...), or ``CLASSIFIER_WEIGHTS``
        names no file (the service refuses to start on it too; a kit without the weights asked for would
        serve the offline model where ResNet-18 was wanted), or the hub cache holds something other than a file
        where the file goes (a folder, a dangling link), as the service refuses it.
    """
    from ..errors import StartupError
    from ..models import RESNET18_URL, check_weights_file, hub_checkpoint_path

    s = settings_mod.load()
    candidates = ([expand(s.WEIGHTS)] if s.WEIGHTS else []) + [hub_checkpoint_path(RESNET18_URL)]
    for path in candidates:
        if not (why := not_a_file(path)):  # a file
            check_weights_file(path, RESNET18_URL)
            return path, f"{path}, sha256 checked"
        if why.startswith(cannot := "cannot be looked at: "):  # a name too long...: a bad setting, in one line
            raise StartupError(f"{path}: {why.removeprefix(cannot)}")
        if s.WEIGHTS and path == candidates[0]:  # what is there instead: missing, a folder, a dangling link...
            raise StartupError(f"CLASSIFIER_WEIGHTS={s.WEIGHTS} {why}. Put a copy of "
                               f"{RESNET18_URL} there, or unset CLASSIFIER_WEIGHTS to bundle without it.")
        if not why.startswith("does not exist"):  # the hub cache's: as the service refuses it
            raise StartupError(f"the torch hub cache's {path} {why}: put the file there in its place")
    return None, (f"none at {', '.join(map(str, candidates))}: the kit serves the offline EfficientNet-Lite0 "
                  f"(python -m webapp weights fetch, then bundle again, adds ResNet-18)")


def _copy(src: Path, dest: Path, mode: int | None = None) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    os.chmod(dest, mode if mode is not None else 0o644)


def _remove_partial(out: Path, made: bool) -> None:
    """After a failed or interrupted build: remove what this run put in ``out`` (everything: it was empty), and
    ``out`` itself where it made it, and a half-written tar, so that the same command can be run again (a left
    folder was refused as not empty: tryout25) and no part of a kit is taken for one."""
    if made:
        shutil.rmtree(out, ignore_errors=True)
    else:
        for child in list(out.iterdir()) if out.is_dir() else ():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    child.unlink()
    with contextlib.suppress(OSError):
        out.with_name(out.name + ".tar.part").unlink()


def cmd_bundle(args: argparse.Namespace) -> int:
    """``bundle``: build the kit in ``--out`` (and ``--out``.tar with ``--tar``).

    Returns EXIT_OK; EXIT_USAGE when ``--out`` is a file or a non-empty folder, or cannot be looked at or made
    (one line: the path and the OS's reason); EXIT_FAILED when
    pip cannot download a wheel (its message is shown), or, before anything is downloaded, a weights file
    found here fails its hash check or ``CLASSIFIER_WEIGHTS`` names no file (``find_weights``). A failure or a
    Ctrl-C (``KeyboardInterrupt``, raised on) part-way removes what the run made (``_remove_partial``).
    """
    from ..errors import StartupError

    try:  # before minutes of downloading: a bad weights file or setting fails at once, leaving no folder behind
        weights, found = find_weights()
    except StartupError as exc:
        err(f"error: {exc}")
        return EXIT_FAILED
    out: Path = expand(args.out).resolve()
    try:
        what = kind(out)  # raises Unusable: a name too long, a folder on the way not searchable
        if what is not None and (what != "folder" or any(out.iterdir())):
            err(f"error: {out} exists and is {'not an empty folder' if what == 'folder' else 'not a folder'}; give "
                f"a new one")
            return EXIT_USAGE
        made = what is None  # what a failure removes again: the folder, or what was put in the empty one
        (out / "wheels").mkdir(parents=True)
    except OSError as exc:  # or it cannot be made: read-only, no permission...
        err(f"error: --out: {out}: {reason(exc)}")
        return EXIT_USAGE
    try:  # a Ctrl-C (or a fault) part-way leaves no half-built kit in the way of the next try
        code = _build(args, out, weights, found)
    except BaseException:
        _remove_partial(out, made)
        raise
    if code != EXIT_OK:
        _remove_partial(out, made)
    return code


def _build(args: argparse.Namespace, out: Path, weights: Path | None, found: str) -> int:
    """``bundle``'s five steps into ``out`` (made, empty but for ``wheels``); EXIT_OK or EXIT_FAILED (pip's failure,
    said here); the caller removes what a failure left."""
    from tqdm import tqdm

    python = args.python_version or "%d.%d" % sys.version_info[:2]
    platform = args.platform or host_platform()
    err(f"building the install kit in {out} for CPython {python} on {platform}")
    wheels_dir = out / "wheels"

    err("[1/5] downloading wheels (pip download --only-binary=:all:) ...")
    cmd = pip_download_command(args, wheels_dir)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:  # pip's own lines, the ones that say what it fetches, as they come
        line = line.rstrip()
        tail = (tail + [line])[-30:]
        if line.startswith(("Collecting", "Saved", "Successfully", "ERROR", "File was already")):
            err(f"  {line}")
    if proc.wait() != 0:
        for line in tail:
            err(line)
        err(f"error: pip download failed (exit {proc.returncode}): {' '.join(cmd)}")
        return EXIT_FAILED
    try:
        wheels = kit.wheels_in(wheels_dir)
    except ValueError as exc:
        err(f"error: {exc}")
        return EXIT_FAILED

    err("[2/5] copying the service's source ...")
    files = source_files()
    for rel in files:
        _copy(ROOT / rel, out / "src" / rel, 0o755 if os.access(ROOT / rel, os.X_OK) else 0o644)
    for name, template in TEMPLATES.items():
        _copy(ROOT / template, out / name, 0o755 if name.endswith(".sh") else 0o644)
    # A container build from a kit already installed here must not send its venv (GBs) as build context.
    (out / ".dockerignore").write_text("venv\n*.tar\n", encoding="utf-8")
    err(f"  {len(files)} files into src/; install.sh, Containerfile, deploy/")

    err("[3/5] ResNet-18 weights ...")  # found (and hash-checked) before the download
    if weights is not None:  # under torchvision's name (its sha256 checked): where the hub looks, what install.sh checks
        from ..models import RESNET18_URL, hub_checkpoint_path

        _copy(weights, out / "weights" / hub_checkpoint_path(RESNET18_URL).name)
    err(f"  {found}")

    err("[4/5] hashing: requirements.lock, MANIFEST.sha256 ...")
    hashes: dict[Path, str] = {}
    with tqdm(total=sum(w.size for w in wheels), unit="B", unit_scale=True, desc="  sha256", file=sys.stderr,
              disable=None) as bar:
        for w in wheels:
            hashes[w.path] = kit.sha256_file(w.path)
            bar.update(w.size)
    (out / kit.LOCK).write_text(kit.lock_text(wheels, hashes), encoding="utf-8")
    (out / kit.TARGET).write_text(kit.target_text(python, wheels, platform), encoding="utf-8")
    (out / kit.MANIFEST).write_text(kit.manifest_text(out, hashes), encoding="utf-8")
    print(out)

    if args.tar:
        err("[5/5] writing the tar ...")
        print(kit.write_tar(out, out.with_name(out.name + ".tar")))
    else:
        err("[5/5] no --tar: the folder is the kit")
    err(kit.size_summary(out, wheels))
    err(f"on the host without network: {out.name}/install.sh (README: Install on a host without internet)")
    return EXIT_OK
