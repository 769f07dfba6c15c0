"""What every command of the CLI shares: exit codes, the project root, stderr lines, plurals, Ray's presence.

Kept apart from ``__init__`` so the command modules can import it without importing the package
that wires them (no import cycle).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # holds gunicorn.conf.py, wsgi.py and the requirements files
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a process that a closed pipe ended (`... | head -1`)

# What ``classify``'s exit status means (locally and with --cluster): its --help and the README's table
# come from here (tests/test_docs.py checks the README, tests/test_cli.py runs each row).
CLASSIFY_EXIT_STATUS = {
    EXIT_OK: "every file classified",
    EXIT_FAILED: "the run went, and some files failed: each has its error line (or Parquet row); with --cluster "
                 "also a job that stopped part way",
    EXIT_USAGE: "usage or configuration error, found before any file is classified: a bad option or setting, "
                "an empty path, a path that does not exist or cannot be looked at (a name part over 255 bytes...), "
                "no image file in the paths, a model that cannot start (e.g. --weights missing or damaged), Ray "
                "missing or no cluster at --address",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_PIPE: "standard output's reader left before the end (piped into `head -1`): the rows it read are right, "
               "the run stopped there, nothing said (128 + SIGPIPE, as a shell reports a process a closed pipe "
               "ended)",
}


def exit_status_table(meanings: dict[int, str]) -> str:
    """``{status: meaning}`` as the README's markdown table."""
    return "\n".join(["| exit status | meaning |", "|---|---|", *(f"| {k} | {v} |" for k, v in meanings.items())])


# The starts of what unicode_text and printable write for a byte or a control character: \xff, \u2028, \n...
_ESCAPE_LIKE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[ntr])")


def file_name(name: str) -> str:
    """A file's name for the results (table, JSON, CSV; then ``unicode_text`` or ``printable``): where those would
    write ``\\xNN`` into it (a byte that is not UTF-8, a control character) or it holds such an escape of its own, its
    backslashes doubled, so that ``\\xff`` in a result is only ever the byte: a file named with the byte FF and one
    named with those four characters printed alike, each with another answer (tryout30). Any other name is as it is
    (a backslash in it too: the path still opens the file)."""
    if _ESCAPE_LIKE.search(name) or not name.isprintable():  # (a byte kept as a surrogate is not printable)
        return name.replace("\\", "\\\\")
    return name


def unicode_text(text: str) -> str:
    """``text`` as valid Unicode: bytes of a file name that are not UTF-8 (kept by Python as surrogates) written
    ``\\xNN``. Raises nothing."""
    try:
        return os.fsencode(text).decode("utf-8", "backslashreplace")
    except UnicodeError:  # a lone surrogate that no file name's byte gives
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def printable(text: str) -> str:
    """``unicode_text(text)`` with every character that is not printable escaped as Python writes it (``\\x1b``,
    ``\\n``, ``\\x85``): C0 and C1 control characters, DEL, and the like. A file name can then neither break a
    line nor drive the terminal (an ESC sequence that retitles it or clears the screen)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in unicode_text(text))


def err(message: str) -> None:
    """Print one line to stderr (results go to stdout; everything else goes here), its control characters escaped
    (``printable``): it may name a file, and file names may hold anything but ``/`` and NUL."""
    print(printable(message), file=sys.stderr)


def silence_stdout() -> None:
    """Point standard output's file descriptor at /dev/null, once it cannot be written (a reader that left, a full
    disk): the interpreter's own flush at exit would fail again, with a traceback of its own. Raises nothing."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError:
        pass


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, pluralised as needed: ``3 files``, ``1 file``, ``2 batches``."""
    word = noun if count == 1 else noun + ("es" if noun.endswith(("ch", "s")) else "s")
    return f"{count} {word}"


def ray_missing() -> bool:
    """Return True, after saying on stderr what to install, when Ray or a2wsgi cannot be imported.

    Both ``--cluster`` modes need them; they are optional (requirements-cluster.txt), so a missing
    one is a message, not a traceback.
    """
    try:
        import a2wsgi  # noqa: F401
        import ray  # noqa: F401
    except ImportError as exc:
        err(f"error: --cluster needs Ray ({exc}): {sys.executable} -m pip install -r "
            f"{ROOT / 'requirements-cluster.txt'}")
        return True
    return False
