"""``python -m webapp weights fetch | verify``: carry ResNet-18 weights to an air-gapped host."""

from __future__ import annotations

import argparse
import errno
import os
import tempfile
import textwrap
import urllib.parse
from pathlib import Path

from .. import settings as settings_mod
from ..paths import Unusable, expand, kind, not_a_file, reason
from .common import EXIT_FAILED, EXIT_OK, err
from .options import HelpFormatter, folder_arg, hex_prefix, path_arg, setting_arg


def add_parser(sub) -> None:
    """Add the ``weights`` command and its ``fetch`` and ``verify`` actions to ``sub``."""
    weights = sub.add_parser("weights", formatter_class=HelpFormatter,
                             help="fetch or verify ResNet-18 weights (for air-gapped hosts)",
                             description="Fetch ResNet-18 weights where a network exists, check a weights file.")
    wsub = weights.add_subparsers(dest="weights_command", metavar="ACTION", required=True)
    fetch = wsub.add_parser(
        "fetch", formatter_class=HelpFormatter, help="download resnet18-f37072fd.pth, hash-checked",
        description="Download the ResNet-18 weights (torchvision IMAGENET1K_V1) into DIR and check their sha256, "
                    "to carry to a host without internet. Fails (exit 1) when there is no network, after at most "
                    "the download timeout.")
    fetch.add_argument("--dest", type=folder_arg, default=Path("."), metavar="DIR", help="folder to put the file in "
                       "(default: the current folder)")
    fetch.add_argument("--timeout", type=setting_arg("DOWNLOAD_TIMEOUT_S", "--timeout"), default=None,
                       metavar="SECONDS", help=f"give up connecting after this long "
                       f"({settings_mod.BY_NAME['DOWNLOAD_TIMEOUT_S'].rule()}; default: CLASSIFIER_DOWNLOAD_TIMEOUT_S)")
    fetch.add_argument("--url", default=None, help=argparse.SUPPRESS)  # tests: a closed port
    fetch.set_defaults(func=cmd_weights_fetch)
    verify = wsub.add_parser(
        "verify", formatter_class=HelpFormatter, help="check a weights file's sha256 against the prefix in its name",
        description="Check FILE's sha256 against the prefix in its name (resnet18-f37072fd.pth -> f37072fd); "
                    "a name without one is checked against ResNet-18's. Prints OK or the mismatch; exit 0 only "
                    "for a whole copy of ResNet-18's file, the only one the service loads.")
    verify.add_argument("file", type=path_arg, metavar="FILE")
    verify.add_argument("--sha256", type=hex_prefix, default=None, metavar="PREFIX",
                        help="expected sha256 (or a prefix of it) instead of the one in the name")
    verify.set_defaults(func=cmd_weights_verify)


def cmd_weights_fetch(args: argparse.Namespace) -> int:
    """``weights fetch``: download the weights into ``--dest`` and check their sha256.

    Returns EXIT_OK (saved, or already there and intact) or EXIT_FAILED (no network within
    ``--timeout`` seconds, an unwritable folder or one that cannot be looked at, a hash mismatch: nothing is
    left behind then).
    """
    s = settings_mod.load()
    from ..errors import StartupError
    from ..models import RESNET18_URL, check_weights_file, download_weights, hub_checkpoint_path, sha256_file

    url = args.url or RESNET18_URL
    timeout = args.timeout or s.DOWNLOAD_TIMEOUT_S
    name = os.path.basename(urllib.parse.urlparse(url).path)
    dest = expand(args.dest)
    target = dest / name
    try:
        made = _dest_folder(dest)
        present = kind(target) == "file"
    except OSError as exc:  # --dest a file, a name too long, a folder on the way not searchable or not a folder
        err(f"error: --dest: {dest}: {reason(exc)}")
        return EXIT_FAILED
    if present:
        try:
            check_weights_file(target, url)
            print(f"{target} is already here and its sha256 matches; nothing downloaded.")
            print(_carry_instructions(target, hub_checkpoint_path(RESNET18_URL)))
            return EXIT_OK
        except StartupError:
            err(f"{target} exists but its sha256 does not match; downloading a fresh copy")
    err(f"downloading {url} to {target} (giving up after {timeout:g} s without a connection) ...")
    try:
        why = download_weights(url, target, timeout=timeout)
    except OSError as exc:  # dest cannot be created or written
        why = f"cannot write {target}: {exc.strerror or exc}"
    if why:
        _remove(made)
        err(f"error: {why}.")
        err(f"No network here? Run `python -m webapp weights fetch --dest DIR` on a machine that "
            f"has one (or download {url} there), then carry the file over.")
        return EXIT_FAILED
    try:
        check_weights_file(target, url)
    except StartupError as exc:
        target.unlink(missing_ok=True)
        _remove(made)
        err(f"error: {exc}")
        return EXIT_FAILED
    print(f"saved {target} ({target.stat().st_size / 1e6:.1f} MB, sha256 {sha256_file(target)[:16]}..., "
          f"matches {name})")
    print(_carry_instructions(target, hub_checkpoint_path(RESNET18_URL)))
    return EXIT_OK


def _dest_folder(dest: Path) -> list[Path]:
    """Make sure ``dest`` is a folder before anything is downloaded (a file there, or on the way, is said now
    with the OS's reason, not after minutes as a network problem); returns the folders made for it, deepest
    first, for ``_remove`` should nothing be saved.

    :raises OSError: ``dest`` is not a folder (ENOTDIR), cannot be looked at or made, or not written in (EROFS).
    """
    what = kind(dest)
    if what == "folder":  # one it may write in: a read-only mount was found only after the download (tryout26)
        with tempfile.TemporaryFile(dir=dest):  # raises EROFS, EACCES (not as root), EDQUOT...
            return []
    if what is not None:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(dest))
    missing = []
    for folder in (dest, *dest.parents):
        if kind(folder) is not None:
            break
        missing.append(folder)
    dest.mkdir(parents=True)  # raises ENOTDIR where a file is on the way, EACCES, EROFS...
    return missing


def _remove(folders: list[Path]) -> None:
    """Remove the (empty) folders ``_dest_folder`` made, deepest first: a failed fetch leaves nothing behind."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _carry_instructions(target: Path, hub_path: Path) -> str:
    name = target.name
    return textwrap.dedent(f"""\
        On the air-gapped host, put it where the service looks (one of):
          mkdir -p ~/.cache/torch/hub/checkpoints && cp {name} ~/.cache/torch/hub/checkpoints/
              (or $TORCH_HOME/hub/checkpoints/ where TORCH_HOME is set; here that is {hub_path.parent})
          export CLASSIFIER_WEIGHTS=/any/folder/{name}
        then check it there: python -m webapp weights verify <path of {name}>
        and see which weights the service will use: python -m webapp info""")


def cmd_weights_verify(args: argparse.Namespace) -> int:
    """``weights verify``: compare the file's sha256 with ``--sha256``, the prefix in its name, else ResNet-18's;
    and say whether it is the ResNet-18 file the service loads (a whole file of anything else is refused there).

    Prints OK, MISMATCH or NOT RESNET-18 on stdout; returns EXIT_OK only for ResNet-18's own file, whole;
    EXIT_FAILED otherwise, or for a missing or unreadable file, or a path that cannot be looked at (one line:
    the path and the OS's reason).
    """
    from ..models import RESNET18_URL, expected_hash_prefix, sha256_file

    path: Path = args.file
    try:
        what = kind(path)
    except Unusable as exc:  # a name too long, a folder on the way not searchable: the OS's reason
        what, why = None, exc.strerror
    else:  # what is there instead, in words: a folder, a dangling or looping link (not "no such file")
        why = "no such file" if (said := not_a_file(path)) == "does not exist" else said
    if what != "file":
        err(f"error: {path}: {why}")
        return EXIT_FAILED
    if args.sha256:
        prefix, source = args.sha256, "given with --sha256"
    else:
        try:
            prefix = expected_hash_prefix(path.name)
            if len(prefix) < 8:  # torchvision names carry 8+ hex digits; 'model-cafe.pth' is no hash
                raise ValueError(prefix)
            source = f"from its name {path.name}"
        except ValueError:
            prefix = expected_hash_prefix(RESNET18_URL)
            source = (f"its name carries no sha256 prefix, so compared with ResNet-18's "
                      f"{os.path.basename(urllib.parse.urlparse(RESNET18_URL).path)}")
    try:
        digest = sha256_file(path)
    except OSError as exc:
        err(f"error: cannot read {path}: {exc.strerror or exc}")
        return EXIT_FAILED
    served = expected_hash_prefix(RESNET18_URL)
    said = f"sha256 {digest} " + ("is the one" if prefix == digest else f"starts with {prefix}")
    if digest.startswith(prefix) and not digest.startswith(served):
        # whole and as named, but the service loads ResNet-18 from this one file only (models.check_weights_file)
        print(f"NOT RESNET-18 {path}: {said} ({source}), but it is not ResNet-18's "
              f"{os.path.basename(urllib.parse.urlparse(RESNET18_URL).path)} (sha256 {served}...), the only file "
              f"the service loads as ResNet-18: it would refuse this one; get that file with 'weights fetch'")
        return EXIT_FAILED
    if digest.startswith(prefix):
        print(f"OK {path}: {said} ({source})")
        return EXIT_OK
    print(f"MISMATCH {path}: sha256 {digest} does not start with {prefix} ({source}); the file is damaged, "
          f"truncated or not the expected file")
    return EXIT_FAILED
