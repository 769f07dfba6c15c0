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

Each package's compiled library (``.so``, the frozen weights inside it) is extracted once beside it
and every worker loads that one file (``load_shared``). ``torch._inductor.aoti_load_package`` unzips
the library into a new temporary folder in every process, so each worker held its own page-cache
copy of every library: for ResNet-18 bf16, 2 x 23.4 MB of the worker's private memory (measured in
``/proc/PID/smaps``: the libraries' read-only segments, ``Private_Dirty``). Mapped from one file, those
pages are shared by all workers. Each worker still copies the weights out of the library into its
own memory once (AOTInductor's constant buffer): the two packages' frozen weights differ (the batch-1
graph prepacks its convolutions for oneDNN, the dynamic one does not), so they cannot share one set.

That library is called through its C interface with ``ctypes`` (``_CApi``), not through torch's
``AOTIModelContainerRunnerCpu``, because torch's runner keeps the GIL for the whole forward pass: in a
gevent worker nothing else ran meanwhile, not the hub (accepting, refusing, reading uploads) nor the
decode threads. At 2x overload with small photos that made refusals take 119-183 ms p99 at the client
(8 ms inside the server); with the GIL released, 40 ms (``bench/overload_bench.py``, 2 cores).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
import zipfile
import zlib
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


_LIBRARY_DIR = "data/aotinductor/model/"
_BESIDE_LIBRARY = ("_metadata.json", ".cpp")  # sources and build metadata: not needed to run


def extract_library(package: Path) -> Path | None:
    """The compiled library of ``package``, extracted beside it once as ``<package stem>.so`` (with its
    extern-kernel description ``<package stem>.json`` where it has one, e.g. int8), or None where the
    package holds anything else a plain load would need (weights or objects stored outside the
    library): then only ``aoti_load_package`` can load it. Written under temporary names and renamed
    (the ``.json`` first), so workers starting together never map half a file.

    Every load checks the extracted files against the package's own record of them (the zip's CRC-32 and
    size: ~5 ms for a 20 MB library) and extracts them again where they differ: a library damaged in place
    (a disk fault, a crash before its pages were written, an edit that kept its modification time) gave
    wrong answers for every batch of 2 or more with every health check green, and one cut short killed
    each worker with SIGBUS as it started, over and over. (It was trusted while its modification time
    matched the package's.)

    :raises OSError, zipfile.BadZipFile: the package cannot be read, or its own bytes fail its CRC (the
        caller builds it again).
    """
    so, js = package.with_suffix(".so"), package.with_suffix(".json")
    mtime = package.stat().st_mtime_ns
    with zipfile.ZipFile(package) as z:
        data = [n for n in z.namelist() if "/data/" in f"/{n}" and not n.endswith("/")]  # beside: archive metadata
        inside = [n for n in data if _LIBRARY_DIR in n]
        libraries = [n for n in inside if n.endswith(".so")]
        extern = [n for n in inside if n.endswith(".json") and not n.endswith("_metadata.json")]
        others = [n for n in inside if n not in libraries + extern and not n.endswith(_BESIDE_LIBRARY)]
        if len(libraries) != 1 or len(extern) > 1 or others or len(inside) < len(data):  # e.g. data/weights/
            return None
        for member, target in [(name, js) for name in extern] + [(libraries[0], so)]:
            info = z.getinfo(member)
            if _same(target, info):
                continue
            if target.exists():
                log.warning("%s differs from its package %s (damaged, or left by another build): extracting it "
                            "again", target, package.name)
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            with z.open(member) as src, open(tmp, "wb") as dst:  # z.open checks the member's CRC at its end
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())  # on disk before its name is: a crash leaves no named half file
            os.utime(tmp, ns=(mtime, mtime))
            os.replace(tmp, target)
    return so


def _same(path: Path, info: zipfile.ZipInfo) -> bool:
    """Whether the file at ``path`` holds exactly the zip member ``info``'s bytes (size, then CRC-32)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != info.file_size:
                return False
            crc = 0
            while chunk := f.read(1 << 22):
                crc = zlib.crc32(chunk, crc)
    except OSError:
        return False
    return crc == info.CRC


class _CApi:
    """AOTInductor's C interface (``torch/csrc/inductor/aoti_runtime/interface.h``) of one compiled library,
    called through ``ctypes``, which lets go of the GIL for the length of every foreign call.

    Why not ``torch._C._aoti.AOTIModelContainerRunnerCpu``: its ``run`` (like ``aoti_load_package``'s
    and ``AOTIModelPackageLoader``'s) keeps the GIL for the whole forward pass. In a gunicorn gevent
    worker the hub then cannot run while a batch is computed: no connection is accepted, no refusal
    written, no upload read and no decode thread gets on with its next photo. Measured on 2 cores, a
    thread sleeping 1 ms woke up to 83 ms late beside a batch-1 ResNet-18 forward and 313 ms beside a
    batch of 8 (5 ms, the GIL's switch interval, with eager or ``torch.compile``), and refusals at 2x
    overload took 100 ms p99 at the client against 8 ms inside the server. Called here, the same
    library runs the same kernels with the GIL released.

    Tensors cross as ``AtenTensorHandle`` (an owned ``at::Tensor*``): ``unsafe_alloc_void_ptrs_from_tensors``
    makes new handles for the inputs, which the run takes over (stolen, freed by it); the outputs' handles
    are handed to the caller, and ``alloc_tensors_by_stealing_from_void_ptrs`` turns them into tensors
    that own them. The same steps as the runner's ``run`` in C++ (``model_container_runner.cpp``).
    """

    _api = ctypes.PyDLL(None)  # Python's own C API, GIL held: function objects of our own, not ctypes.pythonapi's
    _api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    _api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    _api.PyCapsule_New.restype = ctypes.py_object
    _api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

    def __init__(self, so: Path):
        lib = ctypes.CDLL(str(so))
        for name in ("AOTInductorModelContainerCreateWithDevice", "AOTInductorModelContainerDelete",
                     "AOTInductorModelContainerRun", "AOTInductorModelContainerGetNumInputs",
                     "AOTInductorModelContainerGetNumOutputs", "AOTInductorGetLastError"):
            getattr(lib, name).restype = ctypes.c_int32
        self._lib, self._handle = lib, ctypes.c_void_p()
        self._check(lib.AOTInductorModelContainerCreateWithDevice(ctypes.byref(self._handle), ctypes.c_size_t(1),
                                                                  b"cpu", None), "load")
        n_in, n_out = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(lib.AOTInductorModelContainerGetNumInputs(self._handle, ctypes.byref(n_in)), "count inputs of")
        self._check(lib.AOTInductorModelContainerGetNumOutputs(self._handle, ctypes.byref(n_out)), "count outputs of")
        self.num_inputs, self.num_outputs = n_in.value, n_out.value
        self._path = so

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            msg = ctypes.c_char_p()
            self._lib.AOTInductorGetLastError(ctypes.byref(msg))
            text = (msg.value or b"").decode("utf-8", "replace") or f"error code {code}"
            raise RuntimeError(f"AOTInductor could not {what} {self._path}: {text}")

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The model on ``inputs`` (as many as it takes), the GIL released meanwhile; its outputs.

        :raises RuntimeError: the model refused the inputs (wrong count, shape or dtype: its message)."""
        if len(inputs) != self.num_inputs:
            raise RuntimeError(f"AOTInductor model {self._path} takes {self.num_inputs} inputs, not {len(inputs)}")
        get = self._api.PyCapsule_GetPointer
        ins = (ctypes.c_void_p * len(inputs))(*[get(c, None) for c in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(inputs)])
        outs = (ctypes.c_void_p * self.num_outputs)()
        self._check(self._lib.AOTInductorModelContainerRun(self._handle, ins, ctypes.c_size_t(len(inputs)), outs,
                                                           ctypes.c_size_t(self.num_outputs), None, None), "run")
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs([self._api.PyCapsule_New(p, None, None) for p in outs])

    def __del__(self):
        if getattr(self, "_handle", None) and self._handle.value:
            self._lib.AOTInductorModelContainerDelete(self._handle)
            self._handle = ctypes.c_void_p()


def _has_extern_kernels(so: Path) -> bool:
    """Whether the library calls kernels through AOTInductor's proxy executor (listed in the ``.json``
    beside it, e.g. ops with no C shim): only torch's own runner can make that executor, so such a library
    runs there (GIL held). Unreadable counts as having them: the runner then reports the problem."""
    js = so.with_suffix(".json")
    if not js.is_file():
        return False
    try:
        return bool(json.loads(js.read_text(encoding="utf-8")).get("nodes"))
    except (OSError, ValueError, AttributeError):
        return True


class SharedLibrary:
    """A package's model run from its extracted library (``extract_library``), which every worker maps
    from the same file: ``(N, 3, S, S) float32 channels_last -> (N, C)`` logits, as the package.

    Runs through the library's C interface (``_CApi``), which releases the GIL for the forward pass;
    a library with extern kernels (``_has_extern_kernels``) runs in torch's own runner, which keeps it
    (``releases_gil`` says which).

    :raises RuntimeError: (construction) the library does not load in this process.
    """

    def __init__(self, so: Path):
        self.path = so
        self.releases_gil = not _has_extern_kernels(so)
        if self.releases_gil:
            self._runner = _CApi(so)
        else:
            log.debug("%s has extern kernels: torch's AOTInductor runner, which holds the GIL while it runs", so)
            self._runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(so), 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._runner.run([x])[0]


def load_shared(package: Path) -> Callable:
    """``package`` loaded from its library extracted beside it (``SharedLibrary``), or, where it cannot
    be (not extracted, or it does not load), with ``aoti_load_package`` as before.

    :raises Exception: neither way loads it (damaged, or made by another torch)."""
    try:
        so = extract_library(package)
        if so is not None:
            return SharedLibrary(so)
    except (zipfile.BadZipFile, zlib.error, EOFError):
        raise  # the package's own bytes are damaged: built again (load_or_build_aoti)
    except Exception as exc:  # a full disk, a read-only cache folder, a library that does not load here
        log.warning("loading the AOTInductor package %s without sharing its library: %s", package, exc)
    return torch._inductor.aoti_load_package(str(package))


def _build(module: nn.Module, path: Path, input_size: int, batch: int, dynamic: bool,
           inductor_configs: dict | None = None) -> None:
    """Export ``module`` for ``batch``-sized channels_last inputs (a dynamic batch dimension from 2 when
    ``dynamic``) and compile it into the package ``path`` (temporary name, then renamed) with inductor's
    ``inductor_configs`` (default: freezing only, what serving builds; ``bench/autotune_bench.py`` adds others)."""
    from torch.export import Dim, export

    example = torch.zeros(batch, 3, input_size, input_size).contiguous(memory_format=torch.channels_last)
    shapes = ({0: Dim("batch", min=2, max=MAX_BATCH)},) if dynamic else None
    tmp = path.with_name(f"{path.name[:-4]}.{os.getpid()}.tmp.pt2")  # .pt2 like the real name: no suffix warning
    with torch.no_grad():
        program = export(module, (example,), dynamic_shapes=shapes, strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp),
                                                 inductor_configs=inductor_configs or {"freezing": True})
    os.replace(tmp, path)


def _load_or_remove(package: Path) -> Callable | None:
    """``load_shared(package)``, or None where it does not load (damaged, or made by another torch): then the
    package is removed, so that it is built again like an absent one (in a child process, where the caller has
    one), not in the serving process."""
    try:
        return load_shared(package)
    except Exception as exc:
        log.warning("the AOTInductor package %s does not load (%s): building it again", package, exc)
        try:
            package.unlink()
        except OSError:
            pass
        return None


def load_or_build_aoti(module: nn.Module | Callable[[], nn.Module], *, input_size: int, path: Path,
                       build_elsewhere: Callable[[list[Path]], None] | None = None) -> Packaged:
    """The packages at ``path`` (see ``package_path``), built first where absent; returns them as one runner.

    ``module`` is packaged as given (its own dtype handling included, e.g. a bf16 autocast wrapper);
    it may be a function that makes it, called only when a package must be built (int8: a warm
    cache then skips loading the quantized program). Building takes about as long as one
    ``torch.compile`` of both graphs; files are written under a temporary name and renamed, so
    workers starting together never load half a file (each may build its own; all are the same).

    ``build_elsewhere``, where given, is called first (with the packages' paths) when one is absent: it builds
    them in another process (a serving worker's, ``startup.build_in_child``), so that the compiler's modules and memory
    (~250-330 MB private per worker that compiled, kept for its whole life) never enter this one. Whatever
    it leaves absent is built here as before.

    :raises Exception: export or the ahead-of-time compile failed (the caller falls back to JIT).
        A package that does not load (damaged, or made by another torch) is removed and built again, as an
        absent one (``build_elsewhere`` first).
    """
    paths = {False: path.with_name(path.name[:-4] + ".b1.pt2"), True: path}
    loaded: dict[bool, Callable] = {}
    for dynamic, p in paths.items():  # a package that does not load is removed, to be built as an absent one
        if p.is_file() and (runner := _load_or_remove(p)) is not None:
            loaded[dynamic] = runner
    if build_elsewhere is not None and len(loaded) < len(paths):
        build_elsewhere([p for dynamic, p in paths.items() if dynamic not in loaded])
    made: list[nn.Module] = []
    for dynamic, p in paths.items():
        if dynamic in loaded:
            continue
        if p.is_file() and (runner := _load_or_remove(p)) is not None:  # built elsewhere just now
            loaded[dynamic] = runner
            continue
        if not made:
            made.append(module if isinstance(module, nn.Module) else module())
        t0 = time.perf_counter()
        p.parent.mkdir(parents=True, exist_ok=True)
        _build(made[0], p, input_size, 2 if dynamic else 1, dynamic)
        log.info("AOTInductor package built in %.1f s: %s", time.perf_counter() - t0, p)
        loaded[dynamic] = load_shared(p)
    return Packaged(loaded[False], loaded[True])
