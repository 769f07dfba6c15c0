"""``python -m webapp classify --server URL PATH...``: photos to a running server, over N connections.

The same files as local ``classify`` (``files.collect_files``), the same results, progress bar,
table/JSON/CSV (``output.ResultStream``, each row as it is ready) and exit status; the labels come from the
server's ``POST /api/v1/predict``. What makes it fit for a big folder and a busy server:

- **Scaled locally first** (unless ``--no-scale``): a JPEG whose short side is over the serving model's
  ``send_short_side`` (``GET /api/v1/models``) goes through the server's own first steps here (``draft``
  decode as the server's, upright, resized with ``send_resample``) and is sent as lossless WebP, so the
  same pixels reach the model (``scaling.scaled``): a 3.2 MB 12 MP photo as ~130 KB. Results report the
  original's size and format. Any other file is sent as it is (the server says what is wrong, if anything).
- **N concurrent connections** (``--jobs``, default ``DEFAULT_JOBS``): a thread pool
  (``concurrency.client_pool``) over one urllib3 pool of keep-alive connections.
- **Back-pressure honoured** (``retries``): a 429 or 503 is tried again after its ``Retry-After``, a
  dropped connection or a reverse proxy's own 502/504 after a short growing pause; a bounded number
  of tries and seconds of waiting per file.
- **The server's upload limit** (``uploading``): the one its ``/openapi.json`` publishes, or ``--max-upload-bytes``;
  what would be sent over it (a photo's scaled copy) is ``too_large``, unsent; with ``--no-scale``, unread. With none
  known every file is sent (the server's 413 answers). No file over ``uploading.HELD_BYTES`` is held in memory.
- **Nothing dropped silently**: every file ends in a result or an error line (the server's code
  and message, or ``connection_error`` / ``read_error``, with how many tries it took). An upload that gets
  no answer within ``READ_TIMEOUT_S`` is ``no_answer``, not tried again, and the files not yet sent are
  ``no_answer`` too, unsent: the server is stuck. After a 401 (the token missing or wrong) the files not yet
  sent are ``unauthorized``, unsent; after a file's tries all met no server while nothing answered any other file
  (the server gone), ``connection_error``, unsent. At the start, ``GET /api/v1/models`` waits out a 429 as a file does, a
  starting server for ``START_WAIT_S``, saying so; a server that cannot be reached, stays starting, or says
  nothing for ``PROBE_READ_TIMEOUT_S`` is one error line and exit 1.

The token, where the server needs one, is read from ``CLASSIFIER_API_TOKEN`` (not an option: a
command line shows in ``ps``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from .. import settings as settings_mod
from .common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PIPE, EXIT_USAGE, err, plural, silence_stdout
from .files import collect_files, error_code, no_image_files, report_skipped, skipped_note
from .options import flag_names, given_settings, url_problem
from .output import ResultStream, public
from . import retries as _retries  # (MAX_TRIES read at each use: tests lower it)
from .retries import backoff, described, error as _error, out_of_tries, parsed, reason as _reason, refusal as _refusal
from .retries import retry_wait
from .scaling import scaled
from .uploading import OPTION, SERVERS, Limit, published_limit, published_topk, read_upload, too_large

DEFAULT_JOBS = 8  # connections at once: enough to keep a server's batches full, few enough for its queue
# READ: an answer's longest silence. The server bounds answers by CLASSIFIER_REQUEST_TIMEOUT_S (30 s) and refuses
# at once what it cannot take: 120 s of silence is a stuck server (it was 300 s, retried: 40 minutes a file).
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10.0, 120.0
# GET /api/v1/models is answered at once, even by a starting server (its 503): silence this long is a stuck one.
PROBE_READ_TIMEOUT_S = 30.0
START_WAIT_S = 600.0  # the most seconds the first probe waits for a server that says it is starting (503 not_ready)
# The settings the client uses with --server (the others are the server's, refused): the labels asked for, its log,
# its own file limits: --max-upload-bytes (what is sent, over it: unsent; else the server's published limit), MAX_PIXELS
# (over it unscaled). Of the variables, CLASSIFIER_MAX_UPLOAD_BYTES is the server's (named as such), not a limit here.
_CLIENT_SETTINGS = ("TOP_K", "LOG_LEVEL", "MAX_UPLOAD_BYTES", "MAX_PIXELS")
_CLIENT_VARIABLES = ("TOP_K", "LOG_LEVEL", "MAX_PIXELS", "API_TOKEN")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--server`` and ``--no-scale`` to the ``classify`` parser."""
    parser.add_argument("--server", default=None, metavar="URL",
                        help="classify with a running server (http://host:port) instead of a local model: N "
                             "concurrent connections (--jobs, default %d), photos scaled locally first, 429 and "
                             "Retry-After honoured; same outputs and exit status. Where the server wants a "
                             "token, set its API_TOKEN setting's variable here too (read from the environment)"
                             % DEFAULT_JOBS)
    parser.add_argument("--no-scale", action="store_true",
                        help="with --server: send the files as they are (default: photos larger than the server "
                             "needs are scaled down locally first)")


class Unreachable(Exception):
    """The server cannot be asked at all (refused, no such host, not our API); the message says which."""


class Client:
    """Keep-alive connections to one server (``url``: scheme, host and port), shared by ``jobs`` threads."""

    def __init__(self, url: str, *, jobs: int, token: str = ""):
        import urllib3

        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = urllib3.PoolManager(num_pools=1, maxsize=jobs, block=True, retries=False)
        # (code, why) once sending more is pointless: an upload got no answer within READ_TIMEOUT_S (the server is
        # stuck), a 401 (no token, or a wrong one: every file would get the same), or a file's tries all met no
        # server while no answer came for any other (gone); the files not yet sent end so
        self._stopped: tuple[str, str] | None = None
        self._stop = threading.Event()  # set with ``stopped``: ends the other files' waits between tries at once
        self.answered_at = time.monotonic()  # when the server last answered anything (monotonic s)

    @property
    def stopped(self) -> tuple[str, str] | None:
        """``(code, why)`` once sending more is pointless (above), else None."""
        return self._stopped

    @stopped.setter
    def stopped(self, value: tuple[str, str]) -> None:
        self._stopped = value
        self._stop.set()

    def pause(self, seconds: float) -> bool:
        """Wait ``seconds`` (s) before a file's next try; True, at once, where sending has stopped meanwhile (a
        file waiting out its backoff kept the run going up to 8 s after the server was declared gone: tryout31)."""
        return self._stop.wait(seconds)

    def request(self, method: str, path: str, *, body: bytes | None = None, headers: dict | None = None,
                read_timeout_s: float | None = None):
        """One request, waiting at most ``read_timeout_s`` seconds (``READ_TIMEOUT_S`` where None) for each read of
        the answer; returns urllib3's response. Raises urllib3's errors for a failed connection
        (``ReadTimeoutError`` for no answer in time)."""
        import urllib3

        read = READ_TIMEOUT_S if read_timeout_s is None else read_timeout_s
        return self.http.request(method, self.url + path, body=body, headers={**self.headers, **(headers or {})},
                                 preload_content=True, timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=read))

    def serving_model(self, say=None) -> dict:
        """The serving model's ``/api/v1/models`` entry (the one asked for, before the server has loaded one).

        A 429 is tried again as an upload is (``retry_wait``, ``out_of_tries``: at most ``MAX_TRIES`` tries,
        ``MAX_WAIT_S`` seconds of waiting); a ``503 not_ready`` (a starting server's, on every route) for up to
        ``START_WAIT_S`` seconds of waiting; ``say(line)``, where given, is told of each wait. Each answer may
        take at most ``PROBE_READ_TIMEOUT_S`` seconds.

        :raises Unreachable: no connection, no answer within ``PROBE_READ_TIMEOUT_S`` s, still 429/503 when the
            tries run out, or not this service's answer.
        """
        import urllib3

        tries, waited = 0, 0.0
        while True:
            tries += 1
            try:
                resp = self.request("GET", "/api/v1/models", read_timeout_s=PROBE_READ_TIMEOUT_S)
            except urllib3.exceptions.ReadTimeoutError:
                raise Unreachable(f"no answer from {self.url} within {PROBE_READ_TIMEOUT_S:g} s "
                                  f"(GET /api/v1/models)") from None
            except urllib3.exceptions.HTTPError as exc:
                raise Unreachable(f"cannot reach the server at {self.url}: {_reason(exc)}") from None
            wait = retry_wait(resp, tries=tries)
            if wait is None:
                break
            refusal = _refusal(resp)
            starting = refusal["code"] == "not_ready"
            wait = max(wait, 1.0) if starting else wait  # (bounded by time: a Retry-After of 0 must not spin)
            state = "still starting" if starting else "busy" if refusal["code"] != "http_error" else "not answering"
            said = f"{resp.status} {refusal['code']}: {refusal['message']}"
            # A first start compiles for a minute or more (tryout17: given up after 41 s, ready at 77 s): a
            # starting server is waited for up to START_WAIT_S, however many tries that takes.
            if waited + wait > START_WAIT_S if starting else out_of_tries(tries, waited, wait):
                raise Unreachable(f"the server at {self.url} is {state} ({said}); gave up after {tries} tries, "
                                  f"{waited:.0f} s of waiting")
            if say:
                left = (f"waited {waited:.0f} of at most {START_WAIT_S:.0f} s" if starting
                        else f"try {tries + 1} of {_retries.MAX_TRIES}")
                to = "start" if starting else "take more" if state == "busy" else "answer"
                say(f"waiting for the server at {self.url} to {to} ({said}); trying again in {wait:.0f} s ({left})")
            time.sleep(wait)
            waited += wait
        doc = parsed(resp)  # {} where it is not a JSON object: not a photo classifier, below
        try:
            serving = doc["serving"] or doc["requested"]
            return next(m for m in doc["models"] if m["name"] == serving)
        except (KeyError, TypeError, StopIteration):
            raise Unreachable(f"{self.url} is not a photo classifier: GET /api/v1/models answered "
                              f"{described(resp)}") from None

    def document(self) -> dict | None:
        """The server's ``GET /openapi.json``, parsed (what it publishes: its upload limit, its default top-k), or
        None (no such answer). Raises nothing."""
        import urllib3

        try:
            resp = self.request("GET", "/openapi.json", read_timeout_s=PROBE_READ_TIMEOUT_S)
        except urllib3.exceptions.HTTPError:
            return None
        return parsed(resp) if resp.status == 200 else None


def classify_one(client: Client, path: Path, *, topk: int, short_side: int | None, max_bytes: int | Limit | None,
                 resample: str = "bilinear", max_pixels: int | None = None) -> dict:
    """One file's result: ``{"width", "height", "format", "predictions", "batch_size", "retries"}`` or
    ``{"error": {"code", "message"}, "retries"}``. What would be sent over ``max_bytes`` (a ``uploading.Limit``:
    the server's or ``--max-upload-bytes``; an int is the latter; None: none known) is ``too_large``, unsent, naming
    the limit's source: with ``short_side`` the scaled copy, else the file, unread; one over ``HELD_BYTES`` is sent
    from disk as it is read, unscaled (and judged by its size, unread). One over ``max_pixels``, or a JPEG cut short,
    is sent unscaled for the server to judge (``scaling.scaled``). Never raises for a file, a server's refusal or a
    dropped connection (see the module docstring for the retries)."""
    import urllib3

    if client.stopped:  # (not read for nothing)
        return {"error": _error(client.stopped[0], f"not sent: {client.stopped[1]}"), "retries": 0}
    limit = max_bytes if isinstance(max_bytes, Limit) else Limit(max_bytes, OPTION)
    try:  # a photo scaled first is judged by what is sent (tryout22: a 3.2 MB photo, sent as ~115 KB, was refused)
        data = read_upload(path, Limit(None) if short_side else limit)
    except ValueError as exc:  # over the limit
        return {"error": _error("too_large", str(exc)), "retries": 0}
    except OSError as exc:
        return {"error": _error("read_error", f"cannot read the file: {exc.strerror or exc}"), "retries": 0}
    held = isinstance(data, bytes)
    body, info = scaled(data, short_side, resample, max_pixels) if short_side and held else (data, None)
    if limit.bytes is not None and (size := len(body) if held else body.size) > limit.bytes:
        return {"error": _error("too_large", too_large(size, limit, scaled=body is not data)), "retries": 0}
    waited, tries, first_failed = 0.0, 0, None
    while True:
        if client.stopped:
            return {"error": _error(client.stopped[0], f"not sent: {client.stopped[1]}"), "retries": max(tries - 1, 0)}
        tries += 1
        wait = None
        try:
            resp = client.request("POST", f"/api/v1/predict?topk={topk}", body=body if held else body.chunks(),
                                  headers={"Content-Type": "application/octet-stream",
                                           **({} if held else {"Content-Length": str(body.size)})})
        except urllib3.exceptions.ReadTimeoutError:  # it took the upload and said nothing: stuck, not restarting
            why = (f"{client.url} took an upload and gave no answer within {READ_TIMEOUT_S:g} s (its answers are "
                   f"bounded by its CLASSIFIER_REQUEST_TIMEOUT_S: the server is stuck)")
            client.stopped = ("no_answer", why)
            return {"error": _error("no_answer", why.replace("took an upload", "took this upload")),
                    "retries": tries - 1}
        except urllib3.exceptions.HTTPError as exc:  # refused, reset: the server may be restarting
            failure = _error("connection_error", f"no answer from {client.url}: {_reason(exc)}")
            wait, first_failed, why_not = backoff(tries), first_failed or time.monotonic(), _reason(exc)
        else:
            client.answered_at, first_failed = time.monotonic(), None
            doc = parsed(resp)
            if resp.status == 200 and "results" in doc:
                r = doc["results"][0]
                # each prediction's keys in local classify's order (the server's JSON sorts them)
                return {**{k: r[k] for k in ("width", "height", "format")}, **(info or {}), "predictions": [
                    {**{k: p[k] for k in ("label", "index", "probability") if k in p}, **p} for p in r["predictions"]],
                        "batch_size": r.get("batch_size"), "retries": tries - 1}
            failure, wait = _refusal(resp, doc), retry_wait(resp, doc, tries)
            if resp.status == 401:  # the token (CLASSIFIER_API_TOKEN) is missing or wrong: so for every file
                # in the client's words: the server's ("send 'Authorization: Bearer <token>'") are for scripts
                failure["message"] = (f"the server refused the token in CLASSIFIER_API_TOKEN: set it to the server's "
                                      if client.headers else "the server needs a token: set CLASSIFIER_API_TOKEN to "
                                      "it ") + f"(it said: {failure['message']})"
                client.stopped = (failure["code"], failure["message"])
        if wait is None:
            return {"error": failure, "retries": tries - 1}
        if out_of_tries(tries, waited, wait):
            failure["message"] += f" (gave up after {tries} tries, {waited:.0f} s of waiting)"
            if first_failed and client.answered_at < first_failed:  # nothing answered any file all that time: gone,
                # and each file left would wait as long again (3,000 files: hours, the bar said minutes; tryout30)
                client.stopped = ("connection_error", f"the server at {client.url} answered nothing for "
                                  f"{time.monotonic() - client.answered_at:.0f} s ({why_not})")  # (its last answer)
            return {"error": failure, "retries": tries - 1}
        if client.pause(wait):
            failure["message"] += f" (not tried again: {client.stopped[1]})"
            return {"error": failure, "retries": tries - 1}
        waited += wait


def classify_remote(args: argparse.Namespace) -> int:
    """``classify --server URL``: print one result per file on stdout; EXIT_OK all classified, EXIT_FAILED
    some failed (or the server cannot be reached), EXIT_USAGE misused options or no image files (as local
    ``classify``; photos skipped in folders, e.g. HEIC, are named with why, as there)."""
    given = given_settings(args)
    # Named as typed: a switch given as --no-compile is named so, not as --compile.
    misused = [("--no-" if value is False else "--") + k.lower().replace("_", "-")
               for k, value in given.items() if k not in _CLIENT_SETTINGS]
    if misused:
        err(f"error: {', '.join(misused)} {'does' if len(misused) == 1 else 'do'} not go with --server: the "
            f"server's own settings decide")
        return EXIT_USAGE
    cluster = [flag for flag, on in (("--cluster", args.cluster), ("--out", args.out), ("--address", args.address))
               if on]
    if cluster:
        err(f"error: {', '.join(cluster)} {'does' if len(cluster) == 1 else 'do'} not go with --server: they run "
            f"classify over a Ray cluster instead of sending the photos to a server; give one or the other")
        return EXIT_USAGE
    problem = url_problem(args.server)
    if problem:
        err(f"error: {problem}")
        return EXIT_USAGE
    s = settings_mod.load(os.environ, given, flag_names(given))
    # The same settings given as variables cannot be refused (one shell may also start a local server), but are
    # not ignored unsaid either (tryout17: the options were refused, the variables silently did nothing).
    unused = [settings_mod.PREFIX + x.name for x in settings_mod.SETTINGS
              if settings_mod.PREFIX + x.name in os.environ and x.name not in _CLIENT_VARIABLES]
    if unused and not args.quiet:
        err(f"note: {', '.join(unused)} {'is' if len(unused) == 1 else 'are'} set here but "
            f"{'is a setting' if len(unused) == 1 else 'are settings'} of the server: with --server the server's "
            f"own values apply")
    items, skipped = collect_files(args.paths, all_files=args.all_files)
    report_skipped(skipped)  # as local classify: a HEIC in a folder is named with why, not dropped unsaid
    if not any(path for _, path, _ in items):
        no_image_files(args.paths, skipped, [(shown, why) for shown, _, why in items])
        return EXIT_USAGE  # as local classify (README's exit table: no image file in the paths)
    client = Client(args.server, jobs=(jobs := args.jobs or DEFAULT_JOBS), token=s.API_TOKEN)
    try:
        model = client.serving_model(say=None if args.quiet else err)
    except Unreachable as exc:
        err(f"error: {exc}")
        # Each file still gets its row (an error, unsent), as the exit table says of exit 1: with -f json an empty
        # stdout, not [], broke the | jq after it (tryout32)
        client.stopped = ("connection_error", str(exc))
        return _run(args, client, None, items, topk=s.TOP_K, short_side=None, resample="bilinear", jobs=jobs,
                    skipped=skipped, max_bytes=Limit(None, SERVERS), max_pixels=s.MAX_PIXELS)
    # Upload limit, top-k: --max-upload-bytes, --topk (CLASSIFIER_TOP_K) where given, else the server's, else none/ours
    own_topk = "TOP_K" in given or settings_mod.PREFIX + "TOP_K" in os.environ
    doc = None if "MAX_UPLOAD_BYTES" in given and own_topk else client.document()
    limit = Limit(s.MAX_UPLOAD_BYTES, OPTION) if "MAX_UPLOAD_BYTES" in given else Limit(published_limit(doc), SERVERS)
    topk = s.TOP_K if own_topk else published_topk(doc) or s.TOP_K
    short_side = None if args.no_scale else model.get("send_short_side")
    from PIL import Image

    resample = model.get("send_resample", "bilinear")  # a server from before the field: bilinear, as all here
    if str(resample).upper() not in Image.Resampling.__members__:  # a filter Pillow lacks: send originals
        short_side = None
    if not args.quiet:
        scale = "sent as they are" if short_side is None else f"over {short_side} px scaled locally first"
        err(f"classifying with {client.url}: {model.get('title', model['name'])}, {model.get('precision', '?')}; "
            f"{plural(jobs, 'connection')}, photos {scale}")
    return _run(args, client, model["name"], items, topk=topk, short_side=short_side, resample=resample,
                jobs=jobs, skipped=skipped, max_bytes=limit, max_pixels=s.MAX_PIXELS)


def _run(args, client: Client, model: str, items: list, *, topk: int, short_side: int | None, resample: str,
         jobs: int, max_bytes: Limit, skipped: list = (), max_pixels: int | None = None) -> int:
    from concurrent.futures import as_completed

    from tqdm import tqdm

    from ..concurrency import client_pool

    results = []
    for shown, path, why in items:
        error = _error(error_code(why), why) if why else None
        results.append({"path": shown, "model": model, "width": None, "height": None, "format": None,
                        "predictions": [], "batch_size": None, "error": error, "_path": path})
    todo = [i for i, r in enumerate(results) if r["error"] is None]
    failed, retries = len(results) - len(todo), 0
    start = time.perf_counter()
    pool = client_pool(jobs)
    # Every file counts, those that failed before any work too (unreadable, not a file): the bar ends at the
    # summary's number of files, not short of it (tryout17)
    bar = tqdm(total=len(results), initial=len(results) - len(todo), unit="img", file=sys.stderr,
               disable=args.quiet, dynamic_ncols=True, desc="classify", mininterval=0.2)
    stream = None
    try:
        stream = ResultStream(args.format or "table", topk, [r["path"] for r in results], bar=bar)  # (its header)
        for i, r in enumerate(results):
            if r["error"] is not None:  # failed before any work: its row is ready now
                stream.put(i, public(r))
        futures = {pool.submit(classify_one, client, results[i]["_path"], topk=topk, short_side=short_side,
                               max_bytes=max_bytes, resample=resample, max_pixels=max_pixels): i
                   for i in todo}
        for future in as_completed(futures):
            result = results[futures[future]]
            result.update(future.result())
            retries += result.pop("retries")
            failed += result["error"] is not None
            bar.set_postfix(failed=failed, retried=retries, refresh=False)
            bar.update(1)
            if not stream.put(futures[future], public(result)):
                client.stopped = ("not_sent", "the results cannot be written")  # the threads send no more
                break
    except (KeyboardInterrupt, BrokenPipeError) as exc:  # out at once: the pool's threads may be waiting on answers,
        pool.shutdown(wait=False, cancel_futures=True)  # and the interpreter would join them at exit (a second Ctrl-C
        bar.close()  # then printed a traceback: tryout17; a reader that left, | head, had every file sent still)
        if isinstance(exc, BrokenPipeError):
            silence_stdout()
            sys.stderr.flush()
            os._exit(EXIT_PIPE)  # as main: nothing said for a closed pipe, and not 1 (that is "files failed")
        if stream is not None:
            stream.close()  # the rows written so far stay a whole table, CSV or JSON list
        err("interrupted")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)
    bar.close()
    pool.shutdown(cancel_futures=not stream.ok)
    elapsed = time.perf_counter() - start
    if not stream.close():
        return EXIT_FAILED
    if not args.quiet:
        done = len(todo) - (failed - (len(results) - len(todo)))
        rate = f", {done / elapsed:.1f} images/s" if elapsed > 0 and done else ""
        err(f"{plural(len(results), 'file')}: {len(results) - failed} classified, {failed} failed; {elapsed:.1f} s"
            f"{rate}; {retries} tries repeated after 429/503, a proxy's 502/504 or a dropped connection"
            + skipped_note(list(skipped)))
    return EXIT_OK if failed == 0 else EXIT_FAILED
