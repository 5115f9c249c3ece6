#!/usr/bin/env bash
# On the GPU machine: unpacks prebuilt-NAME/ (scripts/prebuild.sh) in place, and links the path
# the tests were built to run mkrun from to the carried mkrun.
#   bash scripts/unpack_prebuilt.sh NAME...
# Run it at the start of every call that uses them: each call re-sends the working tree, and the
# carried folders arrive compressed again (2 s for two variants). Then e.g.
#   prebuilt-v1/mkernel_gpu_tests --gtest_filter='*Moe*'    prebuilt-v1/bench_ring_bisect --sms 66
#   PREBUILT_DIR=prebuilt-v0 PYTHON_TESTS=0 bash scripts/python_gpu_test.sh   (the module, if built)
#   BUILD=$PWD/prebuilt-v0/build bash scripts/device_run.sh python bench      (the links below)
# (first run: 2026-12-06 on an H100, v0 = main and v1 = the queue, both ran as built here).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for name in "$@"; do
  dir="$PWD/prebuilt-$name"
  [[ -d "$dir" ]] || { echo "unpack_prebuilt.sh: no $dir (carry it)" >&2; exit 1; }
  for f in "$dir"/*.xz; do [[ -e "$f" ]] && xz -d -f -T0 "$f"; done
  find "$dir" -maxdepth 1 -type f ! -name '*.*' ! -name COMMIT ! -name MKRUN_PATH \
    ! -name TESTS_PATH -exec chmod +x {} +
  # The paths the build here named (prebuild.sh): mkrun, which the tests start, and the tests,
  # which the ctest file names (`ctest --test-dir prebuilt-NAME/build -L gpu`).
  for link in MKRUN_PATH:mkrun TESTS_PATH:mkernel_gpu_tests; do
    record="$dir/${link%%:*}" exe="$dir/${link#*:}"
    if [[ -f "$record" && -x "$exe" ]]; then
      path="$(cat "$record")"
      mkdir -p "$(dirname "$path")" && ln -sf "$exe" "$path"
    fi
  done
  # A build tree's layout of links (build/bench/bench_*, build/tests/mkernel_gpu_tests, the
  # module in build/), so that the steps that take BUILD run on them as they are:
  #   BUILD=$PWD/prebuilt-NAME/build BENCH_KERNELS="gemm ring_attention" bash scripts/device_run.sh python bench
  mkdir -p "$dir/build/bench" "$dir/build/tests"
  for f in "$dir"/*; do
    [[ -f "$f" ]] || continue
    case "$(basename "$f")" in
      bench_*) ln -sf "$f" "$dir/build/bench/" ;;
      mkernel_gpu_tests) ln -sf "$f" "$dir/build/tests/" ;;
      _C*.so | CTestTestfile.cmake) ln -sf "$f" "$dir/build/" ;;
    esac
  done
  echo "unpack_prebuilt.sh: $dir ($(cat "$dir/COMMIT" 2>/dev/null || echo '?'))"
done
