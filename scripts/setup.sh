#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine needs to build and test mkernel. Idempotent: a second
# run finds everything in place, installs nothing and takes a few seconds.
#
#   bash scripts/setup.sh [--with-torch | --no-torch] [--no-python]
#
#   --with-torch  also pip-install PyTorch (several GB, about a minute from PyPI): the Python
#                 package's tests and the benchmarks' baselines need it. The default where a GPU
#                 answers (nvidia-smi), so that `make setup check` has what it runs
#   --no-torch    not even there
#   --no-python   skip the pip packages
#
# Runs as root, or through sudo when it is available. The CUDA toolkit is NOT installed: it is
# looked up in $CUDA_HOME, then /usr/local/cuda, then on PATH. Python packages go to the python3
# on PATH ($PYTHON overrides); when that is Debian's own interpreter (which refuses pip installs,
# PEP 668), they go to a virtual environment in .venv/, which the Makefile then uses.
set -euo pipefail

WITH_TORCH=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then WITH_TORCH=1; fi
WITH_PYTHON=1
for arg in "$@"; do
  case "$arg" in
    --with-torch) WITH_TORCH=1 ;;
    --no-torch) WITH_TORCH=0 ;;
    --no-python) WITH_PYTHON=0 ;;
    -h | --help) sed -n '2,17s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG="$(mktemp -t mkernel-setup.XXXXXX.log)"
trap 'rm -f "$LOG"' EXIT

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }
# Runs a noisy command with its output in $LOG; shows the end of it only on failure.
quiet() {
  if ! "$@" >"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    die "failed: $*"
  fi
}

# ---- Debian packages ------------------------------------------------------------------------
# libibverbs-dev (rdma-core) carries both infiniband/verbs.h and infiniband/efadv.h.
APT_PACKAGES=(
  build-essential cmake ninja-build git pkg-config
  libgtest-dev libgmock-dev
  libibverbs-dev
  clang-format
  python3 python3-dev python3-pip python3-venv
)

if command -v dpkg-query >/dev/null && command -v apt-get >/dev/null; then
  missing=()
  for pkg in "${APT_PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    SUDO=()
    if ((EUID != 0)); then
      command -v sudo >/dev/null || die "not root and no sudo: install ${missing[*]} by hand"
      SUDO=(sudo)
    fi
    APT=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q)
    say "apt: installing ${missing[*]}"
    quiet "${APT[@]}" update
    quiet "${APT[@]}" install -y --no-install-recommends "${missing[@]}"
  else
    say "apt: all ${#APT_PACKAGES[@]} packages present"
  fi
else
  say "no apt-get here: install by hand the equivalents of ${APT_PACKAGES[*]}"
fi

# CMake >= 3.24 (the project uses --fresh and CUDA architecture 90a).
cmake_version="$(cmake --version 2>/dev/null | sed -n '1s/[^0-9]*\([0-9][0-9.]*\).*/\1/p')"
if [[ -z "$cmake_version" ]] || ! printf '3.24\n%s\n' "$cmake_version" | sort -V -C; then
  die "CMake ${cmake_version:-(none)} found; mkernel needs 3.24 or newer"
fi

# ---- CUDA (detected, never installed) ---------------------------------------------------------
cuda_home="${CUDA_HOME:-/usr/local/cuda}"
if [[ ! -x "$cuda_home/bin/nvcc" ]] && command -v nvcc >/dev/null; then
  cuda_home="$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)"
fi
if [[ -x "$cuda_home/bin/nvcc" ]]; then
  nvcc_version="$("$cuda_home/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  say "cuda: nvcc $nvcc_version in $cuda_home"
  if [[ "$cuda_home" != /usr/local/cuda ]]; then
    say "cuda: pass CUDA_HOME=$cuda_home to make"
  fi
else
  cat >&2 <<EOF
setup: WARNING: nvcc not found (looked in \$CUDA_HOME, /usr/local/cuda and PATH).
setup:   mkernel needs the CUDA toolkit (12.4 or newer, 13.0 tested) to build, even on machines
setup:   without a GPU. Install it from NVIDIA, then run make with CUDA_HOME=/path/to/cuda.
EOF
fi

# ---- Python packages --------------------------------------------------------------------------
if ((WITH_PYTHON)); then
  PY="${PYTHON:-python3}"
  command -v "$PY" >/dev/null || die "no $PY on PATH"
  # Debian's interpreter marks itself EXTERNALLY-MANAGED: use (or make) a virtual environment.
  managed="$("$PY" -c 'import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
print(int(os.path.exists(marker) and not in_venv))')"
  if [[ "$managed" == 1 ]]; then
    if [[ ! -x "$REPO/.venv/bin/python3" ]]; then
      say "python: $PY is managed by Debian; creating $REPO/.venv"
      quiet "$PY" -m venv --system-site-packages "$REPO/.venv"
    fi
    PY="$REPO/.venv/bin/python3"
  fi

  # import name -> pip name
  declare -A PIP_PACKAGES=(
    [numpy]=numpy [matplotlib]=matplotlib [pytest]=pytest
    [nanobind]=nanobind [scikit_build_core]=scikit-build-core
  )
  if ((WITH_TORCH)); then PIP_PACKAGES[torch]=torch; fi
  want=()
  for module in "${!PIP_PACKAGES[@]}"; do
    "$PY" -c "import $module" >/dev/null 2>&1 || want+=("${PIP_PACKAGES[$module]}")
  done
  if ((${#want[@]})); then
    say "pip: installing ${want[*]} into $("$PY" -c 'import sys; print(sys.prefix)')"
    quiet "$PY" -m pip install --disable-pip-version-check --no-input -q "${want[@]}"
  else
    say "pip: all ${#PIP_PACKAGES[@]} packages present ($PY)"
  fi
  if ((!WITH_TORCH)); then say "pip: torch not installed (no GPU here; opt in with --with-torch)"; fi
fi

say "done; build and test with: make test"
