#!/usr/bin/env bash
# A/B/... of patches on the GPU machine: each variant is the checkout with a list of patches
# applied ("-" or "" for the checkout as it is), built in its own directory and installed in its
# own site; then the benchmarks of BENCH_KERNELS (bench/run.sh kernels, default moe_layer) run
# ROUNDS times with the variants interleaved (1 2 3 1 2 3 ...), so that drift of the machine hits
# every variant alike, all on the same data (one MKERNEL_BENCH_SEED).
#
#   bash scripts/ab_variants.sh ROUNDS VARIANT...    e.g.  2 - a.patch a.patch,b.patch
#
# Prints each round's tables with the variant named; every results file goes into
# $OUT/ab-results.tar.gz as v<variant>-r<round>/<file> (scripts/ab_table.py prints each variant's
# best time and its ratio to variant 0 from it). The checkout is left as it was.
#
# The tarball is rewritten after every run and the whole log goes to $OUT/ab.log, so a call that
# runs past its time limit still brings back the runs that finished. AB_POINTS=MODEL:T,... runs
# only those points of moe_dispatch_gemm / moe_layer (their world-1 part, bench_moe*.py
# --points): a few points in several rounds, where the whole sweep takes ~150 s a variant.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
rounds="${1:?usage: ab_variants.sh ROUNDS VARIANT...}"
shift
(($# >= 1)) || { echo "ab_variants: no variant" >&2; exit 2; }
variants=("$@")
kernels="${BENCH_KERNELS:-moe_layer}"
# One seed for every variant and round: the same routing and values, so that a difference is the
# variants' (a MoE point's time moves with its routing).
export MKERNEL_BENCH_SEED="${MKERNEL_BENCH_SEED:-$((RANDOM * 32768 + RANDOM))}"
OUT="${OUT:-$PWD/out}"
results=/tmp/ab-results
rm -rf "$results" && mkdir -p "$OUT" "$results"
exec > >(tee -a "$OUT/ab.log") 2>&1
echo "ab_variants: data seed $MKERNEL_BENCH_SEED (MKERNEL_BENCH_SEED)"

patches_of() { [[ "$1" == - ]] && return 0; tr ',' '\n' <<<"$1" | sed '/^$/d'; }

for i in "${!variants[@]}"; do
  mapfile -t list < <(patches_of "${variants[$i]}")
  for p in "${list[@]}"; do git apply "$p" || { echo "ab_variants: $p does not apply" >&2; exit 2; }; done
  BUILD="$PWD/build-v$i" SITE="/tmp/site-v$i" PYTHON_TESTS=0 OUT="/tmp/ab-log-v$i" \
    bash scripts/device_run.sh build python 2>&1 | grep -E '^== ' | sed "s/^/[variant $i] /"
  for ((j = ${#list[@]} - 1; j >= 0; j--)); do git apply -R "${list[$j]}"; done
done

for ((round = 1; round <= rounds; round++)); do
  for i in "${!variants[@]}"; do
    for kernel in $kernels; do
      echo "==== round $round, variant $i (${variants[$i]}), $kernel"
      marker="$(mktemp)"
      bench_cmd=(bash bench/run.sh "$kernel" bench 1)
      if [[ -n "${AB_POINTS:-}" && ("$kernel" == moe_dispatch_gemm || "$kernel" == moe_layer) ]]; then
        script=bench/bench_moe.py
        [[ "$kernel" == moe_layer ]] && script=bench/bench_moe_layer.py
        bench_cmd=(python3 "$script" --mode bench --points "$AB_POINTS"
                   --json "bench/results/$kernel-ab-w1.json")
      fi
      PYTHONPATH="/tmp/site-v$i" BUILD_DIR="build-v$i" "${bench_cmd[@]}" 2>&1 |
        grep -vE '^(bench/run.sh|bench_moe|moe_layer in-process)'
      mkdir -p "$results/v$i-r$round"
      find bench/results -maxdepth 1 -name '*.json' -newer "$marker" -exec cp -t "$results/v$i-r$round" {} +
      rm -f "$marker"
      tar -czf "$OUT/ab-results.tar.gz" -C "$results" .
    done
  done
done
