"""Start and stop the real gunicorn server from tests: ``Server(log_path, MODEL=..., ...)``.

The launcher itself is ``bench/servers.py``'s ``Gunicorn`` (one for benchmarks and tests); this adds
the test-side manners: failures through ``pytest.fail`` and an exit-0/no-traceback teardown.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from bench.servers import READY_TIMEOUT_S, Gunicorn, NotReady, free_port, ours_command

__all__ = ["READY_TIMEOUT_S", "Server", "as_a_terminal_job", "free_port"]


def as_a_terminal_job() -> None:
    """``preexec_fn`` for a command a test stops with SIGINT or SIGHUP: both back to their default action, as a
    terminal's foreground job has them, however this suite was started. Under ``nohup`` SIGHUP, and in a
    non-interactive shell's background job (``cmd &``: how a CI script may start it) SIGINT, arrive ignored, exec
    keeps SIG_IGN, and a command that keeps an ignored signal ignored (webapp/cli/supervise.py, as Unix
    programs do) then never stops: seen twice, SIGINT tests waiting out their timeouts."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


class Server(Gunicorn):
    """A gunicorn process started from the repo's own gunicorn.conf.py with ``CLASSIFIER_*`` settings.

    ``args`` go on gunicorn's command line before ``app``; ``env`` adds environment variables;
    ``settings`` become ``CLASSIFIER_<NAME>`` (this process's own ``CLASSIFIER_*`` are dropped);
    ``session``: in a process group of its own (``os.killpg(server.proc.pid, SIGINT)`` is a Ctrl-C).
    """

    def __init__(self, log_path: Path, *, args=(), app: str = "wsgi:app", env: dict | None = None,
                 session: bool = False, **settings):
        argv, full_env, port = ours_command(settings=settings, env=env, args=args, app=app, control_socket=True)
        super().__init__("gunicorn", argv, env=full_env, port=port, log_path=log_path, session=session)

    def wait_ready(self, workers: int) -> dict[int, dict]:
        """Poll /healthz until ``workers`` distinct worker pids report ready; return their health by pid."""
        try:
            return super().wait_ready(workers, timeout=READY_TIMEOUT_S, poll=0.2)
        except NotReady as exc:
            pytest.fail(str(exc))

    def stop_cleanly(self) -> str:
        """Stop (SIGTERM) and assert it exited 0 with no traceback in its log; return the log."""
        code = self.stop()
        out = self.output()
        assert code == 0, f"gunicorn exited with {code}:\n{out[-3000:]}"
        assert "Traceback" not in out, out[-5000:]
        return out
