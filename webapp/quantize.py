"""int8: static post-training quantization through PT2E, with the layers that lose answers left in fp32.

Strict ``torch.export`` with a dynamic batch dimension (non-strict export of ResNet-18 trips the
quantizer, pytorch/ao#4478, because BasicBlock reuses one ReLU module), torchao's
``X86InductorQuantizer`` (per-channel int8 weights, per-tensor uint8 activations), calibration on
real photos, ``convert_pt2e``; inductor (``torch.compile`` or an AOTInductor package, with freezing)
then lowers the q/dq pattern to oneDNN int8 kernels. The converted program is saved to the cache
folder, so later workers skip export and calibration.

**Mixed precision** (``INT8_KEEP_FP32``): the layer groups named there are left in fp32 (the
quantizer's ``set_module_name_qconfig(name, None)``), the rest is int8. ``bench/int8_bench.py``
measures each choice (top-1 agreement with fp32 on real photos, and speed). On EfficientNet-Lite0
(no squeeze-excite in the Lite variant) no choice of layers reached the 98% target: measured 2026-11-30 with
the reference (eager, simulated) int8 graph on 256 photos, everything int8 kept 87.1% of top-1
answers; depthwise convs in fp32 91.0%; stem and head 89.8%; depthwise, stem and head 91.8%; on 128
photos, depthwise and projection convs (``conv_pwl``, which write the residual stream) 94.5%, which
leaves only the expansion 1x1 convs in int8. The loss is spread over every layer kind, so the
default stays everything int8, and int8 stays opt-in.

The per-block sweep (``bench/int8_bench.py --sweep``: one block in int8, the rest fp32, 256 photos,
2026-12-02, Zen 5) says why: a single block alone in int8 already loses up to 7.8% of top-1 answers
(``blocks.0.0`` 92.2%, ``blocks.1.0`` 94.5%, ``blocks.4.0`` 94.9%, the stem 96.9%), only 3 of 19 blocks
keep >= 99.2%, and the losses add up to 87.1% for all of them. Leaving the nine most sensitive blocks in
fp32 (stem, 0.0, 1.0, 1.1, 2.0, 3.0, 4.0, 5.0, 6.0) still gave only 94.5%, so no choice of fp32 layers
reaches 98% with this recipe (per-tensor activations calibrated by histogram; min-max observers gave
89.8% in all, 100 more calibration views 87.9%).

The weights alone already lose most of it, so no activation calibration can win it back: every conv and
linear weight rounded to int8's per-channel grid, activations left in float32 (the sweep's last row,
``bench/int8_bench.py``'s ``round_weights_int8``), keeps only 89.5% of top-1 answers (2026-12-02, same 256
photos; MSE-chosen per-channel clipping instead of the max gave 89.8%). Within ``blocks.0.0`` (eager
simulation, one rounding at a time) the depthwise weights alone cost 3.1% and the block's input on the
6/255 activation grid 3.1% (128 photos), the 1x1 projection's weights 2.3% (256 photos). What is left to try changes the rounding itself
(AdaRound-style learned rounding, bias correction), or quantization-aware fine-tuning.

**Bias correction** (``correct_bias``, on by default): rounding shifts each layer's output mean, channel by
channel, and the shifts add up from layer to layer. After ``convert_pt2e`` every conv and linear bias is
moved by the difference between fp32's per-channel output mean and int8's on the calibration photos, layer
after layer in one pass, each layer seeing the corrected ones before it (the empirical bias correction of
Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias Correction", ICCV 2019, 4.2).
EfficientNet-Lite0, everything int8, reference graph, the 228 fidelity photos that are not calibration
photos (2026-12-03, Zen 3): top-1 agreement 86.8% -> 93.0%, largest top-1 probability change 23.7 -> 14.7
points, logit error 16.5% -> 12.3%; a second pass changed nothing; with the depthwise convs in fp32,
92.1% either way. With 7-bit activations (``reduce_range``, what a CPU without VNNI runs) it helps less:
top-1 84.6% -> 85.5% (reference graph) and 82.9% -> 86.0% compiled (AVX2, where 8 bits saturate: 64.5%),
while the largest logit error grows, 16.0% -> 20.1% compiled. Kept on for both: top-1 agreement, what
a user sees, improved in every configuration measured. With it, leaving the stem and blocks 0.0 and 1.0
in fp32 (``int8_only``: the other 16 units) kept 97.4% (nine sensitive blocks in fp32: 97.8%; 8 bits,
reference graph), near the 98% target but at the cost of the high-resolution layers' int8 speed: not
the default. The speed is the same (only bias values change); quantizing takes ~5 s more. The sweep with
it (``--sweep --bits 8``, 2026-12-03): one block alone in int8 loses at most 3.5%, everything 93.8%, and
what it changes are near-ties: on the inputs whose fp32 top two are >= 1 point apart everything-int8
keeps 96.6% (every single block >= 99.6%), on those where fp32's top-1 is >= 0.5, 100% in every row.

**AdaRound** (learned up-or-down weight rounding, Nagel et al. ICML 2020; ``bench/adaround_bench.py``, which
keeps the prototype and its figures) does not reach 98% and is not used: on the quantizer's own grid, layer by
layer on the calibration photos (500 Adam steps a layer, ~8 min on one thread), then this flow with bias
correction, everything int8, 2026-12-04: top-1 93.8% -> 94.1% on 256 inputs, 93.4% -> 93.4% on the 228 that are
not calibration photos, largest top-1 probability change 14.1 -> 14.9 points, logit error 13.5% -> 10.7%
(lr 1e-3: 92.6%). Every layer's output error falls, but the answers lost are near-ties it does not win back.

**What reaches 98%** is not a choice of layers but a second opinion on those near-ties: a served int8 engine
answers every photo whose top two labels it puts under ``CLASSIFIER_INT8_RECHECK_PTS`` (3) points apart with
the fp32 model (``Engine.add_recheck``, trained weights only: ``startup.recheck_points``). EfficientNet-Lite0,
everything int8 with bias correction: top-1 agreement 93.0% -> 99.2% (``bench/int8_bench.py``'s served row;
README, int8). This module's quantization itself is unchanged by it.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch import fx, nn

from .bf16 import bf16_layers

log = logging.getLogger(__name__)

# Layer groups (see ``layer_names``) int8 leaves in fp32, chosen by bench/int8_bench.py.
INT8_KEEP_FP32: tuple[str, ...] = ()
GROUPS = ("stem", "head", "depthwise", "project")


class _Wrap(nn.Module):
    """A thin module around ``module``: strict export drops dynamo's compiled code for the class it
    traces, which would break other compiled engines of the same model in this process."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def layer_names(module: nn.Module, group: str) -> list[str]:
    """Names of ``module``'s layers in one of int8's groups (``GROUPS``; empty where the model has none).

    The same layer groups as the bf16 policy's (``bf16.bf16_layers``: ``stem``, ``head``, ``depthwise``,
    ``project``), picked by that one function so that both precisions mean the same layers by a name.

    :raises ValueError: a group int8 does not know.
    """
    if group not in GROUPS:
        raise ValueError(f"unknown int8 layer group {group!r}; known: {', '.join(GROUPS)}")
    return bf16_layers(module, group)


def quantize_int8(module: nn.Module, calibration: list[torch.Tensor], *, input_size: int,
                  reduce_range: bool = False, keep_fp32: tuple[str, ...] = INT8_KEEP_FP32,
                  int8_only: tuple[str, ...] | None = None,
                  bias_correction: bool = True) -> torch.export.ExportedProgram:
    """PT2E static int8 quantization of ``module`` (see module docstring); returns the exported, converted program
    (input ``(N, 3, S, S) float32``, N = 1..1024, output the module's logits in float32).

    ``calibration``: normalized images ``(3, S, S) float32`` (real photos), run in batches of up to 8
    to collect activation ranges. ``reduce_range``: 7-bit activations (``engine.choose_reduce_range``).
    ``keep_fp32``: layer groups left in fp32 (``layer_names``). ``int8_only``: module names of ``module``
    (``blocks.1.0``, ``conv_stem``) to quantize, everything else left in fp32 (``keep_fp32`` is then
    ignored): the per-block sensitivity sweep of ``bench/int8_bench.py --sweep``. ``bias_correction``:
    ``correct_bias`` on the calibration images (at most ``BIAS_CORRECTION_IMAGES`` of them) after conversion.

    :raises ValueError: no calibration images, or an unknown group.
    """
    from torch.export import Dim, export
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    if not calibration:
        raise ValueError("int8 needs calibration images")
    batch = Dim("batch", min=1, max=1024)  # any batch the batcher may form (max_batch_size <= 256)
    example = (torch.zeros(2, 3, input_size, input_size),)
    config = xiq.get_default_x86_inductor_quantization_config(reduce_range=reduce_range)
    quantizer = xiq.X86InductorQuantizer()
    if int8_only is not None:
        for name in int8_only:
            quantizer.set_module_name_qconfig(f"module.{name}", config)  # "module.": inside _Wrap
    else:
        quantizer.set_global(config)
        for group in keep_fp32:
            for name in layer_names(module, group):
                quantizer.set_module_name_qconfig(f"module.{name}", None)
    with torch.no_grad():
        exported = export(_Wrap(module), example, dynamic_shapes=({0: batch},), strict=True)
        prepared = prepare_pt2e(exported.module(), quantizer)
        for i in range(0, len(calibration), 8):
            prepared(torch.stack(calibration[i:i + 8]))
        reference = copy.deepcopy(prepared) if bias_correction else None  # fp32 (observers pass values through)
        converted = convert_pt2e(prepared)
        if reference is not None:
            moved = correct_bias(converted, reference, torch.stack(calibration[:BIAS_CORRECTION_IMAGES]))
            log.info("int8: bias correction moved %d of the layers' biases", moved)
        return export(converted, example, dynamic_shapes=({0: batch},), strict=True)


# Calibration images bias correction runs on, in one batch (28 ship with the package: ~0.5 GB peak for
# EfficientNet-Lite0 at 224 px; a user's larger calibration folder is capped here).
BIAS_CORRECTION_IMAGES = 64
_LAYERS = (torch.ops.aten.conv2d.default, torch.ops.aten.linear.default)


def _is_layer(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _LAYERS


def _channel_mean(out: torch.Tensor) -> torch.Tensor:
    """Per-channel mean of a conv's ``(N, C, H, W)`` or a linear's ``(N, C)`` output, float64 ``(C,)``."""
    return out.double().mean([0, 2, 3] if out.dim() == 4 else [0])


class _LayerMeans(fx.Interpreter):
    """Runs a graph, keeping the per-channel output mean of each conv and linear, in graph order."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.means: list[torch.Tensor] = []

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if _is_layer(n):
            self.means.append(_channel_mean(out))
        return out


class _CorrectBias(fx.Interpreter):
    """Runs the int8 graph; at each conv and linear, moves its bias by (fp32's mean - this output's mean)
    and passes the corrected output on, so each later layer is corrected for the ones before it."""

    def __init__(self, gm: fx.GraphModule, targets: list[torch.Tensor]):
        super().__init__(gm)
        self.targets = iter(targets)
        self.moved = 0

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if not _is_layer(n):
            return out
        shift = (next(self.targets) - _channel_mean(out)).float()
        bias = n.args[2] if len(n.args) > 2 else None
        if not (isinstance(bias, fx.Node) and bias.op == "get_attr"):
            log.debug("int8 bias correction: %s has no bias to move", n.name)
            return out
        *path, name = bias.target.split(".")
        owner = self.module
        for part in path:
            owner = getattr(owner, part)
        old = getattr(owner, name)
        new = old.detach() + shift  # a new tensor: the fp32 model may share the old one
        setattr(owner, name, nn.Parameter(new, requires_grad=False) if isinstance(old, nn.Parameter) else new)
        self.moved += 1
        return out + (shift[:, None, None] if out.dim() == 4 else shift)


def correct_bias(converted: fx.GraphModule, reference: fx.GraphModule, images: torch.Tensor) -> int:
    """Empirical bias correction of an int8 graph (see the module docstring): ``converted`` (``convert_pt2e``'s
    output) gets each conv and linear bias moved so that its per-channel output mean on ``images``
    ``(N, 3, S, S) float32`` equals ``reference``'s (the same graph in fp32: the prepared, calibrated graph
    before conversion). Layers are matched by their order in the two graphs. Returns how many biases moved
    (a layer without a bias keeps its shift).

    :raises ValueError: the two graphs do not hold the same number of conv and linear layers.
    """
    n_conv = sum(map(_is_layer, converted.graph.nodes))
    n_ref = sum(map(_is_layer, reference.graph.nodes))
    if n_conv != n_ref:
        raise ValueError(f"bias correction: {n_conv} conv/linear layers in the int8 graph, {n_ref} in fp32's")
    with torch.no_grad():
        means = _LayerMeans(reference)
        means.run(images)
        fix = _CorrectBias(converted, means.means)
        fix.run(images)
    return fix.moved


def register_int8_lowering() -> None:
    """Import what inductor needs for int8: torchao's q/dq ops (``torch.export.load`` needs them) and its
    x86 passes that lower q/dq + conv to oneDNN int8 kernels (without them a program loaded from the
    cache compiles to dequantize + fp32 conv: measured 3-4x slower)."""
    import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401


def load_or_quantize(module: nn.Module, calibration: list[torch.Tensor] | Callable[[], list[torch.Tensor]], *,
                     input_size: int,
                     cache_dir: Path | None, cache_key: str, reduce_range: bool = False,
                     keep_fp32: tuple[str, ...] = INT8_KEEP_FP32) -> nn.Module:
    """The int8 model (``quantize_int8``'s program as a module), from ``cache_dir`` when a program for
    ``cache_key`` was saved there, else quantized now and saved (written to a temporary name, renamed).
    ``calibration``: the images ``(3, S, S) float32``, or a function that makes them (called only to quantize).

    :raises ValueError: it must be quantized and there are no calibration images.
    """
    register_int8_lowering()
    path = cache_dir / f"int8-{cache_key}.pt2" if cache_dir else None
    if path and path.is_file():
        try:
            program = torch.export.load(path)
            log.info("int8 program from cache %s", path)
            return program.module()
        except Exception as exc:  # a cache from another version: rebuild it
            log.warning("ignoring int8 cache %s: %s", path, exc)
    t0 = time.perf_counter()
    calibration = calibration() if callable(calibration) else calibration
    program = quantize_int8(module, calibration, input_size=input_size, reduce_range=reduce_range,
                            keep_fp32=keep_fp32)
    log.info("int8: quantized with %d calibration images in %.1f s (%s left in fp32)", len(calibration),
             time.perf_counter() - t0, ", ".join(keep_fp32) or "nothing")
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Ends in .pt2 like the real name: torch.export.save warns about any other suffix.
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
        torch.export.save(program, tmp)
        os.replace(tmp, path)  # atomic: workers starting together never read half a file
    return program.module()
