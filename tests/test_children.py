"""webapp/children.py: a bounded helper command ends with its whole process tree and leaves no temporary files.

The tree here is a shell with background jobs and a grandchild, standing in for ``python -m webapp warm`` and the
g++ -> cc1plus -> as processes it starts (a CI run found a compiler's ``cc*.s`` left after a start stopped at
``CLASSIFIER_STARTUP_TIMEOUT_S``: ``subprocess.run``'s timeout killed only the child).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from webapp import children


def ended(pid: int) -> bool:
    """Gone, or a zombie (ended; an orphan's new parent, maybe a container's PID 1, may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:].startswith("Z")


def pids_in(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()]


def test_a_finished_command_gives_its_output_and_status_and_its_tmpdir_is_removed(tmp_path):
    done = children.run_bounded(["sh", "-c", 'echo "$TMPDIR"; touch "$TMPDIR/left"; echo oops >&2; exit 3'],
                                env=dict(os.environ, TMPDIR=str(tmp_path)), timeout_s=30)
    temp = Path(done.stdout.strip())
    assert (done.returncode, done.stderr) == (3, "oops\n")
    assert temp.parent == tmp_path and temp.name.startswith("classifier-child-"), temp  # its own, under the caller's
    assert not temp.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("term", ["ended by SIGTERM", "SIGTERM ignored"])
def test_past_its_time_the_whole_tree_ends_and_its_files_go(tmp_path, term):
    """Children, a grandchild and a job that ignores SIGTERM (killed after the grace) all end before
    ``TimeoutExpired`` reaches the caller; a file a killed process could not delete is removed with its TMPDIR."""
    trap = 'trap "" TERM; ' if term == "SIGTERM ignored" else ""
    script = (f'{trap}echo $$ > "{tmp_path}/pids"; touch "$TMPDIR/cc1.s"; '
              f'sleep 300 & echo $! >> "{tmp_path}/pids"; '
              f'sh -c \'{trap}sleep 300 & echo $! >> "{tmp_path}/pids"; wait\' & echo $! >> "{tmp_path}/pids"; '
              'wait')
    work = tmp_path / "work"
    work.mkdir()
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        children.run_bounded(["sh", "-c", script], env=dict(os.environ, TMPDIR=str(work)), timeout_s=1.5)
    took = time.monotonic() - t0
    pids = pids_in(tmp_path / "pids")
    assert len(pids) == 4, pids  # the shell, its sleep, the inner shell, its sleep
    assert all(ended(pid) for pid in pids), [(pid, ended(pid)) for pid in pids]
    assert os.listdir(work) == []
    assert took < 1.5 + children.GRACE_S + 2, took
    if term == "ended by SIGTERM":
        assert took < 1.5 + 1.5, took  # no need to wait out the grace


def test_a_tree_that_keeps_forking_is_still_stopped(tmp_path):
    """A process that starts another every few ms while it is being counted: freezing round by round catches it."""
    script = f'echo $$ > "{tmp_path}/pids"; while :; do sleep 300 & echo $! >> "{tmp_path}/pids"; sleep 0.005; done'
    with pytest.raises(subprocess.TimeoutExpired):
        children.run_bounded(["sh", "-c", script], env=dict(os.environ), timeout_s=1)
    time.sleep(0.2)  # a fork under way when the shell was frozen would show here
    pids = pids_in(tmp_path / "pids")
    assert len(pids) > 5 and all(ended(pid) for pid in pids), [p for p in pids if not ended(p)]


def test_descendants_lists_children_and_grandchildren_only():
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sh -c 'sleep 30 & wait' & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(found := children.descendants(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(found) == 3 and proc.pid not in found and os.getpid() not in found, found
    finally:
        children.stop_tree(proc)
    assert proc.returncode is not None and all(ended(pid) for pid in found)


def test_a_python_child_stopped_in_its_time_leaves_no_process(tmp_path):
    """The shape the worker uses: a Python child that starts a compiler-like grandchild."""
    code = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '300']); "
            f"open({str(tmp_path / 'pids')!r}, 'w').write(f'{{p.pid}}'); time.sleep(300)")
    with pytest.raises(subprocess.TimeoutExpired):
        children.run_bounded([sys.executable, "-c", code], env=dict(os.environ), timeout_s=2)
    assert all(ended(pid) for pid in pids_in(tmp_path / "pids"))


def test_stop_all_ends_every_process_below_this_one_and_removes_the_folders(tmp_path):
    """What a worker stopped while it starts does before ``os._exit``: a ``run_bounded`` child under way (its
    folder too) and a child it never registered (as one still between fork and exec) both end."""
    work = tmp_path / "work"
    work.mkdir()
    code = f"""
import os, subprocess, threading, time
from webapp import children
plain = subprocess.Popen(["sh", "-c", "sleep 300 & echo $! >> {tmp_path}/pids; wait"])
env = dict(os.environ, TMPDIR={str(work)!r})
threading.Thread(target=children.run_bounded, daemon=True, kwargs=dict(
    cmd=["sh", "-c", 'echo $$ >> {tmp_path}/pids; touch "$TMPDIR/cc1.s"; sleep 300'], env=env, timeout_s=300)).start()
while len(open("{tmp_path}/pids").read().split()) < 2 or not any(os.scandir({str(work)!r})):
    time.sleep(0.02)
with open("{tmp_path}/pids", "a") as f:
    f.write(f" {{plain.pid}}")
children.stop_all()
os._exit(0)
"""
    (tmp_path / "pids").write_text("")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], timeout=60, check=True)
    pids = pids_in(tmp_path / "pids")
    assert len(pids) == 3 and all(ended(pid) for pid in pids), pids
    assert os.listdir(work) == []


def test_a_bounded_child_whose_parent_is_sigkilled_ends_its_tree_and_removes_its_folder(tmp_path):
    """A parent SIGKILLed (the OOM killer, gunicorn's timeout kill of a worker) runs no cleanup: its compile child,
    reparented, compiled on for ~50 s and left its files. A child that called ``bounded_child`` (as ``python -m
    webapp warm`` does) gets SIGTERM from the kernel when its parent dies, and ends its compiler-like grandchild
    and removes its TMPDIR."""
    work = tmp_path / "work"
    work.mkdir()
    child = ("import os, subprocess, time; from webapp import children; assert children.bounded_child(); "
             "p = subprocess.Popen(['sleep', '300']); open(os.environ['TMPDIR'] + '/cc1.s', 'w').close(); "
             f"open({str(tmp_path / 'pids')!r}, 'a').write(f' {{os.getpid()}} {{p.pid}}'); time.sleep(300)")
    parent = (f"import os, sys; from webapp import children; open({str(tmp_path / 'pids')!r}, 'w').write(str(os.getpid())); "
              f"children.run_bounded([sys.executable, '-c', {child!r}], env=dict(os.environ, TMPDIR={str(work)!r}), "
              "timeout_s=300)")
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 30
        while len(pids_in(tmp_path / "pids") if (tmp_path / "pids").exists() else []) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, "the child never started"
            time.sleep(0.05)
        assert len(os.listdir(work)) == 1  # the child's own folder, with its cc1.s
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + children.GRACE_S + 5
        while not all(ended(pid) for pid in pids_in(tmp_path / "pids")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(ended(pid) for pid in pids_in(tmp_path / "pids")), pids_in(tmp_path / "pids")
        assert os.listdir(work) == []
    finally:
        proc.kill()
        for pid in pids_in(tmp_path / "pids") if (tmp_path / "pids").exists() else []:
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def test_a_parent_already_gone_is_signalled_at_once(tmp_path):
    """``signal_on_parent_death`` after the parent died (between the fork and the call): no death signal would come,
    so it sends the signal itself; with the parent alive, none is sent."""
    code = ("import os, signal, sys; from webapp import children; got = []; "
            "signal.signal(signal.SIGUSR1, lambda *a: got.append(1)); "
            "assert children.signal_on_parent_death(os.getppid(), signal.SIGUSR1); assert not got; "
            "assert children.signal_on_parent_death(os.getppid() + 10**7, signal.SIGUSR1); assert got == [1]; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
