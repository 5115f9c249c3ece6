#!/usr/bin/env bash
# Branch wip/gemm-rs-diagnose: where does gemm_rs lose its time? Times the fused op with one part
# switched off at a time (MKERNEL_RS_DEBUG bits, src/fused/gemm_rs.cuh; results are wrong with
# 1, 2 or 8 - the bench's "check" column says so) against the engine alone, on the GPU host:
#   export PYTHONPATH=/tmp/site (after pip install --target /tmp/site .); bash scripts/diagnose_gemm_rs.sh
export NCCL_NVLS_ENABLE=0 NCCL_NVLS_DISABLE=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
for bits in 0 1 2 4 8 15; do
  echo "=== MKERNEL_RS_DEBUG=$bits"
  MKERNEL_RS_DEBUG=$bits timeout 120 python3 -m torch.distributed.run --standalone \
    --nproc-per-node 2 bench/bench_fused.py --kernel gemm_rs \
    --shapes 8192x8192x8192,4096x4096x4096 --rounds 3 2>&1 | grep -E "^[0-9]+x"
done
