"""Settings -> command-line options, and the checkers and help formatter every command uses.

The options of ``serve`` and ``classify`` are generated from ``webapp.settings.SETTINGS``: a row's
``commands`` column says which commands offer it, its ``secret`` column that its value is never
printed in clear. A new setting appears in ``--help`` with its variable, default and help without
touching the CLI.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from pathlib import Path

from .. import settings as settings_mod
from ..settings import PREFIX, SETTINGS, Setting, SettingsError


# -- one option per setting ------------------------------------------------------------------------------
def option_name(s: Setting) -> str:
    """The command-line flag of a setting: ``MAX_BATCH_SIZE`` -> ``--max-batch-size``."""
    return "--" + s.name.lower().replace("_", "-")


def default_text(s: Setting) -> str:
    """A setting's default as the README table writes it (``true``, ``8``, ``empty``)."""
    if s.default == "":
        return "empty"
    if isinstance(s.default, bool):
        return str(s.default).lower()
    return str(s.default)


def _is_bool(s: Setting) -> bool:
    return not s.choices and s.type_name == "bool"


def _range(s: Setting) -> str:
    """``1..256``, ``>= 0.1``: the allowed range, short (integers written as integers)."""
    def num(x: float) -> str:
        return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"

    return f"{num(s.low)}..{num(s.high)}" if s.high is not None else f">= {num(s.low)}"


def _checked(s: Setting, flag: str):
    """argparse ``type=``: check the text with the setting's own rule, keep the text (it becomes an env var)."""

    def check(text: str) -> str:
        try:
            s.convert(text, flag)
        except SettingsError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text.strip()

    return check


def add_setting_options(parser: argparse.ArgumentParser, *, commands: tuple[str, ...], aliases=None,
                        notes=None) -> None:
    """Add one option per row of ``SETTINGS`` that applies to any of ``commands`` (``settings.COMMANDS``).

    Flag, env var, default, range and help come from the table; ``aliases`` maps a setting's name to extra
    flags, ``notes`` to a sentence added to its help (what differs for this command). Each option stores its
    text (checked, not converted) or bool in ``setting_<NAME>``, None when not given; ``given_settings`` reads
    them back.
    """
    aliases = aliases or {}
    group = parser.add_argument_group(
        "settings", f"Each option sets its {PREFIX}* environment variable, which it overrides; "
                    "unset options keep the variable's value, else the default.")
    for s in SETTINGS:
        if not set(s.commands) & set(commands):
            continue
        flag = option_name(s)
        rule = "" if _is_bool(s) or s.choices or s.low is None else f"; {_range(s)}"
        note = f" {notes[s.name]}" if notes and s.name in notes else ""
        text = f"{s.env} (default {default_text(s)}{rule}). {s.help}{note}".replace("%", "%%")
        names = (flag, *aliases.get(s.name, ()))
        if _is_bool(s):
            group.add_argument(*names, dest=f"setting_{s.name}", action=argparse.BooleanOptionalAction, default=None,
                               help=text)
        else:
            metavar = "{" + ",".join(s.choices) + "}" if s.choices else s.type_name.upper()
            group.add_argument(*names, dest=f"setting_{s.name}", type=_checked(s, flag), default=None,
                               metavar=metavar, help=text)


def given_settings(args: argparse.Namespace) -> dict[str, object]:
    """The settings set on the command line: ``{name: text or bool}`` (absent when not given)."""
    out = {}
    for s in SETTINGS:
        value = getattr(args, f"setting_{s.name}", None)
        if value is not None:
            out[s.name] = value
    return out


def flag_names(given: dict[str, object]) -> dict[str, str]:
    """``{name: its flag}`` for the settings in ``given``: how errors name them (``settings.given_as``)."""
    return {name: option_name(settings_mod.BY_NAME[name]) for name in given}


def as_environ(given: dict[str, object]) -> dict[str, str]:
    """``{name: value}`` -> ``{CLASSIFIER_NAME: text}`` (booleans as 1/0)."""
    return {PREFIX + name: ("1" if value else "0") if isinstance(value, bool) else str(value)
            for name, value in given.items()}


def shown(name: str, value: object) -> str:
    """A setting's value as text for printing: a ``secret`` setting's masked, passwords in URIs hidden.

    ``name`` is the setting's name without the prefix; a non-empty secret becomes ``(set, hidden)``,
    ``redis://:pw@host`` becomes ``redis://:***@host``; booleans print as ``true``/``false``.
    """
    text = str(value).lower() if isinstance(value, bool) else str(value)
    setting = settings_mod.BY_NAME.get(name)
    if setting is not None and setting.secret and text:
        return "(set, hidden)"
    return re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", text)


def settings_epilog() -> str:
    """The closing line of most ``--help`` texts: where the settings come from."""
    return (f"Every setting is a {PREFIX}* environment variable (python -m webapp settings lists them with the "
            f"values in effect). The options of serve and classify set the same variables.")


# -- help layout -----------------------------------------------------------------------------------------
class HelpFormatter(argparse.HelpFormatter):
    """Wraps descriptions and epilogs line by line, so explicit line breaks (examples) stay."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=34)

    def _fill_text(self, text, width, indent):
        return "\n".join(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                         if line.strip() else "" for line in text.splitlines())


# -- argparse type= checkers (a bad value is argparse's usage error, exit 2) ----------------------------------
def positive_int(text: str) -> int:
    """``text`` as an int of 1 or more; raises ``argparse.ArgumentTypeError`` otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def setting_arg(name: str, flag: str):
    """argparse ``type=`` for an option that gives a setting's value under its own flag (``weights fetch --timeout``
    for ``DOWNLOAD_TIMEOUT_S``): the text converted and checked by the setting's own rule, so the range is the
    table's (``--timeout 1e9`` was taken: tryout25); a bad value raises ``argparse.ArgumentTypeError``."""
    setting = settings_mod.BY_NAME[name]

    def convert(text: str):
        try:
            return setting.convert(text, flag)
        except SettingsError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def hex_prefix(text: str) -> str:
    """``text`` as a lowercase sha256 hex prefix (8-64 digits: torchvision's file names carry 8; fewer would match
    one file in 16 or 256 by chance); raises ``argparse.ArgumentTypeError`` otherwise."""
    if not re.fullmatch(r"[0-9a-fA-F]{8,64}", text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a sha256 prefix: give 8 to 64 hex digits")
    return text.strip().lower()


EMPTY_PATH = "an empty path (a shell variable that is not set?)"


def path_arg(text: str) -> Path:
    """``text`` as a ``Path`` for a file or folder argument; raises ``argparse.ArgumentTypeError`` (a usage error,
    exit 2) for an empty one, which ``Path`` would read as the current folder."""
    if not text:
        raise argparse.ArgumentTypeError(EMPTY_PATH)
    return Path(text)


def folder_arg(text: str) -> Path:
    """``path_arg`` for a folder that may well be the current one: the refusal says to give ``.`` for it."""
    if not text:
        raise argparse.ArgumentTypeError(f"{EMPTY_PATH}; give . for the current folder")
    return Path(text)


def address_arg(text: str) -> str:
    """``--address``: a Ray cluster's address; an empty one is a usage error (exit 2), not a silent local Ray."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty address (a shell variable that is not set?); leave --address out "
                                         "to join $RAY_ADDRESS or start a local Ray")
    return text.strip()


def url_problem(url: str) -> str | None:
    """What makes ``url`` unfit for ``--server`` (a usage error, said before anything is sent), or None.

    Not http:// or https:// (``""`` too: ``--server "$URL"`` with URL unset), a port out of range or not a
    number, a host missing or malformed (``http://[::1``): urllib.parse's and urllib3's own URL parsing, the
    latter being what connects; a query or fragment (``http://host:8000?x=1``: the API's paths are appended
    to the URL, so they would end up inside it); the API's own path (``.../api/v1/predict``), appended again
    (a 404 said as "not a photo classifier"): the URL without it is said. Raises nothing.
    """
    import urllib.parse

    import urllib3

    if not url.lower().startswith(("http://", "https://")):  # a scheme is case-insensitive (RFC 3986 3.1)
        return f"--server must be an http:// or https:// URL, got {url!r}"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises for a port out of range or not a number
    except ValueError as exc:
        what = "bad port" if "port" in str(exc).lower() else "bad host"
        return f"--server {url!r} is not a valid URL: {what} ({str(exc)[:1].lower()}{str(exc)[1:]})"
    if not parts.hostname:
        return f"--server {url!r} is not a valid URL: it names no host"
    if "?" in url or "#" in url:  # the API paths are appended to the URL: a query or fragment would swallow them
        return (f"--server {url!r} is not a server's URL: it has a query (?...) or fragment (#...); give "
                f"http://host:port, with a path prefix where a proxy puts one")
    if port == 0:
        return f"--server {url!r} is not a valid URL: bad port (port 0 is not one a server listens on)"
    api = re.search(r"/api/v1(/[a-z]*)?/*$", parts.path)  # the API's own path, which is appended to the URL
    if api:
        return (f"--server {url!r} ends in the API's path {api.group(0).rstrip('/')!r}, which classify adds itself; "
                f"give {url[:len(url) - len(parts.path)] + parts.path[:api.start()]!r}")
    try:
        urllib3.util.parse_url(url)
    except urllib3.exceptions.LocationParseError as exc:
        reason = str(exc).removeprefix("Failed to parse: ")
        return f"--server {url!r} is not a valid URL: bad host ({reason[:1].lower()}{reason[1:]})"
    return None
