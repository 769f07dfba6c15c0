"""The command line: ``python -m webapp serve | classify | weights | info | settings | warm | bundle``.

- ``serve``: exec gunicorn with the project's config (``gunicorn -c gunicorn.conf.py wsgi:app``);
  its options set the ``CLASSIFIER_*`` variables; what follows ``--`` goes to gunicorn.
  ``--cluster``: the same API on a Ray cluster (Ray Serve, webapp/cluster/) instead.
- ``classify PATH...``: files and folders through the same ``Classifier`` the server runs (decode,
  dynamic batcher, engine), from a small thread pool so batches form; one bad file is one error
  line, never the end of the run. Exit 0: all classified, 1: some failed, 2: usage error.
  ``--cluster --out DEST.parquet``: the same with Ray Data over a cluster, one Parquet file out.
- ``weights fetch`` / ``weights verify``: carry ResNet-18 weights to an air-gapped host.
- ``info``: CPU, what oneDNN/ATen run, the precision ``auto`` picks, the worker plan, weights.
- ``settings``: the settings table, with the values in effect (``--markdown``: the README table).
- ``warm``: build the compile caches once at install time (the worker's own start-up, pinned as worker 0).
- ``bundle --out DIR``: the air-gapped install kit (wheels, hash-pinned lock, source, weights, install.sh).

One module per concern: ``options`` (settings -> options, help layout, argument checks), one per
command (``serve``, ``classify``, ``weights``, ``info``, ``settings_cmd``; each adds its own
parser), ``files`` (what classify reads from folders), ``output`` (table/JSON/CSV), ``common``
(exit codes, stderr lines), ``kit`` (the kit's lock, manifest and sizes). This module only wires the
commands together.

Importing this package imports no torch (``--help`` is instant); the commands that need it import
it when they run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from ..settings import SettingsError
from . import bundle, classify, info, serve, settings_cmd, warm, weights
from .common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PIPE, EXIT_USAGE, err, silence_stdout
from .options import HelpFormatter, settings_epilog

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m webapp`` parser: each command module adds its subcommand (in ``--help``'s order)."""
    parser = argparse.ArgumentParser(
        prog="python -m webapp", formatter_class=HelpFormatter,
        description="Photo classifier: serve it, classify photos from the shell, carry weights to air-gapped hosts.",
        epilog=settings_epilog())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in (serve, classify, weights, info, settings_cmd, warm, bundle):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command (``argv``: the arguments, default ``sys.argv[1:]``); return its exit status.

    EXIT_OK (0), EXIT_FAILED (1), EXIT_USAGE (2, also for a bad setting), 130 on Ctrl-C. argparse's
    own usage errors and ``--help`` raise ``SystemExit`` (2 and 0). ``serve`` may not return: it
    execs gunicorn.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    for stream in (sys.stdout, sys.stderr):  # a name the output's encoding cannot hold (PYTHONIOENCODING=ascii, a
        with contextlib.suppress(AttributeError, ValueError):  # C locale) is escaped, not a traceback (tryout25)
            stream.reconfigure(errors="backslashreplace")
    extra: list[str] = []
    if argv[:1] == ["serve"] and "--" in argv:  # serve ... -- <gunicorn args>
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, extra) if args.command == "serve" else args.func(args)
    except SettingsError as exc:
        err(f"configuration error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more, and not 1 (that is "files failed")
        silence_stdout()
        return EXIT_PIPE
