"""AOTInductor packages: a model compiled ahead of time once, loaded by every later start in a blink.

``torch.compile`` compiles again in every new process: its caches save the C++ builds but not the
tracing, lowering and freezing, so a warm restart still took 18-19 s on 2 cores (measured here
under the AVX2 cap, fp32). A package built by ``torch._inductor.aoti_compile_and_package`` from
the exported module, with ``freezing`` (weights folded in, BN folded into convs, oneDNN weights
prepacked, int8 q/dq lowered to oneDNN int8 kernels), is one ``.pt2`` file in the cache folder that
later workers load in well under a second. The export's example input is channels_last, the layout
``Engine.predict`` hands it, so the compiled kernels assume it. Two packages per model, as the JIT
makes two graphs: batch 1 static, and a dynamic batch dimension (2..1024) for every other batch the
batcher forms. One dynamic package for batch 1 too was measured 1.2x slower there (ResNet-18 fp32,
CPU time on 1 thread: 45.5 ms against 35.2 ms static, 38.0 ms JIT; batch 8 the same as the JIT).

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
    """``<cache_dir>/aoti-<precision>-<key>.pt2`` (batches 2..``MAX_BATCH``; batch 1 beside it, ``.b1.pt2``)."""
    return cache_dir / f"aoti-{precision}-{key}.pt2"


class Packaged:
    """The two packages of one model as one function: ``(N, 3, S, S) float32 channels_last -> (N, C)``
    logits for N = 1..``MAX_BATCH``; batch 1 runs the static package, every other batch the dynamic one."""

    def __init__(self, one: Callable, many: Callable):
        self.one, self.many = one, many

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.one if x.shape[0] == 1 else self.many)(x)


def _build(module: nn.Module, path: Path, input_size: int, batch: int, dynamic: bool) -> None:
    """Export ``module`` for ``batch``-sized channels_last inputs (a dynamic batch dimension from 2 when
    ``dynamic``) and compile it with freezing into the package ``path`` (temporary name, then renamed)."""
    from torch.export import Dim, export

    example = torch.zeros(batch, 3, input_size, input_size).contiguous(memory_format=torch.channels_last)
    shapes = ({0: Dim("batch", min=2, max=MAX_BATCH)},) if dynamic else None
    tmp = path.with_name(f"{path.name[:-4]}.{os.getpid()}.tmp.pt2")  # .pt2 like the real name: no suffix warning
    with torch.no_grad():
        program = export(module, (example,), dynamic_shapes=shapes, strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs={"freezing": True})
    os.replace(tmp, path)


def load_or_build_aoti(module: nn.Module | Callable[[], nn.Module], *, input_size: int, path: Path) -> Packaged:
    """The packages at ``path`` (see ``package_path``), built first where absent; returns them as one runner.

    ``module`` is packaged as given (its own dtype handling included, e.g. a bf16 autocast wrapper);
    it may be a function that makes it, called only when a package must be built (int8: a warm
    cache then skips loading the quantized program). Building takes about as long as one
    ``torch.compile`` of both graphs; files are written under a temporary name and renamed, so
    workers starting together never load half a file (each may build its own; all are the same).

    :raises Exception: export or the ahead-of-time compile failed (the caller falls back to JIT).
        A package that does not load (damaged, or made by another torch) is built again.
    """
    paths = {False: path.with_name(path.name[:-4] + ".b1.pt2"), True: path}
    loaded: dict[bool, Callable] = {}
    made: list[nn.Module] = []
    for dynamic, p in paths.items():
        if p.is_file():
            try:
                loaded[dynamic] = torch._inductor.aoti_load_package(str(p))
                continue
            except Exception as exc:  # damaged, or made by another torch: build it again
                log.warning("rebuilding the AOTInductor package %s: %s", p, exc)
        if not made:
            made.append(module if isinstance(module, nn.Module) else module())
        t0 = time.perf_counter()
        p.parent.mkdir(parents=True, exist_ok=True)
        _build(made[0], p, input_size, 2 if dynamic else 1, dynamic)
        log.info("AOTInductor package built in %.1f s: %s", time.perf_counter() - t0, p)
        loaded[dynamic] = torch._inductor.aoti_load_package(str(p))
    return Packaged(loaded[False], loaded[True])
