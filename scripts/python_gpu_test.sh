#!/usr/bin/env bash
# Builds and installs the Python package, then runs its tests (tests/python). For the GPU machine
# (no internet): the build uses the interpreter's own scikit-build-core, nanobind and torch.
#
#   bash scripts/python_gpu_test.sh [pytest args...]
#
# Installs into $SITE (default /tmp/site) with `pip install --target --upgrade`, puts it first on
# PYTHONPATH and runs `python3 -m pytest -q tests/python`. Logs: $OUT/pip.log and $OUT/pytest.log
# when OUT is set, else under $SITE/../mkernel-logs. Exits non-zero when the build or a test fails.
# Knobs: PYTHON (python3), SITE, CUDA_HOME (from nvcc on PATH, else /usr/local/cuda),
# PYTHON_TESTS=0 (install only: for a device call that benchmarks and tests elsewhere),
# PREBUILT_DIR (a CMake build dir holding the module _C*.so: copied instead of pip-building).

# NVLink multicast (NVLS) must stay off on the shared hosts: it can take their GPUs out of service.
export NCCL_NVLS_ENABLE=0 NCCL_NVLS_DISABLE=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PYTHON="${PYTHON:-python3}"
SITE="${SITE:-/tmp/site}"
LOGS="${OUT:-$(dirname "$SITE")/mkernel-logs}"
mkdir -p "$LOGS" "$SITE"

if [[ -z "${CUDA_HOME:-}" ]]; then
  if command -v nvcc >/dev/null; then
    CUDA_HOME="$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)"
  else
    CUDA_HOME=/usr/local/cuda
  fi
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH" CUDACXX="${CUDACXX:-$CUDA_HOME/bin/nvcc}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 8)}"

log() { printf '[python_gpu_test %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

log "python: $(command -v "$PYTHON") ($("$PYTHON" --version 2>&1)); nvcc: $CUDACXX"
"$PYTHON" - <<'EOF'
import importlib
for name in ("torch", "nanobind", "scikit_build_core", "pytest"):
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '?')}")
    except ImportError as e:
        print(f"  {name} MISSING ({e})")
EOF

start=$SECONDS
if [[ -n "${PREBUILT_DIR:-}" ]] && compgen -G "$PREBUILT_DIR/_C*.so" >/dev/null; then
  # A CMake build with MKERNEL_BUILD_PYTHON=ON made the module already: the package is its
  # Python files and that module (what `pip install .` installs), copied.
  log "installing the module built in $PREBUILT_DIR into $SITE"
  rm -rf "$SITE/mkernel" && mkdir -p "$SITE/mkernel" &&
    cp python/mkernel/*.py "$SITE/mkernel/" && cp "$PREBUILT_DIR"/_C*.so "$SITE/mkernel/" ||
    { log "copying the package failed"; exit 1; }
else
  log "building and installing into $SITE (log: $LOGS/pip.log)"
  "$PYTHON" -m pip install --no-build-isolation --no-deps --upgrade -v --target "$SITE" . \
    >"$LOGS/pip.log" 2>&1
  rc=$?
  tail -n 15 "$LOGS/pip.log"
  if ((rc != 0)); then
    log "pip install failed (rc $rc); errors from $LOGS/pip.log:"
    grep -n -i -E "error|fatal" "$LOGS/pip.log" | head -n 40
    exit "$rc"
  fi
fi
log "installed in $((SECONDS - start)) s"

export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${PYTHON_TESTS:-1}" == 0 ]]; then
  log "PYTHON_TESTS=0: not running tests/python"
  exit 0
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L
log "pytest tests/python $* (log: $LOGS/pytest.log)"
"$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/python "$@" 2>&1 | tee "$LOGS/pytest.log"
rc=${PIPESTATUS[0]}
log "pytest: rc $rc"
exit "$rc"
