"""bench/int8_bench.py's sensitivity sweep: the blocks it quantizes one at a time, and how it scores them."""

from __future__ import annotations

import torchvision

import torch

from bench.int8_bench import compare, round_weights_int8, sweep_units
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


def test_compare_splits_agreement_by_how_sure_fp32_was():
    # Four inputs over 3 classes: a sure one (p >= 0.5) kept, a clear one (top two 10 points apart) flipped,
    # a near-tie (top two 0.1 point apart) flipped, a clear one kept.
    ref = torch.log(torch.tensor([[0.80, 0.15, 0.05], [0.45, 0.35, 0.20], [0.334, 0.333, 0.333], [0.2, 0.4, 0.4 - 0.1]]))
    got = ref.clone()
    got[1] = ref[1][[1, 0, 2]]  # class 1 now on top
    got[2] = ref[2][[1, 0, 2]]
    r = compare(got, ref, n_own=2)
    assert r["top1_agree"] == 0.5 and r["top1_agree_not_calibration"] == 0.5
    assert (r["n_p50"], r["top1_agree_p50"]) == (1, 1.0)  # only the first is sure, and kept
    assert r["n_margin1"] == 3 and abs(r["top1_agree_margin1"] - 2 / 3) < 1e-6  # the near-tie is left out; the clear flip counts
    assert abs(r["max_top1_prob_change_pts"] - 10.0) < 0.2  # the clear flip: 45% -> 35% for fp32's top-1
