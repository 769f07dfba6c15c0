"""When ``classify --server`` tries a request again, and how long it waits first.

- A 429 (``overloaded``, ``rate_limited``) or a 503 (``not_ready``) says when to come back: its
  ``Retry-After`` seconds, times uniform(1, 1 + ``JITTER``) so that the clients told the same moment
  do not all return at once.
- A dropped connection, or a reverse proxy's own 502/504 (a body that is not this service's JSON:
  nginx's "Bad Gateway" page while the server behind it restarts), says nothing: a short growing
  pause (``backoff``). The service's own 504 (``timeout``: no result within its request timeout)
  is an answer, not tried again: the same upload would be refused the same way. The web page treats
  a proxy's answers the same way (``static/app.js``, ``GATEWAY_WAIT_S``).
- At most ``MAX_TRIES`` tries and ``MAX_WAIT_S`` seconds of waiting per request.
"""

from __future__ import annotations

import json
import random

MAX_TRIES = 8  # per file: the first try and up to 7 more after 429/503, a proxy's 502/504 or a dropped connection
MAX_WAIT_S = 120.0  # per file: the most seconds spent waiting between tries
JITTER = 0.5  # a wait is Retry-After x uniform(1, 1 + JITTER)
RETRY_STATUSES = (429, 503)
GATEWAY_STATUSES = (502, 503, 504)  # a reverse proxy's own, when what is behind it does not answer


def error(code: str, message: str) -> dict:
    """A result's ``{"code", "message"}``."""
    return {"code": code, "message": message}


def parsed(resp) -> dict:
    """``resp``'s body as JSON (urllib3's response, read already); ``{}`` where it is not JSON. Raises nothing."""
    try:
        doc = json.loads(resp.data)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def ours(doc: dict) -> bool:
    """Whether a parsed body is this service's answer: a result, or its error shape ``{"error": {"code": ...}}``."""
    return "results" in doc or isinstance(doc.get("error"), dict) and "code" in doc["error"]


def refusal(resp, doc: dict | None = None) -> dict:
    """A non-200 answer's ``{"code", "message"}`` (``doc``: its body, parsed already); a body not of this service
    (a proxy's page) is ``http_error`` with the status and its reason phrase. Raises nothing."""
    doc = parsed(resp) if doc is None else doc
    if not ours(doc):
        return error("http_error", f"HTTP {resp.status} {resp.reason or ''}".strip() + _from_a_proxy(resp))
    e = doc["error"]
    return error(e["code"], str(e.get("message") or f"HTTP {resp.status}")
                 .removeprefix("upload: "))  # the server names a raw body "upload"; the path says it


def described(resp, most: int = 80) -> str:
    """An answer that is not this service's, in words: its status and reason, size, content type and first line of
    text (at most ``most`` characters, control characters escaped), e.g. ``404 Not Found (1,234 bytes, Content-Type:
    text/html); first line: <!doctype html>``, never a Python bytes repr. Raises nothing."""
    from .common import printable

    data = resp.data or b""
    parts = [f"{len(data):,} bytes" if data else "an empty body",
             f"Content-Type: {resp.headers.get('Content-Type') or 'none'}"]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
        parts.append("not UTF-8 text")
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = f"; first line: {printable(first[:most])}" + ("..." if len(first) > most else "") if first else ""
    return f"{resp.status} {resp.reason or ''}".strip() + f" ({', '.join(parts)}){line}"


def reason(exc: Exception) -> str:
    """urllib3's wrapped error in a few words: the OS's reason where there is one."""
    inner = getattr(exc, "reason", None) or exc
    while getattr(inner, "reason", None) is not None and inner.reason is not inner:
        inner = inner.reason
    text = str(inner)
    return text.split(": ", 1)[-1] if "Failed to establish a new connection" in text else text


def _from_a_proxy(resp) -> str:
    if resp.status in GATEWAY_STATUSES:
        return " from a proxy in front of the server, not the server's own answer (the server may be restarting)"
    return ""


def backoff(tries: int) -> float:
    """Seconds to wait after ``tries`` tries that got no answer of the server's own: 0.5, 1, 2, 4, 8, 8, ...
    times uniform(1, 1 + ``JITTER``)."""
    return min(0.5 * 2 ** (tries - 1), 8.0) * random.uniform(1, 1 + JITTER)


def retry_wait(resp, doc: dict | None = None, tries: int = 1) -> float | None:
    """Seconds to wait before trying ``resp``'s request again (``doc``: its parsed body; ``tries``: tries so far):
    for a 429 or 503, its ``Retry-After`` (whole seconds; 1 if absent or not a number) times
    uniform(1, 1 + ``JITTER``); for a proxy's 502/504 (a body not of this service), ``backoff(tries)``; None for any
    other answer (not tried again). Raises nothing."""
    if resp.status in RETRY_STATUSES:
        after = resp.headers.get("Retry-After", "1")
        return (int(after) if after.isdigit() else 1) * random.uniform(1, 1 + JITTER)
    if resp.status in GATEWAY_STATUSES and not ours(parsed(resp) if doc is None else doc):
        return backoff(tries)
    return None


def out_of_tries(tries: int, waited_s: float, wait_s: float) -> bool:
    """Whether to give up rather than wait ``wait_s`` more seconds after ``tries`` tries and ``waited_s`` seconds
    of waiting: ``MAX_TRIES`` tries or ``MAX_WAIT_S`` seconds of waiting at most. Raises nothing."""
    return tries >= MAX_TRIES or waited_s + wait_s > MAX_WAIT_S
