#!/usr/bin/env bash
# A/B of one patch on the GPU machine: the checkout as it is (A) against the checkout with PATCH
# applied (B), each built in its own directory and installed in its own site, then the
# benchmarks of BENCH_KERNELS (bench/run.sh kernels, default moe_layer) run ROUNDS times with the
# variants interleaved (A B A B ...), so that drift of the machine hits both alike.
#
#   bash scripts/ab_patch.sh PATCH [ROUNDS]        (ROUNDS: 3)
#
# Prints each round's tables with the variant named; the patch is taken back out at the end.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
patch="${1:?usage: ab_patch.sh PATCH [ROUNDS]}"
rounds="${2:-3}"
kernels="${BENCH_KERNELS:-moe_layer}"
git apply --check "$patch" || { echo "ab_patch: $patch does not apply" >&2; exit 2; }

build_variant() { # name build-dir site
  BUILD="$PWD/$2" SITE="$3" PYTHON_TESTS=0 OUT="/tmp/ab-$1" \
    bash scripts/device_run.sh build python 2>&1 | grep -E '^== ' | sed "s/^/[$1] /"
}
build_variant A build /tmp/site-a
git apply "$patch"
build_variant B build-ab /tmp/site-b
git apply -R "$patch"

for ((round = 1; round <= rounds; round++)); do
  for variant in A B; do
    if [[ $variant == A ]]; then dir=build site=/tmp/site-a; else dir=build-ab site=/tmp/site-b; fi
    for kernel in $kernels; do
      echo "==== round $round, variant $variant ($kernel)"
      PYTHONPATH="$site" BUILD_DIR="$dir" bash bench/run.sh "$kernel" bench 1 2>&1 |
        grep -vE '^(bench/run.sh|bench_moe|model|moe_layer in-process)'
    done
  done
done
