"""mkernel: fused multi-GPU kernels for NVIDIA Hopper, from PyTorch.

A communicator is built on torch.distributed (any backend: mkernel only borrows its c10d store to
exchange a few hundred bytes at creation and at each symmetric allocation) and runs its own
NVLink kernels, without NCCL::

    import torch, torch.distributed as dist, mkernel
    dist.init_process_group("nccl")            # torchrun; "gloo" is enough for mkernel
    torch.cuda.set_device(local_rank)
    comm = mkernel.init()                      # collective over the default group
    out = comm.alloc_tensor((comm.world_size, n), torch.bfloat16)   # symmetric memory
    comm.all_gather(x, out)                    # x: (n,) bf16 on this GPU
    comm.synchronize()                         # optional: wait, and surface time-outs

Stream semantics: every op is enqueued on the current CUDA stream (torch.cuda.current_stream())
and returns without synchronising the host; ops of one communicator must be issued in the same
order on every rank. A peer that never arrives makes the kernel give up after timeout_seconds
and record who waited for whom: call comm.synchronize(), or torch.cuda.synchronize() then
comm.check(), to raise it as MkernelError(code="timeout").

Any world size. The fused GEMMs (ag_gemm, gemm_rs, gemm_ar) and the MoE ops also run across nodes, over the
communicator's inter-node path (socket, ConnectX-7 or EFA transport; MKERNEL_GPUS_PER_NODE makes
virtual nodes on one host); the standalone collectives need every rank on one node (NVLink or
PCIe P2P).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from typing import Optional, Sequence, Union

from mkernel import _C
from mkernel._C import DTYPES, ERROR_CODES, MkernelError

try:  # `import mkernel` works without torch (the C++ layer needs none); the API below needs it
    import torch
except ImportError:  # pragma: no cover - exercised on machines without torch
    torch = None

__all__ = ["Communicator", "MkernelError", "init", "gemm", "grouped_gemm", "ag_gemm", "gemm_rs",
           "gemm_ar", "moe_dispatch", "moe_dispatch_gemm", "moe_combine", "MoeHandle",
           "moe_layer", "moe_weights_from_hf",
           "attention", "ring_attention", "zigzag_shard", "zigzag_unshard", "dtype_name", "DTYPES",
           "ERROR_CODES"]
__version__ = "0.1.0"


def _require_torch(what: str):
    if torch is None:
        raise ImportError(f"mkernel.{what} needs PyTorch, which is not installed")
    return torch


def dtype_name(dtype) -> str:
    """The mkernel name of a torch dtype: bfloat16 -> 'bf16', float16 -> 'f16', float32 -> 'f32'.

    Raises ValueError for any other dtype.
    """
    t = _require_torch("dtype_name")
    names = {t.bfloat16: "bf16", t.float16: "f16", t.float32: "f32"}
    if dtype not in names:
        raise ValueError(
            f"dtype {dtype} is not supported; expected torch.bfloat16, torch.float16 or torch.float32")
    return names[dtype]


# ---- bootstrap over a c10d store ---------------------------------------------------------------

class _StoreAllgather:
    """allgather(bytes, timeout) -> bytes over a c10d Store, for the C++ bootstrap.

    Round n: every rank sets `{prefix}/{n}/{rank}`, waits at most `timeout` seconds for all ranks'
    keys (0: the store's own timeout) - past it, TimeoutError naming the ranks whose keys are
    missing, which the C++ layer raises as MkernelError(code="timeout") naming the step - reads
    them, then adds 1 to `{prefix}/{n}/done`; the rank that brings it to world_size has seen
    everyone done reading and deletes the round's keys.
    Stores without delete_key (FileStore) keep them: a few hundred bytes per communicator and per
    symmetric allocation. Rounds happen at creation and at every alloc, in the same order on
    every rank (the ops' contract), so `n` agrees across ranks.
    """

    def __init__(self, store, prefix: str, rank: int, world_size: int):
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._world = world_size
        self._rounds = itertools.count()
        self._can_delete = True

    def __call__(self, data: bytes, timeout: float = 0.0) -> bytes:
        base = f"{self._prefix}/{next(self._rounds)}"
        keys = [f"{base}/{r}" for r in range(self._world)]
        self._store.set(keys[self._rank], data)
        if timeout > 0:
            self._wait(keys, timeout)
        parts = [self._store.get(k) for k in keys]
        if self._store.add(f"{base}/done", 1) == self._world:
            self._delete(keys + [f"{base}/done"])
        return b"".join(parts)

    def _wait(self, keys, timeout: float):
        import datetime
        try:
            self._store.wait(keys, datetime.timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - c10d raises its own error types on a time-out
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            if not missing:
                raise
            who = (f"rank {missing[0]}" if len(missing) == 1
                   else "ranks [" + ", ".join(map(str, missing)) + "]")
            raise TimeoutError(f"rank {self._rank}: store allgather gave up after {timeout:g} s; "
                               f"{who} did not arrive") from None

    def _delete(self, keys):
        if not self._can_delete:
            return
        try:
            for k in keys:
                self._store.delete_key(k)
        except (RuntimeError, NotImplementedError):  # FileStore: "only implemented for TCPStore"
            self._can_delete = False


_init_lock = threading.Lock()
_comm_ids = itertools.count(1)
_WORLD_BITS = 24  # a communicator's id: serial number << _WORLD_BITS | world size
_comms: dict = {}  # id -> weakref to Communicator (the fused custom ops name communicators by id)


def _communicator(comm_id: int, op: str) -> "Communicator":
    ref = _comms.get(comm_id)
    comm = ref() if ref is not None else None
    if comm is None:
        raise ValueError(f"mkernel.{op}: communicator {comm_id} does not exist (any more)")
    return comm
_init_counts: dict = {}  # group name -> communicators created on it by this process


def _group_name(dist, group) -> str:
    pg = group if group is not None else dist.group.WORLD
    name = getattr(pg, "group_name", None)
    if not name:
        name = dist.distributed_c10d._get_process_group_name(pg)
    return str(name)


def _device_index(t, device) -> int:
    if device is None:
        return t.cuda.current_device()
    if isinstance(device, int):
        return device
    d = t.device(device)
    if d.type != "cuda":
        raise ValueError(f"mkernel.init: device {device!r} is not a CUDA device")
    return d.index if d.index is not None else t.cuda.current_device()


def init(group=None, *, store=None, device=None, timeout_seconds: Optional[float] = None,
         ranks_per_node: Optional[int] = None) -> "Communicator":
    """Create a communicator over a torch.distributed group (collective over its ranks).

    group: a ProcessGroup (e.g. from dist.new_group; a tensor-parallel group smaller than the
        world works) or None for the default group. Rank and size are the group's
        (dist.get_rank(group), dist.get_world_size(group)); only its members call init().
    store: the c10d Store to exchange through; default: the default group's store (the one
        torchrun / init_process_group set up, reachable from every node).
    device: this rank's GPU (int, 'cuda:N' or torch.device); default torch.cuda.current_device().
    timeout_seconds: limit of every wait on a peer inside a kernel; None: MKERNEL_TIMEOUT_S or
        60 s; 0: wait forever.
    ranks_per_node: split the ranks into virtual nodes of this many; None:
        MKERNEL_GPUS_PER_NODE or by host.

    Every member must call init() for a group the same number of times, in the same order
    (keys in the store are namespaced by group name and by that sequence number).
    Raises MkernelError (code 'bootstrap', 'unsupported', ...) if creation fails on any rank.
    """
    t = _require_torch("init")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "mkernel.init: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first (any backend, e.g. 'gloo')")
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    if rank < 0:
        raise ValueError(
            f"mkernel.init: this process (global rank {dist.get_rank()}) is not a member of the "
            "group; only the group's members call init()")
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    name = _group_name(dist, group)
    with _init_lock:
        seq = _init_counts.get(name, 0)
        _init_counts[name] = seq + 1
    allgather = _StoreAllgather(store, f"mkernel/{name}/{seq}", rank, world_size)
    impl = _C.Communicator.create(
        rank, world_size, allgather, _device_index(t, device),
        -1.0 if timeout_seconds is None else float(timeout_seconds),
        -1 if ranks_per_node is None else int(ranks_per_node))
    return Communicator(impl, group=group)


# ---- validation (host only: runs before anything touches a GPU) --------------------------------

def _check_tensor(op: str, name: str, x, written: bool) -> str:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    try:
        dtype = dtype_name(x.dtype)
    except ValueError:
        raise ValueError(f"{op}: {name} has dtype {x.dtype}; expected torch.bfloat16, "
                         "torch.float16 or torch.float32") from None
    if not x.is_contiguous():
        hint = ("it is written in place, so pass a contiguous tensor" if written
                else "call .contiguous() first")
        raise ValueError(f"{op}: {name} is not contiguous (shape {tuple(x.shape)}, stride "
                         f"{tuple(x.stride())}); {hint}")
    return dtype


def _check_same_dtype(op: str, input, output):
    if input.dtype != output.dtype:
        raise ValueError(f"{op}: input has dtype {input.dtype} but output has {output.dtype}; "
                         "expected the same dtype")


def _check_device(op: str, name: str, x, device: int):
    if x.get_device() != device:  # (-1 off the GPU; one call, where x.device builds an object)
        raise ValueError(f"{op}: {name} is on {x.device}; expected cuda:{device} "
                         "(the communicator's GPU)")


def _current_raw_stream(device: int) -> int:
    """torch.cuda.current_stream(device).cuda_stream, without building a Stream object (PyTorch's
    own launchers read it this way); the public call where this torch lacks the private one."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


_SAME_DEVICE = contextlib.nullcontext()


def _current_device(device: int):
    """torch.cuda.device(device), or nothing to switch when it is current already (the common
    case: a context switch costs the host microseconds per op)."""
    return _SAME_DEVICE if torch.cuda.current_device() == device else torch.cuda.device(device)


def _validate(op: str, world: int, device: int, input, output, in_factor: int, out_factor: int):
    """Common checks; in_factor * input.numel() == out_factor * output.numel() must hold."""
    dtype = _check_tensor(op, "input", input, written=False)
    _check_tensor(op, "output", output, written=True)
    _check_same_dtype(op, input, output)
    if input.numel() * in_factor != output.numel() * out_factor:
        rule = {
            "all_gather": f"output.numel() == world_size * input.numel() ({world} x "
                          f"{input.numel()} = {world * input.numel()})",
            "reduce_scatter": f"input.numel() == world_size * output.numel() ({world} x "
                              f"{output.numel()} = {world * output.numel()})",
            "all_reduce": "output.numel() == input.numel()",
        }[op]
        raise ValueError(f"{op}: input has {input.numel()} elements and output "
                         f"{output.numel()}; expected {rule}")
    _check_device(op, "input", input, device)
    _check_device(op, "output", output, device)
    return dtype


# ---- communicator ----------------------------------------------------------------------------

Shape = Union[int, Sequence[int]]


class Communicator:
    """A communicator over the ranks of a torch.distributed group (create it with mkernel.init).

    Collectives take torch tensors on this rank's GPU (bf16, f16 or f32, contiguous), run on the
    current CUDA stream, never synchronise the host, and must be issued in the same order on every
    rank. Ops of one communicator on two streams must be ordered by the caller (they share its
    signals and cached workspaces): use a communicator per stream to overlap them. Tensors that must be symmetric (allocated with alloc_tensor on every rank) are named in
    each method. Errors in the arguments raise ValueError/TypeError here, or MkernelError from the
    C++ checks, before anything is launched.
    """

    def __init__(self, impl, group=None):
        self._impl = impl  # mkernel._C.Communicator
        self._device = impl.device  # (read on every op: a plain attribute is the cheapest)
        self.group = group
        # Fused ops are torch custom ops: they name their communicator by this number. It holds
        # the world size because the ops' output shapes depend on it and torch.compile bakes the
        # number into its graphs: Inductor's on-disk cache keys on the graph, so a program run at
        # another world size must not hit a graph compiled for this one (it did: ag_gemm compiled
        # at 2 ranks, replayed at 4 from the cache, asserted the wrong output size).
        with _init_lock:
            self._id = (next(_comm_ids) << _WORLD_BITS) | impl.world_size
            _comms[self._id] = weakref.ref(self)
        # Fused ops' symmetric workspaces by kind ("gather": scratch; "accumulate": kept zero
        # between calls; "moe": zeroed once, its flags compared with launch numbers), each a
        # list whose last tensor is the largest.
        self._workspaces = {}

    def _workspace(self, nbytes: int, op: str, kind: str) -> "torch.Tensor":
        """A fused op's symmetric workspace of `kind`, at least `nbytes` (grown on demand).

        The first call of a fused op with a larger shape allocates (every rank does, at the same
        call; "accumulate" workspaces are zeroed on the current stream); earlier workspaces stay
        alive with the communicator, since kernels already enqueued may still use them.
        Allocation cannot happen while a CUDA graph is being captured.
        """
        pool = self._workspaces.setdefault(kind, [])
        if pool and pool[-1].numel() >= nbytes:
            return pool[-1]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"mkernel.{op}: its workspace ({nbytes} bytes) is not allocated yet and cannot be "
                "while a CUDA graph is captured; run the op once with this shape (or a larger "
                "one) before capturing")
        ws = self.alloc_tensor(max(nbytes, 16), torch.uint8)
        if kind in ("accumulate", "moe"):
            ws.zero_()
        pool.append(ws)
        return ws

    # topology
    @property
    def rank(self) -> int:
        return self._impl.rank

    @property
    def world_size(self) -> int:
        return self._impl.world_size

    @property
    def local_rank(self) -> int:
        return self._impl.local_rank

    @property
    def local_size(self) -> int:
        return self._impl.local_size

    @property
    def node(self) -> int:
        return self._impl.node

    @property
    def num_nodes(self) -> int:
        return self._impl.num_nodes

    @property
    def device(self) -> int:
        """CUDA device ordinal of this rank."""
        return self._device

    @property
    def timeout_seconds(self) -> float:
        return self._impl.timeout_seconds

    def __repr__(self) -> str:
        return (f"mkernel.Communicator(rank={self.rank}, world_size={self.world_size}, "
                f"device=cuda:{self.device}, timeout_seconds={self.timeout_seconds})")

    # memory
    def alloc_tensor(self, shape: Shape, dtype) -> "torch.Tensor":
        """Collective: a new tensor of `shape` and `dtype` in symmetric memory.

        Every rank must call it with the same shape and dtype. The tensor (and views of it) can
        be the symmetric argument of any op; its contents are uninitialised. The memory is
        released when the last tensor viewing it is freed: keep it alive until the kernels that
        use it have finished (as with any tensor used on a side stream).
        """
        t = _require_torch("Communicator.alloc_tensor")
        size = t.Size([shape] if isinstance(shape, int) else shape)
        numel = math.prod(size)
        itemsize = t.empty((), dtype=dtype).element_size()
        # One allocation even for zero elements: the C++ layer refuses 0 bytes.
        buffer = self._impl.alloc(max(numel, 1) * itemsize)
        # DLPack: the C++ side exports the buffer's bytes as a uint8 capsule whose owner is the
        # buffer object; torch takes the capsule and calls its deleter when the storage dies, so
        # the tensor, and every view of it, keeps the symmetric memory mapped. (A storage made from
        # a raw pointer would need a separate keep-alive; DLPack is the supported way.)
        raw = t.from_dlpack(buffer.dlpack_bytes())
        return raw.view(dtype)[:numel].view(size)

    # collectives
    def _stream(self) -> int:
        """The current CUDA stream of this rank's GPU, as the raw handle the C++ layer takes."""
        return _current_raw_stream(self._device)

    def all_gather(self, input: "torch.Tensor", output: "torch.Tensor", *,
                   channels: int = 0) -> "torch.Tensor":
        """output = concatenation of every rank's input, in rank order.

        input:  any shape, n elements, on this GPU (any memory; may be this rank's slot of
                output, i.e. output.view(world_size, n)[rank]).
        output: world_size * n elements, same dtype, symmetric (from alloc_tensor); e.g. shape
                (world_size, *input.shape). Bitwise copy.
        channels: CTAs per rank, 0 = heuristic. Returns output.
        """
        _require_torch("Communicator.all_gather")
        dtype = _validate("all_gather", self.world_size, self.device, input, output,
                          self.world_size, 1)
        _C.all_gather(self._impl, input.data_ptr(), output.data_ptr(), input.numel(), dtype,
                      self._stream(), channels)
        return output

    def reduce_scatter(self, input: "torch.Tensor", output: "torch.Tensor", *,
                       channels: int = 0) -> "torch.Tensor":
        """output = sum over ranks of their input's slice [rank * n, (rank + 1) * n).

        input:  world_size * n elements in a symmetric tensor (alloc_tensor): peers read it.
        output: n elements, same dtype, any memory of this GPU, not overlapping input.
        Sums in fp32 in rank order, then rounds once to the dtype. Returns output.
        """
        _require_torch("Communicator.reduce_scatter")
        dtype = _validate("reduce_scatter", self.world_size, self.device, input, output, 1,
                          self.world_size)
        _C.reduce_scatter(self._impl, input.data_ptr(), output.data_ptr(), output.numel(),
                          dtype, self._stream(), channels)
        return output

    def all_reduce(self, input: "torch.Tensor", output: Optional["torch.Tensor"] = None, *,
                   channels: int = 0) -> "torch.Tensor":
        """output = sum over ranks of input, bitwise identical on every rank.

        input, output: n elements each, same dtype, both symmetric (alloc_tensor); output=None
        (or output is input) reduces in place. Sums in fp32 in rank order. Returns output.
        """
        _require_torch("Communicator.all_reduce")
        if output is None:
            output = input
        dtype = _validate("all_reduce", self.world_size, self.device, input, output, 1, 1)
        _C.all_reduce(self._impl, input.data_ptr(), output.data_ptr(), input.numel(), dtype,
                      self._stream(), channels)
        return output

    # errors
    def check(self) -> None:
        """Non-blocking: raise MkernelError if a kernel recorded an error (code 'timeout', naming
        the rank that waited, the rank it waited for and the signal). Afterwards the communicator
        refuses new work (code 'not_initialized'): create a new one."""
        self._impl.check()

    def synchronize(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Wait for `stream` (default: the current stream), then check()."""
        _require_torch("Communicator.synchronize")
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        self._impl.synchronize(s.cuda_stream)


# ---- GEMM engine as a PyTorch custom op --------------------------------------------------------

def _gemm_shapes(a, b, b_layout: str, op: str = "gemm"):
    """(M, N, K) of a [..., K] @ op(b), or ValueError naming the op and the problem."""
    if b_layout not in ("nk", "kn"):
        raise ValueError(f"mkernel.{op}: b_layout={b_layout!r}; expected 'nk' (b is [N, K], the "
                         "nn.Linear weight) or 'kn' (b is [K, N])")
    if a.dim() < 1 or b.dim() != 2:
        raise ValueError(f"mkernel.{op}: a must be [..., K] and b 2-D; got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    k = a.shape[-1]
    n, kb = (b.shape[0], b.shape[1]) if b_layout == "nk" else (b.shape[1], b.shape[0])
    if kb != k:
        raise ValueError(f"mkernel.{op}: a has K = {k} but b ({b_layout}) has K = {kb}")
    return math.prod(a.shape[:-1]), n, k


if torch is not None:
    def _make_direct():
        """The public functions' eager fast path: whether a call may run the op's implementation
        directly instead of through the dispatcher (torch.ops.mkernel.*), whose Python custom-op
        layer costs the host tens of microseconds per call - as long as a decode-sized op runs
        on the GPU (bench/bench_host.py measures both). Direct only in plain eager mode: not while
        torch.compile traces, with no TorchDispatchMode or TorchFunctionMode active (fake tensors,
        FlopCounterMode, torch.device(...) as a context), not while the profiler records (its
        traces name the op) and with plain CUDA tensors that need no gradient; anything else
        goes through torch.ops.mkernel.*, which does the same work (meta tensors: the op's fake
        implementation, so shapes propagate as through torch.ops.mkernel.*)."""
        try:
            compiling = torch.compiler.is_compiling
            dispatch_modes = torch._C._len_torch_dispatch_stack
            function_modes = torch._C._len_torch_function_stack
            profiler = torch.autograd.profiler
            profiler._is_profiler_enabled  # noqa: B018 - present in this torch?
        except AttributeError:  # pragma: no cover - a torch without these: always dispatch
            return lambda *tensors: False
        plain = torch.Tensor

        def direct(*tensors) -> bool:
            if (compiling() or dispatch_modes() or function_modes()
                    or profiler._is_profiler_enabled):
                return False
            grad = torch.is_grad_enabled()
            return all(type(t) is plain and t.is_cuda and not (grad and t.requires_grad)
                       for t in tensors)
        return direct

    _direct = _make_direct()

    # The schema is spelled out (this module postpones annotations, and an op's schema is its
    # contract); the default argument lives in the Python wrapper `gemm` below.
    def _gemm_impl(a, b, b_layout):
        m, n, k = _gemm_shapes(a, b, b_layout)
        for name, x in (("a", a), ("b", b)):
            if x.dtype != torch.bfloat16:
                raise ValueError(f"mkernel.gemm: {name} has dtype {x.dtype}; expected bfloat16")
            if not x.is_cuda:
                raise ValueError(f"mkernel.gemm: {name} is on {x.device}; expected a CUDA device")
        if b.device != a.device:
            raise ValueError(f"mkernel.gemm: a is on {a.device} but b on {b.device}")
        a2, b2 = a.contiguous(), b.contiguous()
        c = torch.empty((*a.shape[:-1], n), dtype=torch.bfloat16, device=a.device)
        if c.numel() == 0:
            return c
        if k == 0:  # an empty sum, as torch.matmul has it
            return c.zero_()
        dev = a.get_device()
        with _current_device(dev):
            _C.gemm(a2.data_ptr(), b2.data_ptr(), c.data_ptr(), m, n, k, b_layout,
                    _current_raw_stream(dev))
        return c

    _gemm_op = torch.library.custom_op(
        "mkernel::gemm", mutates_args=(),
        schema="(Tensor a, Tensor b, str b_layout) -> Tensor")(_gemm_impl)

    @_gemm_op.register_fake
    def _gemm_fake(a, b, b_layout):
        _, n, _ = _gemm_shapes(a, b, b_layout)
        return a.new_empty((*a.shape[:-1], n))

    def gemm(a: "torch.Tensor", b: "torch.Tensor", b_layout: str = "nk") -> "torch.Tensor":
        """C = a @ b.T (b_layout='nk': b is [N, K], a torch.nn.Linear weight) or a @ b ('kn').

        a: [..., K] bf16 on a Hopper GPU; b: 2-D bf16 on the same GPU. Returns C [..., N] bf16
        (fp32 accumulation). N and K multiples of 8. The op is torch.ops.mkernel.gemm: it runs on
        the current CUDA stream without synchronising the host, and works under torch.compile
        (fake implementation registered) and inside CUDA graphs.
        """
        return (_gemm_impl if _direct(a, b) else _gemm_op)(a, b, b_layout)

    def _grouped_shapes(a, b, group_rows, b_layout):
        if b_layout not in ("nk", "kn"):
            raise ValueError(f"mkernel.grouped_gemm: b_layout={b_layout!r}; expected 'nk' "
                             "(b is [G, N, K]) or 'kn' (b is [G, K, N])")
        if a.dim() not in (2, 3) or b.dim() != 3 or group_rows.dim() != 1:
            raise ValueError("mkernel.grouped_gemm: a must be [rows, K] (contiguous) or "
                             "[G, capacity, K] (masked), b [G, N, K] or [G, K, N] and group_rows "
                             f"[G]; got {tuple(a.shape)}, {tuple(b.shape)}, "
                             f"{tuple(group_rows.shape)}")
        g = b.shape[0]
        n, kb = (b.shape[1], b.shape[2]) if b_layout == "nk" else (b.shape[2], b.shape[1])
        k = a.shape[-1]
        if kb != k or group_rows.shape[0] != g or (a.dim() == 3 and a.shape[0] != g):
            raise ValueError(f"mkernel.grouped_gemm: a {tuple(a.shape)} has K = {k}, b "
                             f"({b_layout}) has K = {kb} and {g} groups, group_rows has "
                             f"{group_rows.shape[0]}")
        return a.shape[-2], n, k, g

    def _grouped_gemm_impl(a, b, group_rows, b_layout, padded=False):
        rows, n, k, g = _grouped_shapes(a, b, group_rows, b_layout)
        for name, x in (("a", a), ("b", b)):
            if x.dtype != torch.bfloat16:
                raise ValueError(f"mkernel.grouped_gemm: {name} has dtype {x.dtype}; "
                                 "expected bfloat16")
        if group_rows.dtype != torch.int32:
            raise ValueError(f"mkernel.grouped_gemm: group_rows has dtype {group_rows.dtype}; "
                             "expected int32")
        for name, x in (("b", b), ("group_rows", group_rows)):
            if x.device != a.device or not a.is_cuda:
                raise ValueError(f"mkernel.grouped_gemm: {name} is on {x.device}, a on "
                                 f"{a.device}; expected one CUDA device")
        a2, b2, r2 = a.contiguous(), b.contiguous(), group_rows.contiguous()
        masked = a.dim() == 3
        if padded and masked:
            raise ValueError("mkernel.grouped_gemm: padded=True takes a 2-D a [rows, K] (the "
                             "padded layout); a 3-D a is the masked layout")
        c = torch.empty((*a.shape[:-1], n), dtype=torch.bfloat16, device=a.device)
        if rows == 0:
            return c
        dev = a.get_device()
        with _current_device(dev):
            _C.grouped_gemm(a2.data_ptr(), b2.data_ptr(), c.data_ptr(), r2.data_ptr(), g, rows,
                            n, k, b_layout, _current_raw_stream(dev), 0, masked, padded)
        return c

    _grouped_gemm_op = torch.library.custom_op(
        "mkernel::grouped_gemm", mutates_args=(),
        schema="(Tensor a, Tensor b, Tensor group_rows, str b_layout, bool padded=False) "
               "-> Tensor",
    )(_grouped_gemm_impl)

    @_grouped_gemm_op.register_fake
    def _grouped_gemm_fake(a, b, group_rows, b_layout, padded=False):
        _, n, _, _ = _grouped_shapes(a, b, group_rows, b_layout)
        return a.new_empty((*a.shape[:-1], n))

    def grouped_gemm(a: "torch.Tensor", b: "torch.Tensor", group_rows: "torch.Tensor",
                     b_layout: str = "nk", *, padded: bool = False) -> "torch.Tensor":
        """Grouped GEMM (MoE experts): C_g = A_g @ b[g].T ('nk') or @ b[g] ('kn') for each g.

        a: [rows, K] bf16, the groups' rows back to back (contiguous: prefill), or
        [G, capacity, K], group g's rows first in its block (masked: decode, fixed shapes);
        b: [G, N, K] ('nk') or [G, K, N]; group_rows: int32 [G] on the GPU (row counts, e.g.
        tokens per expert; they stay on the device, so nothing synchronises with the host;
        masked counts clamp to the capacity). Returns [rows, N] or [G, capacity, N] bf16; rows
        past the groups' total (contiguous) or past each group's count (masked) are left
        uninitialised. torch.ops.mkernel.grouped_gemm: current stream, torch.compile, CUDA graphs
        (the counts may change between replays). padded=True (2-D a): group g starts at the
        sum over i < g of round_up(M_i, 128) rows - moe_dispatch's padded layout.
        """
        op = _grouped_gemm_impl if _direct(a, b, group_rows) else _grouped_gemm_op
        return op(a, b, group_rows, b_layout, padded)

    def _ag_gemm_shapes(comm, a_shard, b, b_layout):
        if a_shard.dim() != 2:
            raise ValueError(f"mkernel.ag_gemm: a_shard must be 2-D [M / world, K]; got "
                             f"{tuple(a_shard.shape)}")
        _, n, k = _gemm_shapes(a_shard, b, b_layout, "ag_gemm")
        return a_shard.shape[0] * comm.world_size, n, k

    def _ag_gemm_impl(a_shard, b, b_layout, comm, return_gathered, block_n, comm_ctas, piece_rows):
        c = _communicator(comm, "ag_gemm")
        m, n, k = _ag_gemm_shapes(c, a_shard, b, b_layout)
        for name, x in (("a_shard", a_shard), ("b", b)):
            if x.dtype != torch.bfloat16:
                raise ValueError(f"mkernel.ag_gemm: {name} has dtype {x.dtype}; expected bfloat16")
            _check_device("ag_gemm", name, x, c._device)
        a2, b2 = a_shard.contiguous(), b.contiguous()
        out = torch.empty((m, n), dtype=torch.bfloat16, device=a_shard.device)
        gathered = torch.empty((m, k) if return_gathered else (0, k), dtype=torch.bfloat16,
                               device=a_shard.device)
        ws = c._workspace(_C.ag_gemm_workspace_bytes(m, k), "ag_gemm", "gather")
        # (the C++ entry makes c._device current for the launch)
        _C.ag_gemm(c._impl, a2.data_ptr(), b2.data_ptr(), out.data_ptr(), m, n, k, b_layout,
                   ws.data_ptr(), c._stream(), gathered.data_ptr() if return_gathered else 0,
                   block_n, comm_ctas, piece_rows)
        return out, gathered

    _ag_gemm_op = torch.library.custom_op(
        "mkernel::ag_gemm", mutates_args=(),
        schema="(Tensor a_shard, Tensor b, str b_layout, int comm, bool return_gathered, "
               "int block_n, int comm_ctas, int piece_rows) -> (Tensor, Tensor)")(_ag_gemm_impl)

    @_ag_gemm_op.register_fake
    def _ag_gemm_fake(a_shard, b, b_layout, comm, return_gathered, block_n, comm_ctas,
                      piece_rows):
        m, n, k = _ag_gemm_shapes(_communicator(comm, "ag_gemm"), a_shard, b, b_layout)
        return a_shard.new_empty((m, n)), a_shard.new_empty((m, k) if return_gathered else (0, k))

    def ag_gemm(a_shard: "torch.Tensor", b: "torch.Tensor", comm: "Communicator", *,
                b_layout: str = "nk", return_gathered: bool = False, block_n: int = 0,
                comm_ctas: int = 0, piece_rows: int = 0):
        """AllGather + GEMM in one launch: C = all_gather(a_shard) @ b.T ('nk') or @ b ('kn').

        a_shard: this rank's rows of A, [M / world, K] bf16 on the communicator's GPU (shards are
            gathered in rank order: rows [r * M / world, (r + 1) * M / world) come from rank r).
        b: this rank's weight, [N, K] ('nk', a torch.nn.Linear weight) or [K, N] ('kn'), bf16.
        Returns C [M, N] bf16 (fp32 accumulation), and with return_gathered=True also the
        gathered A [M, K] (a copy; costs one extra pass over it).
        N and K multiples of 8. Runs on the current CUDA stream without synchronising the host;
        every rank must call it (same shapes, same order). The op is torch.ops.mkernel.ag_gemm and
        works under torch.compile and in CUDA graphs - but the first call with a new largest
        shape allocates the communicator's symmetric workspace (collectively), so make it before
        capturing. block_n, comm_ctas, piece_rows: overrides of the tuned configuration (0 = auto).
        """
        op = _ag_gemm_impl if _direct(a_shard, b) else _ag_gemm_op
        c, gathered = op(a_shard, b, b_layout, comm._id, return_gathered, block_n, comm_ctas,
                         piece_rows)
        return (c, gathered) if return_gathered else c
    def _gemm_rs_shapes(comm, a, b, b_layout):
        if a.dim() != 2:
            raise ValueError(f"mkernel.gemm_rs: a must be 2-D [M, K / world]; got {tuple(a.shape)}")
        m, n, k = _gemm_shapes(a, b, b_layout, "gemm_rs")
        if m % comm.world_size != 0:
            raise ValueError(f"mkernel.gemm_rs: M = {m} is not a multiple of the world size "
                             f"{comm.world_size}")
        return m, n, k

    def _gemm_rs_impl(a, b, b_layout, comm, block_n, bf16_partials, tma_sends):
        c = _communicator(comm, "gemm_rs")
        m, n, k = _gemm_rs_shapes(c, a, b, b_layout)
        for name, x in (("a", a), ("b", b)):
            if x.dtype != torch.bfloat16:
                raise ValueError(f"mkernel.gemm_rs: {name} has dtype {x.dtype}; expected bfloat16")
            _check_device("gemm_rs", name, x, c._device)
        a2, b2 = a.contiguous(), b.contiguous()
        out = torch.empty((m // c.world_size, n), dtype=torch.bfloat16, device=a.device)
        ws = c._workspace(_C.gemm_rs_workspace_bytes(c._impl, m, n), "gemm_rs", "accumulate")
        # (the C++ entry makes c._device current for the launch)
        _C.gemm_rs(c._impl, a2.data_ptr(), b2.data_ptr(), out.data_ptr(), m, n, k, b_layout,
                   ws.data_ptr(), c._stream(), block_n, bf16_partials, tma_sends)
        return out

    _gemm_rs_op = torch.library.custom_op(
        "mkernel::gemm_rs", mutates_args=(),
        schema="(Tensor a, Tensor b, str b_layout, int comm, int block_n, bool bf16_partials, "
               "bool tma_sends) -> Tensor")(_gemm_rs_impl)

    @_gemm_rs_op.register_fake
    def _gemm_rs_fake(a, b, b_layout, comm, block_n, bf16_partials, tma_sends):
        c = _communicator(comm, "gemm_rs")
        m, n, _ = _gemm_rs_shapes(c, a, b, b_layout)
        return a.new_empty((m // c.world_size, n))

    def gemm_rs(a: "torch.Tensor", b: "torch.Tensor", comm: "Communicator", *,
                b_layout: str = "nk", block_n: int = 0, bf16_partials: bool = False,
                tma_sends: bool = True) -> "torch.Tensor":
        """GEMM + ReduceScatter in one launch: this rank's rows of sum over ranks of a @ op(b).

        a: this rank's A_r, [M, K / world] bf16 (the row-parallel layer's input slice).
        b: this rank's weight slice, [N, K / world] ('nk', nn.Linear layout) or [K / world, N].
        Returns [M / world, N] bf16: rows [r * M / world, (r + 1) * M / world) of the sum on rank
        r. Sums are fp32 until the final rounding. M divisible by the world size; N and K / world
        multiples of 8. Current CUDA stream, no host synchronisation; every rank calls it in the
        same order. torch.ops.mkernel.gemm_rs works under torch.compile and in CUDA graphs (call
        it once per new largest shape before capturing: that allocates its workspace).
        bf16_partials=True (two ranks): the peer's partial sums travel as bf16 - rounded once
        before the fp32 add, as a bf16 NCCL reduce-scatter rounds them - for half the bytes;
        across nodes (any world size) the node sums cross the network as bf16, and at two
        ranks per node the node's partials travel as bf16 too.
        tma_sends=False (two ranks, fp32 partials): slices leave by the threads' stores instead of
        the SM's copy engine (FusedGemmConfig::tma_sends: kept for measuring the two over NVLink).
        """
        op = _gemm_rs_impl if _direct(a, b) else _gemm_rs_op
        return op(a, b, b_layout, comm._id, block_n, bf16_partials, tma_sends)
    def _gemm_ar_impl(a, b, out, b_layout, comm, block_n, bf16_partials, tma_sends):
        c = _communicator(comm, "gemm_ar")
        if a.dim() != 2:
            raise ValueError(f"mkernel.gemm_ar: a must be 2-D [M, K / world]; got {tuple(a.shape)}")
        m, n, k = _gemm_shapes(a, b, b_layout, "gemm_ar")
        for name, x in (("a", a), ("b", b), ("out", out)):
            if x.dtype != torch.bfloat16:
                raise ValueError(f"mkernel.gemm_ar: {name} has dtype {x.dtype}; expected bfloat16")
            _check_device("gemm_ar", name, x, c._device)
        if tuple(out.shape) != (m, n) or not out.is_contiguous():
            raise ValueError(f"mkernel.gemm_ar: out must be a contiguous [{m}, {n}] tensor; got "
                             f"{tuple(out.shape)}")
        a2, b2 = a.contiguous(), b.contiguous()
        ws = c._workspace(_C.gemm_ar_workspace_bytes(c._impl, m, n, k, block_n), "gemm_ar",
                          "accumulate")
        # (the C++ entry makes c._device current for the launch)
        _C.gemm_ar(c._impl, a2.data_ptr(), b2.data_ptr(), out.data_ptr(), m, n, k, b_layout,
                   ws.data_ptr(), c._stream(), block_n, bf16_partials, tma_sends)

    _gemm_ar_op = torch.library.custom_op(
        "mkernel::gemm_ar", mutates_args=("out",),
        schema="(Tensor a, Tensor b, Tensor(a!) out, str b_layout, int comm, int block_n, "
               "bool bf16_partials, bool tma_sends) -> ()")(_gemm_ar_impl)

    @_gemm_ar_op.register_fake
    def _gemm_ar_fake(a, b, out, b_layout, comm, block_n, bf16_partials, tma_sends):
        return None

    def gemm_ar(a: "torch.Tensor", b: "torch.Tensor", comm: "Communicator",
                out: "torch.Tensor", *, b_layout: str = "nk", block_n: int = 0,
                bf16_partials: bool = False, tma_sends: bool = True) -> "torch.Tensor":
        """GEMM + AllReduce in one launch: out = sum over ranks of a @ op(b), on every rank.

        a: this rank's A_r, [M, K / world] bf16 (any M >= 1; the row-parallel layer's input).
        b: this rank's weight slice, [N, K / world] ('nk') or [K / world, N] ('kn') bf16.
        out: [M, N] bf16 in symmetric memory - comm.alloc_tensor((M, N), torch.bfloat16), made
            once and reused: the ranks write each other's outputs. Returned for convenience.
        Every rank ends with the same bits; sums are fp32 until one rounding. Current CUDA
        stream, no host synchronisation, the same order on every rank; torch.ops.mkernel.gemm_ar
        (mutates out) works under torch.compile and in CUDA graphs (call once per new largest
        shape before capturing: that allocates its workspace).
        bf16_partials=True (two ranks): the peer's partial sums travel as bf16 - rounded once
        before the fp32 add, as a bf16 NCCL all-reduce rounds them - for half the bytes; across
        nodes as in gemm_rs (bf16 node sums at any world size).
        tma_sends=False (two ranks): the results and slices leave by the threads' stores instead
        of the SM's copy engine (as gemm_rs).
        """
        op = _gemm_ar_impl if _direct(a, b, out) else _gemm_ar_op
        op(a, b, out, b_layout, comm._id, block_n, bf16_partials, tma_sends)
        return out
else:  # pragma: no cover - without torch there is no tensor to multiply
    def gemm_ar(a, b, comm, out, **kwargs):
        """Needs PyTorch; see the docstring of the torch custom op."""
        _require_torch("gemm_ar")

    def grouped_gemm(a, b, group_rows, b_layout="nk"):
        """Needs PyTorch; see the docstring of the torch custom op."""
        _require_torch("grouped_gemm")

    def gemm_rs(a, b, comm, **kwargs):
        """Needs PyTorch; see the docstring of the torch custom op."""
        _require_torch("gemm_rs")

    def ag_gemm(a_shard, b, comm, **kwargs):
        """Needs PyTorch; see the docstring of the torch custom op."""
        _require_torch("ag_gemm")

    def gemm(a, b, b_layout="nk"):
        """Needs PyTorch; see the docstring of the torch custom op."""
        _require_torch("gemm")

if torch is not None:
    from mkernel.attention_ops import (attention, ring_attention,  # noqa: E402 - needs the above
                                       zigzag_shard, zigzag_unshard)
    from mkernel.moe import (MoeHandle, moe_combine, moe_dispatch,  # noqa: E402 - needs the above
                             moe_dispatch_gemm, moe_layer, moe_weights_from_hf)
else:  # pragma: no cover - without torch there are no tensors to route
    def attention(q, k, v, **kwargs):
        """Needs PyTorch; see mkernel.attention_ops."""
        _require_torch("attention")

    def ring_attention(q, k, v, comm, **kwargs):
        """Needs PyTorch; see mkernel.attention_ops."""
        _require_torch("ring_attention")

    def zigzag_shard(x, comm, dim=1):
        """Needs PyTorch; see mkernel.attention_ops."""
        _require_torch("zigzag_shard")

    def zigzag_unshard(x, comm, dim=1):
        """Needs PyTorch; see mkernel.attention_ops."""
        _require_torch("zigzag_unshard")

    MoeHandle = None

    def moe_dispatch(x, topk_idx, comm, num_experts, **kwargs):
        """Needs PyTorch; see mkernel.moe."""
        _require_torch("moe_dispatch")

    def moe_combine(y, topk_weights, handle, comm, **kwargs):
        """Needs PyTorch; see mkernel.moe."""
        _require_torch("moe_combine")

    def moe_dispatch_gemm(x, topk_idx, w, comm, num_experts, **kwargs):
        """Needs PyTorch; see mkernel.moe."""
        _require_torch("moe_dispatch_gemm")

    def moe_layer(x, topk_idx, topk_weights, w13, w2, comm, num_experts, **kwargs):
        """Needs PyTorch; see mkernel.moe."""
        _require_torch("moe_layer")

    def moe_weights_from_hf(experts):
        """Needs PyTorch; see mkernel.moe."""
        _require_torch("moe_weights_from_hf")
