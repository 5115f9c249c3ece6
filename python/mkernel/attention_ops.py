"""The attention engine (mkernel/attention.h) and ring attention as PyTorch custom ops.

    o = mkernel.attention(q, k, v, causal=True)
    o, lse = mkernel.attention(q, k, v, return_lse=True)

    q_local = mkernel.zigzag_shard(q, comm)                         # this rank's share
    o_local = mkernel.ring_attention(q_local, k_local, v_local, comm, causal=True)
    o = mkernel.zigzag_unshard(o_local, comm)                        # every rank's, in order

q [B, S_q, H, D], k and v [B, S_kv, H_kv, D] bf16 on one Hopper GPU (the flash-attn layout; the
last dimension contiguous, other strides as they come where the copy engine can read them - a
multiple of 8 elements - else a contiguous copy is made), H a multiple of H_kv (GQA, MQA), D 64
or 128, any S. causal is bottom-right aligned (flash-attn's convention: query i sees the keys
j <= i + S_kv - S_q); a query that sees no key gets O = 0 and LSE = -inf. LSE [B, H, S_q] fp32 is
the natural log of the row's softmax denominator, scores scaled. torch.ops.mkernel.attention runs
on the current stream without host synchronisation, under torch.compile (fake implementation)
and in CUDA graphs.
"""

from __future__ import annotations

import math
import struct
from typing import Optional

from mkernel import _C, _check_device, _communicator, _current_device, _current_raw_stream, _direct

import torch

__all__ = ["attention", "ring_attention", "zigzag_shard", "zigzag_unshard"]

_HEAD_DIMS = (64, 128)


def _attention_shapes(q, k, v, op="attention"):
    """(B, S_q, S_kv, H, H_kv, D), or ValueError naming the op and the problem."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"mkernel.{op}: {name} must be 4-D [batch, seq, heads, "
                             f"head_dim]; got {tuple(x.shape)}")
    b, s_q, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"mkernel.{op}: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    bk, s_kv, h_kv, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(f"mkernel.{op}: q {tuple(q.shape)} and k {tuple(k.shape)} differ "
                         "in batch or head_dim")
    if d not in _HEAD_DIMS:
        raise ValueError(f"mkernel.{op}: head_dim = {d}; expected 64 or 128")
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"mkernel.{op}: {h} query heads are not a multiple of {h_kv} "
                         "key/value heads")
    return b, s_q, s_kv, h, h_kv, d


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _dense(x):
    """x with the contiguous layout's strides, 16-byte aligned: x itself where it is, else a
    copy. (Not x.contiguous(), which returns x itself whenever torch calls it contiguous - at
    any alignment, and whatever the strides of its size-1 dimensions.)"""
    if x.stride() == _contiguous_strides(x.shape) and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _readable(x):
    """x itself where the copy engine reads it (last dimension contiguous, strides multiples of
    8 elements and not 0 - the C++ layer reads a 0 stride as the contiguous one, so a broadcast
    dimension (expand) must be copied - 16-byte aligned), else a contiguous copy."""
    ok = (x.stride(3) == 1
          and all(x.stride(i) % 8 == 0 and (x.stride(i) != 0 or x.shape[i] == 1)
                  for i in range(3))
          and x.data_ptr() % 16 == 0)
    return x if ok else _dense(x)


def _check_inputs(op, q, k, v, softmax_scale):
    """dtypes and the scale, or ValueError naming the op."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != torch.bfloat16:
            raise ValueError(f"mkernel.{op}: {name} has dtype {x.dtype}; expected bfloat16")
    if softmax_scale is not None and not (softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise ValueError(f"mkernel.{op}: softmax_scale = {softmax_scale}; expected a finite "
                         "value > 0 (None: 1 / sqrt(head_dim))")
    # The kernels take the scale as a float32, whose 0 means the default: a scale below float32's
    # smallest subnormal would silently become 1 / sqrt(head_dim), one above its largest inf.
    if softmax_scale is not None:
        try:
            as_float32 = struct.unpack("f", struct.pack("f", softmax_scale))[0]
        except OverflowError:
            as_float32 = math.inf
        if as_float32 == 0 or math.isinf(as_float32):
            raise ValueError(f"mkernel.{op}: softmax_scale = {softmax_scale} is "
                             f"{as_float32} as a float32, which the kernels take; expected a "
                             "value between 1.4e-45 and 3.4e38")


def _outputs(q, b, s_q, h, d, return_lse):
    """O [B, S_q, H, D] bf16 and LSE [B, H, S_q] fp32 (or an empty one)."""
    return (torch.empty((b, s_q, h, d), dtype=torch.bfloat16, device=q.device),
            torch.empty((b, h, s_q) if return_lse else (0,), dtype=torch.float32,
                        device=q.device))


def _attention_impl(q, k, v, causal, softmax_scale, return_lse):
    b, s_q, s_kv, h, h_kv, d = _attention_shapes(q, k, v)
    _check_inputs("attention", q, k, v, softmax_scale)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_cuda or x.device != q.device:
            raise ValueError(f"mkernel.attention: {name} is on {x.device}, q on {q.device}; "
                             "expected one CUDA device")
    o, lse = _outputs(q, b, s_q, h, d, return_lse)
    if o.numel() == 0:
        return o, lse
    if s_kv == 0:  # no key at all
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    q2, k2, v2 = _readable(q), _readable(k), _readable(v)
    dev = q.get_device()
    with _current_device(dev):
        _C.attention(q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), o.data_ptr(),
                     lse.data_ptr() if return_lse else 0, tuple(q2.stride()[:3]),
                     tuple(k2.stride()[:3]), tuple(v2.stride()[:3]), b, s_q, s_kv, h, h_kv, d,
                     causal, 0.0 if softmax_scale is None else float(softmax_scale),
                     _current_raw_stream(dev))
    return o, lse


_attention_op = torch.library.custom_op(
    "mkernel::attention", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, bool return_lse) "
           "-> (Tensor, Tensor)",
)(_attention_impl)


def _fake(q, k, v, return_lse):
    b, s_q, _, h, _, d = _attention_shapes(q, k, v)
    return q.new_empty((b, s_q, h, d)), q.new_empty((b, h, s_q) if return_lse else (0,),
                                                    dtype=torch.float32)


@_attention_op.register_fake
def _attention_fake(q, k, v, causal, softmax_scale, return_lse):
    return _fake(q, k, v, return_lse)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: Optional[float] = None, return_lse: bool = False):
    """O = softmax(softmax_scale * q k^T [causal]) v per batch and head (see the module doc).

    Returns O [B, S_q, H, D] bf16, or (O, LSE [B, H, S_q] fp32) with return_lse=True.
    softmax_scale None: 1 / sqrt(D).
    """
    op = _attention_impl if _direct(q, k, v) else _attention_op
    o, lse = op(q, k, v, causal, softmax_scale, return_lse)
    return (o, lse) if return_lse else o


# ---- ring attention --------------------------------------------------------------------------

def _ring_shapes(q, k, v, causal):
    """(B, S_local, H, H_kv, D), or ValueError naming the problem (the op and its fake)."""
    b, s_q, s_kv, h, h_kv, d = _attention_shapes(q, k, v, "ring_attention")
    if s_q != s_kv:
        raise ValueError(f"mkernel.ring_attention: q has {s_q} rows and k {s_kv}; expected both "
                         "= S_local, this rank's share of the sequence")
    if causal and s_q % 2 != 0:
        raise ValueError(f"mkernel.ring_attention: causal with S_local = {s_q}; expected an even "
                         "S_local (the zigzag share: two chunks of S_local / 2)")
    return b, s_q, h, h_kv, d


def _ring_impl(q, k, v, comm, causal, softmax_scale, return_lse):
    c = _communicator(comm, "ring_attention")
    b, s, h, h_kv, d = _ring_shapes(q, k, v, causal)
    _check_inputs("ring_attention", q, k, v, softmax_scale)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_device("ring_attention", name, x, c._device)
    o, lse = _outputs(q, b, s, h, d, return_lse)
    if o.numel() == 0:
        return o, lse
    q2, k2, v2 = _readable(q), _readable(k), _readable(v)
    if k2.stride() != v2.stride():  # (the C++ layer takes one set of strides for both)
        k2, v2 = _dense(k2), _dense(v2)
    ws = c._workspace(_C.ring_attention_workspace_bytes(c._impl, b, s, h, h_kv, d, causal),
                      "ring_attention", "ring")
    _C.ring_attention(c._impl, q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), o.data_ptr(),
                      lse.data_ptr() if return_lse else 0, tuple(q2.stride()[:3]),
                      tuple(k2.stride()[:3]), b, s, h, h_kv, d, causal,
                      0.0 if softmax_scale is None else float(softmax_scale), ws.data_ptr(),
                      c._stream())
    return o, lse


_ring_op = torch.library.custom_op(
    "mkernel::ring_attention", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, int comm, bool causal, float? softmax_scale, "
           "bool return_lse) -> (Tensor, Tensor)",
)(_ring_impl)


@_ring_op.register_fake
def _ring_fake(q, k, v, comm, causal, softmax_scale, return_lse):
    _ring_shapes(q, k, v, causal)
    return _fake(q, k, v, return_lse)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, causal: bool = True,
                   softmax_scale: Optional[float] = None, return_lse: bool = False):
    """Sequence-parallel attention: this rank's queries over the whole sequence, one launch.

    q [B, S_local, H, D], k and v [B, S_local, H_kv, D] bf16: this rank's share of the sequence -
    causal: its zigzag share (zigzag_shard: chunks r and 2w - 1 - r of 2w, S_local even), else
    the contiguous r-th share. Returns O [B, S_local, H, D] bf16 in the same order (and LSE
    [B, H, S_local] fp32 with return_lse=True). Any world size; key / value chunks travel
    between the GPUs while the attention engine works on the one that has arrived (across
    nodes: a launch a node, the chunks moving node to node between them).
    Every rank calls it (same shapes, same order: ranks on a node that differ in B, S_local, H,
    H_kv, D or causal get MkernelError(code='invalid_argument') from comm.synchronize() naming
    both ranks, and no key or value moves). torch.ops.mkernel.ring_attention: current
    stream, torch.compile, CUDA graphs (make one call with the shape before capturing: the
    first allocates the communicator's workspace, collectively).
    """
    op = _ring_impl if _direct(q, k, v) else _ring_op
    o, lse = op(q, k, v, comm._id, causal, softmax_scale, return_lse)
    return (o, lse) if return_lse else o


def zigzag_shard(x: torch.Tensor, comm, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag share of a full sequence along `dim`: of 2 w equal chunks, chunks r and
    2 w - 1 - r, concatenated (a copy). The length along dim must be a multiple of 2 w."""
    w, r = comm.world_size, comm.rank
    if x.shape[dim] % (2 * w) != 0:
        raise ValueError(f"mkernel.zigzag_shard: length {x.shape[dim]} along dim {dim} is not a "
                         f"multiple of 2 x world = {2 * w}")
    chunks = x.chunk(2 * w, dim=dim)
    return torch.cat([chunks[r], chunks[2 * w - 1 - r]], dim=dim)


def zigzag_unshard(x: torch.Tensor, comm, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's zigzag share along `dim` (all_gather over the
    communicator's process group - the one mkernel.init was given, whose ranks are the
    communicator's -, then the chunks put back in order); the inverse of zigzag_shard.
    Not differentiable (torch.distributed.all_gather is not): with gradients enabled, x must not
    require one - detach it or call under torch.no_grad()."""
    import torch.distributed as dist
    if torch.is_grad_enabled() and x.requires_grad:
        # The gathered copies carry no gradient: the result would silently cut x (and whatever
        # produced it, e.g. ring_attention's op, whose missing backward would never be reached)
        # out of the graph.
        raise RuntimeError("mkernel.zigzag_unshard: x requires grad, but the gathered result "
                           "would not propagate it (torch.distributed.all_gather is not "
                           "differentiable); pass x.detach() or call it under torch.no_grad()")
    w = comm.world_size
    if x.shape[dim] % 2 != 0:
        raise ValueError(f"mkernel.zigzag_unshard: length {x.shape[dim]} along dim {dim} is odd; a "
                         "zigzag share is two equal chunks")
    parts = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(parts, x.contiguous(), group=getattr(comm, "group", None))
    chunks = [None] * (2 * w)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * w - 1 - r] = first, second
    return torch.cat(chunks, dim=dim)
