#!/usr/bin/env python3
"""Performance model of the GEMM-family kernels on 2 nodes x 8 H200, 400 Gb/s NIC per GPU.

Prints the tables of docs/MULTINODE_MODEL.md. Every input is a named constant below; change one
and re-run (python3 docs/perf_model.py). No dependencies.
"""

W = 16                 # ranks: 2 nodes x 8 GPUs
LOCAL = 8              # GPUs per node
F = 790e12             # bf16 FLOP/s, cuBLAS on random data (measured 759-803 on our H200)
B_NVL = 360e9          # NVLink bytes/s one way per GPU for all-to-all-like traffic through
                       # NVSwitch (pairwise peer copy measured 395 GB/s on our NV18 pair;
                       # NCCL 8-GPU all-gather busbw on H100/H200 HGX is ~350-370 GB/s)
B_NIC = 0.9 * 50e9     # 400 Gb/s per GPU at 90% efficiency, one way
LAT_NIC = 10e-6        # per pipeline fill across the network (proxy + RDMA write + flag)
E = 2                  # bytes per bf16 element
E_BUILT = 4            # bytes per element of the partials and node sums that gemm_rs / gemm_ar
                       # send across nodes as built (fp32; bf16 would halve them)


def ms(seconds):
    return seconds * 1e3


def ag_gemm(m, n_local, k):
    """Rank r holds A_r [M/W, K]; C [M, N_local] = gather(A) @ B_r [K, N_local].
    Hierarchical, rail-aligned: each GPU receives its rail peer's shard over its NIC (1 shard),
    and the 14 other shards over NVLink (7 local + 7 that arrived at local peers' NICs)."""
    shard = m // W * k * E
    t_gemm = 2 * m * n_local * k / F
    t_nic = shard / B_NIC + LAT_NIC
    t_nvl = (W - 2) * shard / B_NVL
    return t_gemm, max(t_nic, t_nvl), t_nic, t_nvl


def gemm_rs(m, n, k_local, e=E):
    """Rank r: partial C [M, N] = A_r [M, K/W] @ B_r; keeps M/W rows of the sum.
    Hierarchical: reduce-scatter inside the node over NVLink (7/8 of the partial leaves each
    GPU), then each GPU sends the node's partial of its rail peer's rows over its NIC. e: bytes
    per element of what travels."""
    part = m * n * e
    t_gemm = 2 * m * n * k_local / F
    t_nvl = (LOCAL - 1) / LOCAL * part / B_NVL
    t_nic = part / W / B_NIC + LAT_NIC
    return t_gemm, max(t_nic, t_nvl), t_nic, t_nvl


def gemm_ar(m, n, k_local, e=E):
    """GEMM + all-reduce = the reduce-scatter above (e bytes per element), then the same traffic
    back with the bf16 result (all-gather)."""
    t_gemm, _, nic_rs, nvl_rs = gemm_rs(m, n, k_local, e)
    _, _, nic_ag, nvl_ag = gemm_rs(m, n, k_local, E)
    t_nic, t_nvl = nic_rs + nic_ag, nvl_rs + nvl_ag
    return t_gemm, max(t_nic, t_nvl), t_nic, t_nvl


def table(title, rows, published):
    """rows: ((M, N, K), the model with bf16 traffic, the model with the bytes as built)."""
    print(f"\n### {title}\n")
    print("| M | N | K | GEMM ms | NVLink ms | NIC ms | sequential ms | ideal ms | best speedup |"
          " ideal as built ms | published (original) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (m, n, k), (t_gemm, t_comm, t_nic, t_nvl), built in rows:
        seq = t_gemm + t_comm
        ideal = max(t_gemm, t_comm)
        print(f"| {m} | {n} | {k} | {ms(t_gemm):.3f} | {ms(t_nvl):.3f} | {ms(t_nic):.3f} |"
              f" {ms(seq):.3f} | {ms(ideal):.3f} | {seq / ideal:.2f}x |"
              f" {ms(max(built[0], built[1])):.3f} | {published(m)} |")


def main():
    sizes = [2048, 4096, 8192, 16384, 32768]
    table("AllGather + GEMM (M = K, N = M / 16 per rank)",
          [((m, m // 16, m), ag_gemm(m, m // 16, m), ag_gemm(m, m // 16, m)) for m in sizes],
          lambda m: "1.16-1.41x over NCCL + matmul")
    table("GEMM + ReduceScatter (K per rank = M / 16, N = M)",
          [((m, m, m // 16), gemm_rs(m, m, m // 16), gemm_rs(m, m, m // 16, E_BUILT))
           for m in sizes],
          lambda m: "slower than NCCL + matmul" if m <= 8192 else "up to ~1.2x")
    table("GEMM + AllReduce (K per rank = M / 16, N = M)",
          [((m, m, m // 16), gemm_ar(m, m, m // 16), gemm_ar(m, m, m // 16, E_BUILT))
           for m in sizes],
          lambda m: "0.83x" if m == 2048 else "1.3-1.53x")


if __name__ == "__main__":
    main()
