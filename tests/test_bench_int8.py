"""bench/int8_bench.py's sensitivity sweep: the blocks it quantizes one at a time."""

from __future__ import annotations

import torchvision

from bench.int8_bench import sweep_units
from webapp.efficientnet_lite import create_model


def test_sweep_units_are_each_block_in_forward_order():
    lite = sweep_units(create_model())
    # timm's EfficientNet-Lite0: the stem, its 16 MBConv blocks in 7 stages (1, 2, 2, 3, 3, 4, 1), head conv, classifier.
    assert lite == ["conv_stem", *(f"blocks.{i}.{j}" for i, n in enumerate((1, 2, 2, 3, 3, 4, 1)) for j in range(n)),
                    "conv_head", "classifier"]
    resnet = sweep_units(torchvision.models.resnet18())
    assert resnet == ["conv1", *(f"layer{i}.{j}" for i in range(1, 5) for j in range(2)), "fc"]
