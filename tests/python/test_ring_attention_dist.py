"""mkernel.ring_attention from torch.distributed (ranks are spawned processes, as in
test_torch_dist.py: two ranks share the GPU when only one exists).

Every rank builds the same full sequence from the printed seed, takes its share (zigzag_shard for
causal, the contiguous share otherwise), runs ring_attention, and puts every rank's output back in
order (zigzag_unshard / all_gather): against SDPA's math over the whole sequence in fp32, within
twice the error of the same math in bf16 plus 1e-5, and the LSE within 1e-3. Also GQA, a CUDA
graph replayed on new inputs, torch.compile(fullgraph=True), and errors raised before launch.
"""

import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
mkernel = pytest.importorskip("mkernel", reason="mkernel is not installed (pip install .)")
import torch.distributed as dist  # noqa: E402

from test_torch_dist import _REASON, _spawn  # noqa: E402

pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _full(seed, case, shape, scale=1.0):
    g = torch.Generator().manual_seed((seed * 104729 + case * 257) % (1 << 62))
    return ((torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * scale).to(
        torch.bfloat16)


def _reference(q, k, v, causal, dtype):
    h, h_kv, d = q.shape[2], k.shape[2], q.shape[3]
    qt = q.transpose(1, 2).to(dtype)
    kt = k.transpose(1, 2).repeat_interleave(h // h_kv, dim=1).to(dtype)
    vt = v.transpose(1, 2).repeat_interleave(h // h_kv, dim=1).to(dtype)
    scores = (qt @ kt.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    if causal:
        s = q.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    o = (torch.softmax(scores.float(), dim=-1).to(dtype) @ vt).transpose(1, 2)
    return o, lse


def _shard(x, comm, causal):
    if causal:
        return mkernel.zigzag_shard(x, comm)
    return x.chunk(comm.world_size, dim=1)[comm.rank].contiguous()


def _unshard(x, comm, causal, dim=1):
    if causal:
        return mkernel.zigzag_unshard(x, comm, dim=dim)
    parts = [torch.empty_like(x) for _ in range(comm.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _ring(rank, world, seed, use_nccl):
    comm = mkernel.init()
    dev = torch.device("cuda", comm.device)
    cases = [  # (B, S per rank, H, H_kv, D, causal)
        (1, 512, 4, 4, 128, True), (2, 384, 8, 2, 64, False), (1, 200, 4, 1, 128, True),
        (1, 1024, 8, 2, 128, True)]
    for case, (b, s_local, h, h_kv, d, causal) in enumerate(cases):
        what = f"case {case} (B {b}, S_local {s_local}, H {h}/{h_kv}, D {d}, causal {causal})"
        s = s_local * world
        q = _full(seed, case, (b, s, h, d), 2.0).to(dev)
        k = _full(seed, 100 + case, (b, s, h_kv, d), 2.0).to(dev)
        v = _full(seed, 200 + case, (b, s, h_kv, d)).to(dev)
        o_local, lse_local = mkernel.ring_attention(
            _shard(q, comm, causal), _shard(k, comm, causal), _shard(v, comm, causal), comm,
            causal=causal, return_lse=True)
        comm.synchronize()
        o = _unshard(o_local, comm, causal)
        lse = _unshard(lse_local, comm, causal, dim=2)
        exact, exact_lse = _reference(q, k, v, causal, torch.float32)
        low, _ = _reference(q, k, v, causal, torch.bfloat16)
        err = (o.float() - exact).abs().max().item()
        err_low = (low.float() - exact).abs().max().item()
        assert err <= 2 * err_low + 1e-5, f"{what}: error {err}, bf16 math {err_low}"
        assert (lse - exact_lse).abs().max().item() <= 1e-3, f"{what}: LSE"

    # A graph replayed on new inputs, against eager calls; torch.compile.
    b, s_local, h, h_kv, d = 1, 256, 4, 2, 128
    static = [torch.randn(b, s_local, n, d, device=dev, dtype=torch.bfloat16)
              for n in (h, h_kv, h_kv)]
    mkernel.ring_attention(*static, comm)  # allocates the workspace before the capture
    comm.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mkernel.ring_attention(*static, comm)
    for i in range(3):
        g = torch.Generator(device=dev).manual_seed(seed + 10 * i + rank)
        for t in static:
            t.copy_(torch.randn(t.shape, device=dev, dtype=t.dtype, generator=g))
        graph.replay()
        eager = mkernel.ring_attention(*static, comm)
        comm.synchronize()
        assert torch.equal(out, eager), f"replay {i}: differs from an eager call"
    compiled = torch.compile(lambda a, b_, c: mkernel.ring_attention(a, b_, c, comm),
                             fullgraph=True)
    got = compiled(*static)
    comm.synchronize()
    assert torch.equal(got, mkernel.ring_attention(*static, comm))
    with pytest.raises(ValueError, match="even S_local"):
        mkernel.ring_attention(static[0][:, :255], static[1][:, :255], static[2][:, :255], comm)
    comm.synchronize()


def test_ring_attention_matches_full_sequence():
    _spawn(_ring)
