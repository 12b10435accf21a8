"""The padded compressed layout: phi returns cmp_rows(T) = T // d + 2 rows, the emitted blocks
first (packed per sequence in varlen), then padding rows that every consumer ignores.

This is what lets varlen compression size its output without reading cu_seqlens on the host and
keeps one compiled graph for T < block_len; see reference.cmp_rows. The kernels run in the Triton
interpreter on CPU (conftest), so the cases are small.
"""
import pytest
import torch

import nsa_ops
from nsa_ops import reference as ref
from nsa_ops.kernels import compressed as kc
from helpers import TOL, cu_seqlens, qkv

GEOMETRIES = [(16, 8, 16), (32, 16, 64), (16, 16, 32)]  # (l, d, l')
GEO_IDS = ["l{}-d{}-s{}".format(*g) for g in GEOMETRIES]
PACKINGS = [(20, 30), (40, 7, 33), (64,), (16, 0, 50, 9), (5, 3), (0, 31)]
FIXED_LENGTHS = [70, 12, 2]


def exact_blocks(x, l, d):
    """The emitted rows of one sequence x [B,S,H,D], from the definition."""
    S = x.shape[1]
    rows = [x[:, i * d:i * d + l].mean(1) for i in range(ref.num_cmp(S, l, d))]
    return torch.stack(rows, 1) if rows else x.new_empty(x.shape[0], 0, *x.shape[2:])


def split_exact(x, lengths, l, d):
    """The emitted rows of a packed x, sequence after sequence."""
    seqs = torch.split(x, list(lengths), dim=1)
    return torch.cat([exact_blocks(s, l, d) for s in seqs], 1)


def garbage_padding(k_cmp, emitted, seed):
    """k_cmp with its padding rows overwritten by large values: any consumer that read them
    would change its result."""
    g = torch.Generator().manual_seed(seed)
    out = k_cmp.detach().clone()
    out[:, emitted:] = 10 * torch.randn(out[:, emitted:].shape, generator=g).to(out)
    return out


@pytest.mark.parametrize("l,d,s", GEOMETRIES, ids=GEO_IDS)
def test_phi_emits_the_blocks_first(l, d, s):
    _, k, _ = qkv(1, 200, 2, 2, 8, 8, torch.float64, seed=3)
    for lengths in PACKINGS:
        x = k[:, :sum(lengths)]
        cu = cu_seqlens(lengths)
        emitted = ref.total_cmp(cu, l, d)
        assert emitted <= sum(lengths) // d == ref.cmp_rows(sum(lengths), d) - 2
        k_cmp = ref.compress_mean(x, l, d, cu)
        assert k_cmp.shape[1] == ref.cmp_rows(sum(lengths), d)
        torch.testing.assert_close(k_cmp[:, :emitted], split_exact(x, lengths, l, d),
                                   atol=1e-12, rtol=0)
        assert torch.isfinite(k_cmp).all()
    for T in FIXED_LENGTHS:
        k_cmp = ref.compress_mean(k[:, :T], l, d)
        assert k_cmp.shape[1] == ref.cmp_rows(T, d)
        torch.testing.assert_close(k_cmp[:, :ref.num_cmp(T, l, d)], exact_blocks(k[:, :T], l, d),
                                   atol=1e-12, rtol=0)


# (T, cu_seqlens): fixed lengths with and without emitted blocks, packings with short and empty
# sequences
CASES = [(70, None), (12, None)] + [(sum(p), cu_seqlens(p)) for p in ((40, 7, 33), (16, 0, 50, 9))]


@pytest.mark.parametrize("T,cu", CASES, ids=["T70", "T12", "varlen3", "varlen4"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_consumers_ignore_padding_rows(T, cu, impl):
    """compressed_attention (fwd, bwd with dlse) and select_blocks on the padded layout, its
    padding rows garbage, equal the same on the emitted rows alone; padding grads are 0."""
    l, d, s, n = 16, 8, 16, 3
    triton = impl == "triton"
    device = "cuda" if triton and torch.cuda.is_available() else "cpu"
    q, k, v = qkv(1, T, 4, 2, 16, 8, torch.float32 if triton else torch.float64, seed=T,
                  device=device)
    scale = 0.25
    emitted = ref.num_cmp(T, l, d) if cu is None else ref.total_cmp(cu, l, d)
    cu = None if cu is None else cu.to(device)
    k_pad = garbage_padding(ref.compress_mean(k, l, d, cu), emitted, 1)
    v_pad = garbage_padding(ref.compress_mean(v, l, d, cu), emitted, 2)
    k_cmp, v_cmp = k_pad[:, :emitted], v_pad[:, :emitted]
    if triton:
        fwd, bwd, sel = kc.compressed_attention_fwd, kc.compressed_attention_bwd, kc.select_blocks
    else:
        fwd, bwd = ref.compressed_attention, ref.compressed_attention_backward
        sel = ref.select_blocks
    atol, rtol = TOL[q.dtype]
    o, lse = fwd(q, k_pad, v_pad, l, d, scale, cu)
    o_ref, lse_ref = ref.compressed_attention(q, k_cmp, v_cmp, l, d, scale, cu)
    torch.testing.assert_close(o, o_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, lse_ref.to(lse.dtype), atol=atol, rtol=rtol)

    g = torch.Generator().manual_seed(4)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse)
    dq, dk, dv = bwd(q, k_pad, v_pad, o, lse, do, dlse, l, d, scale, cu)
    want = ref.compressed_attention_backward(q, k_cmp, v_cmp, o_ref, lse_ref, do, dlse, l, d,
                                             scale, cu)
    for got, exp, pad in ((dq, want[0], None), (dk, want[1], emitted), (dv, want[2], emitted)):
        if pad is not None:
            assert torch.equal(got[:, pad:], torch.zeros_like(got[:, pad:]))
            got = got[:, :pad]
        torch.testing.assert_close(got, exp, atol=atol, rtol=rtol)

    idx = sel(q, k_pad, lse, l, d, s, n, scale, cu)
    assert torch.equal(idx, ref.select_blocks(q, k_cmp, lse, l, d, s, n, scale, cu))


def test_nsa_attention_varlen_equals_each_sequence():
    lengths = (40, 7, 33)
    q, k, v = qkv(1, sum(lengths), 4, 2, 16, 8, torch.float64, seed=5, requires_grad=True)
    g = [torch.rand(1, sum(lengths), 4, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(i)) for i in range(3)]
    cfg = dict(block_len=16, block_stride=8, sel_block=16, num_sel=3, window=24)
    o = nsa_ops.nsa_attention(q, k, v, *g, cu_seqlens=cu_seqlens(lengths), **cfg)
    t0, parts = 0, []
    for S in lengths:
        sl = slice(t0, t0 + S)
        parts.append(ref.nsa(q[:, sl], k[:, sl], v[:, sl], *(x[:, sl] for x in g), **cfg))
        t0 += S
    torch.testing.assert_close(o, torch.cat(parts, 1), atol=1e-12, rtol=0)
    o.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def rows_error(q, k_cmp, cu=None):
    return torch.ops.nsa.compressed_attention(q, k_cmp, k_cmp, 16, 8, 0.25, cu)


def test_validation_takes_the_emitted_or_the_padded_count():
    q, k, _ = qkv(1, 45, 4, 2, 16, 16, seed=7)
    rows_error(q, k[:, :4])  # num_cmp(45) = 4 emitted
    rows_error(q, k[:, :7])  # cmp_rows(45) = 7 padded
    with pytest.raises(ValueError, match=r"k_cmp must have num_cmp\(T\) = 4 rows \(emitted\), "
                                         r"or T // block_stride \+ 2 = 7"):
        rows_error(q, k[:, :5])
    cu = cu_seqlens((20, 25))  # 1 + 2 emitted
    rows_error(q, k[:, :3], cu)
    rows_error(q, k[:, :7], cu)
    with pytest.raises(ValueError, match=r"k_cmp must pack sum_i num_cmp\(S_i\) = 3 rows for "
                                         r"these cu_seqlens \(emitted\), or T // block_stride "
                                         r"\+ 2 = 7"):
        rows_error(q, k[:, :6], cu)
