"""The settings every Ray replica and actor runs with, and the one-line reading of a start-up failure."""

from __future__ import annotations

import os

from .. import settings as settings_mod
from ..errors import StartupError
from ..paths import expand

# Settings that name files: made absolute where the command runs, since replicas run elsewhere.
PATH_SETTINGS = ("WEIGHTS", "CACHE_DIR", "CALIBRATION_DIR")


def replica_settings(args: dict | None = None, environ=None) -> dict:
    """The settings every replica and actor gets, resolved once where the app is built.

    ``CLASSIFIER_*`` variables of ``environ`` (default ``os.environ``), then ``args`` (setting
    names without the prefix, as in the Serve config's ``args``). ``THREADS`` 0 becomes 1 (a
    replica reserves that many CPUs); relative paths become absolute.

    :raises SettingsError: a bad value, or ``CLUSTER_MIN_REPLICAS`` > ``CLUSTER_MAX_REPLICAS``.
    """
    s = settings_mod.load(os.environ if environ is None else environ, args or {})  # checks MIN <= MAX too
    values = dict(s)
    values["THREADS"] = s.THREADS or 1
    for name in PATH_SETTINGS:
        if values[name]:
            values[name] = str(expand(values[name]).resolve())
    return values


def load_values(values: dict):
    """``Settings`` from ``replica_settings``' values alone: a replica's own environment must not change them."""
    return settings_mod.load({}, values)


def startup_failure(text: str) -> StartupError | None:
    """The ``StartupError`` a replica or actor died of, found in Ray's error text (a remote traceback).

    Ray reports a constructor that raised as a traceback string; its last ``StartupError:`` line
    holds our message (no weights, bad weights file, failed self-test), which says what to do.
    """
    lines = [line.split("StartupError:", 1)[1].strip() for line in text.splitlines() if "StartupError:" in line]
    return StartupError(lines[-1]) if lines else None


def replica_id() -> str:
    """This Ray Serve replica's id (``pid-N`` outside a replica, e.g. in unit tests)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (unit tests)
        return f"pid-{os.getpid()}"
