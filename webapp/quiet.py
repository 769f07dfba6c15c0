"""Third-party warnings kept out of the operator's output: each said once, at debug level.

Start-up prints warnings from torch and torchao about their own internals, which no operator can act
on: a torch log line when torchao is imported (``<enum 'KernelPreference'> ... Calling
register_constant() on Enum subclasses is deprecated``), and Python ``UserWarning``s from inductor
while it lowers int8 convolutions (``mkldnn_lowerings.py``: "To copy construct from a tensor, it is
recommended to use sourceTensor.detach().clone()"), every start, ``classify -q`` included.

``quiet_third_party()`` (start-up runs inside it: ``startup.load_engine``) turns them into one debug
line each (``CLASSIFIER_LOG_LEVEL=debug`` shows them): Python warnings raised by other packages, and
torch's WARNING log records. What matters still passes: our own warnings (re-issued as they
were, after the block), torch's errors, and every exception.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

OURS = str(Path(__file__).resolve().parent)  # warnings raised by code under webapp/ are ours
# Loggers whose handlers print torch's own log lines (torch's logging sets up "torch" and a few
# children with handlers of their own and propagate off).
THIRD_PARTY_LOGGERS = ("torch",)

_said: set[tuple[str, str]] = set()


def say_once(source: str, text: str) -> None:
    """Log ``text`` from ``source`` (a warning category or a logger's name) at debug level, once per process."""
    if (source, text) not in _said:
        _said.add((source, text))
        log.debug("hidden %s: %s", source, text)


class _DemoteWarnings(logging.Filter):
    """A handler filter: WARNING records become one debug line each (``say_once``). Errors pass, and so
    does what is below WARNING: torch prints that only when asked to (``TORCH_LOGS``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not logging.WARNING <= record.levelno < logging.ERROR:
            return True
        say_once(f"{record.levelname.lower()} from logger {record.name}", record.getMessage())
        return False


def _third_party_handlers() -> list[logging.Handler]:
    names = [n for n in logging.root.manager.loggerDict
             if any(n == p or n.startswith(p + ".") for p in THIRD_PARTY_LOGGERS)]
    loggers = [logging.getLogger(n) for n in names]
    return list({id(h): h for lg in loggers for h in lg.handlers}.values())


def is_ours(filename: str) -> bool:
    """True when a warning was raised in this package's code."""
    try:
        return str(Path(filename).resolve()).startswith(OURS)
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def quiet_third_party() -> Iterator[None]:
    """Inside: other packages' Python warnings and torch's WARNING log records are logged once each at
    debug level instead of printed; our own warnings are re-issued on the way out. Usable as a decorator.

    For start-up only: Python's warning state is process-wide, so this belongs where one thread runs
    (a worker's start-up, the CLI's, a Ray replica's constructor), never around request handling.
    """
    demote = _DemoteWarnings()
    handlers = _third_party_handlers()
    for h in handlers:
        h.addFilter(demote)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as got:  # the filters in force still decide what is caught
            try:
                yield
            finally:
                caught = list(got)
    finally:
        for h in handlers:
            h.removeFilter(demote)
        for w in caught:
            if is_ours(w.filename):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
            else:
                say_once(w.category.__name__, f"{w.message} ({w.filename}:{w.lineno})")
