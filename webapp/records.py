"""``auto``'s precision decided once per host and CPU, and kept: the record in the cache folder
(``precision-<key>.json``), read by every worker of every later start, and the lock that makes the workers of one
server starting together wait for one measurement. A provisional verdict (its figures say ``provisional``:
native bf16 measured slow, most often a loaded core) holds for the server start that measured it
(``this_start``: its own file), so a start made beside a neighbour's compile does not keep a host on fp32 for good.
Torch-free: the key and the measurement are ``webapp.startup``'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("webapp.startup")  # its lines are start-up's

# A worker waits this long (s) for another one's measurement (about a second) before measuring alone.
RECORD_LOCK_TIMEOUT_S = 120.0


def precision_record_path(cache: Path, key: dict) -> Path:
    """``<cache>/precision-<16 hex of the key>.json``: one file per key, so switching models keeps each one's."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache / f"precision-{digest}.json"


def this_start() -> str:
    """Which server start this process belongs to, as ``"<pid>-<start time>"``: under gunicorn its master's
    (every worker of one server shares it: replacements and a SIGHUP reload's new workers too), elsewhere its
    own (``python -m webapp warm``, the CLI, a Ray replica). The start time (clock ticks after boot, field 22
    of ``/proc/PID/stat``) tells a reused pid from the first; where it cannot be read, the pid alone."""
    from .settings import GUNICORN_ENV

    pid = os.getppid() if os.environ.get(GUNICORN_ENV) else os.getpid()
    started = _started(pid)
    return f"{pid}-{started}" if started else str(pid)


def _started(pid: int) -> str:
    """Process ``pid``'s start time in clock ticks after boot (``/proc/PID/stat`` field 22); "" if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()  # after "pid (comm)": field 3 is index 0
    except (OSError, IndexError, UnicodeDecodeError):
        return ""


def provisional_path(path: Path, start: str) -> Path:
    """Where a provisional decision for the record at ``path`` lives: one file per server start."""
    return path.with_name(f"{path.stem}.start-{start}.json")


def _remove_ended_starts(path: Path) -> None:
    """Remove the provisional records of the record at ``path`` whose start has ended (its process gone, or
    its pid now another process's); a live start's stays, so its replacement workers read what it chose."""
    for old in path.parent.glob(f"{path.stem}.start-*.json"):
        pid, _, started = old.name[len(path.stem) + len(".start-"):-len(".json")].partition("-")
        if pid.isdigit() and _ended(int(pid), started):
            try:
                old.unlink()
            except OSError:
                pass


def _ended(pid: int, started: str) -> bool:
    """Whether the start ``pid`` (begun at ``started`` ticks, "" if unknown) is over."""
    if started:
        return _started(pid) != started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # there, but not ours to signal
        return False
    return False


def _read_record(path: Path, key: dict) -> dict | None:
    """The record at ``path`` if it is whole and made for ``key``; else None (a damaged one is logged)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring the precision record %s (%s): measuring again", path, exc)
        return None
    ok = (isinstance(record, dict) and record.get("key") == key and record.get("precision") in ("bf16", "fp32")
          and isinstance(record.get("reason"), str) and isinstance(record.get("measured_at"), str))
    return record if ok else None


def recorded_precision(cache: Path, key: dict, decide: Callable[[], tuple]) -> tuple[str, str]:
    """``auto``'s decision made once per host and CPU: read from the record in ``cache``, or made by
    ``decide()`` (``(precision, reason)`` or ``(precision, reason, figures)``, figures a JSON-able dict
    such as ``bf16.judge_bf16``'s) and recorded there with its figures (JSON, written to a temporary
    name and renamed) for every later worker.

    Under a file lock, so the workers of one server starting together wait for the first one's
    measurement instead of each measuring while the others load the CPU (which is how two workers
    came to serve in different precisions). A provisional decision (figures with ``provisional``) is
    recorded for this start only (``provisional_path(path, this_start())``): its workers, replacements
    included, read it; the next start, finding no record, measures again (and the ended starts' files go).
    Every worker, the one that measured included, reports
    the record's reason, with its file name (the log has its path) and when it was measured: the same words
    in every ``/healthz``. Delete the file to measure again. Where the lock cannot be made (a read-only
    cache: a warm cache shipped so), the record is read without it (it is only ever renamed in whole).
    Where there is no record to read and none can be written, or the lock is held past
    ``RECORD_LOCK_TIMEOUT_S``, this process decides alone and says so. Raises what ``decide()`` raises.
    """
    from filelock import FileLock, Timeout

    main = precision_record_path(cache, key)
    this = provisional_path(main, this_start())
    path = main

    def alone(why: object) -> tuple[str, str]:
        log.warning("precision record %s unusable (%s): decided for this process only", path, why)
        return precision, f"{reason} (decided by this process only: the record {path.name} was unusable)"

    def read() -> tuple[Path, dict | None]:  # this start's own provisional decision first
        for candidate in (this, main):
            if (record := _read_record(candidate, key)) is not None:
                return candidate, record
        return main, None

    lock = FileLock(f"{main}.lock", timeout=RECORD_LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except (OSError, Timeout) as exc:
        path, record = read() if isinstance(exc, OSError) else (main, None)  # a read-only cache's: whole (renamed in)
        if record is None:
            precision, reason = decide()[:2]
            return alone(exc)
        log.info("precision from the record %s (read without its lock: %s): %s", path, exc, record["precision"])
    else:
        try:
            path, record = read()
            if record is None:
                decided = decide()  # its errors are the start-up's, not the record's
                precision, reason = decided[:2]
                figures = decided[2] if len(decided) > 2 else None
                provisional = bool((figures or {}).get("provisional"))
                path = this if provisional else main
                record = {"key": key, "precision": precision, "reason": reason, "measured_by_pid": os.getpid(),
                          "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "figures": figures,
                          "start": this_start() if provisional else None}
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                try:
                    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
                    os.replace(tmp, path)  # atomic: a reader sees the old record or the new one, never half
                except OSError as exc:
                    return alone(exc)
                _remove_ended_starts(main)
                log.info("precision for this %s decided and recorded in %s: %s (%s)",
                         "server start" if provisional else "host and CPU", path, precision, reason)
            else:
                log.info("precision from the record %s (measured %s by pid %s): %s", path, record["measured_at"],
                         record["measured_by_pid"], record["precision"])
        finally:
            lock.release()
    # The file's name, not its path: this goes to every client (/healthz, answers); the log above has the path.
    once = "for this server start" if record.get("start") is not None else "once for this host and CPU"
    where = f"decided {once}: {path.name} in CLASSIFIER_CACHE_DIR, measured {record['measured_at']}"
    return record["precision"], f"{record['reason']} ({where})"
