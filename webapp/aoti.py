"""AOTInductor packages: a model compiled ahead of time once, loaded by every later start in a blink.

``torch.compile`` compiles again in every new process: its caches save the C++ builds but not the
tracing, lowering and freezing, so a warm restart still took 18-19 s on 2 cores (measured here
under the AVX2 cap, fp32). A package built by ``torch._inductor.aoti_compile_and_package`` from
the exported module, with ``freezing`` (weights folded in, BN folded into convs, oneDNN weights
prepacked, int8 q/dq lowered to oneDNN int8 kernels), is one ``.pt2`` file in the cache folder that
later workers load in well under a second. The export's example input is channels_last, the layout
``Engine.predict`` hands it, so the compiled kernels assume it; the batch dimension is dynamic
(1..1024), so one package serves every batch size the batcher forms.

The package holds machine code for the CPU it was built on (vector ISA, oneDNN's prepacked weight
layout), so its key names that CPU as this process runs it (``cpu_tag``): a cache folder shared by
other machines, or the same machine capped to AVX2, builds its own.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

MAX_BATCH = 1024  # the dynamic batch dimension's upper bound: any batch the batcher may form (<= 256)


def cpu_tag() -> str:
    """The CPU as this process runs it, for cache keys: model name, torch's kernel level
    (``ATEN_CPU_CAPABILITY`` can lower it) and oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``)."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model}|{torch.backends.cpu.get_cpu_capability()}|{os.environ.get('ONEDNN_MAX_CPU_ISA', '')}"


def package_path(cache_dir: Path, precision: str, key: str) -> Path:
    """``<cache_dir>/aoti-<precision>-<key>.pt2``."""
    return cache_dir / f"aoti-{precision}-{key}.pt2"


def load_or_build_aoti(module: nn.Module | Callable[[], nn.Module], *, input_size: int, path: Path
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The package at ``path``, built first when absent; returns its runner:
    ``(N, 3, S, S) float32 channels_last -> (N, C)`` logits for N = 1..``MAX_BATCH``.

    ``module`` is packaged as given (its own dtype handling included, e.g. a bf16 autocast wrapper);
    it may be a function that makes it, called only when the package must be built (int8: a warm
    cache then skips loading the quantized program). Building takes about as long as one
    ``torch.compile``; it is written to a temporary name and renamed, so workers starting together
    never load half a file (each may build its own; the last rename wins, all are the same).

    :raises Exception: export or the ahead-of-time compile failed (the caller falls back to JIT);
        a damaged package is rebuilt once.
    """
    if path.is_file():
        try:
            return torch._inductor.aoti_load_package(str(path))
        except Exception as exc:  # damaged, or made by another torch: build it again
            log.warning("rebuilding the AOTInductor package %s: %s", path, exc)
    from torch.export import Dim, export

    t0 = time.perf_counter()
    module = module if isinstance(module, nn.Module) else module()
    example = torch.zeros(2, 3, input_size, input_size).contiguous(memory_format=torch.channels_last)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")  # .pt2 like the real name: no suffix warning
    with torch.no_grad():
        program = export(module, (example,), dynamic_shapes=({0: Dim("batch", min=1, max=MAX_BATCH)},), strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs={"freezing": True})
    os.replace(tmp, path)
    log.info("AOTInductor package built in %.1f s: %s", time.perf_counter() - t0, path)
    return torch._inductor.aoti_load_package(str(path))
