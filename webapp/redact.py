"""Secrets kept out of the access logs: a query parameter that looks like a credential is logged as ``[hidden]``.

The API takes its token in ``Authorization: Bearer`` only; a client that puts it in the URL instead
(``?token=...``, ``?api_key=...``: what other services take) gets a 401, and its token was then written in clear
to the access log, text and JSON, where log shippers and everyone who reads the logs have it (tryout28). Every
access line goes through here: gunicorn's text lines (``AccessLogger``, ``logger_class`` in
``gunicorn.conf.py``: the workers', and the refusals gunicorn makes itself), the master's own (its 503s while
starting), and the JSON objects (``logs.access_fields``). Standard library and gunicorn only: the master uses it.
"""

from __future__ import annotations

import re

from gunicorn.glogging import Logger

HIDDEN = "[hidden]"
# A parameter whose name holds one of these (any case) is a credential: token, access_token, api_key, apikey,
# X-Api-Key, password, secret, auth, sig/signature (signed URLs). Its value is hidden, the name kept.
_SECRET_NAME = re.compile(r"token|key|secret|passw|auth|sig", re.IGNORECASE)
_PARAM = re.compile(r"(^|[&;])([^=&;]*)=([^&;]*)")


def hide_query_secrets(query: str) -> str:
    """``query`` (a URL's query string, without the ``?``) with each credential-like parameter's value replaced by
    ``[hidden]``: ``topk=5&token=abc`` -> ``topk=5&token=[hidden]``. Names are matched percent-decoded as written
    (``api%5Fkey`` is not caught: a client that encodes its parameter names is not one that slipped)."""
    if "=" not in query:
        return query
    return _PARAM.sub(lambda m: m.group(0) if not _SECRET_NAME.search(m.group(2)) or not m.group(3)
                      else f"{m.group(1)}{m.group(2)}={HIDDEN}", query)


def hide_uri_secrets(uri: str) -> str:
    """A request target or request line (``GET /x?token=abc HTTP/1.1``) with its query's secrets hidden."""
    path, mark, rest = uri.partition("?")
    if not mark:
        return uri
    query, space, tail = rest.partition(" ")
    return f"{path}?{hide_query_secrets(query)}{space}{tail}"


class AccessLogger(Logger):
    """gunicorn's logger, its access lines' request line (``%(r)s``) and query (``%(q)s``) with secrets hidden."""

    def atoms(self, resp, req, environ, request_time):
        """gunicorn's atoms for the access line, ``r`` and ``q`` passed through ``hide_uri_secrets``."""
        atoms = super().atoms(resp, req, environ, request_time)
        atoms["r"] = hide_uri_secrets(atoms["r"])
        if atoms.get("q"):
            atoms["q"] = hide_query_secrets(atoms["q"])
        return atoms
