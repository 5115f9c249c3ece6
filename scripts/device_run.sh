#!/usr/bin/env bash
# The one script sent to the GPU machine (see /work/.library/device/README.md).
#
#   bash scripts/device_run.sh [build|test|sanitize|python|bench|candidates|check|compare|trace|ab|nodes|host|profile|bisect|all]...
#   (default: all)
#
# Steps run in the order given; `all` = build test sanitize python bench (`host`: the host time
# per op, bench_launch + bench_host.py, after `python`). `python` builds the
# package into $SITE (/tmp/site) and runs tests/python (scripts/python_gpu_test.sh); later steps
# import it from there (the fused kernels' benchmarks need it). A failed step does not stop
# the later ones; each ends with one line "== <step>: PASS|FAIL|SKIP (<s> s) ..." and the script
# exits non-zero when any step failed. Logs go to $OUT (./out when $OUT is unset):
#   build.log  test.log  topo.txt  sanitize.log  bench.log  nodes.log  host.log  bisect.log  and the JSON files
# (at most 8 files come back from $OUT: JSON beyond that is packed into bench-json.tar.gz).
#
# That machine has nvcc, cmake, ninja and python3 with torch, and no internet. GoogleTest is taken
# from the system when it has one (its image of 2026-11-30 had 1.14 in /usr), else from `.deps`:
# run scripts/pack_deps.sh here and carry `.deps` (and `build` to reuse a build made here).
# A call that only runs (tests, benchmarks) can skip building there altogether: scripts/prebuild.sh
# builds the executables here, stripped and compressed, and scripts/unpack_prebuilt.sh unpacks them
# (then BUILD=$PWD/prebuilt-NAME/build for the python and bench steps; scripts/ab_prebuilt.sh
# times prebuilt variants side by side).
#
# Environment knobs: BUILD (build: the CMake build directory), BUILD_TARGETS (build: only these
# targets), JOBS (build: parallel jobs; nproc), BACKEND (socket), BUILD_TYPE (Release), CMAKE_ARGS,
# CTEST_ARGS
# (--timeout 300), SANITIZE_TIMEOUT (300 s a run: then it is hung), SANITIZE_RUNS (1: runs a
# tool), SANITIZE_FILTER (gtest filter of the
# sanitized tests: Sanitize*), SITE (/tmp/site), BENCH_KERNELS ("all
# transport": bench/run.sh kernels; all = collectives, gemm and the fused kernels),
# PATCHES (a comma list of patches applied to this copy first: queued experiments; `queue`: all of
# docs/design/QUEUE in order),
# PYTHON_TESTS=0 (python step installs only), PYTEST_ARGS (shell words added to its pytest
# command, e.g. "-v -k 'moe or gemm_op'"), COMPARE_KERNELS / COMPARE_SHAPES / COMPARE_P2P=0
# (compare step: which kernels and shapes, without the bench_p2p table), TRACE_CASES, AB_OLD / AB_ROUNDS /
# AB_CASES (ab step: the directory of the other build's bench_gemm and trace_fused, rounds, the
# traced cases), PROFILE_CMD / PROFILE_KERNELS / PROFILE_COUNT / PROFILE_METRICS (profile step:
# ncu on a command's kernels; see step_profile), CANDIDATE_SHAPES / CANDIDATE_TIMEOUT (candidates
# step: bench_gemm --candidates's shapes, default the sweep's 84 up to M 2048; its limit, 300 s).

# Results files record $MKERNEL_COMMIT (else `git rev-parse HEAD` there): pass the commit
# checked out here (MKERNEL_COMMIT=$(git rev-parse --short HEAD) written into the command) - the
# device's copy of the checkout has reported another HEAD (2026-12-01: main's, with a branch
# checked out here).
#
# NVLink multicast (NVLS) must stay off on the shared hosts: it can take their GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_NVLS_DISABLE=1
export PYTHONUNBUFFERED=1

set -uo pipefail  # no -e: every step reports and the later steps still run

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO="$PWD"
OUT="${OUT:-$REPO/out}"
# The package the python step installs; the bench step's fused kernels import it.
export PYTHONPATH="${SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
BUILD="${BUILD:-$REPO/build}"
GPU_TESTS="$BUILD/tests/mkernel_gpu_tests"
BACKEND="${BACKEND:-socket}"
BUILD_TYPE="${BUILD_TYPE:-Release}"
read -r -a CMAKE_EXTRA <<<"${CMAKE_ARGS:-}"
read -r -a CTEST_EXTRA <<<"${CTEST_ARGS:---timeout 300}"
SANITIZE_TIMEOUT="${SANITIZE_TIMEOUT:-300}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 8)}"
# BUILD_TARGETS: only these CMake targets (e.g. "mkernel_python bench_moe_ranks"), else all.
read -r -a BUILD_TARGET_ARGS <<<"${BUILD_TARGETS:+--target $BUILD_TARGETS}"
GENERATOR=Ninja
command -v ninja >/dev/null || GENERATOR="Unix Makefiles"

if [[ -z "${CUDA_HOME:-}" ]]; then
  if command -v nvcc >/dev/null; then
    CUDA_HOME="$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)"
  else
    CUDA_HOME=/usr/local/cuda
  fi
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"

log() { printf '[device_run %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
# Runs a command under `timeout` where coreutils has it.
limited() {
  local seconds="$1"
  shift
  if command -v timeout >/dev/null; then timeout --kill-after=10 "$seconds" "$@"; else "$@"; fi
}

# ---- build ----------------------------------------------------------------------------------
# A build/ carried from the development machine holds absolute paths of its source tree there
# (CTestTestfile.cmake, MKRUN_PATH): point that path at this checkout when it is free.
reuse_carried_build() {
  [[ -f "$BUILD/CTestTestfile.cmake" && -x "$GPU_TESTS" ]] || return 1
  local src
  src="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt" 2>/dev/null)"
  [[ -n "$src" ]] || return 1
  if [[ ! "$src" -ef "$REPO" ]]; then
    if [[ -e "$src" || -L "$src" ]]; then
      log "carried build/ was made in $src, which exists here and is not this checkout"
      return 1
    fi
    mkdir -p "$(dirname "$src")" && ln -s "$REPO" "$src" || return 1
    log "linked $src -> $REPO (the carried build's source path)"
  fi
  log "reusing the build/ there (made from $src): building what changed"
}

# Prints the GoogleTest root to configure with: nothing when the system has GoogleTest, else the
# packed libraries when they link with this machine's compiler, else GoogleTest rebuilt from the
# packed sources.
gtest_root() {
  local deps="$REPO/.deps" probe=/tmp/mk-gtest-probe dir
  for dir in /usr/lib/x86_64-linux-gnu /usr/lib /usr/lib64 /usr/local/lib; do
    if [[ -f "$dir/cmake/GTest/GTestConfig.cmake" ]]; then
      log "GoogleTest: the system's ($dir/cmake/GTest)" >&2
      return 0
    fi
  done
  if [[ -f "$deps/gtest/lib/libgtest.a" ]]; then
    mkdir -p "$probe"
    printf '#include <gtest/gtest.h>\nTEST(Probe, Links) { EXPECT_EQ(1, 1); }\n' >"$probe/t.cpp"
    if "${CXX:-c++}" -std=c++20 -I"$deps/gtest/include" "$probe/t.cpp" \
      "$deps/gtest/lib/libgtest_main.a" "$deps/gtest/lib/libgtest.a" -pthread -o "$probe/t" &&
      "$probe/t" >/dev/null; then
      log "GoogleTest: packed libraries in .deps/gtest" >&2
      echo "$deps/gtest"
      return 0
    fi
    log "GoogleTest: the packed libraries do not link here" >&2
  fi
  if [[ -f "$deps/googletest-src/CMakeLists.txt" ]]; then
    log "GoogleTest: building it from .deps/googletest-src" >&2
    local prefix=/tmp/mk-gtest
    cmake -S "$deps/googletest-src" -B /tmp/mk-gtest-build -G "$GENERATOR" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib \
      -DBUILD_GMOCK=ON >&2 &&
      cmake --build /tmp/mk-gtest-build -j "$JOBS" >&2 &&
      cmake --install /tmp/mk-gtest-build >&2 &&
      echo "$prefix" && return 0
  fi
  log "GoogleTest: none usable; run scripts/pack_deps.sh where you develop and carry .deps" >&2
  return 1
}

step_build() {
  # A build/ already there (carried, or left by an earlier call on a warm machine) is brought up
  # to date, never used as it stands: the sources may have changed since it was made.
  if reuse_carried_build; then
    cmake --build "$BUILD" -j "$JOBS" "${BUILD_TARGET_ARGS[@]}" 2>&1 | tee -a "$OUT/build.log" |
      tail -3
    return "${PIPESTATUS[0]}"
  fi
  [[ -x "$CUDA_HOME/bin/nvcc" ]] || { log "no nvcc in $CUDA_HOME/bin"; return 1; }
  local gtest gtest_args=()
  gtest="$(gtest_root)" || return 1
  [[ -z "$gtest" ]] || gtest_args=(-DGTEST_ROOT="$gtest" -DGTest_ROOT="$gtest")
  # The Python module in the same build (the python step installs it without compiling the
  # library a second time), where the interpreter has nanobind.
  local python_args=()
  if python3 -m nanobind --cmake_dir >/dev/null 2>&1; then
    python_args=(-DMKERNEL_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)")
  fi
  # A stale cache (another source path or generator) would stop CMake: start it afresh.
  rm -rf "$BUILD/CMakeCache.txt" "$BUILD/CMakeFiles"
  log "configuring: backend=$BACKEND type=$BUILD_TYPE nvcc=$CUDA_HOME/bin/nvcc" \
    "gtest=${gtest:-system}"
  cmake -S "$REPO" -B "$BUILD" -G "$GENERATOR" \
    -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -DMKERNEL_BACKEND="$BACKEND" \
    -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" \
    -DCUDAToolkit_ROOT="$CUDA_HOME" \
    "${gtest_args[@]}" \
    -DPython3_EXECUTABLE="$(command -v python3)" \
    "${python_args[@]}" \
    "${CMAKE_EXTRA[@]}" || return 1
  log "building with $JOBS jobs"
  # Keep going past a failed target (the Python module, say): the rest can still be tested.
  local keep_going=()
  [[ "$GENERATOR" == Ninja ]] && keep_going=(-- -k 0)
  cmake --build "$BUILD" -j "$JOBS" "${BUILD_TARGET_ARGS[@]}" "${keep_going[@]}"
}

# ---- test -----------------------------------------------------------------------------------
step_test() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L
    nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
    cat "$OUT/topo.txt"
  else
    log "no nvidia-smi on PATH" | tee "$OUT/topo.txt"
  fi
  if [[ ! -f "$BUILD/CTestTestfile.cmake" ]]; then
    log "no build/CTestTestfile.cmake: run the build step first"
    return 1
  fi
  ctest --test-dir "$BUILD" --output-on-failure "${CTEST_EXTRA[@]}" 2>&1 | tee "$OUT/test.log"
  local rc="${PIPESTATUS[0]}"
  # The figures some suites print for the journal (passing tests' output is not shown above).
  grep -hE '^\[(host step|entry points)\]' "$BUILD/Testing/Temporary/LastTest.log" 2>/dev/null |
    tee -a "$OUT/test.log"
  return "$rc"
}

# ---- sanitize -------------------------------------------------------------------------------
SKIP=3  # a step's return code for "nothing to do"

step_sanitize() {
  [[ -x "$GPU_TESTS" ]] || { log "no $GPU_TESTS"; return "$SKIP"; }
  local filter="${SANITIZE_FILTER:-Sanitize*}"
  if ! "$GPU_TESTS" --gtest_list_tests --gtest_filter="$filter" | grep -q '^  '; then
    log "no Sanitize* tests in $GPU_TESTS"
    return "$SKIP"
  fi
  # Each tool SANITIZE_RUNS times (scripts/sanitize_repeat.sh: a run past SANITIZE_TIMEOUT is
  # hung, and its log gets the host threads' stacks); the runs' logs end up in sanitize.log.
  local logs=/tmp/device_run-sanitize rc
  rm -rf "$logs"
  {
    HANG_S="$SANITIZE_TIMEOUT" OUT="$logs" bash "$REPO/scripts/sanitize_repeat.sh" "$GPU_TESTS" \
      "$filter" "${SANITIZE_RUNS:-1}" "memcheck racecheck synccheck"
    rc=$?
    for f in "$logs"/sanitize-*.log; do
      if [[ -e "$f" ]]; then echo "==== ${f##*/}"; cat "$f"; fi
    done
    ((rc == 0))
  } 2>&1 | tee "$OUT/sanitize.log"
  return "${PIPESTATUS[0]}"
}

# ---- python ---------------------------------------------------------------------------------
step_python() {
  local args=()
  # Shell words, quotes kept: PYTEST_ARGS="-k 'moe or gemm_op'" is one -k expression.
  eval "args=(${PYTEST_ARGS:-})"
  # The module the build step made, if any: installed by copying (PREBUILT_DIR).
  local prebuilt=""
  compgen -G "$BUILD/_C*.so" >/dev/null && prebuilt="$BUILD"
  SITE="${SITE:-/tmp/site}" OUT="$OUT" PREBUILT_DIR="$prebuilt" \
    bash "$REPO/scripts/python_gpu_test.sh" "${args[@]}" || return 1
}

# ---- bench ----------------------------------------------------------------------------------
# The fused kernels' other configurations next to the default (scripts/compare_configs.sh), and
# the NVLink rates per CTA (bench_p2p): needs the python step's package. Everything goes into
# $OUT/compare.tar.gz (the machine returns at most 8 files); the tables also go to stdout.
step_compare() {
  local dir=/tmp/mk-compare rc=0
  rm -rf "$dir" && mkdir -p "$dir"
  if [[ "${COMPARE_P2P:-1}" == 0 ]]; then
    log "COMPARE_P2P=0: no bench_p2p table"
  elif [[ -x "$BUILD/bench/bench_p2p" ]]; then
    "$BUILD/bench/bench_p2p" 2>&1 | tee "$dir/p2p.log"
    ((PIPESTATUS[0] == 0)) || rc=1
  else
    log "no $BUILD/bench/bench_p2p"
    rc=1
  fi
  bash "$REPO/scripts/compare_configs.sh" "${COMPARE_SHAPES:-}" "$dir" 2>&1 | tee "$dir/compare.log"
  # One JSON file per kernel when its run finished.
  local kernels
  read -r -a kernels <<<"${COMPARE_KERNELS:-gemm_rs gemm_ar}"
  (($(find "$dir" -maxdepth 1 -name '*.json' | wc -l) == ${#kernels[@]})) || rc=1
  tar -czf "$OUT/compare.tar.gz" -C "$dir" .
  return "$rc"
}

# ---- trace ----------------------------------------------------------------------------------
# Timelines of gemm_rs / gemm_ar launches (bench/trace_fused.cpp, two ranks: processes on two
# GPUs, threads of one process on one GPU): the summaries go to stdout, the records to
# $OUT/trace.tar.gz. TRACE_CASES: "kernel:MxNxK[:VAR=value,...[:--option,value,...]]" words
# (options of trace_fused, e.g. --comm-ctas,16); "moe_dispatch_gemm:MODEL/TOKENS" or
# "moe_layer:MODEL/TOKENS" (tokens a rank; bench_moe_ranks --trace: two ranks as threads and world
# 1 on the same work, summaries only), e.g. TRACE_CASES=moe_dispatch_gemm:qwen3_235b/4096.
step_trace() {
  local dir=/tmp/mk-trace rc=0 c kernel shape envs opts i=0
  [[ -x "$BUILD/bench/trace_fused" ]] || { log "no $BUILD/bench/trace_fused"; return 1; }
  rm -rf "$dir" && mkdir -p "$dir"
  local gpus
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
  ((gpus >= 2)) || log "one GPU: the traces run two ranks in one process (SM work, not NVLink)"
  for c in ${TRACE_CASES:-gemm_rs:8192x8192x8192 gemm_ar:8192x8192x8192}; do
    IFS=: read -r kernel shape envs opts <<<"$c"
    i=$((i + 1))
    echo "=== trace $c"
    if [[ "$kernel" == moe_* ]]; then  # moe_dispatch_gemm:MODEL/TOKENS (tokens a rank)
      env ${envs//,/ } timeout 300 "$BUILD/bench/bench_moe_ranks" --op "$kernel" --ranks 2 \
        --iters 3 --trace "${shape/\//:}" ${opts//,/ } || rc=1
    elif ((gpus >= 2)); then
      env ${envs//,/ } timeout 120 "$BUILD/mkrun" -n 2 -- "$BUILD/bench/trace_fused" \
        --kernel "$kernel" --shape "$shape" ${opts//,/ } --csv "$dir/$i-$kernel-$shape.csv" ||
        rc=1
    else  # one GPU: two ranks as threads of one process, side by side on its SMs
      env ${envs//,/ } timeout 120 "$BUILD/bench/trace_fused" --ranks 2 \
        --kernel "$kernel" --shape "$shape" ${opts//,/ } --csv "$dir/$i-$kernel-$shape.csv" ||
        rc=1
    fi
  done
  tar -czf "$OUT/trace.tar.gz" -C "$dir" .
  return "$rc"
}

# ---- ab ---------------------------------------------------------------------------------------
# Before / after in one run: another build's bench_gemm and trace_fused (AB_OLD, e.g. a carried
# .device/old made from an earlier commit) against this build's, in alternating rounds (old, new,
# old, new, ...), so that drift hits both alike. bench_gemm: its default shapes, mkernel and cuBLAS
# in each run; trace_fused: two ranks (threads of one process on one GPU), the CUDA-event time of
# each rank's traced launch. The medians per case go to stdout (the table last) and $OUT/ab.log.
step_ab() {
  local old="${AB_OLD:-$REPO/.device/old}" rounds="${AB_ROUNDS:-3}" dir=/tmp/mk-ab rc=0 r c
  [[ -x "$old/bench_gemm" && -x "$old/trace_fused" ]] || { log "no bench_gemm / trace_fused in $old"; return 1; }
  rm -rf "$dir" && mkdir -p "$dir"
  local gpus
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
  for ((r = 0; r < rounds; ++r)); do
    for side in old new; do
      local bin="$old"
      [[ "$side" == new ]] && bin="$BUILD/bench"
      limited 300 "$bin/bench_gemm" --iters 30 >"$dir/gemm-$side-$r.txt" 2>&1 || rc=1
      for c in ${AB_CASES:-ag_gemm:4096x4096x4096 ag_gemm:8192x8192x8192 gemm_rs:4096x4096x4096 gemm_rs:8192x8192x8192 gemm_ar:4096x4096x4096 gemm_ar:8192x8192x8192}; do
        local kernel="${c%%:*}" shape="${c#*:}"
        if ((gpus >= 2)); then
          limited 120 "$BUILD/mkrun" -n 2 -- "$bin/trace_fused" --kernel "$kernel" --shape "$shape" \
            --iters 10 >"$dir/trace-$side-$r-$kernel-$shape.txt" 2>&1 || rc=1
        else
          limited 120 "$bin/trace_fused" --ranks 2 --kernel "$kernel" --shape "$shape" \
            --iters 10 >"$dir/trace-$side-$r-$kernel-$shape.txt" 2>&1 || rc=1
        fi
      done
    done
  done
  python3 - "$dir" "$rounds" <<'PY' 2>&1 | tee "$OUT/ab.log"
import glob, re, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
def gemm(side):
    per = {}
    for f in sorted(glob.glob(f"{d}/gemm-{side}-*.txt")):
        for line in open(f):
            m = re.match(r"(\d+x\d+x\d+)\s+([\d.]+)\s+([\d.]+)", line)
            if m:
                per.setdefault(m.group(1), []).append((float(m.group(2)), float(m.group(3))))
    return per
def trace(side):
    per = {}
    for f in sorted(glob.glob(f"{d}/trace-{side}-*.txt")):
        case = re.match(r".*/trace-\w+-\d+-(.*)\.txt", f).group(1)
        ranks = [float(x) for x in re.findall(r"\(([\d.]+) us by CUDA events\)", open(f).read())]
        if ranks:
            per.setdefault(case, []).append(max(ranks))
    return per
go, gn = gemm("old"), gemm("new")
print("plain GEMM (ms, median over rounds; cuBLAS of the same runs)")
print(f"{'shape':>20} {'old':>8} {'new':>8} {'new/old':>8} {'cuBLAS old':>11} {'cuBLAS new':>11}")
for shape in go:
    o = statistics.median(x for x, _ in go[shape]); n = statistics.median(x for x, _ in gn.get(shape, [(0, 0)]))
    bo = statistics.median(y for _, y in go[shape]); bn = statistics.median(y for _, y in gn.get(shape, [(0, 0)]))
    print(f"{shape:>20} {o:8.3f} {n:8.3f} {n / o:8.3f} {bo:11.3f} {bn:11.3f}")
to, tn = trace("old"), trace("new")
print("fused, two ranks in one process (us, the slower rank's traced launch by CUDA events; median, spread)")
print(f"{'case':>28} {'old':>9} {'new':>9} {'new/old':>8}   old runs / new runs")
for case in to:
    o, n = statistics.median(to[case]), statistics.median(tn.get(case, [0]))
    print(f"{case:>28} {o:9.1f} {n:9.1f} {n / o:8.3f}   {' '.join(f'{x:.0f}' for x in to[case])} / {' '.join(f'{x:.0f}' for x in tn.get(case, []))}")
PY
  tar -czf "$OUT/ab.tar.gz" -C "$dir" .
  return "$rc"
}

# ---- host -----------------------------------------------------------------------------------
# The host's share of an op (bench/bench_launch.cu, then bench/bench_host.py with the python
# step's package): microseconds per call of the C++ entry's pieces and of each Python layer, two
# ranks (sharing a GPU on a one-GPU machine). Output to stdout and $OUT/host.log.
step_host() {
  local rc=0
  [[ -x "$BUILD/bench/bench_launch" ]] || { log "no $BUILD/bench/bench_launch"; return 1; }
  timeout 120 "$BUILD/mkrun" -n 2 -- "$BUILD/bench/bench_launch" 2>&1 | tee "$OUT/host.log"
  ((PIPESTATUS[0] == 0)) || rc=1
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    "$REPO/bench/bench_host.py" 2>&1 | tee -a "$OUT/host.log"
  ((PIPESTATUS[0] == 0)) || rc=1
  return "$rc"
}

# ---- bisect ---------------------------------------------------------------------------------
# Ring attention at world 1 against the engine, piece by piece (bench_ring_bisect; issue 32,
# docs/design/attention.md): on every SM, then on BISECT_SMS (66: a rank's share with two ranks
# sharing the GPU). BUILD_TARGETS=bench_ring_bisect builds just it.
step_bisect() {
  local rc=0 sms
  [[ -x "$BUILD/bench/bench_ring_bisect" ]] || { log "no $BUILD/bench/bench_ring_bisect"; return 1; }
  for sms in 0 ${BISECT_SMS:-66}; do
    timeout 300 "$BUILD/bench/bench_ring_bisect" --sms "$sms" 2>&1 | tee -a "$OUT/bisect.log"
    ((PIPESTATUS[0] == 0)) || rc=1
  done
  return "$rc"
}

# ---- check ----------------------------------------------------------------------------------
# The users' check front (bench/run.sh <kernel> check 1) at CHECK_RANKS ranks (default "2 4"),
# however many GPUs there are: with fewer GPUs than ranks the ranks share them (the references
# then need no NCCL). Needs the python step's package for the fused kernels.
step_check() {
  local rc=0 ranks kernel
  for ranks in ${CHECK_RANKS:-2 4}; do
    for kernel in ${CHECK_KERNELS:-collectives ag_gemm gemm_rs gemm_ar}; do
      echo "=== $kernel check, $ranks ranks"
      MKERNEL_RANKS="$ranks" BUILD_DIR="$BUILD" limited 300 bash "$REPO/bench/run.sh" "$kernel" \
        check 1 2>&1 | tee -a "$OUT/check.log"
      ((PIPESTATUS[0] == 0)) || rc=1
    done
  done
  return "$rc"
}

# ---- nodes ----------------------------------------------------------------------------------
# Issue 8 across virtual nodes on this host, through the users' front: every fused kernel's check
# on NODES_COUNT (2) virtual nodes of the GPUs here (bench/run.sh with MKERNEL_VIRTUAL_NODES=1,
# socket transport over loopback; needs the python step's package). A kernel that does not run
# across nodes yet says so and counts as failed. NODES_KERNELS: which (ag_gemm gemm_rs gemm_ar).
step_nodes() {
  local rc=0 kernel
  for kernel in ${NODES_KERNELS:-ag_gemm gemm_rs gemm_ar}; do
    echo "=== $kernel check across ${NODES_COUNT:-2} virtual nodes"
    MKERNEL_VIRTUAL_NODES=1 limited 300 bash "$REPO/bench/run.sh" "$kernel" check \
      "${NODES_COUNT:-2}" 2>&1 | tee -a "$OUT/nodes.log"
    ((PIPESTATUS[0] == 0)) || rc=1
  done
  return "$rc"
}

step_bench() {
  local marker rc=0 kernel
  compgen -G "$BUILD/bench/bench_*" >/dev/null || { log "no benchmarks in $BUILD"; return "$SKIP"; }
  marker="$(mktemp)"
  # The front users run, once per kernel family; each writes bench/results/<kernel>-*.json.
  for kernel in ${BENCH_KERNELS:-all transport}; do
    BUILD_DIR="$BUILD" bash "$REPO/bench/run.sh" "$kernel" bench 1 2>&1 | tee -a "$OUT/bench.log"
    ((PIPESTATUS[0] == 0)) || rc=1
  done
  if [[ -d "$REPO/bench/results" ]]; then
    find "$REPO/bench/results" -maxdepth 1 -name '*.json' -newer "$marker" -exec cp -t "$OUT" {} +
  fi
  rm -f "$marker"
  log "JSON files: $(find "$OUT" -maxdepth 1 -name '*.json' | wc -l)"
  return "$rc"
}

# At most 8 files come back from $OUT: pack the JSON files when there are more.
fit_out() {
  local n
  n="$(find "$OUT" -type f | wc -l)"
  ((n > 8)) || return 0
  (cd "$OUT" &&
    find . -maxdepth 1 -name '*.json' -printf '%P\n' | tar -czf bench-json.tar.gz -T - &&
    find . -maxdepth 1 -name '*.json' -delete)
  log "packed the JSON files of $OUT into bench-json.tar.gz ($n files were there)"
}

# ---- candidates -----------------------------------------------------------------------------
# The GEMM plan's candidates (issue 28; docs/design/gemm_decode.md): bench_gemm --candidates at
# CANDIDATE_SHAPES (default: the sweep's 84 shapes up to M 2048, those of
# bench/data/gemm_candidates-h200.csv), B [N, K], cuBLAS in the same run; the log and the CSV
# scripts/fit_gemm_plan.py reads go to $OUT (gemm_candidates-<gpu>.csv: copy it over
# bench/data's to refit).
step_candidates() {
  local shapes="${CANDIDATE_SHAPES:-}" gpu m nk rc=0
  [[ -x "$BUILD/bench/bench_gemm" ]] || { log "no $BUILD/bench/bench_gemm"; return 1; }
  if [[ -z "$shapes" ]]; then
    for nk in 8192x8192 14336x4096 4096x14336 7168x2048 2048x7168 28672x8192; do
      for m in 1 8 32 64 128 192 256 384 512 640 768 1024 1536 2048; do shapes+="${shapes:+,}${m}x$nk"; done
    done
  fi
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 |
        awk '{for (i = 1; i <= NF; i++) if ($i ~ /[0-9]/) { print tolower($i); exit }}')
  limited "${CANDIDATE_TIMEOUT:-300}" "$BUILD/bench/bench_gemm" --candidates --layouts nk \
    --shapes "$shapes" >"$OUT/candidates.log" 2>&1 || rc=1
  tail -n 2 "$OUT/candidates.log"
  python3 "$REPO/scripts/candidates_csv.py" "$OUT/candidates.log" \
    --commit "${MKERNEL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
    >"$OUT/gemm_candidates-${gpu:-unknown}.csv" || rc=1
  return "$rc"
}

# ---- profile: Nsight Compute on the kernels of one command ----------------------------------
# PROFILE_CMD (a command line, run from the checkout, e.g. "build/bench/bench_ring_attention
# --ranks 2 --iters 2" or "python3 bench/bench_moe_layer.py --mode check --quick"),
# PROFILE_KERNELS (an ncu kernel-name regex: "regex:GroupedSwiglu|GroupedGemm"), PROFILE_COUNT
# (launches of them to profile, 4): ncu's speed-of-light, memory, scheduler and warp-state
# sections of each into $OUT/profile.txt - where a kernel's time goes, without guessing.
step_profile() {
  local ncu
  ncu="$(command -v ncu || ls "$CUDA_HOME"/bin/ncu "$CUDA_HOME"/nsight-compute*/ncu 2>/dev/null |
    head -n 1)"
  [[ -n "$ncu" && -x "$ncu" ]] || { log "no ncu (Nsight Compute) here"; return "$SKIP"; }
  [[ -n "${PROFILE_CMD:-}" ]] || { log "PROFILE_CMD is not set"; return 1; }
  local cmd what
  read -r -a cmd <<<"$PROFILE_CMD"
  what=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats
    --section WarpStateStats --section LaunchStats --section Occupancy
    --section ComputeWorkloadAnalysis)
  # PROFILE_METRICS (ncu metric names, comma-separated) instead of the sections, e.g.
  # dram__bytes_read.sum,lts__t_sector_hit_rate.pct: how often tiles share their operands.
  [[ -n "${PROFILE_METRICS:-}" ]] && what=(--metrics "$PROFILE_METRICS")
  # --clock-control none: the kernels at the clocks they run at in the benchmarks. ncu's default
  # locks the SMs at base clock (1.33 GHz on these cards), which moves the balance between the
  # tensor pipe and memory that a profile is taken to show (attention.md's stall samples were).
  limited "${PROFILE_TIMEOUT:-400}" "$ncu" --target-processes all --clock-control none \
    --kernel-name "${PROFILE_KERNELS:-regex:.}" --launch-count "${PROFILE_COUNT:-4}" \
    "${what[@]}" "${cmd[@]}" >"$OUT/profile.txt" 2>&1
  local rc=$?
  tail -n 40 "$OUT/profile.txt"
  return "$rc"
}

# ---- main -----------------------------------------------------------------------------------
steps=("$@")
((${#steps[@]})) || steps=(all)
plan=()
for s in "${steps[@]}"; do
  case "$s" in
    all) plan+=(build test sanitize python bench) ;;
    build | test | sanitize | python | bench | candidates | check | compare | trace | ab | nodes | host | profile | bisect) plan+=("$s") ;;
    *) echo "usage: bash scripts/device_run.sh [build|test|sanitize|python|bench|candidates|check|compare|trace|ab|nodes|host|profile|bisect|all]..." >&2; exit 2 ;;
  esac
done

# PATCHES: a comma-separated list of patches (git apply) to run with - queued experiments whose
# tests and numbers come first (docs/design/*.patch); the word `queue` in it stands for the whole
# queue in order (docs/design/QUEUE). This copy of the checkout keeps them.
if [[ ",${PATCHES:-}," == *",queue,"* ]]; then
  PATCHES=$(printf '%s' "$PATCHES" | sed "s#\(^\|,\)queue\(,\|$\)#\1$(bash scripts/queue_patches.sh)\2#")
fi
if [[ -n "${PATCHES:-}" ]]; then
  IFS=, read -r -a patch_list <<<"$PATCHES"
  for p in "${patch_list[@]}"; do
    p="${p//[[:space:]]/}"
    [[ -z "$p" ]] && continue
    if git apply -R --check "$p" 2>/dev/null; then  # (a warm machine's copy may have it)
      log "already applied: $p"
      continue
    fi
    # Files an earlier call's copy of this patch created, left behind on a warm machine (the
    # tracked files come back as they are here; a file the patch adds may not go).
    git apply --check "$p" 2>/dev/null ||
      git apply --summary "$p" | awk '$1 == "create" {print $NF}' | xargs -r rm -f --
    git apply "$p" || { echo "device_run: $p does not apply" >&2; exit 2; }
    log "applied $p"
  done
  # Results files name the patches beside the commit.
  MKERNEL_COMMIT="${MKERNEL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  export MKERNEL_COMMIT="$MKERNEL_COMMIT+${PATCHES//[[:space:]]/}"
fi
# A build of other patches (or none) is rebuilt whole: the sources here may be older than the
# objects that the patched sources made.
patch_stamp="$BUILD/.device_run_patches" patches_now="${PATCHES:-}"
patches_now="${patches_now//[[:space:]]/}"
if [[ -d "$BUILD" && "$(cat "$patch_stamp" 2>/dev/null)" != "$patches_now" ]]; then
  log "the build in $BUILD had other patches ('$(cat "$patch_stamp" 2>/dev/null)'): touching the sources"
  find src include tests bench python -type f -print0 | xargs -0 -r touch
fi
mkdir -p "$BUILD" && printf '%s' "$patches_now" >"$patch_stamp"

log "steps: ${plan[*]}; OUT=$OUT; $(nproc) cores; nvcc $(nvcc --version 2>/dev/null |
  sed -n 's/.*release \([0-9.]*\).*/\1/p'); $(cmake --version 2>/dev/null | head -n 1)"

summary=()
any_failed=0
for s in "${plan[@]}"; do
  log "==== $s ===="
  start=$SECONDS
  case "$s" in
    build) step_build 2>&1 | tee -a "$OUT/build.log" ;;
    test) step_test ;;
    sanitize) step_sanitize ;;
    python) step_python ;;
    bench) step_bench ;;
    candidates) step_candidates ;;
    check) step_check ;;
    compare) step_compare ;;
    trace) step_trace ;;
    ab) step_ab ;;
    nodes) step_nodes ;;
    host) step_host ;;
    profile) step_profile ;;
    bisect) step_bisect ;;
  esac
  rc=$?
  case "$rc" in
    0) verdict=PASS ;;
    "$SKIP") verdict=SKIP ;;
    *) verdict="FAIL (rc $rc)"; any_failed=1 ;;
  esac
  line="== $s: $verdict ($((SECONDS - start)) s)"
  echo "$line"
  summary+=("$line")
done
fit_out

echo
log "summary"
printf '%s\n' "${summary[@]}"
exit "$any_failed"
