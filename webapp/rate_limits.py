"""The rate limit's two settings, checked the way Flask-Limiter will read them: at start-up, connecting nowhere.

``CLASSIFIER_RATE_LIMIT`` must be in the ``limits`` library's notation (``limits.parse_many``), every
amount and window at least 1;
``CLASSIFIER_RATE_LIMIT_STORAGE`` a storage URI whose scheme that library registers, whose storage
keeps a moving window (the strategy ``webapp/access.py`` uses) and whose client package is
installed. These are the settings table's parsers (``webapp/settings.py``), so ``python -m webapp
settings``, ``serve``, gunicorn's master and ``classify`` refuse a bad value with one line and exit 2,
before anything listens: a worker finding it while building its app was a traceback and exit 3.

``limits`` is imported only when a value is checked, and no storage is made: a MongoDB client
starts threads (gunicorn's master must start none before it forks), a Redis one would connect.
"""

from __future__ import annotations

import importlib.util
import re
import urllib.parse

RATE_LIMIT_RULE = ("empty (off), or Flask-Limiter notation such as '120/minute' or '10/second;500/hour', "
                   "each amount and window at least 1")
STORAGE_RULE = ("a storage URI of the limits library with a moving window: memory://; redis://HOST:PORT, rediss://, "
                "redis+sentinel://, redis+cluster:// (pip install redis); valkey:// (pip install valkey); "
                "mongodb://HOST:PORT (pip install pymongo); empty only with no CLASSIFIER_RATE_LIMIT")


class MissingPackage(ValueError):
    """The value is well formed, but the client package its scheme needs is not installed (the message says which)."""


def rate_limit(text: str) -> str:
    """``CLASSIFIER_RATE_LIMIT``'s parser: the text, trimmed; empty means no limit.

    :raises ValueError: not in the notation ``limits.parse_many`` reads (``lots``, ``5/fortnight``); an amount
        of 0 (``0/second``: the notation takes it, and then every classify request is refused, forever); a
        window of 0 (``2/0 seconds``: the library reads it as 1 s, so the limit would not be what was written).
    """
    value = str(text).strip()
    if value:
        from limits import parse_many

        limits = parse_many(value)
        if any(limit.amount < 1 for limit in limits):
            raise ValueError("an amount of 0 refuses every request")
        # The windows' multiples as written (parse_many has checked the notation): "2/0 seconds" parses as 2/second.
        if any(int(n) < 1 for n in re.findall(r"(?:/|per)\s*([0-9]+)\s*[a-z]", value, re.IGNORECASE)):
            raise ValueError("a window of 0")
    return value


def storage(text: str) -> str:
    """``CLASSIFIER_RATE_LIMIT_STORAGE``'s parser: the URI, trimmed (empty is allowed here; ``settings.load``
    refuses it when a rate limit is set).

    :raises MissingPackage: the scheme's client package (redis, valkey, pymongo) cannot be imported.
    :raises ValueError: no ``scheme://``; a scheme the limits library has no storage for, or an async one;
        a storage without a moving window (memcached://); a port that is not a number from 0 to 65535.
    """
    value = str(text).strip()
    if not value:
        return value
    from limits.storage import SCHEMES, MovingWindowSupport  # the registry: imports no client, connects nowhere

    url = urllib.parse.urlsplit(value)
    if "://" not in value or url.scheme.startswith("async+") or url.scheme not in SCHEMES:
        raise ValueError(f"no storage for the scheme {url.scheme!r}")
    kind = SCHEMES[url.scheme]
    if not issubclass(kind, MovingWindowSupport):
        raise ValueError(f"{url.scheme}:// keeps no moving window")
    url.port  # noqa: B018  raises ValueError for a port that is not a number from 0 to 65535
    needs = [str(name).split(".")[0] for name in kind.DEPENDENCIES]
    needs = [name for name in needs if name in url.scheme] or needs  # redis:// takes redis, valkey:// valkey
    for name in dict.fromkeys(needs):
        if importlib.util.find_spec(name) is None:
            raise MissingPackage(f"{url.scheme}:// needs the Python package {name!r}, which is not installed here "
                                 f"(requirements.txt leaves it out): pip install {name}")
    return value
