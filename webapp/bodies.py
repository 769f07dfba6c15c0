"""Request bodies under gunicorn: refusals answered before the body, stalls bounded, drains after.

A WSGI middleware around the Flask app (``guard_bodies``), active where gunicorn serves (it reads
``gunicorn.socket`` from the environ; elsewhere it only wraps nothing):

- ``Expect: 100-continue``: gunicorn would send ``100 Continue`` before the app sees the request
  (``gunicorn.conf.py``'s ``pre_request`` hook turns that off), so a client that waits for it
  would upload a body the app then refuses. Here ``100 Continue`` goes out on the first read of the
  body instead: everything the request line and headers decide (413 by Content-Length, 415,
  401, 429, 503) is answered with no ``100`` at all. Never to an HTTP/1.0 request (RFC 9110 10.1.1).
- An idle timeout between received bytes (``BODY_TIMEOUT_S``, on each socket read of the body): a client
  that sends part of a body and stops gets ``408 body_timeout`` and its connection closes, so it can neither hold a
  connection forever nor stretch a graceful shutdown past that timeout.
- Once a stopping worker's graceful timeout has ``DRAIN_SECONDS`` + 1 s left, each request whose body is
  still arriving is answered ``503 not_ready`` (``cut_by_stop``; ``webapp.worker``) and drained as any
  refusal, the drain ending ``STOP_MARGIN_S`` before the timeout does. The master's kill at the timeout
  reset it before (a slow upload, or a stalled one: ``BODY_TIMEOUT_S`` is as long as the timeout by
  default), and logged the stalled one as cut although its 408 had gone out.
- A chunked body gunicorn cannot de-chunk (a bad chunk size, extension or trailer, no CRLF after a
  chunk, cut off before its last chunk), or one of tiny chunks (``_counted``), is the client's error:
  ``400 bad_request``, connection closed. A chunk whose size line is over the upload limit is a 413 as soon
  as that line is read (``_bounded``), as a Content-Length over it is.
- A refused request whose body was not read to its end is answered at once, with the connection
  closed after the answer. Only then is what is left of the body read and discarded, bounded in
  bytes and seconds (``drain_bytes``, ``DRAIN_SECONDS``), so a client still sending reads the
  answer instead of a connection reset, and one that stalls cannot hold the worker. Where the
  connection closes, that drain reads the socket itself, 256 KiB a read, discarded in the kernel
  (``MSG_TRUNC``) on Linux: through gunicorn's reader (8 KiB a read, copied) a refused 3 MB upload
  (the 12 MP photo) cost the worker 4.5 ms of CPU, now 1.5 ms (a refusal of a small body: 0.6 ms).
  At 2x overload the refusals' CPU was what made throughput lower than without admission by time.
"""

from __future__ import annotations

import logging
import socket
import sys

from gunicorn.http.errors import NoMoreData, ParseException

from . import balance
from .concurrency import let_others_run, time_limit
from .errors import BadRequest, BodyTimeout, NotReady, TooLarge

log = logging.getLogger(__name__)

# After the answer to a refused request: read at most this much more of its body, for at most this long.
DRAIN_BYTES = 16 * 1024 * 1024
# The bound in force: at least the largest body a route takes, and a quarter more (``guard_bodies``). A proxy that
# buffers uploads (nginx, as the README sets it up: client_max_body_size 43m) writes the body whole after an
# early answer; a drain ending at 16 MiB closed under it, and nginx answered its HTML 502 in place of the
# service's 413, 401 or 415 for 1 upload in 4 of 20-40 MB (tryout28). The seconds still bound a slow client.
drain_bytes = DRAIN_BYTES
DRAIN_SECONDS = 2.0
DRAIN_CHUNK = 256 * 1024  # bytes per read of a drain from the socket
# Linux TCP discards what a MSG_TRUNC read asks for instead of copying it (tcp(7), since 2.4): the
# buffer is never written there, so one serves every drain of the process; elsewhere (flags 0) it is
# scratch space whose content nobody reads.
_MSG_TRUNC = getattr(socket, "MSG_TRUNC", 0) if sys.platform.startswith("linux") else 0
_DISCARD = bytearray(DRAIN_CHUNK)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# A chunked body whose pieces, from the CHUNKS_JUDGED-th on, average under MIN_MEAN_PIECE bytes is refused (400):
# gunicorn de-chunks in Python, ~2 us a chunk, and never lets the hub run while bytes are waiting, so a 3 MB photo
# sent in 1-byte chunks (19.5 MB on the wire) took 12.5 s of the worker's CPU, and /healthz and refusals waited
# 7-9 s behind two of them (tryout21). Clients chunk by their buffer (http.client 8 KB, curl 16-64 KB) or a TCP
# read; a script that sends a binary file line by line averages ~256 bytes (a byte is "\n" once in 256), hence
# 128: a 32 MiB body then costs at most ~260,000 chunks, ~1 s, and the hub runs every CHUNKS_JUDGED of them. The
# average is judged at every piece: judged once, at the 4,096th, 160-byte chunks and then 1-byte ones took 9.7 s
# and held /healthz 9 s (tryout24).
CHUNKS_JUDGED, MIN_MEAN_PIECE = 4096, 128
STOP_MARGIN_S = 0.5  # s: a stopping worker's drains end this long before its stop's wait does


# The sockets whose request body is being read now (a read waiting for bytes or under way): what a stopping
# worker cuts before its graceful timeout ends (``webapp.worker.Worker.cut_body_reads``).
_reading: set = set()


def reading(sock) -> bool:
    """Whether a request body is being read from ``sock`` (a client socket) now."""
    return sock in _reading


def cut_by_stop(seconds: float) -> NotReady:
    """The 503 for a request whose body was still arriving ``seconds`` (s) after its worker began to stop, too
    close to the end of the stop's wait (gunicorn's ``graceful_timeout``) to be read and answered: an answer
    the client can act on instead of the reset it got when the wait ended."""
    return NotReady(f"the worker reading it is stopping (the server is stopping, or reloading: its new workers "
                    f"serve), and this request's body had not all arrived {seconds:.1f} s after the stop began; send "
                    "the request again", headers={"Retry-After": "1"})  # not "the server": a reload's too (tryout26)


def stop_time_left() -> float | None:
    """Seconds (s) left of this worker's stop's wait (gunicorn's ``graceful_timeout``), None when it is not
    stopping. Replaced by the gunicorn worker as it runs (``webapp.worker.Worker.stop_time_left``)."""
    return None


def stopping() -> bool:
    """Whether this worker is stopping (its answers then close their connection); elsewhere never."""
    return stop_time_left() is not None


class GuardedInput:
    """``wsgi.input`` with ``100 Continue`` sent on the first read and an idle timeout on every read.

    ``raw`` is gunicorn's body reader (already limited to Content-Length, or de-chunked);
    ``idle_s`` is the longest wait for the next bytes (s).

    :raises BodyTimeout: (from any read) no byte arrived for ``idle_s`` seconds (408).
    :raises BadRequest: (from any read) the body ended, the client having closed its side, before the
        bytes its Content-Length declared, or before the last chunk of a chunked body; or a chunked body
        that gunicorn cannot de-chunk (a chunk size that is not hex, no CRLF after a chunk, a malformed
        extension or trailer...). 400; the connection then closes.
    """

    def __init__(self, raw, *, sock, expect_continue: bool, content_length: int | None, idle_s: float):
        self.raw = raw
        self.sock = sock
        self.pending_continue = expect_continue
        self.left = content_length  # None: chunked, unknown until the reader says it ended
        self.idle_s = idle_s
        self.declared = content_length
        self.ended = content_length == 0
        self.closing = False  # the connection closes after the answer: a drain may bypass gunicorn's reader
        self.cut_short = False  # the body ended before its Content-Length: the connection cannot be reused

    def _read(self, fn, *args) -> bytes:
        if self.ended:
            return b""
        if self.pending_continue:
            self.pending_continue = False
            self.sock.sendall(_CONTINUE)
        # The limit is on each socket read, not on this read: gunicorn's reader serves one app read with as many
        # socket reads as the bytes need, so an upload over a slow link whose bytes keep coming got 408 once the
        # whole body took idle_s (gevent's sockets, TLS ones too, raise socket.timeout, a TimeoutError).
        before = self.sock.gettimeout()
        self.sock.settimeout(self.idle_s)
        _reading.add(self.sock)
        try:
            data = fn(*args)
        except TimeoutError:  # refused before its end: the connection closes after the 408, drained (below)
            raise BodyTimeout.after(self.idle_s) from None
        except ChunkOverLimit as exc:  # a chunk declared larger than the whole limit: 413 now, as a Content-Length
            self.cut_short = True
            raise TooLarge.body(exc.limit, exc.size) from None
        except (ParseException, NoMoreData) as exc:  # gunicorn's de-chunking: the client's error, never a 500
            # Where a next request would start is unknown: close. A client still sending is drained from the
            # socket after its 400 (closing with bytes unread resets the connection, and it may lose the answer).
            self.cut_short, self.ended = True, isinstance(exc, NoMoreData)
            raise BadRequest(_chunked_problem(exc)) from None
        finally:
            _reading.discard(self.sock)
            self.sock.settimeout(before)
        if not data:
            self.ended = True
            if self.left is not None and self.left > 0 and (not args or args[0] != 0):
                self.cut_short = True
                got = self.declared - self.left
                raise BadRequest(f"the request body ended after {got} of the {self.declared} bytes its "
                                 "Content-Length header declares: send the whole body, or the right length")
        elif self.left is not None:
            self.left -= len(data)
            self.ended = self.left <= 0
        return data

    def read(self, size: int | None = -1) -> bytes:
        """Up to ``size`` bytes (all that is left for -1/None), ``b""`` at the end."""
        return self._read(self.raw.read, size if size is not None else -1)

    def readline(self, size: int | None = -1) -> bytes:
        """One line (``b"\\n"``-terminated) of at most ``size`` bytes."""
        return self._read(self.raw.readline, size if size is not None else -1)

    def readlines(self, hint: int | None = None) -> list[bytes]:
        """The remaining lines."""
        return list(iter(self.readline, b""))

    def __iter__(self):
        return iter(self.readline, b"")

    def drain(self, max_bytes: int | None = None, max_seconds: float = DRAIN_SECONDS) -> bool:
        """Read and discard what is left, bounded; True if the body was read to its end or the client closed.

        Where the connection closes after the answer (``closing``), straight from the socket in
        ``DRAIN_CHUNK`` reads (gunicorn's reader state no longer matters: no request follows on it; the
        few KiB it may hold already are not counted, so the drain ends at the client's close, as HTTP
        clients close once they read a ``Connection: close`` answer); elsewhere through gunicorn's reader."""
        self.pending_continue = False  # a refused request never gets "100 Continue"
        max_bytes = drain_bytes if max_bytes is None else max_bytes
        if self.ended:
            return True
        if self.closing:
            cap = max_bytes if self.left is None else min(max_bytes, self.left)
            closed, read = drain_socket(self.sock, cap, max_seconds)
            return closed or (self.left is not None and read >= self.left)
        read = 0
        try:
            with time_limit(max_seconds):
                while not self.ended and read < max_bytes:
                    chunk = self.raw.read(min(65536, max_bytes - read))
                    if not chunk:
                        self.ended = True
                    read += len(chunk)
                    if self.left is not None:
                        self.left -= len(chunk)
                        self.ended = self.ended or self.left <= 0
        except (TimeoutError, OSError, ValueError, ParseException):  # stalled, gone, or a malformed chunked body
            return False
        return self.ended


def drain_socket(sock, max_bytes: int | None = None, max_seconds: float = DRAIN_SECONDS) -> tuple[bool, int]:
    """Half-close ``sock`` after its refusal was written, then read and drop what the client still sends, until it
    closes, at most ``max_bytes`` bytes (default ``drain_bytes``) and ``max_seconds`` s, in ``DRAIN_CHUNK`` reads;
    returns (whether it closed, bytes read). For a refused body whose connection closes (``GuardedInput.drain``)
    and gunicorn's own refusals (``refusals.write_json_error``): closing a socket with unread bytes resets the
    connection, and a client still uploading may lose the answer it has not read yet. Never raises."""
    read, flags, max_bytes = 0, _MSG_TRUNC, drain_bytes if max_bytes is None else max_bytes
    try:  # half-close (RFC 9112 9.6): a client that reads to the end of the connection has the answer now, not
        sock.shutdown(socket.SHUT_WR)  # after the drain (2 s for gunicorn's refusals: tryout27), and closes its side
    except OSError:
        pass
    try:
        with time_limit(max_seconds):
            while read < max_bytes:
                try:
                    n = sock.recv_into(_DISCARD, min(DRAIN_CHUNK, max_bytes - read), flags)
                except ValueError:  # a TLS socket (gunicorn --certfile) takes no flags: copy instead
                    if not flags:
                        raise
                    flags = 0
                    continue
                if not n:
                    return True, read  # the client closed: it has the answer
                read += n
    except (TimeoutError, OSError, ValueError):
        pass
    return False, read


class ChunkOverLimit(ParseException):
    """A chunk whose size line declares more than ``limit`` bytes, the whole body's limit (``MAX_UPLOAD_BYTES``)."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"a chunk of {size:,} bytes")
        self.size, self.limit = size, limit


def _bounded(parse_chunk_size, limit: int):
    """gunicorn's ``ChunkedReader.parse_chunk_size`` (-> ``(size, rest)``), raising ``ChunkOverLimit`` for a chunk over
    ``limit`` bytes as soon as its size line is read: it waited for the bytes (a stalled client: the body timeout,
    30 s) where a Content-Length as large gets its 413 at once (tryout24)."""
    def parse(unreader, data=None):
        size, rest = parse_chunk_size(unreader, data)
        if size > limit:
            raise ChunkOverLimit(size, limit)
        return size, rest
    return parse


class TinyChunks(ParseException):
    """A chunked body of tiny chunks (``CHUNKS_JUDGED``, ``MIN_MEAN_PIECE``): ``pieces`` pieces, ``nbytes`` bytes."""

    def __init__(self, pieces: int, nbytes: int):
        super().__init__(f"{pieces} chunks of {nbytes / pieces:.0f} bytes on average")
        self.pieces, self.nbytes = pieces, nbytes


def _counted(parser):
    """gunicorn's de-chunking generator (``ChunkedReader.parser``: each chunk's bytes, in pieces no larger than
    a socket read), raising ``TinyChunks`` once ``CHUNKS_JUDGED`` or more pieces average under ``MIN_MEAN_PIECE``;
    every ``CHUNKS_JUDGED`` pieces the other greenlets run."""
    pieces = nbytes = 0
    for piece in parser:
        pieces, nbytes = pieces + 1, nbytes + len(piece)
        if pieces >= CHUNKS_JUDGED:
            if nbytes < MIN_MEAN_PIECE * pieces:
                raise TinyChunks(pieces, nbytes)
            if pieces % CHUNKS_JUDGED == 0:
                let_others_run()
        yield piece


def _chunked_problem(exc: Exception) -> str:
    """The 400 message for gunicorn's error ``exc`` while it de-chunked a request body."""
    if isinstance(exc, TinyChunks):
        return (f"the chunked request body came in chunks of {exc.nbytes / exc.pieces:.0f} bytes on average over "
                f"its first {exc.pieces:,} (at least {MIN_MEAN_PIECE} are taken): each chunk costs the server far "
                f"more than its bytes; send larger chunks (8 KB or more), or a Content-Length instead")
    if isinstance(exc, NoMoreData):
        return ("the chunked request body ended, the client having closed its side, before its last chunk "
                "(0 CRLF CRLF): send the whole body")
    return (f"malformed chunked request body ({str(exc)[:120]}): each chunk is its size in hex, CRLF, the bytes, "
            "CRLF, ending with 0 CRLF CRLF (RFC 9112 section 7.1); or send a Content-Length instead")


class _Answered:
    """The app's response iterable; its ``close()`` (called by gunicorn after the answer is written)
    drains the refused request's body, bounded, before the connection closes."""

    def __init__(self, body, guarded: GuardedInput):
        self.body = body
        self.guarded = guarded

    def __iter__(self):
        return iter(self.body)

    def close(self) -> None:
        left = stop_time_left()  # stopping: the drain ends before the stop's wait does (else the master kills it)
        try:
            if not self.guarded.drain(max_seconds=DRAIN_SECONDS if left is None else
                                      max(0.0, min(DRAIN_SECONDS, left - STOP_MARGIN_S))):
                log.debug("closing a connection with its request body unread (stalled, or over the drain bound)")
        finally:
            if hasattr(self.body, "close"):
                self.body.close()


def guard_bodies(wsgi_app, *, idle_s: float, max_bytes: int | None = None, largest_body: int = 0):
    """Wrap ``wsgi_app`` (a WSGI callable) as the module docstring says (``idle_s``: the body timeout, s; ``max_bytes``:
    the upload limit, which one chunk of a chunked body may not declare more than; ``largest_body``: the largest
    body any route takes, bytes, which sets ``drain_bytes``); returns the new WSGI callable."""
    global drain_bytes
    drain_bytes = max(DRAIN_BYTES, largest_body * 5 // 4)

    def app(environ, start_response):
        sock = environ.get("gunicorn.socket")
        if sock is None:  # not under gunicorn (tests' client, Ray's a2wsgi): bodies are already bounded there
            return wsgi_app(environ, start_response)
        length = environ.get("CONTENT_LENGTH")
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        # RFC 9110 10.1.1: an HTTP/1.0 request's 100-continue is ignored (a 1.0 client would take 100 as its answer).
        expect = environ.get("HTTP_EXPECT", "").lower() == "100-continue" and \
            environ.get("SERVER_PROTOCOL", "HTTP/1.1") not in ("HTTP/1.0", "HTTP/0.9")
        # An HTTP/1.0 POST without Content-Length may carry a body gunicorn reads as none (411, uploads.py): its
        # length is unknown, so that after the refusal what the client sent is drained, not reset.
        unknown = not length and not chunked and environ.get("SERVER_PROTOCOL") == "HTTP/1.0" and \
            environ.get("REQUEST_METHOD") in ("POST", "PUT", "PATCH")
        reader = getattr(environ["wsgi.input"], "reader", None)  # gunicorn's Body: its ChunkedReader, if chunked
        if chunked and getattr(reader, "parser", None) is not None:
            reader.parser = _counted(reader.parser)
            if max_bytes and hasattr(reader, "parse_chunk_size"):  # looked up on the reader at each chunk
                reader.parse_chunk_size = _bounded(reader.parse_chunk_size, max_bytes)
        guarded = GuardedInput(environ["wsgi.input"], sock=sock, expect_continue=expect,
                               content_length=None if chunked or unknown else int(length or 0), idle_s=idle_s)
        environ["wsgi.input"] = guarded

        def start(status: str, headers: list, exc_info=None):
            refused = int(status[:3]) >= 400 and not guarded.ended
            # Refused before its body was read: answer now, close after (gunicorn's Response: the
            # response must close, or keep-alive would read the rest of the body unbounded). Or an
            # upload answered by a worker that has others in progress while another worker is idle:
            # the client's next request connects again and goes to the idle one (webapp/balance.py).
            # Or an answer written while the worker stops: the connection closes after it, so it must say so
            # (gunicorn's check of ``alive`` is made as a request begins: one in flight said keep-alive).
            if refused or guarded.cut_short or stopping() or \
                    (environ.get("REQUEST_METHOD") == "POST" and balance.hand_over()):
                resp = getattr(start_response, "__self__", None)
                if hasattr(resp, "force_close"):
                    resp.force_close()
                    guarded.closing = True
                headers = [(k, v) for k, v in headers if k.lower() != "connection"] + [("Connection", "close")]
            return start_response(status, headers, exc_info) if exc_info else start_response(status, headers)

        return _Answered(wsgi_app(environ, start), guarded)

    return app
