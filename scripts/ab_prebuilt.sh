#!/usr/bin/env bash
# A/B/... of prebuilt variants on the GPU machine, nothing compiled there: each variant is a
# folder prebuilt-NAME/ made here by scripts/prebuild.sh (e.g. v0 = main, v1 = the queue) and
# carried. The benchmarks run ROUNDS times with the variants interleaved (v0 v1 v2 v0 v1 v2 ...),
# all on the same data (one MKERNEL_BENCH_SEED), so that drift of the machine hits every variant
# alike; then, if asked, each variant's GPU tests.
#
#   bash scripts/ab_prebuilt.sh ROUNDS NAME...        e.g.  AB_RUNS="moe gemm ring" ... 2 v0 v1 v2
#
# AB_RUNS (default "moe gemm ring"), each run where the variant has the executable:
#   moe   bench_moe_ranks --op moe_dispatch_gemm: two ranks sharing the GPU at AB_RANK_POINTS
#         (MODEL:TOKENS a rank; default Qwen3 512 / 2048 / 4096, DeepSeek-V3 2048, Mixtral 2048),
#         then world 1 cut after each node of the call (--prefix) at AB_PREFIX_POINTS (Qwen3 1024
#         and 8192): the route kernels', notify's and the fused launch's shares
#   gemm  bench_gemm --layouts nk,kn at AB_GEMM_SHAPES (the mid-M points below 0.95 of cuBLAS;
#         "sweep": bench_gemm's own sweep, issue 28's 192 points, ~25 s a variant on an H100)
#   ring  bench_ring_attention --ranks 2 (its eight shapes)
#   attention  bench/bench_attention.py --mode bench (against SDPA) on the variant's module
#         (_C*.so: prebuild.sh's mkernel_python), installed once a variant into /tmp/ab-site-<i>
#         (scripts/python_gpu_test.sh); not in the default runs
#   grouped  bench/bench_grouped.py --mode bench (against torch._grouped_mm) on the variant's
#         module as attention's, with AB_GROUPED_ARGS (default --quick: a few points; "" for
#         issue 28's whole grouped sweep); not in the default runs
# AB_TESTS: a gtest filter each variant's mkernel_gpu_tests runs after the benchmarks (e.g.
# '*Moe*:*RingAttention*'), AB_TESTS_TIMEOUT (200 s) a variant. AB_DEADLINE: seconds from the
# start after which nothing new starts (default 540: a call's 600 s less a margin).
# Results: $OUT/ab-results.tar.gz as v<i>-r<round>/<file> (i: the variant's place in the list),
# rewritten after every run, so that a call stopped at its limit brings back what finished;
# `python3 scripts/ab_table.py ab-results.tar.gz` prints each variant's best time and its ratio to
# the first. The log: $OUT/ab.log (and stdout, the tables' lines).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export NCCL_NVLS_ENABLE=0 NCCL_NVLS_DISABLE=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
rounds="${1:?usage: ab_prebuilt.sh ROUNDS NAME...}"
shift
(($# >= 1)) || { echo "ab_prebuilt: no variant" >&2; exit 2; }
names=("$@")
export MKERNEL_BENCH_SEED="${MKERNEL_BENCH_SEED:-$((RANDOM * 32768 + RANDOM))}"
OUT="${OUT:-$PWD/out}"
results=/tmp/ab-prebuilt
rm -rf "$results" && mkdir -p "$OUT" "$results"
exec > >(tee -a "$OUT/ab.log") 2>&1
deadline=$((SECONDS + ${AB_DEADLINE:-540}))
default="qwen3_235b:512,qwen3_235b:2048,qwen3_235b:4096,deepseek_v3:2048,mixtral:2048"
rank_points="${AB_RANK_POINTS:-$default}"
prefix_points="${AB_PREFIX_POINTS:-qwen3_235b:1024,qwen3_235b:8192}"
default="640x2048x7168,768x2048x7168,384x4096x14336,640x4096x14336,256x14336x4096"
default+=",512x7168x2048,640x7168x2048,2048x7168x2048,256x28672x8192,8192x8192x8192"
gemm_shapes="${AB_GEMM_SHAPES:-$default}"
echo "ab_prebuilt: data seed $MKERNEL_BENCH_SEED; variants ${names[*]};" \
     "runs ${AB_RUNS:-moe gemm ring}"
bash scripts/unpack_prebuilt.sh "${names[@]}" || exit 1

# Runs "$@" (a benchmark writing $json) for variant i, round r, unless past the deadline.
run() {
  local i="$1" r="$2" json="$3" left
  shift 3
  left=$((deadline - SECONDS))
  if ((left < 10)); then echo "ab_prebuilt: past the deadline, skipped: $*"; return 0; fi
  mkdir -p "$results/v$i-r$r"
  echo "== v$i (${names[$i]}) round $r: $*"
  timeout "$left" "$@" --json "$results/v$i-r$r/$json" || echo "ab_prebuilt: exit $? from $*"
  tar -czf "$OUT/ab-results.tar.gz" -C "$results" .
}

for ((r = 1; r <= rounds; ++r)); do
  for i in "${!names[@]}"; do
    dir="prebuilt-${names[$i]}"
    for what in ${AB_RUNS:-moe gemm ring}; do
      case "$what" in
        moe)
          [[ -x "$dir/bench_moe_ranks" ]] || continue
          run "$i" "$r" moe_dispatch_gemm-ab-w2-one-gpu.json "$dir/bench_moe_ranks" \
            --op moe_dispatch_gemm --ranks 2 --points "$rank_points" --commit "${names[$i]}"
          run "$i" "$r" moe_dispatch_gemm-ab-w1-prefix.json "$dir/bench_moe_ranks" \
            --op moe_dispatch_gemm --ranks 1 --prefix "$prefix_points" --commit "${names[$i]}" ;;
        gemm)
          [[ -x "$dir/bench_gemm" ]] || continue
          if [[ "$gemm_shapes" == sweep ]]; then
            run "$i" "$r" gemm-ab-w1.json "$dir/bench_gemm" --layouts nk,kn
          else
            run "$i" "$r" gemm-ab-w1.json "$dir/bench_gemm" --layouts nk,kn --shapes "$gemm_shapes"
          fi ;;
        ring)
          [[ -x "$dir/bench_ring_attention" ]] || continue
          run "$i" "$r" ring_attention-ab-w1.json "$dir/bench_ring_attention" --ranks 2 \
            --commit "${names[$i]}" ;;
        attention | grouped)
          compgen -G "$dir/_C*.so" >/dev/null || continue
          site="/tmp/ab-site-$i"
          if [[ ! -d "$site/mkernel" ]]; then
            SITE="$site" PREBUILT_DIR="$PWD/$dir/build" PYTHON_TESTS=0 OUT="$results/install-v$i" \
              bash scripts/python_gpu_test.sh >/dev/null 2>&1 ||
              { echo "ab_prebuilt: ${names[$i]}: its module did not install"; continue; }
          fi
          if [[ "$what" == attention ]]; then
            run "$i" "$r" attention-ab-w1.json env PYTHONPATH="$site" python3 \
              bench/bench_attention.py --mode bench
          else
            # shellcheck disable=SC2086  # (AB_GROUPED_ARGS: words)
            run "$i" "$r" grouped_gemm-ab-w1.json env PYTHONPATH="$site" python3 \
              bench/bench_grouped.py --mode bench ${AB_GROUPED_ARGS---quick}
          fi ;;
        *) echo "ab_prebuilt: unknown run '$what' (moe, gemm, ring, attention, grouped)"; exit 2 ;;
      esac
    done
  done
done

status=0
if [[ -n "${AB_TESTS:-}" ]]; then
  for i in "${!names[@]}"; do
    dir="prebuilt-${names[$i]}"
    left=$((deadline - SECONDS))
    ((left > 10)) || { echo "ab_prebuilt: past the deadline, no tests for ${names[$i]}"; continue; }
    ((left > ${AB_TESTS_TIMEOUT:-200})) && left=${AB_TESTS_TIMEOUT:-200}
    mkdir -p "$results/tests-v$i"
    MKERNEL_BOOTSTRAP_TIMEOUT_S=60 timeout "$left" "$dir/mkernel_gpu_tests" --gtest_brief=1 \
      --gtest_filter="$AB_TESTS" >"$results/tests-v$i/test.log" 2>&1
    rc=$?
    verdict=PASS
    ((rc == 0)) || verdict="FAIL (rc $rc)"
    echo "ab_prebuilt: ${names[$i]} tests ($AB_TESTS): $verdict"
    grep -E "^\[  FAILED  \]" "$results/tests-v$i/test.log" | head -20
    ((rc == 0)) || status=1
    tar -czf "$OUT/ab-results.tar.gz" -C "$results" .
  done
fi
python3 scripts/ab_table.py "$results" || true
exit "$status"
