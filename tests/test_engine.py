"""The compiled engine: same logits as eager, every batch size warmed, no compile after warm-up."""

import pytest
import torch
import torchvision

from webapp.engine import Engine


@pytest.fixture
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


@pytest.fixture(autouse=True)
def default_stance():
    yield
    torch.compiler.set_stance("default")  # warm_up leaves fail_on_recompile on: don't leak it


def test_eager_engine_shapes(resnet):
    engine = Engine(resnet, input_size=224, compile=False)
    engine.warm_up(3)
    assert engine.warm_batch_sizes == [1, 2, 3]
    out = engine.predict(torch.randn(2, 3, 224, 224))
    assert out.shape == (2, 1000) and out.dtype == torch.float32


def test_compiled_matches_eager_and_never_recompiles(resnet):
    x = torch.randn(3, 3, 224, 224)
    with torch.inference_mode():
        expected = resnet(x)
    engine = Engine(resnet, input_size=224, compile=True)
    engine.warm_up(3)
    for n in (1, 2, 3):
        got = engine.predict(x[:n])
        rel = (got - expected[:n]).abs().max() / expected[:n].abs().max()
        assert rel < 1e-3, (n, float(rel))
    with pytest.raises(Exception, match="(?i)recompil"):
        engine.predict(torch.randn(1, 3, 160, 160))  # a new shape would compile on a request: refused
