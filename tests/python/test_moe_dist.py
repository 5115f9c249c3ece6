"""mkernel.moe_dispatch / moe_combine from torch.distributed (ranks are spawned processes, as in
test_torch_dist.py: two ranks share the GPU when only one exists).

Every rank rebuilds every rank's tokens, routing and expert weights from the printed seed:
  dispatch  the handle's rows equal the routing contract's order (source rank, token, slot),
            padded to 128 or masked, and every placed row is bitwise its source token
  layer     grouped_gemm of the dispatched rows with the local experts' weights (and
            moe_dispatch_gemm, the two in one launch), then combine:
            against the fp64 MoE of all ranks' experts, within twice the error of the same MoE
            computed by torch in bf16 (cuBLAS per expert, fp32 weighted sum), plus a small atol
  graphs    dispatch + grouped GEMM + combine captured once, replayed with new routing
  compile   torch.compile(fullgraph=True) of the same
  errors    an expert id out of range and a full masked block raise MkernelError at synchronize,
            once, and the communicator keeps working
"""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
mkernel = pytest.importorskip("mkernel", reason="mkernel is not installed (pip install .)")
import torch.distributed as dist  # noqa: E402

from test_torch_dist import _REASON, _assert_bitwise, _spawn  # noqa: E402

pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _routing(seed, case, rank, tokens, top_k, experts, skew=False):
    """Rank `rank`'s topk_idx [T, k] int64: distinct experts per token, about 1 in 8 slots -1."""
    g = torch.Generator().manual_seed((seed * 7919 + case * 131 + rank) % (1 << 62))
    if skew:  # Zipf-like popularity
        w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        idx = torch.stack([torch.multinomial(w, top_k, generator=g) for _ in range(tokens)]) \
            if tokens else torch.empty(0, top_k, dtype=torch.int64)
    else:
        idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) \
            if tokens else torch.empty(0, top_k, dtype=torch.int64)
    drop = torch.rand(idx.shape, generator=g) < 0.125
    return torch.where(drop, torch.full_like(idx, -1), idx)


def _data(seed, case, rank, shape, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator().manual_seed((seed * 104729 + case * 257 + rank) % (1 << 62))
    return ((torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * scale).to(dtype)


def _expected_rows(topk_all, rank, e_local, layout, capacity):
    """The contract's rows of `rank`'s layout: a list of (src, token, slot) or None, and the
    counts per local expert."""
    rows_of = [[] for _ in range(e_local)]
    for src, topk in enumerate(topk_all):
        for t, row in enumerate(topk.tolist()):
            for j, e in enumerate(row):
                if e >= 0 and e // e_local == rank:
                    rows_of[e % e_local].append((src, t, j))
    counts = [len(r) for r in rows_of]
    if layout == "masked":
        total = e_local * capacity
        starts = [e * capacity for e in range(e_local)]
        ends = [s + capacity for s in starts]
    else:
        total, starts, at = capacity, [], 0
        for n in counts:
            starts.append(at)
            at += (n + 127) // 128 * 128
        ends = [total] * e_local
    layout_rows = [None] * total
    for e, rows in enumerate(rows_of):
        for i, r in enumerate(rows):
            if starts[e] + i < ends[e]:
                layout_rows[starts[e] + i] = r
    return layout_rows, counts


def _check_dispatch(recv, expert_rows, handle, xs, topk_all, rank, e_local, layout, capacity,
                    what):
    want_rows, counts = _expected_rows(topk_all, rank, e_local, layout, capacity)
    assert expert_rows.tolist() == counts, f"{what}: rows per expert"
    got = handle.rows.cpu()
    want = torch.tensor([r if r is not None else (-1, -1, -1) for r in want_rows],
                        dtype=torch.int32).reshape(-1, 3)
    assert torch.equal(got, want), f"{what}: handle rows differ from the contract's order"
    flat = recv.reshape(-1, recv.shape[-1]).cpu()
    placed = [i for i, r in enumerate(want_rows) if r is not None]
    if placed:
        src_rows = torch.stack([xs[s][t] for s, t, _ in (want_rows[i] for i in placed)])
        _assert_bitwise(flat[placed], src_rows, f"{what}: dispatched rows")


def _moe_reference(x, topk, weights, w_all, e_local, world):
    """(fp64 exact, torch bf16) outputs of this rank's tokens: per slot x @ W_e^T."""
    exact = torch.zeros(x.shape, dtype=torch.float64)
    torch_out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk.shape[1]):
            e = int(topk[t, j])
            if e < 0:
                continue
            w = w_all[e // e_local][e % e_local]
            exact[t] += float(weights[t, j]) * (x[t].double() @ w.double().T)
            y = (x[t:t + 1].cuda() @ w.cuda().T).float().cpu()[0]  # cuBLAS, rounded to bf16
            torch_out[t] = torch.addcmul(torch_out[t], y, torch.tensor(float(weights[t, j])))
    return exact, torch_out.to(torch.bfloat16)


def _moe(rank, world, seed, use_nccl):
    comm = mkernel.init()
    dev = torch.device("cuda", comm.device)
    cases = [  # (tokens, hidden, experts, top_k, layout, capacity, skew, index dtype)
        (96, 256, 8, 2, "padded", 0, False, torch.int64),
        (64, 512, 16, 4, "masked", 0, True, torch.int32),
        (33, 128, 32, 8, "padded", 0, True, torch.int64),
    ]
    for case, (tokens, hidden, experts, top_k, layout, capacity, skew, idx_dtype) in \
            enumerate(cases):
        what = f"moe case {case} (T {tokens}, H {hidden}, E {experts}, top-{top_k}, {layout}), " \
               f"rank {rank}"
        e_local = experts // world
        topk_all = [_routing(seed, case, r, tokens, top_k, experts, skew) for r in range(world)]
        xs = [_data(seed, case, r, (tokens, hidden)) for r in range(world)]
        weights = _data(seed, case, 100 + rank, (tokens, top_k), torch.float32).abs() + 0.1
        w_all = [_data(seed, case, 200 + r, (e_local, hidden, hidden), scale=0.1)
                 for r in range(world)]
        x = xs[rank].to(dev)
        idx = topk_all[rank].to(idx_dtype).to(dev)
        recv, expert_rows, handle = mkernel.moe_dispatch(x, idx, comm, experts, layout=layout,
                                                         capacity=capacity)
        comm.synchronize()
        plan = mkernel.moe.moe_plan(comm, tokens, hidden, top_k, experts, layout=layout,
                                    capacity=capacity)
        _check_dispatch(recv, expert_rows, handle, xs, topk_all, rank, e_local, layout, plan[1],
                        what)
        y = mkernel.grouped_gemm(recv, w_all[rank].to(dev), expert_rows,
                                 padded=layout == "padded")
        out = mkernel.moe_combine(y, weights.to(dev), handle, comm)
        comm.synchronize()
        exact, torch_out = _moe_reference(xs[rank], topk_all[rank], weights, w_all, e_local, world)
        err = (out.cpu().double() - exact).abs().max().item()
        err_torch = (torch_out.double() - exact).abs().max().item()
        assert err <= 2 * err_torch + 1e-3, f"{what}: error {err}, torch {err_torch}"
        again = mkernel.moe_combine(y, weights.to(dev), handle, comm)
        _assert_bitwise(again, out, f"{what}: combine twice")
        # The fused launch: the same layout and rows, y within the tolerance rule after combine.
        y_f, rows_f, handle_f, recv_f = mkernel.moe_dispatch_gemm(
            x, idx, w_all[rank].to(dev), comm, experts, layout=layout, capacity=capacity,
            return_received=True)
        comm.synchronize()
        assert torch.equal(rows_f, expert_rows), f"{what}: fused counts"
        assert torch.equal(handle_f.rows, handle.rows), f"{what}: fused handle"
        placed = (handle.rows[:, 0] >= 0).nonzero().flatten()
        _assert_bitwise(recv_f.reshape(-1, hidden)[placed], recv.reshape(-1, hidden)[placed],
                        f"{what}: fused dispatched rows")
        y_rows, yf_rows = y.reshape(-1, y.shape[-1])[placed], y_f.reshape(-1, y.shape[-1])[placed]
        differ = (y_rows != yf_rows).any(dim=1).nonzero().flatten()
        if len(differ):
            rows = placed[differ[:8]]
            print(f"{what}: {len(differ)} of {len(placed)} fused y rows differ from the grouped "
                  f"GEMM's; rows {rows.tolist()}, handles {handle.rows[rows].tolist()}",
                  flush=True)
        out_f = mkernel.moe_combine(y_f, weights.to(dev), handle_f, comm)
        comm.synchronize()
        err_f = (out_f.cpu().double() - exact).abs().max().item()
        assert err_f <= 2 * err_torch + 1e-3, f"{what}: fused error {err_f}, torch {err_torch}"
        # Without return_received the rows are not copied anywhere: the same y, bit for bit.
        y_g, rows_g, handle_g = mkernel.moe_dispatch_gemm(
            x, idx, w_all[rank].to(dev), comm, experts, layout=layout, capacity=capacity)
        comm.synchronize()
        assert torch.equal(rows_g, expert_rows), f"{what}: fused counts, no recv_x"
        assert torch.equal(handle_g.rows, handle.rows), f"{what}: fused handle, no recv_x"
        _assert_bitwise(y_g.reshape(-1, y.shape[-1])[placed], yf_rows,
                        f"{what}: fused y without recv_x")
    dist.barrier()

    # A CUDA graph of the layer, replayed with new routing, tokens and weights.
    tokens, hidden, experts, top_k = 80, 256, 16, 4
    e_local = experts // world
    w_local = _data(seed, 40, 200 + rank, (e_local, hidden, hidden), scale=0.1).to(dev)
    x_s = torch.zeros(tokens, hidden, dtype=torch.bfloat16, device=dev)
    idx_s = torch.full((tokens, top_k), -1, dtype=torch.int64, device=dev)
    wt_s = torch.zeros(tokens, top_k, dtype=torch.float32, device=dev)

    def layer(x_in, idx_in, wt_in):
        recv_, rows_, handle_ = mkernel.moe_dispatch(x_in, idx_in, comm, experts)
        return mkernel.moe_combine(mkernel.grouped_gemm(recv_, w_local, rows_, padded=True),
                                   wt_in, handle_, comm)

    layer(x_s, idx_s, wt_s)  # the workspace, before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = layer(x_s, idx_s, wt_s)
    compiled = torch.compile(layer, fullgraph=True)
    for replay in range(6):
        idx = _routing(seed, 50 + replay, rank, tokens, top_k, experts, replay % 2 == 1)
        x_s.copy_(_data(seed, 50 + replay, rank, (tokens, hidden)))
        idx_s.copy_(idx)
        wt_s.copy_(_data(seed, 50 + replay, 100 + rank, (tokens, top_k), torch.float32).abs())
        eager = layer(x_s, idx_s, wt_s)
        graph.replay()
        _assert_bitwise(out_s, eager, f"graph replay {replay}, rank {rank}")
        _assert_bitwise(compiled(x_s, idx_s, wt_s), eager, f"torch.compile {replay}, rank {rank}")
    comm.synchronize()
    dist.barrier()

    # Data errors: raised once at synchronize, the communicator still usable.
    x = _data(seed, 60, rank, (16, 64)).to(dev)
    bad = torch.zeros(16, 2, dtype=torch.int64, device=dev)
    bad[3, 1] = 8 * world  # out of range
    mkernel.moe_dispatch(x, bad, comm, 8 * world)
    with pytest.raises(mkernel.MkernelError, match=r"topk_idx\[3\]\[1\]") as info:
        comm.synchronize()
    assert info.value.code == "invalid_argument"
    full = torch.zeros(16, 2, dtype=torch.int64, device=dev)
    full[:, 1] = 1  # every token of every rank to experts 0 and 1: 16 x world rows each
    mkernel.moe_dispatch(x, full, comm, 8 * world, layout="masked", capacity=5)
    if rank == 0:  # experts 0 and 1 live on rank 0
        with pytest.raises(mkernel.MkernelError, match="local expert [01] ") as info:
            comm.synchronize()
        assert info.value.code == "out_of_memory"
    else:
        comm.synchronize()
    comm.check()
    recv, rows, handle = mkernel.moe_dispatch(x, full, comm, 8 * world)
    comm.synchronize()
    if rank == 0:
        assert rows.tolist()[:2] == [16 * world, 16 * world]
    dist.barrier()


def test_moe_dispatch_and_combine_match_references():
    _spawn(_moe)


def _disagree(rank, world, seed, use_nccl):
    comm = mkernel.init(timeout_seconds=30)
    dev = torch.device("cuda", comm.device)
    torch.cuda.set_device(dev)
    x = _data(seed, 70, rank, (16, 64)).to(dev)
    idx = _routing(seed, 70, rank, 16, 2, 8 * world).to(dev)
    # A first call with room for both problems below: every rank's workspace fits either, so the
    # ranks meet in the kernels, not in a workspace allocation one of them makes alone.
    mkernel.moe_dispatch(x, idx, comm, 8 * world, max_tokens=64)
    comm.synchronize()
    dist.barrier()
    # max_tokens of its own on each rank (as the default, this call's T, gives when the ranks' T
    # differ): an error naming both ranks, not rows at the wrong offsets.
    mkernel.moe_dispatch(x, idx, comm, 8 * world, max_tokens=16 + 8 * rank)
    with pytest.raises(mkernel.MkernelError, match="different operations or sizes") as info:
        comm.synchronize()
    assert info.value.code == "invalid_argument"
    assert f"rank {rank} and rank " in str(info.value)
    dist.barrier()


def test_ranks_that_disagree_on_the_problem_get_an_error():
    _spawn(_disagree)
