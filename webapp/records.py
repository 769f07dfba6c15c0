"""``auto``'s precision decided once per host and CPU, and kept: the record in the cache folder
(``precision-<key>.json``), read by every worker of every later start, and the lock that makes the workers of one
server starting together wait for one measurement. Torch-free: the key and the measurement are
``webapp.startup``'s.
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
    came to serve in different precisions). Every worker, the one that measured included, reports
    the record's reason, with its file name (the log has its path) and when it was measured: the same words
    in every ``/healthz``. Delete the file to measure again. Where the lock cannot be made (a read-only
    cache: a warm cache shipped so), the record is read without it (it is only ever renamed in whole).
    Where there is no record to read and none can be written, or the lock is held past
    ``RECORD_LOCK_TIMEOUT_S``, this process decides alone and says so. Raises what ``decide()`` raises.
    """
    from filelock import FileLock, Timeout

    path = precision_record_path(cache, key)

    def alone(why: object) -> tuple[str, str]:
        log.warning("precision record %s unusable (%s): decided for this process only", path, why)
        return precision, f"{reason} (decided by this process only: the record {path.name} was unusable)"

    lock = FileLock(f"{path}.lock", timeout=RECORD_LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except (OSError, Timeout) as exc:
        record = _read_record(path, key) if isinstance(exc, OSError) else None  # a read-only cache's: whole (renamed in)
        if record is None:
            precision, reason = decide()[:2]
            return alone(exc)
        log.info("precision from the record %s (read without its lock: %s): %s", path, exc, record["precision"])
    else:
        try:
            record = _read_record(path, key)
            if record is None:
                decided = decide()  # its errors are the start-up's, not the record's
                precision, reason = decided[:2]
                record = {"key": key, "precision": precision, "reason": reason, "measured_by_pid": os.getpid(),
                          "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "figures": decided[2] if len(decided) > 2 else None}
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                try:
                    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
                    os.replace(tmp, path)  # atomic: a reader sees the old record or the new one, never half
                except OSError as exc:
                    return alone(exc)
                log.info("precision for this host and CPU decided and recorded in %s: %s (%s)", path, precision,
                         reason)
            else:
                log.info("precision from the record %s (measured %s by pid %s): %s", path, record["measured_at"],
                         record["measured_by_pid"], record["precision"])
        finally:
            lock.release()
    # The file's name, not its path: this goes to every client (/healthz, answers); the log above has the path.
    where = f"decided once for this host and CPU: {path.name} in CLASSIFIER_CACHE_DIR, measured {record['measured_at']}"
    return record["precision"], f"{record['reason']} ({where})"
