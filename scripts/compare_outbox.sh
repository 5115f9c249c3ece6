#!/usr/bin/env bash
# gemm_rs and gemm_ar three ways, same shapes, on the 2-GPU host (after
# `pip install --target /tmp/site .`):
#   PYTHONPATH=/tmp/site bash scripts/compare_outbox.sh [shapes] [out_dir]
#   default           outbox (src/fused/partials.cuh) + interleaved order (reduce_order.h)
#   interleave0       outbox, all peers' tiles first (MKERNEL_INTERLEAVE=0)
#   outbox0           the epilogue sends the partials itself (MKERNEL_OUTBOX=0; no interleaving)
export NCCL_NVLS_ENABLE=0 NCCL_NVLS_DISABLE=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
shapes="${1:-4096x4096x4096,8192x8192x8192,16384x8192x8192,8192x2048x8192}"
out="${2:-/tmp}"
for kernel in gemm_rs gemm_ar; do
  for variant in default interleave0 outbox0; do
    echo "=== $kernel $variant"
    env MKERNEL_OUTBOX=$([[ $variant == outbox0 ]] && echo 0 || echo 1) \
      MKERNEL_INTERLEAVE=$([[ $variant == interleave0 ]] && echo 0 || echo 1) \
      timeout 120 python3 -m torch.distributed.run --standalone \
      --nproc-per-node 2 bench/bench_fused.py --kernel "$kernel" --shapes "$shapes" --rounds 3 \
      --json "$out/$kernel-$variant.json" 2>&1 | grep -E "^[0-9]+x|^shape|rror"
  done
done
