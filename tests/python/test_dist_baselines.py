"""bench/dist_baselines.py - the NCCL-and-torch baselines bench_dist.py times mkernel against -
held to single-process references, so that a baseline that computes the wrong thing cannot make
a speedup. Ranks are spawned processes over gloo on the CPU (no GPU needed): worlds 2 and 3.

Every rank rebuilds every rank's tokens, routing and weights from the seed:
  moe_gemm_seq   each expert-major row is (source rank, token, slot) in mkernel's contract order
                 (by local expert, then source, token, slot), every routed pair once, and its
                 product with its expert's weight
  moe_layer_seq  the layer's output against the fp64 layer over all ranks' experts
  gather_kv + sdpa_local   this rank's share of the full-sequence attention (fp64 reference),
                 contiguous non-causal and zigzag causal, GQA
"""
import datetime
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import dist_baselines as base  # noqa: E402
from spawn_ranks import spawn_ranks  # noqa: E402

JOB_TIMEOUT_S = 240


def _gen(seed, *salt):
    s = seed
    for v in salt:
        s = (s * 1000003 + v) % (1 << 62)
    return torch.Generator().manual_seed(s)


def _routing(g, tokens, top_k, experts):
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) \
        if tokens else torch.empty(0, top_k, dtype=torch.int64)
    drop = torch.rand(idx.shape, generator=g) < 0.125
    return torch.where(drop, torch.full_like(idx, -1), idx)


def _bf16(g, shape, scale=1.0):
    return ((torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * scale).to(
        torch.bfloat16)


def _moe_inputs(seed, rank, tokens, hidden, top_k, experts):
    g = _gen(seed, 1, rank)
    x = _bf16(g, (tokens, hidden))
    idx = _routing(g, tokens, top_k, experts)
    weights = torch.rand(tokens, top_k, generator=g)
    return x, idx, weights


def _moe(rank, world, seed):
    hidden, n, inter, top_k, e_local = 32, 24, 16, 3, 3
    experts = world * e_local
    tokens_of = [5 + 7 * r for r in range(world)]  # ranks with different token counts
    tokens_of[world - 1] = 0 if world > 2 else tokens_of[world - 1]  # a rank with none
    inputs = [_moe_inputs(seed, r, tokens_of[r], hidden, top_k, experts) for r in range(world)]
    g = _gen(seed, 2)
    w_all = _bf16(g, (experts, n, hidden), 0.3)  # [E, N, H]
    w13_all = _bf16(g, (experts, 2 * inter, hidden), 0.3)
    w2_all = _bf16(g, (experts, hidden, inter), 0.3)
    mine = slice(rank * e_local, (rank + 1) * e_local)
    x, idx, weights = inputs[rank]

    # moe_gemm_seq: every pair routed here once, in the contract's order, times its weight.
    y, em = base.moe_gemm_seq(x, idx, w_all[mine].transpose(1, 2), experts)
    want = [(e - rank * e_local, s, t, j) for s in range(world)
            for t, row in enumerate(inputs[s][1].tolist()) for j, e in enumerate(row)
            if e >= 0 and e // e_local == rank]
    want.sort()  # by local expert, then source, token, slot
    assert [tuple(w) for w in em.who.tolist()] == [w[1:] for w in want], f"rank {rank}: rows"
    assert em.counts.tolist() == [sum(1 for w in want if w[0] == e) for e in range(e_local)]
    for i, (e, s, t, j) in enumerate(want):
        exact = inputs[s][0][t].double() @ w_all[rank * e_local + e].double().T
        assert (y[i].double() - exact).abs().max().item() <= 2 ** -7 * exact.abs().max() + 1e-3, \
            f"rank {rank}: row {i} ({s}, {t}, {j})"

    # moe_layer_seq against the fp64 layer.
    out = base.moe_layer_seq(x, idx, weights, w13_all[mine].transpose(1, 2),
                             w2_all[mine].transpose(1, 2), experts)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    for t in range(x.shape[0]):
        acc = torch.zeros(hidden, dtype=torch.float64)
        for j, e in enumerate(idx[t].tolist()):
            if e < 0:
                continue
            xt = x[t].double()
            h = torch.nn.functional.silu(w13_all[e, :inter].double() @ xt) * \
                (w13_all[e, inter:].double() @ xt)
            acc += float(weights[t, j]) * (w2_all[e].double() @ h)
        err = (out[t].double() - acc).abs().max().item()
        assert err <= 2 ** -6 * acc.abs().max().item() + 1e-2, f"rank {rank}: token {t} ({err})"


def _attention(rank, world, seed):
    b, h, h_kv, s_local, d = 2, 4, 2, 8, 16
    s = world * s_local
    g = _gen(seed, 3)
    q_full, k_full, v_full = (_bf16(g, (b, s, hh, d)) for hh in (h, h_kv, h_kv))
    for causal in (False, True):
        if causal:
            half = s_local // 2
            chunks = (rank, 2 * world - 1 - rank)
            share = lambda t: torch.cat([t[:, c * half:(c + 1) * half] for c in chunks], 1)  # noqa
            positions = torch.cat([torch.arange(c * half, (c + 1) * half) for c in chunks])
        else:
            share = lambda t: t[:, rank * s_local:(rank + 1) * s_local]  # noqa: E731
            positions = torch.arange(rank * s_local, (rank + 1) * s_local)
        k_seq, v_seq = base.gather_kv(share(k_full), share(v_full), causal)
        assert torch.equal(k_seq, k_full) and torch.equal(v_seq, v_full), "sequence order"
        out = base.sdpa_local(share(q_full), k_seq, v_seq, causal, rank, world)
        # fp64 reference: this rank's queries (at `positions`) against every key
        qt = share(q_full).double().transpose(1, 2)
        kt = k_full.double().transpose(1, 2).repeat_interleave(h // h_kv, 1)
        vt = v_full.double().transpose(1, 2).repeat_interleave(h // h_kv, 1)
        scores = qt @ kt.transpose(-1, -2) / math.sqrt(d)
        if causal:
            scores = scores.masked_fill(torch.arange(s)[None, :] > positions[:, None],
                                        float("-inf"))
        ref = (torch.softmax(scores, -1) @ vt).transpose(1, 2)
        err = (out.double() - ref).abs().max().item()
        assert err <= 2e-2, f"rank {rank}: causal {causal}: {err}"


def _entry(rank, world, port, seed, body):
    store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        body(rank, world, seed)
    finally:
        dist.destroy_process_group()


def _spawn(body, world):
    spawn_ranks(_entry, body.__name__, world, JOB_TIMEOUT_S, extra=(body,))


@pytest.mark.parametrize("world", [2, 3])
def test_moe_baselines_match_references(world):
    _spawn(_moe, world)


@pytest.mark.parametrize("world", [2, 3])
def test_attention_baselines_match_references(world):
    _spawn(_attention, world)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU backends")
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"])
def test_sdpa_local_causal_backends(backend):
    """The zigzag causal split (unmasked keys before each chunk, causal keys of the chunk, merged
    by log-sum-exp) on each GPU backend, every rank of world 2, against fp32 attention."""
    from torch.nn.attention import SDPBackend
    b, h, h_kv, s_local, d, world = 2, 8, 2, 256, 128, 2
    s = world * s_local
    g = _gen(11, 5)
    q_full, k_full, v_full = (_bf16(g, (b, s, hh, d)).cuda() for hh in (h, h_kv, h_kv))
    half = s_local // 2
    for rank in range(world):
        chunks = (rank, 2 * world - 1 - rank)
        q = torch.cat([q_full[:, c * half:(c + 1) * half] for c in chunks], 1)
        positions = torch.cat([torch.arange(c * half, (c + 1) * half) for c in chunks]).cuda()
        try:
            # (getattr: SDPBackend is a plain enum type in some torch builds, not subscriptable)
            chosen = getattr(SDPBackend, backend)
            out = base.sdpa_local(q, k_full, v_full, True, rank, world, chosen)
        except RuntimeError as e:  # (best_sdpa_backend skips a backend that does not run)
            pytest.skip(f"{backend} does not run here: {e}")
        qt = q.float().transpose(1, 2)
        kt = k_full.float().transpose(1, 2).repeat_interleave(h // h_kv, 1)
        vt = v_full.float().transpose(1, 2).repeat_interleave(h // h_kv, 1)
        scores = (qt @ kt.transpose(-1, -2) / math.sqrt(d)).masked_fill(
            torch.arange(s, device="cuda")[None, :] > positions[:, None], float("-inf"))
        ref = (torch.softmax(scores, -1) @ vt).transpose(1, 2)
        err = (out.float() - ref).abs().max().item()
        assert err <= 2 ** -7 * ref.abs().max().item() + 1e-3, f"{backend} rank {rank}: {err}"
