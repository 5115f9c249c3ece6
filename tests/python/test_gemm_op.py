"""mkernel.gemm as a PyTorch custom op (torch.ops.mkernel.gemm) on a Hopper GPU.

Fresh random inputs each run. Accuracy rule (../shared/STYLE.md): against an fp64 reference,
max |mkernel - exact| <= 2 * max |torch.matmul (cuBLAS, bf16) - exact| + 1e-6. Also: leading
batch dimensions, both B layouts, torch.compile(fullgraph=True), CUDA-graph capture and replay,
torch.library.opcheck, and errors raised before any launch.
"""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
mkernel = pytest.importorskip("mkernel", reason="mkernel is not installed (pip install .)")


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    major, minor = torch.cuda.get_device_capability(0)
    if major < 9:
        return f"GPU 0 is sm_{major}{minor}; mkernel.gemm needs Hopper (sm_90)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _inputs(m, n, k, layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    shape = (n, k) if layout == "nk" else (k, n)
    b = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    return a, b


def _reference(a, b, layout):
    bd = b.double()
    return a.double() @ (bd.t() if layout == "nk" else bd)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (129, 264, 72), (1000, 1000, 1000),
                                   (3000, 5120, 3584), (4096, 4096, 4096)])
def test_matches_reference(shape, layout):
    m, n, k = shape
    a, b = _inputs(m, n, k, layout, seed=torch.seed() % (1 << 31))
    ours = mkernel.gemm(a, b, layout)
    theirs = a @ (b.t() if layout == "nk" else b)
    exact = _reference(a, b, layout)
    err = (ours.double() - exact).abs().max().item()
    err_torch = (theirs.double() - exact).abs().max().item()
    assert err <= 2 * err_torch + 1e-6, f"mkernel error {err}, torch error {err_torch}"


def test_leading_dimensions():
    a, b = _inputs(6 * 100, 256, 512, "nk", seed=3)
    a3 = a.view(2, 3, 100, 512)
    out = mkernel.gemm(a3, b)
    assert out.shape == (2, 3, 100, 256)
    torch.testing.assert_close(out.view(600, 256), mkernel.gemm(a, b), rtol=0, atol=0)


def test_eager_fast_path_and_dispatcher_agree():
    """The public function skips the dispatcher in plain eager mode (host time); torch.ops and
    everything that needs the dispatcher (fake tensors, profiler, autograd) still reach the op."""
    a, b = _inputs(300, 512, 256, "nk", seed=4)
    direct = mkernel.gemm(a, b)
    torch.testing.assert_close(direct, torch.ops.mkernel.gemm(a, b, "nk"), rtol=0, atol=0)
    assert mkernel._direct(a, b)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fa, fb = mode.from_tensor(a), mode.from_tensor(b)
        assert not mkernel._direct(fa, fb)
        out = mkernel.gemm(fa, fb)  # the fake implementation: shape only, nothing launched
        assert out.shape == (300, 512) and type(out).__name__ == "FakeTensor"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert not mkernel._direct(a, b)
        mkernel.gemm(a, b)
    assert any("mkernel::gemm" in e.name for e in prof.events()), "the profiler names the op"
    w = b.clone().requires_grad_()
    assert not mkernel._direct(a, w)
    with torch.no_grad():
        assert mkernel._direct(a, w)


def test_torch_compile_fullgraph():
    a, b = _inputs(512, 1024, 768, "nk", seed=5)

    def f(x, w):
        return torch.relu(mkernel.gemm(x, w)) + 1

    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(a, b), f(a, b), rtol=0, atol=0)


def test_cuda_graph_replays_with_new_inputs():
    a, b = _inputs(1024, 2048, 1024, "nk", seed=7)
    static_a, static_b = a.clone(), b.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mkernel.gemm(static_a, static_b)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = mkernel.gemm(static_a, static_b)
    for seed in range(3):
        new_a, new_b = _inputs(1024, 2048, 1024, "nk", seed=100 + seed)
        static_a.copy_(new_a)
        static_b.copy_(new_b)
        graph.replay()
        torch.testing.assert_close(static_out, mkernel.gemm(new_a, new_b), rtol=0, atol=0)


def test_opcheck():
    a, b = _inputs(256, 512, 384, "nk", seed=11)
    torch.library.opcheck(torch.ops.mkernel.gemm.default, (a, b, "nk"))


def test_errors_before_launch():
    a, b = _inputs(64, 64, 64, "nk", seed=13)
    with pytest.raises(ValueError, match="expected bfloat16"):
        mkernel.gemm(a.float(), b)
    with pytest.raises(ValueError, match="has K = 64 but b"):
        mkernel.gemm(a, b[:, :32])
    with pytest.raises(ValueError, match="b_layout"):
        mkernel.gemm(a, b, "xx")
    with pytest.raises(mkernel.MkernelError, match="multiple of 8"):
        mkernel.gemm(a[:, :60].contiguous(), b[:, :60].contiguous())


def test_empty_shapes_as_torch():
    """K = 0 is an empty sum: zeros, as torch.matmul gives (not an unwritten tensor); M = 0 or
    N = 0 an empty result."""
    for m, n, k in ((64, 32, 0), (0, 32, 64), (64, 0, 64), (0, 0, 0)):
        for layout in ("nk", "kn"):
            a = torch.randn(2, m, k, device="cuda").to(torch.bfloat16)
            b = torch.randn((n, k) if layout == "nk" else (k, n), device="cuda").to(torch.bfloat16)
            c = mkernel.gemm(a, b, layout)
            assert c.shape == (2, m, n)
            assert torch.equal(c, torch.zeros_like(c)) if k == 0 else c.numel() == 0


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_grouped_gemm_matches_per_group(layout):
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % (1 << 31))
    counts = [0, 1, 127, 128, 129, 300, 0, 45]
    n, k = 264, 136
    rows = sum(counts) + 17
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    shape = (len(counts), n, k) if layout == "nk" else (len(counts), k, n)
    b = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    group_rows = torch.tensor(counts, dtype=torch.int32, device="cuda")
    out = mkernel.grouped_gemm(a, b, group_rows, layout)
    assert out.shape == (rows, n)
    start = 0
    for i, m in enumerate(counts):
        if m == 0:
            continue
        a_g = a[start:start + m]
        exact = _reference(a_g, b[i], layout)
        err = (out[start:start + m].double() - exact).abs().max().item()
        theirs = a_g @ (b[i].t() if layout == "nk" else b[i])
        err_torch = (theirs.double() - exact).abs().max().item()
        assert err <= 2 * err_torch + 1e-6, f"group {i}: error {err}, torch {err_torch}"
        start += m


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_grouped_gemm_masked_layout(layout):
    """a [G, capacity, K]: group g's first count rows of its block (counts clamp to the
    capacity); the output's block rows past a count are not the op's to write."""
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % (1 << 31))
    counts = [0, 1, 64, 0, 200, 31, -3]
    capacity, n, k = 96, 264, 136
    a = torch.randn(len(counts), capacity, k, device="cuda", dtype=torch.bfloat16, generator=g)
    shape = (len(counts), n, k) if layout == "nk" else (len(counts), k, n)
    b = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    group_rows = torch.tensor(counts, dtype=torch.int32, device="cuda")
    out = mkernel.grouped_gemm(a, b, group_rows, layout)
    assert out.shape == (len(counts), capacity, n)
    for i, m in enumerate(counts):
        m = min(max(m, 0), capacity)
        if m == 0:
            continue
        exact = _reference(a[i, :m], b[i], layout)
        err = (out[i, :m].double() - exact).abs().max().item()
        theirs = a[i, :m] @ (b[i].t() if layout == "nk" else b[i])
        err_torch = (theirs.double() - exact).abs().max().item()
        assert err <= 2 * err_torch + 1e-6, f"group {i}: error {err}, torch {err_torch}"
    compiled = torch.compile(lambda x, w, r: mkernel.grouped_gemm(x, w, r, layout), fullgraph=True)
    assert compiled(a, b, group_rows).shape == out.shape


def test_grouped_gemm_compile_and_errors():
    a = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3, 128, 64, device="cuda", dtype=torch.bfloat16)
    group_rows = torch.tensor([100, 0, 200], dtype=torch.int32, device="cuda")
    compiled = torch.compile(lambda x, w, r: mkernel.grouped_gemm(x, w, r) + 1, fullgraph=True)
    want = mkernel.grouped_gemm(a, b, group_rows) + 1
    torch.testing.assert_close(compiled(a, b, group_rows), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="int32"):
        mkernel.grouped_gemm(a, b, group_rows.long())
    with pytest.raises(ValueError, match="groups, group_rows has 2"):
        mkernel.grouped_gemm(a, b, group_rows[:2])
