"""mkernel.attention as a PyTorch custom op (torch.ops.mkernel.attention) on a Hopper GPU.

Fresh random inputs each run. Accuracy rule (../shared/STYLE.md): against SDPA's math in fp32,
max |mkernel - exact| <= 2 * max |SDPA in bf16 - exact| + 1e-5, the LSE within 1e-3 of the fp32
logsumexp. Causal is bottom-right aligned (flash-attn's convention), so the reference builds its
mask explicitly. Also: GQA, strided (packed qkv) inputs, torch.compile(fullgraph=True), CUDA
graphs, torch.library.opcheck, and errors raised before any launch.
"""

import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
mkernel = pytest.importorskip("mkernel", reason="mkernel is not installed (pip install .)")


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    major, minor = torch.cuda.get_device_capability(0)
    if major < 9:
        return f"GPU 0 is sm_{major}{minor}; mkernel.attention needs Hopper (sm_90)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _inputs(b, s_q, s_kv, h, h_kv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s_q, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s_kv, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s_kv, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def _reference(q, k, v, causal, dtype):
    """(O [B, S_q, H, D], LSE [B, H, S_q]) computed in `dtype` with SDPA's math."""
    b, s_q, h, d = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    qt = q.transpose(1, 2).to(dtype)
    kt = k.transpose(1, 2).repeat_interleave(h // h_kv, dim=1).to(dtype)
    vt = v.transpose(1, 2).repeat_interleave(h // h_kv, dim=1).to(dtype)
    scores = (qt @ kt.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    if causal:  # bottom-right: query i sees keys j <= i + S_kv - S_q
        i = torch.arange(s_q, device=q.device)[:, None]
        j = torch.arange(s_kv, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + s_kv - s_q, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    p = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(dtype)
    o = (p @ vt).transpose(1, 2)
    return o, lse


def _check(q, k, v, causal):
    o, lse = mkernel.attention(q, k, v, causal=causal, return_lse=True)
    exact, exact_lse = _reference(q, k, v, causal, torch.float32)
    low, _ = _reference(q, k, v, causal, torch.bfloat16)
    err = (o.float() - exact).abs().max().item()
    err_low = (low.float() - exact).abs().max().item()
    assert err <= 2 * err_low + 1e-5, f"mkernel error {err}, bf16 SDPA math error {err_low}"
    finite = torch.isfinite(exact_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "rows with no key: LSE must be -inf"
    if finite.any():
        assert (lse[finite] - exact_lse[finite]).abs().max().item() <= 1e-3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [
    (1, 128, 128, 4, 4, 128), (2, 1000, 1000, 8, 2, 128), (1, 300, 777, 4, 1, 64),
    (1, 777, 300, 4, 4, 128), (4, 1, 513, 8, 8, 64), (1, 4096, 4096, 16, 2, 128),
])
def test_matches_reference(shape, causal):
    q, k, v = _inputs(*shape, seed=torch.seed() % (1 << 31))
    _check(q, k, v, causal)


def test_packed_qkv_strides():
    b, s, h, d = 2, 515, 8, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)  # strided views: no copies
    assert not q.is_contiguous()
    _check(q, k, v, True)


def test_broadcast_heads():
    """MQA written as k.expand over the heads (stride 0): the same as the materialised copy."""
    q, k, v = _inputs(1, 300, 300, 4, 1, 128, seed=9)
    kb, vb = k.expand(1, 300, 4, 128), v.expand(1, 300, 4, 128)
    assert kb.stride(2) == 0
    assert torch.equal(mkernel.attention(q, kb, vb, causal=True),
                       mkernel.attention(q, kb.contiguous(), vb.contiguous(), causal=True))


def test_default_output_and_scale():
    q, k, v = _inputs(1, 256, 256, 4, 4, 64, seed=5)
    o = mkernel.attention(q, k, v)
    assert o.shape == q.shape and o.dtype == torch.bfloat16
    o2 = mkernel.attention(q, k, v, softmax_scale=0.125)  # 1 / sqrt(64)
    assert torch.equal(o, o2)
    o3 = mkernel.attention(q, k, v, softmax_scale=0.5)
    assert not torch.equal(o, o3)


def test_compile_and_graph():
    q, k, v = _inputs(2, 640, 640, 8, 2, 128, seed=11)
    eager = mkernel.attention(q, k, v, causal=True)
    compiled = torch.compile(lambda a, b, c: mkernel.attention(a, b, c, causal=True),
                             fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)
    static = [t.clone() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mkernel.attention(*static, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mkernel.attention(*static, causal=True)
    for seed in (1, 2):
        fresh = _inputs(2, 640, 640, 8, 2, 128, seed=seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, mkernel.attention(*fresh, causal=True))


def test_opcheck():
    q, k, v = _inputs(1, 200, 300, 4, 2, 64, seed=3)
    torch.library.opcheck(torch.ops.mkernel.attention.default, (q, k, v, True, None, True))


def test_errors():
    q, k, v = _inputs(1, 128, 128, 4, 2, 128, seed=1)
    with pytest.raises(ValueError, match="head_dim = 96"):
        mkernel.attention(q[..., :96], k[..., :96], v[..., :96])
    with pytest.raises(ValueError, match="not a multiple"):
        mkernel.attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="dtype"):
        mkernel.attention(q.float(), k, v)
    with pytest.raises(ValueError, match="4-D"):
        mkernel.attention(q[0], k, v)
    with pytest.raises(ValueError, match="softmax_scale"):
        mkernel.attention(q, k, v, softmax_scale=-1.0)
    # Positive doubles that are 0 or inf as the kernels' float32 (0 would mean the default).
    for scale in (1e-46, 1e39):
        with pytest.raises(ValueError, match="as a float32"):
            mkernel.attention(q, k, v, softmax_scale=scale)
