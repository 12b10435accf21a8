"""Queries at an offset (Tq <= Tk, bottom-right aligned): every branch over the last Tq queries of a
sequence equals the same rows of the full-length computation, fixed length and varlen."""
import pytest
import torch

from nsa_ops import reference as R
from helpers import SMALL, TOL, cu_seqlens, qkv

L, D, LP, N = SMALL["block_len"], SMALL["block_stride"], SMALL["sel_block"], SMALL["num_sel"]


def _tails(lengths_k, lengths_q):
    """Packed row indices of the last lengths_q[i] tokens of each key sequence."""
    rows, start = [], 0
    for lk, lq in zip(lengths_k, lengths_q):
        rows += range(start + lk - lq, start + lk)
        start += lk
    return torch.tensor(rows, dtype=torch.long)


# (B, Tk, Tq, varlen key lengths, their query lengths)
CASES = [(2, 70, 70, None, None), (2, 70, 23, None, None), (1, 53, 1, None, None),
         (1, 90, 90, (40, 50), (40, 50)), (1, 90, 29, (40, 17, 33), (12, 0, 17)),
         (1, 64, 3, (31, 33), (1, 2))]


def _inputs(B, Tk, Tq, lengths_k, lengths_q, G=2, H=2):
    q_full, k, v = qkv(B, Tk, G * H, H, 16, 8, torch.float64, seed=Tk + Tq)
    if lengths_k is None:
        rows, cu_k, cu_q = torch.arange(Tk - Tq, Tk), None, None
    else:
        rows, cu_k, cu_q = _tails(lengths_k, lengths_q), cu_seqlens(lengths_k), \
            cu_seqlens(lengths_q)
    return q_full, q_full[:, rows], k, v, rows, cu_k, cu_q


@pytest.mark.parametrize("B,Tk,Tq,lengths_k,lengths_q", CASES)
def test_reference_branches_at_an_offset(B, Tk, Tq, lengths_k, lengths_q):
    q_full, q, k, v, rows, cu_k, cu_q = _inputs(B, Tk, Tq, lengths_k, lengths_q)
    varlen = cu_k is not None
    full_cu = cu_k
    # offset form: fixed length names Tk, varlen both cu_seqlens
    off = dict(cu_seqlens_k=cu_k) if varlen else {}
    cmp_off = dict(cu_seqlens_k=cu_k) if varlen else dict(seqlen_k=Tk)
    scale = 0.3
    k_cmp, v_cmp = R.compress_mean(k, L, D, full_cu), R.compress_mean(v, L, D, full_cu)
    atol, rtol = TOL[torch.float64]

    o_full, lse_full = R.compressed_attention(q_full, k_cmp, v_cmp, L, D, scale, full_cu)
    o, lse = R.compressed_attention(q, k_cmp, v_cmp, L, D, scale, cu_q, **cmp_off)
    torch.testing.assert_close(o, o_full[:, rows], atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, lse_full[:, rows], atol=atol, rtol=rtol)

    idx_full = R.select_blocks(q_full, k_cmp, lse_full, L, D, LP, N, scale, full_cu)
    idx = R.select_blocks(q, k_cmp, lse, L, D, LP, N, scale, cu_q, **cmp_off)
    assert torch.equal(idx, idx_full[:, rows])

    for fn, args in ((R.selection_attention, (idx_full, LP)), (R.sliding_window_attention, (24,))):
        o_full, lse_full = fn(q_full, k, v, *args, scale, full_cu)
        if fn is R.selection_attention:
            args = (args[0][:, rows], LP)
        o, lse = fn(q, k, v, *args, scale, cu_q, **off)
        torch.testing.assert_close(o, o_full[:, rows], atol=atol, rtol=rtol)
        torch.testing.assert_close(lse, lse_full[:, rows], atol=atol, rtol=rtol)
