"""Expert-parallel MoE dispatch and combine (mkernel/moe.h), as PyTorch custom ops.

Each rank holds T tokens x [T, H] bf16 and their router's top-k choice topk_idx [T, k] (global
expert ids, int32 or int64, -1 = no expert in that slot); the E = world x E_local experts live
on the ranks in order (expert e on rank e // E_local). Only routed tokens travel, once per
destination rank::

    recv_x, expert_rows, handle = mkernel.moe_dispatch(x, topk_idx, comm, num_experts)
    y = mkernel.grouped_gemm(recv_x, w_local, expert_rows)         # the local experts' work
    out = mkernel.moe_combine(y, topk_weights, handle, comm)         # [T, H] at the source

The whole layer in one call (dispatch, gate / up with SwiGLU, down, weighted combine)::

    w13, w2 = mkernel.moe_weights_from_hf(experts_of_this_rank)     # from a Hugging Face block
    out = mkernel.moe_layer(x, topk_idx, topk_weights, w13, w2, comm, num_experts)

Rows of an expert come in (source rank, token, slot) order, so both ops reproduce bit for bit.
Nothing synchronises with the host and both work in CUDA graphs (routing may change between
replays) and under torch.compile. A row past its expert's room, or an expert id out of range,
is an error recorded on the GPU and raised by comm.synchronize() / comm.check().
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mkernel import _C, _check_device, _communicator, _direct

import torch

__all__ = ["MoeHandle", "moe_dispatch", "moe_dispatch_gemm", "moe_combine", "moe_plan", "moe_layer",
           "moe_layer_plan", "moe_weights_from_hf"]

_LAYOUTS = ("padded", "masked")


@dataclasses.dataclass(frozen=True)
class MoeHandle:
    """What moe_combine needs from its moe_dispatch.

    rows: int32 [rows, 3], for every row of the dispatch layout (source rank, token, slot), or
        (-1, -1, -1) for padding and unused rows.
    expert_rows: int32 [E_local], rows routed to each local expert (also rows past the room).
    The rest is the problem the dispatch ran with (the combine runs with the same).
    """
    rows: "torch.Tensor"
    expert_rows: "torch.Tensor"
    num_tokens: int
    max_tokens: int
    hidden: int
    top_k: int
    num_experts: int
    layout: str
    capacity: int


def _problem(comm, x, topk_idx, num_experts, layout, capacity, max_tokens, op):
    if layout not in _LAYOUTS:
        raise ValueError(f"mkernel.{op}: layout={layout!r}; expected 'padded' or 'masked'")
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"mkernel.{op}: x must be [T, H] and topk_idx [T, k]; got "
                         f"{tuple(x.shape)} and {tuple(topk_idx.shape)}")
    tokens, hidden = x.shape
    top_k = topk_idx.shape[1]
    max_tokens = tokens if max_tokens <= 0 else max_tokens
    return tokens, max_tokens, hidden, top_k


def moe_plan(comm, tokens: int, hidden: int, top_k: int, num_experts: int, *,
             layout: str = "padded", capacity: int = 0, max_tokens: int = 0, sms: int = 0):
    """(rows, capacity, experts_local, ctas, workspace_bytes, description) of a dispatch."""
    return _C.moe_plan(comm._impl, tokens, max_tokens if max_tokens > 0 else tokens, hidden,
                       top_k, num_experts, layout, capacity, sms)


def _out_shape(plan, hidden, layout):
    rows, capacity, experts_local = plan[0], plan[1], plan[2]
    return (rows, hidden) if layout == "padded" else (experts_local, capacity, hidden)


def _dispatch_impl(x, topk_idx, comm, num_experts, layout, capacity, max_tokens, sms):
    c = _communicator(comm, "moe_dispatch")
    tokens, max_tokens, hidden, top_k = _problem(c, x, topk_idx, num_experts, layout, capacity,
                                                 max_tokens, "moe_dispatch")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"mkernel.moe_dispatch: x has dtype {x.dtype}; expected bfloat16")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mkernel.moe_dispatch: topk_idx has dtype {topk_idx.dtype}; expected "
                         "int32 or int64")
    _check_device("moe_dispatch", "x", x, c._device)
    _check_device("moe_dispatch", "topk_idx", topk_idx, c._device)
    plan = _C.moe_plan(c._impl, tokens, max_tokens, hidden, top_k, num_experts, layout, capacity,
                       sms)
    x2, idx2 = x.contiguous(), topk_idx.contiguous()
    recv = torch.empty(_out_shape(plan, hidden, layout), dtype=torch.bfloat16, device=x.device)
    expert_rows = torch.empty((plan[2],), dtype=torch.int32, device=x.device)
    handle = torch.empty((plan[0], 3), dtype=torch.int32, device=x.device)
    ws = c._workspace(plan[4], "moe_dispatch", "moe")
    _C.moe_dispatch(c._impl, tokens, max_tokens, hidden, top_k, num_experts, layout, capacity,
                    x2.data_ptr(), idx2.data_ptr(), idx2.dtype == torch.int64, recv.data_ptr(),
                    expert_rows.data_ptr(), handle.data_ptr(), ws.data_ptr(), c._stream(), sms)
    return recv, expert_rows, handle


_dispatch_op = torch.library.custom_op(
    "mkernel::moe_dispatch", mutates_args=(),
    schema="(Tensor x, Tensor topk_idx, int comm, int num_experts, str layout, int capacity, "
           "int max_tokens, int sms) -> (Tensor, Tensor, Tensor)")(_dispatch_impl)


@_dispatch_op.register_fake
def _dispatch_fake(x, topk_idx, comm, num_experts, layout, capacity, max_tokens, sms):
    c = _communicator(comm, "moe_dispatch")
    tokens, max_tokens, hidden, top_k = _problem(c, x, topk_idx, num_experts, layout, capacity,
                                                 max_tokens, "moe_dispatch")
    plan = _C.moe_plan(c._impl, tokens, max_tokens, hidden, top_k, num_experts, layout, capacity,
                       sms)
    return (x.new_empty(_out_shape(plan, hidden, layout)),
            x.new_empty((plan[2],), dtype=torch.int32),
            x.new_empty((plan[0], 3), dtype=torch.int32))


def moe_dispatch(x: "torch.Tensor", topk_idx: "torch.Tensor", comm, num_experts: int, *,
                 layout: str = "padded", capacity: int = 0, max_tokens: int = 0,
                 sms: int = 0):
    """Send every routed token to the ranks of its experts; returns (recv_x, expert_rows, handle).

    x: [T, H] bf16 (H a multiple of 8); topk_idx: [T, k] int32 or int64 (k <= 16), global
    expert ids or -1; num_experts: E, a multiple of the world size (at most 8192).
    layout 'padded' (prefill): recv_x [rows, H], local expert e's rows from the sum over e' < e
        of round_up(rows(e'), 128); capacity = rows in all (0: every routed row fits).
    layout 'masked' (decode): recv_x [E_local, capacity, H], expert e's rows first in its block;
        capacity = rows per local expert (0: world x max_tokens).
    max_tokens: the most tokens any rank passes (the same on every rank; 0: this call's T, so
        every rank must then pass the same T - ranks that disagree on it, or on anything else
        every rank shares, get MkernelError(code='invalid_argument') from comm.synchronize()
        naming both ranks, and nothing moves). It sizes the communicator's symmetric workspace,
        allocated (collectively) by the first call with a larger problem - make that call before
        capturing a CUDA graph.
    expert_rows: int32 [E_local] on the GPU (feed it to mkernel.grouped_gemm); handle: a
    MoeHandle for moe_combine. Rows an expert has no room for are not placed, and
    comm.synchronize() raises MkernelError(code='out_of_memory') naming the expert.
    """
    op = _dispatch_impl if _direct(x, topk_idx) else _dispatch_op
    recv, expert_rows, rows = op(x, topk_idx, comm._id, num_experts, layout, capacity,
                                 max_tokens, sms)
    tokens = x.shape[0]
    handle = MoeHandle(rows, expert_rows, tokens, max_tokens if max_tokens > 0 else tokens,
                       x.shape[1], topk_idx.shape[1], num_experts, layout, capacity)
    return recv, expert_rows, handle


def _dispatch_gemm_impl(x, topk_idx, w, comm, num_experts, b_layout, layout, capacity,
                        max_tokens, return_received, block_n, sms):
    c = _communicator(comm, "moe_dispatch_gemm")
    tokens, max_tokens, hidden, top_k = _problem(c, x, topk_idx, num_experts, layout, capacity,
                                                 max_tokens, "moe_dispatch_gemm")
    n = _gemm_width(x, w, b_layout)
    for name, t in (("x", x), ("w", w)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"mkernel.moe_dispatch_gemm: {name} has dtype {t.dtype}; expected "
                             "bfloat16")
        _check_device("moe_dispatch_gemm", name, t, c._device)
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mkernel.moe_dispatch_gemm: topk_idx has dtype {topk_idx.dtype}; "
                         "expected int32 or int64")
    _check_device("moe_dispatch_gemm", "topk_idx", topk_idx, c._device)
    plan = _C.moe_plan(c._impl, tokens, max_tokens, hidden, top_k, num_experts, layout, capacity,
                       sms)
    _require_local_experts(w, plan)
    x2, idx2, w2 = x.contiguous(), topk_idx.contiguous(), w.contiguous()
    recv_shape = _out_shape(plan, hidden, layout)
    # Without return_received the rows are not copied anywhere on one node: the GEMM reads them
    # where they lie. Across nodes the op runs as the dispatch, then the grouped GEMM on its rows:
    # they need the buffer.
    keep = return_received or c._impl.num_nodes > 1
    recv = torch.empty(recv_shape if keep else (0,) + tuple(recv_shape[1:]),
                       dtype=torch.bfloat16, device=x.device)
    y = torch.empty(_out_shape(plan, n, layout), dtype=torch.bfloat16, device=x.device)
    expert_rows = torch.empty((plan[2],), dtype=torch.int32, device=x.device)
    handle = torch.empty((plan[0], 3), dtype=torch.int32, device=x.device)
    ws = c._workspace(plan[4], "moe_dispatch_gemm", "moe")
    _C.moe_dispatch_gemm(c._impl, tokens, max_tokens, hidden, top_k, num_experts, layout,
                         capacity, x2.data_ptr(), idx2.data_ptr(), idx2.dtype == torch.int64,
                         w2.data_ptr(), b_layout, n, y.data_ptr(), recv.data_ptr() if keep else 0,
                         expert_rows.data_ptr(), handle.data_ptr(), ws.data_ptr(), c._stream(),
                         sms, block_n)
    kept = recv if return_received else recv.new_empty((0,) + tuple(recv.shape[1:]))
    return y, expert_rows, handle, kept


def _require_local_experts(w, plan):
    """w [E_local, ...] holds this rank's experts (the op and its fake)."""
    if w.shape[0] != plan[2]:
        raise ValueError(f"mkernel.moe_dispatch_gemm: w holds {w.shape[0]} experts; this rank has "
                         f"{plan[2]} (num_experts / world)")


def _gemm_width(x, w, b_layout):
    """N of the experts' weights w [E_local, N, H] ('nk') or [E_local, H, N] ('kn')."""
    if b_layout not in ("nk", "kn"):
        raise ValueError(f"mkernel.moe_dispatch_gemm: b_layout={b_layout!r}; expected 'nk' (w is "
                         "[E_local, N, H]) or 'kn' (w is [E_local, H, N])")
    if w.dim() != 3:
        raise ValueError(f"mkernel.moe_dispatch_gemm: w must be 3-D; got {tuple(w.shape)}")
    n, h = (w.shape[1], w.shape[2]) if b_layout == "nk" else (w.shape[2], w.shape[1])
    if h != x.shape[-1]:
        raise ValueError(f"mkernel.moe_dispatch_gemm: w ({b_layout}) has H = {h}, x has "
                         f"{x.shape[-1]}")
    return n


_dispatch_gemm_op = torch.library.custom_op(
    "mkernel::moe_dispatch_gemm", mutates_args=(),
    schema="(Tensor x, Tensor topk_idx, Tensor w, int comm, int num_experts, str b_layout, "
           "str layout, int capacity, int max_tokens, bool return_received, int block_n, "
           "int sms) -> (Tensor, Tensor, Tensor, Tensor)")(_dispatch_gemm_impl)


@_dispatch_gemm_op.register_fake
def _dispatch_gemm_fake(x, topk_idx, w, comm, num_experts, b_layout, layout, capacity,
                        max_tokens, return_received, block_n, sms):
    c = _communicator(comm, "moe_dispatch_gemm")
    tokens, max_tokens, hidden, top_k = _problem(c, x, topk_idx, num_experts, layout, capacity,
                                                 max_tokens, "moe_dispatch_gemm")
    n = _gemm_width(x, w, b_layout)
    plan = _C.moe_plan(c._impl, tokens, max_tokens, hidden, top_k, num_experts, layout, capacity,
                       sms)
    _require_local_experts(w, plan)
    recv_shape = _out_shape(plan, hidden, layout)
    return (x.new_empty(_out_shape(plan, n, layout)),
            x.new_empty((plan[2],), dtype=torch.int32),
            x.new_empty((plan[0], 3), dtype=torch.int32),
            x.new_empty(recv_shape if return_received else (0,) + recv_shape[1:]))


def moe_dispatch_gemm(x: "torch.Tensor", topk_idx: "torch.Tensor", w: "torch.Tensor", comm,
                      num_experts: int, *, b_layout: str = "nk", layout: str = "padded",
                      capacity: int = 0, max_tokens: int = 0, return_received: bool = False,
                      block_n: int = 0, sms: int = 0):
    """moe_dispatch and the local experts' GEMM in one launch: (y, expert_rows, handle[, recv_x]).

    As moe_dispatch (x, topk_idx, num_experts, layout, capacity, max_tokens), and w: this rank's
    experts' weights, [E_local, N, H] ('nk', nn.Linear's layout) or [E_local, H, N] ('kn') bf16.
    y: [rows, N] (padded) or [E_local, capacity, N] (masked) bf16 - each dispatched row times its
    expert's weight, every 128-row tile multiplied as soon as its rows have landed; rows without
    a token are not written. expert_rows and handle as moe_dispatch's (moe_combine takes y and
    the handle when N = H). return_received=True: also the dispatched rows (recv_x).
    """
    op = _dispatch_gemm_impl if _direct(x, topk_idx, w) else _dispatch_gemm_op
    y, expert_rows, rows, recv = op(x, topk_idx, w, comm._id, num_experts, b_layout, layout,
                                    capacity, max_tokens, return_received, block_n, sms)
    tokens = x.shape[0]
    handle = MoeHandle(rows, expert_rows, tokens, max_tokens if max_tokens > 0 else tokens,
                       x.shape[1], topk_idx.shape[1], num_experts, layout, capacity)
    return (y, expert_rows, handle, recv) if return_received else (y, expert_rows, handle)


def _combine_impl(y, topk_weights, rows, comm, num_experts, layout, capacity, max_tokens, sms):
    c = _communicator(comm, "moe_combine")
    if topk_weights.dim() != 2 or y.dim() not in (2, 3):
        raise ValueError("mkernel.moe_combine: topk_weights must be [T, k] and y [rows, H] or "
                         f"[E_local, capacity, H]; got {tuple(topk_weights.shape)} and "
                         f"{tuple(y.shape)}")
    tokens, top_k = topk_weights.shape
    hidden = y.shape[-1]
    if y.dtype != torch.bfloat16 or topk_weights.dtype != torch.float32:
        raise ValueError(f"mkernel.moe_combine: y must be bfloat16 and topk_weights float32; got "
                         f"{y.dtype} and {topk_weights.dtype}")
    if rows.dtype != torch.int32:
        raise ValueError(f"mkernel.moe_combine: the handle's rows have dtype {rows.dtype}; "
                         "expected int32 (the MoeHandle moe_dispatch returned)")
    for name, t in (("y", y), ("topk_weights", topk_weights), ("handle.rows", rows)):
        _check_device("moe_combine", name, t, c._device)
    plan = _C.moe_plan(c._impl, tokens, max_tokens, hidden, top_k, num_experts, layout, capacity,
                       sms)
    if tuple(y.shape) != _out_shape(plan, hidden, layout) or tuple(rows.shape) != (plan[0], 3):
        raise ValueError(f"mkernel.moe_combine: y {tuple(y.shape)} and the handle's rows "
                         f"{tuple(rows.shape)} do not match the dispatch's layout "
                         f"{_out_shape(plan, hidden, layout)}")
    y2, w2, r2 = y.contiguous(), topk_weights.contiguous(), rows.contiguous()
    out = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=y.device)
    ws = c._workspace(plan[4], "moe_combine", "moe")
    _C.moe_combine(c._impl, tokens, max_tokens, hidden, top_k, num_experts, layout, capacity,
                   y2.data_ptr(), w2.data_ptr(), r2.data_ptr(), out.data_ptr(), ws.data_ptr(),
                   c._stream(), sms)
    return out


_combine_op = torch.library.custom_op(
    "mkernel::moe_combine", mutates_args=(),
    schema="(Tensor y, Tensor topk_weights, Tensor rows, int comm, int num_experts, str layout, "
           "int capacity, int max_tokens, int sms) -> Tensor")(_combine_impl)


@_combine_op.register_fake
def _combine_fake(y, topk_weights, rows, comm, num_experts, layout, capacity, max_tokens, sms):
    return y.new_empty((topk_weights.shape[0], y.shape[-1]))


def moe_combine(y: "torch.Tensor", topk_weights: "torch.Tensor", handle: MoeHandle, comm, *,
                sms: int = 0) -> "torch.Tensor":
    """Send the experts' rows back and sum them at their source; returns out [T, H] bf16.

    y: the experts' outputs in the dispatch's layout ([rows, H] or [E_local, capacity, H] bf16,
    H as the dispatch's); topk_weights: [T, k] float32; handle: the dispatch's MoeHandle. Per
    token, sum over its slots in slot order of topk_weights[t, j] * y(t, j), in fp32, rounded
    once (slots without a row add nothing).
    """
    if not isinstance(handle, MoeHandle):
        raise TypeError("mkernel.moe_combine: handle must be the MoeHandle moe_dispatch returned")
    if tuple(topk_weights.shape) != (handle.num_tokens, handle.top_k):
        raise ValueError(f"mkernel.moe_combine: topk_weights is {tuple(topk_weights.shape)}; "
                         f"the dispatch had [{handle.num_tokens}, {handle.top_k}]")
    if y.shape[-1] != handle.hidden:
        raise ValueError(f"mkernel.moe_combine: y has H = {y.shape[-1]}; the dispatch had "
                         f"{handle.hidden}")
    op = _combine_impl if _direct(y, topk_weights, handle.rows) else _combine_op
    return op(y, topk_weights, handle.rows, comm._id, handle.num_experts, handle.layout,
              handle.capacity, handle.max_tokens, sms)


def moe_layer_plan(comm, tokens: int, hidden: int, top_k: int, num_experts: int,
                   intermediate: int, *, layout: str = "padded", capacity: int = 0,
                   max_tokens: int = 0, sms: int = 0, block_n: int = 0):
    """(rows, capacity, experts_local, ctas, workspace_bytes, scratch_bytes, description) of a
    moe_layer call: the symmetric workspace it shares with the dispatch, and the per-call scratch
    (the dispatched rows and the intermediate) it takes from the allocator."""
    return _C.moe_layer_plan(comm._impl, tokens, max_tokens if max_tokens > 0 else tokens, hidden,
                             top_k, num_experts, layout, capacity, intermediate, sms, block_n)


def _layer_shapes(x, topk_idx, topk_weights, w13, w2, op="moe_layer"):
    """(E_local, I) of the experts' weights, after checking every shape against x."""
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_weights.dim() != 2:
        raise ValueError(f"mkernel.{op}: x must be [T, H], topk_idx and topk_weights [T, k]; got "
                         f"{tuple(x.shape)}, {tuple(topk_idx.shape)} and "
                         f"{tuple(topk_weights.shape)}")
    if tuple(topk_idx.shape) != tuple(topk_weights.shape) or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"mkernel.{op}: topk_idx {tuple(topk_idx.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T, k] with T = "
                         f"{x.shape[0]}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"mkernel.{op}: w13 must be [E_local, 2I, H] and w2 [E_local, H, I]; "
                         f"got {tuple(w13.shape)} and {tuple(w2.shape)}")
    experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if hidden != x.shape[1] or two_i % 2 != 0 or tuple(w2.shape) != (experts, hidden, inter):
        raise ValueError(f"mkernel.{op}: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not "
                         f"fit x {tuple(x.shape)}: expected w13 [E_local, 2I, {x.shape[1]}] and "
                         f"w2 [E_local, {x.shape[1]}, I]")
    return experts, inter


def _layer_impl(x, topk_idx, topk_weights, w13, w2, comm, num_experts, layout, capacity,
                max_tokens, sms, block_n):
    c = _communicator(comm, "moe_layer")
    experts, inter = _layer_shapes(x, topk_idx, topk_weights, w13, w2)
    tokens, max_tokens, hidden, top_k = _problem(c, x, topk_idx, num_experts, layout, capacity,
                                                 max_tokens, "moe_layer")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"mkernel.moe_layer: {name} has dtype {t.dtype}; expected bfloat16")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mkernel.moe_layer: topk_idx has dtype {topk_idx.dtype}; expected int32 "
                         "or int64")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"mkernel.moe_layer: topk_weights has dtype {topk_weights.dtype}; "
                         "expected float32")
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights),
                    ("w13", w13), ("w2", w2)):
        _check_device("moe_layer", name, t, c._device)
    plan = _C.moe_layer_plan(c._impl, tokens, max_tokens, hidden, top_k, num_experts, layout,
                             capacity, inter, sms, block_n)
    if experts != plan[2]:
        raise ValueError(f"mkernel.moe_layer: w13 and w2 hold {experts} experts; this rank has "
                         f"{plan[2]} (num_experts / world)")
    x2, idx2, wt2 = x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()
    w13c, w2c = w13.contiguous(), w2.contiguous()
    out = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=x.device)
    ws = c._workspace(plan[4], "moe_layer", "moe")
    # The intermediates, from torch's allocator (a CUDA graph's pool when capturing).
    scratch = torch.empty((plan[5],), dtype=torch.uint8, device=x.device)
    _C.moe_layer(c._impl, tokens, max_tokens, hidden, top_k, num_experts, layout, capacity, inter,
                 x2.data_ptr(), idx2.data_ptr(), idx2.dtype == torch.int64, wt2.data_ptr(),
                 w13c.data_ptr(), w2c.data_ptr(), out.data_ptr(), ws.data_ptr(),
                 scratch.data_ptr(), c._stream(), sms, block_n)
    return out


_layer_op = torch.library.custom_op(
    "mkernel::moe_layer", mutates_args=(),
    schema="(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w13, Tensor w2, int comm, "
           "int num_experts, str layout, int capacity, int max_tokens, int sms, int block_n) "
           "-> Tensor")(_layer_impl)


@_layer_op.register_fake
def _layer_fake(x, topk_idx, topk_weights, w13, w2, comm, num_experts, layout, capacity,
                max_tokens, sms, block_n):
    _layer_shapes(x, topk_idx, topk_weights, w13, w2)
    return x.new_empty(tuple(x.shape))


def moe_layer(x: "torch.Tensor", topk_idx: "torch.Tensor", topk_weights: "torch.Tensor",
              w13: "torch.Tensor", w2: "torch.Tensor", comm, num_experts: int, *,
              layout: str = "padded", capacity: int = 0, max_tokens: int = 0, sms: int = 0,
              block_n: int = 0) -> "torch.Tensor":
    """An expert-parallel MoE layer: out [T, H] bf16.

    out[t] = sum over t's slots j of topk_weights[t, j] * (silu(x Wg^T) * (x Wu^T)) W2^T of
    expert topk_idx[t, j], where this rank's experts' weights are w13 [E_local, 2I, H] (each
    expert's gate rows, then its up rows: Mixtral's w1 / w3, DeepSeek's and Qwen's gate_proj /
    up_proj - moe_weights_from_hf stacks them) and w2 [E_local, H, I] (down_proj), bf16, I a
    multiple of 64. x [T, H] bf16, topk_idx [T, k] int32 / int64 (global expert ids, -1 = none),
    topk_weights [T, k] float32; num_experts, layout, capacity and max_tokens as moe_dispatch's.
    The intermediate is rounded to bf16 once; the combine sums in fp32 in slot order (the same
    bits every run). One persistent launch (after the routing's small kernels): rows placed as
    they arrive, gate / up with SwiGLU in its epilogue, down, each down row sent to its source's
    combine slot and every token summed there; a CUDA graph replays it with new routing,
    torch.compile sees one op. sms: CTAs of the launch (0: the communicator's SM budget);
    block_n: the experts' GEMMs' tile width, 128 or 256 (0: chosen).
    """
    op = _layer_impl if _direct(x, topk_idx, topk_weights, w13, w2) else _layer_op
    return op(x, topk_idx, topk_weights, w13, w2, comm._id, num_experts, layout, capacity,
              max_tokens, sms, block_n)


_HF_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _require_silu_gate(fn, what: str, fused: bool, device):
    """Refuses experts whose gate is not moe_layer's silu(gate) * up: calls the module's own gate
    function (fused: _apply_gate on [gate, up]; else act_fn on gate) on fp32 values on the
    weights' device (the CPU for meta weights), some past the clamps of clamped SwiGLUs
    (DeepSeek-V4, GLM, ... limit their gates), against SiLU's."""
    if device.type == "meta":
        device = torch.device("cpu")
    gate = torch.linspace(-100.0, 100.0, 201, device=device)
    up = torch.linspace(100.0, -100.0, 201, device=device)
    want = torch.nn.functional.silu(gate) * up if fused else torch.nn.functional.silu(gate)
    problem = None
    try:
        with torch.no_grad():
            got = fn(torch.cat([gate, up])[None])[0] if fused else fn(gate)
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape
                and torch.allclose(got.to(want), want, rtol=1e-3, atol=1e-5)):
            problem = "it does not compute " + ("silu(gate) * up" if fused else "SiLU")
    except Exception as e:  # noqa: BLE001 - any failure: the gate cannot be shown to be SiLU's
        problem = f"calling it raised {type(e).__name__}: {e}"
    if problem is not None:
        raise ValueError(f"mkernel.moe_weights_from_hf: the experts' {what} is not this layer's "
                         f"SwiGLU (silu(gate) * up, unclamped): {problem}")


def moe_weights_from_hf(experts):
    """(w13 [E, 2I, H], w2 [E, H, I]) from Hugging Face MoE experts, in their order.

    experts: either the expert modules of the experts this rank holds - e.g.
    block.experts[r * E_local:(r + 1) * E_local] of a Mixtral block of transformers 4 (w1 = gate,
    w3 = up, w2 = down) or of a Qwen-MoE / DeepSeek block (gate_proj, up_proj, down_proj), each
    an nn.Linear with weight [out, in] - or a fused experts module (transformers 5: block.experts
    with gate_up_proj [E, 2I, H], the gate's rows then the up's, and down_proj [E, H, I]), whose
    experts all come back (slice this rank's). Returns contiguous tensors with the experts'
    dtype and device: copies for expert modules, the parameters themselves for a fused module
    whose parameters are contiguous already (an in-place change to them changes the model). Raises ValueError for experts that do not compute moe_layer's unclamped
    silu(gate) * up without biases (checked on the modules' own act_fn / _apply_gate): their
    weights would give another layer's outputs.
    """
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
        if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True) \
                or getattr(experts, "has_bias", False):
            raise ValueError("mkernel.moe_weights_from_hf: fused experts with transposed, "
                             "interleaved or biased gate_up_proj are not this layer's SwiGLU")
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2 != 0 or \
                tuple(down.shape) != (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
            raise ValueError(f"mkernel.moe_weights_from_hf: fused experts gate_up_proj "
                             f"{tuple(gate_up.shape)} and down_proj {tuple(down.shape)}; expected "
                             "[E, 2I, H] and [E, H, I]")
        if getattr(experts, "has_post_expert_norm", False):
            raise ValueError("mkernel.moe_weights_from_hf: fused experts with a norm after each "
                             "expert are not this layer's SwiGLU")
        if callable(getattr(experts, "_apply_gate", None)):
            _require_silu_gate(experts._apply_gate, "gate (_apply_gate)", True, gate_up.device)
        elif callable(getattr(experts, "act_fn", None)):
            _require_silu_gate(experts.act_fn, "activation (act_fn)", False, gate_up.device)
        return gate_up.detach().contiguous(), down.detach().contiguous()
    experts = list(experts)
    if not experts:
        raise ValueError("mkernel.moe_weights_from_hf: no experts given")
    for gate_name, up_name, down_name in _HF_NAMES:
        if all(hasattr(e, gate_name) and hasattr(e, up_name) and hasattr(e, down_name)
               for e in experts):
            for e in experts:
                for name in (gate_name, up_name, down_name):
                    if getattr(getattr(e, name), "bias", None) is not None:
                        raise ValueError(f"mkernel.moe_weights_from_hf: the experts' {name} has "
                                         "a bias, which this layer's SwiGLU does not add")
                if callable(getattr(e, "act_fn", None)):
                    _require_silu_gate(e.act_fn, "activation (act_fn)", False,
                                       getattr(e, gate_name).weight.device)
            w13 = torch.stack([torch.cat([getattr(e, gate_name).weight.detach(),
                                          getattr(e, up_name).weight.detach()], dim=0)
                               for e in experts])
            w2 = torch.stack([getattr(e, down_name).weight.detach() for e in experts])
            return w13.contiguous(), w2.contiguous()
    raise ValueError("mkernel.moe_weights_from_hf: the experts have neither gate_proj / up_proj / "
                     "down_proj nor w1 / w3 / w2 (nor fused gate_up_proj / down_proj)")
