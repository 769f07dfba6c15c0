"""``python -m webapp classify PATH...``: files through the same ``Classifier`` the server runs.

Locally: decode, dynamic batcher and engine as in the server, fed from a small thread pool so
batches form; one bad file is one error line, never the end of the run. ``--cluster --out
DEST.parquet``: the same with Ray Data over a cluster, one Parquet file out.
Exit status: ``common.CLASSIFY_EXIT_STATUS`` (0 all classified, 1 some failed, 2 usage or configuration
error). ``-`` among the paths reads more paths from stdin, one per line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from .. import caches
from .. import settings as settings_mod
from ..settings import PREFIX
from .common import CLASSIFY_EXIT_STATUS, EXIT_FAILED, EXIT_OK, EXIT_USAGE, err, plural, printable, ray_missing
from ..paths import expand, kind, said
from .files import (IMAGE_SUFFIXES, collect_files, error_code, no_image_files, read_limited, report_skipped,
                    skipped_note, unreadable)
from .options import (EMPTY_PATH, HelpFormatter, add_setting_options, address_arg, flag_names, given_settings,
                      positive_int, settings_epilog)
from .output import ResultStream, public
from .remote import add_arguments as add_remote_arguments
from .remote import classify_remote


def add_parser(sub) -> None:
    """Add the ``classify`` command to ``sub`` (the top parser's subparsers)."""
    classify = sub.add_parser(
        "classify", formatter_class=HelpFormatter, help="classify image files and folders",
        description="Classify image files and folders (searched recursively for image files) with the same engine "
                    "the server runs. Results go to stdout, progress and a summary to stderr. A file that cannot "
                    "be read or decoded is reported as an error and the run goes on. PATH - reads paths from stdin, "
                    "one per line (find ... | python -m webapp classify -).\nExit status: "
                    + "; ".join(f"{k} {v}" for k, v in CLASSIFY_EXIT_STATUS.items()) + ".",
        epilog="With --compile (the default), the model compiles first: about a minute on 2 cores, less once the "
               "cache (CLASSIFIER_CACHE_DIR) is warm; --no-compile starts in seconds. " + settings_epilog())
    classify.add_argument("paths", nargs="+", metavar="PATH", help="image files and folders; - reads paths from "
                          "stdin, one per line")
    classify.add_argument("-f", "--format", choices=("table", "json", "csv"), default=None,
                          help="table (default): path and top-k labels; json: a list, one object per file; "
                               "csv: path,rank,label,index,probability,error")
    classify.add_argument("-j", "--jobs", type=positive_int, default=0, metavar="N",
                          help="files read, decoded and queued at once (default: 2 x max batch size, "
                               "at most the queue size)")
    classify.add_argument("--all-files", action="store_true",
                          help="in folders, try every file, hidden ones too (default: only image file "
                               "names, no hidden files)")
    classify.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary. A file that "
                          "fails is a row of the output, with or without -q (stdout's table, CSV or JSON; with "
                          "--cluster, the Parquet file, or a line on stderr for a path it cannot read); warnings, "
                          "skipped HEIC/RAW photos and errors that stop the run still go to stderr")
    classify.add_argument("--cluster", action="store_true",
                          help="classify with Ray Data on a Ray cluster (pip install -r requirements-cluster.txt) and "
                               "write one Parquet file (--out): path, model, width, height, format, labels, "
                               "indices, probabilities, error_code, error per file. PATH may also be a URI Ray "
                               "Data reads (s3://bucket/photos/, gs://...). --cluster-actors model actors")
    classify.add_argument("--out", default=None, metavar="DEST.parquet",
                          help="with --cluster: the Parquet file to write (a path or a URI such as s3://...)")
    classify.add_argument("--address", type=address_arg, default=None, metavar="ADDR",
                          help="with --cluster: the Ray cluster to join (default: $RAY_ADDRESS, else a local Ray)")
    add_remote_arguments(classify)  # --server URL, --no-scale: the same command against a running server
    add_setting_options(classify, commands=(settings_mod.CLASSIFY, settings_mod.CLASSIFY_CLUSTER),
                        aliases={"TOP_K": ("--topk", "-k")},
                        notes={"TOP_K": "With --server, where neither this nor the variable is given: the server's "
                                        "default.",
                               "MAX_UPLOAD_BYTES": "With --server, where not given: the limit the server publishes."})
    classify.set_defaults(func=cmd_classify)


# -- log lines around the progress bar ---------------------------------------------------------------------
class _StderrHandler(logging.Handler):
    """Log lines on stderr (or ``stream``), above the progress bar rather than through it."""

    def __init__(self, stream=None):
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(printable(self.format(record)), file=self.stream or sys.stderr)  # (it may name a file)
        except Exception:
            self.handleError(record)


def _setup_logging(level: str, stream=None):
    """Route the ``webapp`` logger to stderr (or ``stream``) at ``level``; return a function that restores it."""
    handler = _StderrHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("webapp")
    saved = log.handlers, log.propagate, log.level
    log.handlers = [handler]
    log.propagate = False
    log.setLevel(level.upper())

    def restore() -> None:
        log.handlers, log.propagate, log.level = saved

    return restore


def read_paths(paths: list[str], stdin) -> list[str]:
    """``paths`` with ``-`` replaced by the lines of ``stdin`` (one path per line, blank lines ignored), in place."""
    out: list[str] = []
    for p in paths:
        if p == "-":
            out.extend(line.rstrip("\r\n") for line in stdin if line.strip())
        else:
            out.append(p)
    return out


def path_problems(paths: list[str]) -> list[str]:
    """An error line for each path that can hold nothing to classify: a usage error, said before anything
    starts. An empty one (``classify "$DIR"`` with DIR unset: never the current folder), and a local one
    (not a URI) that does not exist or cannot be looked at (a name part over 255 bytes, a folder on the way
    that may not be searched: ``files.unreadable``'s words). A FIFO or device is left to the run (an error row)."""
    out = []
    for p in paths:
        if not p:
            out.append(f"error: {EMPTY_PATH}; give . for the current folder")
        elif "://" not in p and (why := unreadable(Path(p))) and error_code(why) != "not_a_file":
            out.append(f"error: {p}: {why}")
    return out


# -- local ---------------------------------------------------------------------------------------------------
def _error(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def cmd_classify(args: argparse.Namespace) -> int:
    """``classify``: print one result per file on stdout; the exit status is ``CLASSIFY_EXIT_STATUS``'s.

    A bad setting, or a ``CACHE_DIR`` that cannot be created, raises ``SettingsError`` (``main`` makes it
    exit 2); ``--cluster`` goes to
    ``classify_cluster``. Paths (``-``: from stdin) are checked first: an empty one, one that does not exist
    or cannot be looked at (``path_problems``), or none holding an image file, is a usage error before any
    model starts.
    """
    if args.server is not None and os.environ.get(settings_mod.PREFIX + "TOP_K") == "":  # the load would name 3
        raise settings_mod.SettingsError(f"{settings_mod.PREFIX}TOP_K='' is not valid (empty: a shell variable not "
                                         "set? unset it for the server's default); allowed: "
                                         f"{settings_mod.BY_NAME['TOP_K'].rule()}")
    s = settings_mod.load(os.environ, given := given_settings(args), flag_names(given))
    args.paths = read_paths(args.paths, sys.stdin)
    if not args.paths:
        err("error: no paths (stdin was empty)")
        return EXIT_USAGE
    problems = path_problems(args.paths)
    for line in problems:
        err(line)
    if problems:
        return EXIT_USAGE
    if args.server is not None:  # --server "" ($URL unset) is a usage error there, not a local run
        return classify_remote(args)
    if args.no_scale:  # as --out without --cluster: an option that would do nothing is said, not ignored
        err("error: --no-scale goes with --server (it sends the files as they are instead of scaled down first)")
        return EXIT_USAGE
    if args.cluster:
        return classify_cluster(args)
    if args.out or args.address:
        err("error: --out and --address go with --cluster")
        return EXIT_USAGE
    caches.make_cache_dir(s, read_only_ok=True)  # one that cannot be made is a setting's fault (SettingsError: 2)
    items, skipped = collect_files(args.paths, all_files=args.all_files)
    report_skipped(skipped)
    if not any(path for _, path, _ in items):
        no_image_files(args.paths, skipped, [(shown, why) for shown, _, why in items])
        return EXIT_USAGE
    # The service's info lines are for server logs; here the CLI's own lines say it shorter. An
    # explicitly set log level (--log-level, CLASSIFIER_LOG_LEVEL) is honoured.
    explicit = "LOG_LEVEL" in given_settings(args) or f"{PREFIX}LOG_LEVEL" in os.environ
    restore_logging = _setup_logging(s.LOG_LEVEL if explicit else "warning")
    try:
        return _classify(args, s, items, skipped)
    finally:
        restore_logging()


def _classify(args: argparse.Namespace, s, items: list, skipped: int) -> int:
    topk = s.TOP_K

    from tqdm import tqdm

    from .. import mangled
    from ..contract import Upload
    from ..errors import ServiceError, StartupError
    from ..service import Classifier

    if not args.quiet:  # which model serves is known once it is loaded (the offline one may stand in)
        err(f"starting the model ({'compiling, about a minute on a cold cache' if s.COMPILE else 'eager'}) ...")
    t0 = time.perf_counter()
    classifier = Classifier(s)
    try:
        classifier.start()
    except StartupError as exc:  # weights missing or damaged, a failed self-test: configuration
        err(f"error: cannot start the model: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:  # before any row: still a whole (empty) list, table or CSV, as later (tryout25)
        ResultStream(args.format or "table", topk, []).close()
        raise
    model = classifier.describe()
    if model.get("note") and logging.getLogger("webapp").level > logging.WARNING:  # else the service said it
        err(f"warning: {model['note']}")
    if not args.quiet:
        err(f"model {model['title']}, weights {model['weights']}, {model['precision']}, "
            f"{'compiled' if model['compiled'] else 'eager'}, {plural(classifier.threads, 'thread')}, "
            f"ready in {time.perf_counter() - t0:.1f} s")
    batches_before, images_before = classifier.batcher.batches, classifier.batcher.images
    # Each job has at most one image queued, so the batcher's queue never overflows.
    jobs = min(args.jobs or 2 * s.MAX_BATCH_SIZE, s.QUEUE_SIZE)

    def one(path: Path) -> dict:
        data = b""
        try:
            data = read_limited(path, s.MAX_UPLOAD_BYTES)
            answer = classifier.classify([Upload(path.name, data)], topk=topk)
        except ServiceError as exc:  # words about a file here, not an upload (no curl advice)
            message = mangled.for_a_file(exc.message.removeprefix(f"{path.name}: "), data)
            return {"error": _error(exc.code, message)}
        except OSError as exc:
            return {"error": _error("read_error", f"cannot read the file: {exc.strerror or exc}")}
        except Exception as exc:  # a bug: report it on this file, go on with the others
            logging.getLogger("webapp").exception("unexpected error on %s", path)
            return {"error": _error("internal_error", f"{type(exc).__name__}: {exc}")}
        r = answer["results"][0]
        return {"width": r["width"], "height": r["height"], "format": r["format"], "predictions": r["predictions"],
                "batch_size": r["batch_size"]}

    results: list[dict] = []
    for shown, path, why in items:
        error = _error(error_code(why), why) if why else None
        results.append({"path": shown, "model": model["name"], "width": None, "height": None, "format": None,
                        "predictions": [], "batch_size": None, "error": error, "_path": path})
    todo = [i for i, r in enumerate(results) if r["error"] is None]
    failed = len(results) - len(todo)
    start = time.perf_counter()
    from concurrent.futures import as_completed

    from ..concurrency import client_pool

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
        futures = {pool.submit(one, results[i]["_path"]): i for i in todo}
        for future in as_completed(futures):
            result = results[futures[future]]
            result.update(future.result())
            if result["error"]:
                failed += 1
                bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)
            if not stream.put(futures[future], public(result)):
                break  # the output cannot be written: said, and nothing more to do
    except (KeyboardInterrupt, BrokenPipeError) as exc:  # Ctrl-C, or the reader left (| head): nothing more to do
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
        classifier.stop()
        if isinstance(exc, KeyboardInterrupt) and stream is not None:
            stream.close()  # the rows written so far stay a whole table, CSV or JSON list
        raise
    bar.close()
    pool.shutdown(cancel_futures=not stream.ok)
    elapsed = time.perf_counter() - start
    batches = classifier.batcher.batches - batches_before
    images = classifier.batcher.images - images_before
    classifier.stop()
    if not stream.close():
        return EXIT_FAILED
    ok = len(results) - failed
    if not args.quiet:
        rate = f", {images / elapsed:.1f} images/s" if elapsed > 0 and images else ""
        mean = f" in {plural(batches, 'batch')} (mean size {images / batches:.1f})" if batches else ""
        err(f"{plural(len(results), 'file')}: {ok} classified, {failed} failed{mean}; {elapsed:.1f} s{rate}"
            + skipped_note(skipped))
    return EXIT_OK if failed == 0 else EXIT_FAILED


# -- on a Ray cluster -----------------------------------------------------------------------------------------
def classify_cluster(args: argparse.Namespace) -> int:
    """``classify --cluster``: Ray Data over the paths, one Parquet file out (``--out``).

    The exit status is ``CLASSIFY_EXIT_STATUS``'s. Ray's own output (driver log lines, its C++ core's,
    the actors' forwarded lines) goes to a log file named at the end; the terminal shows only our
    progress bar and lines. Paths in the rows follow ``files.shown_path``'s rule, as locally.
    """
    if not args.out:
        err("error: classify --cluster writes a Parquet file: give --out DEST.parquet")
        return EXIT_USAGE
    if args.format or args.jobs:
        err("error: --format and --jobs are for classify without --cluster (with it, rows go to --out)")
        return EXIT_USAGE
    suffix = os.path.splitext(args.out.rstrip("/"))[1].lower()
    if suffix not in (".parquet", ".pq", ""):  # x.csv held Parquet, exit 0 (tryout24): a name that says otherwise
        err(f"error: --out {args.out!r}: classify --cluster writes Parquet, not {suffix}; name it "
            f"{args.out.rstrip('/')[:-len(suffix)]}.parquet (or leave --cluster out for --format csv/json)")
        return EXIT_USAGE
    if "://" not in args.out:  # a bad destination is a usage error, found before Ray starts
        out = expand(args.out)
        try:
            if kind(out) == "folder":  # raises Unusable: "PATH: File name too long"
                raise IsADirectoryError(f"{args.out} is a folder; give a file name, e.g. {out / 'labels.parquet'}")
            out.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(out.parent, os.W_OK):
                raise PermissionError(f"cannot write in {out.parent}")
        except OSError as exc:
            err(f"error: --out: {said(exc)}")
            return EXIT_USAGE
    # Local files and folders are listed here, by classify's own rules (image names, no hidden files,
    # unless --all-files), as absolute paths (symlinks kept: a row names the file as it was given): Ray's
    # workers run elsewhere, and Ray Data's own folder listing would also drop names starting with "_"
    # (cameras' _MG_1234.JPG). URIs go to Ray Data.
    uris = [p for p in args.paths if "://" in p]
    items, skipped = collect_files([p for p in args.paths if "://" not in p], all_files=args.all_files)
    report_skipped(skipped)
    unreadable = [(shown, why) for shown, path, why in items if path is None]
    shown = {os.path.abspath(path): name for name, path, _ in items if path is not None}
    sources = list(shown) + uris
    if not sources:
        no_image_files(args.paths, skipped, unreadable)
        return EXIT_USAGE
    for name, why in unreadable:
        err(f"{name}: {why}")
    if ray_missing():
        return EXIT_USAGE
    import tempfile

    from .. import cluster
    from ..catalog import OFFLINE
    from ..errors import StartupError
    from ..models import fallback_note

    values = cluster.replica_settings(given_settings(args))
    extensions = None if args.all_files or not uris else sorted(x.lstrip(".") for x in IMAGE_SUFFIXES)
    if not args.quiet:  # which model serves is known from the rows (the offline one may stand in)
        err(f"classifying {' '.join(args.paths)} with Ray Data: {plural(values['CLUSTER_ACTORS'], 'model actor')}, "
            f"{values['THREADS']} CPU each -> {args.out}")
    ray_log = Path(tempfile.gettempdir()) / f"classify-cluster-{os.getpid()}.log"
    failure, status = None, EXIT_FAILED
    with cluster.ray_output_in(ray_log) as console:
        restore_logging = _setup_logging(values["LOG_LEVEL"] if "LOG_LEVEL" in given_settings(args) else "warning",
                                         console)
        try:
            done = cluster.classify_to_parquet(values, sources, args.out, address=args.address, extensions=extensions,
                                               progress=not args.quiet, shown=shown, console=console)
        except StartupError as exc:
            failure, status = f"cannot start the model: {exc}", EXIT_USAGE
        except (FileNotFoundError, ConnectionError) as exc:  # nothing at the URIs; no cluster at --address
            failure, status = str(exc), EXIT_USAGE
        except OSError as exc:  # --out s3://... that cannot be written
            failure, status = str(exc), EXIT_FAILED
        finally:
            restore_logging()
    if failure:
        err(f"error: {failure} (Ray's own messages: {ray_log})")
        return status
    done["failed"] += len(unreadable)
    if values["MODEL"] not in done["models"] and OFFLINE in done["models"]:  # the actors' warning is in Ray's logs
        err(f"warning: {fallback_note()}")
    if not args.quiet:
        rate = f", {done['files'] / done['seconds']:.1f} files/s" if done["seconds"] > 0 else ""
        err(f"{plural(done['files'], 'file')}: {done['files'] - done['failed']} classified by "
            f"{', '.join(done['models']) or 'no model'}, {done['failed']} failed; {done['seconds']:.1f} s{rate} "
            f"-> {args.out}" + skipped_note(skipped))
        err(f"Ray's own messages: {ray_log}; its workers' logs: Ray's session folder (/tmp/ray/session_latest/logs "
            f"on a local Ray)")
    return EXIT_OK if done["failed"] == 0 else EXIT_FAILED
