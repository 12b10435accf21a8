"""Spec semantics: Eq.9 / Eq.10 on hand-computed cases, top-n rules, causality, small-T
equivalence with full causal attention, varlen == per-sequence, and the reference's own backward."""
import pytest
import torch

import nsa_ops
from nsa_ops import reference as R
from nsa_ops import routing
from helpers import SMALL, TOL, compressed, cu_seqlens, gates, qkv, selection_for


# ---- Eq.9 -----------------------------------------------------------------------------------

def test_eq9_overlap_paper_geometry():
    # l=32, d=16, l'=64: block i covers [16i, 16i+32)
    m = R.overlap_matrix(torch.arange(6), 32, 16, 64, 2)
    expected = torch.tensor([[1.0, 0.0],   # [0,32)   inside sel block 0
                             [1.0, 0.0],   # [16,48)
                             [1.0, 0.0],   # [32,64)
                             [0.5, 0.5],   # [48,80)  straddles: 16 tokens each side
                             [0.0, 1.0],   # [64,96)
                             [0.0, 1.0]])  # [80,112)
    torch.testing.assert_close(m, expected)


def test_eq9_overlap_equal_blocks_is_identity():
    m = R.overlap_matrix(torch.arange(4), 16, 16, 16, 4)
    torch.testing.assert_close(m, torch.eye(4))


def test_eq9_overlap_long_cmp_block():
    # l=32, d=8, l'=16: block 1 covers [8,40) -> 8/32 of sel 0, 16/32 of sel 1, 8/32 of sel 2
    m = R.overlap_matrix(torch.tensor([1]), 32, 8, 16, 3)
    torch.testing.assert_close(m, torch.tensor([[0.25, 0.5, 0.25]]))


def test_eq9_eq10_block_scores_hand_case():
    # T=4 queries, l=d=2, l'=4: compressed blocks [0,2), [2,4); one sel block. Two query heads in
    # one group with k_cmp chosen so p_cmp is known in closed form at t=3 (both blocks visible).
    q = torch.zeros(1, 4, 2, 1, dtype=torch.float64)
    q[0, 3, 0, 0], q[0, 3, 1, 0] = 1.0, -1.0
    k_cmp = torch.tensor([[0.0], [float(torch.log(torch.tensor(3.0)))]], dtype=torch.float64)
    k_cmp = k_cmp.view(1, 2, 1, 1)
    _, lse = R.compressed_attention(q, k_cmp, k_cmp, 2, 2, 1.0)
    s = R.block_scores(q, k_cmp, lse, 2, 2, 4, 1.0)  # [1, 4, 1, 1]
    # head 0: p = (1/4, 3/4); head 1: p = (3/4, 1/4). Both blocks lie in sel block 0 with weight
    # 2/2 each, so p_slc = 1 per head and the group sum is 2.
    assert s[0, 3, 0, 0].item() == pytest.approx(2.0)
    # t=1 sees block 0 only: p = 1 per head -> score 2; t=0 sees nothing -> 0
    assert s[0, 1, 0, 0].item() == pytest.approx(2.0)
    assert s[0, 0, 0, 0].item() == 0.0


def test_eq10_sums_over_group_heads():
    # Two heads of one group prefer different sel blocks; the group sum decides for both.
    # l=d=l'=2, T=8 -> 4 compressed blocks, 4 sel blocks, query t=7 sees all 4.
    q = torch.zeros(1, 8, 2, 2, dtype=torch.float64)
    q[0, 7, 0] = torch.tensor([4.0, 0.0])  # head 0 likes k_cmp dir e0
    q[0, 7, 1] = torch.tensor([0.0, 3.0])  # head 1 likes e1, less sharply
    k_cmp = torch.zeros(1, 4, 1, 2, dtype=torch.float64)
    k_cmp[0, 1, 0] = torch.tensor([1.0, 0.0])
    k_cmp[0, 2, 0] = torch.tensor([0.0, 1.0])
    _, lse = R.compressed_attention(q, k_cmp, k_cmp, 2, 2, 1.0)
    s = R.block_scores(q, k_cmp, lse, 2, 2, 2, 1.0)[0, 7, 0]
    e4, e3 = torch.exp(torch.tensor(4.0, dtype=torch.float64)), torch.exp(torch.tensor(3.0, dtype=torch.float64))
    p0 = torch.tensor([1, e4, 1, 1], dtype=torch.float64) / (3 + e4)
    p1 = torch.tensor([1, 1, e3, 1], dtype=torch.float64) / (3 + e3)
    torch.testing.assert_close(s, p0 + p1)


# ---- top-n ----------------------------------------------------------------------------------

def test_topn_forced_ties_and_padding():
    # t=200, l'=32: blocks 0..6 valid (j*32 <= 200), local blocks 6 and 5, block 0 forced.
    score = torch.tensor([0.0, 0.3, 0.3, 0.1, 0.3, 0.0, 0.0, 9.0])  # block 7 invalid (224 > 200)
    out = R.topn_blocks(score.view(1, 1, 1, -1), torch.tensor([200]), 32, 5)
    # forced {0, 5, 6}; then 0.3-ties go to the lower indices 1, 2 (4 loses the tie)
    assert out.flatten().tolist() == [0, 1, 2, 5, 6]


def test_topn_keeps_the_forced_blocks_among_nan_scores():
    # a NaN input's row: its scores carry no order, its forced blocks still stand
    score = torch.tensor([0.2, float("nan"), 0.3, float("nan"), float("nan"), 0.1, 0.0, 9.0])
    out = R.topn_blocks(score.view(1, 1, 1, -1), torch.tensor([200]), 32, 5)
    # forced {0, 5, 6}; then 2, the largest among 1-4; then the NaNs, as 0s, lowest first
    assert out.flatten().tolist() == [0, 1, 2, 5, 6]


def test_topn_early_tokens_pad_with_minus_one():
    score = torch.rand(1, 3, 1, 4)
    out = R.topn_blocks(score, torch.tensor([0, 20, 40]), 16, 4)
    assert out[0, 0, 0].tolist() == [0, -1, -1, -1]        # t=0: only block 0
    assert out[0, 1, 0].tolist() == [0, 1, -1, -1]         # t=20: blocks 0 (forced) and 1 (local)
    assert out[0, 2, 0].tolist() == [0, 1, 2, -1]          # t=40: three valid blocks


def test_select_blocks_output_contract():
    q, k, v = qkv(2, 150, 8, 2, 16, 16, torch.float64, seed=3)
    geo = dict(block_len=16, block_stride=8, sel_block=16, num_sel=5)
    idx = selection_for(q, k, v, geo)
    T = 150
    pos = torch.arange(T)
    valid = idx >= 0
    # no duplicates, ascending, -1 last, causal, forced blocks present
    srt = torch.where(valid, idx, 10**6)
    assert torch.equal(srt, srt.sort(-1).values)
    assert bool((valid[..., 1:] <= valid[..., :-1]).all())
    assert bool(((idx * 16 <= pos.view(1, T, 1, 1)) | ~valid).all())
    cur = (pos // 16).view(1, T, 1, 1)
    for forced in (torch.zeros_like(cur), cur, (cur - 1).clamp(min=0)):
        assert bool((idx == forced).any(-1).all())
    n_valid = valid.sum(-1)
    assert torch.equal(n_valid, torch.minimum(pos // 16 + 1, torch.tensor(5)).view(1, T, 1).expand_as(n_valid))


# ---- equivalences ---------------------------------------------------------------------------

@pytest.mark.parametrize("B,T,G", [(1, 40, 1), (2, 63, 4)])
def test_small_t_selection_and_window_equal_full_causal(B, T, G):
    q, k, v = qkv(B, T, 2 * G, 2, 16, 8, torch.float64, seed=T)
    scale = 16 ** -0.5
    nblk = -(-T // 16)
    geo = dict(block_len=16, block_stride=8, sel_block=16, num_sel=max(3, nblk))
    full, full_lse = R.full_causal_attention(q, k, v)
    idx = selection_for(q, k, v, geo)
    o_sel, lse_sel = torch.ops.nsa.selection_attention(q, k, v, idx, 16, scale)
    o_win, lse_win = torch.ops.nsa.sliding_window_attention(q, k, v, T, scale)
    for o, lse in ((o_sel, lse_sel), (o_win, lse_win)):
        torch.testing.assert_close(o, full)
        torch.testing.assert_close(lse, full_lse)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(G, 2).transpose(1, 2),
        v.repeat_interleave(G, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(full, ref)


def test_varlen_equals_per_sequence():
    lengths = (37, 5, 60)
    q, k, v = qkv(1, sum(lengths), 4, 2, 16, 8, torch.float64, seed=7)
    g = gates(1, sum(lengths), 4, torch.float64)
    cu = cu_seqlens(lengths)
    packed = nsa_ops.nsa_attention(q, k, v, *g, cu_seqlens=cu, **SMALL, window=20)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = nsa_ops.nsa_attention(q[:, sl], k[:, sl], v[:, sl], *(x[:, sl] for x in g),
                                      **SMALL, window=20)
        torch.testing.assert_close(packed[:, sl], alone)
        start += n


# ---- causality ------------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [17, 40, 64])
def test_future_tokens_change_nothing_earlier(cut):
    B, T = 2, 90
    q, k, v = qkv(B, T, 4, 2, 16, 8, torch.float64, seed=11)
    g = gates(B, T, 4, torch.float64)
    cfg = dict(SMALL, window=24)
    base = nsa_ops.nsa_attention(q, k, v, *g, **cfg)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, cut + 1:] = torch.randn_like(t[:, cut + 1:]) * 3
    g2 = [x.clone() for x in g]
    for x in g2:
        x[:, cut + 1:] = torch.rand_like(x[:, cut + 1:])
    moved = nsa_ops.nsa_attention(q2, k2, v2, *g2, **cfg)
    torch.testing.assert_close(moved[:, :cut + 1], base[:, :cut + 1], atol=0, rtol=0)
    assert not torch.allclose(moved[:, cut + 1:], base[:, cut + 1:])


def test_no_visible_block_gives_zero_and_minus_inf():
    q, k, v = qkv(1, 40, 2, 1, 16, 8)
    k_cmp, v_cmp = compressed(k, v, SMALL)
    o, lse = torch.ops.nsa.compressed_attention(q, k_cmp, v_cmp, 16, 8, 0.25)
    assert torch.equal(o[:, :15], torch.zeros_like(o[:, :15]))
    assert bool(torch.isneginf(lse[:, :15]).all()) and bool(torch.isfinite(lse[:, 15:]).all())
    assert not bool(torch.isnan(o).any())


NAN_OPS = ("sliding_window_attention", "compressed_attention", "selection_attention")
FLASH_ATTENTION_ROUTES = ("flash_attn", "aten_fa2")


def _nan_rows_case(op: str, impl: str, poison: str, device="cpu", dtype=torch.float32):
    """(o's NaN rows, lse, the rows that see the NaN), each [T, HQ], for one NaN in q (token
    40, head 1) or in one key of KV head 0 (token 20; compressed row 2) (G = 2, l = 16, d = 8,
    l' = 16)."""
    q, k, v = qkv(1, 64, 4, 2, 16, 16, dtype, seed=3, device=device)
    k_cmp, v_cmp = compressed(k, v, SMALL)
    t = torch.arange(64)[:, None]
    heads = torch.arange(4)[None, :]
    if poison == "q":
        q[0, 40, 1, 5] = float("nan")
        want = (t == 40) & (heads == 1)
    else:
        k[0, 20, 0, 5] = float("nan")
        k_cmp[0, 2, 0, 5] = float("nan")
        first, last = {"sliding_window_attention": (20, 20 + 24 - 1),
                       "selection_attention": (20, 63),
                       "compressed_attention": (2 * 8 + 16 - 1, 63)}[op]
        want = (t >= first) & (t <= last) & (heads < 2)
    blocks = torch.tensor([0, 1, 2], dtype=torch.int32, device=device).expand(1, 64, 2, 3)
    args = {"sliding_window_attention": (q, k, v, 24, 0.25),
            "selection_attention": (q, k, v, blocks, 16, 0.25),
            "compressed_attention": (q, k_cmp, v_cmp, 16, 8, 0.25)}[op]
    with routing.force(**{op: impl}):
        o, lse = getattr(torch.ops.nsa, op)(*args)
    return o[0].isnan().any(-1).cpu(), lse[0].cpu(), want


# the interpreter takes the max of a NaN row with numpy, which warns
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
@pytest.mark.parametrize("poison", ["q", "key"])
@pytest.mark.parametrize("op, impl", [(op, impl) for op in NAN_OPS
                                      for impl in ("reference", "triton")]
                         + [("selection_attention", "packed_sdpa")])
def test_a_nan_input_makes_exactly_the_rows_that_see_it_nan(op, impl, poison):
    """As in SDPA, on every route: the reference had returned o = 0 for them
    (it took a NaN lse for an empty row) where the kernels returned NaN, and the compressed and
    selection kernels an empty row's lse = -inf."""
    o_rows, lse, want = _nan_rows_case(op, impl, poison)
    assert torch.equal(o_rows, want), f"o's NaN rows {o_rows.nonzero().tolist()[:4]}..."
    assert torch.equal(lse.isnan(), want), f"lse's NaN rows {lse.isnan().nonzero().tolist()[:4]}"


@pytest.mark.gpu
@pytest.mark.parametrize("poison", ["q", "key"])
@pytest.mark.parametrize("op", NAN_OPS)
def test_gpu_nan_rows_on_every_route_that_serves(op, poison):
    """bf16 on the GPU, each route that serves the op there when forced (cuDNN, bundled FA-2,
    the Triton kernels with their GPU tiles, packed SDPA, the reference), as on CPU; but
    FlashAttention's kernels give such rows lse = +inf, their mark of a row sum that is not a
    number (torch 2.11's bundled FA-2 on an H200), as the README states."""
    served = []
    for route in routing.candidates(op):
        try:
            o_rows, lse, want = _nan_rows_case(op, route.impl, poison, "cuda", torch.bfloat16)
        except routing.RoutingError:  # this route refuses these inputs on this machine
            continue
        served.append(route.impl)
        assert torch.equal(o_rows, want), f"{route.impl}: o's NaN rows differ"
        marked = lse.isposinf() if route.impl in FLASH_ATTENTION_ROUTES else lse.isnan()
        assert torch.equal(marked, want), f"{route.impl}: lse's NaN rows differ"
    assert "triton" in served and "reference" in served, served


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_nan_query_row_keeps_its_forced_blocks(impl):
    """The NaN row's scores rank as 0 (ties to the lower index) behind its forced blocks: the
    Triton keys had ranked a NaN's float bits above the forced blocks' +inf (blocks 1-5 at t =
    127 where 0, 6 and 7 are forced)."""
    q, k, v = qkv(1, 128, 4, 2, 16, 16, torch.float32, seed=3)
    k_cmp, v_cmp = compressed(k, v, SMALL)
    _, lse = R.compressed_attention(q, k_cmp, v_cmp, 16, 8, 0.25)
    want = R.select_blocks(q, k_cmp, lse, 16, 8, 16, 5, 0.25)
    q[0, 127, 1, 5] = float("nan")
    lse[0, 127, 1] = float("nan")
    with routing.force(select_blocks=impl):
        idx = torch.ops.nsa.select_blocks(q, k_cmp, lse, 16, 8, 16, 5, 0.25)
    assert idx[0, 127, 0].tolist() == [0, 1, 2, 6, 7]
    assert torch.equal(idx[0, 127, 1], want[0, 127, 1])
    assert torch.equal(idx[:, :127], want[:, :127]), "a NaN row changed another row's blocks"


def test_a_nan_query_row_of_the_layer_is_nan_alone():
    q, k, v = qkv(1, 64, 4, 2, 16, 16, torch.float32, seed=3)
    q[0, 40, 1, 5] = float("nan")
    o = nsa_ops.nsa_attention(q, k, v, *gates(1, 64, 4), **SMALL, window=24)
    assert o[0].isnan().any(-1).nonzero().tolist() == [[40, 1]]


# ---- the functional API ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_nsa_attention_matches_reference_and_backprops(dtype):
    q, k, v = qkv(2, 77, 8, 2, 32, 16, dtype, seed=5, requires_grad=True)
    g = gates(2, 77, 8, dtype)
    cfg = dict(SMALL, window=30)
    o = nsa_ops.nsa_attention(q, k, v, *g, **cfg)
    ref = R.nsa(q.detach(), k.detach(), v.detach(), *g, **cfg)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(o, ref, atol=atol, rtol=rtol)
    o.backward(torch.randn_like(o))
    for t in (q, k, v):
        assert t.grad is not None and bool(torch.isfinite(t.grad).all()) and t.grad.abs().sum() > 0


def test_window_zero_leaves_the_window_branch_out():
    """window=0 (fla's window_size=0): o = g_cmp*o_cmp + g_slc*o_slc; g_win may be None."""
    q, k, v = qkv(1, 70, 4, 2, 16, 16, torch.float64, seed=11, requires_grad=True)
    g_cmp, g_slc, g_win = gates(1, 70, 4, torch.float64)
    cfg = dict(SMALL, window=0)
    o = nsa_ops.nsa_attention(q, k, v, g_cmp, g_slc, None, **cfg)
    scale = q.shape[-1] ** -0.5
    k_cmp, v_cmp = compressed(k, v, SMALL)
    L, D = SMALL["block_len"], SMALL["block_stride"]
    o_cmp, lse = torch.ops.nsa.compressed_attention(q, k_cmp, v_cmp, L, D, scale)
    idx = torch.ops.nsa.select_blocks(q, k_cmp, lse, L, D, SMALL["sel_block"], SMALL["num_sel"],
                                      scale)
    o_slc, _ = torch.ops.nsa.selection_attention(q, k, v, idx, SMALL["sel_block"], scale)
    want = g_cmp.unsqueeze(-1) * o_cmp + g_slc.unsqueeze(-1) * o_slc
    torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(nsa_ops.nsa_attention(q, k, v, g_cmp, g_slc, g_win, **cfg), o)
    torch.testing.assert_close(R.nsa(q, k, v, g_cmp, g_slc, g_win, **cfg), o)
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="window must be a positive int, or 0"):
        nsa_ops.nsa_attention(q, k, v, g_cmp, g_slc, g_win, **dict(SMALL, window=-1))


def test_phi_mlp_starts_as_mean_and_learns():
    q, k, v = qkv(1, 64, 4, 2, 16, 16, seed=9)
    g = gates(1, 64, 4)
    phi = (nsa_ops.PhiMLP(16, 16), nsa_ops.PhiMLP(16, 16))
    o_mlp = nsa_ops.nsa_attention(q, k, v, *g, phi=phi, **SMALL, window=16)
    o_mean = nsa_ops.nsa_attention(q, k, v, *g, **SMALL, window=16)
    torch.testing.assert_close(o_mlp, o_mean)
    o_mlp.sum().backward()
    assert phi[0].fc2.weight.grad.abs().sum() > 0
