#!/usr/bin/env bash
# gemm_rs and gemm_ar next to their other configurations, in the same run (interleaved rounds),
# on the 2-GPU host (after `pip install --target /tmp/site .`):
#   PYTHONPATH=/tmp/site bash scripts/compare_configs.sh [shapes] [out_dir]
# bench_fused.py --sweep times, next to the default: the other tile widths and, with two ranks,
# bf16 partials and tma_sends=False (the threads' stores instead of the SM's copy engine).
# The default's results go to <out_dir>/<kernel>.json. COMPARE_KERNELS (default "gemm_rs gemm_ar")
# may add ag_gemm, whose --sweep times piece sizes and pushing CTAs.
export NCCL_NVLS_ENABLE=0 NCCL_NVLS_DISABLE=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
shapes="${1:-4096x4096x4096,8192x8192x8192,16384x8192x8192,8192x2048x8192}"
out="${2:-/tmp}"
for kernel in ${COMPARE_KERNELS:-gemm_rs gemm_ar}; do
  echo "=== $kernel"
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    bench/bench_fused.py --kernel "$kernel" --shapes "$shapes" --rounds 3 --sweep \
    --json "$out/$kernel.json" 2>&1 | grep -E "^[0-9]+x|^shape|sweep|rror"
done
