#!/usr/bin/env bash
# The benchmark front, as in the original mKernel:
#
#   bash bench/run.sh <kernel|all> <check|bench> <num_nodes> [sizes]
#
# kernel: all, collectives, all_gather, reduce_scatter, all_reduce, gemm, grouped_gemm (against
#         torch._grouped_mm on MoE expert shapes, both layouts), moe_dispatch_gemm (one GPU:
#         the fused launch, moe_dispatch / moe_combine and dispatch-then-grouped-GEMM against
#         torch._grouped_mm on the issue's MoE shapes), moe_layer (one GPU: the whole layer against
#         the plain PyTorch layer on torch._grouped_mm) - both then, when bench_moe_ranks is
#         built, two ranks as threads sharing the GPU against world 1 on the same work (and
#         moe_dispatch_gemm against torch._grouped_mm's time on those rows from the first part) -
#         bench mode writes bench/results/<kernel>-<gpu>-w2-one-gpu.json), attention (one GPU: against torch SDPA's
#         best backend), ring_attention (one GPU: ranks as threads, against the engine on the
#         same work and SMs), ag_gemm, gemm_rs, gemm_ar. On a machine with several GPUs, or
#         across nodes, moe_dispatch_gemm, moe_layer and ring_attention run one rank per GPU
#         against their NCCL baselines instead (bench/bench_dist.py: NCCL dispatch then
#         torch._grouped_mm, the whole layer the NCCL way, NCCL all-gather of K and V then SDPA;
#         results ...-w<world>.json; sizes: MODEL:TOKENS,... or B:H:H_kv:S_local:D:causal,...),
#         transport (the socket proxy path over loopback; no GPU needed), p2p (NVLink push /
#         red.add / pull rate per CTA between GPU 0 and 1: what the fused kernels are sized by).
#         Other fused kernels join as they land. all = collectives, gemm and every fused kernel.
# check = correctness on the GPUs present; bench = timings against the baselines (NCCL, cuBLAS,
#         NCCL-then-cuBLAS, PyTorch async-TP), written to bench/results/<kernel>-<gpu>-w<world>.json
#         (../shared/BENCH_SCHEMA.md). sizes: collectives: MiB per rank, comma-separated (bench:
#         8,64,512); gemm and fused kernels: MxNxK,... (default: the issue's shape list).
# The fused kernels run through PyTorch (torchrun + the mkernel package: `pip install .` first).
# One rank per GPU of this machine (MKERNEL_RANKS overrides; ranks may share GPUs in check mode,
# whose references then need no NCCL; on a machine with one GPU check mode runs two ranks on it).
# Environment: BUILD_DIR (build), MKERNEL_NCCL_LIB (NCCL to compare with; default: PyTorch's).
# num_nodes > 1 (the fused GEMMs, MoE and ring attention; results ...-w<world>-n<nodes>.json), as
# in the original: this machine is node 0 and starts torchrun on node i >= 1 over ssh. NODE0_IP (the address the others
# reach this machine at), NODE1_IP, ... (one per node), NODE<i>_SSH (ssh target of node i;
# default NODE<i>_IP), MKERNEL_REMOTE_DIR (this checkout's path there; default the same path),
# GPUS_PER_NODE (default: this machine's), MASTER_PORT (29500). MKERNEL_* and NCCL_* variables
# go along. MKERNEL_VIRTUAL_NODES=1: every node on this machine instead (MKERNEL_GPUS_PER_NODE =
# ranks / num_nodes, inter-node traffic through the socket transport over loopback).
# MKERNEL_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 NCCL_NVLS_DISABLE=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

usage() { sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
kernel="$1" mode="$2" nodes="$3" sizes="${4:-}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build="${BUILD_DIR:-build}"

case "$kernel" in
  all | collectives | all_gather | reduce_scatter | all_reduce | gemm | grouped_gemm | moe_dispatch_gemm | moe_layer | attention | ring_attention | ag_gemm | gemm_rs | gemm_ar) ;;
  transport)
    # The inter-node proxy path over loopback (host only, no GPU): latency and bandwidth.
    [[ -x "${BUILD_DIR:-build}/bench/bench_transport" ]] || { echo "bench/run.sh: run 'make' first" >&2; exit 2; }
    exec "${BUILD_DIR:-build}/bench/bench_transport" ;;
  p2p)
    [[ -x "${BUILD_DIR:-build}/bench/bench_p2p" ]] || { echo "bench/run.sh: run 'make' first" >&2; exit 2; }
    exec "${BUILD_DIR:-build}/bench/bench_p2p" ;;
  *) echo "bench/run.sh: unknown kernel '$kernel'" >&2; usage ;;
esac
[[ "$mode" == check || "$mode" == bench ]] || usage
[[ "$nodes" =~ ^[1-9][0-9]*$ ]] || { echo "bench/run.sh: num_nodes '$nodes' is not a positive number" >&2; exit 2; }
dry_run="${MKERNEL_DRY_RUN:-0}"
# Runs "$@", or prints it (MKERNEL_DRY_RUN=1).
run() {
  if [[ "$dry_run" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}
# The GPU's short name in the results files' names: the first word of its name with a digit in
# it, lower case ("NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200). A dry run names the
# GPU it pretends to have, an H200.
gpu_name() {
  local name=""
  [[ "$dry_run" == 1 ]] ||
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 |
           awk '{for (i = 1; i <= NF; i++) if ($i ~ /[0-9]/) { print tolower($i); exit }}')
  echo "${name:-h200}"
}
# Before a torchrun of the Python benchmarks: the package importable (or exit 2); $gpu, the GPU's
# short name for the results files; MKERNEL_COMMIT, the commit they record.
torchrun_setup() {
  python3 -c 'import mkernel' 2>/dev/null || [[ "$dry_run" == 1 ]] || {
    echo "bench/run.sh: the mkernel Python package is not importable: run 'pip install .' first" >&2
    exit 2
  }
  gpu=$(gpu_name)
  export MKERNEL_COMMIT="${MKERNEL_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
}

# The expert- and sequence-parallel kernels: across GPUs bench/bench_dist.py (one rank per GPU,
# NCCL baselines); on one GPU (or MKERNEL_RANKS=1) their one-GPU benchmarks (world 1, and ranks
# sharing the GPU).
dist_kernel=0
case "$kernel" in moe_dispatch_gemm | moe_layer | ring_attention) dist_kernel=1 ;; esac
[[ "${MKERNEL_RANKS:-1}" =~ ^[1-9][0-9]*$ ]] ||
  { echo "bench/run.sh: MKERNEL_RANKS '${MKERNEL_RANKS}' is not a positive number" >&2; exit 2; }
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ "$dry_run" == 1 ]] && ((nodes > 1 || dist_kernel)); then
  gpus="${GPUS_PER_NODE:-2}"  # what a dry run pretends this machine has, whatever it has
fi

if [[ "$nodes" -gt 1 ]]; then
  case "$kernel" in
    ag_gemm | gemm_rs | gemm_ar | moe_dispatch_gemm | moe_layer | ring_attention) ;;
    all)
      status=0
      for k in ag_gemm gemm_rs gemm_ar; do
        bash "$PWD/bench/run.sh" "$k" "$mode" "$nodes" "$sizes" || { rc=$?; [[ $status -ne 0 ]] || status=$rc; }
      done
      # (sizes are the GEMMs'; these take their own points, and one GPU a rank)
      if [[ "${MKERNEL_VIRTUAL_NODES:-0}" == 1 ]] && ((${MKERNEL_RANKS:-$gpus} > gpus)); then
        echo "bench/run.sh: moe_dispatch_gemm, moe_layer, ring_attention skipped: one GPU a" \
             "rank (${MKERNEL_RANKS} ranks on $gpus GPUs)" >&2
      else
        for k in moe_dispatch_gemm moe_layer ring_attention; do
          bash "$PWD/bench/run.sh" "$k" "$mode" "$nodes" || { rc=$?; [[ $status -ne 0 ]] || status=$rc; }
        done
      fi
      exit "$status" ;;
    *) echo "bench/run.sh: $kernel runs on one node only; across nodes: ag_gemm, gemm_rs, gemm_ar," \
            "moe_dispatch_gemm, moe_layer, ring_attention, all" >&2
       exit 2 ;;
  esac
  if [[ "$gpus" -eq 0 ]]; then
    echo "bench/run.sh: no NVIDIA GPU found on this machine; nothing was checked." >&2
    exit 3
  fi
  torchrun_setup
  if [[ "${MKERNEL_VIRTUAL_NODES:-0}" == 1 ]]; then
    ranks="${MKERNEL_RANKS:-$gpus}"
    if ((ranks % nodes != 0)); then
      echo "bench/run.sh: $ranks ranks do not split into $nodes virtual nodes (MKERNEL_RANKS)" >&2
      exit 2
    fi
    per_node=$((ranks / nodes))
  else
    per_node="${GPUS_PER_NODE:-$gpus}"
    ranks=$((per_node * nodes))
  fi
  fused_args=(--kernel "$kernel" --mode "$mode")
  script=bench/bench_fused.py
  ((dist_kernel)) && script=bench/bench_dist.py
  if [[ -n "$sizes" ]]; then
    if ((dist_kernel)); then fused_args+=(--points "$sizes"); else fused_args+=(--shapes "$sizes"); fi
  fi
  if [[ "$mode" == bench ]]; then
    mkdir -p bench/results
    fused_args+=(--json "bench/results/${kernel}-${gpu}-w${ranks}-n${nodes}.json")
  fi
  if [[ "${MKERNEL_VIRTUAL_NODES:-0}" == 1 ]]; then
    echo "bench/run.sh: $kernel $mode on $nodes virtual nodes of $per_node rank(s), this machine"
    run env MKERNEL_GPUS_PER_NODE="$per_node" python3 -m torch.distributed.run --standalone --nproc-per-node "$ranks" \
      "$script" "${fused_args[@]}"
    exit $?
  fi
  for ((i = 0; i < nodes; i++)); do
    var="NODE${i}_IP"
    [[ -n "${!var:-}" ]] || { echo "bench/run.sh: $nodes nodes asked but $var is not set (see the usage)" >&2; exit 2; }
  done
  port="${MASTER_PORT:-29500}"
  remote_dir="${MKERNEL_REMOTE_DIR:-$PWD}"
  # What each node's torchrun gets: rendezvous on node 0, this node's rank, the variables.
  torchrun_on() {
    printf 'python3 -m torch.distributed.run --nnodes %q --node-rank %q --nproc-per-node %q ' \
      "$nodes" "$1" "$per_node"
    printf -- '--master-addr %q --master-port %q %q' "$NODE0_IP" "$port" "$script"
    printf ' %q' "${fused_args[@]}"
  }
  forwarded=$(env | grep -E '^(MKERNEL|NCCL)_[A-Z0-9_]*=' | grep -v '^MKERNEL_DRY_RUN=' |
              while IFS= read -r kv; do printf '%q ' "$kv"; done)
  echo "bench/run.sh: $kernel $mode on $nodes nodes x $per_node rank(s) (node 0: this machine)"
  pids=()
  for ((i = 1; i < nodes; i++)); do
    ip_var="NODE${i}_IP" ssh_var="NODE${i}_SSH"
    target="${!ssh_var:-${!ip_var}}"
    remote="cd $(printf %q "$remote_dir") && env $forwarded$(torchrun_on "$i")"
    if [[ "$dry_run" == 1 ]]; then
      run ssh -o BatchMode=yes "$target" "$remote"
    else
      ssh -o BatchMode=yes "$target" "$remote" &
      pids+=($!)
    fi
  done
  status=0
  run bash -c "$(torchrun_on 0)" || status=$?
  for pid in "${pids[@]}"; do wait "$pid" || { rc=$?; [[ $status -ne 0 ]] || status=$rc; }; done
  exit "$status"
fi
if [[ "$gpus" -eq 0 ]]; then
  echo "bench/run.sh: no NVIDIA GPU found on this machine. mkernel's kernels need Hopper GPUs" \
       "(H100/H200); nothing was checked." >&2
  exit 3
fi
if ((dist_kernel && gpus >= 2 && ${MKERNEL_RANKS:-$gpus} >= 2)); then
  # One rank per GPU over NVLink, against the NCCL baselines (bench/bench_dist.py).
  ranks="${MKERNEL_RANKS:-$gpus}"
  if ((ranks > gpus)); then
    echo "bench/run.sh: $kernel: $ranks ranks on $gpus GPUs; across GPUs it runs one rank per GPU" >&2
    exit 2
  fi
  torchrun_setup
  dist_args=(--kernel "$kernel" --mode "$mode")
  [[ -z "$sizes" ]] || dist_args+=(--points "$sizes")
  if [[ "$mode" == bench ]]; then
    mkdir -p bench/results
    dist_args+=(--json "bench/results/${kernel}-${gpu}-w${ranks}.json")
  fi
  echo "bench/run.sh: $kernel $mode on $ranks GPUs, one rank each"
  run python3 -m torch.distributed.run --standalone --nproc-per-node "$ranks" bench/bench_dist.py \
    "${dist_args[@]}"
  exit $?
fi
if [[ "$kernel" == ring_attention ]]; then
  # One GPU: the ranks as threads sharing it (the SM-side cost of the ring; no NVLink).
  [[ -x "$build/bench/bench_ring_attention" ]] || { echo "bench/run.sh: run 'make' first" >&2; exit 2; }
  ring_args=(--ranks "${MKERNEL_RANKS:-2}")
  if [[ "$mode" == bench ]]; then
    gpu=$(gpu_name)
    mkdir -p bench/results
    ring_args+=(--json "bench/results/ring_attention-${gpu}-w1.json")
  fi
  export MKERNEL_COMMIT="${MKERNEL_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  run "$build/bench/bench_ring_attention" "${ring_args[@]}"
  exit $?
fi
ranks="${MKERNEL_RANKS:-$gpus}"
if [[ -z "${MKERNEL_RANKS:-}" && "$mode" == check && "$gpus" -eq 1 && "$kernel" != gemm &&
      "$kernel" != grouped_gemm && "$kernel" != moe_dispatch_gemm && "$kernel" != moe_layer &&
      "$kernel" != attention ]]; then
  # One GPU: the multi-rank kernels are still checked, with two ranks sharing it.
  ranks=2
  [[ "$kernel" == all ]] ||
    echo "bench/run.sh: one GPU here: $kernel check runs two ranks sharing it (MKERNEL_RANKS overrides)"
fi
if [[ "$mode" == bench && "$ranks" -gt "$gpus" && "$kernel" != all ]]; then
  echo "bench/run.sh: $ranks ranks on $gpus GPU(s): timings need one GPU per rank (check mode" \
       "runs with ranks sharing GPUs)" >&2
  exit 2
fi
if [[ "$kernel" == grouped_gemm || "$kernel" == moe_dispatch_gemm || "$kernel" == moe_layer ||
      "$kernel" == attention ]]; then  # Python + torch only
  [[ -z "$sizes" ]] || echo "bench/run.sh: $kernel runs its own sweep; sizes ignored" >&2
  if [[ "$kernel" != grouped_gemm && "$nodes" -ne 1 ]]; then
    echo "bench/run.sh: $kernel runs on one node only" >&2
    exit 2
  fi
  gpu=$(gpu_name)
  export MKERNEL_COMMIT="${MKERNEL_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  python3 -c 'import mkernel' 2>/dev/null || {
    echo "bench/run.sh: the mkernel Python package is not importable: run 'pip install .' first" >&2
    exit 2
  }
  script=bench/bench_grouped.py
  [[ "$kernel" == moe_dispatch_gemm ]] && script=bench/bench_moe.py
  [[ "$kernel" == moe_layer ]] && script=bench/bench_moe_layer.py
  [[ "$kernel" == attention ]] && script=bench/bench_attention.py
  one_gpu_args=(--mode "$mode")
  if [[ "$mode" == bench ]]; then
    mkdir -p bench/results
    one_gpu_args+=(--json "bench/results/${kernel}-${gpu}-w1.json")
  fi
  echo "bench/run.sh: $kernel $mode on 1 GPU"
  if [[ "$kernel" != moe_layer && "$kernel" != moe_dispatch_gemm ]]; then
    exec python3 "$script" "${one_gpu_args[@]}"
  fi
  status=0
  marker="$(mktemp)"  # (the w1 file's torch times count only if this run wrote them)
  python3 "$script" "${one_gpu_args[@]}" || status=$?
  ranks_bin="${BUILD_DIR:-build}/bench/bench_moe_ranks"
  if [[ -x "$ranks_bin" ]]; then  # two ranks sharing the GPU (threads): the SM-side cost
    ranks_args=(--op "$kernel" --ranks "${MKERNEL_RANKS:-2}")
    [[ "$mode" == bench ]] &&
      ranks_args+=(--json "bench/results/${kernel}-${gpu}-w${MKERNEL_RANKS:-2}-one-gpu.json")
    [[ "$mode" == check ]] && ranks_args+=(--iters 1)
    w1_json="bench/results/${kernel}-${gpu}-w1.json"
    if [[ "$kernel" == moe_dispatch_gemm && "$mode" == bench && "$w1_json" -nt "$marker" ]]; then
      # torch._grouped_mm's time on each world-1 point's rows, measured just above.
      torch_times=$(python3 -c 'import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print(",".join("%s:%d:%.6f" % (r["shape"]["model"], r["shape"]["tokens_per_rank"],
                               r["ms"]["gemm_alone"]) for r in rows))' "$w1_json") || torch_times=
      [[ -z "$torch_times" ]] || ranks_args+=(--torch "$torch_times")
    fi
    "$ranks_bin" "${ranks_args[@]}" || { rc=$?; [[ $status -ne 0 ]] || status=$rc; }
  else
    echo "bench/run.sh: $ranks_bin is not built ('make'): the ranks-sharing-a-GPU part skipped" >&2
  fi
  rm -f "$marker"
  exit "$status"
fi

# (gemm, below, is one GPU's bench_gemm alone; the rest launch ranks with mkrun.)
if [[ "$kernel" != gemm && ( ! -x "$build/bench/bench_collectives" || ! -x "$build/mkrun" ) ]]; then
  echo "bench/run.sh: $build/bench/bench_collectives is missing: run 'make' first" >&2
  exit 2
fi
if [[ -z "${MKERNEL_NCCL_LIB:-}" ]]; then
  # NCCL is only the baseline. Prefer the one PyTorch ships (what torch.distributed users run).
  dir=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
  [[ -n "$dir" && -f "$dir/lib/libnccl.so.2" ]] && export MKERNEL_NCCL_LIB="$dir/lib/libnccl.so.2"
fi

if [[ "$kernel" == all ]]; then
  # Every family in turn; the first failure is the exit status.
  status=0
  for k in collectives gemm grouped_gemm moe_dispatch_gemm moe_layer attention ring_attention ag_gemm gemm_rs gemm_ar; do
    bash "$PWD/bench/run.sh" "$k" "$mode" "$nodes" || { rc=$?; [[ $status -ne 0 ]] || status=$rc; }
  done
  exit "$status"
fi

gpu=$(gpu_name)
export MKERNEL_COMMIT="${MKERNEL_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"

if [[ "$kernel" == ag_gemm || "$kernel" == gemm_rs || "$kernel" == gemm_ar ]]; then
  python3 -c 'import mkernel' 2>/dev/null || {
    echo "bench/run.sh: the mkernel Python package is not importable: run 'pip install .' first" >&2
    exit 2
  }
  fused_args=(--kernel "$kernel" --mode "$mode")
  [[ -z "$sizes" ]] || fused_args+=(--shapes "$sizes")
  if [[ "$mode" == bench ]]; then
    mkdir -p bench/results
    fused_args+=(--json "bench/results/${kernel}-${gpu}-w${ranks}.json")
  fi
  echo "bench/run.sh: $kernel $mode on $ranks rank(s), $gpus GPU(s)"
  exec python3 -m torch.distributed.run --standalone --nproc-per-node "$ranks" \
    bench/bench_fused.py "${fused_args[@]}"
fi

if [[ "$kernel" == gemm ]]; then
  [[ -x "$build/bench/bench_gemm" ]] || { echo "bench/run.sh: run 'make' first" >&2; exit 2; }
  gemm_args=()
  [[ -z "$sizes" ]] || gemm_args+=(--shapes "$sizes")
  if [[ "$mode" == check ]]; then
    gemm_args+=(--check)
  else
    mkdir -p bench/results
    gemm_args+=(--json "bench/results/gemm-${gpu}-w1.json")
  fi
  echo "bench/run.sh: gemm $mode on 1 GPU"
  exec "$build/bench/bench_gemm" "${gemm_args[@]}"
fi

args=()
[[ "$kernel" == collectives ]] || args+=(--ops "$kernel")
if [[ "$mode" == check ]]; then
  args+=(--check --sizes-mib "${sizes:-1,8}")
else
  mkdir -p bench/results
  json="bench/results/collectives-${gpu}-w${ranks}.json"
  args+=(--json "$json" --sizes-mib "${sizes:-8,64,512}")
fi
echo "bench/run.sh: $kernel $mode on $ranks rank(s), $gpus GPU(s)"
"$build/mkrun" -n "$ranks" --timeout 900 -- "$build/bench/bench_collectives" "${args[@]}"
