"""Requests gunicorn refuses itself, before the app sees them: answered, and logged, as the app's are.

gunicorn answers a request line or header it cannot parse (``Content-Length: abc``, a line over its limit, an
``Expect`` it does not know, a method not in capitals, bad chunked framing) from ``Worker.handle_error`` with an
HTML page and its own message. Here (``worker.Worker`` installs these):

- ``write_json_error`` (gunicorn's ``util.write_error``) answers in the API's JSON error shape, the protocol's
  under ``/v2`` (``errors.error_body``), with the client's ``X-Request-ID`` where it got that far (``refusing``
  finds it, in gunicorn's request object or the header lines its parser was reading), and says in words what
  gunicorn says too briefly (``_in_words``);
- the text access line gunicorn writes before its answer exists (0 bytes, no id) waits for that answer
  (``access_after_answer``), and where gunicorn writes none (no request object: a 417, a lowercase method) one is
  written; with ``ACCESS_LOG=json`` the JSON line, as every request has one;
- ``ClientFaultsAtInfo`` logs gunicorn's "Invalid request from ip=..." at INFO: the client's fault, not a warning;
- ``on_refusal`` tells ``/metrics`` of each (``webapp/metrics.py``: endpoint ``(unparsed)``).
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from datetime import timedelta
from http import HTTPStatus
from types import SimpleNamespace
from typing import Callable

from gunicorn import util as gunicorn_util
from gunicorn.http import message as gunicorn_message

from .bodies import drain_socket
from .errors import OTHER_HTTP_CODE, error_body
from .logs import ACCESS_LOGGER, REQUEST_ID_HEADER, access_fields, request_id_from

# gunicorn's statuses for what it refuses itself -> the error table's code (webapp/errors.py); the
# others have no row there and get "http_error", as the app's handler gives Werkzeug's unlisted ones.
_PARSE_CODES = {400: "bad_request"}


# id(client socket) -> (path, request id, method, client address, User-Agent, gunicorn's logger, protocol) of the
# request gunicorn
# refused on it, from Worker.handle_error (``refusing``) to write_json_error, which it calls (same greenlet, same call:
# the entry is removed right after).
_REFUSED: dict[int, tuple] = {}
# id(client socket) -> (gunicorn's access, resp, req, environ, request_time): the text access line of such a request,
# held from gunicorn's handle_error (which logs it before the answer exists) until write_json_error has its size and id.
_HELD: dict[int, tuple] = {}
_LINE_START = re.compile(rb"^[A-Za-z]+ (/[^ \r\n?]*)")
# Told (method or None, status, error code) of each refusal answered: webapp/metrics.py counts them (one at most).
on_refusal: list[Callable[[str | None, int, str], None]] = []


@contextmanager
def refusing(req, client, addr, exc: BaseException, glog):
    """Around gunicorn's ``Worker.handle_error(req, client, addr, exc)``: what ``write_json_error`` needs of the refused
    request (path, ``X-Request-ID``, method, address, User-Agent; ``glog``, gunicorn's logger, for its access line)."""
    parsed = _parsed_request(req, exc)
    version = getattr(parsed, "version", None)
    who = getattr(parsed, "method", None), addr[0] if isinstance(addr, tuple) else None, \
        _request_header(req, exc, "User-Agent")
    _REFUSED[id(client)] = (_request_path(req, exc), request_id_from(_request_header(req, exc, REQUEST_ID_HEADER)),
                            *who, glog, f"HTTP/{version[0]}.{version[1]}" if isinstance(version, tuple) else None)
    try:
        yield
    finally:
        _REFUSED.pop(id(client), None)
        if (held := _HELD.pop(id(client), None)) is not None:  # the answer was not written: the line as it is
            held[0](*held[1:])


def _request_header(req, exc: BaseException, name: str) -> str | None:
    """A header of the refused request where gunicorn got as far as its headers (its request object, or the header
    lines its parser was reading when it refused one of them, e.g. an ``Expect`` it does not know), else None."""
    for candidate in (req, getattr(exc, "req", None)):
        for key, value in getattr(candidate, "headers", None) or ():
            if isinstance(key, str) and key.upper() == name.upper():
                return value
    for local in _parser_frames(exc):
        lines = local.get("lines")  # parse_headers: the header lines, as str
        for line in lines if isinstance(lines, list) else ():
            key, colon, value = str(line).partition(":")
            if colon and key.strip().upper() == name.upper():
                return value.strip()
    return None


def _parser_frames(exc: BaseException):
    """The local variables of each frame of gunicorn's parser (``gunicorn.http.message``) in ``exc``'s traceback,
    outer frames first: what it had read of the request when it refused it."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == gunicorn_message.__file__:
            yield tb.tb_frame.f_locals
        tb = tb.tb_next


def _parsed_request(req, exc: BaseException):
    """gunicorn's request object for the refused request, as far as it was parsed: ``req``, the one the error
    carries, or the one its parser was filling when it refused a header (an ``Expect`` it does not know: a 417,
    whose access line said ``"- /path -"`` for its method and protocol). None where there is none."""
    for candidate in (req, getattr(exc, "req", None)):
        if isinstance(getattr(candidate, "method", None), str):
            return candidate
    for local in _parser_frames(exc):
        if isinstance(owner := local.get("self"), gunicorn_message.Request) and isinstance(owner.method, str):
            return owner
    return None


def _request_path(req, exc: BaseException) -> str | None:
    """The path of a request gunicorn could not parse, as far as it got: its request object (``req``, or the
    one the error carries, or the one being parsed in the traceback), else the start of the request line it
    was reading (a line over the limit). None where nothing says."""
    for candidate in (req, getattr(exc, "req", None)):
        if isinstance(getattr(candidate, "path", None), str):
            return candidate.path
    for local in _parser_frames(exc):
        owner, line = local.get("self"), local.get("data")
        if isinstance(owner, gunicorn_message.Request) and isinstance(getattr(owner, "path", None), str):
            return owner.path
        if isinstance(line, (bytes, bytearray)) and (m := _LINE_START.match(bytes(line[:512]))):
            return m.group(1).decode("latin-1")  # read_line: the request line, too long to parse
    return None


class ClientFaultsAtInfo(logging.Filter):
    """On gunicorn's error log: its "Invalid request from ip=..." (a request it could not parse: the client's fault,
    answered 4xx by ``write_json_error``) at INFO, not WARNING, so that warnings stay the server's own (tryout23: a
    malformed Content-Length logged as a warning); dropped where INFO is off."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and str(record.msg).startswith("Invalid request from ip="):
            record.levelno, record.levelname = logging.INFO, "INFO"
            return self.logger.isEnabledFor(logging.INFO)
        return True


def access_after_answer(access, resp, req, environ, request_time) -> None:
    """gunicorn's access logging (``Logger.access``, bound as ``access``), but for a request gunicorn refused: its
    line is held (``_HELD``) for ``write_json_error``, so that it shows the answer's bytes and X-Request-ID, as every
    other line does, not gunicorn's 0 bytes and no id (tryout23)."""
    if id(getattr(resp, "sock", None)) in _REFUSED:
        _HELD[id(resp.sock)] = (access, resp, req, environ, request_time)
    else:
        access(resp, req, environ, request_time)


_RAW_LINE = re.compile(r"Invalid HTTP request line: '(.*?)'+$", re.S)


def _in_words(mesg: str) -> str:
    """gunicorn's message for a request it refused, with what to send instead where it says too little."""
    if "CONTENT-LENGTH" in mesg.upper():
        # gunicorn says only "CONTENT-LENGTH" for all three faults: not a size, given twice, or beside chunked.
        return (f"{mesg}: Content-Length must be the body's size in bytes, a whole number >= 0, given once, "
                f"and not together with Transfer-Encoding: chunked")
    if (m := _RAW_LINE.search(mesg)) and re.search(r"[\x80-\xff]|\\x[89a-f][0-9a-f]", m.group(1)):
        # A raw UTF-8 byte in the URL (a hand-made client): gunicorn shows it decoded as Latin-1 ("Ã©" for "é").
        raw = re.sub(r"\\x([0-9a-f]{2})", lambda h: chr(int(h.group(1), 16)), m.group(1))
        line = raw.encode("latin-1", "replace").decode("utf-8", "replace")
        return (f"the request line is not ASCII ({line!r}): a URL's other characters are sent percent-encoded "
                f"(RFC 3986 2.1: é as %C3%A9; curl -G --data-urlencode 'name=value' encodes a query value)")
    return mesg


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn's ``util.write_error`` (same arguments: the socket, status, reason phrase, message) in
    the API's error shape: ``{"error": {"code", "message", "status"}}``, ``Connection: close``.

    Called by gunicorn's ``Worker.handle_error`` for a request it could not parse (400, 414, 417, 431, 501...)
    before the app saw it. A Content-Length that is not a number of bytes, is repeated, or comes with
    ``Transfer-Encoding: chunked`` says what Content-Length must be, in words. Every answer carries an
    ``X-Request-ID``, as the app's do, and with ``ACCESS_LOG=json`` its access line (duration unknown: null), as
    every request has one. Then the answer's side is closed (a client reading to the end has it at once) and what
    the client still sends is read and dropped, bounded (``bodies.drain_socket``), so that closing does not reset
    the connection under an answer not yet read."""
    message = _in_words(mesg)
    path, request_id, method, remote, agent, glog, protocol = _REFUSED.get(id(sock), (None,) * 7)
    request_id = request_id or request_id_from(None)
    body = json.dumps(error_body(path, _PARSE_CODES.get(status_int, OTHER_HTTP_CODE), message, status_int)).encode()
    try:  # gunicorn 27 names its 501 (a transfer coding it does not know) "Bad Request"
        reason = HTTPStatus(status_int).phrase
    except ValueError:
        pass
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{REQUEST_ID_HEADER}: {request_id}\r\n\r\n").encode("latin-1")
    if (held := _HELD.pop(id(sock), None)) is not None:  # the text access line (ACCESS_LOG=text), now complete
        log_access, resp, *rest = held
        resp.sent, resp.headers = len(body), [(REQUEST_ID_HEADER, request_id)]
        log_access(resp, *rest)
    elif glog is not None:  # gunicorn logs none where it has no request object (a 417, a method not in capitals)
        answer = SimpleNamespace(status=status_int, sent=len(body), headers=[(REQUEST_ID_HEADER, request_id)])
        glog.access(answer, [], {"REMOTE_ADDR": remote or "-", "REQUEST_METHOD": method or "-", "RAW_URI": path or "-",
                                 "SERVER_PROTOCOL": protocol or "-", "HTTP_USER_AGENT": agent or "-"}, timedelta(0))
    gunicorn_util.write_nonblock(sock, head + body)
    for observe in on_refusal:  # /metrics (tryout25: a flood of malformed requests was invisible there)
        try:
            observe(method, status_int, _PARSE_CODES.get(status_int, OTHER_HTTP_CODE))
        except Exception:  # never fail an answer over a metric
            logging.getLogger(__name__).exception("cannot count a refused request in the metrics")
    if (access := logging.getLogger(ACCESS_LOGGER)).handlers:  # ACCESS_LOG=json: its line, as every request has
        access.info(json.dumps(access_fields(request_id=request_id, method=method, path=path, status=status_int,
                                             duration_ms=None, size=len(body), remote_addr=remote, query="",
                                             user_agent=agent), separators=(",", ":")))
    drain_socket(sock)  # half-closes first
