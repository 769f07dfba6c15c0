"""webapp/quantize.py: which layers int8 quantizes (the converted program's q/dq nodes say it)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from webapp.efficientnet_lite import create_model
from webapp.quantize import quantize_int8


def _quantized(program) -> Counter:
    """The program's quantize/dequantize ops by name: one ``dequantize_per_channel`` per int8 weight."""
    return Counter(str(n.target).split(".")[1] for n in program.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("quantized_decomposed."))


@pytest.mark.slow  # three PT2E exports and calibrations: ~25 s on 2 cores
@pytest.mark.extended  # int8 is opt-in: out of the plain run, in CI's `-m extended` step
def test_int8_only_quantizes_just_the_named_blocks():
    torch.manual_seed(0)
    model = create_model().eval()
    calibration = [torch.randn(3, 224, 224) for _ in range(2)]
    stem = _quantized(quantize_int8(model, calibration, input_size=224, int8_only=("conv_stem",)))
    assert stem["dequantize_per_channel"] == 1  # the stem's weight, nothing else
    block = _quantized(quantize_int8(model, calibration, input_size=224, int8_only=("blocks.1.0",)))
    assert block["dequantize_per_channel"] == 3  # the MBConv block's expand, depthwise and project convs
    # keep_fp32 is ignored with int8_only: the named block alone, not everything but a group.
    again = quantize_int8(model, calibration, input_size=224, keep_fp32=("depthwise",), int8_only=("blocks.1.0",))
    assert _quantized(again) == block
