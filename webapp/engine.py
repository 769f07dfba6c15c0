"""The compiled model: the only code that runs a forward pass.

``torch.compile`` (inductor) with ``freezing`` (weights folded into the graph as constants, BN
folded into convs) and channels_last inputs (oneDNN's native layout for convs on x86), under
``torch.inference_mode()``. Compilation happens only in ``warm_up``, which runs every batch size
1..``max_batch_size`` once in the calling thread: under gunicorn's gevent worker that must be the
worker's main thread (inductor's C++ compile uses ``subprocess``, which gevent only allows
there; see ``shared/notes/gevent-threads.md``). After warm-up, recompiling is made an error,
so no request can ever pay for, or hang in, a compile.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)


def configure_threads(threads: int) -> int:
    """Set intra-op threads (0: one per core this process is pinned to) and one inter-op thread.

    Returns the intra-op thread count in effect.
    """
    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)  # we never run ops in parallel within a worker
    except RuntimeError:  # may only be set once per process, before inter-op work starts
        pass
    return torch.get_num_threads()


class Engine:
    """Runs ``module`` on batches: ``predict((N, 3, S, S) float32) -> (N, C) float32`` logits.

    ``compile=False`` runs eager (still channels_last, inference mode): starts in about a
    second, for unit tests. ``precision`` is ``"fp32"``.
    """

    precision = "fp32"

    def __init__(self, module: nn.Module, *, input_size: int, compile: bool):
        self.input_size = input_size
        self.compiled = compile
        self.module = module.eval().to(memory_format=torch.channels_last)
        for p in self.module.parameters():
            p.requires_grad_(False)
        self._fn: Callable[[torch.Tensor], torch.Tensor] = self.module
        if compile:
            import torch._inductor.config as inductor_config

            inductor_config.freezing = True
            # CUDA builds of torch warn that no CUDA runtime exists on every CPU compile: noise here.
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
            self._fn = torch.compile(self.module, backend="inductor")
        self.warm_batch_sizes: list[int] = []

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        """``(N, 3, S, S) float32`` normalized images -> ``(N, C) float32`` logits."""
        with torch.inference_mode():
            x = batch.contiguous(memory_format=torch.channels_last)
            return self._fn(x).float()

    def warm_up(self, max_batch_size: int, heartbeat: Callable[[], None] | None = None) -> float:
        """Run every batch size 1..``max_batch_size`` once (compiling them); return seconds taken.

        Batch 1 gets a static graph, batch 2 a graph with a dynamic batch dimension that serves
        3..N too. Afterwards, with compile on, any recompile raises instead of compiling.
        """
        start = time.perf_counter()
        if self.compiled:
            torch.compiler.set_stance("default")
        for n in range(1, max_batch_size + 1):
            t0 = time.perf_counter()
            x = torch.zeros(n, 3, self.input_size, self.input_size)
            out = self.predict(x)
            if out.shape[0] != n:
                raise RuntimeError(f"warm-up at batch {n} returned {tuple(out.shape)}")
            self.warm_batch_sizes.append(n)
            log.debug("warm-up batch %d: %.2f s", n, time.perf_counter() - t0)
            if heartbeat:
                heartbeat()
        if self.compiled:
            torch.compiler.set_stance("fail_on_recompile")
        return time.perf_counter() - start
