"""mkernel from torch.distributed on Hopper GPUs: ranks are processes (torch.multiprocessing,
spawn) that meet through a TCPStore on 127.0.0.1, rank r on GPU r % device_count (two ranks
share a GPU when only one exists).

Checks, with fresh random inputs every run (the seed is printed) and poisoned outputs:
  all_gather      bitwise against every rank's input, and against NCCL when each rank has a GPU
  reduce_scatter  against the fp64 sum: |ours - exact| <= ulp(exact) + 4 * 6e-8 * sum |x|
  all_reduce      (tests/gpu/gpu_test_util.h sum_close), max error <= 2 x NCCL's + 1e-6 when
                  NCCL runs, bitwise equal on every rank and from run to run
  subgroups, two communicators on one group, and a time-out naming the rank that never came.
"""

import contextlib
import datetime
import os
import time

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
mkernel = pytest.importorskip("mkernel", reason="mkernel is not installed (pip install .)")
import torch.distributed as dist  # noqa: E402
from spawn_ranks import spawn_ranks  # noqa: E402

WORLD = 2
JOB_TIMEOUT_S = 300  # per spawned job: a hang is a bug, reported as a failure, never waited out
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
COUNTS = [1, 4099, 1 << 20]  # one element, not a multiple of 8 or 16 bytes, 2-4 MiB
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "NCCL_NVLS_DISABLE": "1",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _skip_reason():
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    major, minor = torch.cuda.get_device_capability(0)
    if major < 9:
        return (f"GPU 0 ({torch.cuda.get_device_name(0)}) is sm_{major}{minor}; "
                "mkernel needs Hopper (sm_90)")
    return None


_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


# ---- spawning ---------------------------------------------------------------------------------

def _entry(rank, world, port, seed, body, kwargs):
    os.environ.update(MULTICAST_OFF)
    ndev = torch.cuda.device_count()
    torch.cuda.set_device(rank % ndev)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    use_nccl = dist.is_nccl_available() and ndev >= world  # NCCL needs a GPU per rank
    backend = "cpu:gloo,cuda:nccl" if use_nccl else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        body(rank, world, seed, use_nccl, **kwargs)
    finally:
        dist.destroy_process_group()


def _spawn(body, world=WORLD, **kwargs):
    """Runs body(rank, world, seed, use_nccl, **kwargs) in `world` processes; fails on any
    rank's exception or when the job outlives JOB_TIMEOUT_S."""
    spawn_ranks(_entry, body.__name__, world, JOB_TIMEOUT_S, extra=(body, kwargs),
                store_timeout_s=120, poll_s=5, note=f", {torch.cuda.device_count()} GPU(s)")


# ---- data and checks (run in the ranks) -------------------------------------------------------

def _inputs(seed, case, rank, shape, dtype):
    """Rank `rank`'s input of test case `case`: uniform in [-1, 1), on the CPU; any rank can
    rebuild any other rank's."""
    g = torch.Generator().manual_seed((seed * 7919 + case * 131 + rank) % (1 << 62))
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)


def _reduce_bar(plan, a_all, b_all, rows, exact, kn):
    """The error a reducing kernel's output may have against `exact`: twice its baseline's, plus a
    small atol. The baseline is cuBLAS on the K-concatenated operands (one rounding at the end)
    while the plan reduces in fp32; with "bf16 partials" in the plan line (two ranks: the one peer
    partial travels rounded to bf16) it is the sequential composition - each rank's cuBLAS
    partial in bf16, summed and rounded once as NCCL sums - and the atol one bf16 rounding of the
    largest value (2^-8 of it; at tiny shapes the baseline's max over few elements can be lucky)."""
    dev = exact.device
    if "bf16 partials" not in plan:
        a_cat = torch.cat(a_all, dim=1).to(dev)[rows]
        b_cat = torch.cat(b_all, dim=0 if kn else 1).to(dev)
        baseline = a_cat @ (b_cat if kn else b_cat.T)
        return 2 * (baseline.double() - exact).abs().max().item() + 1e-6, "cuBLAS"
    parts = [a.to(dev)[rows] @ (b.to(dev) if kn else b.to(dev).T) for a, b in zip(a_all, b_all)]
    baseline = torch.stack([p.float() for p in parts]).sum(0).to(torch.bfloat16)
    atol = exact.abs().max().item() / 256
    return 2 * (baseline.double() - exact).abs().max().item() + atol, "sequential (cuBLAS + NCCL)"


def _wrong_blocks(out, exact, bar, a_all, b_all, rows, layout):
    """Which 64 x 128 blocks of a reducing kernel's output are off, and whose partial each holds
    (for a failure message)."""
    dev = exact.device
    bad = (out.double() - exact).abs() > bar
    blocks = sorted({(r // 64, c // 128) for r, c in bad.nonzero().tolist()})
    parts = [(a.to(dev)[rows] @ (b.to(dev) if layout == "kn" else b.to(dev).T)).double()
             for a, b in zip(a_all, b_all)]
    notes = []
    for br, bc in blocks[:6]:
        block = (slice(64 * br, 64 * br + 64), slice(128 * bc, 128 * bc + 128))
        got = out.double()[block]
        near = [i for i, p in enumerate(parts) if (got - p[block]).abs().max().item() < 1]
        missing = [i for i in range(len(parts))
                   if (got - (exact[block] - parts[i][block])).abs().max().item() < 1]
        notes.append(f"({br},{bc}): equals partial of {near}, sum without {missing}")
    return f"{bad.sum().item()} wrong in {len(blocks)} blocks of 64x128: " + "; ".join(notes)


@contextlib.contextmanager
def _kernel_status_on_failure(comm):
    """A failed check inside gets what comm.synchronize() says appended: a kernel whose wait gave
    up writes wrong numbers and records which rank, peer and signal it waited for."""
    try:
        yield
    except AssertionError as e:
        try:
            comm.synchronize()
            said = "nothing"
        except Exception as err:  # any error: reported as text
            said = f"{type(err).__name__}: {err}"
        raise AssertionError(f"{e}\n(comm.synchronize() then raised {said})") from None


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_bitwise(got, want, what):
    got, want = _bits(got.cpu()), _bits(want.cpu())
    diff = (got != want).nonzero()
    assert diff.numel() == 0, (f"{what}: {diff.shape[0]} of {got.numel()} elements differ; "
                               f"first at {diff[0].tolist()}")


def _assert_sum_close(got, exact, abs_sum, dtype, what):
    """tests/gpu/gpu_test_util.h sum_close: fp32 accumulation then one rounding to the dtype is
    off from the exact sum by at most one ulp of the result plus the fp32 accumulation error."""
    mant = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    floor = 6.1e-5 if dtype == torch.float16 else 1.2e-38
    got = got.cpu().double()
    _, exp = torch.frexp(exact.abs().clamp_min(floor))  # |x| = m * 2**exp, m in [0.5, 1)
    tol = torch.pow(2.0, (exp - mant).double()) + 4 * 6e-8 * abs_sum + 1e-30
    bad = ~((got - exact).abs() <= tol)  # NaN (an unwritten element) is bad
    if bad.any():
        i = bad.nonzero()[0, 0].item()
        raise AssertionError(f"{what}: {int(bad.sum())} of {got.numel()} elements off; first "
                             f"[{i}]: got {got[i].item()!r}, exact {exact[i].item()!r}, "
                             f"tolerance {tol[i].item():.3g}")


def _assert_err_vs_nccl(ours, nccl, exact, what):
    """FlashAttention's rule: max |ours - exact| <= 2 * max |nccl - exact| + 1e-6."""
    err = (ours.cpu().double() - exact).abs().max().item()
    ref = (nccl.cpu().double() - exact).abs().max().item()
    assert err <= 2 * ref + 1e-6, f"{what}: max error {err:.3g}, NCCL's {ref:.3g}"


def _assert_same_on_all_ranks(t, what):
    mine = _bits(t.cpu()).flatten().to(torch.int64)  # gloo need not know int16
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)  # CPU tensors: through gloo
    for r, other in enumerate(everyone):
        assert torch.equal(other, mine), f"{what}: rank {r}'s result differs from this rank's"


def _nan(shape, dtype, comm=None):
    if comm is not None:
        return comm.alloc_tensor(shape, dtype).fill_(float("nan"))
    return torch.full(shape if isinstance(shape, tuple) else (shape,), float("nan"), dtype=dtype,
                      device="cuda")


# ---- bodies -----------------------------------------------------------------------------------

def _collectives(rank, world, seed, use_nccl):
    comm = mkernel.init(timeout_seconds=30)
    assert (comm.rank, comm.world_size) == (rank, world)
    assert comm.device == torch.cuda.current_device()
    assert (comm.num_nodes, comm.node, comm.local_size, comm.local_rank) == (1, 0, world, rank)
    case = 0
    for dtype in DTYPES:
        for count in COUNTS:
            tag = f"{mkernel.dtype_name(dtype)} count {count}"
            case += 1
            # all_gather: plain input -> symmetric output (world, count)
            x = _inputs(seed, case, rank, count, dtype).cuda()
            want = torch.stack([_inputs(seed, case, r, count, dtype) for r in range(world)])
            out = _nan((world, count), dtype, comm)
            assert comm.all_gather(x, out) is out
            comm.synchronize()
            _assert_bitwise(out, want, f"all_gather {tag}")
            if use_nccl:
                ref = _nan(world * count, dtype)
                dist.all_gather_into_tensor(ref, x)
                _assert_bitwise(out.flatten(), ref, f"all_gather {tag} vs NCCL")
            # all_gather in place: the input is this rank's slot of the output
            out2 = _nan((world, count), dtype, comm)
            out2[rank].copy_(x)
            comm.all_gather(out2[rank], out2)
            comm.synchronize()
            _assert_bitwise(out2, want, f"all_gather in place {tag}")

            # reduce_scatter: symmetric input (world, count) -> plain output (count)
            case += 1
            ins = [_inputs(seed, case, r, (world, count), dtype) for r in range(world)]
            exact = sum(a.double() for a in ins)[rank]
            abs_sum = sum(a.double().abs() for a in ins)[rank]
            inp = comm.alloc_tensor((world, count), dtype)
            inp.copy_(ins[rank])
            res = _nan(count, dtype)
            assert comm.reduce_scatter(inp, res) is res
            comm.synchronize()
            _assert_sum_close(res, exact, abs_sum, dtype, f"reduce_scatter {tag}")
            if use_nccl:
                ref = _nan(count, dtype)
                dist.reduce_scatter_tensor(ref, ins[rank].flatten().cuda())
                _assert_err_vs_nccl(res, ref, exact, f"reduce_scatter {tag}")

            # all_reduce: out of place twice (deterministic), then in place
            case += 1
            ins = [_inputs(seed, case, r, count, dtype) for r in range(world)]
            exact = sum(a.double() for a in ins)
            abs_sum = sum(a.double().abs() for a in ins)
            buf = comm.alloc_tensor(count, dtype)
            buf.copy_(ins[rank])
            outs = [_nan(count, dtype, comm) for _ in range(2)]
            for o in outs:
                assert comm.all_reduce(buf, o) is o
            assert comm.all_reduce(buf) is buf
            comm.synchronize()
            _assert_sum_close(outs[0], exact, abs_sum, dtype, f"all_reduce {tag}")
            _assert_bitwise(outs[1], outs[0], f"all_reduce {tag}: second run")
            _assert_bitwise(buf, outs[0], f"all_reduce {tag}: in place")
            _assert_same_on_all_ranks(outs[0], f"all_reduce {tag}")
            if use_nccl:
                ref = ins[rank].cuda()
                dist.all_reduce(ref)
                _assert_err_vs_nccl(outs[0], ref, exact, f"all_reduce {tag}")


def _subgroups(rank, world, seed, use_nccl):
    solo = dist.new_group([1], backend="gloo")  # every rank calls new_group, members use it
    pair = dist.new_group([0, 1], backend="gloo")
    dtype = torch.bfloat16
    if rank == 1:
        comm = mkernel.init(solo)  # global rank 1 is rank 0 of a world of one
        assert (comm.rank, comm.world_size) == (0, 1)
        x = _inputs(seed, 1, rank, 1000, dtype).cuda()
        out = _nan((1, 1000), dtype, comm)
        comm.all_gather(x, out)
        buf = comm.alloc_tensor(1000, dtype)
        buf.copy_(x)
        red = _nan(1000, dtype, comm)
        comm.all_reduce(buf, red)
        rs = _nan(1000, dtype)
        comm.reduce_scatter(buf.view(1, 1000), rs)
        comm.synchronize()
        for name, got in (("all_gather", out[0]), ("all_reduce", red), ("reduce_scatter", rs)):
            _assert_bitwise(got, x, f"world-1 {name}")
    else:
        with pytest.raises(ValueError, match="not a member"):
            mkernel.init(solo)
    # Two communicators on one group: their store keys must not collide.
    comms = [mkernel.init(pair), mkernel.init(pair)]
    ins = [_inputs(seed, 2, r, 5000, torch.float32) for r in range(world)]
    exact = sum(a.double() for a in ins)
    abs_sum = sum(a.double().abs() for a in ins)
    for i, comm in enumerate(comms):
        assert (comm.rank, comm.world_size) == (rank, world)
        buf = comm.alloc_tensor(5000, torch.float32)
        buf.copy_(ins[rank])
        comm.all_reduce(buf)
        comm.synchronize()
        _assert_sum_close(buf, exact, abs_sum, torch.float32, f"communicator {i} on the pair group")
    dist.barrier()


def _timeout(rank, world, seed, use_nccl):
    comm = mkernel.init(timeout_seconds=2)
    assert comm.timeout_seconds == 2
    x = comm.alloc_tensor(4096, torch.float32)
    x.fill_(rank + 1)
    comm.all_reduce(x)
    comm.synchronize()  # both ranks: the communicator works
    assert x[0].item() == sum(range(1, world + 1))
    dist.barrier()
    if rank == 0:  # rank 1 skips this all_reduce
        comm.all_reduce(x)
        start = time.monotonic()
        with pytest.raises(mkernel.MkernelError) as info:
            comm.synchronize()
        elapsed = time.monotonic() - start
        assert info.value.code == "timeout", str(info.value)
        assert "for rank 1" in str(info.value), str(info.value)
        assert elapsed < 2 + 30, f"the time-out came after {elapsed:.1f} s (limit 2 s)"
        with pytest.raises(mkernel.MkernelError) as again:  # broken for good
            comm.all_reduce(x)
        assert again.value.code == "not_initialized", str(again.value)
    dist.barrier()  # rank 1 stays until rank 0 has seen the time-out


HOST_LIMIT_S = 2.0  # the host-step tests' time limit: each ends well inside twice it


def _expect_host_timeout(info, step, start, case):
    text = str(info.value)
    assert info.value.code == "timeout", text
    assert step in text and "rank 0: " in text and "rank 1 did not arrive" in text, text
    elapsed = time.monotonic() - start
    assert elapsed < 2 * HOST_LIMIT_S, f"the time-out came after {elapsed:.1f} s ({text})"
    print(f"[host step] {case}: reported after {elapsed:.3f} s (limit {HOST_LIMIT_S} s)", flush=True)


def _host_step(rank, world, seed, use_nccl, step):
    """Rank 1 stays away from (or dies before) one host-side collective step; rank 0 must get
    MkernelError(code="timeout") naming the step and rank 1 within the limit, and exit cleanly."""
    if step in ("init", "init-killed"):
        if rank == 1:
            if step == "init-killed":
                os._exit(0)  # dies before creation
            time.sleep(1.3 * HOST_LIMIT_S)
            return
        start = time.monotonic()
        with pytest.raises(mkernel.MkernelError) as info:
            mkernel.init(timeout_seconds=HOST_LIMIT_S)
        _expect_host_timeout(info, "Communicator::create", start, step)
        return
    inter_node = step.startswith("inter-node")
    if inter_node:  # two virtual nodes of one rank: ag_gemm's first call sets up the path
        os.environ["MKERNEL_GPUS_PER_NODE"] = "1"
    comm = mkernel.init(timeout_seconds=HOST_LIMIT_S)
    a = torch.randn(256, 128, device="cuda").to(torch.bfloat16)
    b = torch.randn(256, 128, device="cuda").to(torch.bfloat16)
    if inter_node:  # both ranks grow the workspace, so that the setup is the step missed
        comm._workspace(mkernel._C.ag_gemm_workspace_bytes(256 * world, 128), "ag_gemm", "gather")
    dist.barrier()
    if rank == 1:
        if step.endswith("-killed"):
            os._exit(0)  # dies before the allocation (or the workspace growth)
        time.sleep(1.3 * HOST_LIMIT_S)
        return
    start = time.monotonic()
    with pytest.raises(mkernel.MkernelError) as info:
        if step in ("alloc", "alloc-killed"):
            comm.alloc_tensor((1024,), torch.bfloat16)
        elif inter_node:
            mkernel.ag_gemm(a, b, comm)
        else:  # the first gemm_rs grows the package's workspace (a symmetric allocation)
            mkernel.gemm_rs(a, b, comm)
    _expect_host_timeout(info, "setting up the inter-node path" if inter_node
                         else "symmetric allocation", start, step)
    with pytest.raises(mkernel.MkernelError) as again:  # broken for good
        comm.alloc_tensor((16,), torch.bfloat16)
    assert again.value.code == "not_initialized", str(again.value)


# ---- the input-check property test -------------------------------------------------------------
# Random calls of every op with the communicator: shapes (valid or not), dtypes, CPU tensors,
# non-contiguous views, outputs that should be symmetric and are not, overlapping in/out, configs
# out of range. The same cases on every rank (the case seed is shared; the data is each rank's),
# so the ranks decide alike. Each call either runs and matches torch, or raises before launch with
# a message that names the op and the argument - and then its poisoned output is still poisoned.

INPUT_CHECK_CASES = 150
_ARG_NAMES = ("input", "output", "a", "b", "a_shard", "out", "M ", "N ", "K", "M =", "N =",
              "block_n", "comm_ctas", "piece_rows", "channels", "b_layout", "dtype", "symmetric",
              "contiguous", "overlap", "world size", "expected")


def _refused(op, e):
    text = str(e)
    assert isinstance(e, (ValueError, TypeError, mkernel.MkernelError)), f"{op}: {e!r}"
    assert op in text, f"{op}: the message does not name the op: {text}"
    assert any(name in text for name in _ARG_NAMES), f"{op}: no argument named: {text}"


def _input_checks(rank, world, seed, use_nccl):
    import random as _random
    comm = mkernel.init(timeout_seconds=30)
    cases = _random.Random(seed)  # the same sequence on every rank
    counts = {}

    def data(shape, tag, r=rank, dtype=torch.bfloat16):
        g = torch.Generator(device="cuda").manual_seed((seed * 1009 + tag * 131 + r) % (1 << 62))
        return torch.rand(shape, device="cuda", generator=g).sub_(0.5).to(dtype)

    def variant(t):
        """The tensor as passed: usually itself, sometimes broken in one way."""
        kind = cases.choice(["ok"] * 6 + ["cpu", "f32", "noncontig", "int"])
        if kind == "cpu":
            return t.cpu(), kind
        if kind == "f32":
            return t.float(), kind
        if kind == "int":
            return t.to(torch.int32), kind
        if kind == "noncontig" and t.dim() == 2 and t.shape[1] >= 2:
            return torch.stack([t, t], -1)[..., 0], kind  # the same values, stride 2
        return t, "ok"

    def attempt(op, call, poisoned):
        """(True, call()) - or (False, None) when the call was refused as it should be: the
        message names the op and an argument, and `poisoned` (the output) was not written."""
        try:
            return True, call()
        except Exception as e:  # noqa: BLE001 - checked in _refused
            _refused(op, e)
            if poisoned is not None:
                assert torch.isnan(poisoned.float()).all(), f"{op}: written on rejection"
            return False, None

    for case in range(INPUT_CHECK_CASES):
        op = cases.choice(["all_gather", "reduce_scatter", "all_reduce", "ag_gemm", "gemm_rs",
                           "gemm_ar"])
        tag = 1000 + case
        outcome = "ran"
        try:
            if op in ("all_gather", "reduce_scatter", "all_reduce"):
                n = cases.choice([1, 7, 1000, 4099])
                symmetric_out = cases.random() < 0.8
                if op == "all_gather":
                    x, kind = variant(data((1, n), tag).view(1, n))
                    out = _nan((world, n), torch.bfloat16, comm if symmetric_out else None)
                    poisoned = out
                    call = lambda: comm.all_gather(x, out)  # noqa: E731
                elif op == "reduce_scatter":
                    x = comm.alloc_tensor((world, n), torch.bfloat16)
                    x.copy_(data((world, n), tag))
                    overlap = cases.random() < 0.15
                    out = x[rank] if overlap else _nan((n,), torch.bfloat16)
                    kind = "overlap" if overlap else "ok"
                    poisoned = None if overlap else out
                    call = lambda: comm.reduce_scatter(x, out)  # noqa: E731
                else:
                    x = comm.alloc_tensor((n,), torch.bfloat16) if symmetric_out else \
                        torch.empty(n, device="cuda", dtype=torch.bfloat16)
                    x.copy_(data((n,), tag))
                    out = _nan(n, torch.bfloat16, comm)
                    kind = "ok" if symmetric_out else "input not symmetric"
                    poisoned = out
                    call = lambda: comm.all_reduce(x, out)  # noqa: E731
                ran, _ = attempt(op, call, poisoned)
                if not ran:
                    outcome = "refused"
                    continue
                comm.synchronize()
                assert kind == "ok" and (symmetric_out or op == "reduce_scatter"), \
                    f"{op}: accepted a {kind} argument (symmetric output {symmetric_out})"
                if op == "all_gather":
                    want = torch.cat([data((1, n), tag, r) for r in range(world)])
                    assert torch.equal(out.view(torch.int16), want.view(torch.int16)), op
                elif op == "reduce_scatter":
                    exact = sum(data((world, n), tag, r).double() for r in range(world))[rank]
                    assert (out.double() - exact).abs().max().item() <= 4 * 2 ** -8 * world, op
                else:
                    exact = sum(data((n,), tag, r).double() for r in range(world))
                    assert (out.double() - exact).abs().max().item() <= 4 * 2 ** -8 * world, op
                continue
            # the GEMMs
            m = cases.choice([world, 2 * world, 128 * world, 300 * world, 7 * world + 1])
            n = cases.choice([8, 64, 256, 264, 12])
            k = cases.choice([8 * world, 64 * world, 512 * world, 20])
            layout = cases.choice(["nk"] * 4 + ["kn", "xy"])
            cfg = cases.choice([{}] * 4 + [{"block_n": 96}, {"block_n": 128}, {"block_n": -64}])
            kl = max(1, k // world)
            bshape = lambda kk: (n, kk) if layout != "kn" else (kk, n)  # noqa: E731
            if op == "ag_gemm":
                shard = max(1, m // world)
                a, kind_a = variant(data((shard, k), tag))
                b, kind_b = variant(data(bshape(k), tag + 1))
                extra = cases.choice([{}] * 4 + [{"comm_ctas": -1}, {"piece_rows": 16}])
                call = lambda: mkernel.ag_gemm(a, b, comm, b_layout=layout, **cfg, **extra)  # noqa
                poisoned = None
            elif op == "gemm_rs":
                a, kind_a = variant(data((m, kl), tag))
                b, kind_b = variant(data(bshape(kl), tag + 1))
                call = lambda: mkernel.gemm_rs(a, b, comm, b_layout=layout, **cfg)  # noqa
                poisoned = None
            else:
                a, kind_a = variant(data((m, kl), tag))
                b, kind_b = variant(data(bshape(kl), tag + 1))
                symmetric_out = cases.random() < 0.85
                out = _nan((m, n), torch.bfloat16, comm if symmetric_out else None)
                kind_a = kind_a if symmetric_out else "out not symmetric"
                call = lambda: mkernel.gemm_ar(a, b, comm, out, b_layout=layout, **cfg)  # noqa
                poisoned = out
            ran, result = attempt(op, call, poisoned)
            if not ran:
                outcome = "refused"
                continue
            comm.synchronize()
            valid_shape = (layout in ("nk", "kn") and n % 8 == 0 and cfg.get("block_n", 0) in (0, 128)
                           and (k % 8 == 0 if op == "ag_gemm" else kl % 8 == 0)
                           and (m % world == 0 if op == "gemm_rs" else True)
                           and (extra.get("comm_ctas", 0) >= 0 if op == "ag_gemm" else True))
            assert valid_shape and kind_a in ("ok", "noncontig") and kind_b in ("ok", "noncontig"), \
                f"{op}: ran with {m}x{n}x{k} {layout} {cfg}, a {kind_a}, b {kind_b}"
            if op == "ag_gemm":
                a_all = torch.cat([data((shard, k), tag, r) for r in range(world)]).float()
                bf = data(bshape(k), tag + 1).float()
                want = a_all @ (bf.T if layout == "nk" else bf)
                got = result
            else:
                want = sum(data((m, kl), tag, r).float() @ (
                    data(bshape(kl), tag + 1, r).float().T if layout == "nk"
                    else data(bshape(kl), tag + 1, r).float()) for r in range(world))
                if op == "gemm_rs":
                    want = want[rank * (m // world):(rank + 1) * (m // world)]
                    got = result
                else:
                    got = out
            err = (got.float() - want).abs().max().item()
            assert err <= 4 * 2 ** -8 * (want.abs().max().item() + 1e-3), f"{op}: error {err}"
        finally:
            counts[(op, outcome)] = counts.get((op, outcome), 0) + 1
    total = sum(counts.values())
    if rank == 0:
        print(f"input checks: {total} cases: " +
              ", ".join(f"{op} {o} {c}" for (op, o), c in sorted(counts.items())))
    comm.synchronize()
    dist.barrier()


# ---- soak --------------------------------------------------------------------------------------
# Two ranks issue SOAK_LAUNCHES launches of mixed ops with random shapes, every 100th checked
# against torch; afterwards (communicator gone, caches emptied) the GPU's free memory, this
# process's file descriptors and its memory mappings are back where they started, and nothing
# raised. Bounded in count and time (SOAK_LIMIT_S).

SOAK_LAUNCHES = int(os.environ.get("MKERNEL_SOAK_LAUNCHES", "10000"))
SOAK_LIMIT_S = 900


def _resources():
    """(free GPU memory, open fds, mappings) once every rank has released what it can."""
    import gc
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier()  # (the GPU's free memory counts every rank sharing it)
    free, _ = torch.cuda.mem_get_info()
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return free, len(os.listdir("/proc/self/fd")), maps


def _soak(rank, world, seed, use_nccl):
    import random as _random
    rng = _random.Random(seed)  # the same op sequence on every rank

    def data(shape, tag, r=rank):
        g = torch.Generator(device="cuda").manual_seed((seed * 7 + tag * 131 + r) % (1 << 62))
        return torch.rand(shape, device="cuda", generator=g).sub_(0.5).to(torch.bfloat16)

    # A short soak first (its own communicator): what is loaded or opened once per process - the
    # kernels' modules, cuBLAS, the driver's files, NCCL - belongs to the baseline.
    _soak_launches(rank, world, _random.Random(seed + 1), data, 200)
    before = _resources()
    counts, checked, elapsed = _soak_launches(rank, world, rng, data, SOAK_LAUNCHES)
    after = _resources()
    if rank == 0:
        print(f"soak: {SOAK_LAUNCHES} launches in {elapsed:.1f} s ({checked} checked): " +
              ", ".join(f"{op} {c}" for op, c in counts.items()) +
              f"; free GPU memory {before[0] >> 20} -> {after[0] >> 20} MiB, fds {before[1]} -> "
              f"{after[1]}, mappings {before[2]} -> {after[2]}")
    assert after[1] == before[1], f"file descriptors {before[1]} -> {after[1]}"
    assert after[2] <= before[2] + 2, f"memory mappings {before[2]} -> {after[2]}"
    assert after[0] >= before[0] - (8 << 20), \
        f"GPU memory not returned: free {before[0] >> 20} -> {after[0] >> 20} MiB"
    dist.barrier()


def _soak_launches(rank, world, rng, data, launches):
    """The launches (a function of their own: every tensor and the communicator die with it)."""
    comm = mkernel.init(timeout_seconds=60)
    ops = ["all_gather", "reduce_scatter", "all_reduce", "gemm", "grouped_gemm", "ag_gemm",
           "gemm_rs", "gemm_ar"]
    counts = dict.fromkeys(ops, 0)
    checked = 0
    bufs = {n: (comm.alloc_tensor((world, n), torch.bfloat16), comm.alloc_tensor(n, torch.bfloat16))
            for n in (256, 4096)}
    outs = {}
    start = time.monotonic()
    for i in range(launches):
        assert time.monotonic() - start < SOAK_LIMIT_S, f"soak: only {i} launches in time"
        op = rng.choice(ops)
        counts[op] += 1
        check = i % 100 == 0
        tag = i
        if op in ("all_gather", "reduce_scatter", "all_reduce"):
            n = rng.choice((256, 4096))
            big, small = bufs[n]
            if op == "all_gather":
                x = data((1, n), tag)
                comm.all_gather(x, big)
                if check:
                    want = torch.cat([data((1, n), tag, r) for r in range(world)])
                    assert torch.equal(big.view(torch.int16), want.view(torch.int16)), i
            elif op == "reduce_scatter":
                big.copy_(data((world, n), tag))
                out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
                comm.reduce_scatter(big, out)
                if check:
                    exact = sum(data((world, n), tag, r).double() for r in range(world))[rank]
                    assert (out.double() - exact).abs().max().item() <= 2 ** -6 * world, i
            else:
                small.copy_(data((n,), tag))
                comm.all_reduce(small)
                if check:
                    exact = sum(data((n,), tag, r).double() for r in range(world))
                    assert (small.double() - exact).abs().max().item() <= 2 ** -6 * world, i
        else:
            m = world * rng.choice((1, 8, 64, 128, 200))
            n = rng.choice((64, 256, 520))
            k = world * rng.choice((64, 256))
            kl = k // world
            if op == "gemm":
                a, b = data((m, k), tag), data((n, k), tag + 1)
                got, want = mkernel.gemm(a, b), (lambda: a.float() @ b.float().T)
            elif op == "grouped_gemm":
                groups = rng.choice((1, 4, 8))
                a, b = data((m, k), tag), data((groups, n, k), tag + 1)
                counts_g = torch.tensor([m // groups] * (groups - 1) + [m - m // groups * (groups - 1)],
                                        dtype=torch.int32, device="cuda")
                got = mkernel.grouped_gemm(a, b, counts_g)
                rows = counts_g.tolist() if check else None
                want = (lambda: torch.cat([a[sum(rows[:g]):sum(rows[:g + 1])].float() @ b[g].float().T
                                           for g in range(groups)]))
            elif op == "ag_gemm":
                a, b = data((m // world, k), tag), data((n, k), tag + 1)
                got = mkernel.ag_gemm(a, b, comm)
                want = (lambda: torch.cat([data((m // world, k), tag, r) for r in range(world)])
                        .float() @ b.float().T)
            else:
                a, b = data((m, kl), tag), data((n, kl), tag + 1)
                full = (lambda: sum(data((m, kl), tag, r).float() @ data((n, kl), tag + 1, r).float().T
                                    for r in range(world)))
                if op == "gemm_rs":
                    got = mkernel.gemm_rs(a, b, comm)
                    want = (lambda: full()[rank * (m // world):(rank + 1) * (m // world)])
                else:
                    if (m, n) not in outs:
                        outs[(m, n)] = comm.alloc_tensor((m, n), torch.bfloat16)
                    got = mkernel.gemm_ar(a, b, comm, outs[(m, n)])
                    want = full
            if check:
                w = want()
                err = (got.float() - w).abs().max().item()
                assert err <= 2 ** -6 * (w.abs().max().item() + 1e-3), f"soak {i} {op}: {err}"
        if check:
            checked += 1
            comm.synchronize()
    comm.synchronize()
    return counts, checked, time.monotonic() - start


# `bench/run.sh ag_gemm check`'s shapes (M, N, K): each a new largest, so each call grows the
# package's workspace (a new symmetric buffer, registered with the inter-node path across nodes).
BENCH_CHECK_SHAPES = [(512, 1024, 1024), (1024, 2048, 2048), (2048, 2048, 2048), (1024, 512, 2048),
                      (1024, 7168, 2048), (256, 2048, 2048)]


def _ag_gemm(rank, world, seed, use_nccl, gpus_per_node=0):
    """mkernel.ag_gemm: gathered A bitwise equal to the shards (and to NCCL's all_gather), C
    bitwise equal to the GEMM engine on the gathered A and within twice cuBLAS's error of the
    fp64 product; then torch.compile and a CUDA graph replayed with new inputs. gpus_per_node:
    virtual nodes of that many ranks (MKERNEL_GPUS_PER_NODE; shards of other nodes travel over
    the socket transport), with the benchmark's check shapes as well."""
    if gpus_per_node:
        os.environ["MKERNEL_GPUS_PER_NODE"] = str(gpus_per_node)
    comm = mkernel.init()
    if gpus_per_node:
        assert comm.num_nodes == world // gpus_per_node, comm
    dev = torch.device("cuda", comm.device)
    cases = [(200, 264, 136, "nk"), (1000, 1024, 512, "kn"), (1, 8, 8, "nk"),
             (517, 384, 4096, "nk")]
    if gpus_per_node:
        cases += [(m // world, n, k, "nk") for m, n, k in BENCH_CHECK_SHAPES]
    with _kernel_status_on_failure(comm):
        for case, (shard, n, k, layout) in enumerate(cases):
            what = f"ag_gemm case {case} (shard {shard}, N {n}, K {k}, {layout}), rank {rank}"
            shards = [_inputs(seed, case, r, (shard, k), torch.bfloat16) for r in range(world)]
            a_full = torch.cat(shards).to(dev)
            b_shape = (n, k) if layout == "nk" else (k, n)
            b = _inputs(seed, case, 1000 + rank, b_shape, torch.bfloat16).to(dev)
            c, gathered = mkernel.ag_gemm(shards[rank].to(dev), b, comm, b_layout=layout,
                                          return_gathered=True)
            assert c.shape == (shard * world, n) and gathered.shape == (shard * world, k)
            _assert_bitwise(gathered, a_full, what + ": gathered A")
            if use_nccl:
                nccl = torch.empty_like(a_full)
                dist.all_gather_into_tensor(nccl, shards[rank].to(dev))
                _assert_bitwise(gathered, nccl, what + ": gathered A vs NCCL")
            # The GEMM engine as ag_gemm computes: its tile width, K whole (a split of K sums in
            # another order: the plan splits M 1034 x N 384 x K 4096 in two since 2ba9e10).
            plain = torch.empty_like(c)
            width = int(mkernel._C.ag_gemm_plan(comm._impl, shard * world, n, k)
                        .split("tiles 128x")[1].split(",")[0])
            mkernel._C.gemm(a_full.data_ptr(), b.data_ptr(), plain.data_ptr(), shard * world, n,
                            k, layout, torch.cuda.current_stream(dev).cuda_stream, width, 1)
            _assert_bitwise(c, plain, what + ": C vs the GEMM engine")
            bt = b.T if layout == "nk" else b
            exact = a_full.double() @ bt.double()
            err = (c.double() - exact).abs().max().item()
            err_blas = ((a_full @ bt).double() - exact).abs().max().item()
            assert err <= 2 * err_blas + 1e-6, f"{what}: error {err}, cuBLAS {err_blas}"

    with pytest.raises(ValueError, match="bfloat16"):
        mkernel.ag_gemm(torch.zeros(8, 8, device=dev), torch.zeros(8, 8, device=dev), comm)
    with pytest.raises(mkernel.MkernelError, match="N = 12"):
        mkernel.ag_gemm(torch.zeros(8, 8, device=dev, dtype=torch.bfloat16),
                        torch.zeros(12, 8, device=dev, dtype=torch.bfloat16), comm)

    shard, n, k = 136, 256, 192
    b = _inputs(seed, 50, 1000 + rank, (n, k), torch.bfloat16).to(dev)
    compiled = torch.compile(lambda a, w: mkernel.ag_gemm(a, w, comm) * 2, fullgraph=True)
    for step in range(2):
        shards = [_inputs(seed, 60 + step, r, (shard, k), torch.bfloat16) for r in range(world)]
        want = mkernel.gemm(torch.cat(shards).to(dev), b) * 2
        _assert_bitwise(compiled(shards[rank].to(dev), b), want, f"torch.compile step {step}")

    a_static = _inputs(seed, 70, rank, (shard, k), torch.bfloat16).to(dev)
    mkernel.ag_gemm(a_static, b, comm)  # allocates the workspace before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c_static = mkernel.ag_gemm(a_static, b, comm)
    for replay in range(5):
        shards = [_inputs(seed, 80 + replay, r, (shard, k), torch.bfloat16) for r in range(world)]
        a_static.copy_(shards[rank])
        graph.replay()
        _assert_bitwise(c_static, mkernel.gemm(torch.cat(shards).to(dev), b),
                        f"CUDA graph replay {replay}")
    comm.synchronize()
    dist.barrier()


def _gemm_rs(rank, world, seed, use_nccl, gpus_per_node=0):
    """mkernel.gemm_rs against the fp64 sum of every rank's product (rows of this rank), within
    twice the error of cuBLAS on the K-concatenated operands; then a CUDA graph with new inputs.
    gpus_per_node: virtual nodes of that many ranks (node sums cross the socket transport)."""
    if gpus_per_node:
        os.environ["MKERNEL_GPUS_PER_NODE"] = str(gpus_per_node)
    comm = mkernel.init()
    if gpus_per_node:
        assert comm.num_nodes == world // gpus_per_node, comm
    dev = torch.device("cuda", comm.device)
    cases = [(200, 264, 136, "nk", False), (1000, 1024, 512, "kn", False), (1, 8, 8, "nk", False),
             (1000, 1024, 512, "kn", True), (1, 8, 8, "nk", True)]  # True: bf16 partials
    with _kernel_status_on_failure(comm):
        for case, (shard, n, kl, layout, bf16) in enumerate(cases):
            what = (f"gemm_rs case {case} (shard {shard}, N {n}, K_r {kl}, {layout}, bf16 partials "
                    f"{bf16}), rank {rank}")
            m = shard * world
            a_all = [_inputs(seed, 100 + case, r, (m, kl), torch.bfloat16) for r in range(world)]
            b_shape = (n, kl) if layout == "nk" else (kl, n)
            b_all = [_inputs(seed, 200 + case, r, b_shape, torch.bfloat16) for r in range(world)]
            out = mkernel.gemm_rs(a_all[rank].to(dev), b_all[rank].to(dev), comm, b_layout=layout,
                                  bf16_partials=bf16)
            assert out.shape == (shard, n)
            a_cat = torch.cat(a_all, dim=1).to(dev)
            b_cat = torch.cat(b_all, dim=1 if layout == "nk" else 0).to(dev)
            bt = b_cat.T if layout == "nk" else b_cat
            rows = slice(rank * shard, (rank + 1) * shard)
            exact = a_cat[rows].double() @ bt.double()
            err = (out.double() - exact).abs().max().item()
            plan = mkernel._C.gemm_rs_plan(comm._impl, m, n, kl, bf16_partials=bf16)
            bar, baseline = _reduce_bar(plan, a_all, b_all, rows, exact, layout == "kn")
            assert err <= bar, (f"{what}: error {err}, bar {bar} from {baseline} ({plan}); "
                                f"{_wrong_blocks(out, exact, bar, a_all, b_all, rows, layout)}")

    shard, n, kl = 136, 256, 64
    b = _inputs(seed, 300, rank, (n, kl), torch.bfloat16).to(dev)
    b_all_graph = [_inputs(seed, 300, r, (n, kl), torch.bfloat16) for r in range(world)]
    b_cat = torch.cat(b_all_graph, dim=1).to(dev)
    plan = mkernel._C.gemm_rs_plan(comm._impl, shard * world, n, kl)
    a_static = _inputs(seed, 301, rank, (shard * world, kl), torch.bfloat16).to(dev)
    mkernel.gemm_rs(a_static, b, comm)  # allocates the workspace before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = mkernel.gemm_rs(a_static, b, comm)
    for replay in range(5):
        a_all = [_inputs(seed, 400 + replay, r, (shard * world, kl), torch.bfloat16)
                 for r in range(world)]
        a_static.copy_(a_all[rank])
        graph.replay()
        rows = slice(rank * shard, (rank + 1) * shard)
        a_cat = torch.cat(a_all, dim=1).to(dev)[rows]
        exact = a_cat.double() @ b_cat.T.double()
        err = (out_static.double() - exact).abs().max().item()
        bar, baseline = _reduce_bar(plan, a_all, b_all_graph, rows, exact, False)
        assert err <= bar, f"graph replay {replay}: error {err}, bar {bar} from {baseline}"
    comm.synchronize()
    dist.barrier()


def _gemm_ar(rank, world, seed, use_nccl, gpus_per_node=0):
    """mkernel.gemm_ar: the whole sum on every rank, within twice cuBLAS's error of the fp64
    product of the K-concatenated operands, bitwise equal on all ranks; then a CUDA graph.
    gpus_per_node: virtual nodes of that many ranks (MKERNEL_GPUS_PER_NODE)."""
    if gpus_per_node:
        os.environ["MKERNEL_GPUS_PER_NODE"] = str(gpus_per_node)
    comm = mkernel.init()
    if gpus_per_node:
        assert comm.num_nodes == world // gpus_per_node, comm
    dev = torch.device("cuda", comm.device)
    cases = [(1, 8, 8, "nk", False), (7, 264, 136, "nk", False), (128, 1024, 512, "kn", False),
             (1000, 520, 256, "nk", False), (7, 264, 136, "nk", True), (1000, 520, 256, "nk", True)]
    with _kernel_status_on_failure(comm):
        for case, (m, n, kl, layout, bf16) in enumerate(cases):  # bf16: bf16 partials
            what = (f"gemm_ar case {case} (M {m}, N {n}, K_r {kl}, {layout}, bf16 partials {bf16}), "
                    f"rank {rank}")
            a_all = [_inputs(seed, 500 + case, r, (m, kl), torch.bfloat16) for r in range(world)]
            b_shape = (n, kl) if layout == "nk" else (kl, n)
            b_all = [_inputs(seed, 600 + case, r, b_shape, torch.bfloat16) for r in range(world)]
            out = comm.alloc_tensor((m, n), torch.bfloat16)
            out.fill_(float("nan"))
            mkernel.gemm_ar(a_all[rank].to(dev), b_all[rank].to(dev), comm, out, b_layout=layout,
                            bf16_partials=bf16)
            a_cat = torch.cat(a_all, dim=1).to(dev)
            b_cat = torch.cat(b_all, dim=1 if layout == "nk" else 0).to(dev)
            bt = b_cat.T if layout == "nk" else b_cat
            exact = a_cat.double() @ bt.double()
            err = (out.double() - exact).abs().max().item()
            plan = mkernel._C.gemm_ar_plan(comm._impl, m, n, kl, bf16_partials=bf16)
            bar, baseline = _reduce_bar(plan, a_all, b_all, slice(0, m), exact, layout == "kn")
            assert err <= bar, f"{what}: error {err}, bar {bar} from {baseline} ({plan})"
            _assert_same_on_all_ranks(out, what)

    m, n, kl = 200, 256, 64
    b = _inputs(seed, 700, rank, (n, kl), torch.bfloat16).to(dev)
    b_all_graph = [_inputs(seed, 700, r, (n, kl), torch.bfloat16) for r in range(world)]
    b_cat = torch.cat(b_all_graph, dim=1).to(dev)
    plan = mkernel._C.gemm_ar_plan(comm._impl, m, n, kl)
    a_static = _inputs(seed, 701, rank, (m, kl), torch.bfloat16).to(dev)
    out = comm.alloc_tensor((m, n), torch.bfloat16)
    mkernel.gemm_ar(a_static, b, comm, out)  # allocates the workspace before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mkernel.gemm_ar(a_static, b, comm, out)
    for replay in range(5):
        a_all = [_inputs(seed, 800 + replay, r, (m, kl), torch.bfloat16) for r in range(world)]
        a_static.copy_(a_all[rank])
        graph.replay()
        a_cat = torch.cat(a_all, dim=1).to(dev)
        exact = a_cat.double() @ b_cat.T.double()
        err = (out.double() - exact).abs().max().item()
        bar, baseline = _reduce_bar(plan, a_all, b_all_graph, slice(0, m), exact, False)
        assert err <= bar, f"graph replay {replay}: error {err}, bar {bar} from {baseline}"
        _assert_same_on_all_ranks(out, f"graph replay {replay}")
    comm.synchronize()
    dist.barrier()


# ---- tests ------------------------------------------------------------------------------------

def test_gemm_ar_matches_references():
    _spawn(_gemm_ar)


@pytest.mark.parametrize("nodes,per_node", [(2, 1), (2, 2)])
def test_gemm_ar_across_virtual_nodes(nodes, per_node):
    _spawn(_gemm_ar, world=nodes * per_node, gpus_per_node=per_node)


def test_gemm_rs_matches_references():
    _spawn(_gemm_rs)


@pytest.mark.parametrize("nodes,per_node", [(2, 1), (2, 2)])
def test_gemm_rs_across_virtual_nodes(nodes, per_node):
    _spawn(_gemm_rs, world=nodes * per_node, gpus_per_node=per_node)


def test_ag_gemm_matches_references():
    _spawn(_ag_gemm)


@pytest.mark.parametrize("nodes,per_node", [(2, 1), (2, 2)])
def test_ag_gemm_across_virtual_nodes(nodes, per_node):
    _spawn(_ag_gemm, world=nodes * per_node, gpus_per_node=per_node)


def test_random_arguments_run_correctly_or_are_refused_before_launch():
    _spawn(_input_checks)


def test_soak_mixed_launches_leave_nothing_behind():
    _spawn(_soak)


def test_collectives_match_references():
    _spawn(_collectives)


def test_subgroups_and_repeated_init():
    _spawn(_subgroups)


def test_timeout_names_the_missing_rank():
    _spawn(_timeout)


@pytest.mark.parametrize(
    "step", ["init", "init-killed", "alloc", "alloc-killed", "workspace", "workspace-killed",
             "inter-node", "inter-node-killed"]
)
def test_host_step_gives_up_within_the_limit_naming_the_missing_rank(step):
    _spawn(_host_step, step=step)
