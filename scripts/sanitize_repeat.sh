#!/usr/bin/env bash
# On the GPU machine: the sanitized tests, each tool several times, for the hangs that come one run
# in a few (docs/design/moe.md, "The two-rank hang under compute-sanitizer"). A run still going
# after HANG_S seconds is taken for hung: before it is killed, its host threads' stacks are
# written down (gdb when the machine has it, else each thread's kernel wait channel and state
# from /proc), so that the log says where each rank's thread waits.
#
#   bash scripts/sanitize_repeat.sh TESTS_BINARY FILTER [RUNS] [TOOLS]
#   e.g. MKERNEL_TIMEOUT_S=8 bash scripts/sanitize_repeat.sh prebuilt-v2/mkernel_gpu_tests \
#          'SanitizeGemmAr*:SanitizeGemmRs*' 4 "racecheck memcheck"
#
# RUNS: 3; TOOLS: "racecheck memcheck synccheck"; HANG_S (40): the seconds after which a run is
# hung. One line a run ("<tool> #<i>: PASS | FAIL (rc) | HUNG") on stdout; each run's output in
# $OUT/sanitize-<tool>-<i>.log, the hung runs' stacks appended to it, with the GPU's utilisation
# (busy: a kernel that never ends; idle: the host threads wait on each other or in the tool).
# The in-process ranks' meetings outside a time-limited step (the tests' barriers) give up
# after MKERNEL_BOOTSTRAP_TIMEOUT_S, 20 s here unless set. Exits 1 if any run failed or hung.
set -uo pipefail
tests="${1:?usage: sanitize_repeat.sh TESTS_BINARY FILTER [RUNS] [TOOLS]}"
filter="${2:?usage: sanitize_repeat.sh TESTS_BINARY FILTER [RUNS] [TOOLS]}"
runs="${3:-3}"
tools="${4:-racecheck memcheck synccheck}"
hang_s="${HANG_S:-40}"
OUT="${OUT:-$PWD/out}"
export MKERNEL_BOOTSTRAP_TIMEOUT_S="${MKERNEL_BOOTSTRAP_TIMEOUT_S:-20}"
mkdir -p "$OUT"
sanitizer="$(command -v compute-sanitizer ||
  ls "${CUDA_HOME:-/usr/local/cuda}"/compute-sanitizer/compute-sanitizer 2>/dev/null)" ||
  { echo "sanitize_repeat: no compute-sanitizer" >&2; exit 1; }

# Process $1 and every process below it (the sanitizer starts the tests two levels down).
descendants() {
  local child
  echo "$1"
  for child in $(pgrep -P "$1"); do descendants "$child"; done
}

# The host threads of process $1 and its descendants: gdb's backtraces, or /proc's wait channels.
stacks() {
  local pid
  for pid in $(descendants "$1"); do
    echo "---- process $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-200)"
    if command -v gdb >/dev/null; then
      timeout 60 gdb -p "$pid" -batch -ex 'thread apply all bt 25' 2>&1 |
        grep -E '^(Thread|#)' | cut -c1-240
    else
      local task
      for task in /proc/"$pid"/task/*; do
        echo "thread ${task##*/} $(cat "$task/comm" 2>/dev/null):" \
          "state $(awk '{print $3}' "$task/stat" 2>/dev/null)," \
          "waits in $(cat "$task/wchan" 2>/dev/null)"
      done
    fi
  done
}

failed=0
for tool in $tools; do
  for ((i = 1; i <= runs; ++i)); do
    log="$OUT/sanitize-$tool-$i.log"
    : >"$log"  # (appended to by both the run and the stacks below)
    "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 100 "$tests" \
      --gtest_filter="$filter" >>"$log" 2>&1 &
    pid=$!
    start=$SECONDS
    while kill -0 "$pid" 2>/dev/null && ((SECONDS - start < hang_s)); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
      {
        echo "==== sanitize_repeat: still running after $hang_s s; the GPU:"
        nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>&1
        echo "==== host stacks:"
        stacks "$pid"
      } >>"$log"
      # Every process of the run: the tests run two levels below the sanitizer, and one left
      # running would hold the GPU under the next runs.
      kill -KILL $(descendants "$pid") 2>/dev/null
      wait "$pid" 2>/dev/null
      echo "$tool #$i: HUNG (last test: $(grep -E '^\[ RUN' "$log" | tail -1 | cut -c14-))"
      failed=1
      continue
    fi
    wait "$pid"
    rc=$?
    if ((rc == 0)); then
      echo "$tool #$i: PASS ($((SECONDS - start)) s)"
    else
      echo "$tool #$i: FAIL (rc $rc, $((SECONDS - start)) s)"
      failed=1
    fi
  done
done
exit "$failed"
