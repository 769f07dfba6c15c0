"""The runtimes the engine benchmark compares, each built into a ``Runner`` with one ``predict``.

``predict`` maps a float32 NCHW batch ``(N, 3, S, S)`` to float32 logits ``(N, C)`` as a numpy
array. ``build_all`` builds the requested ones in a safe order and checks each with one call.

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
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import os
import platform
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bench import log
from bench.inputs import BATCH, Inputs
from webapp import assets, bf16
from webapp import engine as engine_mod
from webapp.cpu import cpu_info

# (runtime, precision), in table order. Keys are "runtime-precision", e.g. "ov-bf16".
RUNTIMES = [("eager", "fp32"), ("ours", "fp32"), ("ours", "bf16"), ("ours", "int8"),
            ("ort", "fp32"), ("ort", "int8"), ("ov", "fp32"), ("ov", "bf16"), ("ov", "int8")]
BASELINE = "eager-fp32"
LABELS = {"eager": "eager", "ours": "ours", "ort": "ONNX Runtime", "ov": "OpenVINO"}
OPSET = 17


@dataclass
class Runner:
    """One runtime at one precision: ``predict`` (None where it failed: then ``error`` says why), its
    effective ``config``, ``build_s`` (s to build and check it) and ``notes`` for the table."""

    key: str
    runtime: str
    precision: str
    predict: Callable[[torch.Tensor], np.ndarray] | None = None
    config: dict = field(default_factory=dict)
    build_s: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    keep: object = None  # whatever must stay alive for predict (engine, session, compiled model)


def short_error(exc: BaseException) -> str:
    """``Type: message``, its first line only, at most 300 characters: an error for a table cell."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


class Env:
    """What every builder shares: threads, a scratch dir (``workdir``, the ONNX files), the int8 program
    cache (``cache_dir``, None: none), and the ONNX files (or their export errors) and OV models made so far."""

    def __init__(self, threads: int, workdir: Path, cache_dir: Path | None = None):
        self.threads = threads
        self.workdir = workdir
        self.cache_dir = cache_dir
        self.onnx: dict[str, Path | BaseException] = {}
        self.ov_fp32: dict[str, object] = {}
        self._core = None

    @property
    def core(self):
        """The ``openvino.Core``, made on first use (OpenVINO is imported only then)."""
        if self._core is None:
            import openvino as ov
            self._core = ov.Core()
        return self._core


def build_eager(loaded, inputs: Inputs, env: Env) -> Runner:
    """The baseline: a copy of the torch module, eager, under ``torch.inference_mode()``."""
    module = copy.deepcopy(loaded.module).eval()

    def predict(x):
        with torch.inference_mode():
            return module(x).numpy()
    return Runner(key="", runtime="eager", precision="fp32", predict=predict, keep=module,
                  config={"module": "as built by webapp.models.load_model, NCHW fp32", "mode": "torch.inference_mode()",
                          "torch_threads": torch.get_num_threads()})


def build_ours(loaded, inputs: Inputs, env: Env, precision: str) -> Runner:
    """``webapp.engine.Engine(compile=True)`` at ``precision`` (fp32, bf16 or int8), warmed up to ``BATCH``.

    :raises Exception: whatever compiling or quantizing raised (``build_all`` records it).
    """
    calib_id = "|".join(f"{p.name}:{p.stat().st_size}" for p in assets.calibration_files())
    kwargs = dict(input_size=loaded.preprocessing.crop, compile=True, precision=precision,
                  calibration=inputs.calibration if precision == "int8" else None, cache_dir=env.cache_dir,
                  cache_id=f"bench|{loaded.name}|{loaded.weights}|{calib_id}",
                  bf16_keep_fp32=bf16.keep_fp32_for(loaded.name))  # the model's own policy, as served
    if precision == "int8":
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
            log(f"  legacy ONNX export failed ({short_error(legacy_exc)}); trying dynamo=True")
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
    """An ONNX Runtime CPU session of the file at ``path``, and its configuration for the record."""
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
    """ONNX Runtime on our ONNX export: fp32 as exported, int8 by ``quantize_static`` (QDQ) of it.

    :raises Exception: the export's or ORT's error (``build_all`` records it).
    """
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
        notes.append(f"quant_pre_process failed ({short_error(exc)}); quantized the plain export")
        source = path
    reduce_range = not engine_mod.int8_vnni()
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
        log(f"  OV: no ONNX file ({short_error(exc)}); ov.convert_model of the torch module instead")
        size = loaded.preprocessing.crop
        model = ov.convert_model(copy.deepcopy(loaded.module).eval(), example_input=torch.zeros(2, 3, size, size),
                                 input=[(-1, 3, size, size)])
        source = "ov.convert_model of the torch module (ONNX export failed)"
    env.ov_fp32[loaded.name] = (model, source)
    return model, source


def build_ov(loaded, inputs: Inputs, env: Env, precision: str) -> Runner:
    """OpenVINO on CPU at ``precision`` (fp32, bf16 by the precision hint, int8 by ``nncf.quantize``).

    :raises Exception: OpenVINO's or NNCF's error (``build_all`` records it).
    """
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
        flags = cpu_info()["flags"]
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
    """Build the runners of ``keys`` (``"runtime-precision"``) in ``BUILD_ORDER``, each checked with one bs1 call.

    A failure becomes a ``Runner`` with ``error`` set (logged with its traceback), never an
    exception. Returned in ``RUNTIMES`` order.
    """
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
            log(f"  {key} FAILED: {short_error(exc)}")
            traceback.print_exc(file=sys.stderr)
            runner = Runner(key=key, runtime=runtime, precision=precision, error=short_error(exc))
            if runtime == "ort" and isinstance(env.onnx.get(loaded.name), BaseException):
                runner.error = f"ONNX export failed: {short_error(env.onnx[loaded.name])}"
        runner.key = key
        runner.build_s = round(time.perf_counter() - t0, 2)
        runners[key] = runner
        gc.collect()
    return {f"{r}-{p}": runners[f"{r}-{p}"] for r, p in RUNTIMES if f"{r}-{p}" in runners}


def versions() -> dict[str, str | None]:
    """Python's version and each runtime package's (None where it is not installed)."""
    out = {"python": platform.python_version()}
    for dist in ("torch", "torchvision", "torchao", "numpy", "onnx", "onnxruntime", "onnxscript", "openvino", "nncf"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out

