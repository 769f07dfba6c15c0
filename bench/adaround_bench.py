"""AdaRound (learned int8 weight rounding) for EfficientNet-Lite0: measured, not adopted (2026-12-04).

Nagel et al., "Up or Down? Adaptive Rounding for Post-Training Quantization" (ICML 2020): each weight is
rounded down or up, not to nearest, the choice learned layer by layer to reproduce the fp32 layer's
output. Here on the grid torchao's ``X86InductorQuantizer`` uses (``PerChannelMinMaxObserver``, int8,
``per_channel_symmetric``: per output channel scale = max |w| / 127.5 of the BatchNorm-folded weight).
A BatchNorm after a conv scales each output channel by one factor, so the folded weight's grid is the
unfolded weight's grid times that factor: rounding is learned on the unfolded weight, the loss taken
after the BatchNorm and its activation (the folded layer's output, the activation as in the paper).

Recipe (the paper's, shortened for a CPU): rectified sigmoid h(V), V initialised so that h(V) is the
fractional part; loss = squared output error summed over channels, mean over positions, + lambda *
sum(1 - |2h - 1|^beta), lambda 0.01, no regularizer for the first 20% of the iterations, then beta
annealed 20 -> 2; Adam; each step a batch of 8 random images at one random 8x8 patch of output
positions. Inputs are the already-rounded preceding layers' outputs (weights rounded, activations in
float32), the target the fp32 layer's output on the fp32 input (the paper's asymmetric reconstruction).
A layer where the learned rounding does not beat nearest on all the images keeps nearest (none did here).
The result is written back as float weights ``W' = scale * q``, except each channel's max-magnitude
element, kept as it was so the observer computes the same scale; every other element is held within
[-127, 127] so it never outgrows it. The quantizer's round-to-nearest of ``W'`` then gives exactly the
learned integers (``tests/test_bench_adaround.py`` checks it with torchao's observer). AdaRound learns on
the 28 calibration photos, mirrored, and 28 random crops of them (84 images), never the fidelity views.

Then both go through the same PT2E flow (``quantize_int8``, bias correction on, 8-bit activations, the
reference eager graph with simulated q/dq) and are compared with eager fp32 on ``int8_bench``'s fidelity
set (256 inputs, 228 of them not calibration photos) with ``int8_bench.compare``. Measured 2026-12-04,
one thread, 500 iterations a layer, 50 layers (the same run gives both rows):

============  =====  ==============  ==========  =========  ============
lr            top-1  top-1 not cal.  max dp pts  logit err  AdaRound (s)
============  =====  ==============  ==========  =========  ============
nearest       93.8%  93.4%           14.1        13.5%      --
1e-3          92.6%  92.1%           12.3        11.3%      476
1e-2          94.1%  93.4%           14.9        10.7%      453
============  =====  ==============  ==========  =========  ============

Each layer's own output error on the calibration images falls (median to 0.83x of nearest's at lr 1e-2,
0.95x at 1e-3; the stem to 0.08x, ``blocks.0.0``'s convs to 0.27x and 0.23x), and the logit error falls
from 13.5% to 10.7%, but top-1 agreement does not move past a near-tie or two: the lost answers are
near-ties (the ``margin>=1pt`` agreement is 97.4% in every row), far from 98%. Not worth ~8 minutes of
quantizing on a worker's thread, so ``quantize_int8`` does not use it. Untried: activations
fake-quantized in the reconstruction's inputs, the paper's 10k+ iterations, reconstructing a whole block
at once (BRECQ).

    python bench/adaround_bench.py [--iters 500] [--lr 1e-2] [--json out.json]
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import ImageOps
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import log, main, table  # noqa: E402
from bench.inputs import BATCH, augmented  # noqa: E402
from bench.int8_bench import compare, fidelity_photos, reference  # noqa: E402
from webapp import assets, imaging  # noqa: E402
from webapp.engine import configure_threads  # noqa: E402
from webapp.quantize import quantize_int8  # noqa: E402

ZETA, GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch (the paper's)
HALF_RANGE = 127.5  # the symmetric observer's (quant_max - quant_min) / 2


class _Stop(Exception):
    pass


def layers(module: nn.Module) -> list[tuple[str, nn.Module, nn.Module | None]]:
    """``(name, conv or linear, the BatchNorm right after it or None)`` in registration (= forward) order."""
    mods = list(module.named_modules())
    out = []
    for i, (name, m) in enumerate(mods):
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nxt = next((x for _, x in mods[i + 1:] if not list(x.children()) or isinstance(x, nn.BatchNorm2d)), None)
            out.append((name, m, nxt if isinstance(nxt, nn.BatchNorm2d) else None))
    return out


def _layer_input(module: nn.Module, layer: nn.Module, images: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """What ``layer`` receives when ``module`` runs on ``images`` (the forward stops there)."""
    got = []

    def hook(_m, args):
        got.append(args[0].detach().clone())
        raise _Stop

    handle = layer.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for i in range(0, len(images), batch):
                try:
                    module(images[i:i + batch])
                except _Stop:
                    pass
    finally:
        handle.remove()
    return torch.cat(got)


def _pad(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` padded as ``conv`` pads it (timm's TF 'SAME' ``Conv2dSame`` or a static padding)."""
    if type(conv).__name__ == "Conv2dSame":
        from timm.layers import pad_same
        return pad_same(x, conv.kernel_size, conv.stride, conv.dilation)
    ph, pw = conv.padding
    return F.pad(x, (pw, pw, ph, ph))


def grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, fixed)``: the per-output-channel scale ``(C, 1, ...)`` of the observer for ``w`` (up to
    the BatchNorm factor) and the mask of each channel's max-magnitude element(s), which keep their values."""
    dims = tuple(range(1, w.dim()))
    amax = w.abs().amax(dim=dims, keepdim=True)
    return (amax / HALF_RANGE).clamp_min(torch.finfo(torch.float32).eps), w.abs() >= amax


def _h(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0, 1)


def _learn(layer: nn.Module, bn: nn.Module | None, x_q: torch.Tensor, target: torch.Tensor, *, iters: int,
           lr: float, lam: float, batch: int, patch: int, seed: int) -> tuple[torch.Tensor, float, float]:
    """The learned integers of ``layer``'s weight, and the output error (mean squared, summed over channels)
    of round-to-nearest and of AdaRound on all of ``x_q`` (``target``: the fp32 output)."""
    gen = torch.Generator().manual_seed(seed)
    w = layer.weight.detach()
    scale, fixed = grid(w)
    x = w / scale
    floor = torch.floor(x)
    rest = (x - floor).clamp(1e-4, 1 - 1e-4)
    v = (-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1)).requires_grad_(True)
    fixed_q = torch.clamp(torch.round(x), -128, 127)
    conv = isinstance(layer, nn.Conv2d)
    x_pad = _pad(layer, x_q) if conv else x_q

    def forward(weight, xs):
        if conv:
            out = F.conv2d(xs, weight, layer.bias, layer.stride, 0, layer.dilation, layer.groups)
        else:
            out = F.linear(xs, weight, layer.bias)
        return bn(out) if bn is not None else out

    def weight_of(q):
        return scale * torch.where(fixed, fixed_q, torch.clamp(q, -127, 127))

    def sample():
        idx = torch.randint(len(x_q), (min(batch, len(x_q)),), generator=gen)
        if not conv:
            return x_pad[idx], target[idx]
        oh, ow = target.shape[2:]
        ph, pw = min(patch, oh), min(patch, ow)
        oy = int(torch.randint(oh - ph + 1, (1,), generator=gen))
        ox = int(torch.randint(ow - pw + 1, (1,), generator=gen))
        (sh, sw), (kh, kw), (dh, dw) = layer.stride, layer.kernel_size, layer.dilation
        ih, iw = (ph - 1) * sh + dh * (kh - 1) + 1, (pw - 1) * sw + dw * (kw - 1) + 1
        xs = x_pad[idx, :, oy * sh:oy * sh + ih, ox * sw:ox * sw + iw]
        return xs, target[idx, :, oy:oy + ph, ox:ox + pw]

    opt = torch.optim.Adam([v], lr=lr)
    warm = int(0.2 * iters)
    for it in range(iters):
        xs, ts = sample()
        h = _h(v)
        rec = (forward(weight_of(floor + h), xs) - ts).pow(2).sum(1).mean()
        if it < warm:
            loss = rec
        else:
            beta = 2 + (20 - 2) * (1 - (it - warm) / max(1, iters - warm))
            loss = rec + lam * (1 - (2 * h - 1).abs().pow(beta)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        q = torch.where(fixed, fixed_q, torch.clamp(floor + (v >= 0).float(), -127, 127))
        nearest = torch.where(fixed, fixed_q, torch.clamp(torch.round(x), -127, 127))
        err = [_error(forward, weight_of(k), x_pad, target) for k in (nearest, q)]
    if err[1] >= err[0]:  # a short run can lose to nearest (a first layer, few inputs per output): keep nearest
        return nearest, err[0], err[0]
    return q, err[0], err[1]


def _error(forward, weight, x_pad, target, batch: int = 16) -> float:
    total = 0.0
    for i in range(0, len(x_pad), batch):
        total += float((forward(weight, x_pad[i:i + batch]) - target[i:i + batch]).pow(2).sum(1).mean()) * len(
            x_pad[i:i + batch])
    return total / len(x_pad)


def adaround(module: nn.Module, images: torch.Tensor, *, iters: int = 500, lr: float = 1e-3, lam: float = 0.01,
             batch: int = 8, patch: int = 8, seed: int = 0) -> dict:
    """AdaRound every conv and linear weight of ``module`` (eval mode, fp32) in place, in forward order (see
    the module docstring); a layer where the learned rounding does not beat round-to-nearest on ``images``
    keeps round-to-nearest. ``images``: ``(N, 3, S, S) float32``, calibration images (not the photos the result
    is measured on). Returns ``{"layers": {name: (nearest error, adaround error)}, "seconds": s}``.
    """
    t0 = time.perf_counter()
    reference = copy.deepcopy(module).eval()
    ref_layers = {name: (m, bn) for name, m, bn in layers(reference)}
    out = {}
    for k, (name, layer, bn) in enumerate(layers(module)):
        ref, ref_bn = ref_layers[name]
        x_fp = _layer_input(reference, ref, images)
        with torch.no_grad():
            y = ref(x_fp)
            target = ref_bn(y) if ref_bn is not None else y
        del x_fp
        x_q = _layer_input(module, layer, images)
        q, e_near, e_ada = _learn(layer, bn, x_q, target, iters=iters, lr=lr, lam=lam, batch=batch, patch=patch,
                                  seed=seed + k)
        scale, fixed = grid(layer.weight.detach())
        with torch.no_grad():
            layer.weight.copy_(torch.where(fixed, layer.weight, scale * q))
        out[name] = (e_near, e_ada)
        log(f"  adaround {name}: output error {e_near:.4g} nearest -> {e_ada:.4g} ({time.perf_counter() - t0:.0f} s)")
    return {"layers": out, "seconds": time.perf_counter() - t0}


def add_arguments(parser) -> None:
    """The benchmark's options (``run`` reads them)."""
    parser.add_argument("--iters", type=int, default=500, help="AdaRound iterations per layer")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdaRound's Adam learning rate")
    parser.add_argument("--photos", type=int, default=256, help="fidelity inputs in all")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")


def calibration_views(loaded) -> torch.Tensor:
    """The calibration photos, mirrored, and 28 random crops of them: ``(84, 3, S, S) float32``."""
    transform = imaging.build_transform(loaded.preprocessing)
    imgs = [imaging.decode(p.read_bytes(), max_pixels=80_000_000, name=p.name).image for p in assets.calibration_files()]
    views = imgs + [ImageOps.mirror(i) for i in imgs] + augmented(imgs, len(imgs), seed=1)
    return torch.stack([imaging.preprocess(i, transform) for i in views])


def run(args) -> dict:
    """Round-to-nearest then AdaRound through ``quantize_int8``, compared with eager fp32; print the table."""
    configure_threads(args.threads)
    photos, extra = fidelity_photos(args.photos)
    loaded, inputs, x, ref = reference("efficientnet_lite0", photos, extra)
    rows, info = {}, {}
    for key in ("nearest", "adaround"):
        module = copy.deepcopy(loaded.module)
        if key == "adaround":
            res = adaround(module, calibration_views(loaded), iters=args.iters, lr=args.lr)
            info = {"seconds": res["seconds"], "layers": res["layers"]}
            log(f"  adaround: {res['seconds']:.0f} s for {len(res['layers'])} layers")
        t0 = time.perf_counter()
        int8 = quantize_int8(module, inputs.calibration, input_size=loaded.preprocessing.crop).module()
        with torch.no_grad():
            got = torch.cat([int8(x[i:i + BATCH]) for i in range(0, len(x), BATCH)])
        rows[key] = compare(got, ref, len(inputs.fidelity))
        log(f"  {key}: top-1 {100 * rows[key]['top1_agree']:.1f}% ({time.perf_counter() - t0:.0f} s)")
    cells = [[k, f"{100 * r['top1_agree']:.1f}%", f"{100 * r['top1_agree_not_calibration']:.1f}%",
              f"{100 * r['top1_agree_margin1']:.1f}%", f"{r['max_top1_prob_change_pts']:.1f}",
              f"{100 * r['rel_err']:.2f}%"] for k, r in rows.items()]
    print(table(["int8 weights", "top1", "top1 not calib", "top1 margin>=1pt", "max dp pts", "logit err"], cells,
                title=f"efficientnet_lite0 int8 (reference graph, bias correction) vs eager fp32 on {len(x)} inputs "
                      f"({len(inputs.fidelity)} not calibration); AdaRound {args.iters} iters, lr {args.lr}, "
                      f"{info.get('seconds', 0):.0f} s on {torch.get_num_threads()} thread(s)"))
    return {"rows": rows, "adaround": info, "iters": args.iters, "lr": args.lr}


if __name__ == "__main__":
    main(__doc__, add_arguments, run)
