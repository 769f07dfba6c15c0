"""``auto``'s precision decided once per host and CPU, and kept: the record in the cache folder
(``precision-<key>.json``), read by every worker of every later start, and the lock that makes the workers of one
server starting together wait for one measurement. Under gunicorn a provisional verdict (its figures say
``provisional``: faithful answers, but native bf16 measured slow, most often a loaded core) holds for the server
start that measured it (``this_start``: its own file), so a start made beside a neighbour's compile does not keep a
host on fp32 for good; ``SLOW_STARTS_FOR_HOST`` such starts in a row, or one outside gunicorn (``warm``, the CLI,
Ray), record it for the host. Torch-free: the key and the measurement are ``webapp.startup``'s.
"""

from __future__ import annotations

import contextlib
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


# A provisional verdict seen at this many server starts in a row (the same host, CPU and key) is the CPU's, not a
# neighbour's: it is then recorded for the host, and later starts no longer spend the 2-4 s of measuring it.
SLOW_STARTS_FOR_HOST = 3


def this_start() -> str | None:
    """The server start this process belongs to, as ``"<boot>-<namespace>-<pid>-<start time>"``, or None outside
    gunicorn (``python -m webapp warm``, the CLI, a Ray replica: no server start to hold a decision, so a
    provisional one is recorded for the host there). Under gunicorn it is the master's: every worker of one server
    shares it (replacements and a SIGHUP reload's new workers too). ``boot`` and ``namespace`` (``_namespace``) name
    the machine's boot and the pid namespace: two containers sharing a cache volume each run their master as pid 1.
    The start time (clock ticks after boot, field 22 of ``/proc/PID/stat``; 0 where it cannot be read) tells a
    reused pid from the first."""
    from .settings import GUNICORN_ENV

    if not os.environ.get(GUNICORN_ENV):
        return None
    pid = os.getppid()
    return f"{_namespace()}-{pid}-{_started(pid) or 0}"


def _namespace() -> str:
    """``<boot>-<pid namespace>``, 8 hex digits each (of ``/proc/sys/kernel/random/boot_id`` and
    ``/proc/self/ns/pid``; "0" * 8 where unreadable): processes whose pids can be compared share both, and every
    process of another boot has ended (a container run with ``--rm`` gets a new namespace each time: its earlier
    starts' files are judged ended at the next boot, not before)."""
    parts = []
    for path, read in (("/proc/sys/kernel/random/boot_id", lambda p: Path(p).read_text().strip()),
                       ("/proc/self/ns/pid", os.readlink)):
        try:
            parts.append(hashlib.sha256(read(path).encode()).hexdigest()[:8])
        except OSError:
            parts.append("0" * 8)
    return "-".join(parts)


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


def _starts(path: Path) -> list[Path]:
    """The provisional records of the record at ``path``, of every start, newest first (by modification time)."""
    found = []
    for p in path.parent.glob(f"{path.stem}.start-*.json"):
        with contextlib.suppress(OSError):  # (removed meanwhile)
            found.append((p.stat().st_mtime, p))
    return [p for _, p in sorted(found, reverse=True)]


def _origin(name: str, stem: str) -> tuple[str, str, str, str] | None:
    """``(boot, namespace, pid, ticks)`` from the provisional record named ``name`` of the record ``stem``; None for
    the first rules' name (``<boot and namespace>-<pid>-<ticks>``, three parts)."""
    parts = name[len(f"{stem}.start-"):-len(".json")].split("-")
    return tuple(parts) if len(parts) == 4 else None


def _ended(origin: tuple[str, str, str, str] | None, here: str) -> bool:
    """Whether the start ``origin`` (``_origin``'s) has ended, judged from the process whose ``_namespace()`` is
    ``here``: made in another boot of this machine (or under the first rules, which named boot and namespace as
    one), or in this boot and pid namespace by a master now gone or its pid now another process's. Another
    namespace's starts in this boot cannot be judged from here (a container beside this one may still run): not
    ended. A start whose start time could not be read when it was made (ticks "0") is judged by its pid alone."""
    if origin is None:
        return True
    boot, ns, pid, started = origin
    here_boot, here_ns = here.split("-")
    if boot != here_boot:
        return True
    if ns != here_ns or not pid.isdigit() or int(pid) <= 0:
        return False
    if started != "0":
        return _started(int(pid)) != started
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it runs, as another user's process
        pass
    return False


def _here(origin: tuple[str, str, str, str] | None, here: str) -> bool:
    """Whether the start ``origin`` was made in this boot and pid namespace, ``here`` (its start judgeable)."""
    return origin is not None and f"{origin[0]}-{origin[1]}" == here


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
    came to serve in different precisions). Under gunicorn a provisional decision (figures with
    ``provisional``) is recorded for this start only (``provisional_path(path, this_start())``): its workers,
    replacements and a reload's included, read it; the next start, finding no host record, measures again (the
    count of slow starts is carried from every start's file, a container's beside this one included, and
    ``SLOW_STARTS_FOR_HOST`` in a row make it the host's; the files of ended starts go, ``_ended``: a container
    run with ``--rm`` has a new pid namespace each time, so its earlier starts' files go at the next boot, while
    their count still reaches the host record). Every worker, the one that measured included, reports
    the record's reason, with its file name (the log has its path) and when it was measured: the same words
    in every ``/healthz``. Delete the file to measure again. Where the lock cannot be made (a read-only
    cache: a warm cache shipped so), the record is read without it (it is only ever renamed in whole).
    Where there is no record to read and none can be written, or the lock is held past
    ``RECORD_LOCK_TIMEOUT_S``, this process decides alone and says so. Raises what ``decide()`` raises.
    """
    from filelock import FileLock, Timeout

    main = precision_record_path(cache, key)
    start = this_start()
    this = provisional_path(main, start) if start else None
    path = main

    def alone(why: object) -> tuple[str, str]:
        log.warning("precision record %s unusable (%s): decided for this process only", path, why)
        return precision, f"{reason} (decided by this process only: the record {path.name} was unusable)"

    def read(*, any_start: bool = False) -> tuple[Path, dict | None]:
        # This start's own provisional decision first; a read-only cache (shipped warm) takes any start's
        # rather than have each worker decide alone.
        others = _starts(main) if any_start else []
        for candidate in [p for p in (this, main) if p] + others:
            if (record := _read_record(candidate, key)) is not None:
                return candidate, record
        return main, None

    lock = FileLock(f"{main}.lock", timeout=RECORD_LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except (OSError, Timeout) as exc:
        path, record = read(any_start=True) if isinstance(exc, OSError) else (main, None)  # read-only: renamed in whole
        if record is None:
            precision, reason = decide()[:2]
            return alone(exc)
        log.info("precision from the record %s (read without its lock: %s): %s", path, exc, record["precision"])
    else:
        try:
            path, record = read()
            starts = [p for p in _starts(main) if p != this]
            here = _namespace()
            origins = {p: _origin(p.name, main.stem) for p in starts}
            ended = [p for p in starts if _ended(origins[p], here)]
            if record is None:
                decided = decide()  # its errors are the start-up's, not the record's
                precision, reason = decided[:2]
                figures = decided[2] if len(decided) > 2 else None
                # In a row: any start's count (a container's beside this one, or ended), none broken since by a
                # host record (which would have been read above).
                slow_starts = 1 + max((_slow_starts(p, key) for p in starts), default=0)
                beside = [p for p in starts if p not in ended and _here(origins[p], here)]
                if this is None and (figures or {}).get("provisional") and beside:
                    # The CLI or ``warm`` run beside a live server of this machine: its load is the likeliest
                    # cause of slow bf16; recorded for the host, it would keep every later start on fp32.
                    log.info("precision decided for this process only: a server runs beside it (%s)", beside[0])
                    return precision, (f"{reason} (decided for this process only: a server start beside it, "
                                       f"{beside[0].name}, loads the cores, so slow bf16 is not recorded for the host)")
                provisional = bool((figures or {}).get("provisional")) and this is not None and \
                    slow_starts < SLOW_STARTS_FOR_HOST
                path = this if provisional else main
                record = {"key": key, "precision": precision, "reason": reason, "measured_by_pid": os.getpid(),
                          "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "figures": figures,
                          "start": start if provisional else None,
                          "slow_starts": slow_starts if (figures or {}).get("provisional") and start else None}
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                try:
                    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
                    os.replace(tmp, path)  # atomic: a reader sees the old record or the new one, never half
                except OSError as exc:
                    return alone(exc)
                log.info("precision for this %s decided and recorded in %s: %s (%s)",
                         "server start" if provisional else "host and CPU", path, precision, reason)
                if not provisional and (figures or {}).get("provisional"):  # the host's fp32 now: every start's
                    ended = starts  # fp32 file goes (their count is in it; a live start's workers read the same)
            else:
                log.info("precision from the record %s (measured %s by pid %s): %s", path, record["measured_at"],
                         record["measured_by_pid"], record["precision"])
            for old in ended:
                with contextlib.suppress(OSError):  # (another worker's start-up removed it first)
                    old.unlink()
        finally:
            lock.release()
    # The file's name, not its path: this goes to every client (/healthz, answers); the log above has the path.
    measured = f"{path.name} in CLASSIFIER_CACHE_DIR, measured {record['measured_at']}"
    if path not in (this, main):  # another start's decision, read from a read-only cache
        where = (f"read from the read-only cache: {measured} by the server start that warmed it (a read-only cache "
                 "is never measured again)")
    elif record.get("start") is not None:
        where = (f"decided for this server start only: slow native bf16 is most often a loaded core, so the next "
                 f"start (not a reload) measures again; {measured}")
    elif (record.get("figures") or {}).get("provisional"):
        slow = record.get("slow_starts")
        where = (f"decided once for this host and CPU: {measured}; bf16 measured slow"
                 + (f" at {slow} server starts in a row" if isinstance(slow, int) and slow > 1 else "")
                 + ": if the host was busy then, delete the file to measure again")
    else:
        where = f"decided once for this host and CPU: {measured}"
    return record["precision"], f"{record['reason']} ({where})"


def _slow_starts(path: Path, key: dict) -> int:
    """How many starts in a row had measured bf16 slow, as the provisional record at ``path`` says (0: none)."""
    record = _read_record(path, key)
    count = (record or {}).get("slow_starts")
    return count if isinstance(count, int) and count > 0 else 0
