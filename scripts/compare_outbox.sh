#!/usr/bin/env bash
# gemm_rs and gemm_ar with and without the outbox (src/fused/partials.cuh), same shapes, one run
# each, on the 2-GPU host (after `pip install --target /tmp/site .`):
#   PYTHONPATH=/tmp/site bash scripts/compare_outbox.sh [shapes] [out_dir]
# MKERNEL_OUTBOX=0 makes the epilogue send the partials itself (the design before the outbox).
export NCCL_NVLS_ENABLE=0 NCCL_NVLS_DISABLE=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
shapes="${1:-4096x4096x4096,8192x8192x8192,16384x8192x8192,8192x2048x8192}"
out="${2:-/tmp}"
for kernel in gemm_rs gemm_ar; do
  for outbox in 1 0; do
    echo "=== $kernel MKERNEL_OUTBOX=$outbox"
    MKERNEL_OUTBOX=$outbox timeout 120 python3 -m torch.distributed.run --standalone \
      --nproc-per-node 2 bench/bench_fused.py --kernel "$kernel" --shapes "$shapes" --rounds 3 \
      --json "$out/$kernel-outbox$outbox.json" 2>&1 | grep -E "^[0-9]+x|^shape|rror"
  done
done
