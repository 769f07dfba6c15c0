"""Settings that are allowed but work against the server they start, or that nothing in it reads: said as warnings
at start, each naming the setting, what it will do and what to set instead.

The settings table refuses what no server can run with; these values can run (tests, a deliberate limit, a host
this was not planned for) but an operator who set one by mistake got a server that said it was ready and then
refused every photo, or answered 40x slower, with no word in its log but "oversubscribed" (tryout34). gunicorn's
master says them once (``gunicorn.conf.py``), ``python -m webapp info`` under its plan ("a start warns").
Torch-free, for the master.
"""

from __future__ import annotations

import os

from . import catalog
from .settings import given_as

SLOW_TIMEOUT_S = 1.0  # s: below it, one 12 MP photo's decode and forward pass (~50-150 ms here) on a busy worker


def warnings(settings, threads: int, cores: int) -> list[str]:
    """The warnings for ``settings`` on a server whose workers run ``threads`` intra-op threads each
    (``cpu.Plan.threads``) on the ``cores`` cores it may use; [] where there is nothing to say."""
    said = []

    def named(name: str) -> str:
        return f"{given_as(settings, name)}={settings[name]:,}" if isinstance(settings[name], int) and \
            not isinstance(settings[name], bool) else f"{given_as(settings, name)}={settings[name]}"

    if threads > cores:
        said.append(f"{named('THREADS')}: more intra-op threads than the {cores} core{'s' * (cores != 1)} this "
                    f"server may use; each forward pass then shares them among {threads} threads and runs many "
                    f"times slower (999 on 2 cores: ~40x); leave it 0 (one per core of each worker) or at most "
                    f"{cores}")
    side = catalog.entry(settings.MODEL).input_size
    if settings.MAX_PIXELS < side * side:
        said.append(f"{named('MAX_PIXELS')}: every photo of more pixels gets 413 too_large, which is every photo a "
                    f"camera or phone takes (the model's own input is {side} x {side} = {side * side:,} pixels)")
    if settings.MAX_REQUEST_PIXELS < settings.MAX_PIXELS:
        said.append(f"{named('MAX_REQUEST_PIXELS')} is below {named('MAX_PIXELS')}: a single photo within the "
                    f"per-photo limit still gets 413 too_large for the request's total")
    if settings.REQUEST_TIMEOUT_S < SLOW_TIMEOUT_S:
        said.append(f"{named('REQUEST_TIMEOUT_S')} s: a request whose decode and forward pass take longer gets 504 "
                    f"timeout, on an idle server too (a 12 MP photo takes ~50-150 ms here); 30 s is the default")
    if settings.MODEL == "resnet18" and "TORCH_HOME" in os.environ and not os.environ["TORCH_HOME"].strip():
        said.append(f"TORCH_HOME is set but empty: torch then looks for the weights in hub/checkpoints under the folder "
                    f"the server starts in ({os.getcwd()}); unset it for ~/.cache/torch, or give it a folder")
    # set, and read by nothing in this configuration (only WEIGHTS said so: catalog.unused_weights)
    if settings.METRICS_TOKEN and not settings.METRICS:
        said.append(f"{given_as(settings, 'METRICS_TOKEN')} is not used: {given_as(settings, 'METRICS')}=0 serves no "
                    f"/metrics")
    if settings.SEED and settings.MODEL != "resnet18_seeded":
        said.append(f"{named('SEED')} is not used: it seeds resnet18_seeded's random weights, and "
                    f"{named('MODEL')} has trained ones")
    return said
