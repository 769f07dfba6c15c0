"""The bf16 policy (which layers stay fp32, fp32 logits) and the start-up judgement of its fidelity (webapp/bf16.py)."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch
import torchvision

from webapp import bf16, catalog
from webapp.efficientnet_lite import create_model


@pytest.fixture(scope="module")
def lite0():
    torch.manual_seed(0)
    return create_model().eval()


def test_layer_groups_of_both_architectures(lite0):
    assert bf16.bf16_layers(lite0, "stem") == ["conv_stem"]
    assert bf16.bf16_layers(lite0, "head") == ["conv_head", "classifier"]
    assert len(bf16.bf16_layers(lite0, "depthwise")) == 16
    # The first three stages (112, 56, 28 px): 5 depthwise convs.
    assert bf16.bf16_layers(lite0, "early_depthwise") == [
        "blocks.0.0.conv_dw", "blocks.1.0.conv_dw", "blocks.1.1.conv_dw", "blocks.2.0.conv_dw", "blocks.2.1.conv_dw"]
    assert len(bf16.bf16_layers(lite0, "bn")) == 49  # stem, head, 2 in the first block, 3 in each of the other 15
    resnet = torchvision.models.resnet18()
    assert bf16.bf16_layers(resnet, "stem") == ["conv1"] and bf16.bf16_layers(resnet, "head") == ["fc"]
    assert bf16.bf16_layers(resnet, "depthwise") == [] and bf16.bf16_layers(resnet, "se") == []
    with pytest.raises(ValueError, match="unknown bf16 layer group 'fc'"):
        bf16.bf16_layers(resnet, "fc")


def test_policy_runs_kept_layers_in_fp32_and_returns_fp32_logits(lite0):
    dtypes = {}

    def record(name):
        return lambda module, args, out: dtypes.__setitem__(name, out.dtype)

    for name in ("conv_stem", "blocks.1.0.conv_dw", "blocks.1.0.conv_pw", "blocks.5.0.conv_dw", "conv_head",
                 "classifier"):
        lite0.get_submodule(name).register_forward_hook(record(name))
    policy = bf16.bf16_policy(lite0)
    with torch.inference_mode():
        out = policy(torch.randn(2, 3, 224, 224))
    assert out.dtype == torch.float32 and out.shape == (2, 1000)
    assert dtypes == {"conv_stem": torch.float32, "blocks.1.0.conv_dw": torch.float32, "conv_head": torch.float32,
                      "classifier": torch.float32,  # kept in fp32...
                      "blocks.1.0.conv_pw": torch.bfloat16, "blocks.5.0.conv_dw": torch.bfloat16}  # ...the rest bf16
    # The model itself is untouched (an fp32 engine may share it) and the weights are shared, not copied.
    assert not any(isinstance(m, bf16._Fp32) for m in lite0.modules())
    assert policy.module.conv_stem.module.weight is lite0.conv_stem.weight


def test_each_model_has_its_own_policy():
    """ResNet-18 keeps only its classifier in fp32 (BN folds into its bf16 convs); Lite0, and any model the
    sweep has not measured, the default policy; every catalog model's policy keeps the classifier and names known groups."""
    assert bf16.keep_fp32_for("resnet18") == bf16.keep_fp32_for("resnet18_seeded") == ("head",)
    assert bf16.keep_fp32_for("efficientnet_lite0") == bf16.keep_fp32_for("another") == bf16.BF16_KEEP_FP32
    for keep in {bf16.keep_fp32_for(name) for name in catalog.NAMES}:
        assert "head" in keep  # the classifier in fp32: the logits never carry bf16's rounding ties
        for group in keep:
            bf16.bf16_layers(torchvision.models.resnet18(), group)  # a known group (raises ValueError if not)


def test_folded_bn_gives_fp32_logits_of_the_model_and_leaves_an_untraceable_one_as_it_is(lite0):
    torch.manual_seed(0)
    resnet = torchvision.models.resnet18().eval()
    for bn in (m for m in resnet.modules() if isinstance(m, torch.nn.BatchNorm2d)):  # statistics a fold must honour
        bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2.0), bn.weight.data.uniform_(0.5, 1.5)
    folded = bf16.folded_bn(resnet)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in resnet.modules())  # a copy: the model is untouched
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        ref, got = resnet(x), folded(x)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert bf16.bf16_layers(folded, "head") == ["fc"]  # the policy finds its groups in the folded copy
    assert bf16.folded_bn(lite0) is lite0  # timm's EfficientNet has control flow torch.fx cannot trace


@pytest.mark.parametrize("keep, folded", [(("head",), True), (bf16.BF16_KEEP_FP32, False)], ids=["bn-to-bf16", "bn-fp32"])
def test_judge_bf16_judges_the_policy_as_compiled(monkeypatch, keep, folded):
    """Where the policy leaves BN to bf16, inductor's freezing folds it into the bf16 convs: the judgement
    measures the policy with BN folded as well, not the eager model with BN in fp32 it would never serve."""
    given = []
    policy = bf16.bf16_policy
    monkeypatch.setattr(bf16, "bf16_policy", lambda module, keep_fp32=bf16.BF16_KEEP_FP32: (
        given.append((tuple(keep_fp32), any(isinstance(m, torch.nn.BatchNorm2d) for m in module.modules())))
        or policy(module, keep_fp32)))
    torch.manual_seed(0)
    bf16.judge_bf16(torchvision.models.resnet18().eval(), torch.randn(2, 3, 64, 64), runs=1, keep_fp32=keep)
    assert given[0] == (keep, not folded)  # the judged policy
    assert given[1] == ((), True)  # plain autocast for the speed part, as before


def test_ties_count_equal_probabilities_at_the_answers_6_decimals():
    probs = torch.tensor([[0.371, 0.371, 0.1, 0.158],         # a tie at the top
                          [0.5, 0.2, 0.2, 0.1],               # a tie at 2nd/3rd
                          [0.5, 0.3, 0.1, 0.1],               # a tie at 3rd/4th: outside the top 3
                          [0.4, 0.3999999, 0.1, 0.1000001]])  # 1e-7 apart: equal once rounded
    assert bf16.ties(probs) == 3


def test_fidelity_figures():
    ref = torch.tensor([[4.0, 1.0, 0.0], [0.0, 1.0, 1.2], [2.0, 0.0, -0.5]])
    got = torch.tensor([[4.0, 1.0, 0.0], [0.0, 1.3, 1.2], [2.1, 0.0, -0.5]])
    fig = bf16.fidelity(ref, got)
    p_ref, p_got = ref.softmax(1), got.softmax(1)
    assert fig["n"] == 3 and fig["top1_agree"] == pytest.approx(2 / 3)
    assert fig["sure_n"] == 2 and fig["sure_agree"] == 1.0  # row 2 (fp32 at 0.42) is the one that changed
    changes = [0.0, abs(p_got[1, 2] - p_ref[1, 2]) * 100, abs(p_got[2, 0] - p_ref[2, 0]) * 100]
    assert fig["max_change_pts"] == pytest.approx(float(max(changes)), abs=1e-4)
    assert fig["mean_change_pts"] == pytest.approx(float(sum(changes) / 3), abs=1e-4)
    assert fig["ties"] == 0 and fig["logit_err"] == pytest.approx(0.3 / 4)
    assert not bf16.faithful(fig) and bf16.faithful(bf16.fidelity(ref, ref + 1e-3))


class Scripted(torch.nn.Module):
    """A model whose run times (on a fake clock) and logits are set per precision: fp32, or under bf16 autocast.

    Input row i (its first value) gets logits row i; only the timed calls cost time (``timed`` says which)."""

    def __init__(self, clock: list, times: dict, logits: dict):
        super().__init__()
        self.clock, self.times, self.logits, self.calls = clock, {k: list(v) for k, v in times.items()}, logits, []

    def forward(self, x):
        kind = "bf16" if torch.is_autocast_enabled("cpu") else "fp32"
        self.calls.append(kind)
        # The fidelity pass (fp32: 2 calls, the policy: 2) and the first call of each kind on the timed photos
        # are not timed.
        if len(self.calls) > 6:
            self.clock[0] += self.times[kind].pop(0)
        return self.logits[kind][x[:, 0, 0, 0].long()].clone()


# Rows 1, 2, 4: fp32 is sure (>= 0.5); row 3: a near tie in fp32 (0.6 points apart).
REF = torch.tensor([[10.0, 2.0, -3.0, 0.0], [1.0, 9.0, 7.0, -2.0], [0.0, 5.0, 5.012, 0.0], [3.0, 0.0, -1.0, 0.5]])


@pytest.mark.parametrize("fp32_s, bf16_s, bf16_logits, ok, words", [
    ([30, 31, 90], [20, 20, 60], REF + 0.01, True, ("top-1 agreement 100.0% (100% of 3 with fp32 >= 50%), top-1 "
                                                    "probability change max 0.00 points, 0 ties; bf16 kernels 1.55x fp32")),
    ([11, 11, 11], [10, 10, 10], REF, True, "bf16 kernels 1.10x fp32"),
    ([10.5, 10.5, 10.5], [10, 10, 10], REF, False, "bf16 kernels 1.05x fp32"),
    ([30, 30, 30], [10, 10, 10], REF + torch.tensor([[0.0, 0, 0, 0], [0, 0, 0.3, 0], [0, 0, 0, 0], [0, 0, 0, 0]]), False,
     "top-1 probability change max 3.52 points"),
    ([30, 30, 30], [10, 10, 10], REF + torch.tensor([[0.0, 0, 0, 0], [0, 0, 0, 0], [0, 0.02, 0, 0], [0, 0, 0, 0]]), False,
     "top-1 agreement 75.0% (100% of 3 with fp32 >= 50%)"),
    ([30, 30, 30], [10, 10, 10], REF + torch.tensor([[0.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 4.5, 0]]), False,
     "top-1 agreement 75.0% (67% of 3"),
    ([30, 30, 30], [10, 10, 10], torch.tensor([[10.0, 2.0, 2.0, 0.0]]).expand(4, 4), False, "4 ties"),
], ids=["faithful-fast", "exactly-1.1x-is-enough", "1.05x-too-slow", "probability-moved", "a-near-tie-flipped",
        "a-sure-one-flipped", "ties"])
def test_judge_bf16_on_agreement_probability_ties_and_median_speed(monkeypatch, fp32_s, bf16_s, bf16_logits, ok, words):
    clock = [0.0]
    monkeypatch.setattr(bf16, "time", SimpleNamespace(perf_counter=lambda: clock[0], thread_time=lambda: clock[0]))
    module = Scripted(clock, {"fp32": fp32_s, "bf16": bf16_s}, {"fp32": REF, "bf16": bf16_logits})
    photos = torch.arange(4.0)[:, None, None, None].expand(4, 3, 8, 8)  # photo i's values are all i
    got_ok, reason, fig = bf16.judge_bf16(module, photos, runs=3, speed_batch=3)
    assert got_ok is ok and words in reason, reason
    assert reason.startswith("measured on 4 calibration photos: ") and fig["photos"] == 4
    # Fidelity in batches of 3 (fp32, then the policy), an untimed first call of each kind on the timed
    # photos, then the timed calls, fp32 and autocast taking turns at going first; the median of 3 each.
    assert module.calls == ["fp32"] * 2 + ["bf16"] * 2 + ["fp32", "bf16"] + ["fp32", "bf16", "bf16", "fp32", "fp32", "bf16"]
    assert module.times == {"fp32": [], "bf16": []}


NEAR_TIE_FLIPPED = REF + torch.tensor([[0.0, 0, 0, 0], [0, 0, 0, 0], [0, 0.02, 0, 0], [0, 0, 0, 0]])
SURE_ONE_FLIPPED = REF + torch.tensor([[0.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 4.5, 0]])


@pytest.mark.parametrize("fp32_s, bf16_s, bf16_logits, ok, words", [
    ([30, 30, 30], [10, 10, 10], NEAR_TIE_FLIPPED, True,
     "with 1 close call(s) (under 1 points) answered by fp32: top-1 agreement 100.0%"),
    ([12, 12, 12], [10, 10, 10], NEAR_TIE_FLIPPED, False, "bf16 kernels 1.20x fp32, 0.92x with the rechecks"),
    ([30, 30, 30], [10, 10, 10], SURE_ONE_FLIPPED, False, "with 1 close call(s) (under 1 points) answered by fp32: "
                                                          "top-1 agreement 75.0% (67% of 3"),
], ids=["near-tie-answered-by-fp32", "rechecks-eat-the-speed", "a-sure-flip-is-no-close-call"])
def test_judge_bf16_judges_the_policy_as_served_with_its_rechecks(monkeypatch, fp32_s, bf16_s, bf16_logits, ok, words):
    """With ``recheck_pts`` the judgement sees what the server answers: the policy's close calls (top two under
    that many points apart) take fp32's logits, and their fp32 passes count against the speed (a quarter of the
    photos rechecked at 1.2x: 1 / (1/1.2 + 0.25) = 0.92x). Without them the near-tie case fails (above)."""
    clock = [0.0]
    monkeypatch.setattr(bf16, "time", SimpleNamespace(perf_counter=lambda: clock[0], thread_time=lambda: clock[0]))
    module = Scripted(clock, {"fp32": fp32_s, "bf16": bf16_s}, {"fp32": REF, "bf16": bf16_logits})
    photos = torch.arange(4.0)[:, None, None, None].expand(4, 3, 8, 8)
    got_ok, reason, fig = bf16.judge_bf16(module, photos, runs=3, speed_batch=3, recheck_pts=1.0)
    assert got_ok is ok and words in reason, reason
    assert fig["rechecked"] == 0.25  # row 2, fp32's own near tie; the sure flip (row 3, 23 points apart) is no close call
    assert fig["served_speedup"] == pytest.approx(1 / (1 / fig["native_speedup"] + fig["rechecked"]))


def test_judge_bf16_on_borrowed_cores_gives_them_back():
    """The fidelity part may run on the server's cores (its other workers wait for it); afterwards every
    thread of the process is back on this thread's cores, with the intra-op threads as they were."""
    given = sorted(os.sched_getaffinity(0))
    if len(given) < 2:
        pytest.skip("needs 2 cores")
    threads = torch.get_num_threads()
    try:
        os.sched_setaffinity(0, given[:1])
        torch.set_num_threads(1)
        seen = []

        class Spy(torch.nn.Module):
            def forward(self, x):
                if not torch.is_autocast_enabled("cpu") and len(seen) < 2:
                    seen.append((sorted(os.sched_getaffinity(0)), torch.get_num_threads()))
                return torch.randn(len(x), 5)

        bf16.judge_bf16(Spy(), torch.randn(4, 3, 8, 8), runs=1, cores=given[:2])
        assert seen[0] == (given[:2], 2)  # the fidelity part: both cores, 2 intra-op threads
        assert torch.get_num_threads() == 1
        assert {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")} == {tuple(given[:1])}
    finally:
        torch.set_num_threads(threads)
        for t in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(t), given)


def test_judge_bf16_on_a_real_model_reports_the_documented_figures():
    torch.manual_seed(0)
    ok, reason, fig = bf16.judge_bf16(torchvision.models.resnet18().eval(), torch.randn(3, 3, 64, 64), runs=1)
    assert isinstance(ok, bool) and fig["photos"] == fig["n"] == 3
    assert re.fullmatch(r"measured on 3 calibration photos: top-1 agreement \d+\.\d% \(\d+% of \d+ with fp32 >= "
                        r"50%\), top-1 probability change max \d+\.\d\d points, \d+ ties; bf16 kernels \d+\.\d\dx fp32",
                        reason), reason
