"""nsa_ops.nsa_attention: the whole NSA layer core on top of the torch.ops.nsa.* ops."""
from __future__ import annotations

from typing import Callable, Optional, Union

from torch import Tensor

from . import eager, ops, reference
from . import validation as check

# phi maps tokens [B,T,H,D] to compressed rows [B,rows,H,D], the emitted ones or the padded
# layout (reference.cmp_rows): phi(x, block_len, block_stride, cu_seqlens). nsa_ops.PhiMLP
# instances qualify.
Phi = Callable[[Tensor, int, int, Optional[Tensor]], Tensor]


def _resolve_phi(phi) -> tuple[Phi, Phi]:
    if isinstance(phi, str):
        if phi == "mean":
            return reference.compress_mean, reference.compress_mean
        if phi == "mlp":
            raise ValueError('phi="mlp" has learnable weights: pass PhiMLP modules, e.g. '
                             'phi=(nsa_ops.PhiMLP(block_len, Dk), nsa_ops.PhiMLP(block_len, Dv)), '
                             'or use nsa_ops.NSAAttention')
        raise ValueError(f'phi must be "mean", a callable or a (phi_k, phi_v) pair, got {phi!r}')
    if isinstance(phi, tuple) and len(phi) == 2 and all(callable(p) for p in phi):
        return phi
    if callable(phi):
        return phi, phi
    raise ValueError(f'phi must be "mean", a callable or a (phi_k, phi_v) pair, got {phi!r}')


def nsa_attention(q: Tensor, k: Tensor, v: Tensor, g_cmp: Tensor, g_slc: Tensor,
                  g_win: Optional[Tensor], *,
                  block_len: int = 32, block_stride: int = 16, sel_block: int = 64,
                  num_sel: int = 16, window: int = 512,
                  phi: Union[str, Phi, tuple[Phi, Phi]] = "mean", scale: Optional[float] = None,
                  cu_seqlens: Optional[Tensor] = None, block_idx: Optional[Tensor] = None,
                  cu_seqlens_q: Optional[Tensor] = None,
                  cu_seqlens_k: Optional[Tensor] = None,
                  on_block_idx: Optional[Callable[[Tensor], None]] = None) -> Tensor:
    """Native Sparse Attention: o = g_cmp*o_cmp + g_slc*o_slc + g_win*o_win.

    q [B,T,HQ,Dk], k [B,T,H,Dk], v [B,T,H,Dv], gates [B,T,HQ] (already activated). Varlen: B == 1
    and cu_seqlens int32 [N+1]. phi returns the emitted compressed rows, or the padded layout of
    `reference.cmp_rows` (the built-in phi do: no host read of cu_seqlens, one compiled graph).
    block_idx [B,T,H,num_sel] overrides the learned selection (e.g. to reuse it across layers).
    window=0 leaves the sliding-window branch out, like fla's window_size=0 (the spec's empty
    window would give o_win = 0); g_win may then be None.

    Queries at an offset: k/v may be longer than q (Tq <= Tk); query i then sits at key position
    Tk - Tq + i, as in flash-attn's causal attention with unequal lengths (the last Tq rows of
    the full computation: chunked prefill, context parallelism). Varlen: cu_seqlens_q with
    cu_seqlens_k instead of cu_seqlens, each sequence's queries at the end of its keys.
    on_block_idx, if given, is called with the block_idx the selection used (NSAAttention's
    selection statistics read it).
    """
    check.check_qkv(q, k, v)
    cu_q, cu_k = check.seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    check.check_key_length(q, k.shape[1], cu_q, cu_k)
    check.check_block_params(block_len, block_stride, sel_block, num_sel)
    check.check_window(window)
    gates = [("g_cmp", g_cmp), ("g_slc", g_slc)]
    if window:
        gates.append(("g_win", g_win))
    else:
        g_win = None  # no window branch: its gate has nothing to weigh
    for name, g in gates:
        check.check_gate(name, g, q)
    check.check_cu_seqlens(cu_q, q)
    check.check_cu_seqlens_k(cu_k, cu_q, q, k.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    check.check_scale(scale)
    phi_k, phi_v = _resolve_phi(phi)

    seqs = dict(cu_seqlens=cu_q) if cu_k is None else dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    # keys compress over their own sequences; the ops place the queries at their ends
    cu_keys = cu_q if cu_k is None else cu_k
    offset = cu_q is None and k.shape[1] != q.shape[1]
    cmp_keys = dict(seqs, seqlen_k=k.shape[1]) if offset else seqs
    if eager.serves(phi_k, phi_v, [q, k, v, g_cmp, g_slc, g_win, block_idx, cu_q, cu_k]):
        plan = eager.Plan(block_len, block_stride, sel_block, num_sel, window, scale, seqs,
                          cmp_keys, cu_q, cu_k)
        o, block_idx = eager.nsa_attention(plan, q, k, v, g_cmp, g_slc, g_win, block_idx)
        if on_block_idx is not None:
            on_block_idx(block_idx)
        return o

    # the window first: it needs no compression, so the GPU starts a long kernel while the host
    # pools k and v and prepares the next launches (8k tokens on an H100: the GPU idled ~0.3 ms)
    o_win = ops.sliding_window_attention(q, k, v, window, scale, **seqs)[0] if window else None
    k_cmp = phi_k(k, block_len, block_stride, cu_keys)
    v_cmp = phi_v(v, block_len, block_stride, cu_keys)
    o_cmp, lse_cmp = ops.compressed_attention(q, k_cmp, v_cmp, block_len, block_stride, scale,
                                              **cmp_keys)
    if block_idx is None:
        block_idx = ops.select_blocks(q, k_cmp, lse_cmp, block_len, block_stride, sel_block,
                                      num_sel, scale, **cmp_keys)
    o_slc, _ = ops.selection_attention(q, k, v, block_idx, sel_block, scale, **seqs)
    # the op under torch.compile too: Inductor (torch 2.13, CPU) computed wrong q/k/v gradients
    # when it fused the torch expression of a three-branch gate whose gates need grad (an
    # NSAAttention layer); aot_eager and the op were right (tests/test_compile.py)
    o = ops.gate_combine(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win)
    if on_block_idx is not None:
        on_block_idx(block_idx)
    return o
