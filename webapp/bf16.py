"""bf16 as faithful as fp32: which layers run in bf16 (the policy), and how faithful it is (the judgement).

**The policy** (``bf16_policy``): the model under ``torch.autocast("cpu", bfloat16)`` except the layer
groups it keeps in fp32 (``keep_fp32_for(model name)``), and logits always returned in fp32, so softmax
and top-k never see two labels with exactly equal (bf16-rounded) probabilities. The groups were chosen
per architecture with ``bench/fidelity_bench.py`` (``python -m bench --only fidelity``), a per-layer-group
sweep of top-1 agreement and top-1 probability change against fp32 on real photos, with the speed each
costs: the layers kept in fp32 are those where bf16 loses fidelity but that cost little time.
``BF16_KEEP_FP32``, for EfficientNet-Lite0 and any model whose catalog entry sets no other: the stem
conv, which sees the raw normalized pixels; the depthwise convs of the first three stages, few FLOPs;
the 1x1 head conv and the classifier, which make the logits; BatchNorm, applied in fp32 to the bf16
convs' outputs as eager autocast does, where inductor's freezing would otherwise fold it into bf16 conv
weights and a bf16 bias, which cost EfficientNet-Lite0 more than autocast itself. ResNet-18 keeps only
its classifier: BatchNorm and the stem kept in fp32 bought it nothing (logit error 0.34% against 0.28%
with only the classifier kept, seeded weights) and cost it 29% of its bf16 speed where AMX makes the
convs cheap.
The convs carrying most FLOPs stay bf16.
Eager (``Engine(compile=False)``), ``torch.compile`` and the AOTInductor package all run this module.

**The judgement** (``judge_bf16``): the start-up check behind ``auto`` where oneDNN claims native
bf16. On the calibration photos (real photos shipped with the package, or the user's), eager and as
served (its close calls answered by fp32, ``close_calls``): the policy's top-1 must agree with fp32's
(at least ``MIN_TOP1_AGREE``, all of those fp32 is sure of), no top-1 probability may move more than
``MAX_PROB_CHANGE_PTS``, no top-3 may hold a tie, and bf16 kernels must be at least ``MIN_NATIVE_SPEEDUP``
as fast as fp32, the rechecks' fp32 passes counted. ``fidelity`` computes those figures
(the bench uses it too, with ``MIN_SPEEDUP`` for the compiled policy).
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from .catalog import BY_NAME

# Layer groups the bf16 policy keeps in fp32 (see ``bf16_layers``), chosen by bench/fidelity_bench.py.
BF16_KEEP_FP32 = ("stem", "head", "early_depthwise", "bn")


def keep_fp32_for(model_name: str) -> tuple[str, ...]:
    """The layer groups the bf16 policy keeps in fp32 for the model ``model_name``: its catalog entry's
    ``bf16_keep_fp32`` where the sweep chose otherwise for it (ResNet-18: the classifier only), else
    ``BF16_KEEP_FP32``."""
    entry = BY_NAME.get(model_name)
    return entry.bf16_keep_fp32 if entry is not None and entry.bf16_keep_fp32 is not None else BF16_KEEP_FP32


def bf16_layers(module: nn.Module, group: str) -> list[str]:
    """Names of ``module``'s layers in one group of the bf16 policy (empty where the model has none).

    ``stem``: the first Conv2d. ``head``: the last Linear (the classifier) and, where the last Conv2d
    is 1x1 (EfficientNet's ``conv_head``), that conv. ``depthwise``: Conv2d with groups == in_channels > 1.
    ``early_depthwise``: the depthwise convs whose output is at 1/8 of the input's resolution or more
    (EfficientNet-Lite0's first three stages, 112 to 28 px: where the sweep found bf16's losses).
    ``bn``: every BatchNorm2d (timm's BatchNormAct2d with its activation), so BN is applied in fp32 to
    the bf16 conv's output, as eager autocast does, instead of being folded into bf16 conv weights and
    a bf16 bias by inductor's freezing. ``se``: squeeze-excite modules (class name contains ``SqueezeExcite``). ``project``: timm's 1x1
    projection convs (``conv_pwl``), which write the residual stream.

    :raises ValueError: an unknown group.
    """
    mods = list(module.named_modules())
    convs = [(n, m) for n, m in mods if isinstance(m, nn.Conv2d)]
    if group == "stem":
        return [n for n, _ in convs[:1]]
    if group == "head":
        linear = [n for n, m in mods if isinstance(m, nn.Linear)][-1:]
        conv = [n for n, m in convs[-1:] if m.kernel_size == (1, 1) and n not in [c for c, _ in convs[:1]]]
        return conv + linear
    if group == "depthwise":
        return [n for n, m in convs if m.groups > 1 and m.groups == m.in_channels]
    if group == "early_depthwise":
        early, stride = [], 1
        for n, m in convs:
            if m.kernel_size != (1, 1):  # the strides of a chain of kxk convs (1x1 ones are shortcuts' or pointwise)
                stride *= m.stride[0]
            if m.groups > 1 and m.groups == m.in_channels and stride <= 8:
                early.append(n)
        return early
    if group == "bn":
        return [n for n, m in mods if isinstance(m, nn.BatchNorm2d)]
    if group == "se":
        return [n for n, m in mods if "SqueezeExcite" in type(m).__name__]
    if group == "project":
        return [n for n, _ in convs if n.endswith("conv_pwl")]
    raise ValueError(f"unknown bf16 layer group {group!r}")


class _Fp32(nn.Module):
    """One layer the bf16 policy keeps in fp32: autocast off, its input cast up (a bf16 activation is exact in fp32)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.module(x.float())


def _wrapped(module: nn.Module, names: list[str]) -> nn.Module:
    """A copy of ``module``'s tree with the layers ``names`` in ``_Fp32``; the weights are shared, not copied
    (``module`` itself is left as it was: an fp32 engine of the same model may use it)."""
    if not names:
        return module
    new = copy.copy(module)
    new._modules = dict(module._modules)
    below: dict[str, list[str]] = {}
    for name in names:
        head, _, rest = name.partition(".")
        below.setdefault(head, []).append(rest)
    for head, rests in below.items():
        child = module._modules[head]
        new._modules[head] = _Fp32(child) if "" in rests else _wrapped(child, [r for r in rests if r])
    return new


class _Bf16(nn.Module):
    """The bf16 policy: ``module`` under bf16 autocast except the layers of ``keep_fp32`` (``bf16_layers``),
    logits back in fp32 (so softmax and top-k never see bf16 rounding ties): ``(N, 3, S, S) float32 ->
    (N, C) float32``. The graph both the JIT path compiles and the AOTInductor package is built from."""

    def __init__(self, module: nn.Module, keep_fp32: tuple[str, ...] = BF16_KEEP_FP32):
        super().__init__()
        self.keep_fp32 = tuple(keep_fp32)
        self.module = _wrapped(module, [n for g in self.keep_fp32 for n in bf16_layers(module, g)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.module(x)
        return y.float()  # outside autocast: strict dtype checks in export trip over it inside


def bf16_policy(module: nn.Module, keep_fp32: tuple[str, ...] = BF16_KEEP_FP32) -> nn.Module:
    """``module`` as bf16 runs it: ``(N, 3, S, S) float32 -> (N, C) float32`` logits, the layer groups
    ``keep_fp32`` (see ``bf16_layers``) in fp32, the rest under bf16 autocast. Shares ``module``'s weights.

    :raises ValueError: an unknown group.
    """
    return _Bf16(module, keep_fp32)


# The fidelity bf16 must keep (issue #14 target 1) and the speed it must buy, for ``auto`` to choose it.
MIN_TOP1_AGREE = 0.99         # share of photos whose top-1 equals fp32's (all of them where fp32 is >= 0.5 sure)
SURE = 0.5                    # fp32 top-1 probability from which the top-1 must never change
MAX_PROB_CHANGE_PTS = 2.0     # largest change of the fp32 top-1 class's probability, percentage points
MIN_SPEEDUP = 1.3             # the policy's compiled images/s over compiled fp32's (the bench's target)
MIN_NATIVE_SPEEDUP = 1.1      # eager bf16 autocast over eager fp32 at start-up: bf16 kernels native and fast here


def ties(probs: torch.Tensor, k: int = 3, decimals: int = 6) -> int:
    """How many rows of ``probs`` ``(N, C) float32`` have two equal probabilities among their top ``k``
    once rounded to ``decimals`` (as ``models.encode`` answers them): the rounding ties bf16 logits make."""
    top = torch.topk(probs.float(), k=min(k, probs.shape[1]), dim=1).values
    rounded = torch.round(top * 10**decimals)
    return int((rounded[:, 1:] == rounded[:, :-1]).any(dim=1).sum())


def close_calls(logits: torch.Tensor, pts: float) -> torch.Tensor:
    """Rows of ``(N, C)`` logits whose two most probable labels are under ``pts`` percentage points apart (softmax):
    ``(K,) int64`` row indices, the ones ``Engine``'s ``recheck`` answers in fp32 (also ``judge_bf16``'s and
    ``bench/fidelity_bench.py``'s)."""
    top2 = logits.float().softmax(1).topk(2, dim=1).values
    return ((top2[:, 0] - top2[:, 1]) * 100 < pts).nonzero()[:, 0]


def fidelity(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """How faithful logits ``got`` are to ``ref`` (both ``(N, C)``, any float dtype; ref = fp32).

    Returns ``n``; ``top1_agree`` (share 0..1 whose argmax equals ref's); ``sure_n`` and
    ``sure_agree`` (the same over rows where ref's top-1 probability is >= ``SURE``; 1.0 when none);
    ``max_change_pts`` / ``mean_change_pts`` (change of the probability of ref's top-1 class,
    percentage points); ``ties`` (rows of ``got`` with a top-3 tie, see ``ties``); ``logit_err``
    (max |got - ref| / max |ref|).
    """
    ref, got = ref.float(), got.float()
    p_ref, p_got = ref.softmax(1), got.softmax(1)
    top = p_ref.argmax(1)
    agree = (p_got.argmax(1) == top)
    sure = p_ref.max(1).values >= SURE
    change = (p_got.gather(1, top[:, None]) - p_ref.gather(1, top[:, None]))[:, 0].abs() * 100
    return {"n": len(ref), "top1_agree": float(agree.float().mean()), "sure_n": int(sure.sum()),
            "sure_agree": float(agree[sure].float().mean()) if sure.any() else 1.0,
            "max_change_pts": float(change.max()), "mean_change_pts": float(change.mean()),
            "ties": ties(p_got), "logit_err": float((got - ref).abs().max() / ref.abs().max())}


def faithful(fig: dict) -> bool:
    """Whether ``fidelity``'s figures meet the targets (``MIN_TOP1_AGREE``, all sure ones kept,
    ``MAX_PROB_CHANGE_PTS``, no ties)."""
    return (fig["top1_agree"] >= MIN_TOP1_AGREE and fig["sure_agree"] == 1.0
            and fig["max_change_pts"] <= MAX_PROB_CHANGE_PTS and fig["ties"] == 0)


def folded_bn(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with each BatchNorm folded into the conv before it, in fp32 (``torch.fx``'s
    ``fuse``), as inductor's freezing folds it in the compiled graph, where the policy leaves BN to bf16;
    ``module`` itself where torch.fx cannot trace it (timm's EfficientNet: control flow; it keeps BN in
    fp32 anyway)."""
    from torch.fx.experimental.optimization import fuse

    try:
        return fuse(module)
    except Exception:  # noqa: BLE001 - any trace failure: judge the unfolded model, as before
        return module


def judge_bf16(module: nn.Module, photos: torch.Tensor, *, runs: int = 3, speed_batch: int = 8, timed_n: int = 2,
               cores: list[int] | None = None, keep_fp32: tuple[str, ...] = BF16_KEEP_FP32,
               recheck_pts: float = 0.0) -> tuple[bool, str, dict]:
    """The start-up check behind ``auto`` where oneDNN claims native bf16: is the bf16 policy faithful here,
    and are bf16 kernels really fast here?

    Eager, in batches of ``speed_batch`` of ``photos`` ``(N, 3, S, S) float32`` (the calibration photos):
    the fidelity of ``bf16_policy(module, keep_fp32)`` (the model's policy, ``keep_fp32_for``; with BN folded
    first, ``folded_bn``, where the policy leaves BN to bf16, as the compiled graph folds it) against
    ``module`` in fp32 over all N (``fidelity``, judged by ``faithful``), as it is served: the policy's close
    calls (``close_calls`` under ``recheck_pts``, ``CLASSIFIER_BF16_RECHECK_PTS``; 0: none) answered by fp32, as
    ``Engine``'s recheck answers them, on ``cores`` (the server's, borrowed while its other workers wait:
    ``cpu.borrowed_cores``, one intra-op thread per core; None: this thread's own); then speed on ``timed_n``
    photos of the last batch, back on this thread's cores and intra-op threads, plain bf16 autocast against fp32,
    ``runs`` times each, taking turns, after one untimed call each (oneDNN creates its primitives then): the
    median must be ``MIN_NATIVE_SPEEDUP`` times faster, counting the rechecks' fp32 time (``served_speedup``: a
    share r of photos rechecked costs r fp32 passes more per photo). Autocast and not the policy, because eager
    speed does not predict compiled speed for the policy (its fp32 layers cost casts that inductor fuses away:
    EfficientNet-Lite0 measured 0.88x eager, 1.42x compiled); what this catches is a host where bf16
    is emulated or slow. The policy's compiled speed is the bench's to measure (``MIN_SPEEDUP``).
    Times are this thread's CPU time with one intra-op thread (a pinned worker's usual setting; a busy
    host does not stretch it), else wall time.

    Returns ``(ok, reason, figures)``: ``figures`` is ``fidelity``'s dict plus ``native_speedup`` (fp32
    s / bf16 s), ``rechecked`` (share 0..1 of the photos answered by fp32), ``served_speedup``, ``photos`` and
    ``faithful`` (the fidelity part alone passed); ``reason`` says the figures in words. 28 photos at 224x224,
    ResNet-18, this 2-core box: 2.7 s on one core and one thread for all of it; 1.8 s with the fidelity part on
    both cores and the speed part on 2 photos instead of 4 (2026-12-01).
    """
    from .cpu import borrowed_cores

    policy = bf16_policy(module if "bn" in keep_fp32 else folded_bn(module), keep_fp32)
    fns = {"fp32": module, "policy": policy, "bf16": bf16_policy(module, ())}
    batches = [photos[i:i + speed_batch] for i in range(0, len(photos), speed_batch)]
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    with torch.inference_mode():
        with borrowed_cores(cores, len(cores or ())):
            ref = torch.cat([fns["fp32"](b).float() for b in batches])
            got = torch.cat([fns["policy"](b) for b in batches]).float()
        close = close_calls(got, recheck_pts) if recheck_pts > 0 else torch.zeros(0, dtype=torch.long)
        got[close] = ref[close]  # what the served engine answers for them: fp32's own logits
        timed = batches[-1][:timed_n]  # a few photos are enough with CPU time; a quarter of the cost of 8
        fns["fp32"](timed), fns["bf16"](timed)  # untimed: oneDNN makes the primitives of this shape and thread count
        for k in range(runs):
            for kind in (("fp32", "bf16") if k % 2 == 0 else ("bf16", "fp32")):
                t0 = clock()
                fns[kind](timed)
                times[kind].append(clock() - t0)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    speedup, share = med["fp32"] / med["bf16"], len(close) / max(1, len(photos))
    fig = {**fidelity(ref, got), "native_speedup": speedup, "rechecked": share,
           "served_speedup": served_speedup(speedup, share), "photos": len(photos)}
    rechecks = (f" with {len(close)} close call(s) (under {recheck_pts:g} points) answered by fp32"
                if recheck_pts > 0 else "")
    reason = (f"measured on {fig['photos']} calibration photos{rechecks}: top-1 agreement "
              f"{100 * fig['top1_agree']:.1f}% ({100 * fig['sure_agree']:.0f}% of {fig['sure_n']} with fp32 >= "
              f"{SURE:.0%}), top-1 probability change max {fig['max_change_pts']:.2f} points, {fig['ties']} ties; "
              f"bf16 kernels {speedup:.2f}x fp32"
              + (f", {fig['served_speedup']:.2f}x with the rechecks" if len(close) else ""))
    fig["faithful"] = faithful(fig)
    return fig["faithful"] and fig["served_speedup"] >= MIN_NATIVE_SPEEDUP, reason, fig


def served_speedup(speedup: float, rechecked: float) -> float:
    """fp32's time per photo over bf16's once a share ``rechecked`` (0..1) of photos also runs in fp32: with
    ``speedup`` = fp32 s / bf16 s, ``1 / (1 / speedup + rechecked)`` (a recheck is one more fp32 pass)."""
    return 1.0 / (1.0 / speedup + rechecked)
