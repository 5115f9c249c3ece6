"""The Python layer's host-side behaviour, on any machine (no GPU, no built extension needed).

Where mkernel is installed the installed package is tested; elsewhere the package's sources
(python/mkernel) are imported over a stand-in for the extension mkernel._C, which nothing here
reaches: the checks below run the custom ops' fake implementations, the eager fast path's
choice, zigzag_unshard's gradient check and the Hugging Face weight converter.
"""
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

_SOURCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")


def _load_mkernel():
    try:
        import mkernel
        return mkernel
    except ImportError:
        pass
    stub = types.ModuleType("mkernel._C")
    stub.DTYPES = ("bf16", "f16", "f32")
    stub.ERROR_CODES = ("invalid_argument", "not_initialized", "out_of_memory", "unsupported",
                        "timeout", "bootstrap", "cuda", "system", "internal")
    stub.MkernelError = type("MkernelError", (RuntimeError,), {"code": None})
    # Imported, then taken out of sys.modules again: the other test files must still find no
    # mkernel (they skip) rather than these sources over a stand-in.
    sys.path.insert(0, _SOURCES)
    sys.modules["mkernel._C"] = stub
    try:
        import mkernel
        return mkernel
    finally:
        sys.path.remove(_SOURCES)
        for name in [n for n in sys.modules if n == "mkernel" or n.startswith("mkernel.")]:
            del sys.modules[name]


mkernel = _load_mkernel()


class _FakeImpl:
    """Stands in for _C.Communicator: nothing here may reach it."""

    rank, world_size, device = 0, 2, 0


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _assert_like(got, shape, dtype):
    """What the real implementation allocates: contiguous, on the inputs' device."""
    assert tuple(got.shape) == tuple(shape) and got.dtype == dtype
    assert got.device.type == "meta" and got.is_contiguous()


def test_public_functions_propagate_meta_tensors_like_the_ops():
    """Meta tensors (a shape-only dry run outside any mode) go through torch.ops.mkernel.* and
    its fake implementation, as they do when the op is called by name; the eager fast path
    used to take them and raise 'expected a CUDA device' instead."""
    comm = mkernel.Communicator(_FakeImpl())
    a, b = _meta(2, 3, 64), _meta(32, 64)
    _assert_like(torch.ops.mkernel.gemm(a, b, "nk"), (2, 3, 32), torch.bfloat16)
    _assert_like(mkernel.gemm(a, b), (2, 3, 32), torch.bfloat16)
    _assert_like(mkernel.gemm(a, _meta(64, 48), "kn"), (2, 3, 48), torch.bfloat16)
    rows = _meta(4, dtype=torch.int32)
    _assert_like(mkernel.grouped_gemm(_meta(100, 64), _meta(4, 32, 64), rows), (100, 32),
                 torch.bfloat16)
    _assert_like(mkernel.grouped_gemm(_meta(4, 16, 64), _meta(4, 32, 64), rows), (4, 16, 32),
                 torch.bfloat16)
    c, gathered = mkernel.ag_gemm(_meta(8, 64), b, comm, return_gathered=True)
    _assert_like(c, (16, 32), torch.bfloat16)
    _assert_like(gathered, (16, 64), torch.bfloat16)
    _assert_like(mkernel.ag_gemm(_meta(8, 64), b, comm), (16, 32), torch.bfloat16)
    _assert_like(mkernel.gemm_rs(_meta(16, 64), b, comm), (8, 32), torch.bfloat16)
    out = _meta(16, 32)
    assert mkernel.gemm_ar(_meta(16, 64), b, comm, out) is out
    q, kv = _meta(2, 16, 8, 64), _meta(2, 16, 2, 64)
    o, lse = mkernel.attention(q, kv, kv, causal=True, return_lse=True)
    _assert_like(o, (2, 16, 8, 64), torch.bfloat16)
    _assert_like(lse, (2, 8, 16), torch.float32)
    _assert_like(mkernel.attention(q, kv, kv), (2, 16, 8, 64), torch.bfloat16)
    o, lse = mkernel.ring_attention(q, kv, kv, comm, return_lse=True)
    _assert_like(o, (2, 16, 8, 64), torch.bfloat16)
    _assert_like(lse, (2, 8, 16), torch.float32)
    x, idx, wt = _meta(5, 64), _meta(5, 2, dtype=torch.int64), _meta(5, 2, dtype=torch.float32)
    _assert_like(mkernel.moe_layer(x, idx, wt, _meta(2, 256, 64), _meta(2, 64, 128), comm, 4),
                 (5, 64), torch.bfloat16)
    handle = mkernel.MoeHandle(_meta(300, 3, dtype=torch.int32), _meta(2, dtype=torch.int32),
                               5, 5, 64, 2, 4, "padded", 0)
    _assert_like(mkernel.moe_combine(_meta(300, 64), wt, handle, comm), (5, 64), torch.bfloat16)


def test_fast_path_is_for_cuda_tensors_only():
    assert not mkernel._direct(_meta(4, 8), _meta(8, 8))
    assert not mkernel._direct(torch.zeros(4, 8), torch.zeros(8, 8))
    with pytest.raises(ValueError, match="is on cpu; expected a CUDA device"):
        mkernel.gemm(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8, 8, dtype=torch.bfloat16))


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield types.SimpleNamespace(world_size=1, rank=0, group=None)
    finally:
        dist.destroy_process_group()


def test_zigzag_unshard_refuses_to_drop_the_gradient(one_rank_group):
    """zigzag_unshard gathers with torch.distributed.all_gather, which is not differentiable: a
    tensor that needs a gradient (e.g. ring_attention's output, whose op has no backward) came
    back detached, silently cutting everything before it out of backward."""
    comm = one_rank_group
    x = torch.randn(2, 8, 3)
    share = mkernel.zigzag_shard(x, comm)
    torch.testing.assert_close(mkernel.zigzag_unshard(share, comm), x, rtol=0, atol=0)
    w = torch.randn(2, 8, 3, requires_grad=True)
    y = mkernel.zigzag_shard(w * 2, comm)  # zigzag_shard is differentiable (chunk, cat)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match="zigzag_unshard: x requires grad"):
        mkernel.zigzag_unshard(y, comm)
    torch.testing.assert_close(mkernel.zigzag_unshard(y.detach(), comm), w.detach() * 2)
    with torch.no_grad():
        torch.testing.assert_close(mkernel.zigzag_unshard(y, comm), w.detach() * 2)


# ---- attention's inputs --------------------------------------------------------------------------

def _misaligned(*shape):
    """A contiguous bf16 tensor 2 bytes past a 16-byte boundary (a view into a flat buffer)."""
    n = 1
    for d in shape:
        n *= d
    flat = torch.randn(n + 8, dtype=torch.float32).to(torch.bfloat16)
    skip = next(i for i in range(1, 8) if (flat.data_ptr() + 2 * i) % 16 != 0)
    x = flat[skip:skip + n].view(*shape)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    return x


def _bf16_at(address, shape, strides):
    """The bf16 tensor the C++ layer would read at `address` with these element strides."""
    import ctypes
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    raw = torch.frombuffer((ctypes.c_uint16 * span).from_address(address), dtype=torch.bfloat16)
    return raw.as_strided(shape, strides)


def test_attention_copies_what_the_copy_engine_cannot_read():
    """attention's inputs are copied where the copy engine cannot read them (module doc); the
    copy was x.contiguous(), which is x itself for a tensor torch calls contiguous - at any
    alignment, and with any stride on a size-1 dimension - so those went on to the C++ layer
    unchanged and were refused there ('not 16-byte aligned', 'stride = 3')."""
    ops = mkernel.attention_ops
    odd = torch.randn(1, 16, 1, 64).to(torch.bfloat16).as_strided((1, 16, 1, 64), (3, 64, 5, 1))
    assert odd.is_contiguous()
    for x in (_misaligned(2, 16, 4, 64), odd):
        got = ops._readable(x)
        assert got.data_ptr() % 16 == 0
        assert got.stride(3) == 1 and all(s % 8 == 0 for s in got.stride()[:3])
        assert torch.equal(got, x)
    packed = torch.randn(2, 16, 3, 4, 64).to(torch.bfloat16)[:, :, 0]  # readable as it is
    assert ops._readable(packed) is packed


class _FakeRingComm:
    """What ring_attention's implementation asks of a communicator, on the CPU."""

    world_size, _device, _impl = 2, -1, None  # (_device -1: CPU tensors' get_device())

    def _workspace(self, nbytes, op, kind):
        return torch.empty(nbytes, dtype=torch.uint8)

    def _stream(self):
        return 0


def test_ring_attention_hands_the_cxx_layer_readable_k_and_v(monkeypatch):
    """The C++ layer takes one set of strides for k and v, 16-byte aligned pointers. A misaligned
    contiguous k was passed on as it was (x.contiguous() of a contiguous tensor is itself), and
    then refused; k and v of different strides each 'made contiguous' could still differ."""
    ops = mkernel.attention_ops
    calls = []

    def ring_attention(impl, q, k, v, o, lse, q_strides, kv_strides, b, s, h, h_kv, d, *rest):
        shape = (b, s, h_kv, d)
        calls.append({"pointers": (q, k, v), "strides": (q_strides, kv_strides),
                      "k": _bf16_at(k, shape, kv_strides + (1,)).clone(),
                      "v": _bf16_at(v, shape, kv_strides + (1,)).clone()})

    fake_c = types.SimpleNamespace(ring_attention_workspace_bytes=lambda *args: 256,
                                   ring_attention=ring_attention)
    monkeypatch.setattr(ops, "_C", fake_c)
    monkeypatch.setattr(ops, "_communicator", lambda comm, op: _FakeRingComm())
    q = torch.randn(2, 40, 4, 64).to(torch.bfloat16)
    k = _misaligned(2, 40, 1, 64)
    # [B, H_kv, S, D] as a model holds it, transposed: torch-contiguous (H_kv = 1), but its head
    # stride is S x D where k's is D.
    v = torch.randn(2, 1, 40, 64).to(torch.bfloat16).transpose(1, 2)
    assert v.is_contiguous() and v.stride() != k.stride()
    ops._ring_impl(q, k, v, 0, True, None, False)
    (call,) = calls
    assert all(p % 16 == 0 for p in call["pointers"]), call["pointers"]
    assert all(s % 8 == 0 for strides in call["strides"] for s in strides), call["strides"]
    assert torch.equal(call["k"], k) and torch.equal(call["v"], v)


def test_ring_attention_fake_refuses_what_the_op_refuses():
    """The fake implementation (torch.compile, meta tensors) gave shapes for what the op itself
    refuses - S_q != S_kv, an odd causal S_local - so a compiled graph failed only when run; and
    the shape errors of ring_attention were worded as mkernel.attention's."""
    comm = mkernel.Communicator(_FakeImpl())
    kv = _meta(2, 32, 2, 64)
    with pytest.raises(ValueError, match="expected both = S_local"):
        mkernel.ring_attention(_meta(2, 16, 8, 64), kv, kv, comm)
    with pytest.raises(ValueError, match="even S_local"):
        mkernel.ring_attention(_meta(2, 15, 8, 64), _meta(2, 15, 2, 64), _meta(2, 15, 2, 64), comm,
                               causal=True)
    with pytest.raises(ValueError, match="mkernel.ring_attention: q must be 4-D"):
        mkernel.ring_attention(_meta(2, 32, 64), kv, kv, comm)
    o = mkernel.ring_attention(_meta(2, 15, 8, 64), _meta(2, 15, 2, 64), _meta(2, 15, 2, 64), comm,
                               causal=False)
    _assert_like(o, (2, 15, 8, 64), torch.bfloat16)


def test_moe_dispatch_gemm_fake_refuses_another_ranks_count_of_experts(monkeypatch):
    """moe_dispatch_gemm refuses w whose experts are not this rank's E_local (e.g. every rank's
    experts); its fake implementation did not, so torch.compile traced it and it failed when
    run."""
    comm = mkernel.Communicator(_FakeImpl())  # world 2: 8 experts, 4 a rank
    plans = []

    def moe_plan(impl, tokens, max_tokens, hidden, top_k, num_experts, layout, capacity, sms):
        plans.append(num_experts)
        rows = 2 * max_tokens * top_k + 4 * 127
        return rows, rows, num_experts // 2, 8, 1 << 20, "fake plan"

    monkeypatch.setattr(mkernel.moe, "_C", types.SimpleNamespace(moe_plan=moe_plan))
    x, idx = _meta(5, 64), _meta(5, 2, dtype=torch.int64)
    y, expert_rows, handle = mkernel.moe_dispatch_gemm(x, idx, _meta(4, 32, 64), comm, 8)
    _assert_like(y, (2 * 5 * 2 + 4 * 127, 32), torch.bfloat16)
    _assert_like(expert_rows, (4,), torch.int32)
    with pytest.raises(ValueError, match="w holds 8 experts; this rank has 4"):
        mkernel.moe_dispatch_gemm(x, idx, _meta(8, 32, 64), comm, 8)
    assert plans == [8, 8]


# ---- moe_weights_from_hf -----------------------------------------------------------------------

def _default_apply_gate(self, gate_up):  # transformers 5's, which @use_experts_implementation adds
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


class _FusedExperts(nn.Module):
    """The layout of transformers 5's fused experts (MixtralExperts, Qwen2MoeExperts, ...)."""

    is_concatenated, is_transposed, has_bias, has_post_expert_norm = True, False, False, False
    _apply_gate = _default_apply_gate

    def __init__(self, experts=3, hidden=16, inter=8, act=None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter))
        self.act_fn = act if act is not None else nn.SiLU()


class _ClampedExperts(_FusedExperts):
    """DeepSeek-V4's, GLM's, ... experts: a SwiGLU whose gate and up are clamped."""

    limit = 10.0

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)


class _Fp32GateExperts(_FusedExperts):
    """A gate computed in fp32 and rounded back: the same SwiGLU."""

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return (self.act_fn(gate.float()) * up.float()).to(gate.dtype)


class _Expert(nn.Module):
    """transformers 4's Mixtral expert (w1 gate, w3 up, w2 down)."""

    def __init__(self, hidden=16, inter=8, act=None, bias=False):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=bias)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.act_fn = act if act is not None else nn.SiLU()


def test_hf_converter_keeps_swiglu_experts():
    fused = _FusedExperts()
    w13, w2 = mkernel.moe_weights_from_hf(fused)
    torch.testing.assert_close(w13, fused.gate_up_proj.detach(), rtol=0, atol=0)
    torch.testing.assert_close(w2, fused.down_proj.detach(), rtol=0, atol=0)
    mkernel.moe_weights_from_hf(_Fp32GateExperts())
    experts = [_Expert() for _ in range(3)]
    w13, w2 = mkernel.moe_weights_from_hf(experts)
    assert w13.shape == (3, 16, 16) and w2.shape == (3, 16, 8)
    for e, expert in enumerate(experts):
        torch.testing.assert_close(w13[e], torch.cat([expert.w1.weight, expert.w3.weight]).detach(),
                                   rtol=0, atol=0)
        torch.testing.assert_close(w2[e], expert.w2.weight.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("experts, match", [
    (lambda: _ClampedExperts(), r"gate \(_apply_gate\) is not this layer's SwiGLU"),
    (lambda: _FusedExperts(act=nn.GELU()), r"gate \(_apply_gate\) is not this layer's SwiGLU"),
    (lambda: [_Expert(act=nn.GELU()) for _ in range(2)], r"activation \(act_fn\) is not"),
    (lambda: [_Expert(), _Expert(bias=True)], "w1 has a bias"),
])
def test_hf_converter_refuses_experts_the_layer_would_compute_differently(experts, match):
    """moe_layer computes silu(x Wg^T) * (x Wu^T) then W2, nothing else: experts with another
    activation, a clamped gate or biases were converted without a word, and the layer then gave
    other outputs than the model's."""
    with pytest.raises(ValueError, match=match):
        mkernel.moe_weights_from_hf(experts())


def test_hf_converter_refuses_a_norm_after_each_expert():
    fused = _FusedExperts()
    fused.has_post_expert_norm = True
    with pytest.raises(ValueError, match="norm after each expert"):
        mkernel.moe_weights_from_hf(fused)


def test_hf_converter_on_transformers_mixtral():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    del transformers
    config = MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                           num_experts_per_tok=2)
    w13, w2 = mkernel.moe_weights_from_hf(MixtralSparseMoeBlock(config).experts)
    assert w13.shape == (4, 32, 32) and w2.shape == (4, 32, 16)
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="not this layer's SwiGLU"):
        mkernel.moe_weights_from_hf(MixtralSparseMoeBlock(config).experts)
