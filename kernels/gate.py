"""The gated combine of the three branches (NSA-SPEC "Gate") as one Triton kernel each way.

o = g_cmp*o_cmp + g_slc*o_slc + g_win*o_win, gates [B,T,HQ] broadcast over Dv; o_win = g_win =
None leaves the window branch out (nsa_attention's window=0, fla's window_size=0). The oracle is
`nsa_ops.reference.gate_combine` / `gate_combine_backward`. Eagerly, the torch expression runs five
kernels (three broadcasting multiplies, two adds) and writes four intermediates; at 64k tokens
that is ~5 ms of the NSA forward on an H100. One pass reads the branch outputs once, sums in
fp32 and writes o; the backward writes the three branch grads and, when the gates need grads,
their row sums of dO * o in the same pass (for a branch whose backward takes dO and its gate
instead of g * dO, the fp32 sums in place of its grad: its delta). Under torch.compile Inductor
fuses the expression itself (into the selection template's epilogue), so nsa_attention uses
these only eagerly, and there the selection forward's own epilogue runs the combine
(`gated_rows`) where the Triton kernel serves the branch.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_ops.kernels.utils import cdiv, launch, pow2

# Rows (tokens x heads) per program: 32 rows of 128 values is 8 KB per input, enough loads in
# flight to stream at HBM speed.
BLOCK_BYTES = 8192


@triton.jit
def _tile(ptr, rows, rmask, DV: tl.constexpr, DVP: tl.constexpr):
    cols = tl.arange(0, DVP)
    mask = rmask[:, None] & (cols[None, :] < DV)
    return tl.load(ptr + rows[:, None] * DV + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, rows, rmask, x, DV: tl.constexpr, DVP: tl.constexpr):
    cols = tl.arange(0, DVP)
    mask = rmask[:, None] & (cols[None, :] < DV)
    tl.store(ptr + rows[:, None] * DV + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate(ptr, rows, rmask, stride):
    return tl.load(ptr + rows * stride, mask=rmask, other=0.0).to(tl.float32)


@triton.jit
def gated_rows(o_slc, OC, OW, GC, GS, GW, rows, rmask, sgc, sgs, sgw, DV: tl.constexpr,
               DVP: tl.constexpr, HAS_WIN: tl.constexpr):
    """The combine of rows (fp32), the selection branch's given as the fp32 tile o_slc: what
    this module's forward kernel sums, and the selection forward's epilogue where it runs the
    combine itself (`selection_attention_gated_fwd`)."""
    acc = _gate(GC, rows, rmask, sgc)[:, None] * _tile(OC, rows, rmask, DV, DVP)
    acc += _gate(GS, rows, rmask, sgs)[:, None] * o_slc
    if HAS_WIN:
        acc += _gate(GW, rows, rmask, sgw)[:, None] * _tile(OW, rows, rmask, DV, DVP)
    return acc


@triton.jit
def _fwd_kernel(OC, OS, OW, GC, GS, GW, O, R, sgc, sgs, sgw,
                DV: tl.constexpr, DVP: tl.constexpr, BLOCK_R: tl.constexpr, HAS_WIN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    acc = gated_rows(_tile(OS, rows, rmask, DV, DVP), OC, OW, GC, GS, GW, rows, rmask, sgc, sgs,
                     sgw, DV, DVP, HAS_WIN)
    _store(O, rows, rmask, acc, DV, DVP)


@triton.jit
def _bwd_kernel(DO, OC, OS, OW, GC, GS, GW, DOC, DOS, DOW, DGC, DGS, DGW, R, sgc, sgs, sgw,
                DV: tl.constexpr, DVP: tl.constexpr, BLOCK_R: tl.constexpr,
                GATE_GRADS: tl.constexpr, HAS_WIN: tl.constexpr, CMP_GRAD: tl.constexpr,
                SLC_GRAD: tl.constexpr, WIN_GRAD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    do = _tile(DO, rows, rmask, DV, DVP)
    if CMP_GRAD:
        _store(DOC, rows, rmask, _gate(GC, rows, rmask, sgc)[:, None] * do, DV, DVP)
    if SLC_GRAD:
        _store(DOS, rows, rmask, _gate(GS, rows, rmask, sgs)[:, None] * do, DV, DVP)
    if HAS_WIN and WIN_GRAD:
        _store(DOW, rows, rmask, _gate(GW, rows, rmask, sgw)[:, None] * do, DV, DVP)
    # a branch that takes dO and its gate gets its rows' sums (its delta) whether or not the
    # gates need grads
    if GATE_GRADS or not CMP_GRAD:
        tl.store(DGC + rows, tl.sum(do * _tile(OC, rows, rmask, DV, DVP), axis=1), mask=rmask)
    if GATE_GRADS or not SLC_GRAD:
        tl.store(DGS + rows, tl.sum(do * _tile(OS, rows, rmask, DV, DVP), axis=1), mask=rmask)
    if HAS_WIN and (GATE_GRADS or not WIN_GRAD):
        tl.store(DGW + rows, tl.sum(do * _tile(OW, rows, rmask, DV, DVP), axis=1), mask=rmask)


def _launch(o: Tensor) -> tuple[int, dict]:
    """(programs, constexprs) for outputs shaped like o."""
    rows, dv = o.numel() // o.shape[-1], o.shape[-1]
    dvp = pow2(dv)
    block_r = max(1, min(128, BLOCK_BYTES // (dvp * o.element_size())))
    return cdiv(rows, block_r), dict(DV=dv, DVP=dvp, BLOCK_R=block_r)


def _gate_rows(g: Tensor) -> tuple[Tensor, int]:
    """g [B,T,HQ] as (tensor, row stride) over its B*T*HQ rows: the module's gates are strided
    slices of one [B,T,HQ,3] tensor, which flatten to a view with stride 3, not a copy."""
    flat = g.reshape(-1)
    return flat, flat.stride(0) if flat.numel() > 1 else 1


def _present(o_cmp: Tensor, o_slc: Tensor, o_win: Optional[Tensor], g_cmp: Tensor,
             g_slc: Tensor, g_win: Optional[Tensor]) -> tuple[list, list]:
    """(branch outputs, gates) of the branches present."""
    if o_win is None:
        return [o_cmp, o_slc], [g_cmp, g_slc]
    return [o_cmp, o_slc, o_win], [g_cmp, g_slc, g_win]


def _pointers(branches: list, gates: list) -> tuple[list, list]:
    """Contiguous branch outputs and (gate, row stride) pairs, three each: an absent window
    branch passes the compressed branch's, which HAS_WIN=False never reads."""
    outs = [x.contiguous() for x in branches]
    rows = [_gate_rows(g) for g in gates]
    return outs + outs[:3 - len(outs)], rows + rows[:3 - len(rows)]


def gated_rows_args(o_cmp: Tensor, o_win: Optional[Tensor], g_cmp: Tensor, g_slc: Tensor,
                    g_win: Optional[Tensor]) -> tuple:
    """`gated_rows`'s tensor and stride arguments (OC, OW, GC, GS, GW, sgc, sgs, sgw) for a
    kernel that has the selection branch's output in hand."""
    branches, gates = _present(o_cmp, o_cmp, o_win, g_cmp, g_slc, g_win)
    outs, rows = _pointers(branches, gates)
    return (outs[0], outs[2], *(g for g, _ in rows), *(s for _, s in rows))


def gate_combine_fwd(o_cmp: Tensor, o_slc: Tensor, o_win: Optional[Tensor], g_cmp: Tensor,
                     g_slc: Tensor, g_win: Optional[Tensor]) -> Tensor:
    """o [B,T,HQ,Dv] in the dtype the torch expression would give (fp32 sums, one rounding)."""
    branches, gates = _present(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win)
    dtype = o_cmp.dtype
    for x in branches + gates:
        dtype = torch.promote_types(dtype, x.dtype)
    out = torch.empty(o_cmp.shape, dtype=dtype, device=o_cmp.device)
    if out.numel() == 0:
        return out
    outs, rows = _pointers(branches, gates)
    programs, meta = _launch(out)
    launch(_fwd_kernel)[(programs,)](*outs, *(g for g, _ in rows), out,
                                     out.numel() // out.shape[-1], *(s for _, s in rows),
                                     HAS_WIN=o_win is not None, **meta)
    return out


def gate_combine_bwd(do: Tensor, o_cmp: Tensor, o_slc: Tensor, o_win: Optional[Tensor],
                     g_cmp: Tensor, g_slc: Tensor, g_win: Optional[Tensor], gate_grads: bool,
                     branch_grads: tuple[bool, bool, bool] = (True, True, True)
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d_o_cmp, d_o_slc, d_o_win, d_g_cmp, d_g_slc, d_g_win); an absent window branch's grads
    and, unless gate_grads, the gate grads are empty [0] tensors. Where branch_grads
    (compressed, selection, window) says False, that branch's slot holds instead its rows'
    rowsum(dO * o) (fp32 [B, T, HQ]): nsa_attention's eager backward hands that branch's kernels
    dO and the gate (`Route.scales_do`), and these sums as their delta."""
    branches, gates = _present(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win)
    wanted = tuple(branch_grads)
    d_o = [torch.empty(x.shape if want else (0,), dtype=x.dtype, device=x.device)
           for x, want in zip(branches, wanted)]
    d_g = [torch.empty(g.shape if gate_grads or not want else (0,), dtype=torch.float32,
                       device=g.device) for g, want in zip(gates, wanted)]
    if do.numel() > 0:
        outs, rows = _pointers(branches, gates)
        programs, meta = _launch(do)
        launch(_bwd_kernel)[(programs,)](
            do.contiguous(), *outs, *(g for g, _ in rows), *(d_o + d_o[:3 - len(d_o)]),
            *(d_g + d_g[:3 - len(d_g)]), do.numel() // do.shape[-1], *(s for _, s in rows),
            GATE_GRADS=gate_grads, HAS_WIN=o_win is not None, CMP_GRAD=branch_grads[0],
            SLC_GRAD=branch_grads[1], WIN_GRAD=branch_grads[2], **meta)
    d_o = [x if want else sums for x, sums, want in zip(d_o, d_g, wanted)]
    d_g = [x.to(g.dtype) if gate_grads else g.new_empty(0) for x, g in zip(d_g, gates)]
    if o_win is None:
        d_o.append(do.new_empty(0))
        d_g.append(do.new_empty(0))
    return (*d_o, *d_g)
