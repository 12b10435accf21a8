"""Packed-SDPA selection attention (the routing table's short-sequence / sm89 path) vs the reference."""
import pytest
import torch

from nsa_ops import reference
from nsa_ops.packed import selection_attention_packed
import nsa_ops.packed as packed
from helpers import SMALL, TOL, cu_seqlens, qkv, selection_for

GEO = dict(SMALL, num_sel=4)


def check(q, k, v, cu=None, tol=None, drop_row=None):
    idx = selection_for(q.float().cpu(), k.float().cpu(), v.float().cpu(), GEO,
                        None if cu is None else cu.cpu()).to(q.device)
    if drop_row is not None:  # a row with every slot empty: o = 0, lse = -inf
        idx[0, drop_row] = -1
    scale = q.shape[-1] ** -0.5
    ro, rl = reference.selection_attention(q.double(), k.double(), v.double(), idx,
                                           GEO["sel_block"], scale, cu)
    o, lse = selection_attention_packed(q, k, v, idx, GEO["sel_block"], scale, cu)
    atol, rtol = tol or TOL[q.dtype]
    assert lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), ro, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), rl, atol=max(atol, 1e-5), rtol=rtol)
    if drop_row is not None:
        assert (o[0, drop_row] == 0).all() and (lse[0, drop_row] == float("-inf")).all()


@pytest.mark.parametrize("B,T,HQ,H,Dk,Dv", [(2, 70, 4, 4, 16, 16), (1, 101, 8, 2, 32, 16),
                                            (1, 64, 16, 1, 16, 32)])
def test_packed_matches_reference(B, T, HQ, H, Dk, Dv):
    check(*qkv(B, T, HQ, H, Dk, Dv, seed=T), drop_row=T // 2)


def test_packed_varlen():
    q, k, v = qkv(1, 120, 4, 2, 16, 16, seed=3)
    check(q, k, v, cu_seqlens([33, 70, 17]))


def test_packed_chunks_tokens(monkeypatch):
    """A tiny gather budget forces one token per chunk: same result."""
    monkeypatch.setattr(packed, "GATHER_BUDGET", 1)
    check(*qkv(1, 45, 4, 2, 16, 16, seed=5))


def test_packed_block_idx_is_a_set():
    """Shuffled slots, -1 first, a block named twice: the reference's set semantics."""
    q, k, v = qkv(1, 60, 4, 2, 16, 16, seed=6)
    idx = selection_for(q, k, v, GEO)
    idx = torch.cat([idx.flip(-1), idx[..., -1:]], -1)
    assert (idx[..., 0] < 0).any() and (idx[..., -1] >= 0).any()
    scale = q.shape[-1] ** -0.5
    ro, rl = reference.selection_attention(q.double(), k.double(), v.double(), idx,
                                           GEO["sel_block"], scale)
    o, lse = selection_attention_packed(q, k, v, idx, GEO["sel_block"], scale)
    torch.testing.assert_close(o.double(), ro, atol=TOL[q.dtype][0], rtol=TOL[q.dtype][1])
    torch.testing.assert_close(lse.double(), rl, atol=1e-5, rtol=TOL[q.dtype][1])


def test_packed_without_slots():
    """n = 0: no keys at all, as the reference: o = 0, lse = -inf (no division by zero)."""
    q, k, v = qkv(1, 20, 4, 2, 16, 8, seed=7)
    idx = torch.empty(1, 20, 2, 0, dtype=torch.int32)
    o, lse = selection_attention_packed(q, k, v, idx, GEO["sel_block"], 0.25)
    assert o.shape == (1, 20, 4, 8) and (o == 0).all() and (lse == float("-inf")).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("G,Dk,Dv", [(1, 64, 64), (4, 128, 128), (16, 192, 128)])
def test_packed_gpu(dtype, G, Dk, Dv):
    q, k, v = qkv(2, 700, 4 * G, 4, Dk, Dv, dtype=dtype, seed=G, device="cuda")
    check(q, k, v, tol=TOL[dtype] if dtype != torch.float32 else (1e-4, 1e-3), drop_row=9)
