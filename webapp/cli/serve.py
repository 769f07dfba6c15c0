"""``python -m webapp serve``: exec gunicorn with the project's config; ``--cluster``: Ray Serve instead.

The options set ``CLASSIFIER_*`` variables; what follows ``--`` goes to gunicorn unchanged.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys

from .. import settings as settings_mod
from ..settings import PREFIX
from .common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ROOT, err, ray_missing
from .options import HelpFormatter, add_setting_options, address_arg, as_environ, given_settings, settings_epilog, shown


def add_parser(sub) -> None:
    """Add the ``serve`` command to ``sub`` (the top parser's subparsers)."""
    serve = sub.add_parser(
        "serve", formatter_class=HelpFormatter, help="run the web service (gunicorn with gunicorn.conf.py)",
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
    serve.add_argument("--address", type=address_arg, default=None, metavar="ADDR",
                       help="with --cluster: the Ray cluster to join, e.g. ray://head:10001 or head:6379 "
                            "(default: $RAY_ADDRESS, else a local Ray)")
    add_setting_options(serve, commands=settings_mod.SERVERS)
    serve.set_defaults(func=cmd_serve)


def _print_environ(env: dict) -> None:
    """The ``CLASSIFIER_*`` variables of ``env``, sorted, as shell assignments (``--dry-run``); a secret that is
    set is a comment line, so that pasting the lines cannot set ``CLASSIFIER_API_TOKEN='(set, hidden)'``."""
    for key in sorted(k for k in env if k.startswith(PREFIX)):
        setting = settings_mod.BY_NAME.get(key[len(PREFIX):])
        print(f"# {key} is set (hidden)" if setting is not None and setting.secret and env[key]
              else f"{key}={shlex.quote(shown(key[len(PREFIX):], env[key]))}")


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    """``serve``: replace this process with gunicorn (``extra``: its arguments after ``--``).

    Returns only on a problem found before the exec (EXIT_USAGE, EXIT_FAILED), with ``--dry-run``
    (EXIT_OK), or with ``--cluster`` (``serve_cluster``'s code). A bad setting raises
    ``SettingsError`` (``main`` makes it exit 2).
    """
    env = dict(os.environ)
    env.update(as_environ(given_settings(args)))
    s = settings_mod.load(env)  # a bad value stops here, named, before gunicorn starts
    if args.cluster:
        return serve_cluster(args, env, extra)
    if args.address:
        err("error: --address goes with --cluster")
        return EXIT_USAGE
    conf, wsgi = ROOT / "gunicorn.conf.py", ROOT / "wsgi.py"
    if not conf.is_file() or not wsgi.is_file():
        err(f"error: {conf} or {wsgi} is missing; serve runs from a checkout of the project")
        return EXIT_FAILED
    import importlib.util

    if importlib.util.find_spec("gunicorn") is None:
        err(f"error: gunicorn is not installed for {sys.executable}; pip install -r {ROOT / 'requirements.txt'}")
        return EXIT_FAILED
    # wsgi.py and the webapp package are found from any working folder; relative paths in
    # settings (CLASSIFIER_WEIGHTS=./x.pth) still mean the caller's folder.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    gunicorn_args = ["-c", str(conf), "wsgi:app", *extra]
    cmd = [*_gunicorn_launcher(), *gunicorn_args]
    if args.dry_run:  # what the real start would refuse (--bogus, -w 0, 500 workers on 24 GB), refused here too
        from .. import caches, cpu, lifecycle

        try:  # gunicorn's own parser on gunicorn's own arguments: an unknown flag is argparse's exit 2 there
            problem, workers = lifecycle.gunicorn_flags_problem(gunicorn_args)
        except SystemExit as exc:  # argparse printed its usage line and the error
            return EXIT_USAGE if exc.code else EXIT_OK  # -- --help: gunicorn's help, printed
        if workers is None:
            workers = cpu.plan(cpu.usable_cores(), workers=s.WORKERS, threads=s.THREADS).workers
        problem = problem or caches.cache_dir_problem(s) or cpu.memory_problem(workers, cpu.available_mb())
        if problem:
            err(f"configuration error: {problem}")
            return EXIT_USAGE
        _print_environ(env)
        print(f"PYTHONPATH={shlex.quote(env['PYTHONPATH'])}")
        print(shlex.join(cmd))
        return EXIT_OK
    if "BIND" in given_settings(args) and (problem := _bind_problem(s.BIND, extra)):
        from .. import lifecycle

        err(f"error: {problem}")
        return lifecycle.EXIT_LISTEN  # the status gunicorn.conf.py's own check exits with
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)  # never returns: gunicorn's master is this process now
    return EXIT_FAILED  # pragma: no cover


def _gunicorn_launcher() -> list[str]:
    """How to start gunicorn with this interpreter: its ``gunicorn`` script where this interpreter's scripts are
    (a venv's bin), else ``python -m gunicorn``. The script first: gunicorn's SIGUSR2 re-exec runs ``sys.argv``
    again, and ``python .../gunicorn/__main__.py`` puts gunicorn's own folder first on the import path, whose
    ``http`` package hides the standard library's: the new master failed with a traceback (tryout26)."""
    import sysconfig

    script = os.path.join(sysconfig.get_path("scripts"), "gunicorn")
    return [sys.executable, script] if os.path.isfile(script) else [sys.executable, "-m", "gunicorn"]


def _bind_problem(bind: str, extra: list[str]) -> str | None:
    """Whether gunicorn can listen on ``--bind``'s address (``bind``, parsed), checked before the exec as
    gunicorn.conf.py checks it (``listen.check_listen``), so that the line names --bind, which was given (the
    config's check names CLASSIFIER_BIND and gunicorn's -b only); None where it can, or where a gunicorn -b after
    ``--`` (``extra``) decides instead."""
    if any(a in ("-b", "--bind") or a.startswith(("-b", "--bind=")) for a in extra):
        return None
    from gunicorn.util import parse_address

    from .. import listen

    problem = listen.check_listen([parse_address(bind)])
    if problem is None or "CLASSIFIER_BIND (or gunicorn's -b)" not in problem:
        return problem and f"{problem} (given as --bind)"
    return problem.replace("CLASSIFIER_BIND (or gunicorn's -b)", "--bind (or CLASSIFIER_BIND, or gunicorn's -b)")


def serve_cluster(args: argparse.Namespace, env: dict, extra: list[str]) -> int:
    """``serve --cluster``: deploy the Ray Serve application and keep it until SIGINT/SIGTERM.

    ``env`` is the environment with the options applied. With a local Ray this process only
    supervises: the driver runs in a session of its own (``supervise``), so a signal to our process
    group reaches Ray only through it. A stop takes at most ``stop_timeout_s`` (REQUEST_TIMEOUT_S + 30 s).
    Returns EXIT_OK once stopped on SIGINT/SIGTERM (drained; or, when the signal reached Ray's own
    processes too, without waiting on them), and after ``--dry-run``; EXIT_USAGE for arguments after
    ``--`` or a BIND that is not a free host:port; EXIT_FAILED when Ray is missing, no cluster answers,
    the model cannot start or Ray could not be shut down in time; 128 + N when signal N ended the driver.
    """
    if extra:
        err(f"error: arguments after -- go to gunicorn, which --cluster does not run: {shlex.join(extra)}")
        return EXIT_USAGE
    s = settings_mod.load(env)
    host, _, port = s.BIND.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        err(f"error: CLASSIFIER_BIND={s.BIND!r}: with --cluster give host:port (port 1-65535) for Ray's HTTP proxy")
        return EXIT_USAGE
    host = host.strip("[]")
    joined = bool(args.address or os.environ.get("RAY_ADDRESS"))
    if not joined and not args.dry_run:  # a local Ray's proxy will listen here: is the address free?
        import socket

        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.bind((host, int(port)))
        except OSError as exc:
            err(f"error: cannot listen on {s.BIND}: {exc.strerror or exc} (CLASSIFIER_BIND / --bind)")
            return EXIT_USAGE
    address = args.address or os.environ.get("RAY_ADDRESS") or "(a local Ray on this host)"
    if args.dry_run:
        _print_environ(env)
        print(f"ray serve: {address} -> http://{host}:{port}/ (application 'classifier')")
        return EXIT_OK
    from .supervise import DRIVER_ENV, stop_timeout_s, supervise

    bound = stop_timeout_s(s.REQUEST_TIMEOUT_S)
    supervisor = os.environ.get(DRIVER_ENV)
    if not joined and not supervisor:  # the Ray started here must not get the signals sent to our group
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        return supervise([sys.executable, "-m", "webapp", "serve", "--cluster"], env, hard_stop_s=bound + 10)
    if ray_missing():
        return EXIT_FAILED
    from .. import cluster
    from ..errors import StartupError

    logging.basicConfig(level=s.LOG_LEVEL.upper(), format="%(asctime)s [%(levelname)s] %(name)s: %(message)s")
    try:
        clean = cluster.serve_forever(cluster.replica_settings(environ=env), address=args.address, host=host,
                                      port=int(port), stop_timeout_s=bound,
                                      parent=int(supervisor) if supervisor else None)
    except StartupError as exc:
        err(f"error: cannot start the model: {exc}")
        return EXIT_FAILED
    except (RuntimeError, ConnectionError) as exc:  # no cluster there; Ray Serve could not start or deploy
        err(f"error: {exc}")
        return EXIT_FAILED
    if not clean:  # Ray did not shut down in time: its exit hooks would wait on it again
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)
    return EXIT_OK
