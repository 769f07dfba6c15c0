"""Bulk classification with Ray Data: ``classify --cluster SRC... --out DEST.parquet``.

``read_binary_files`` -> ``map_batches(BulkClassifier)`` on an actor pool of ``CLUSTER_ACTORS`` ->
one Parquet file written as rows arrive. A file that cannot be decoded is an error row with the
code and message the API would answer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Iterator, TextIO

import ray

from .. import imaging, startup
from ..batcher import checked_predict
from ..concurrency import decode_executor
from ..errors import InferenceFailed, ServiceError, check_file_size
from ..models import encode
from .config import load_values, startup_failure
from .deploy import connect

log = logging.getLogger(__name__)


def parquet_schema():
    """The rows of ``classify --cluster``: one per file, errors included (Arrow schema)."""
    import pyarrow as pa

    return pa.schema([
        ("path", pa.string()), ("model", pa.string()),
        ("width", pa.int32()), ("height", pa.int32()), ("format", pa.string()),
        ("labels", pa.list_(pa.string())), ("indices", pa.list_(pa.int32())),
        ("probabilities", pa.list_(pa.float64())),
        ("error_code", pa.string()), ("error", pa.string()),
    ])


class BulkClassifier:
    """Ray Data ``map_batches`` callable class: one per actor, each with the engine loaded once.

    Input batch: ``{"path": (N,) str, "bytes": (N,) object}`` (``read_binary_files``); output: a
    ``parquet_schema()`` table of N rows. Decoded images are predicted ``MAX_BATCH_SIZE`` at a
    time as ``(n, 3, S, S) float32``. A file that cannot be decoded, or is over
    ``MAX_UPLOAD_BYTES``, gets an error row with the code and message the API would answer.
    """

    def __init__(self, values: dict):
        self.settings = load_values(values)
        self.started = startup.load_engine(self.settings)
        self.started.engine.thread_init()  # batches run on the thread that calls this actor
        self.decode_pool = decode_executor(max(1, self.started.threads))

    def _prepare(self, path: str, data: bytes) -> imaging.Prepared:
        s, started = self.settings, self.started
        check_file_size(len(data), s.MAX_UPLOAD_BYTES)
        return imaging.prepare(data, name=Path(path).name, transform=started.transform, max_pixels=s.MAX_PIXELS,
                               min_side=started.min_side(s.FAST_DECODE))

    def __call__(self, batch: dict):
        import pyarrow as pa
        import torch

        s, model = self.settings, self.started.model
        paths = [str(p) for p in batch["path"]]
        futures = [self.decode_pool.submit(self._prepare, p, bytes(b)) for p, b in zip(paths, batch["bytes"])]
        rows = []
        for path, fut in zip(paths, futures):
            row = {"path": path, "model": model.name, "width": None, "height": None, "format": None,
                   "labels": [], "indices": [], "probabilities": [], "error_code": None, "error": None}
            try:
                p = fut.result()
                row.update(width=p.size[0], height=p.size[1], format=p.format, _tensor=p.tensor)
            except ServiceError as exc:
                row.update(error_code=exc.code, error=exc.message.removeprefix(f"{Path(path).name}: "))
            except Exception as exc:  # a bug: report it on this file, go on with the others
                log.exception("unexpected error on %s", path)
                row.update(error_code="internal_error", error=f"{type(exc).__name__}: {exc}")
            rows.append(row)
        ok = [r for r in rows if "_tensor" in r]
        for i in range(0, len(ok), s.MAX_BATCH_SIZE):
            chunk = ok[i:i + s.MAX_BATCH_SIZE]
            try:
                logits = checked_predict(self.started.engine.predict, torch.stack([r.pop("_tensor") for r in chunk]))
            except InferenceFailed as exc:
                for r in chunk:
                    r.update(error_code=exc.code, error=exc.message)
                continue
            for r, row_logits in zip(chunk, logits):
                top = encode(row_logits, model.categories, s.TOP_K)
                r.update(labels=[p["label"] for p in top], indices=[p["index"] for p in top],
                         probabilities=[p["probability"] for p in top])
        for r in rows:
            r.pop("_tensor", None)
        return pa.Table.from_pylist(rows, schema=parquet_schema())


@contextlib.contextmanager
def ray_output_in(path: Path) -> Iterator[TextIO]:
    """While inside, everything written to this process's stdout and stderr (file descriptors 1 and 2)
    goes to ``path``: Ray's driver log lines, its C++ core's, colour codes and all. Yields a stream to
    the real stderr, for our own progress bar and lines. Ray's workers keep their logs in Ray's own
    files (``connect(log_to_driver=False)``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    console = os.fdopen(os.dup(saved[2]), "w", buffering=1)
    with open(path, "ab") as sink:
        for fd in (1, 2):
            os.dup2(sink.fileno(), fd)
    try:
        yield console
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        console.close()


def classify_to_parquet(values: dict, sources: list[str], out: str, *, address: str | None = None,
                        extensions: list[str] | None = None, progress: bool = True,
                        shown: dict[str, str] | None = None, console: TextIO | None = None) -> dict:
    """Classify every file under ``sources`` with Ray Data and write one Parquet file at ``out``.

    ``sources``: files, folders (recursive; Ray Data skips names starting with ``.`` or ``_``
    directly under them) or anything ``ray.data.read_binary_files`` reads (``s3://``, ``gs://``,
    ``abfs://`` with pyarrow's credentials). ``extensions`` (no dot) keeps only those file names;
    None reads every file. ``out`` may be a local path or such a URI. ``shown`` maps a source as
    passed to the path its row names (the CLI's rule: as given, never resolved); ``console`` is where
    the progress bar goes (default stderr). Returns ``{"files", "failed", "seconds", "models"}``:
    ``models`` the names of the models that answered (the offline one where it stood in).

    :raises FileNotFoundError: a source does not exist, or holds no file to read.
    :raises StartupError: the actors cannot start the model (their message).
    """
    import pyarrow as pa
    import pyarrow.fs
    import pyarrow.parquet as pq
    from tqdm import tqdm

    connect(address, log_to_driver=False)  # the actors' log lines stay in Ray's log files
    s = load_values(values)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # ours below counts files written
    ctx.execution_options.preserve_order = True  # rows in the order of the files: reruns diff cleanly
    # Reading is I/O: its tasks reserve no CPU, so the model actors can have every core without
    # starving the read that feeds them (with 1 CPU each, reads and actors deadlock on a full node).
    try:
        ds = ray.data.read_binary_files(sources, include_paths=True, file_extensions=extensions, num_cpus=0)
    except (ValueError, OSError) as exc:  # nothing there, no such bucket, no credentials
        raise FileNotFoundError(f"cannot list {' '.join(sources[:3])}{' ...' if len(sources) > 3 else ''}: "
                                f"{exc}") from None
    total = len(ds.input_files()) or None
    ds = ds.map_batches(BulkClassifier, fn_constructor_args=(values,), batch_size=s.MAX_BATCH_SIZE,
                        batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=s.CLUSTER_ACTORS),
                        num_cpus=values["THREADS"])
    fs, where = pyarrow.fs.FileSystem.from_uri(out) if "://" in out else (None, str(Path(out).resolve()))
    if fs is None:
        Path(where).parent.mkdir(parents=True, exist_ok=True)
    start, files, failed, models = time.perf_counter(), 0, 0, set()
    bar = tqdm(total=total, unit="file", disable=not progress, desc="classify", mininterval=0.5, dynamic_ncols=True,
               file=console or sys.stderr)
    try:
        with pq.ParquetWriter(where, parquet_schema(), filesystem=fs) as writer:
            for table in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                table = table.cast(parquet_schema())
                if shown:
                    names = [shown.get(p, p) for p in table.column("path").to_pylist()]
                    table = table.set_column(0, "path", pa.array(names, pa.string()))
                models.update(table.column("model").to_pylist())
                writer.write_table(table)
                files += table.num_rows
                failed += table.num_rows - table.column("error_code").null_count
                bar.set_postfix(failed=failed, refresh=False)
                bar.update(table.num_rows)
    except Exception as exc:  # an actor could not start its model: one line that says why
        raise startup_failure(str(exc)) or exc from None
    finally:
        bar.close()
    return {"files": files, "failed": failed, "seconds": time.perf_counter() - start, "models": sorted(models)}
