"""How ``classify`` prints its results on stdout: a table, JSON or CSV."""

from __future__ import annotations

import csv
import io
import json
import sys

from .common import err, file_name, printable, silence_stdout, unicode_text

_unicode, _printable = unicode_text, printable  # (the names this module has used)


def _cell(text: str) -> str:
    """A CSV cell a spreadsheet shows as text: one starting with ``= + - @``, a tab or CR (a file named
    ``=cmd().jpg``) gets a leading ``'``, OWASP's guard against formula injection (tryout24)."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _error_text(error: dict) -> str:
    return f"error: {error['message']} ({error['code']})"


class ResultStream:
    """Writes results to ``out`` (standard output where None) in the files' order as soon as each one and every one
    before it is done, as ``fmt``: ``"table"``, ``"json"`` or ``"csv"``; flushed as it goes.

    A run over a big folder printed nothing until its last file: a crash or Ctrl-C near the end lost every row
    (tryout17). ``paths``: every file's shown path, in order (the table's column width comes from them, as when
    printed at the end); ``topk`` only heads the table's column. Each result is ``{"path", "predictions",
    "error", ...}`` (``error``: None or ``{"code", "message"}``; other keys go to JSON as they are). ``close``
    ends the JSON list, so an interrupted run's output is still valid JSON, of the files before the first one
    not done. While ``bar`` (tqdm, on stderr) is drawn and the rows go to a terminal too, they are written in its
    external write mode, so that the bar is redrawn below them.

    Write errors: a closed pipe (``| head``) propagates, the reader left and ``main`` says nothing; any other
    (``> /dev/full``, a quota, an I/O error) is said in one line on stderr, standard output is silenced, and
    ``put`` and ``close`` return False from then on (the caller stops and exits 1; it was a traceback).
    """

    def __init__(self, fmt: str, topk: int, paths: list[str], out=None, bar=None):
        self.fmt, self.topk, self.out, self.bar = fmt, topk, out, bar
        self.held: dict[int, dict] = {}
        self.next = 0
        self.ok = True
        self.width = min(max([len("path"), *(len(_printable(file_name(p))) for p in paths)]), 60)
        self._write(self._header())

    def _stream(self):
        return self.out if self.out is not None else sys.stdout

    def _header(self) -> str:
        if self.fmt == "json":
            return "["
        if self.fmt == "csv":
            return "path,rank,label,index,probability,error\n"
        return f"{'path':<{self.width}}  top-{self.topk}\n"

    def _row(self, r: dict) -> str:
        if self.fmt == "json":
            # A file name that is not UTF-8 (bytes Python keeps as lone surrogates, "\udce9") would be JSON that
            # strict readers (serde_json, Go's decoder) refuse or mangle: its bytes are written \xe9 instead.
            # Each element as json.dump(list, indent=1) writes it: one more space before every line.
            text = json.dumps({**r, "path": _unicode(file_name(r["path"]))}, indent=1).replace("\n", "\n ")
            return ("\n " if self.next == 0 else ",\n ") + text
        if self.fmt == "csv":
            buf = io.StringIO()
            path = _cell(_unicode(file_name(r["path"])))  # not UTF-8: \xNN, as in JSON (UTF-8 CSV readers refused it)
            error = _cell(f"{r['error']['message']} ({r['error']['code']})") if r["error"] else ""
            # Lines end in "\n", so the csv module quotes a field with "\n" but not one with "\r", which readers
            # (csv, pandas) take for a line end: a file named "cr\rret.jpg" split its row in two (tryout25).
            writer = csv.writer(buf, lineterminator="\n", quoting=csv.QUOTE_ALL if "\r" in path + error else
                                csv.QUOTE_MINIMAL)
            if r["error"]:
                writer.writerow([path, "", "", "", "", error])
            for rank, p in enumerate(r["predictions"], 1):
                writer.writerow([path, rank, p["label"], p["index"], f"{p['probability']:.6f}", ""])
            return buf.getvalue()
        text = _error_text(r["error"]) if r["error"] else "  ".join(
            f"{p['label']} {100 * p['probability']:.1f}%" for p in r["predictions"])
        return f"{_printable(file_name(r['path'])):<{self.width}}  {text}\n"

    def _write(self, text: str) -> None:
        if not self.ok or not text:
            return
        try:
            if self.bar is not None and not self.bar.disable and self._stream().isatty():  # a file needs no redraw
                with self.bar.external_write_mode(file=self._stream()):
                    self._stream().write(text)
                    self._stream().flush()
            else:
                self._stream().write(text)
                self._stream().flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            self.ok = False
            err(f"error: cannot write the results to standard output: {exc.strerror or exc}")
            if self.out is None:
                silence_stdout()

    def put(self, index: int, result: dict) -> bool:
        """File ``index``'s result is done: write it, and those after it that were waiting for it. False once the
        output cannot be written."""
        self.held[index] = result
        rows = []
        while self.next in self.held:
            rows.append(self._row(self.held.pop(self.next)))
            self.next += 1
        self._write("".join(rows))
        return self.ok

    def close(self) -> bool:
        """End the output (the JSON list's ``]``); the rows still held (a file before them not done: an
        interrupted run) are left out. False where the output could not be written."""
        self._write(("\n]\n" if self.next else "]\n") if self.fmt == "json" else "")
        return self.ok


def public(result: dict) -> dict:
    """A result without the keys a run keeps for itself (``_path``, the file to read)."""
    return {k: v for k, v in result.items() if not k.startswith("_")}
