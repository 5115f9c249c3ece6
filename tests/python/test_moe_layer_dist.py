"""mkernel.moe_layer from torch.distributed (spawned ranks, as test_torch_dist.py: two ranks share
the GPU when only one exists).

Every rank rebuilds every expert's weights and its own tokens and routing from the printed seed:
  reference  the plain PyTorch layer over all experts: per slot silu(x Wg^T) * (x Wu^T) -> W2^T,
             weighted sum - in fp64 (exact) and in bf16 on the GPU (what a user's torch layer
             computes); ours within twice torch's error of the exact one plus a small atol,
             padded and masked layouts, skewed routing, -1 slots, top-1/2/8
  bitwise    a second call writes the same bits
  graphs     the layer captured once, replayed with new routing and tokens: bitwise eager
  compile    torch.compile(fullgraph=True): bitwise eager
  hf         Hugging Face transformers' MixtralSparseMoeBlock (random weights, small config):
             its router's top-k fed to ours with moe_weights_from_hf's weights; ours within twice
             the block's own error (it computes in bf16) of the fp64 layer
  errors     shapes, dtypes and experts per rank refused with a message
"""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
mkernel = pytest.importorskip("mkernel", reason="mkernel is not installed (pip install .)")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from test_torch_dist import _REASON, _assert_bitwise, _spawn  # noqa: E402

pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _gen(seed, *salt):
    h = seed
    for s in salt:
        h = (h * 1000003 + s) % (1 << 62)
    return torch.Generator().manual_seed(h)


def _data(shape, g, scale=1.0, dtype=torch.bfloat16):
    return ((torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * scale).to(dtype)


def _routing(g, tokens, top_k, experts, skew):
    if skew:
        w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.5
        idx = torch.stack([torch.multinomial(w, top_k, generator=g) for _ in range(tokens)])
    else:
        idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    drop = torch.rand(idx.shape, generator=g) < 0.1
    return torch.where(drop, torch.full_like(idx, -1), idx)


def _experts(seed, case, experts, hidden, inter):
    """All experts' (w13 [E, 2I, H], w2 [E, H, I]) bf16 on the CPU."""
    g = _gen(seed, case, 7)
    w13 = _data((experts, 2 * inter, hidden), g, hidden ** -0.5 * 2)
    w2 = _data((experts, hidden, inter), g, inter ** -0.5 * 2)
    return w13, w2


def _reference(x, idx, wt, w13, w2):
    """(fp64 exact, torch bf16 on the GPU) of the layer over all experts."""
    inter = w2.shape[2]
    exact = torch.zeros(x.shape, dtype=torch.float64)
    ours_torch = torch.zeros(x.shape, dtype=torch.float32, device="cuda")
    xg = x.cuda()
    for e in range(w13.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        wg, wu = w13[e, :inter], w13[e, inter:]
        xd = x[tok].double()
        h = F.silu(xd @ wg.double().T) * (xd @ wu.double().T)
        exact.index_add_(0, tok, wt[tok, slot].double()[:, None] * (h @ w2[e].double().T))
        # The plain PyTorch layer in bf16 (cuBLAS), the weighted sum in fp32.
        xb = xg[tok.cuda()]
        hb = F.silu(xb @ wg.cuda().T) * (xb @ wu.cuda().T)
        yb = (hb @ w2[e].cuda().T).float()
        ours_torch.index_add_(0, tok.cuda(), wt[tok, slot].cuda()[:, None] * yb)
    return exact, ours_torch.to(torch.bfloat16).cpu()


def _layer(rank, world, seed, use_nccl):
    comm = mkernel.init()
    dev = torch.device("cuda", comm.device)
    cases = [  # (tokens, hidden, inter, experts, top_k, layout, skew, index dtype)
        (96, 256, 128, 8, 2, "padded", False, torch.int64),
        (64, 512, 192, 16, 8, "padded", True, torch.int32),
        (50, 256, 64, 8, 1, "masked", False, torch.int64),
        (40, 136, 128, 4 * world, 2, "masked", True, torch.int32),
    ]
    for case, (tokens, hidden, inter, experts, top_k, layout, skew, idx_dtype) in \
            enumerate(cases):
        what = f"layer case {case} (T {tokens}, H {hidden}, I {inter}, E {experts}, " \
               f"top-{top_k}, {layout}), rank {rank}"
        e_local = experts // world
        w13, w2 = _experts(seed, case, experts, hidden, inter)
        g = _gen(seed, case, rank)
        x = _data((tokens, hidden), g)
        idx = _routing(g, tokens, top_k, experts, skew)
        wt = torch.rand((tokens, top_k), generator=g, dtype=torch.float32) + 0.05
        mine = slice(rank * e_local, (rank + 1) * e_local)
        args = (x.to(dev), idx.to(idx_dtype).to(dev), wt.to(dev), w13[mine].to(dev),
                w2[mine].to(dev), comm, experts)
        out = mkernel.moe_layer(*args, layout=layout)
        comm.synchronize()
        exact, torch_out = _reference(x, idx, wt, w13, w2)
        err = (out.cpu().double() - exact).abs().max().item()
        err_torch = (torch_out.double() - exact).abs().max().item()
        assert err <= 2 * err_torch + 1e-3, f"{what}: error {err}, torch's {err_torch}"
        _assert_bitwise(mkernel.moe_layer(*args, layout=layout), out, f"{what}: second call")
        plan = mkernel.moe.moe_layer_plan(comm, tokens, hidden, top_k, experts, inter,
                                          layout=layout)
        assert plan[5] > 0 and "I " + str(inter) in plan[6], plan
    dist.barrier()

    # A CUDA graph and torch.compile of the layer, replayed with new routing and tokens.
    tokens, hidden, inter, experts, top_k = 80, 256, 128, 16, 4
    e_local = experts // world
    w13, w2 = _experts(seed, 40, experts, hidden, inter)
    w13_l = w13[rank * e_local:(rank + 1) * e_local].to(dev)
    w2_l = w2[rank * e_local:(rank + 1) * e_local].to(dev)
    x_s = torch.zeros(tokens, hidden, dtype=torch.bfloat16, device=dev)
    idx_s = torch.full((tokens, top_k), -1, dtype=torch.int64, device=dev)
    wt_s = torch.zeros(tokens, top_k, dtype=torch.float32, device=dev)

    def layer(x_in, idx_in, wt_in):
        return mkernel.moe_layer(x_in, idx_in, wt_in, w13_l, w2_l, comm, experts)

    layer(x_s, idx_s, wt_s)  # the workspace, before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = layer(x_s, idx_s, wt_s)
    compiled = torch.compile(layer, fullgraph=True)
    for replay in range(4):
        g = _gen(seed, 50 + replay, rank)
        x_s.copy_(_data((tokens, hidden), g))
        idx_s.copy_(_routing(g, tokens, top_k, experts, replay % 2 == 1))
        wt_s.copy_(torch.rand((tokens, top_k), generator=g) + 0.05)
        eager = layer(x_s, idx_s, wt_s)
        graph.replay()
        _assert_bitwise(out_s, eager, f"graph replay {replay}, rank {rank}")
        _assert_bitwise(compiled(x_s, idx_s, wt_s), eager, f"torch.compile {replay}, rank {rank}")
    comm.synchronize()

    # Refusals, before anything runs (every rank refuses the same call).
    x = torch.zeros(8, hidden, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(8, 2, dtype=torch.int64, device=dev)
    wt = torch.ones(8, 2, dtype=torch.float32, device=dev)
    with pytest.raises(ValueError, match="w13"):
        mkernel.moe_layer(x, idx, wt, w13_l[:, :, :64], w2_l, comm, experts)
    with pytest.raises(ValueError, match="topk_weights has dtype"):
        mkernel.moe_layer(x, idx, wt.double(), w13_l, w2_l, comm, experts)
    with pytest.raises(ValueError, match="experts"):
        mkernel.moe_layer(x, idx, wt, w13_l[:1], w2_l[:1], comm, experts)
    with pytest.raises(mkernel.MkernelError, match="intermediate = 96"):
        mkernel.moe_layer(x, idx, wt, w13_l[:, :192], w2_l[:, :, :96], comm, experts)
    dist.barrier()


def test_moe_layer_matches_torch_references():
    _spawn(_layer)


def _hf_mixtral(rank, world, seed, use_nccl):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    comm = mkernel.init()
    dev = torch.device("cuda", comm.device)
    hidden, inter, experts, top_k, tokens = 256, 128, 4 * world, 2, 64
    config = MixtralConfig(hidden_size=hidden, intermediate_size=inter,
                           num_local_experts=experts, num_experts_per_tok=top_k)
    block = MixtralSparseMoeBlock(config)
    g = _gen(seed, 91)  # the same weights on every rank (transformers 5 leaves them empty)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(_data(tuple(p.shape), g, p.shape[-1] ** -0.5 * 2, torch.float32))
    block = block.to(dev, torch.bfloat16).eval()
    g = _gen(seed, 90, rank)
    x = _data((tokens, hidden), g).to(dev)
    with torch.no_grad():
        hf = block(x[None])
        hf_out = (hf[0] if isinstance(hf, tuple) else hf).reshape(tokens, hidden)
        # The block's routing (its router's weight; transformers 4 and 5 alike): softmax in fp32,
        # top-k, renormalised.
        probs = torch.softmax(F.linear(x, block.gate.weight).float(), dim=-1)
        wt, idx = torch.topk(probs, top_k, dim=-1)
        wt = wt / wt.sum(dim=-1, keepdim=True)
    e_local = experts // world
    w13, w2 = mkernel.moe_weights_from_hf(block.experts)  # all experts, in order
    assert w13.shape == (experts, 2 * inter, hidden) and w2.shape == (experts, hidden, inter)
    ours = mkernel.moe_layer(x, idx, wt, w13[rank * e_local:(rank + 1) * e_local],
                             w2[rank * e_local:(rank + 1) * e_local], comm, experts)
    comm.synchronize()
    exact, _ = _reference(x.cpu(), idx.cpu(), wt.cpu(), w13.cpu(), w2.cpu())
    assert exact.abs().max().item() > 1e-2, "the layer's output is (near) zero: a vacuous check"
    err = (ours.cpu().double() - exact).abs().max().item()
    err_hf = (hf_out.cpu().double() - exact).abs().max().item()
    assert err <= 2 * err_hf + 1e-3, f"rank {rank}: error {err}, the HF block's {err_hf}"
    dist.barrier()


def test_moe_layer_matches_hf_mixtral_block():
    pytest.importorskip("transformers", reason="transformers is not installed")
    _spawn(_hf_mixtral)
