#!/usr/bin/env bash
# The CPU suite (tests/cpu: bootstraps, sockets, fd passing, mkrun, the transports' host sides, the
# proxy, the plans) built with AddressSanitizer and UndefinedBehaviorSanitizer, and run. Any
# report fails it: an out-of-bounds access, a use after free, a leak, undefined behaviour.
#
#   bash scripts/asan_cpu_tests.sh            (make test-asan; CI runs it after make test)
#
# Build tree: $ASAN_BUILD_DIR (build-asan). The C++ translation units are instrumented; the CUDA
# ones (.cu, compiled by nvcc) are not. No GPU needed: the suite's device-facing tests stand in
# for the GPU with host memory.
#
# intercept_send=0: ASan's sendmsg wrapper checks the iovecs' memory after the call returns. By
# then the peer may have received the bytes and the signal behind them, and its owner freed the
# buffer - a report of memory the kernel finished reading before it was freed (seen in
# InterNode's exchange test, 2026-12-06). Everything else stays on.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build="${ASAN_BUILD_DIR:-build-asan}"
sanitizers="-fsanitize=address,undefined"
flags="$sanitizers -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
generator=$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles")
[[ -f "$build/CMakeCache.txt" ]] ||
  cmake -S . -B "$build" -G "$generator" -DCMAKE_BUILD_TYPE=Release -DMKERNEL_BUILD_TESTS=ON \
    -DMKERNEL_BUILD_BENCH=OFF -DCMAKE_CUDA_COMPILER="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" \
    -DCUDAToolkit_ROOT="${CUDA_HOME:-/usr/local/cuda}" \
    "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_EXE_LINKER_FLAGS=$sanitizers" >/dev/null
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target mkernel_cpu_tests mkrun mkrun_test_helper
# (protect_shadow_gap=0: the CUDA runtime maps memory where ASan would reserve its gap. Leaks are
# reported by default; UB stops the run: -fno-sanitize-recover.)
export ASAN_OPTIONS="protect_shadow_gap=0:intercept_send=0"
export UBSAN_OPTIONS="print_stacktrace=1"
"$build/tests/mkernel_cpu_tests" --gtest_brief=1
