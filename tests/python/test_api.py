"""The Python API without a GPU: the extension, errors, dtypes, the store bootstrap and the
argument checks that run before anything reaches the GPU.

Needs the installed package (pip install --no-build-isolation .); the torch parts skip without
torch.
"""

import threading
import time

import pytest

try:
    import mkernel
    from mkernel import _C
except ImportError as e:  # not built / not on sys.path
    pytest.skip(f"mkernel is not importable ({e}); build and install it first: "
                "python3 -m pip install --no-build-isolation --no-deps .",
                allow_module_level=True)

try:
    import torch
    import torch.distributed as dist
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


# ---- extension, errors -----------------------------------------------------------------------

def test_import_exposes_the_api():
    for name in ("init", "Communicator", "MkernelError", "dtype_name", "DTYPES", "ERROR_CODES"):
        assert hasattr(mkernel, name), name
    assert mkernel.MkernelError is _C.MkernelError
    assert issubclass(mkernel.MkernelError, RuntimeError)
    assert mkernel.DTYPES == ("bf16", "f16", "f32")


def test_error_codes_are_the_cpp_enum():
    assert _C.ERROR_CODES == ("invalid_argument", "not_initialized", "out_of_memory",
                              "unsupported", "timeout", "bootstrap", "cuda", "system", "internal")


@pytest.mark.parametrize("code", _C.ERROR_CODES)
def test_cpp_error_becomes_mkernel_error_with_code(code):
    with pytest.raises(mkernel.MkernelError) as info:
        _C._raise_error(code, "rank 0 waited 2 s for rank 1")
    assert info.value.code == code
    assert "rank 0 waited 2 s for rank 1" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_mkernel_error_raised_from_python_has_no_code():
    assert mkernel.MkernelError("x").code is None


def test_dtype_names_and_sizes():
    assert [_C.dtype_size(d) for d in ("bf16", "f16", "f32")] == [2, 2, 4]
    with pytest.raises(ValueError, match="'bf16', 'f16', 'f32'"):
        _C.dtype_size("f64")


def test_create_rejects_a_callback_that_is_not_callable():
    with pytest.raises(TypeError):
        _C.Communicator.create(0, 2, b"not callable", 0)


# ---- the allgather callback (no GPU: the test hook runs one bootstrap allgather) -------------

def test_callback_allgather_returns_every_rank_in_order():
    seen = []

    def allgather(data, timeout):  # rank 1 of 2: rank 0 contributed b"AB"
        seen.append(data)
        return b"AB" + data

    assert _C._callback_allgather(1, 2, allgather, b"CD") == b"ABCD"
    assert seen == [b"CD"]


def test_callback_allgather_copies_the_result():
    assert _C._callback_allgather(0, 3, lambda d, t: d + b"BB" + b"CC", b"AA") == b"AABBCC"


def test_callback_exception_becomes_bootstrap_error():
    def allgather(data, timeout):
        raise KeyError("store went away")

    with pytest.raises(mkernel.MkernelError) as info:
        _C._callback_allgather(1, 2, allgather, b"abc")
    assert info.value.code == "bootstrap"
    assert "rank 1" in str(info.value) and "store went away" in str(info.value)


def test_callback_wrong_length_or_type_is_bootstrap_error():
    with pytest.raises(mkernel.MkernelError, match="returned 3 bytes; expected 4") as info:
        _C._callback_allgather(0, 2, lambda d, t: d + b"x", b"ab")
    assert info.value.code == "bootstrap"
    with pytest.raises(mkernel.MkernelError, match="expected bytes") as info:
        _C._callback_allgather(0, 2, lambda d, t: "text", b"ab")
    assert info.value.code == "bootstrap"


def test_callback_time_out_becomes_timeout_error_naming_the_ranks():
    seen = []

    def allgather(data, timeout):
        seen.append(timeout)
        raise TimeoutError("rank 0: store allgather gave up after 1.5 s; rank 1 did not arrive")

    with pytest.raises(mkernel.MkernelError) as info:
        _C._callback_allgather(0, 2, allgather, b"ab", 1.5)
    assert info.value.code == "timeout"
    assert "rank 1 did not arrive" in str(info.value)
    assert seen == [1.5]  # the limit reaches the callback


# ---- torch: dtypes, store bootstrap, validation ----------------------------------------------

@needs_torch
def test_torch_dtype_mapping():
    assert mkernel.dtype_name(torch.bfloat16) == "bf16"
    assert mkernel.dtype_name(torch.float16) == "f16"
    assert mkernel.dtype_name(torch.float32) == "f32"
    for bad in (torch.float64, torch.int32, torch.uint8):
        with pytest.raises(ValueError, match="torch.bfloat16, torch.float16 or torch.float32"):
            mkernel.dtype_name(bad)


def _run_ranks(world, fn):
    """fn(rank) on `world` threads; returns results by rank, re-raises the first error."""
    results, errors = [None] * world, []

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "store allgather hung"
    if errors:
        raise errors[0]
    return results


@needs_torch
@pytest.mark.parametrize("world", [1, 2, 3])
def test_store_allgather_over_hash_store_deletes_its_keys(world):
    store = dist.HashStore()
    gathers = [mkernel._StoreAllgather(store, "mkernel/test/0", r, world) for r in range(world)]

    def rounds(r):
        return [gathers[r](bytes([r]) * 5), gathers[r](b"%d" % (10 + r))]

    out = _run_ranks(world, rounds)
    want_0 = b"".join(bytes([r]) * 5 for r in range(world))
    want_1 = b"".join(b"%d" % (10 + r) for r in range(world))
    assert all(o == [want_0, want_1] for o in out)
    assert store.num_keys() == 0, "the last reader of each round deletes the round's keys"


@needs_torch
def test_store_allgather_over_file_store(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 2)  # may not support delete_key
    gathers = [mkernel._StoreAllgather(store, "mkernel/test/0", r, 2) for r in range(2)]
    out = _run_ranks(2, lambda r: [gathers[r](b"a%d" % r), gathers[r](b"b%d" % r)])
    assert out == [[b"a0a1", b"b0b1"]] * 2


@needs_torch
def test_store_allgather_names_the_ranks_that_do_not_arrive():
    store = dist.HashStore()
    world = 3
    gathers = [mkernel._StoreAllgather(store, "mkernel/test/late", r, world) for r in range(world)]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0: store allgather gave up after 0.5 s; "
                                           r"ranks \[1, 2\] did not arrive"):
        gathers[0](b"x", 0.5)
    assert time.monotonic() - start < 5


@needs_torch
def test_init_without_torch_distributed_says_so():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        mkernel.init()


class _FakeBuffer:
    def __init__(self, nbytes):
        self._bytes = torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    def dlpack_bytes(self):
        return torch.utils.dlpack.to_dlpack(self._bytes)


class _FakeImpl:
    """Stands in for _C.Communicator: the checks under test must not reach it."""

    rank, world_size, device = 0, 2, 0

    def __init__(self):
        self.allocs = []

    def alloc(self, nbytes):
        self.allocs.append(nbytes)
        return _FakeBuffer(nbytes)


@pytest.fixture
def comm():
    return mkernel.Communicator(_FakeImpl())


def test_communicator_ids_differ_by_world_size():
    # torch.compile bakes the id into its graphs and Inductor's on-disk cache keys on them: two
    # programs at different world sizes (different output shapes) must not share a cached graph.
    class _World4(_FakeImpl):
        world_size = 4

    a, b = mkernel.Communicator(_FakeImpl()), mkernel.Communicator(_World4())
    assert a._id % (1 << 24) == 2 and b._id % (1 << 24) == 4
    assert mkernel._communicator(b._id, "test") is b


@needs_torch
def test_alloc_tensor_views_the_buffer_with_shape_and_dtype(comm):
    t = comm.alloc_tensor((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert comm._impl.allocs == [30]
    assert comm.alloc_tensor(7, torch.float32).shape == (7,)
    empty = comm.alloc_tensor((0, 4), torch.float32)
    assert empty.shape == (0, 4) and comm._impl.allocs[-1] == 4  # never 0 bytes


def _meta(*shape, dtype=torch.bfloat16 if torch else None):
    return torch.empty(*shape, dtype=dtype, device="meta")


@needs_torch
def test_all_gather_checks_before_the_gpu(comm):
    with pytest.raises(TypeError, match="torch.Tensor"):
        comm.all_gather([1, 2], _meta(4))
    with pytest.raises(ValueError, match="input has dtype torch.float64"):
        comm.all_gather(_meta(2, dtype=torch.float64), _meta(4))
    with pytest.raises(ValueError, match="input has dtype torch.bfloat16 but output has torch.float32"):
        comm.all_gather(_meta(2), _meta(4, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"expected output.numel\(\) == world_size \* input.numel\(\)"):
        comm.all_gather(_meta(2), _meta(5))
    with pytest.raises(ValueError, match="output is not contiguous.*written in place"):
        comm.all_gather(_meta(2), _meta(4, 2)[:, 0])
    with pytest.raises(ValueError, match=r"input is on cpu; expected cuda:0"):
        comm.all_gather(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16))


@needs_torch
def test_reduce_scatter_checks_before_the_gpu(comm):
    with pytest.raises(ValueError, match=r"input.numel\(\) == world_size \* output.numel\(\)"):
        comm.reduce_scatter(_meta(6), _meta(2))
    with pytest.raises(ValueError, match="input is not contiguous.*contiguous\\(\\)"):
        comm.reduce_scatter(_meta(4, 2).t(), _meta(4))
    with pytest.raises(ValueError, match="input is on meta; expected cuda:0"):
        comm.reduce_scatter(_meta(4, dtype=torch.float16), _meta(2, dtype=torch.float16))


@needs_torch
def test_all_reduce_checks_before_the_gpu(comm):
    with pytest.raises(ValueError, match=r"output.numel\(\) == input.numel\(\)"):
        comm.all_reduce(_meta(4), _meta(3))
    with pytest.raises(ValueError, match="dtype torch.int32"):
        comm.all_reduce(_meta(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="input is on meta; expected cuda:0"):
        comm.all_reduce(_meta(4))  # in place: output defaults to input
