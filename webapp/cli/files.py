"""Which files ``classify`` reads: files and folders from the command line -> a stable list of files."""

from __future__ import annotations

import os
from pathlib import Path

# What ``classify`` takes from a folder (files named on the command line are always tried).
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".gif", ".webp", ".bmp", ".dib", ".tif",
                            ".tiff", ".avif", ".ppm", ".pgm", ".pbm", ".pnm"})

Item = tuple[str, "Path | None", "str | None"]  # (path as shown, path to read or None, why it cannot be read)


def collect_files(paths: list[str], *, all_files: bool = False) -> tuple[list[Item], int]:
    """Expand files and folders into ``[(shown path, path, error)]`` in a stable order, and a count of skipped files.

    Folders are walked recursively (symlinked folders are not followed, so no loops), sorted, and
    yield image file names only, no hidden files, unless ``all_files``. A path named on the command
    line is always tried. What cannot be had becomes an error entry: a missing path, something that
    is not a regular file, an unreadable folder. Raises nothing for a bad path.
    """
    items: list[Item] = []
    seen: set[Path] = set()
    skipped = 0

    def add(shown: str, path: Path) -> None:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            items.append((shown, path, None))

    for arg in paths:
        path = Path(arg)
        if path.is_dir():
            walk_errors: list[OSError] = []
            for folder, dirs, names in os.walk(path, onerror=walk_errors.append):
                dirs[:] = sorted(d for d in dirs if all_files or not d.startswith("."))
                for name in sorted(names):
                    file = Path(folder) / name
                    if not all_files and (name.startswith(".") or file.suffix.lower() not in IMAGE_SUFFIXES):
                        skipped += 1
                    elif not file.is_file():  # broken link, fifo, socket, device
                        skipped += 1
                    else:
                        add(str(file), file)
            for exc in walk_errors:
                items.append((str(exc.filename or path), None, f"cannot read the folder: {exc.strerror or exc}"))
        elif path.is_file():
            add(arg, path)
        elif path.exists():
            items.append((arg, None, "not a regular file"))
        else:
            items.append((arg, None, "no such file or directory" + (" (a broken link)" if path.is_symlink() else "")))
    return items, skipped
