"""Which files ``classify`` reads: files and folders from the command line -> a stable list of files."""

from __future__ import annotations

import os
from pathlib import Path

from ..contract import FORMAT_NAMES, FORMATS
from ..paths import Unusable, kind
from .common import err, plural

# The file names of each format the server reads (``contract.FORMATS``, the formats Pillow may open there; one
# table, so the folder search cannot drift from it: tests/test_cli.py checks it against Pillow's own extensions).
# MPO (a JPEG with more images after it: phones' gain and depth maps) is read as JPEG, APNG as PNG, PFM as PPM;
# .pjpeg and .pjp are browsers' names for JPEG files.
FORMAT_SUFFIXES = {"JPEG": (".jpg", ".jpeg", ".jpe", ".jfif", ".pjpeg", ".pjp", ".mpo"), "PNG": (".png", ".apng"),
                   "GIF": (".gif",), "WEBP": (".webp",), "BMP": (".bmp", ".dib"), "TIFF": (".tif", ".tiff"),
                   "AVIF": (".avif", ".avifs"), "PPM": (".ppm", ".pgm", ".pbm", ".pnm", ".pfm")}
# What ``classify`` takes from a folder (files named on the command line are always tried).
IMAGE_SUFFIXES = frozenset(x for f in FORMATS for x in FORMAT_SUFFIXES[f])

# Photos by their file names that the service cannot decode: a folder's are skipped and named, with why.
UNREADABLE_PHOTOS = {".heic": "HEIC", ".heif": "HEIF", ".hif": "HEIF", ".dng": "RAW (DNG)", ".cr2": "RAW (Canon)",
                     ".cr3": "RAW (Canon)", ".nef": "RAW (Nikon)", ".nrw": "RAW (Nikon)", ".arw": "RAW (Sony)",
                     ".orf": "RAW (Olympus)", ".rw2": "RAW (Panasonic)", ".raf": "RAW (Fujifilm)",
                     ".pef": "RAW (Pentax)", ".srw": "RAW (Samsung)"}

Item = tuple[str, "Path | None", "str | None"]  # (path as shown, path to read or None, why it cannot be read)
Skipped = tuple[str, "str | None"]  # (path as shown, why: set for a photo in a format not read here, else None)


def shown_path(arg: str, inside: Path | None = None) -> str:
    """How a file is named in every output (the table, JSON, CSV, and ``--cluster``'s Parquet rows): the
    path as given on the command line (or stdin), joined with the file's place inside a given folder.
    Never resolved: a symlink is named as itself; never normalised: pathlib dropped a folder given as ``.`` or a
    leading ``./`` (``classify .`` named ``./-x.jpg`` as ``-x.jpg``, an option's look: tryout30)."""
    return os.path.join(arg, inside) if inside is not None else arg


def why_skipped(path: Path) -> str | None:
    """Why a photo file in a folder is not read (HEIC, RAW: formats the decoder does not take, by its name), else
    None. The walk reads one so named anyway where its first bytes are a format read here (``read_anyway``)."""
    kind = UNREADABLE_PHOTOS.get(path.suffix.lower())
    return f"skipped: {kind} is not a format read here ({FORMAT_NAMES}); convert it to JPEG first" if kind else None


def read_anyway(path: Path) -> bool:
    """True where a file named as a format not read here (``UNREADABLE_PHOTOS``) starts as one that is: an app's JPEG
    saved as ``.heic`` was skipped by its name (tryout24), though named on the command line it was classified."""
    from ..formats import claimed_format

    try:
        with open(path, "rb") as f:
            return claimed_format(f.read(64)) is not None
    except OSError:
        return False


def collect_files(paths: list[str], *, all_files: bool = False) -> tuple[list[Item], list[Skipped]]:
    """Expand files and folders into ``[(shown path, path, error)]`` in a stable order, and the files skipped.

    Folders are walked recursively (symlinked ones too, but for a link back to a folder above, or above the folder
    given: a loop), sorted, and
    yield image file names only, no hidden files, unless ``all_files``. A path named on the command
    line is always tried. What cannot be had becomes an error entry (``unreadable``'s words): a missing
    path, something that is not a regular file (a broken link, a FIFO, a device: never opened), an
    unreadable folder; in a folder, too, for an entry it would take. Each skipped file is ``(shown path,
    why)``: ``why`` is set for photos in a format the service cannot read (HEIC, RAW), None for other
    regular files (what ``all_files`` would try; other entries are left out). Paths are shown by
    ``shown_path``'s rule. A path found twice is one item; symlinks to one file are one item each. Raises
    nothing for a bad path (one that cannot be looked at either).
    """
    items: list[Item] = []
    seen: set[str] = set()
    skipped: list[Skipped] = []

    def add(shown: str, path: Path) -> None:
        # One row per path, not per file: the same path found twice (a folder and a file in it both named)
        # is one row, but each symlink is its own (a dataset's class folders of links into one pool of photos
        # lost all but one row per photo, without a word, when this resolved them).
        key = os.path.abspath(path)
        if key not in seen:
            seen.add(key)
            items.append((shown, path, None))

    for arg in paths:
        path = Path(arg)
        try:
            folder = kind(path) == "folder"
        except Unusable:  # unreadable says why, below
            folder = False
        if folder:
            def cannot_list(exc: OSError, top: Path = path) -> None:  # called where the walk reaches it: in order
                items.append((str(exc.filename or top), None, f"cannot read the folder: {exc.strerror or exc}"))

            # folder -> the folders above it, as (device, inode); the given folder's own parents too: a link to
            # one of them ("ln -s .. loop", a link to /) walked the tree the folder is in (tryout27)
            above: dict[str, frozenset] = {os.fspath(path): frozenset(map(_inode, Path(os.path.realpath(path)).parents))}
            for folder, dirs, names in os.walk(path, onerror=cannot_list, followlinks=True):
                # Symlinked folders are walked as any (tryout24: they were left out without a word), except one
                # that links back to a folder above it (a loop: all it holds is listed already).
                chain = above.pop(folder, frozenset()) | {_inode(folder)}
                dirs[:] = [d for d in sorted(dirs) if (all_files or not d.startswith("."))
                           and _inode(os.path.join(folder, d)) not in chain]
                above.update((os.path.join(folder, d), chain) for d in dirs)
                for name in sorted(names):
                    file = Path(folder) / name
                    shown = shown_path(arg, file.relative_to(path))
                    why = unreadable(file)
                    suffix = file.suffix.lower()
                    taken = all_files or not name.startswith(".") and (
                        suffix in IMAGE_SUFFIXES or suffix in UNREADABLE_PHOTOS and why is None and read_anyway(file))
                    if not taken:
                        photo = None if name.startswith(".") else why_skipped(file)
                        if photo or why is None:  # a HEIC/RAW photo, or a file --all-files would try
                            skipped.append((shown, photo))
                    elif why:  # as if named on the command line: an error line, never opened
                        items.append((shown, None, why))
                    else:
                        add(shown, file)
        elif (why := unreadable(path)) is None:
            add(arg, path)
        else:
            items.append((arg, None, why))
    return items, skipped


def _inode(path: str) -> tuple:
    """``path``'s folder as ``(device, inode)``, through links; where it cannot be looked at, a key of its own (the
    walk then says it cannot read it)."""
    try:
        st = os.stat(path)
    except OSError:
        return ("unreadable", path)
    return st.st_dev, st.st_ino


def read_limited(path: Path, limit: int) -> bytes:
    """The bytes of the file at ``path``, which may be at most ``limit`` bytes (``MAX_UPLOAD_BYTES``), as both
    local and ``--server`` classify read a file. Its size (``fstat`` of the opened file) is checked first, so a
    20 GiB file is refused unread, and never more than ``limit`` + 1 bytes are read: a file that grew since, a
    pipe (``/dev/stdin``) or a file whose size the system misreports is refused as well.

    :raises TooLarge: over ``limit`` bytes (``too_large``, the message local classify has always given).
    :raises OSError: the file cannot be opened or read.
    """
    from ..errors import TooLarge, check_file_size

    with open(path, "rb") as f:
        check_file_size(os.fstat(f.fileno()).st_size, limit)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge.file(None, limit)
    return data


def unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file (None: a regular file, or a link to one), from ``stat``
    alone: a FIFO or device is never opened. ``no such file or directory`` (with ``(a broken link)``
    for a dangling or looping symlink), ``not a regular file`` (a folder, FIFO, socket, device), or the
    OS's reason it cannot be looked at (``File name too long``, ``Permission denied`` on a folder on the
    way: ``paths.Unusable``). The messages ``classify`` prints and reports as ``error_code`` says. Raises
    nothing."""
    try:
        what = kind(path)
    except Unusable as exc:
        return exc.strerror
    if what == "file":
        return None
    if what is not None:
        return "not a regular file"
    return "no such file or directory" + (" (a broken link)" if path.is_symlink() else "")


def error_code(why: str) -> str:
    """The error code of a path ``unreadable`` gave ``why`` for: ``not_found``, ``not_a_file``, else ``read_error``
    (it cannot be looked at), as local and ``--server`` classify report it."""
    return "not_found" if why.startswith("no such") else "not_a_file" if why == "not a regular file" else "read_error"


# -- what was skipped, said the same way by local and --server classify ----------------------------------
def report_skipped(skipped: list) -> None:
    """Name each skipped photo (HEIC, RAW) and why: an operator looking for it must not have to guess."""
    for shown, why in skipped:
        if why:
            err(f"{shown}: {why}")


def no_image_files(paths: list[str], skipped: list, unread: list[tuple[str, str]]) -> None:
    """The usage error for paths holding no image file: each path that could not be had (``unread``: (shown path,
    ``unreadable``'s why)) named with why, then the paths with what was skipped in them. Where the unread ones
    are the given paths themselves (``classify /dev/zero``), each is the error: "error: /dev/zero: not a regular
    file", as for a missing path, not that line and "no image files in /dev/zero" after it (tryout25)."""
    whole = not skipped and set(paths) <= {shown for shown, _ in unread}
    for shown, why in unread:
        err(f"{'error: ' if whole else ''}{shown}: {why}")
    if not whole:
        err(f"error: no image files in {' '.join(paths)}" + skipped_note(skipped, lead=" (") +
            (")" if skipped else ""))


def skipped_note(skipped: list, lead: str = "; ") -> str:
    """The summary's words for the photos (HEIC, RAW) and other files skipped in folders; "" if none."""
    photos = sum(1 for _, why in skipped if why)
    other = len(skipped) - photos
    parts = ([f"{plural(photos, 'photo')} in a format not read here (named above)"] if photos else []) + (
        [f"{plural(other, 'other file')} (--all-files tries them)"] if other else [])
    return f"{lead}skipped in folders: {', '.join(parts)}" if parts else ""
