"""The persistent cache folder (``CACHE_DIR``): where it is, and made, or refused, before anything starts.

Compiled kernels, AOTInductor packages, the int8 program and the precision record live there
(``webapp/startup.py``). A folder that cannot be made or written is a setting's fault: gunicorn's
master checks it before it listens (``gunicorn.conf.py``) and ``classify`` before any model starts,
so each says so in one line and exits 2, instead of a pathlib traceback or every worker's "loading
model failed" and exit 3. Torch-free, for the master.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from .paths import expand, look, reason
from .settings import PREFIX, SettingsError, given_as


def cache_dir(values: Mapping[str, Any]) -> Path:
    """The cache folder of ``values`` (``settings.load``'s): ``CACHE_DIR``, else ``~/.cache/photo-classifier``."""
    return expand(values["CACHE_DIR"] or Path.home() / ".cache" / "photo-classifier")


def unwritable(path: Path) -> str | None:
    """Why this process cannot write in the folder ``path`` ("Read-only file system", "Permission denied",
    "Operation not permitted"), or None where it can. A read-only mount is told by its flag: it said "Permission
    denied" too (tryout15). Where ``os.access`` says yes, a folder is made and removed there to be sure: root passes
    every access check, and sysfs, NFS's root squash or an ACL still refuse it (CACHE_DIR=/sys/kernel passed the
    start's checks, then every worker's compile failed: tryout34)."""
    if os.access(path, os.W_OK | os.X_OK):
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=path))
            return None
        except OSError as exc:
            return os.strerror(exc.errno) if exc.errno else str(exc)
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return os.strerror(errno.EROFS if read_only else errno.EACCES)


def folder_problem(path: Path) -> str | None:
    """Why the folder ``path`` cannot be made (with its parents) or written by this process (the OS's reason, or "it
    exists and is not a folder"), or None: made where it was missing, and writable."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return "it exists and is not a folder" if look(path)[0] not in (None, "folder") else reason(exc)
    return unwritable(path)


def make_cache_dir(values: Mapping[str, Any], *, read_only_ok: bool = False) -> Path:
    """Create the cache folder (``cache_dir``) with its parents if it is missing, as every start-up does; return it.

    ``read_only_ok``: a folder that exists and cannot be written is taken as it is (a warm cache shipped on a
    read-only mount, a container's read-only root: what it holds is used, ``startup.use_cache_dir`` says so);
    ``warm``, whose work is to write there, refuses it.

    :raises SettingsError: naming ``CLASSIFIER_CACHE_DIR`` and the folder: it cannot be created (the OS's
        reason: no such file or directory, permission denied, read-only file system, file name too long...),
        it exists and is not a folder, this process cannot write in it (unless ``read_only_ok``), or its
        ``inductor`` is not a folder.
    """
    path, named = cache_dir(values), given_as(values, "CACHE_DIR")
    what = f"{named}={path}" if values["CACHE_DIR"] else f"{named} (empty: the default {path})"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # Asked with paths.look, not path.exists(): that raises again for a name part over 255 bytes.
        why = "it exists and is not a folder" if look(path)[0] not in (None, "folder") else reason(exc)
        raise SettingsError(f"{what} cannot be created: {why}") from None
    if (why := unwritable(path)) and not read_only_ok:
        raise SettingsError(f"{what} cannot be written: {why} (warm writes the compiled model and the precision "
                            f"record there)")
    inductor = path / "inductor"  # where compiled kernels go (startup.inductor_cache_dir): a worker's compile
    if look(inductor)[0] not in (None, "folder"):  # failed on a file there, after the port was open
        raise SettingsError(f"{what}: {inductor} (where compiled kernels go) is not a folder: remove it, and the "
                            f"next start makes the folder")
    return path


def cache_dir_problem(values: Mapping[str, Any]) -> str | None:
    """What ``make_cache_dir(values, read_only_ok=True)`` would refuse, found without making anything (``serve
    --dry-run`` passed a folder the start then refused: tryout26), or None: the folder, or the nearest folder
    above it that exists, must be one, and a missing one's nearest existing folder writable."""
    path, named = cache_dir(values), given_as(values, "CACHE_DIR")
    what = f"{named}={path}" if values["CACHE_DIR"] else f"{named} (empty: the default {path})"
    below = path
    while (found := look(below))[0] is None and found[1] is None and below.parent != below:
        below = below.parent  # missing: the start makes it and its parents in the nearest existing folder
    if found[1] is not None:
        return f"{what} cannot be created: {found[1]}"
    if found[0] != "folder":
        return f"{what} cannot be created: " + ("it exists and is not a folder" if below == path else
                                                 f"{below} is not a folder")
    if below != path and (why := unwritable(below)):
        return f"{what} cannot be created: {why} (in {below})"
    return None


def where_space_ran_out(reason: str, values: Mapping[str, Any]) -> str:
    """``reason`` (a failed start-up's line), with the free space of the folders start-up writes to where it says
    a disk is full (ENOSPC): the cache folder and the temporary one, each named with its MB free. The OS's
    "No space left on device" names neither, and the two are often on different disks."""
    if os.strerror(errno.ENOSPC) not in reason:
        return reason
    where = []
    for what, path in ((given_as(values, "CACHE_DIR"), cache_dir(values)), ("TMPDIR", Path(tempfile.gettempdir()))):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        where.append(f"{what} {path} has {st.f_bavail * st.f_frsize / 2**20:,.0f} MB free")
    return (f"{reason}; {', '.join(where)} (a first compile writes about 100 MB to the cache, and the compiler's "
            f"temporary files to TMPDIR)") if where else reason
