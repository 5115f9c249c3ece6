"""What a user would run instead of mkernel's expert- and sequence-parallel kernels across GPUs:
torch.distributed (NCCL) for the communication, torch for the compute. bench_dist.py times them;
tests/python/test_dist_baselines.py holds them to single-process references (on CPUs too, over
gloo: nothing here needs a GPU).

MoE (expert parallelism; rank r holds experts [r E_local, (r + 1) E_local)):
  nccl_dispatch   each token crosses once per destination rank that holds one of its experts,
                  with its routing row (token index, top-k experts, and the weights when the
                  combine needs them): the counts by one all_to_all_single, read on the host
                  (the split sizes: what torch users do), then the rows by one and the routing
                  (with the weights) by another
  expert_major    the received rows gathered by local expert (source rank, token, slot order:
                  mkernel's contract), their counts and offsets for torch._grouped_mm
  grouped_mm      torch._grouped_mm (a loop of matmuls on CPUs)
  moe_combine_seq each received token's rows summed over its slots here with their weights (fp32,
                  sent as bf16), sent back by all_to_all_single, summed at the source
Attention (sequence parallelism):
  gather_kv       K and V of every rank by all_gather_into_tensor, put in sequence order
                  (contiguous shares, or zigzag: rank r holds chunks r and 2w - 1 - r of 2w)
  sdpa_local      this rank's queries against every key by torch SDPA (GQA through enable_gqa;
                  non-causal: the backend asked for; zigzag causal: each of its two chunks as
                  torch's context parallelism does it - the keys before it unmasked, its own keys
                  with the causal mask, merged by their log-sum-exp - on the backend asked for)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def grouped_mm(rows, w_t, offs):
    """rows [R, K] @ w_t[g] [K, N] for each group's rows (offs: int32 cumulative ends)."""
    if rows.is_cuda:
        return torch._grouped_mm(rows, w_t, offs=offs)
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append((rows[start:end].float() @ w_t[g].float()).to(rows.dtype))
        start = end
    return torch.cat(out) if out else rows.new_empty(0, w_t.shape[-1])


class Dispatched:
    """nccl_dispatch's result on the receiving rank.

    recv [n, H]: the rows received, by source rank, then token; meta [n, 1 + k] int64: each row's
    token index at its source, then its top-k experts (global ids, -1 none); weights [n, k]
    float32 (when asked); src [n]: each row's source rank. send_tokens / send_splits /
    recv_splits: what the combine needs to send the rows back.
    """

    def __init__(self, recv, meta, weights, src, send_tokens, send_splits, recv_splits,
                 recv_pairs):
        self.recv, self.meta, self.weights, self.src = recv, meta, weights, src
        self.send_tokens, self.send_splits, self.recv_splits = (send_tokens, send_splits,
                                                                recv_splits)
        self.recv_pairs = recv_pairs  # (token, slot) pairs of the rows here bound for this rank


def nccl_dispatch(x, idx, num_experts, weights=None, group=None):
    world = dist.get_world_size(group)
    e_local = num_experts // world
    tokens, top_k = idx.shape
    dst = torch.where(idx >= 0, idx // e_local, torch.full_like(idx, world))
    to = torch.zeros(tokens, world + 1, dtype=torch.bool, device=x.device)
    to.scatter_(1, dst.long(), True)
    to = to[:, :world]
    # Each destination's tokens and (token, slot) pairs, exchanged together and read back at once:
    # the one host synchronisation the split sizes need (the pairs' count sizes the receiver's
    # expert-major index, so that nonzero does not read its size back a second time).
    slots = torch.zeros(world + 1, dtype=torch.int64, device=x.device)
    slots.scatter_add_(0, dst.long().flatten(), torch.ones(dst.numel(), dtype=torch.int64,
                                                           device=x.device))
    send_counts = torch.stack([to.sum(0), slots[:world]], 1).flatten()  # [rank][tokens, pairs]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    counts = torch.cat([send_counts, recv_counts]).tolist()
    send_splits, recv_splits = counts[0:2 * world:2], counts[2 * world::2]
    recv_pairs = sum(counts[2 * world + 1::2])
    # (rank, token), by rank then token
    pairs = torch.nonzero_static(to.t(), size=sum(send_splits))
    send_tokens = pairs[:, 1]
    n = sum(recv_splits)
    recv = x.new_empty(n, x.shape[1])
    dist.all_to_all_single(recv, x.index_select(0, send_tokens), recv_splits, send_splits,
                           group=group)
    # The routing in one int64 message a row: token, experts, and the weights' fp32 bits.
    parts = [send_tokens[:, None], idx.index_select(0, send_tokens).long()]
    if weights is not None:
        parts.append(weights.index_select(0, send_tokens).view(torch.int32).long())
    meta_out = torch.cat(parts, 1)
    meta_in = meta_out.new_empty(n, meta_out.shape[1])
    dist.all_to_all_single(meta_in, meta_out, recv_splits, send_splits, group=group)
    meta = meta_in[:, :1 + top_k]
    recv_w = None
    if weights is not None:
        recv_w = meta_in[:, 1 + top_k:].int().view(torch.float32)
    src = torch.repeat_interleave(torch.arange(world, device=x.device), recv_counts[0::2],
                                  output_size=n)
    return Dispatched(recv, meta, recv_w, src, send_tokens, send_splits, recv_splits, recv_pairs)


class ExpertMajor:
    """The received rows by local expert: row [R] (index into Dispatched.recv), slot [R], counts
    [E_local], offs (int32 ends, torch._grouped_mm's), who [R, 3] (source rank, token, slot)."""

    def __init__(self, row, slot, counts, offs, who):
        self.row, self.slot, self.counts, self.offs, self.who = row, slot, counts, offs, who


def expert_major(d: Dispatched, rank, e_local):
    experts = d.meta[:, 1:]
    first = rank * e_local
    mine = (experts >= first) & (experts < first + e_local)
    # by received row (source, token), then slot; the count known from the dispatch's
    pairs = torch.nonzero_static(mine, size=d.recv_pairs)
    row, slot = pairs[:, 0], pairs[:, 1]
    local = experts[row, slot] - first
    order = torch.sort(local, stable=True).indices
    row, slot, local = row[order], slot[order], local[order]
    counts = torch.zeros(e_local, dtype=torch.int64, device=d.recv.device)
    counts.scatter_add_(0, local, torch.ones_like(local))  # (bincount would read back its size)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    who = torch.stack([d.src[row], d.meta[row, 0], slot], 1)
    return ExpertMajor(row, slot, counts, offs, who)


def moe_combine_seq(y, d: Dispatched, em: ExpertMajor, tokens, group=None):
    """y [R, H] (em's rows) -> out [tokens, H] bf16 at the sources: per received token the
    weighted sum of its rows here (fp32, sent in bf16), back by all_to_all_single, summed."""
    part = torch.zeros(d.recv.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    part.index_add_(0, em.row, y.float() * d.weights[em.row, em.slot][:, None])
    back = y.new_empty(d.send_tokens.shape[0], y.shape[1])
    dist.all_to_all_single(back, part.to(y.dtype), d.send_splits, d.recv_splits, group=group)
    out = torch.zeros(tokens, y.shape[1], dtype=torch.float32, device=y.device)
    out.index_add_(0, d.send_tokens, back.float())
    return out.to(y.dtype)


def moe_gemm_seq(x, idx, w_t, num_experts, group=None):
    """NCCL dispatch, the rows expert-major, torch._grouped_mm: (y [R, N], ExpertMajor)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    d = nccl_dispatch(x, idx, num_experts, group=group)
    em = expert_major(d, rank, num_experts // world)
    return grouped_mm(d.recv.index_select(0, em.row), w_t, em.offs), em


def moe_layer_seq(x, idx, weights, w13_t, w2_t, num_experts, group=None):
    """The whole layer the NCCL way: dispatch, gate / up, SwiGLU, down, combine: out [T, H]."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    d = nccl_dispatch(x, idx, num_experts, weights=weights, group=group)
    em = expert_major(d, rank, num_experts // world)
    inter = w2_t.shape[1]
    gate_up = grouped_mm(d.recv.index_select(0, em.row), w13_t, em.offs)
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # (in bf16, as a torch layer does)
    y = grouped_mm(h, w2_t, em.offs)
    return moe_combine_seq(y, d, em, x.shape[0], group=group)


def sequence_order(parts, causal):
    """[world, B, S_local, ...] shares (rank order) -> [B, S, ...] in sequence order."""
    world = parts.shape[0]
    if not causal:
        return torch.cat(list(parts), dim=1)
    halves = [p.chunk(2, dim=1) for p in parts]
    chunks = [halves[c][0] if c < world else halves[2 * world - 1 - c][1]
              for c in range(2 * world)]
    return torch.cat(chunks, dim=1)


def gather_kv(k, v, causal, group=None):
    world = dist.get_world_size(group)
    out = []
    for t in (k, v):
        parts = t.new_empty(world * t.shape[0], *t.shape[1:])  # (gloo wants them along dim 0)
        dist.all_gather_into_tensor(parts, t.contiguous(), group=group)
        out.append(sequence_order(parts.view(world, *t.shape), causal))
    return out


def _attend_lse(q, k, v, causal, backend):
    """q [B, H, S, D] against k, v [B, H_kv, S_k, D] by one SDPA backend's own op, with each row's
    log-sum-exp: (out [B, H, S, D], lse [B, H, S] fp32, natural log). causal: top-left (S = S_k).
    backend: an SDPBackend (None: flash attention); on CPUs, torch's CPU flash attention."""
    from torch.nn.attention import SDPBackend
    aten = torch.ops.aten
    if not q.is_cuda:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
        return out, lse
    if backend in (None, SDPBackend.FLASH_ATTENTION):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    elif backend == SDPBackend.CUDNN_ATTENTION:
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)[:2]
    elif backend == SDPBackend.EFFICIENT_ATTENTION:  # (no GQA: K and V expanded, as SDPA does)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                causal)[:2]
    else:
        raise ValueError(f"_attend_lse: no log-sum-exp from backend {backend}")
    return out, lse[:, :, :q.shape[2]].reshape(out.shape[:3])  # (efficient pads S; cuDNN [.., 1])


def sdpa_local(q, k_full, v_full, causal, rank, world, backend=None):
    """This rank's queries (its share of the sequence) against every key: [B, S_local, H, D].
    backend: the SDPBackend to use (None: torch's choice; flash for causal). Causal (zigzag): each
    of its two chunks in two calls, what torch's context parallelism does - the keys before the
    chunk without a mask, the chunk's own keys with the causal (square) mask, both with their
    log-sum-exp - merged by it in fp32. (One call with the bottom-right causal bias takes
    flash attention only, about half as fast as cuDNN on Hopper.)"""
    gqa = q.shape[2] != k_full.shape[2]
    kt, vt = k_full.transpose(1, 2), v_full.transpose(1, 2)
    if not causal:
        def attend():
            return F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt,
                                                  enable_gqa=gqa).transpose(1, 2)
        if backend is None:
            return attend()
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(backend):
            return attend()
    half = q.shape[1] // 2
    outs = []
    for i, c in enumerate((rank, 2 * world - 1 - rank)):
        qc = q[:, i * half:(i + 1) * half].transpose(1, 2)
        keys = slice(c * half, (c + 1) * half)
        out, lse = _attend_lse(qc, kt[:, :, keys], vt[:, :, keys], True, backend)
        if c > 0:
            before, lse_before = _attend_lse(qc, kt[:, :, :c * half], vt[:, :, :c * half], False,
                                             backend)
            share = torch.sigmoid(lse_before - lse).unsqueeze(-1)  # the earlier keys' share
            out = torch.lerp(out.float(), before.float(), share).to(q.dtype)
        outs.append(out.transpose(1, 2))
    return torch.cat(outs, dim=1)
