"""The compiled model: the only code that runs a forward pass.

``torch.compile`` (inductor) with ``freezing`` (weights folded into the graph as constants, BN
folded into convs, int8 weights prepacked) and channels_last inputs (oneDNN's native layout
for convs on x86), under ``torch.inference_mode()``, in one of three precisions:

- ``fp32``: the reference.
- ``bf16``: the bf16 policy of ``webapp/bf16.py`` (autocast inside the model, a few sensitive
  layers and the logits in fp32); oneDNN runs the other convs and matmuls in bf16 where the CPU
  has native bf16 (avx512_bf16, AMX).
- ``int8``: static post-training quantization through PT2E, with the layers that lose answers
  left in fp32 (``webapp/quantize.py``); inductor lowers the q/dq pattern to oneDNN int8 kernels.

With a ``recheck`` engine (fp32), each image whose two most probable labels int8 or bf16 puts closer
than ``recheck_pts`` percentage points is run again there and answered from fp32's logits: both change
answers where fp32 itself nearly ties, so their close calls are where a second opinion pays.

With a cache directory every precision is compiled ahead of time instead (AOTInductor,
``webapp/aoti.py``): built once (about one ``torch.compile``), loaded by later workers in well under a
second, same kernels and speed as the JIT. Without one, or where the package cannot be built, JIT.

JIT compilation happens only in ``warm_up``, which then runs every batch size 1..``max_batch_size`` once
in the calling thread: under gunicorn's gevent worker that must be the worker's main thread
(inductor's C++ compile uses ``subprocess``, which gevent only allows there; see
``shared/notes/gevent-threads.md``). After warm-up, recompiling is made an error, so no request
can ever pay for, or hang in, a compile.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .aoti import cpu_tag, load_or_build_aoti, package_path
from .bf16 import BF16_KEEP_FP32, bf16_policy, close_calls
from .errors import StartupError
from .quantize import INT8_KEEP_FP32, load_or_quantize

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "int8")
LOADING_PACKAGES = "loading compiled model"  # the start-up phase where the packages are there (else "compiling")


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


def native_bf16() -> bool:
    """True when oneDNN will run bf16 convs natively on this CPU, as this process runs it.

    Asks oneDNN (``_is_mkldnn_bf16_supported``), not ``/proc/cpuinfo``: flags still list
    avx512_bf16 when the ISA is capped (``ONEDNN_MAX_CPU_ISA=AVX2``), where bf16 is emulated
    and about 5x slower than fp32.
    """
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def int8_vnni() -> bool:
    """True when oneDNN's int8 kernels will use VNNI (u8 x s8 dot products without saturation).

    CPUID says whether the CPU has it; ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` say
    whether this process may use it (both are how an old-CPU deployment is tested here).
    """
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    isa_allows = cap == "ALL" or any(word in cap for word in ("VNNI", "BF16", "AMX", "AVX10"))
    return bool(torch.cpu._is_vnni_supported()) and isa_allows and torch.backends.cpu.get_cpu_capability() != "AVX2"


def choose_reduce_range(setting: str) -> bool:
    """int8 activations in 7 bits (0..127) instead of 8: ``auto`` does so where VNNI is missing.

    Without VNNI, oneDNN's u8 x s8 path sums pairs of products in 16 bits, which can saturate;
    halving the activation range avoids that (torchao's quantizer documents this option).
    """
    return setting == "on" or (setting == "auto" and not int8_vnni())


def choose_precision(requested: str) -> tuple[str, str]:
    """Resolve ``auto`` (or pass through an explicit mode); return ``(precision, reason)`` for the log and /healthz."""
    if requested != "auto":
        return requested, "set by CLASSIFIER_PRECISION"
    if native_bf16():
        return "bf16", "auto: oneDNN has native bf16 on this CPU (avx512_bf16 or AMX)"
    return "fp32", "auto: no native bf16 in oneDNN on this CPU, so bf16 would be emulated and slower"


def cache_key(*parts) -> str:
    """A short stable key for a cached artefact: model, weights, torch version, calibration..., and the
    source of the modules that decide what a package or program holds (the bf16 policy, int8
    quantization, packaging), so a changed policy never loads an artefact made by the old one."""
    from . import aoti, bf16, quantize

    code = b"".join(Path(m.__file__).read_bytes() for m in (aoti, bf16, quantize))
    text = "|".join(map(str, (*parts, torch.__version__, hashlib.sha256(code).hexdigest())))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


AGREE = 0.02  # the largest logit difference between batch sizes, as a fraction of batch 1's logit range
PROGRESS_S = 10.0  # seconds between warm-up progress lines (the JIT compile of many batch sizes takes minutes)


def missing_compiler() -> str | None:
    """Where inductor finds no C++ compiler (its own search: ``CXX``, else ``g++``, run with ``--version``, ~10 ms),
    the one line a start that must compile fails with; None where it finds one. A host without ``g++`` got a
    ~100-line ``InvalidCxxCompiler`` traceback from ``warm`` and a worker's exit 3 after three tries (tryout23)."""
    from torch._inductor import cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        cpp_builder.get_cpp_compiler()
        return None
    except (InvalidCxxCompiler, OSError):
        from .settings import PREFIX

        return (f"no C++ compiler found ({os.environ.get('CXX') or 'g++'}, as CXX names it): compiling the model needs "
                f"one (Debian, Ubuntu: apt-get install g++; RHEL: dnf install gcc-c++); {PREFIX}COMPILE=0 serves the "
                f"model uncompiled")


class GraphsDisagree(RuntimeError):
    """``Engine.warm_up``'s sample photo gave other logits at ``batch`` than at batch 1: ``off`` (fraction of the
    logit range), top-1 class indices ``one`` (batch 1) and ``many``; ``engine``: the one whose graphs disagree
    where it is an engine's ``recheck`` engine (None: the engine warmed up)."""

    engine: "Engine | None" = None

    def __init__(self, batch: int, off: float, one: int, many: int):
        super().__init__(f"batch {batch} gives other logits than batch 1 for the same photo (off by {off:.0%} of "
                         f"their range; top-1 class {many} instead of {one})")
        self.batch, self.off, self.one, self.many = batch, off, one, many


class Engine:
    """Runs a model on batches: ``predict((N, 3, S, S) float32) -> (N, C) float32`` logits.

    ``precision`` is ``fp32``, ``bf16`` or ``int8`` (see module docstring); int8 needs
    ``calibration`` images ``(3, S, S) float32`` (a list, or a function that makes it, called only where
    no package or saved program spares the quantization) and leaves the layer groups ``int8_keep_fp32`` in
    fp32 (``webapp/quantize.py``); bf16 keeps the groups ``bf16_keep_fp32`` in fp32 (the model's own:
    ``bf16.keep_fp32_for``; the default is EfficientNet-Lite0's and any unmeasured model's).
    ``compile=False`` runs eager (still channels_last, inference mode): it starts in about a second,
    for unit tests; int8 without compile runs the reference (simulated) quantized graph, slow, for
    tests only. With ``compile`` and a ``cache_dir``, ``backend`` is ``aoti`` (the package, see
    ``webapp/aoti.py``; ``build_elsewhere`` builds absent packages in another process first), else
    ``inductor`` (JIT); without ``compile``, ``eager``. ``status`` is told ``compiling``, or
    ``LOADING_PACKAGES`` where the packages are already in ``cache_dir`` (a warm start, for ``/readyz`` and the CLI).

    ``add_recheck(recheck, recheck_pts)`` (an fp32 ``Engine`` of the same model, points > 0): rows whose top two
    probabilities differ by less than ``recheck_pts`` percentage points here are run again in ``recheck``
    and answered from its logits (``predict``); ``rechecked`` counts those images. Measured on EfficientNet-Lite0
    int8 (``python -m bench --only int8``; 256 photos, AMX box, 2026-12-06): at 3 points, 21% of the photos are
    rechecked and top-1 agreement with fp32 goes from 93.0% to 99.2%. bf16 (its policy's AOTInductor package,
    148 inputs of the fidelity bench, 2026-12-06): at 1 point, 4.7% rechecked, 98.6% -> 100%.
    """

    def __init__(self, module: nn.Module, *, input_size: int, compile: bool, precision: str = "fp32",
                 calibration: list[torch.Tensor] | Callable[[], list[torch.Tensor]] | None = None,
                 reduce_range: bool = False,
                 cache_dir: Path | None = None, cache_id: str = "",
                 int8_keep_fp32: tuple[str, ...] = INT8_KEEP_FP32,
                 bf16_keep_fp32: tuple[str, ...] = BF16_KEEP_FP32,
                 build_elsewhere: Callable[[list[Path]], None] | None = None,
                 status: Callable[[str], None] = lambda _: None):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.input_size = input_size
        self.compiled = compile
        self.precision = precision
        self.reduce_range = reduce_range if precision == "int8" else None
        module = module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
        # What runs, as a function that makes it: int8 quantizes (or loads its program) only when no
        # package is there to load. bf16 runs the policy module (fp32 logits, some layers fp32).
        if precision == "int8":
            # torchao's q/dq ops and x86 lowering passes (~1.5 s of imports) are registered by
            # load_or_quantize, so only where a program is loaded or made: a package needs neither.
            variant = (reduce_range, int8_keep_fp32)
            make = lambda: load_or_quantize(module, calibration or [], input_size=input_size,
                                            cache_dir=cache_dir, cache_key=cache_key(cache_id, *variant),
                                            reduce_range=reduce_range, keep_fp32=int8_keep_fp32)
        else:
            module = module.to(memory_format=torch.channels_last)
            variant = tuple(bf16_keep_fp32) if precision == "bf16" else ()
            ready = bf16_policy(module, variant) if precision == "bf16" else module
            make = lambda: ready
        self._fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.backend, self.package = "eager", None
        self.threads = torch.get_num_threads()
        if compile:
            import torch._inductor.config as inductor_config

            inductor_config.freezing = True
            # CUDA builds of torch warn that no CUDA runtime exists on every CPU compile: noise here.
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
            if cache_dir is not None:  # every precision: a package loads in well under a second, JIT recompiles
                path = package_path(cache_dir, precision, cache_key(cache_id, precision, variant, cpu_tag()))
                both = (path, path.with_name(path.name[:-4] + ".b1.pt2"))  # as aoti.load_or_build_aoti names them
                status(LOADING_PACKAGES if all(p.is_file() for p in both) else "compiling")
                try:
                    self._fn = load_or_build_aoti(make, input_size=input_size, path=path,
                                                  build_elsewhere=build_elsewhere)
                    self.backend, self.package = "aoti", path
                except StartupError:  # the build ran past STARTUP_TIMEOUT_S: a JIT compile here would too
                    raise
                except Exception as exc:  # export or AOT compile failed for this model: JIT still works
                    if missing := missing_compiler():  # unless no compiler: JIT fails alike, in a traceback
                        raise StartupError(missing) from None
                    log.warning("%s AOTInductor package failed (%s); using torch.compile", precision, exc)
        if self._fn is None:
            self._fn = make()
            if compile:
                status("compiling")
                self._fn = torch.compile(self._fn, backend="inductor")
                self.backend = "inductor"
        self.warm_batch_sizes: list[int] = []
        self.recheck: Engine | None = None
        self.recheck_pts, self.rechecked = 0.0, 0

    def add_recheck(self, recheck: Engine, pts: float) -> None:
        """Answer this engine's close calls from ``recheck`` (class docstring); ``pts`` <= 0 leaves none. Made
        after this engine, so that building ``recheck`` (channels_last, in place) never changes the module
        this one quantizes."""
        self.recheck, self.recheck_pts = (recheck, float(pts)) if pts > 0 else (None, 0.0)

    def remedy(self, inductor_dir: Path) -> str:
        """What to do where the compiled code is damaged (``GraphsDisagree``): which files to remove."""
        from .settings import PREFIX

        if self.package is not None:
            one = self.package.with_name(self.package.name[:-4] + ".b1.pt2")
            return (f"remove {one.name} and {self.package.name} (and the .so and .json beside each) from "
                    f"{self.package.parent} ({PREFIX}CACHE_DIR) and start again: they are built anew")
        if self.backend == "inductor":
            return f"remove the compiled kernels in {inductor_dir} and start again"
        return f"uncompiled, this torch build computes it wrongly; {PREFIX}MAX_BATCH_SIZE=1 avoids batches"

    def thread_init(self) -> None:
        """Call first on the thread that will run ``predict``: intra-op threads are per calling thread."""
        torch.set_num_threads(self.threads)

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        """``(N, 3, S, S) float32`` normalized images -> ``(N, C) float32`` logits (close calls from ``recheck``)."""
        with torch.inference_mode():
            x = batch.contiguous(memory_format=torch.channels_last)
            out = self._fn(x).float()
            if self.recheck is not None and out.shape[1] > 1:
                close = close_calls(out, self.recheck_pts)
                if len(close):
                    out = out.clone()  # never write into a buffer the compiled code may own
                    out[close] = self.recheck.predict(batch[close])
                    self.rechecked += len(close)
            return out

    def warm_up(self, max_batch_size: int, heartbeat: Callable[[], None] | None = None,
                sample: torch.Tensor | None = None) -> float:
        """Run batch sizes 1, 2 and ``max_batch_size`` once, every size 1..``max_batch_size`` under the JIT
        compile (compiling them); return seconds taken.

        With a ``sample`` (``(1, 3, S, S) float32``, a real photo: start-up passes the golden one), each batch is
        that photo repeated, and every row must give batch 1's logits (within ``AGREE`` of their range): batch 1
        and the others run different compiled code (two graphs, two AOTInductor libraries), and a fault in one
        (a damaged library) answered every batched request wrongly while the self-test, at batch 1, passed.
        Measured here, the graphs differ by ~3e-7 of the range (fp32 and bf16); a damaged one by most of it.

        Batch 1 gets a static graph, batch 2 a graph with a dynamic batch dimension that serves
        3..N too. Afterwards, with compile on, any recompile raises instead of compiling: so the JIT compile
        (``torch.compile``, where no AOTInductor package could be built) runs every size. The AOTInductor
        packages compile nothing, nor does eager: batches 1, 2 and ``max_batch_size`` check them; every other
        size would cost a whole forward pass each at start (about 1 s of a 5 s warm start, ResNet-18 on one
        thread; sizes 1..256 eager: ~33,000 images, over 10 min on 2 cores, tryout22) to save its first request
        about 10 ms (oneDNN's primitives for that shape; eager ResNet-18 at 3, 5 and 7: 5 to 40 ms). A warm-up
        still running logs its progress every ``PROGRESS_S`` s.
        A ``recheck`` engine is warmed up first, the same way (its ``GraphsDisagree`` names it as ``engine``).
        """
        start = time.perf_counter()
        if self.recheck is not None:
            try:
                self.recheck.warm_up(max_batch_size, heartbeat, sample)
            except GraphsDisagree as exc:
                exc.engine = exc.engine or self.recheck
                raise
        jit = self.backend == "inductor"
        if jit:
            torch.compiler.set_stance("default")
        sizes = range(1, max_batch_size + 1)
        if not jit:
            sizes = sorted({1, 2, max_batch_size} & set(sizes))
        first, told = None, start
        for n in sizes:
            t0 = time.perf_counter()
            x = (torch.zeros(n, 3, self.input_size, self.input_size) if sample is None
                 else sample.expand(n, -1, -1, -1).contiguous())
            out = self.predict(x)
            if out.shape[0] != n:
                raise RuntimeError(f"warm-up at batch {n} returned {tuple(out.shape)}")
            if sample is not None:
                first = out[0] if first is None else first
                off = float((out - first).abs().max()) / max(float(first.max() - first.min()), 1e-6)
                if not off <= AGREE:  # (NaN too)
                    raise GraphsDisagree(n, off, int(first.argmax()), int(out[-1].argmax()))
            self.warm_batch_sizes.append(n)
            log.debug("warm-up batch %d: %.2f s", n, time.perf_counter() - t0)
            if (now := time.perf_counter()) - told >= PROGRESS_S and n != sizes[-1]:
                told = now
                log.info("warm-up: batch sizes up to %d of %d done in %.0f s", n, max_batch_size, now - start)
            if heartbeat:
                heartbeat()
        if jit:
            torch.compiler.set_stance("fail_on_recompile")
        return time.perf_counter() - start
