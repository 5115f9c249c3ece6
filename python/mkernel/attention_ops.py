"""The attention engine (mkernel/attention.h) as a PyTorch custom op.

    o = mkernel.attention(q, k, v, causal=True)
    o, lse = mkernel.attention(q, k, v, return_lse=True)

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
from typing import Optional

from mkernel import _C, _current_device, _current_raw_stream, _direct

import torch

__all__ = ["attention"]

_HEAD_DIMS = (64, 128)


def _attention_shapes(q, k, v):
    """(B, S_q, S_kv, H, H_kv, D), or ValueError naming the problem."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"mkernel.attention: {name} must be 4-D [batch, seq, heads, "
                             f"head_dim]; got {tuple(x.shape)}")
    b, s_q, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"mkernel.attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    bk, s_kv, h_kv, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(f"mkernel.attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ "
                         "in batch or head_dim")
    if d not in _HEAD_DIMS:
        raise ValueError(f"mkernel.attention: head_dim = {d}; expected 64 or 128")
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"mkernel.attention: {h} query heads are not a multiple of {h_kv} "
                         "key/value heads")
    return b, s_q, s_kv, h, h_kv, d


def _readable(x):
    """x itself where the copy engine reads it (last dimension contiguous, strides multiples of
    8 elements, 16-byte aligned), else a contiguous copy."""
    ok = (x.stride(3) == 1 and all(x.stride(i) % 8 == 0 for i in range(3))
          and x.data_ptr() % 16 == 0)
    return x if ok else x.contiguous()


def _attention_impl(q, k, v, causal, softmax_scale, return_lse):
    b, s_q, s_kv, h, h_kv, d = _attention_shapes(q, k, v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != torch.bfloat16:
            raise ValueError(f"mkernel.attention: {name} has dtype {x.dtype}; expected bfloat16")
        if not x.is_cuda or x.device != q.device:
            raise ValueError(f"mkernel.attention: {name} is on {x.device}, q on {q.device}; "
                             "expected one CUDA device")
    if softmax_scale is not None and not (softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise ValueError(f"mkernel.attention: softmax_scale = {softmax_scale}; expected a "
                         "finite value > 0 (None: 1 / sqrt(head_dim))")
    o = torch.empty((b, s_q, h, d), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((b, h, s_q) if return_lse else (0,), dtype=torch.float32, device=q.device)
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


@_attention_op.register_fake
def _attention_fake(q, k, v, causal, softmax_scale, return_lse):
    b, s_q, _, h, _, d = _attention_shapes(q, k, v)
    return q.new_empty((b, s_q, h, d)), q.new_empty((b, h, s_q) if return_lse else (0,),
                                                    dtype=torch.float32)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: Optional[float] = None, return_lse: bool = False):
    """O = softmax(softmax_scale * q k^T [causal]) v per batch and head (see the module doc).

    Returns O [B, S_q, H, D] bf16, or (O, LSE [B, H, S_q] fp32) with return_lse=True.
    softmax_scale None: 1 / sqrt(D).
    """
    op = _attention_impl if _direct(q, k, v) else _attention_op
    o, lse = op(q, k, v, causal, softmax_scale, return_lse)
    return (o, lse) if return_lse else o
