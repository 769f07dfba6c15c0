"""Our ``Engine`` against eager PyTorch, ONNX Runtime and OpenVINO: speed and fidelity, in one run.

What it measures, all in one process, on the same inputs and the same thread count:

* **Speed** (ResNet-18, seeded weights, 224x224; ``--time-offline`` adds EfficientNet-Lite0):
  batch-1 latency (median ms) and batch-8 throughput (median images/s) of every runtime and
  precision below, each after its own warm-up. Runtimes are timed **round-robin**: every round
  runs a short block of bs1 then bs8 calls of each runtime, in an order rotated each round, and
  the medians are taken over all rounds. A machine that gets busier or quieter mid-run then
  slows every runtime alike, so the ratios stay meaningful even where absolute times are noisy.
  The first call of each block is not timed (it lets the thread pool of the runtime that ran
  before go back to sleep, and this one's wake up).
* **Speed-up** against the baseline, eager fp32 (bs1: its latency / ours; bs8: ours / its
  throughput), and **against OpenVINO at the same precision** (bs1: latency / OV's, lower is
  better; bs8: throughput / OV's, higher is better).
* **Logit error**: ``max |logits - ref| / max |ref|`` against eager fp32 of the same weights, over
  a fixed batch: the shared photos (``../shared/images``), decoded and preprocessed with our own
  pipeline (``webapp.imaging``, fast decode as served).
* **Top-1 agreement with fp32** of the real-weight offline model (EfficientNet-Lite0): on the
  shared photos plus deterministic crops / flips / rescales of them generated in memory (256
  photos in all; 32 with ``--quick``), the share whose top-1 class equals eager fp32's.
  (ResNet-18's seeded weights have no meaningful top-1, so only its logit error is reported.)

Runtimes and their configuration (``threads`` = ``--threads``, default every core this process
may use, ``len(os.sched_getaffinity(0))``):

* ``eager fp32``: the baseline. The torch module as built by ``webapp.models.load_model``
  (NCHW, fp32), under ``torch.inference_mode()``; ``torch.set_num_threads(threads)``, one
  inter-op thread (``webapp.engine.configure_threads``).
* ``ours fp32 / bf16 / int8``: ``webapp.engine.Engine(compile=True)``, as a worker serves it:
  inductor with freezing and channels_last; bf16 by autocast; int8 by PT2E static quantization
  (X86InductorQuantizer: per-channel s8 weights, per-tensor u8 activations; 7-bit activations
  where oneDNN has no VNNI, as the service chooses) calibrated on the shipped calibration photos
  (``webapp/calibration``, 28). ``warm_up(8)`` compiles bs1 (static) and bs2+ (dynamic batch)
  before timing. As in the service, compiled kernels and the int8 program are cached in
  ``--cache-dir`` (default the service's ``~/.cache/photo-classifier``; ``TORCHINDUCTOR_CACHE_DIR``
  wins for kernels); ``--cache-dir ''`` quantizes int8 afresh. torchao's x86 quantizer module is
  imported before an int8 Engine is built: it registers the Inductor int8 lowering, which
  ``webapp.engine`` leaves unregistered when it loads a cached program (see ``build_ours``).
* ``ORT fp32``: the model exported with ``torch.onnx.export`` (the TorchScript exporter,
  ``dynamo=False``, where this torch still has it; else the dynamo exporter, which needs
  ``onnxscript``), opset 17 (18 with the dynamo exporter, its lowest), dynamic batch axis. ``CPUExecutionProvider``,
  ``intra_op_num_threads=threads``, ``inter_op_num_threads=1``, sequential execution,
  ``ORT_ENABLE_ALL`` graph optimizations, default spinning.
* ``ORT int8``: ``quant_pre_process`` (shape inference + ORT optimizations, ORT's recommended
  first step) then ``quantize_static``: QDQ format, per-channel s8 weights, u8 activations
  (U8S8, the layout oneDNN and ours use too), MinMax calibration over a data reader of the
  same 28 calibration photos; ``reduce_range`` where the CPU has no VNNI. Same session options.
* ``OV fp32 / bf16``: OpenVINO reads **the same ONNX file** (so ORT and OV run the same graph;
  ``ov.convert_model`` of the torch module is only the fallback where the ONNX export failed).
  Compiled for ``CPU`` with ``PERFORMANCE_HINT: LATENCY`` (one stream),
  ``INFERENCE_NUM_THREADS: threads``, ``INFERENCE_PRECISION_HINT: f32`` or ``bf16``, dynamic
  batch (like ORT and ours, one compiled model serves every batch size); synchronous infer
  requests. bf16 is native only where the CPU has avx512_bf16 or AMX: the row's note says which.
* ``OV int8``: ``nncf.quantize`` (post-training, default preset: per-channel symmetric weights,
  per-tensor activations, fast bias correction) of the fp32 OV model on the same 28 calibration
  photos, compiled as fp32 (``INFERENCE_PRECISION_HINT: f32`` for the ops left unquantized, as ours).

Each runtime's effective configuration (and, for OV, what it resolved: streams, threads,
precision, pinning) lands in the result under ``configs``. A runtime or export that fails is
reported in the table and the JSON with its error, never hidden; the others still run.

Usage (repo root, venv with ``requirements-bench.txt``)::

    python bench/engine_bench.py --quick                 # smoke test: ~1.5 min on 2 quiet cores, warm caches
    python bench/engine_bench.py --json bench.json       # full run
    python bench/engine_bench.py --runtimes ours-bf16,ov-bf16 --rounds 30   # eager fp32 always runs

The first run compiles every Engine (and quantizes int8) and takes a few minutes more. Run it on
a quiet machine: under CPU contention torch's OpenMP threads, which spin-wait at every op's
barrier, slow down far more than ORT's and OV's pools (seen here: eager bs1 4-10x slower under
a load average of 5-15 on 2 cores, while ORT and OV slowed ~2x), which round-robin timing cannot
cancel; the table warns when the load average was high.

Importable: ``add_arguments(parser)`` and ``run(args) -> dict`` (JSON-serialisable; its
``table`` is the printed text).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import inspect
import io
import logging
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image, ImageOps

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import IMAGES, num, table  # noqa: E402  (the benchmarks' shared helpers)
from bench import main as bench_main  # noqa: E402
from webapp import assets, imaging, models, settings  # noqa: E402
from webapp import engine as engine_mod  # noqa: E402

SHARED_IMAGES = IMAGES
TIMED_MODEL = "resnet18_seeded"
OFFLINE_MODEL = "efficientnet_lite0"
# (runtime, precision), in table order. Keys are "runtime-precision", e.g. "ov-bf16".
RUNTIMES = [("eager", "fp32"), ("ours", "fp32"), ("ours", "bf16"), ("ours", "int8"),
            ("ort", "fp32"), ("ort", "int8"), ("ov", "fp32"), ("ov", "bf16"), ("ov", "int8")]
BASELINE = "eager-fp32"
LABELS = {"eager": "eager", "ours": "ours", "ort": "ONNX Runtime", "ov": "OpenVINO"}
OPSET = 17
BATCH = 8  # the bs8 of the throughput figures; also the chunk size of the fidelity runs
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Inputs: real photos, preprocessed with the service's own pipeline
# --------------------------------------------------------------------------------------------

def shared_photos() -> list[tuple[str, Image.Image]]:
    """Every photo in ``../shared/images``, decoded as the service decodes uploads (fast decode on)."""
    if not SHARED_IMAGES.is_dir():
        raise SystemExit(f"no shared photos at {SHARED_IMAGES}: this benchmark needs real photos")
    out = []
    for path in sorted(SHARED_IMAGES.iterdir()):
        if path.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"):
            d = imaging.decode(path.read_bytes(), max_pixels=80_000_000, name=path.name, min_side=256)
            out.append((path.name, d.image))
    # Scene photos first (the two 12 MP files are dog.jpg again): bs8 and bs1 use varied photos.
    out.sort(key=lambda item: (item[0].startswith("phone"), item[0]))
    return out


def augmented(photos: list[Image.Image], n: int, *, seed: int) -> list[Image.Image]:
    """``n`` deterministic variants of ``photos``: a random crop (35-100 % of the area, aspect 3:4..4:3),
    a mirror half the time, and a rescale of the result to a short side of 96..640 px (bicubic),
    so the pipeline sees zoomed-in, mirrored, low- and high-resolution views."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        img = photos[k % len(photos)]
        w, h = img.size
        area = rng.uniform(0.35, 1.0) * w * h
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw = min(w, max(16, round(math.sqrt(area * aspect))))
        ch = min(h, max(16, round(math.sqrt(area / aspect))))
        x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
        view = img.crop((x0, y0, x0 + cw, y0 + ch))
        if rng.random() < 0.5:
            view = ImageOps.mirror(view)
        short = rng.randint(96, 640)
        scale = short / min(view.size)
        view = view.resize((max(1, round(view.width * scale)), max(1, round(view.height * scale))),
                           Image.Resampling.BICUBIC)
        out.append(view)
    return out


@dataclass
class Inputs:
    """One model's inputs, all ``float32`` NCHW, preprocessed by its own ``webapp.imaging`` transform."""

    names: list[str]
    fixed: torch.Tensor        # the shared photos: the logit-error batch
    fidelity: torch.Tensor     # shared photos + augmentations: the top-1 agreement set
    calibration: list[torch.Tensor]
    bs1: torch.Tensor
    bs8: torch.Tensor


def make_inputs(loaded: models.LoadedModel, photos, extra: list[Image.Image]) -> Inputs:
    transform = imaging.build_transform(loaded.preprocessing)
    fixed = torch.stack([imaging.preprocess(img, transform) for _, img in photos])
    fidelity = torch.cat([fixed, torch.stack([imaging.preprocess(img, transform) for img in extra])]) if extra else fixed
    calibration = []
    for path in assets.calibration_files():
        d = imaging.decode(path.read_bytes(), max_pixels=80_000_000, name=path.name)
        calibration.append(imaging.preprocess(d.image, transform))
    if len(fixed) < BATCH:
        fixed_bs8 = fixed.repeat((BATCH + len(fixed) - 1) // len(fixed), 1, 1, 1)[:BATCH]
    else:
        fixed_bs8 = fixed[:BATCH]
    return Inputs(names=[n for n, _ in photos], fixed=fixed, fidelity=fidelity, calibration=calibration,
                  bs1=fixed[:1].clone(), bs8=fixed_bs8.clone())


# --------------------------------------------------------------------------------------------
# Runtimes: each becomes a Runner whose predict maps (N, 3, S, S) float32 -> (N, C) float32 numpy
# --------------------------------------------------------------------------------------------

@dataclass
class Runner:
    key: str
    runtime: str
    precision: str
    predict: Callable[[torch.Tensor], np.ndarray] | None = None
    config: dict = field(default_factory=dict)
    build_s: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    keep: object = None  # whatever must stay alive for predict (engine, session, compiled model)


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


class Env:
    """What every builder shares: threads, a scratch dir, the onnx files and OV models made so far."""

    def __init__(self, threads: int, workdir: Path, cache_dir: Path | None = None):
        self.threads = threads
        self.workdir = workdir
        self.cache_dir = cache_dir
        self.onnx: dict[str, Path | BaseException] = {}
        self.ov_fp32: dict[str, object] = {}
        self._core = None

    @property
    def core(self):
        if self._core is None:
            import openvino as ov
            self._core = ov.Core()
        return self._core


def build_eager(loaded, inputs: Inputs, env: Env) -> Runner:
    module = copy.deepcopy(loaded.module).eval()

    def predict(x):
        with torch.inference_mode():
            return module(x).numpy()
    return Runner(key="", runtime="eager", precision="fp32", predict=predict, keep=module,
                  config={"module": "as built by webapp.models.load_model, NCHW fp32", "mode": "torch.inference_mode()",
                          "torch_threads": torch.get_num_threads()})


def build_ours(loaded, inputs: Inputs, env: Env, precision: str) -> Runner:
    calib_id = "|".join(f"{p.name}:{p.stat().st_size}" for p in assets.calibration_files())
    kwargs = dict(input_size=loaded.preprocessing.crop, compile=True, precision=precision,
                  calibration=inputs.calibration if precision == "int8" else None, cache_dir=env.cache_dir,
                  cache_id=f"bench|{loaded.name}|{loaded.weights}|{calib_id}")
    params = inspect.signature(engine_mod.Engine).parameters
    if precision == "int8" and "reduce_range" in params and hasattr(engine_mod, "choose_reduce_range"):
        kwargs["reduce_range"] = engine_mod.choose_reduce_range("auto")
    if precision == "int8":
        # Importing the x86 quantizer registers torchao's Inductor int8 passes (weight prepack, q/dq -> oneDNN
        # qconv). webapp.engine imports it only when it quantizes, not when it loads its cached int8 program:
        # then the compiled graph keeps dequantize + fp32 conv (no qconv at all, ~3x slower at bs1).
        # Imported here so this row measures PT2E int8 as designed whether or not the program was cached.
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401
    torch.compiler.set_stance("default")  # a previous Engine's warm-up left "fail_on_recompile" on, process-wide
    engine = engine_mod.Engine(copy.deepcopy(loaded.module), **kwargs)
    engine.warm_up(BATCH)

    def predict(x):
        return engine.predict(x).numpy()
    config = {"engine": "webapp.engine.Engine(compile=True)", "precision": precision, "warm_up": BATCH,
              "backend": getattr(engine, "backend", None),
              "torch_threads": torch.get_num_threads(),
              "calibration_photos": len(inputs.calibration) if precision == "int8" else None,
              "int8_program_cache": str(env.cache_dir) if precision == "int8" and env.cache_dir else None,
              "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    if precision == "int8":
        config["reduce_range"] = kwargs.get("reduce_range", False)
    notes = []
    if precision == "bf16" and not engine_mod.native_bf16():
        notes.append("no native bf16 in oneDNN here: emulated")
    return Runner(key="", runtime="ours", precision=precision, predict=predict, keep=engine, config=config, notes=notes)


def export_onnx(loaded, env: Env) -> Path:
    """The model as ONNX (opset 17, dynamic batch), made once per model; raises what the export raised."""
    if loaded.name in env.onnx:
        got = env.onnx[loaded.name]
        if isinstance(got, BaseException):
            raise got
        return got
    path = env.workdir / f"{loaded.name}.onnx"
    module = copy.deepcopy(loaded.module).eval()
    size = loaded.preprocessing.crop
    example = (torch.zeros(2, 3, size, size),)
    try:
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                torch.onnx.export(module, example, str(path), dynamo=False, opset_version=OPSET,
                                  input_names=["input"], output_names=["logits"],
                                  dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
            exporter = "torchscript (dynamo=False)"
        except Exception as legacy_exc:  # a torch without the TorchScript exporter: the dynamo one
            log(f"  legacy ONNX export failed ({_short_error(legacy_exc)}); trying dynamo=True")
            batch = torch.export.Dim("batch", min=1, max=1024)
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                # opset 18: the dynamo exporter's lowest; it cannot convert these models down to 17
                torch.onnx.export(module, example, str(path), dynamo=True, opset_version=max(OPSET, 18),
                                  input_names=["input"], output_names=["logits"],
                                  dynamic_shapes=({0: batch},), external_data=False)
            exporter = "dynamo (dynamo=True)"
    except Exception as exc:
        env.onnx[loaded.name] = exc
        raise
    import onnx

    opset = max((o.version for o in onnx.load(str(path), load_external_data=False).opset_import if o.domain in ("", "ai.onnx")),
                default=None)
    env.onnx[loaded.name] = path
    env.onnx[loaded.name + ":exporter"] = f"{exporter}, opset {opset}"
    return path


def _ort_session(path: Path, env: Env):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = env.threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    config = {"providers": session.get_providers(), "intra_op_num_threads": env.threads, "inter_op_num_threads": 1,
              "execution_mode": "ORT_SEQUENTIAL", "graph_optimization_level": "ORT_ENABLE_ALL",
              "allow_spinning": "default (1)"}
    return session, config


def _ort_runner(session, config, precision) -> Runner:
    name = session.get_inputs()[0].name

    def predict(x):
        return session.run(None, {name: x.numpy()})[0]
    return Runner(key="", runtime="ort", precision=precision, predict=predict, keep=session, config=config)


def build_ort(loaded, inputs: Inputs, env: Env, precision: str) -> Runner:
    path = export_onnx(loaded, env)
    exporter = env.onnx[loaded.name + ":exporter"]
    if precision == "fp32":
        session, config = _ort_session(path, env)
        config.update(onnx=f"{exporter}, dynamic batch")
        return _ort_runner(session, config, precision)
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self, tensors):
            self._it = iter([{"input": t[None].numpy()} for t in tensors])

        def get_next(self):
            return next(self._it, None)

    pre = env.workdir / f"{loaded.name}-pre.onnx"
    notes = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quant_pre_process(str(path), str(pre))
        source = pre
    except Exception as exc:  # quantize the plain export instead, and say so
        notes.append(f"quant_pre_process failed ({_short_error(exc)}); quantized the plain export")
        source = path
    reduce_range = not engine_mod.int8_vnni() if hasattr(engine_mod, "int8_vnni") else False
    out = env.workdir / f"{loaded.name}-int8-qdq.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(source), str(out), Reader(inputs.calibration), quant_format=QuantFormat.QDQ,
                        per_channel=True, reduce_range=reduce_range, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax)
    session, config = _ort_session(out, env)
    config.update(onnx=f"{exporter}, dynamic batch",
                  quantization={"api": "quantize_static", "pre_process": source == pre, "format": "QDQ",
                                "per_channel": True, "activations": "QUInt8", "weights": "QInt8",
                                "calibrate_method": "MinMax", "calibration_photos": len(inputs.calibration),
                                "reduce_range": reduce_range})
    runner = _ort_runner(session, config, precision)
    runner.notes += notes
    return runner


def _ov_fp32_model(loaded, env: Env):
    """The fp32 OV model: read from our ONNX file, or converted from torch where the export failed."""
    if loaded.name in env.ov_fp32:
        return env.ov_fp32[loaded.name]
    import openvino as ov

    try:
        path = export_onnx(loaded, env)
        model, source = env.core.read_model(str(path)), f"read_model of the ONNX file ({env.onnx[loaded.name + ':exporter']})"
    except Exception as exc:
        log(f"  OV: no ONNX file ({_short_error(exc)}); ov.convert_model of the torch module instead")
        size = loaded.preprocessing.crop
        model = ov.convert_model(copy.deepcopy(loaded.module).eval(), example_input=torch.zeros(2, 3, size, size),
                                 input=[(-1, 3, size, size)])
        source = "ov.convert_model of the torch module (ONNX export failed)"
    env.ov_fp32[loaded.name] = (model, source)
    return model, source


def build_ov(loaded, inputs: Inputs, env: Env, precision: str) -> Runner:
    model, source = _ov_fp32_model(loaded, env)
    notes = [] if source.startswith("read_model") else ["ONNX export failed: converted with ov.convert_model"]
    quant = None
    if precision == "int8":
        import nncf

        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            dataset = nncf.Dataset(inputs.calibration, lambda t: t[None].numpy())
            model = nncf.quantize(model, dataset, subset_size=len(inputs.calibration))
        quant = {"api": "nncf.quantize", "preset": "default (PERFORMANCE: symmetric)", "fast_bias_correction": True,
                 "calibration_photos": len(inputs.calibration)}
    hint = "bf16" if precision == "bf16" else "f32"
    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": env.threads, "INFERENCE_PRECISION_HINT": hint}
    compiled = env.core.compile_model(model, "CPU", props)
    effective = {}
    for prop in ("PERFORMANCE_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT",
                 "ENABLE_CPU_PINNING", "ENABLE_HYPER_THREADING", "SCHEDULING_CORE_TYPE"):
        try:
            value = compiled.get_property(prop)
            effective[prop] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
        except Exception:
            pass
    if precision == "bf16":
        caps = env.core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        flags = cpu_flags()
        native = "BF16" in caps and (flags.get("avx512_bf16") or flags.get("amx_bf16"))
        notes.append("native bf16 (avx512_bf16/AMX)" if native else "CPU has no native bf16: OV emulates or falls back")
        if effective.get("INFERENCE_PRECISION_HINT", "bf16") != "bf16":
            notes.append(f"OV runs {effective['INFERENCE_PRECISION_HINT']}, not bf16")
    request = compiled.create_infer_request()

    def predict(x):
        request.infer({0: x.numpy()})
        return request.get_output_tensor(0).data.copy()
    config = {"model": source, "device": "CPU", "properties": props, "effective": effective,
              "batch": "dynamic (-1)", "api": "synchronous InferRequest.infer"}
    if quant:
        config["quantization"] = quant
    return Runner(key="", runtime="ov", precision=precision, predict=predict, keep=(compiled, request),
                  config=config, notes=notes)


BUILDERS = {"eager": build_eager, "ours": build_ours, "ort": build_ort, "ov": build_ov}


# Build order (the table keeps RUNTIMES' order). Strict torch.export, which ours-int8 runs, drops
# dynamo's compiled code for the model class's forward (torch._dynamo.eval_frame.remove_from_cache),
# process-wide: an Engine of the same model compiled earlier would have to recompile on its next
# call, which its warm-up made an error. So every export comes first and ours fp32/bf16 last.
BUILD_ORDER = ["eager-fp32", "ort-fp32", "ort-int8", "ov-fp32", "ov-bf16", "ov-int8", "ours-int8", "ours-fp32", "ours-bf16"]


def build_all(loaded, inputs: Inputs, env: Env, keys: list[str]) -> dict[str, Runner]:
    runners = {}
    for key in BUILD_ORDER:
        runtime, precision = key.split("-")
        if key not in keys:
            continue
        log(f"{loaded.name}: building {key}")
        t0 = time.perf_counter()
        try:
            builder = BUILDERS[runtime]
            runner = builder(loaded, inputs, env) if runtime == "eager" else builder(loaded, inputs, env, precision)
            out = runner.predict(inputs.bs1)  # one call each: catches a runner that builds but cannot run
            if out.shape != (1, len(loaded.categories)) or not np.isfinite(out).all():
                raise RuntimeError(f"bad output: shape {out.shape}, finite {bool(np.isfinite(out).all())}")
        except Exception as exc:
            log(f"  {key} FAILED: {_short_error(exc)}")
            traceback.print_exc(file=sys.stderr)
            runner = Runner(key=key, runtime=runtime, precision=precision, error=_short_error(exc))
            if runtime == "ort" and isinstance(env.onnx.get(loaded.name), BaseException):
                runner.error = f"ONNX export failed: {_short_error(env.onnx[loaded.name])}"
        runner.key = key
        runner.build_s = round(time.perf_counter() - t0, 2)
        runners[key] = runner
        gc.collect()
    return {f"{r}-{p}": runners[f"{r}-{p}"] for r, p in RUNTIMES if f"{r}-{p}" in runners}


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------

def run_batched(runner: Runner, x: torch.Tensor) -> np.ndarray:
    return np.concatenate([runner.predict(x[i:i + BATCH].contiguous()) for i in range(0, len(x), BATCH)])


def fidelity(runners: dict[str, Runner], inputs: Inputs, *, top1: bool) -> dict[str, dict]:
    """Logit error on the fixed batch and (``top1``) top-1 agreement on the fidelity set, vs eager fp32."""
    ref_runner = runners.get(BASELINE)
    if ref_runner is None or ref_runner.predict is None:
        return {}
    ref_fixed = run_batched(ref_runner, inputs.fixed)
    ref_top = run_batched(ref_runner, inputs.fidelity).argmax(1) if top1 else None
    out = {}
    for key, runner in runners.items():
        if runner.predict is None:
            continue
        t0 = time.perf_counter()
        try:
            logits = run_batched(runner, inputs.fixed)
            row = {"rel_err": float(np.abs(logits - ref_fixed).max() / np.abs(ref_fixed).max()),
                   "photos": len(inputs.fixed)}
            if top1:
                top = run_batched(runner, inputs.fidelity).argmax(1)
                agree = int((top == ref_top).sum())
                row.update(top1_agree=agree / len(ref_top), top1_n=len(ref_top), top1_agree_count=agree)
            row["fidelity_s"] = round(time.perf_counter() - t0, 2)
        except Exception as exc:
            log(f"  fidelity of {key} FAILED: {_short_error(exc)}")
            row = {"error": _short_error(exc)}
        out[key] = row
    return out


def _stats(samples: list[float]) -> dict:
    qs = statistics.quantiles(samples, n=10) if len(samples) >= 2 else [samples[0]] * 9
    return {"median": statistics.median(samples), "p10": qs[0], "p90": qs[-1], "n": len(samples)}


def timing(runners: dict[str, Runner], inputs: Inputs, *, rounds: int, iters1: int, iters8: int) -> dict[str, dict]:
    """Round-robin timing: each round, every runner does 1 untimed + ``iters1`` bs1 calls, then 1 + ``iters8`` bs8."""
    live = [r for r in runners.values() if r.predict is not None]
    samples = {r.key: {1: [], BATCH: []} for r in live}
    clock = time.perf_counter
    for rnd in range(rounds):
        k = rnd % len(live)
        order = live[k:] + live[:k]
        if rnd % 2:
            order.reverse()  # who runs after whom changes too
        for runner in order:
            for bs, x, iters in ((1, inputs.bs1, iters1), (BATCH, inputs.bs8, iters8)):
                runner.predict(x)
                for _ in range(iters):
                    t0 = clock()
                    runner.predict(x)
                    samples[runner.key][bs].append(clock() - t0)
        if rnd == 0 or (rnd + 1) % max(1, rounds // 5) == 0:
            log(f"  timing round {rnd + 1}/{rounds}")
    out = {}
    for key, by_bs in samples.items():
        lat = _stats([s * 1e3 for s in by_bs[1]])
        thr = _stats([BATCH / s for s in by_bs[BATCH]])
        out[key] = {"bs1_ms": lat, f"bs{BATCH}_img_s": thr}
    return out


def ratios(rows: dict[str, dict]) -> None:
    """Add speed-up vs the baseline and ratios to OpenVINO at the same precision (in place)."""
    base = rows.get(BASELINE, {})
    tkey = f"bs{BATCH}_img_s"
    for key, row in rows.items():
        if "bs1_ms" not in row:
            continue
        lat, thr = row["bs1_ms"]["median"], row[tkey]["median"]
        if "bs1_ms" in base:
            row["speedup_bs1"] = base["bs1_ms"]["median"] / lat
            row[f"speedup_bs{BATCH}"] = thr / base[tkey]["median"]
        ov = rows.get(f"ov-{row['precision']}", {})
        if "bs1_ms" in ov:
            row["vs_ov_bs1_latency"] = lat / ov["bs1_ms"]["median"]
            row[f"vs_ov_bs{BATCH}_throughput"] = thr / ov[tkey]["median"]


# --------------------------------------------------------------------------------------------
# Machine facts
# --------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> dict[str, bool]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return {f: f in have for f in CPU_FLAGS}
    except OSError:
        pass
    return {}


def versions() -> dict[str, str | None]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "torchvision", "torchao", "numpy", "onnx", "onnxruntime", "onnxscript", "openvino", "nncf"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def _err(value) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value * 100:.3f}%" if value < 0.1 else f"{value * 100:.1f}%"


def _pct(v) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _model_table(result: dict, name: str, footnotes: list[list]) -> str:
    """One timed model's rows; notes and failures become numbered footnotes."""
    tkey = f"bs{BATCH}_img_s"
    rows = result["models"][name]["rows"]
    off = result["models"].get(OFFLINE_MODEL, {}).get("rows", {}) if name == TIMED_MODEL else {}
    headers = ["runtime", "bs1 ms", "x eager", "/OV", f"bs{BATCH} img/s", "x eager", "/OV", "logit err"]
    if off:
        headers += ["L0 top1", "L0 err"]
    headers += ["build s", "notes"]
    cells = []

    def mark(label: str, text: str) -> str:  # one footnote per distinct text, naming every row it concerns
        for i, (labels, seen) in enumerate(footnotes, 1):
            if seen == text:
                if label not in labels:
                    labels.append(label)
                return f"[{i}]"
        footnotes.append([[label], text])
        return f"[{len(footnotes)}]"

    for runtime, precision in RUNTIMES:
        key = f"{runtime}-{precision}"
        if key not in rows:
            continue
        r, o = rows[key], off.get(key, {})
        marks = []
        if r.get("error"):
            line = ["FAILED"] + ["-"] * 6
            marks.append(mark(f"{LABELS[runtime]} {precision}", r["error"]))
        else:
            line = [num(r.get("bs1_ms", {}).get("median"), 2), num(r.get("speedup_bs1"), 2),
                    num(r.get("vs_ov_bs1_latency"), 2), num(r.get(tkey, {}).get("median"), 1),
                    num(r.get(f"speedup_bs{BATCH}"), 2), num(r.get(f"vs_ov_bs{BATCH}_throughput"), 2),
                    "ref" if key == BASELINE else _err(r.get("rel_err"))]
            marks += [mark(f"{LABELS[runtime]} {precision}", n) for n in r.get("notes", [])]
        if off:
            if o.get("error"):
                line += ["FAILED", "-"]
                marks.append(mark(f"EfficientNet-Lite0 {LABELS[runtime]} {precision}", o["error"]))
            else:
                line += ["ref", "ref"] if key == BASELINE else [_pct(o.get("top1_agree")), _err(o.get("rel_err"))]
                marks += [mark(f"EfficientNet-Lite0 {LABELS[runtime]} {precision}", n)
                          for n in o.get("notes", []) if n not in r.get("notes", [])]
        cells.append([f"{LABELS[runtime]} {precision}"] + line + [num(r.get("build_s"), 0), " ".join(marks)])
    title = {TIMED_MODEL: "ResNet-18 (seeded weights)", OFFLINE_MODEL: "EfficientNet-Lite0 (real weights)"}.get(name, name)
    return table(headers, cells, title=f"{title}, 224x224: batch 1 latency, batch {BATCH} throughput (medians)")


def format_table(result: dict) -> str:
    """The fixed-width text report of a ``run`` result."""
    host, s = result["host"], result["settings"]
    flags = ", ".join(f for f, on in host["cpu_flags"].items() if on and f not in ("avx2", "avx512f")) or "none"
    lines = [
        f"Engine benchmark {result['date']}: {host['cpu_model']} ({flags}; oneDNN native bf16: "
        f"{'yes' if host['onednn_native_bf16'] else 'no'}), {result['threads']} threads for every runtime",
        "  " + "  ".join(f"{k} {v}" for k, v in result["versions"].items() if v),
        f"  timing: {s['rounds']} round-robin rounds x ({s['iters_bs1']} bs1 + {s['iters_bs8']} bs{BATCH}) timed calls "
        f"per runtime{' (--quick)' if s['quick'] else ''}",
    ]
    for name, ld in result.get("load", {}).items():
        busy = ld["loadavg_1min_after"]  # includes this run's own ~threads
        if busy > (host["cpu_count"] or 1) + 1:
            lines.append(f"  WARNING: load average {busy:.1f} on {host['cpu_count']} CPUs after timing {name}: other work "
                         f"was running. Torch's OpenMP threads (active spin-waits) slow down far more than ORT's or "
                         f"OV's under contention, so the ratios are biased against torch: rerun on a quiet machine.")
    footnotes: list[list] = []  # [[row labels], text]
    timed = [m for m in result["models"] if result["models"][m].get("timed")]
    for name in timed:
        lines += ["", _model_table(result, name, footnotes)]
    lines += ["",
              "x eager: speed-up over eager fp32 (bs1: its latency / this one; bs8: this throughput / its).",
              "/OV: ratio to OpenVINO at the same precision: bs1 latency ratio (lower is better), "
              "bs8 throughput ratio (higher is better).",
              f"logit err: max|logits - eager fp32| / max|eager fp32| over the {len(result['photos'])} shared photos."]
    if TIMED_MODEL in timed and OFFLINE_MODEL in result["models"]:
        lines.append(f"L0 top1, L0 err: EfficientNet-Lite0 (real weights): top-1 agreement with its eager fp32 on "
                     f"{result['models'][OFFLINE_MODEL]['fidelity_photos']} photos (shared + crops/flips/rescales), "
                     f"and its logit error as above.")
    for name, m in result["models"].items():
        if m.get("timed") or (name == OFFLINE_MODEL and TIMED_MODEL in timed):
            continue
        lines += ["", f"{name}: fidelity only ({m.get('fidelity_photos')} photos for top-1)"]
        for key, r in m["rows"].items():
            msg = f"FAILED: {r['error']}" if r.get("error") else f"top1 {_pct(r.get('top1_agree'))}, err {_err(r.get('rel_err'))}"
            lines.append(f"  {key:<12} {msg}")
    for name, m in result["models"].items():
        if (m.get("onnx_export") or "").startswith("failed"):
            lines.append(f"{name}: ONNX export {m['onnx_export']}")
    if footnotes:
        lines += [""] + [f"[{i}] {', '.join(labels)}: {text}" for i, (labels, text) in enumerate(footnotes, 1)]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 3 rounds of few calls, 32 fidelity photos (< 3 min on 2 quiet cores, warm caches)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON here")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads for every runtime; 0: the cores this process may use")
    parser.add_argument("--rounds", type=int, help="round-robin timing rounds (None: 8; --quick 3)")
    parser.add_argument("--iters-bs1", type=int, help="timed bs1 calls per runtime per round (None: 10; --quick 4)")
    parser.add_argument("--iters-bs8", type=int, help="timed bs8 calls per runtime per round (None: 4; --quick 2)")
    parser.add_argument("--fidelity-photos", type=int,
                        help="photos for top-1 agreement: the shared ones + generated variants (None: 256; --quick 32)")
    parser.add_argument("--runtimes", default="all",
                        help="comma-separated subset of: " + ",".join(f"{r}-{p}" for r, p in RUNTIMES)
                             + " (eager-fp32, the reference, always runs)")
    parser.add_argument("--time-offline", action="store_true", help="also time EfficientNet-Lite0 (default: fidelity only)")
    parser.add_argument("--no-offline", action="store_true", help="skip EfficientNet-Lite0 altogether")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated photo variants")
    parser.add_argument("--workdir", type=Path, help="where ONNX files go (default: a temporary directory)")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "photo-classifier"),
                        help="ours: inductor kernels (unless TORCHINDUCTOR_CACHE_DIR is set) and int8 programs are "
                             "kept here across runs, as the service keeps them ('' quantizes int8 afresh every run)")
    return parser


def run(args: argparse.Namespace) -> dict:
    """Build every runtime, measure, print the table; return every number (JSON-serialisable)."""
    t_start = time.perf_counter()
    defaults = vars(add_arguments(argparse.ArgumentParser()).parse_args([]))
    args = argparse.Namespace(**{**defaults, **vars(args)})  # a caller's Namespace may lack some options
    quick = bool(args.quick)
    rounds = args.rounds or (3 if quick else 8)
    iters1 = args.iters_bs1 or (4 if quick else 10)
    iters8 = args.iters_bs8 or (2 if quick else 4)
    n_fid = args.fidelity_photos or (32 if quick else 256)
    if not logging.getLogger().handlers:  # the engine says where its int8 program came from, and compile times
        logging.basicConfig(level=logging.WARNING, format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("webapp").setLevel(logging.INFO)
    affinity_before = sorted(os.sched_getaffinity(0))
    threads = engine_mod.configure_threads(args.threads or len(affinity_before))
    keys = [f"{r}-{p}" for r, p in RUNTIMES]
    if args.runtimes != "all":
        wanted = {k.strip() for k in args.runtimes.split(",") if k.strip()}
        unknown = wanted - set(keys)
        if unknown:
            raise SystemExit(f"unknown runtimes {sorted(unknown)}; known: {', '.join(keys)}")
        keys = [k for k in keys if k in wanted or k == BASELINE]

    log(f"{threads} threads, cores {affinity_before}; decoding photos")
    photos = shared_photos()
    scenes = [img for name, img in photos if not name.startswith("phone")] or [img for _, img in photos]
    extra = augmented(scenes, max(0, n_fid - len(photos)), seed=args.seed)  # the phone photos are dog.jpg again

    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "onednn_native_bf16": engine_mod.native_bf16(),
                 "int8_vnni": engine_mod.int8_vnni() if hasattr(engine_mod, "int8_vnni") else None,
                 "cores_allowed": affinity_before, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                 "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "GOMP_", "ONEDNN_"))}},
        "threads": threads,
        "versions": versions(),
        "settings": {"quick": quick, "rounds": rounds, "iters_bs1": iters1, "iters_bs8": iters8,
                     "fidelity_photos": len(photos) + len(extra), "seed": args.seed, "runtimes": keys,
                     "batch": BATCH, "opset_requested": OPSET},
        "photos": [n for n, _ in photos],
        "models": {},
        "configs": {},
        "load": {},
    }
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else None
    if cache_dir:  # as the service does: its compiled kernels (and our int8 programs) survive runs
        cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    result["settings"]["cache_dir"] = str(cache_dir) if cache_dir else None
    model_names = [TIMED_MODEL] + ([] if args.no_offline else [OFFLINE_MODEL])
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="engine-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        env = Env(threads, workdir, cache_dir)
        for name in model_names:
            loaded = models.load_model(settings.load(environ={}, overrides={"MODEL": name}))
            inputs = make_inputs(loaded, photos, extra if name == OFFLINE_MODEL else [])
            runners = build_all(loaded, inputs, env, keys)
            top1 = name == OFFLINE_MODEL
            log(f"{name}: fidelity ({len(inputs.fixed)} photos for logit error"
                + (f", {len(inputs.fidelity)} for top-1)" if top1 else ")"))
            fid = fidelity(runners, inputs, top1=top1)
            timed = name == TIMED_MODEL or args.time_offline
            times = {}
            if timed:
                load_before = os.getloadavg()
                log(f"{name}: timing {sum(r.predict is not None for r in runners.values())} runtimes round-robin")
                times = timing(runners, inputs, rounds=rounds, iters1=iters1, iters8=iters8)
                result["load"][name] = {"loadavg_1min_before": load_before[0], "loadavg_1min_after": os.getloadavg()[0]}
            rows = {}
            for key, r in runners.items():
                row = {"runtime": r.runtime, "precision": r.precision, "build_s": r.build_s, "notes": r.notes}
                if r.error:
                    row["error"] = r.error
                row.update(fid.get(key, {}))
                row.update(times.get(key, {}))
                rows[key] = row
                result["configs"][f"{name}:{key}"] = r.config
            ratios(rows)
            onnx = env.onnx.get(name)
            result["models"][name] = {"rows": rows, "timed": timed, "weights": loaded.weights,
                                      "fidelity_photos": len(inputs.fidelity) if top1 else None,
                                      "onnx_export": (f"failed: {_short_error(onnx)}" if isinstance(onnx, BaseException)
                                                      else env.onnx.get(name + ":exporter"))}
            del runners, inputs
            gc.collect()
    affinity_after = sorted(os.sched_getaffinity(0))
    if affinity_after != affinity_before:
        result["host"]["affinity_changed_to"] = affinity_after
        log(f"WARNING: this process's CPU affinity changed during the run: {affinity_before} -> {affinity_after}")
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    result["table"] = format_table(result)
    print(result["table"])
    print(f"\n(wall time {result['wall_s']} s)")
    return result


def main(argv=None) -> int:
    bench_main(__doc__, add_arguments, run, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
