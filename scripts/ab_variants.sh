#!/usr/bin/env bash
# A/B/... of patches on the GPU machine: each variant is a copy of the checkout (/tmp/ab-src-v<i>)
# with a list of patches applied ("-" or "" for the checkout as it is), built there - every
# variant at once, the cores shared - and installed in its own site; then the benchmarks of
# BENCH_KERNELS (bench/run.sh kernels, default moe_layer) run ROUNDS times from each copy with the
# variants interleaved (1 2 3 1 2 3 ...), so that drift of the machine hits every variant alike,
# all on the same data (one MKERNEL_BENCH_SEED).
#
#   bash scripts/ab_variants.sh ROUNDS VARIANT...    e.g.  2 - a.patch a.patch,b.patch
#   (the word `queue` in a variant stands for docs/design/QUEUE's patches, in order)
#
# Prints each round's tables with the variant named; every results file goes into
# $OUT/ab-results.tar.gz as v<variant>-r<round>/<file> (scripts/ab_table.py prints each variant's
# best time and its ratio to variant 0 from it). The checkout is left as it was.
#
# The tarball is rewritten after every run and the whole log goes to $OUT/ab.log, so a call that
# runs past its time limit still brings back the runs that finished. AB_POINTS=MODEL:T,... runs
# only those points of moe_dispatch_gemm / moe_layer (their world-1 part, bench_moe*.py
# --points): a few points in several rounds, where the whole sweep takes ~150 s a variant.
# AB_RANK_POINTS=MODEL:T,... (T a rank) runs those points with two ranks sharing the GPU
# (bench_moe_ranks --points) after them; with AB_POINTS and without it, no two-rank part.
# AB_BUILD_TARGETS: what each variant builds ("mkernel_python bench_moe_ranks bench_gemm";
# "" for everything). AB_GEMM_ARGS: the gemm kernel's benchmark is bench_gemm with these
# arguments (e.g. "--layouts nk --shapes 640x2048x7168,...") instead of bench/run.sh's sweep.
# AB_TESTS (a ctest regex) and AB_SANITIZE (a gtest filter): before the benchmarks, every
# patched variant runs those GPU suites, and compute-sanitizer's memcheck, racecheck and synccheck
# on those cases (SANITIZE_TIMEOUT, 120 s a tool; device_run.sh's test and sanitize steps) - one
# call then says whether the patches are correct as well as what they buy (mkernel_gpu_tests must
# be in AB_BUILD_TARGETS). Their logs go into the tarball (checks-v<i>/test.log, sanitize.log),
# their verdicts into the log; AB_CHECKS_TIMEOUT (300 s) bounds them a variant.
# Every variant's copy is patched first, before any build starts: a patch that
# does not apply stops the script within seconds, naming it.
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

# A variant's patches, one a line ("queue": docs/design/QUEUE's, in order, in its place).
patches_of() {
  [[ "$1" == - ]] && return 0
  tr ',' '\n' <<<"$1" | sed '/^$/d' | while IFS= read -r p; do
    if [[ "$p" == queue ]]; then bash scripts/queue_patches.sh | tr ',' '\n'; else echo "$p"; fi
  done
}

repo="$PWD"
export MKERNEL_COMMIT="${MKERNEL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
jobs=$(( ($(nproc 2>/dev/null || echo 8) + ${#variants[@]} - 1) / ${#variants[@]} ))
((jobs >= 2)) || jobs=2
# Each variant's copy of the checkout (/tmp/ab-src-v<i>) with its patches applied in order, made
# before any build, one variant after another: a stale patch costs seconds and names itself.
for i in "${!variants[@]}"; do
  src="/tmp/ab-src-v$i"
  rm -rf "$src" && mkdir -p "$src"
  tar -C "$repo" --exclude='./build*' --exclude=./out --exclude=./.git -cf - . | tar -C "$src" -xf -
  while IFS= read -r p; do
    [[ -z "$p" ]] && continue
    (cd "$src" && git apply "$repo/$p") ||
      { echo "ab_variants: variant $i (${variants[$i]}): $p does not apply" >&2; exit 2; }
  done < <(patches_of "${variants[$i]}")
done

build_variant() {  # variant index: build and install its copy
  local i="$1"
  local src="/tmp/ab-src-v$i"
  BUILD="$src/build" SITE="/tmp/site-v$i" PYTHON_TESTS=0 OUT="/tmp/ab-log-v$i" JOBS="$jobs" \
    BUILD_TARGETS="${AB_BUILD_TARGETS-mkernel_python bench_moe_ranks bench_gemm}" \
    bash "$src/scripts/device_run.sh" build python 2>&1 | grep -E '^== ' | sed "s/^/[variant $i] /"
  # A failed build's errors into this log (its own log stays on the machine).
  grep -E 'error|FAILED' "/tmp/ab-log-v$i/build.log" 2>/dev/null | head -40 |
    sed "s/^/[variant $i build] /"
}
pids=()  # (a bare `wait` would also wait for the log's tee, which ends only with this script)
for i in "${!variants[@]}"; do
  build_variant "$i" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
echo "ab_variants: ${#variants[@]} variants built in $SECONDS s"

if [[ -n "${AB_TESTS:-}${AB_SANITIZE:-}" ]]; then
  checks=()
  [[ -n "${AB_TESTS:-}" ]] && checks+=(test)
  [[ -n "${AB_SANITIZE:-}" ]] && checks+=(sanitize)
  for i in "${!variants[@]}"; do
    [[ -z "$(patches_of "${variants[$i]}")" ]] && continue  # the checkout: main's own runs
    # device_run.sh's own test and sanitize steps on the variant's build.
    # (Bounded as a whole, AB_CHECKS_TIMEOUT s: a hang in a patched kernel must leave the call
    # time for the benchmarks.)
    BUILD="/tmp/ab-src-v$i/build" OUT="$results/checks-v$i" \
      CTEST_ARGS="-R ${AB_TESTS:-.} --timeout 200" SANITIZE_FILTER="${AB_SANITIZE:-}" \
      SANITIZE_TIMEOUT="${SANITIZE_TIMEOUT:-120}" \
      timeout --kill-after=10 "${AB_CHECKS_TIMEOUT:-300}" \
      bash "/tmp/ab-src-v$i/scripts/device_run.sh" "${checks[@]}" 2>&1 |
      grep -E '^== |tests passed|tests failed|\*\*\*|sanitize [a-z]+: ' | awk '!seen[$0]++' |
      sed "s/^/[variant $i] /"  # (device_run.sh repeats its steps' verdicts at the end)
  done
  tar -czf "$OUT/ab-results.tar.gz" -C "$results" .
fi

for ((round = 1; round <= rounds; round++)); do
  for i in "${!variants[@]}"; do
    for kernel in $kernels; do
      echo "==== round $round, variant $i (${variants[$i]}), $kernel"
      marker="$(mktemp)"
      bench_cmd=(bash bench/run.sh "$kernel" bench 1)
      if [[ -n "${AB_GEMM_ARGS:-}" && "$kernel" == gemm ]]; then
        read -r -a gemm_args <<<"$AB_GEMM_ARGS"
        bench_cmd=(build/bench/bench_gemm "${gemm_args[@]}" --json bench/results/gemm-ab-w1.json)
      fi
      if [[ -n "${AB_POINTS:-}" && ("$kernel" == moe_dispatch_gemm || "$kernel" == moe_layer) ]]; then
        script=bench/bench_moe.py
        [[ "$kernel" == moe_layer ]] && script=bench/bench_moe_layer.py
        bench_cmd=(python3 "$script" --mode bench --points "$AB_POINTS"
                   --json "bench/results/$kernel-ab-w1.json")
      fi
      # (The results files name the variant beside the commit.)
      (cd "/tmp/ab-src-v$i" && PYTHONPATH="/tmp/site-v$i" BUILD_DIR=build \
        MKERNEL_COMMIT="$MKERNEL_COMMIT+${variants[$i]}" "${bench_cmd[@]}") 2>&1 |
        grep -vE '^(bench/run.sh|bench_moe|moe_layer in-process)'
      if [[ -n "${AB_RANK_POINTS:-}" && ("$kernel" == moe_dispatch_gemm || "$kernel" == moe_layer) ]]; then
        (cd "/tmp/ab-src-v$i" && build/bench/bench_moe_ranks --op "$kernel" --ranks 2 \
          --points "$AB_RANK_POINTS" --json "bench/results/$kernel-ab-w2-one-gpu.json" \
          --commit "$MKERNEL_COMMIT+${variants[$i]}") 2>&1
      fi
      mkdir -p "$results/v$i-r$round"
      find "/tmp/ab-src-v$i/bench/results" -maxdepth 1 -name '*.json' -newer "$marker" \
        -exec cp -t "$results/v$i-r$round" {} +
      rm -f "$marker"
      tar -czf "$OUT/ab-results.tar.gz" -C "$results" .
    done
  done
done
