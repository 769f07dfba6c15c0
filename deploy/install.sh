#!/bin/sh
# Install the photo classifier from this kit, with no network: check the kit, make a venv, install the
# hash-pinned wheels, put the weights where the service looks, warm the compile caches, and print the
# command that starts the service. Made by `python -m webapp bundle`; safe to run again.
#
#   ./install.sh [--prefix DIR] [--python PYTHON] [--cache-dir DIR] [--no-warm]
#
#   --prefix DIR      the venv to make (default: ./venv in this kit)
#   --python PYTHON   the Python to make it with (default: pythonX.Y as TARGET says, else python3)
#   --cache-dir DIR   CLASSIFIER_CACHE_DIR for the compile caches (default: the service's own default,
#                     ~/.cache/photo-classifier of the user running this); use the service's, e.g.
#                     /var/cache/photo-classifier for the systemd unit
#   --no-warm         skip `python -m webapp warm` (the first start then compiles: about a minute)
#
# Exit status: 0 installed; 1 a check failed (damaged kit, wrong Python or platform, pip or warm failed);
# 2 a usage error.
set -eu

KIT=$(cd "$(dirname "$0")" && pwd)
PREFIX="$KIT/venv"
PYTHON=""
CACHE_DIR="${CLASSIFIER_CACHE_DIR:-}"
WARM=1

say() { printf 'install.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || { say "--prefix needs a folder"; exit 2; }; PREFIX=$2; shift 2 ;;
        --python) [ $# -ge 2 ] || { say "--python needs a program"; exit 2; }; PYTHON=$2; shift 2 ;;
        --cache-dir) [ $# -ge 2 ] || { say "--cache-dir needs a folder"; exit 2; }; CACHE_DIR=$2; shift 2 ;;
        --no-warm) WARM=0; shift ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) say "unknown option $1 (see --help)"; exit 2 ;;
    esac
done
case "$PREFIX" in /*) ;; *) PREFIX="$(pwd)/$PREFIX" ;; esac
cd "$KIT"

# 1. The kit is whole and untouched: every file's sha256 against MANIFEST.sha256, before anything runs.
command -v sha256sum >/dev/null 2>&1 || die "sha256sum (coreutils) is needed to check the kit"
[ -f MANIFEST.sha256 ] || die "no MANIFEST.sha256 in $KIT: not a complete kit"
say "checking every file of the kit against MANIFEST.sha256 ..."
bad=$(sha256sum -c MANIFEST.sha256 2>/dev/null | grep -v ': OK$' || true)
if [ -n "$bad" ]; then
    printf '%s\n' "$bad" | sed 's/^/  /' >&2
    die "the kit is damaged or was altered: $(printf '%s\n' "$bad" | sed 's/: .*//' | tr '\n' ' ')does not match MANIFEST.sha256. Nothing was installed; copy the kit again."
fi
for f in wheels/* weights/*; do  # a file slipped in beside the listed ones is refused too
    [ -e "$f" ] || continue
    grep -q "  $f\$" MANIFEST.sha256 || die "$f is not in MANIFEST.sha256 (added after the kit was made). Nothing was installed."
done
for w in weights/*; do  # step 4 checks each against the sha256 prefix in its name: one without cannot be checked
    [ -e "$w" ] || continue
    printf '%s\n' "${w##*/}" | grep -q -- '-[0-9a-f]\{8,\}\.pth$' || die "weights file $w has no sha256 prefix in its name (torchvision names it resnet18-f37072fd.pth): it cannot be checked, and the service looks for that name. Nothing was installed."
done

# 2. The right Python and platform, named, before pip would refuse wheel by wheel.
get() { sed -n "s/^$1=//p" TARGET; }
NEED_PY=$(get python); NEED_MACHINE=$(get machine); NEED_GLIBC=$(get glibc); NEED_PLATFORM=$(get platform)
NEEDS="CPython $NEED_PY${NEED_MACHINE:+ on Linux $NEED_MACHINE}${NEED_GLIBC:+ with glibc >= $NEED_GLIBC} ($NEED_PLATFORM)"
if [ -z "$PYTHON" ]; then
    if command -v "python$NEED_PY" >/dev/null 2>&1; then PYTHON="python$NEED_PY"; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null 2>&1 || die "this kit needs $NEEDS; no $PYTHON here (--python PATH names another)"
facts=$("$PYTHON" -c 'import platform, sys
print("%d.%d" % sys.version_info[:2], sys.implementation.name, platform.system(), platform.machine(),
      platform.libc_ver()[1] or "none")') || die "this kit needs $NEEDS; $PYTHON does not run"
set -- $facts
HAVE="$2 $1 on $3 $4, glibc $5"
[ "$1" = "$NEED_PY" ] && [ "$2" = cpython ] || die "this kit needs $NEEDS; $PYTHON is $HAVE. Install Python $NEED_PY (or build a kit for $1: python -m webapp bundle --python-version $1)"
[ "$3" = Linux ] || die "this kit needs $NEEDS; this host is $3"
[ -z "$NEED_MACHINE" ] || [ "$4" = "$NEED_MACHINE" ] || die "this kit needs $NEEDS; this host is $4"
if [ -n "$NEED_GLIBC" ]; then
    awk -v have="$5" -v need="$NEED_GLIBC" 'BEGIN { split(have, h, "."); split(need, n, ".");
        exit !(h[1] > n[1] || (h[1] == n[1] && h[2] >= n[2])) }' ||
        die "this kit needs $NEEDS; this host has glibc $5 (build a kit with --platform manylinux_<its glibc>_$4)"
fi
say "Python: $PYTHON ($HAVE): fits $NEEDS"
# The warm step compiles the model (torch.compile's C++ compiler): said now, not after 3 GB of wheels (tryout23).
if [ "$WARM" = 1 ] && [ "${CLASSIFIER_COMPILE:-1}" != 0 ] && ! command -v "${CXX:-g++}" >/dev/null 2>&1; then
    die "no C++ compiler (${CXX:-g++}) here: compiling the model needs one (Debian, Ubuntu: apt-get install g++; RHEL: dnf install gcc-c++); or install with --no-warm and serve with CLASSIFIER_COMPILE=0 (uncompiled, slower). Nothing was installed."
fi

# 3. The venv and the wheels: no index, nothing but the kit's wheels, each hash-checked again by pip.
if [ ! -x "$PREFIX/bin/python" ]; then
    say "making the venv $PREFIX ..."
    "$PYTHON" -m venv "$PREFIX" || die "$PYTHON -m venv failed (Debian/Ubuntu: apt-get install python$NEED_PY-venv)"
fi
# No pip configuration of this host (index URLs, find-links, constraints) may add anything to the kit's.
unset PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CONSTRAINT PIP_REQUIREMENT PIP_NO_INDEX
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
say "installing $(grep -c -- '--hash=' requirements.lock) packages from wheels/ (no network) ..."
"$PREFIX/bin/python" -m pip install --no-index --find-links wheels --require-hashes -r requirements.lock ||
    die "pip could not install the kit's wheels (its message is above)"

# 4. Weights: checked against the sha256 prefix in their names, then into the torch hub cache.
HUB="${TORCH_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/torch}/hub/checkpoints"
found=""
for w in weights/*.pth; do
    [ -f "$w" ] || continue
    name=$(basename "$w")
    prefix=$(printf '%s\n' "$name" | sed -n 's/.*-\([0-9a-f]\{8,\}\)\.[^.]*$/\1/p')
    sum=$(sha256sum "$w" | cut -d' ' -f1)
    case "$sum" in "$prefix"*) ;; *) die "weights file $w is damaged: its sha256 $sum does not start with ${prefix:-the prefix its name should carry}" ;; esac
    found=$w
    if mkdir -p "$HUB" 2>/dev/null && cp "$w" "$HUB/$name" 2>/dev/null; then
        say "weights $name -> $HUB (where the service looks for the user running this)"
    fi
    say "for a service run by another user, put this in its environment: CLASSIFIER_WEIGHTS=$KIT/$w"
done
[ -n "$found" ] || say "no ResNet-18 weights in this kit: the service serves the offline EfficientNet-Lite0 (its weights came in its wheel); see README, Weights"

# 5. Warm the compile caches for this CPU's precision, so the first real start is ready in seconds.
if [ -n "$CACHE_DIR" ]; then export CLASSIFIER_CACHE_DIR="$CACHE_DIR"; fi
if [ "$WARM" = 1 ]; then
    say "warming the compile caches (python -m webapp warm; about a minute of CPU the first time) ..."
    (cd "$KIT/src" && "$PREFIX/bin/python" -m webapp warm) || die "python -m webapp warm failed (its message is above)"
fi

say "installed. Start the service with:"
printf 'cd %s/src && %s%s/bin/gunicorn -c gunicorn.conf.py wsgi:app\n' "$KIT" \
    "${CACHE_DIR:+CLASSIFIER_CACHE_DIR=$CACHE_DIR }" "$PREFIX"
