"""Compressed attention as two dense causal attentions through torch's cuDNN SDPA kernels.

Query t sees the compressed rows i <= floor((t - l + 1) / d). Write t = d*m + r with 0 <= r < d;
since d divides l, that bound is m - l/d for r < d - 1 and m - l/d + 1 for r = d - 1. For a fixed
residue r the queries m therefore form a plain causal attention over the compressed rows, shifted
by a constant, and the branch splits into two causal attentions over strided views of q (the
residue is the batch dimension, so nothing is copied in):

  group A: residues 0 .. d-2, queries m >= l/d;     query m' = m - l/d     sees rows i <= m'
  group B: residue  d-1,      queries m >= l/d - 1; query m' = m - l/d + 1 sees rows i <= m'

Queries t < l - 1 see no row: o = 0, lse = -inf. Both groups are square (rows = queries), so the
top-left causal mask of the dense kernel is the compressed mask exactly. On an H100 cuDNN's fused
attention runs this at 489 TFLOP/s forward and 422 backward, against 424 / 292 for the Triton
kernel at T = 64k, l = 32, d = 16 (H200, bench/results/compressed_routing.csv). The routing table
defers to Triton where that does not pay off (short residue sequences).

cuDNN's backward has no input for an lse gradient; with a dlse the Triton backward runs instead
(it takes any correct o and lse).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .kernels.utils import unit_last_stride


def _groups(T: int, block_len: int, block_stride: int) -> list[tuple[int, int, int, int]]:
    """(first residue, residues, first m, queries = rows) of groups A and B, non-empty ones."""
    d, M, lead = block_stride, T // block_stride, block_len // block_stride
    groups = [(0, d - 1, lead, M - lead), (d - 1, 1, lead - 1, M - lead + 1)]
    return [g for g in groups if g[1] > 0 and g[3] > 0]


def _residues(x: Tensor, d: int, r0: int, nres: int, m0: int, M: int) -> Tensor:
    """x [T, HQ, D] (one batch row) as [nres, HQ, M, D]: element [j, h, m', :] is query
    t = d * (m0 + m') + r0 + j. A view: the residue is a batch stride of HQ * D."""
    _, hq, dim = x.shape
    sh, st = x.stride(1), x.stride(0)
    return x.as_strided((nres, hq, M, dim), (st, sh, d * st, x.stride(2)),
                        x.storage_offset() + (m0 * d + r0) * st)


def _residue_stats(s: Tensor, d: int, r0: int, nres: int, m0: int, M: int) -> Tensor:
    """s [T, HQ] (one batch row of lse) as [nres, HQ, M]: `_residues` of a unit last dim."""
    return _residues(s.unsqueeze(-1), d, r0, nres, m0, M)[..., 0]


def _rows(x: Tensor, nres: int, M: int) -> Tensor:
    """Compressed rows x [NC, H, D] (one batch row) as [nres, H, M, D]: rows 0..M-1, shared by
    every residue through a zero batch stride."""
    return x[:M].permute(1, 0, 2).unsqueeze(0).expand(nres, -1, -1, -1)


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    """lse and dk/dv sums: float32, float64 for float64 inputs (the CPU tests' math kernels)."""
    return torch.promote_types(dtype, torch.float32)


def _dense_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention [B, HQ, M, D] over [B, H, M, D] (GQA): (o, lse [B, HQ, M] float32)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return out[0], out[1].view(q.shape[:3])


def _dense_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    # None for attn_bias and the sequence offsets: an undefined tensor, as SDPA's own autograd
    # passes them (an empty cum_seq tensor would select cuDNN's packed, nested layout)
    unused = torch.empty(0, device=q.device)
    M = q.shape[2]
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse.unsqueeze(-1), unused, unused, None, None, None, M, M, 0.0, True,
        scale=scale)


def compressed_attention_fwd(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, block_len: int,
                             block_stride: int, scale: float,
                             cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """o [B,T,HQ,Dv] (q.dtype), lse [B,T,HQ] float32. Fixed-length batches with T % d == 0
    (the routing table refuses others)."""
    assert cu_seqlens is None and q.shape[1] % block_stride == 0
    q, k_cmp, v_cmp = (unit_last_stride(x) for x in (q, k_cmp, v_cmp))
    B, T, HQ, _ = q.shape
    o = torch.empty(B, T, HQ, v_cmp.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=_accumulate(q.dtype), device=q.device)
    blind = min(T, block_len - 1)  # queries before the first full block see no row
    o[:, :blind] = 0
    lse[:, :blind] = float("-inf")
    for b in range(B):
        for r0, nres, m0, M in _groups(T, block_len, block_stride):
            view = (block_stride, r0, nres, m0, M)
            o_g, lse_g = _dense_fwd(_residues(q[b], *view), _rows(k_cmp[b], nres, M),
                                    _rows(v_cmp[b], nres, M), scale)
            _residues(o[b], *view).copy_(o_g)
            _residue_stats(lse[b], *view).copy_(lse_g)
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
    assert cu_seqlens is None and q.shape[1] % block_stride == 0
    B, T = q.shape[:2]
    q, k_cmp, v_cmp, o, do = (unit_last_stride(x.to(q.dtype)) for x in (q, k_cmp, v_cmp, o, do))
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dq[:, :min(T, block_len - 1)] = 0
    acc = _accumulate(q.dtype)
    dk = torch.zeros(k_cmp.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v_cmp.shape, dtype=acc, device=q.device)
    for b in range(B):
        for r0, nres, m0, M in _groups(T, block_len, block_stride):
            view = (block_stride, r0, nres, m0, M)
            dq_g, dk_g, dv_g = _dense_bwd(
                _residues(do[b], *view), _residues(q[b], *view), _rows(k_cmp[b], nres, M),
                _rows(v_cmp[b], nres, M), _residues(o[b], *view),
                _residue_stats(lse[b], *view).contiguous(), scale)
            _residues(dq[b], *view).copy_(dq_g)
            # one gradient per residue (the rows were broadcast over them): sum in fp32
            dk[b, :M] += dk_g.sum(0, dtype=acc).permute(1, 0, 2)
            dv[b, :M] += dv_g.sum(0, dtype=acc).permute(1, 0, 2)
    return dq, dk.to(k_cmp.dtype), dv.to(v_cmp.dtype)
