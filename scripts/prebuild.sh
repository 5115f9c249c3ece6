#!/usr/bin/env bash
# Builds executables on this (development) machine for a device call to run as they are, so that
# the call spends its device time running, not compiling (two variants' build there takes ~4 min
# of a 30-minute budget). The CUDA here is the GPU machine's (13.0) and the executables link
# libcudart statically; they need glibc 2.34 and, for cuBLAS, libcublas 13 there.
#
#   bash scripts/prebuild.sh NAME PATCHES TARGET...
#     e.g.  bash scripts/prebuild.sh v0 - bench_ring_bisect mkernel_gpu_tests mkrun
#           bash scripts/prebuild.sh v1 queue bench_ring_bisect mkernel_gpu_tests
#
# NAME: the output folder prebuilt-NAME/ in this checkout (git ignores it; name it in the device
# tool's `carry`). PATCHES: a comma list as ab_variants.sh takes ("-": none; "queue": the queued
# patches in order). TARGET: CMake targets; each executable goes in stripped and xz-compressed
# (~10 MB for bench_ring_bisect, mkernel_gpu_tests, bench_gemm and bench_moe_ranks together).
# mkernel_python: the Python module, for the device's Python 3.12 (PREBUILT_DIR=prebuilt-NAME
# for scripts/python_gpu_test.sh). On the GPU machine `bash scripts/unpack_prebuilt.sh NAME` unpacks them; mkernel_gpu_tests
# runs mkrun from the path it was built with, which unpack_prebuilt.sh links to the carried
# mkrun (build mkrun into the same folder).
#
# The copy of HEAD with the patches and its build live in /tmp/mk-prebuild-NAME and are kept,
# so that the next call rebuilds only what changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
(($# >= 3)) || { echo "usage: prebuild.sh NAME PATCHES TARGET..." >&2; exit 2; }
name="$1" patches="$2"
shift 2
repo="$PWD" src="/tmp/mk-prebuild-$name" out="$PWD/prebuilt-$name"
[[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "prebuild.sh: NAME: letters, digits, . _ -" >&2; exit 2; }

[[ -d "$src/.git" ]] || git clone -q "$repo" "$src"
git -C "$src" fetch -q "$repo" HEAD
git -C "$src" checkout -qf FETCH_HEAD
git -C "$src" clean -fdq -e build
if [[ "$patches" != - && -n "$patches" ]]; then
  tr ',' '\n' <<<"$patches" | sed '/^$/d' | while IFS= read -r p; do
    if [[ "$p" == queue ]]; then bash scripts/queue_patches.sh | tr ',' '\n'; else echo "$p"; fi
  done | while IFS= read -r p; do
    git -C "$src" apply "$repo/$p" || { echo "prebuild.sh: $p does not apply" >&2; exit 1; }
  done
fi
# The Python module (target mkernel_python) for the device's interpreter, 3.12: PYTHON names an
# interpreter of that version here with nanobind installed (pyenv's 3.12 by default).
python_args=()
if [[ " $* " == *" mkernel_python "* ]]; then
  py="${PYTHON:-$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)}"
  [[ -x "$py" ]] && "$py" -m nanobind --cmake_dir >/dev/null ||
    { echo "prebuild.sh: mkernel_python needs PYTHON=<python3.12 with nanobind>" >&2; exit 1; }
  python_args=(-DMKERNEL_BUILD_PYTHON=ON -DPython_EXECUTABLE="$py")
  grep -q '^MKERNEL_BUILD_PYTHON:BOOL=ON' "$src/build/CMakeCache.txt" 2>/dev/null ||
    rm -f "$src/build/build.ninja"
fi
[[ -f "$src/build/build.ninja" ]] ||
  cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DMKERNEL_BUILD_TESTS=ON -DMKERNEL_BUILD_BENCH=ON "${python_args[@]}" >/dev/null
ninja -C "$src/build" "$@"

rm -rf "$out" && mkdir -p "$out"
for t in "$@"; do
  if [[ "$t" == mkernel_python ]]; then  # the module _C*.so, which python_gpu_test.sh copies in
    for so in "$src"/build/_C*.so; do strip -o "$out/$(basename "$so")" "$so" && xz -T0 -f "$out/$(basename "$so")"; done
    continue
  fi
  exe="$(find "$src/build" -maxdepth 3 -type f -name "$t" -perm -u+x | head -1)"
  [[ -n "$exe" ]] || { echo "prebuild.sh: no executable $t in $src/build" >&2; exit 1; }
  strip -o "$out/$t" "$exe" && xz -T0 -f "$out/$t"
  [[ "$t" == mkrun ]] && echo "$exe" >"$out/MKRUN_PATH"
  # The GPU suites as ctest knows them (ctest -L gpu on the GPU machine, BUILD=prebuilt-NAME/build
  # for device_run.sh's test step): its test file names the executables by their paths here,
  # which unpack_prebuilt.sh links to the carried ones.
  if [[ "$t" == mkernel_gpu_tests ]]; then
    cp "$src/build/tests/CTestTestfile.cmake" "$out/CTestTestfile.cmake"
    echo "$exe" >"$out/TESTS_PATH"
  fi
done
git -C "$src" rev-parse --short HEAD >"$out/COMMIT"
echo "prebuild.sh: $(du -sh "$out" | cut -f1) in $out (HEAD $(cat "$out/COMMIT"), patches: $patches)"
