"""bench/int8_bench.py's sensitivity sweep: the blocks it quantizes one at a time."""

from __future__ import annotations

import torchvision

import torch

from bench.int8_bench import round_weights_int8, sweep_units
from webapp.efficientnet_lite import create_model


def test_sweep_units_are_each_block_in_forward_order():
    lite = sweep_units(create_model())
    # timm's EfficientNet-Lite0: the stem, its 16 MBConv blocks in 7 stages (1, 2, 2, 3, 3, 4, 1), head conv, classifier.
    assert lite == ["conv_stem", *(f"blocks.{i}.{j}" for i, n in enumerate((1, 2, 2, 3, 3, 4, 1)) for j in range(n)),
                    "conv_head", "classifier"]
    resnet = sweep_units(torchvision.models.resnet18())
    assert resnet == ["conv1", *(f"layer{i}.{j}" for i in range(1, 5) for j in range(2)), "fc"]


def test_weights_are_rounded_to_a_per_channel_int8_grid_and_nothing_else_changes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 5)).eval()
    model[0].weight.data[1] *= 100  # one channel far larger: its grid is coarser, the others' not
    rounded = round_weights_int8(model)
    for layer, orig in ((rounded[0], model[0]), (rounded[3], model[3])):
        w, r = orig.weight.data, layer.weight.data
        scale = w.abs().amax(dim=tuple(range(1, w.dim())), keepdim=True) / 127
        steps = r / scale
        assert torch.allclose(steps, steps.round(), atol=1e-4)  # on the grid: integer multiples of the scale
        assert steps.abs().max() <= 127 + 1e-4
        assert ((r - w).abs() <= scale / 2 + 1e-6).all()  # nearest grid point
        assert torch.equal(layer.bias, orig.bias)  # biases stay float32 as they were
    assert not torch.equal(rounded[0].weight, model[0].weight)  # it did round, on a copy
    assert torch.equal(rounded[1].running_var, model[1].running_var)
