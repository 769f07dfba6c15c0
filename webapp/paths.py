"""Looking at a path a user gave (a command line's files and folders, ``--out``, ``--dest``, the path settings
``WEIGHTS``, ``CACHE_DIR``, ``CALIBRATION_DIR``) without a traceback.

pathlib's ``exists()``, ``is_file()`` and ``is_dir()`` answer False for a path that is not there (ENOENT,
ENOTDIR, ELOOP) but raise ``OSError`` for one that cannot even be looked at: a name part over 255 bytes
(ENAMETOOLONG), a parent folder this process may not search (EACCES). ``kind`` answers the first and raises
``Unusable`` for the second, whose text names the path and the OS's reason in words ("PATH: File name too
long"), so each caller says it in one line with its own exit status. Standard library only: gunicorn's master
uses it (``caches``).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# pathlib's "is not there": a missing path or folder on the way, a broken or looping link.
NOT_THERE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EBADF})


class Unusable(OSError):
    """A path that cannot be looked at (``errno``, ``strerror`` and ``filename`` as ``OSError``'s); ``str()`` is
    ``"PATH: reason"``, the reason as ``os.strerror`` words it."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def reason(exc: OSError) -> str:
    """The OS's words for ``exc`` (``os.strerror`` of its errno: "File name too long"), else its own text."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


def kind(path: str | os.PathLike) -> str | None:
    """What is at ``path``, links followed: ``"file"`` (a regular file), ``"folder"``, ``"other"`` (a FIFO,
    socket or device), or None when nothing is (missing, a folder on the way missing, a broken or looping link,
    a name with a NUL byte).

    :raises Unusable: ``path`` cannot be looked at: a name too long, no permission to search a folder on the
        way, an I/O error...
    """
    try:
        mode = os.stat(path).st_mode
    except ValueError:  # an embedded NUL byte: no such path can exist (pathlib's exists() says False too)
        return None
    except OSError as exc:
        if exc.errno in NOT_THERE:
            return None
        raise Unusable(exc.errno, reason(exc), os.fspath(path)) from None
    return "file" if stat.S_ISREG(mode) else "folder" if stat.S_ISDIR(mode) else "other"


def look(path: str | os.PathLike) -> tuple[str | None, str | None]:
    """``(kind(path), None)``, or ``(None, the OS's reason)`` where ``path`` cannot be looked at: for a report
    (``info``) that shows either. Raises nothing."""
    try:
        return kind(path), None
    except Unusable as exc:
        return None, exc.strerror


def not_a_file(path: str | os.PathLike) -> str:
    """Why ``path`` is not a regular file to read, in words that say what is there instead: "does not exist", "is
    a folder, not a file", "is a link to T, which does not exist", "is a link that loops", "cannot be looked at:
    Permission denied"...; "" where it is a file. A dangling or looping link was said as "does not exist", which
    sent users looking for a file they could see in ``ls`` (tryout26). Raises nothing."""
    try:
        what = kind(path)
    except Unusable as exc:
        return f"cannot be looked at: {exc.strerror}"
    if what is not None:
        return {"file": "", "folder": "is a folder, not a file"}.get(what, "is not a regular file (a FIFO or device)")
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except ValueError:  # a NUL byte in the name
        return "does not exist"
    except OSError as exc:
        return {errno.ELOOP: "goes through a link that loops",
                errno.ENOTDIR: "does not exist (a part of its path is a file, not a folder)"}.get(exc.errno,
                                                                                               "does not exist")
    if not is_link:
        return "does not exist"
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a link that loops (Too many levels of symbolic links)"
    return f"is a link to {os.readlink(path)}, which does not exist"


def said(exc: OSError) -> str:
    """``exc`` in one line: ``"PATH: reason"`` (``os.strerror``'s words) when it names a path, else its own text
    (``mkdir``'s ``[Errno 36] File name too long: '...'`` becomes ``.../aaa: File name too long``)."""
    return f"{exc.filename}: {reason(exc)}" if exc.filename is not None and exc.errno else str(exc)


def expand(path: str | os.PathLike) -> Path:
    """``path`` with ``~`` and ``~user`` expanded as the shell does; ``~name`` of no known user is left as it is
    (pathlib's ``expanduser()`` raises ``RuntimeError`` for it, a traceback), so looking at it then says there is
    no such path."""
    return Path(os.path.expanduser(path))
