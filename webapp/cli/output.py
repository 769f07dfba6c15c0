"""How ``classify`` prints its results on stdout: a table, JSON or CSV."""

from __future__ import annotations

import csv
import json
import os
import sys

from .common import silence_stdout


def _unicode(path: str) -> str:
    """``path`` as valid Unicode: bytes that are not UTF-8 (kept by Python as surrogates) written ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _printable(path: str) -> str:
    """``_unicode(path)`` with control characters (a newline in a file name) escaped, so a row stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in _unicode(path))


def _error_text(error: dict) -> str:
    return f"error: {error['message']} ({error['code']})"


def write_results(results: list[dict], fmt: str, topk: int, out) -> None:
    """Write ``results`` to the text stream ``out`` as ``fmt``: ``"table"``, ``"json"`` or ``"csv"``.

    Each result is ``{"path", "predictions", "error", ...}`` (``error``: None or ``{"code",
    "message"}``); ``topk`` only heads the table's column. Returns nothing; write errors (a closed
    pipe) propagate.
    """
    if fmt == "json":
        # A file name that is not UTF-8 (bytes Python keeps as lone surrogates, "\udce9") would be JSON that
        # strict readers (serde_json, Go's decoder) refuse or mangle: its bytes are written \xe9 instead.
        json.dump([{**r, "path": _unicode(r["path"])} for r in results], out, indent=1)
        out.write("\n")
    elif fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["path", "rank", "label", "index", "probability", "error"])
        for r in results:  # a name that is not UTF-8: \xNN, as in JSON (a UTF-8 CSV reader refused the raw bytes)
            path = _unicode(r["path"])
            if r["error"]:
                writer.writerow([path, "", "", "", "", f"{r['error']['message']} ({r['error']['code']})"])
            for rank, p in enumerate(r["predictions"], 1):
                writer.writerow([path, rank, p["label"], p["index"], f"{p['probability']:.6f}", ""])
    else:
        results = [{**r, "path": _printable(r["path"])} for r in results]
        width = min(max([len("path"), *(len(r["path"]) for r in results)]), 60)
        out.write(f"{'path':<{width}}  top-{topk}\n")
        for r in results:
            text = _error_text(r["error"]) if r["error"] else "  ".join(
                f"{p['label']} {100 * p['probability']:.1f}%" for p in r["predictions"])
            out.write(f"{r['path']:<{width}}  {text}\n")


def print_results(results: list[dict], fmt: str, topk: int) -> bool:
    """``write_results`` to standard output, flushed; False (said in one line on stderr) where the output cannot be
    written: a full disk (``> /dev/full``), a quota, an I/O error. It was a traceback and exit 1, as if files had
    failed (tryout17). A closed pipe (``| head``) still propagates: the reader left, and ``main`` says nothing."""
    try:
        write_results(results, fmt, topk, sys.stdout)
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        raise
    except OSError as exc:
        print(f"error: cannot write the results to standard output: {exc.strerror or exc}", file=sys.stderr)
        silence_stdout()
        return False
