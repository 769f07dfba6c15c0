"""``python -m webapp settings``: the settings table with the values in effect here."""

from __future__ import annotations

import argparse
import os
import textwrap

from .. import settings as settings_mod
from ..settings import PREFIX, SETTINGS, SettingsError
from .common import EXIT_OK, EXIT_USAGE
from .options import HelpFormatter, default_text, settings_epilog, shown


def add_parser(sub) -> None:
    """Add the ``settings`` command to ``sub`` (the top parser's subparsers)."""
    table = sub.add_parser(
        "settings", formatter_class=HelpFormatter, help="list the settings and the values in effect",
        description="List every setting: its variable, the value in effect here (from the environment, else the "
                    "default) and what it does. Invalid values and unknown CLASSIFIER_* variables are flagged "
                    "(exit 2).", epilog=settings_epilog())
    table.add_argument("--markdown", action="store_true", help="print the README's table (markdown)")
    table.set_defaults(func=cmd_settings)


def cmd_settings(args: argparse.Namespace) -> int:
    """``settings``: print each setting's variable, value in effect (secrets masked) and help.

    ``--markdown``: the README's table instead. Returns EXIT_OK, or EXIT_USAGE when a variable
    holds an invalid value, values are invalid together (``settings.load``'s checks across settings),
    a ``CLASSIFIER_*`` variable names no setting, or the cache folder cannot be made or written
    (``caches.cache_dir_problem``): the service would refuse to start.
    """
    if args.markdown:
        print(settings_mod.markdown_table())
        return EXIT_OK
    bad = 0
    wrap = textwrap.TextWrapper(width=100, initial_indent="    ", subsequent_indent="    ")
    for s in SETTINGS:
        if s.env in os.environ:
            raw = os.environ[s.env]
            try:
                value = shown(s.name, s.convert(raw, s.env))
                where = f"from the environment; default {default_text(s)}"
            except SettingsError as exc:
                bad += 1
                value, where = shown(s.name, raw), f"INVALID: {exc}"
        else:
            value, where = ("(empty)" if s.default == "" else default_text(s)), "default"
        print(f"{s.env} = {value}  ({where})")
        print(wrap.fill(f"{s.type_name}. {s.help}"))
    unknown = sorted(k for k in os.environ if k.startswith(PREFIX) and k[len(PREFIX):] not in settings_mod.BY_NAME)
    for key in unknown:
        bad += 1
        guess = settings_mod.did_you_mean(key, PREFIX) or " (a typo?)"
        print(f"{key}: UNKNOWN setting{guess}; the service refuses to start with it")
    if not bad:  # each value is fine alone; together (a rate limit with no storage), as the service loads them?
        try:
            values = settings_mod.load(os.environ)
        except SettingsError as exc:
            bad += 1
            print(f"INVALID together: {exc}")
        else:  # the cache folder as every start makes it (serve --dry-run and info ask the same; this did not)
            from ..caches import cache_dir_problem

            if problem := cache_dir_problem(values):
                bad += 1
                print(f"INVALID: {problem}; the service refuses to start with it")
    return EXIT_USAGE if bad else EXIT_OK
