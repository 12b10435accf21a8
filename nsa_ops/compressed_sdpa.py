"""Compressed attention as dense attentions through torch's cuDNN SDPA kernels.

Query t sees the compressed rows i <= floor((t - l + 1) / d). Write t = l - 1 + d*m + j with
0 <= j < d: it sees rows i <= m, whatever j. So the queries t >= l - 1 in whole groups of d form
one causal attention per j over the rows (j is the batch dimension of a strided view of q, m its
query index; nothing is copied in), and the M = (T - l + 1) // d of them are square (rows =
queries), so the dense kernel's top-left causal mask is the compressed mask exactly. The last
(T - l + 1) % d queries (one when d divides T and l) all see rows 0..M: one attention without a
mask. cuDNN lays its output out like the q view, i.e. as the tokens l - 1 .. l - 2 + d*M in
order, so writing it into o is one contiguous copy.

Queries t < l - 1 see no row: o = 0, lse = -inf. On an H100 cuDNN's fused attention runs this at
489 TFLOP/s forward and 422 backward, against 424 / 292 for the Triton kernel at T = 64k, l = 32,
d = 16 (H200, bench/results/compressed_routing.csv). The routing table defers to Triton where
that does not pay off (short sequences per residue).

cuDNN's backward has no input for an lse gradient; with a dlse the Triton backward runs instead
(it takes any correct o and lse).

CUDA-graph capture: cuDNN builds an attention plan on its first call for a layout, with a device
allocation that capture forbids; torch then keeps the plan per thread. So each eager call here
records its layout for its thread (`plans_built`), and the routing table lets a capture run cuDNN
only for a layout recorded on the capturing thread (torch.cuda.make_graphed_callables and
torch.compile's cudagraphs run their calls eagerly before capturing), the Triton kernel otherwise.
"""
from __future__ import annotations

import threading
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .kernels.utils import unit_last_stride


class _Part(NamedTuple):
    """Queries t = first + d*m + j (j < nres, m < queries) attending rows 0..rows-1."""
    first: int
    nres: int
    queries: int
    rows: int
    causal: bool


def _parts(T: int, block_len: int, block_stride: int) -> list[_Part]:
    """The causal attention of the whole groups of d queries and the unmasked one of the rest,
    non-empty ones."""
    d, first = block_stride, block_len - 1
    seen = max(0, T - first)  # queries that see a row
    M, rest = divmod(seen, d)
    parts = [_Part(first, d, M, M, True), _Part(first + d * M, rest, 1, M + 1, False)]
    return [p for p in parts if p.nres > 0 and p.queries > 0]


def _residues(x: Tensor, d: int, part: _Part) -> Tensor:
    """x [T, HQ, D] (one batch row) as [nres, HQ, queries, D]: element [j, h, m, :] is token
    first + d*m + j. A view: the residue is a batch stride of HQ * D."""
    _, hq, dim = x.shape
    st = x.stride(0)
    return x.as_strided((part.nres, hq, part.queries, dim), (st, x.stride(1), d * st, x.stride(2)),
                        x.storage_offset() + part.first * st)


def _residue_stats(s: Tensor, d: int, part: _Part) -> Tensor:
    """s [T, HQ] (one batch row of lse) as [nres, HQ, queries]: `_residues` of a unit last dim."""
    return _residues(s.unsqueeze(-1), d, part)[..., 0]


def _rows(x: Tensor, part: _Part) -> Tensor:
    """Compressed rows x [NC, H, D] (one batch row) as [nres, H, rows, D]: the part's rows,
    shared by every residue through a zero batch stride."""
    return x[:part.rows].permute(1, 0, 2).unsqueeze(0).expand(part.nres, -1, -1, -1)


# per thread, as torch keeps cuDNN's attention plans: the layouts whose plans this thread built
_threads = threading.local()


def _layout(q: Tensor, v_cmp: Tensor, block_len: int, block_stride: int, backward: bool) -> tuple:
    """What fixes the dense calls' shapes and strides, as the routing table sees the inputs."""
    return (q.device, q.dtype, tuple(q.shape), q.stride(), tuple(v_cmp.shape), v_cmp.stride(),
            block_len, block_stride, backward)


def plans_built(q: Tensor, v_cmp: Tensor, block_len: int, block_stride: int,
                backward: bool) -> bool:
    """Whether an eager call on this thread ran this direction's cuDNN calls on inputs laid out as
    q and v_cmp, so that their plans exist and a CUDA-graph capture may run them."""
    return _layout(q, v_cmp, block_len, block_stride, backward) in getattr(_threads, "built", ())


def _built(q: Tensor, v_cmp: Tensor, block_len: int, block_stride: int, backward: bool) -> None:
    if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        if not hasattr(_threads, "built"):
            _threads.built = set()
        _threads.built.add(_layout(q, v_cmp, block_len, block_stride, backward))


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    """lse and dk/dv sums: float32, float64 for float64 inputs (the CPU tests' math kernels)."""
    return torch.promote_types(dtype, torch.float32)


def _dense_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool
               ) -> tuple[Tensor, Tensor]:
    """Attention [B, HQ, M, D] over [B, H, N, D] (GQA), top-left causal if causal:
    (o, lse [B, HQ, M] float32)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].view(q.shape[:3])


def _dense_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
               scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    # None for attn_bias and the sequence offsets: an undefined tensor, as SDPA's own autograd
    # passes them (an empty cum_seq tensor would select cuDNN's packed, nested layout)
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse.unsqueeze(-1), unused, unused, None, None, None, q.shape[2],
        k.shape[2], 0.0, causal, scale=scale)


def _single_key_dv(do: Tensor, kv_heads: int, acc: torch.dtype) -> Tensor:
    """dv [1, H, Dv] of an attention of one query over one key per residue, do [nres, HQ, 1, Dv]:
    the softmax over one key is 1 whatever the score, so o = v, dq = dk = 0 and dv sums dO over
    the residues and the query heads of each KV head. cuDNN's backward refuses these calls
    ("s_q = s_kv = 1 is not supported"): the part that holds only the first d queries when
    T - l + 1 < 2d, or the last ones when none fills a group (T - l + 1 < d)."""
    return do.to(acc).unflatten(1, (kv_heads, -1)).sum((0, 2)).permute(1, 0, 2)


def _fixed_length(cu_seqlens: Optional[Tensor]) -> None:
    """What the routing table's cudnn row checks; a direct call gets a ValueError."""
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens: the cuDNN compressed attention takes fixed-length batches "
                         "only (the residue views need one length)")


def compressed_attention_fwd(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, block_len: int,
                             block_stride: int, scale: float,
                             cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """o [B,T,HQ,Dv] (q.dtype), lse [B,T,HQ] float32. Fixed-length batches (the routing table
    refuses others)."""
    _fixed_length(cu_seqlens)
    layout = (q, v_cmp, block_len, block_stride)
    q, k_cmp, v_cmp = (unit_last_stride(x) for x in (q, k_cmp, v_cmp))
    B, T, HQ, _ = q.shape
    o = torch.empty(B, T, HQ, v_cmp.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=_accumulate(q.dtype), device=q.device)
    blind = min(T, block_len - 1)  # queries before the first full block see no row
    o[:, :blind] = 0
    lse[:, :blind] = float("-inf")
    d = block_stride
    for b in range(B):
        for part in _parts(T, block_len, d):
            o_p, lse_p = _dense_fwd(_residues(q[b], d, part), _rows(k_cmp[b], part),
                                    _rows(v_cmp[b], part), scale, part.causal)
            _residues(o[b], d, part).copy_(o_p)
            _residue_stats(lse[b], d, part).copy_(lse_p)
    _built(*layout, backward=False)
    return o, lse


def compressed_attention_bwd(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, o: Tensor, lse: Tensor,
                             do: Tensor, dlse: Optional[Tensor], block_len: int,
                             block_stride: int, scale: float,
                             cu_seqlens: Optional[Tensor] = None
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk_cmp, dv_cmp) in the dtypes of (q, k_cmp, v_cmp)."""
    if dlse is not None:
        # imported here: the forward alone (inference) never needs Triton on this path
        from nsa_ops.kernels.compressed import compressed_attention_bwd as triton_bwd
        return triton_bwd(q, k_cmp, v_cmp, o, lse, do, dlse, block_len, block_stride, scale,
                          cu_seqlens)
    _fixed_length(cu_seqlens)
    B, T = q.shape[:2]
    layout = (q, v_cmp, block_len, block_stride)
    q, k_cmp, v_cmp, o, do = (unit_last_stride(x.to(q.dtype)) for x in (q, k_cmp, v_cmp, o, do))
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dq[:, :min(T, block_len - 1)] = 0
    acc = _accumulate(q.dtype)
    dk = torch.zeros(k_cmp.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v_cmp.shape, dtype=acc, device=q.device)
    d = block_stride
    for b in range(B):
        for part in _parts(T, block_len, d):
            if part.queries == 1 and part.rows == 1:
                _residues(dq[b], d, part).zero_()
                dv[b, :1] += _single_key_dv(_residues(do[b], d, part), v_cmp.shape[2], acc)
                continue
            dq_p, dk_p, dv_p = _dense_bwd(
                _residues(do[b], d, part), _residues(q[b], d, part), _rows(k_cmp[b], part),
                _rows(v_cmp[b], part), _residues(o[b], d, part),
                _residue_stats(lse[b], d, part).contiguous(), scale, part.causal)
            _residues(dq[b], d, part).copy_(dq_p)
            # one gradient per residue (the rows were broadcast over them): sum in fp32
            dk[b, :part.rows] += dk_p.sum(0, dtype=acc).permute(1, 0, 2)
            dv[b, :part.rows] += dv_p.sum(0, dtype=acc).permute(1, 0, 2)
    _built(*layout, backward=True)
    return dq, dk.to(k_cmp.dtype), dv.to(v_cmp.dtype)
