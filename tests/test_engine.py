"""The compiled engine: same logits as eager, every batch size warmed, no compile after warm-up."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torchvision

from webapp import bf16
from webapp.aoti import MAX_BATCH, SharedLibrary
from webapp.engine import LOADING_PACKAGES, Engine


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
    engine.warm_batch_sizes.clear()
    engine.warm_up(1)
    assert engine.warm_batch_sizes == [1]
    out = engine.predict(torch.randn(2, 3, 224, 224))
    assert out.shape == (2, 1000) and out.dtype == torch.float32


@pytest.mark.slow  # torch.compile: ~40 s on 2 cores
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


def test_auto_precision_follows_onednn_not_cpu_flags(monkeypatch):
    from webapp import engine

    monkeypatch.setattr(engine, "native_bf16", lambda: True)
    assert engine.choose_precision("auto")[0] == "bf16"
    monkeypatch.setattr(engine, "native_bf16", lambda: False)
    precision, reason = engine.choose_precision("auto")
    assert precision == "fp32" and "emulated" in reason
    assert engine.choose_precision("int8") == ("int8", "set by CLASSIFIER_PRECISION")


@pytest.mark.parametrize("keep", [bf16.BF16_KEEP_FP32, bf16.keep_fp32_for("resnet18_seeded")],
                         ids=["default-policy", "resnet-policy"])
def test_bf16_stays_close_to_fp32(resnet, keep):
    x = torch.randn(4, 3, 224, 224)
    with torch.inference_mode():
        ref = resnet(x)
    engine = Engine(resnet, input_size=224, compile=False, precision="bf16", bf16_keep_fp32=keep)
    assert engine._fn.keep_fp32 == keep
    got = engine.predict(x)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() / ref.abs().max() < 0.03


@pytest.mark.slow  # PT2E quantization + compile: ~25 s on 2 cores
@pytest.mark.extended  # int8 is opt-in (never picked by auto): out of the plain run, in CI's `-m extended` step
def test_int8_is_calibrated_compiled_and_cached(resnet, tmp_path):
    torch.manual_seed(1)
    calibration = list(torch.randn(8, 3, 224, 224))
    x = torch.randn(3, 3, 224, 224)
    with torch.inference_mode():
        ref = resnet(x)
    engine = Engine(resnet, input_size=224, compile=True, precision="int8",
                    calibration=calibration, cache_dir=tmp_path, cache_id="seeded")
    engine.warm_up(3)
    got = engine.predict(x)
    assert (got - ref).abs().max() / ref.abs().max() < 0.08
    saved = list(tmp_path.glob("int8-*.pt2"))
    assert len(saved) == 1
    # A second worker loads the saved program: no calibration needed, same answers.
    again = Engine(resnet, input_size=224, compile=False, precision="int8",
                   calibration=[], cache_dir=tmp_path, cache_id="seeded")
    assert (again.predict(x) - got).abs().max() / got.abs().max() < 0.02


def test_int8_reduce_range_follows_vnni_as_this_process_may_use_it(monkeypatch):
    from webapp import engine

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # an old-CPU deployment: no VNNI for oneDNN
    assert not engine.int8_vnni() and engine.choose_reduce_range("auto") is True
    monkeypatch.setattr(engine, "int8_vnni", lambda: True)
    assert engine.choose_reduce_range("auto") is False
    assert engine.choose_reduce_range("on") is True and engine.choose_reduce_range("off") is False


def test_auto_picks_what_the_kernels_can_do_here():
    """Meaningful in both CI runs: uncapped, and capped to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`)."""
    import os

    from webapp import engine

    precision, reason = engine.choose_precision("auto")
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2":
        assert precision == "fp32" and "emulated" in reason  # bf16 would be ~5x slower than fp32 there
        assert engine.choose_reduce_range("auto") is True
    else:
        assert precision == ("bf16" if engine.native_bf16() else "fp32")


def tiny_net() -> torch.nn.Module:
    """A small net with the layer kinds of the served models (stem, depthwise, 1x1 head, classifier): compiles in seconds."""
    from torch import nn

    torch.manual_seed(2)
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU6(),
                         nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.ReLU6(),
                         nn.Conv2d(16, 32, 1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()


# fp32 in the plain run; bf16 and int8 go through the same packaging and loading (their own policy or
# quantization first: test_bf16.py, the int8 test above) and run with `-m extended` (CI's own step).
@pytest.mark.slow  # an AOTInductor package of a tiny net per precision: ~15 s each on 2 cores
@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.extended),
                                       pytest.param("int8", marks=pytest.mark.extended)])
def test_a_warm_cache_starts_without_compiling(precision, tmp_path, monkeypatch):
    """Every precision is packaged ahead of time on the first start; a later one loads the package (no
    export, no compile, no quantization) and answers exactly as the first."""
    from webapp import quantize

    net, size = tiny_net(), 32
    torch.manual_seed(3)
    calibration = list(torch.randn(8, 3, size, size))
    x = torch.randn(3, 3, size, size)
    kwargs = dict(input_size=size, compile=True, precision=precision, calibration=calibration, cache_dir=tmp_path,
                  cache_id="tiny")
    phases = []
    first = Engine(net, **kwargs, status=phases.append)
    assert first.backend == "aoti" and len(list(tmp_path.glob(f"aoti-{precision}-*.pt2"))) == 2  # batch 1, 2..N
    assert phases == ["compiling"]
    first.warm_up(3)
    got = first.predict(x)
    with torch.inference_mode():
        ref = net(x)
    assert got.dtype == torch.float32 and (got - ref).abs().max() / ref.abs().max() < 0.1

    def refuse(*args, **kwargs):
        raise AssertionError("a warm start compiled or quantized")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    monkeypatch.setattr(torch, "compile", refuse)
    monkeypatch.setattr(quantize, "quantize_int8", refuse)
    monkeypatch.setattr(torch.export, "load", refuse)  # int8: not even its program is loaded
    monkeypatch.setattr(torch._inductor, "aoti_load_package", refuse)  # no unzip into a folder of its own
    again = Engine(net, **{**kwargs, "calibration": []}, status=phases.append)
    assert again.backend == "aoti" and phases == ["compiling", LOADING_PACKAGES]  # what /readyz and `warm` say
    assert torch.equal(again.predict(x), got)
    # Both packages run from their libraries extracted beside them: every worker maps those same files.
    libraries = {fn.path for fn in (again._fn.one, again._fn.many) if isinstance(fn, SharedLibrary)}
    assert libraries == set(tmp_path.glob(f"aoti-{precision}-*.so")) and len(libraries) == 2
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert all(str(lib) in maps.read_text() for lib in libraries)
    # ... and they let go of the GIL while they run: a gevent worker's hub (accepting, refusing, reading
    # uploads) and its decode threads go on during a forward pass.
    assert again._fn.one.releases_gil and again._fn.many.releases_gil
    batch = x.contiguous(memory_format=torch.channels_last)
    while forward_ms(again._fn.many, batch) < 20 and 2 * len(batch) <= MAX_BATCH:  # a forward long enough to see
        batch = torch.cat([batch, batch]).contiguous(memory_format=torch.channels_last)
    assert others_run_inside(again._fn.many, batch), "the GIL was held for the whole forward pass"

    # A library damaged in place (same size and modification time: a disk fault, a crash mid-write) answered every
    # batch of 2 or more wrongly while batch 1 (the self-test) was right; one cut short killed each worker with
    # SIGBUS. Each load now checks the library against its package and extracts it again where it differs.
    def damage(path: Path, data: bytes) -> None:  # a new file under the name: this process maps the old one
        stamp = path.stat().st_mtime_ns
        path.with_suffix(".new").write_bytes(data)
        os.replace(path.with_suffix(".new"), path)
        os.utime(path, ns=(stamp, stamp))

    so, cut, alone = again._fn.many.path, again._fn.one.path, again.predict(x[:1])
    data = bytearray(so.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = bytes(4096)
    damage(so, bytes(data))
    damage(cut, cut.read_bytes()[:cut.stat().st_size // 3])
    third = Engine(net, **{**kwargs, "calibration": []})
    assert third.backend == "aoti" and torch.equal(third.predict(x), got)
    assert torch.equal(third.predict(x[:1]), alone) and so.read_bytes() != bytes(data)


def test_warm_up_with_a_sample_checks_every_batch_size_against_batch_1():
    """Batch 1 and the others run different compiled code; a fault in one answered every batched request wrongly
    while the self-test, at batch 1, passed. With a sample photo, warm-up compares them and says which differs."""
    from webapp.engine import GraphsDisagree

    class WrongWhenBatched(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            out = self.net(x)
            return out if x.shape[0] == 1 else out.flip(-1)  # another top-1 at every batch of 2 or more

    net, size = tiny_net(), 32
    sample = torch.randn(1, 3, size, size)
    assert Engine(net, input_size=size, compile=False).warm_up(4, sample=sample) >= 0
    bad = Engine(WrongWhenBatched(net), input_size=size, compile=False)
    with pytest.raises(GraphsDisagree, match="batch 2 gives other logits than batch 1") as caught:
        bad.warm_up(4, sample=sample)
    assert caught.value.batch == 2 and caught.value.off > 0.5
    assert "MAX_BATCH_SIZE=1" in bad.remedy(Path("/x"))
    Engine(WrongWhenBatched(net), input_size=size, compile=False).warm_up(4)  # no sample: not compared


class _Logits(torch.nn.Module):
    """Logits read straight off the input: row i's are ``sign * x[i, 0, 0, :C]`` (a test sets them pixel by pixel)."""

    def __init__(self, sign: float = 1.0, classes: int = 10):
        super().__init__()
        self.sign, self.classes = sign, classes

    def forward(self, x):
        return self.sign * x[:, 0, 0, :self.classes]


def test_close_calls_are_answered_by_the_recheck_engine_and_only_they():
    """int8's second opinion (``Engine.add_recheck``): a row whose top two probabilities are under ``pts`` points
    apart gets the recheck engine's logits, every other row its own; with 0 points none is rechecked."""
    from webapp.engine import GraphsDisagree

    x = torch.zeros(4, 3, 16, 16)
    x[0, 0, 0, :2] = torch.tensor([5.0, 0.0])    # sure: 98% against 0.7%
    x[1, 0, 0, :2] = torch.tensor([1.0, 0.99])   # a near-tie: 0.2 points apart
    x[2, 0, 0, :2] = torch.tensor([1.0, 0.95])   # 1.0 point apart
    x[3, 0, 0, :2] = torch.tensor([2.0, 1.0])    # 27 points apart
    main, other = Engine(_Logits(), input_size=16, compile=False), Engine(_Logits(-1.0), input_size=16, compile=False)
    own, second = main.predict(x), other.predict(x)
    main.add_recheck(other, 3.0)
    got = main.predict(x)
    assert torch.equal(got[[0, 3]], own[[0, 3]]) and torch.equal(got[[1, 2]], second[[1, 2]])
    assert main.rechecked == 2
    assert torch.equal(main.predict(x[[1]]), second[[1]]) and main.rechecked == 3  # alone, at batch 1, too
    main.warm_up(3)
    assert other.warm_batch_sizes == [1, 2, 3]  # warmed up with it: never compiling under a request
    main.add_recheck(other, 0.0)
    assert main.recheck is None and torch.equal(main.predict(x), own)

    class WrongWhenBatched(_Logits):
        def forward(self, x):
            return super().forward(x) if x.shape[0] == 1 else super().forward(x).flip(-1)

    broken = Engine(WrongWhenBatched(), input_size=16, compile=False)
    main.add_recheck(broken, 3.0)
    with pytest.raises(GraphsDisagree) as caught:  # names the recheck engine, whose files a remedy must name
        main.warm_up(3, sample=x[[1]])
    assert caught.value.engine is broken


def forward_ms(fn, x) -> float:
    """The median of 3 calls of ``fn(x)``, in ms."""
    times = []
    with torch.inference_mode():
        for _ in range(3):
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def others_run_inside(fn, x) -> bool:
    """Whether this thread runs while another thread is inside one call of ``fn(x)``.

    The GIL's switch interval is set to 100 s meanwhile, so a thread holding the GIL is never made to drop
    it. The other thread starts the call right away; this thread gets the GIL back only when that thread
    lets go of it: inside the call where ``fn`` releases it (``ctypes``), only after the call has returned
    (and recorded that it did, with nothing in between that could let go) where ``fn`` keeps it (torch's
    own AOTInductor runner). No timing decides it, only the order; the call must merely outlast this
    thread's wake-up (the caller makes it tens of ms)."""
    returned: list = []

    def call():
        with torch.inference_mode():
            returned.append(fn(x))

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    worker = threading.Thread(target=call)
    try:
        worker.start()  # returns once this thread has the GIL again
        inside = not returned
    finally:
        sys.setswitchinterval(old)
    worker.join()
    return inside


@pytest.mark.slow  # AOTInductor packaging of ResNet-18: ~30 s on 2 cores
@pytest.mark.extended  # the plain run packages the tiny net (fp32); bf16 at ResNet-18's size runs with `-m extended`
def test_bf16_is_packaged_ahead_of_time_and_reloaded(resnet, tmp_path):
    x = torch.randn(3, 3, 224, 224)
    with torch.inference_mode():
        ref = resnet(x)
    # ResNet-18's own policy, as served: BN folded into the bf16 convs by freezing, only the classifier in fp32.
    keep = bf16.keep_fp32_for("resnet18_seeded")
    first = Engine(resnet, input_size=224, compile=True, precision="bf16", cache_dir=tmp_path, cache_id="seeded",
                   bf16_keep_fp32=keep)
    assert first.backend == "aoti" and len(list(tmp_path.glob("aoti-bf16-*.pt2"))) == 2  # batch 1, 2..N
    first.warm_up(3)
    got = first.predict(x)
    assert got.dtype == torch.float32 and (got - ref).abs().max() / ref.abs().max() < 0.03
    start = time.perf_counter()
    again = Engine(resnet, input_size=224, compile=True, precision="bf16", cache_dir=tmp_path, cache_id="seeded",
                   bf16_keep_fp32=keep)
    assert time.perf_counter() - start < 10  # a later worker loads the package instead of compiling
    assert torch.allclose(again.predict(x), got, rtol=0, atol=1e-3 * float(got.abs().max()))


FRESH_INT8_START = """
import pathlib, sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
from test_engine import tiny_net
from webapp.engine import Engine

def no_photos():
    raise AssertionError("a start with a package decoded its calibration photos")

engine = Engine(tiny_net(), input_size=32, compile=True, precision="int8", calibration=no_photos,
                cache_dir=pathlib.Path({cache!r}), cache_id="tiny")
assert engine.backend == "aoti", engine.backend
assert not [m for m in sys.modules if m.startswith("torchao")], "a package start imported torchao"
torch.save(engine.predict(torch.load({x!r})), {out!r})
"""


@pytest.mark.slow  # an int8 AOTInductor package of a tiny net (~20 s on 2 cores), then a fresh process
@pytest.mark.extended  # int8 is opt-in: with the other int8 checks in CI's `-m extended` step
def test_an_int8_package_starts_without_torchao_or_its_photos(tmp_path):
    """A warm int8 start is a package load: in a fresh process it imports no torchao (~1.5 s of imports: its
    q/dq ops and lowering passes are compiled into the package) and decodes no calibration photo (~0.5 s),
    and answers exactly as the process that built the package."""
    import subprocess
    import sys
    from pathlib import Path

    torch.manual_seed(3)
    first = Engine(tiny_net(), input_size=32, compile=True, precision="int8",
                   calibration=lambda: list(torch.randn(8, 3, 32, 32)), cache_dir=tmp_path, cache_id="tiny")
    assert first.backend == "aoti"
    x = torch.randn(3, 3, 32, 32)
    torch.save(x, tmp_path / "x.pt")
    tests = Path(__file__).parent
    code = FRESH_INT8_START.format(root=str(tests.parent), tests=str(tests), cache=str(tmp_path),
                                   x=str(tmp_path / "x.pt"), out=str(tmp_path / "out.pt"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), first.predict(x))


def test_eager_warm_up_runs_sizes_1_2_and_the_largest_and_says_how_far_it_is(monkeypatch, caplog):
    """Eager compiles nothing: warming every size 1..256 ran ~33,000 images (over 10 min on 2 cores; tryout22,
    no line in the log meanwhile). It warms 1, 2 and the largest, as the packages do; a long warm-up logs how
    far it is every ``PROGRESS_S`` s."""
    import logging

    from webapp import engine as engine_mod

    seen = []
    engine = Engine(_Logits(), input_size=16, compile=False)
    real = engine.predict
    monkeypatch.setattr(engine, "predict", lambda x: seen.append(x.shape[0]) or real(x))
    monkeypatch.setattr(engine_mod, "PROGRESS_S", 0.0)  # every size a line, but the last (the end says it)
    with caplog.at_level(logging.INFO, logger="webapp.engine"):
        engine.warm_up(256, sample=torch.rand(1, 3, 16, 16))
    assert seen == engine.warm_batch_sizes == [1, 2, 256]
    said = [r.getMessage() for r in caplog.records if r.name == "webapp.engine"]
    assert [m.split(" done")[0] for m in said] == ["warm-up: batch sizes up to 1 of 256",
                                                   "warm-up: batch sizes up to 2 of 256"]


def test_missing_compiler_is_one_line_saying_what_to_do(monkeypatch):
    """No C++ compiler: the line a start that must compile fails with (tryout23: a ~100-line traceback from warm);
    None where inductor finds one (this suite compiles elsewhere, so it has one)."""
    import torch._inductor.config as inductor_config

    from webapp.engine import missing_compiler

    assert missing_compiler() is None
    before = inductor_config.cpp.cxx
    monkeypatch.setenv("CXX", "/bin/false")
    with inductor_config.patch({"cpp.cxx": ("/bin/false",)}):  # restored after (monkeypatch deleted the key)
        said = missing_compiler()
    assert inductor_config.cpp.cxx == before
    assert said.startswith("no C++ compiler found (/bin/false, as CXX names it)") and "\n" not in said
    assert "apt-get install g++" in said and said.endswith("CLASSIFIER_COMPILE=0 serves the model uncompiled")
