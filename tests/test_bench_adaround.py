"""bench/adaround_bench.py's AdaRound: learned rounding beats round-to-nearest on each layer's output, and stays on the quantizer's grid."""

from __future__ import annotations

import torch
from torch import nn

from bench.adaround_bench import adaround, grid, layers


def _tiny_net() -> nn.Module:
    """A stem, a depthwise and a 1x1 conv with BatchNorm (folded by PT2E, so a channel factor on the grid), a classifier."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
                        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
                        nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
    for m in net:
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(-2, 2)  # negative factors too: the folded grid flips sign
            m.running_var.uniform_(0.5, 2.0)
    return net.eval()


def _observer_ints(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What torchao's weight observer and quantize op make of ``w``: ``(scale, int8 values)``."""
    from torchao.quantization.pt2e.observer import PerChannelMinMaxObserver

    obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.int8, quant_min=-128, quant_max=127,
                                   qscheme=torch.per_channel_symmetric)
    obs(w)
    scale, _ = obs.calculate_qparams()
    shape = (-1,) + (1,) * (w.dim() - 1)
    return scale, torch.clamp(torch.round(w * (1.0 / scale.view(shape))), -128, 127)


def test_adaround_lowers_every_layers_output_error_and_keeps_the_quantizers_grid():
    torch.set_num_threads(1)
    net = _tiny_net()
    folded_before = {name: _fold(layer, bn) for name, layer, bn in layers(net)}
    images = torch.randn(16, 3, 16, 16)
    result = adaround(net, images, iters=300, lr=1e-2, lam=1e-5, patch=4)  # lambda for errors ~1e-6
    assert set(result["layers"]) == set(folded_before)
    errors = result["layers"]
    # Every layer's output error (mean squared, on these images) is lower than round-to-nearest's.
    assert all(learned < nearest for nearest, learned in errors.values()), errors
    for name, layer, bn in layers(net):
        w = layer.weight.detach()
        scale, fixed = grid(w)
        ints = w / scale
        assert (ints[~fixed] - ints[~fixed].round()).abs().max() < 1e-3, name  # every other weight on the grid
        assert ints[~fixed].abs().max() <= 127, name
        # The quantizer sees the BatchNorm-folded weight: same scale as before, and it rounds to the learned ints.
        old_scale, _ = _observer_ints(folded_before[name])
        new_scale, q = _observer_ints(_fold(layer, bn))
        assert torch.equal(new_scale, old_scale), name
        sign = torch.ones(len(w)) if bn is None else torch.sign(bn.weight.detach())
        learned = torch.where(fixed, q * sign.view((-1,) + (1,) * (w.dim() - 1)), ints.round())
        assert torch.equal(q, learned * sign.view((-1,) + (1,) * (w.dim() - 1))), name


def _fold(layer: nn.Module, bn: nn.Module | None) -> torch.Tensor:
    w = layer.weight.detach()
    if bn is None:
        return w.clone()
    factor = bn.weight.detach() / torch.sqrt(bn.running_var + bn.eps)
    return w * factor.view((-1,) + (1,) * (w.dim() - 1))
