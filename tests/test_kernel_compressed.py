"""Triton compressed-branch kernels (nsa_ops.kernels.compressed) against nsa_ops.reference.

Without CUDA the kernels run in the Triton interpreter (conftest), which is slow: the CPU cases are
small and hand-picked to cover B in {1,2}, T not a multiple of any block, G in {1,2,4}, Dk != Dv,
four (l, d, l') layouts, n in {3,5,6} and varlen with a sequence shorter than l; they run on CUDA
too when present. Reference values are computed in float64 from the same (possibly low-precision)
inputs. The @pytest.mark.gpu cases use realistic shapes in fp16/bf16 and
compare relative errors against a float32 reference.
"""
import re

import pytest
import torch
import triton.language as tl

from nsa_ops import reference as ref
from nsa_ops.kernels import compressed as kc
from nsa_ops.kernels.utils import pow2
from helpers import SM90_SHARED_BYTES, compile_for_sm90, poisoned_empty, rel_err

# per dtype: |kernel - reference| <= ATOL * (1 + |reference|)
ATOL = {torch.float32: 1e-4, torch.float16: 2e-2}
# relative Frobenius error on GPU against the float32 reference
RTOL_GPU = {torch.float16: 1e-2, torch.bfloat16: 2e-2}

# (B, T, H, G, Dk, Dv, l, d)
CASES = [
    (1, 70, 2, 1, 16, 16, 32, 16),
    (2, 133, 1, 2, 32, 16, 32, 16),
    (1, 133, 2, 4, 16, 16, 16, 16),
    (2, 70, 1, 4, 32, 16, 16, 8),
    (1, 133, 1, 2, 16, 16, 16, 8),
    (1, 20, 2, 2, 16, 16, 32, 16),  # T < l: no compressed block at all
]
CASE_IDS = ["B{}-T{}-H{}-G{}-Dk{}-Dv{}-l{}-d{}".format(*c) for c in CASES]
# varlen: lengths 10 (< l), 130, 93; (H, G, Dk, Dv, l, d)
VARLEN_CU = [0, 10, 140, 233]
VARLEN_CASES = [(2, 2, 32, 16, 16, 8), (1, 4, 16, 16, 32, 16)]
VARLEN_IDS = ["H{}-G{}-Dk{}-Dv{}-l{}-d{}".format(*c) for c in VARLEN_CASES]
# selection needs more blocks than the 3 forced ones to be tested: (B, T, H, G, Dk, l, d, l', n)
SEL_CASES = [
    (1, 700, 1, 2, 16, 32, 16, 64, 5),
    (2, 333, 2, 1, 32, 16, 16, 16, 5),
    (1, 261, 1, 4, 16, 16, 8, 32, 3),
    (2, 150, 2, 2, 32, 16, 8, 16, 5),
    (1, 20, 2, 2, 16, 32, 16, 64, 3),
    (1, 100, 1, 2, 16, 16, 8, 16, 16),  # n >= the padded block count: every visible block
    (1, 90, 1, 2, 16, 32, 8, 16, 4),  # l > l': compressed blocks span several selection blocks
    (1, 300, 1, 2, 16, 32, 16, 48, 4),  # l'/d = 3 blocks per selection block: the loop
]
_sel_id = "B{}-T{}-H{}-G{}-Dk{}-l{}-d{}-s{}-n{}".format
SEL_IDS = [_sel_id(*c) for c in SEL_CASES]


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(B, T, H, G, Dk, Dv, l, d, dtype, cu=None, device=None, seed=0):
    device = device or _device()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    nc = ref.num_cmp(T, l, d) if cu is None else ref.total_cmp(cu, l, d)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    # q is a view into a wider tensor (fused-projection layout): exercises the strides
    q = rnd(B, T, H * G, Dk + 8)[..., :Dk]
    return q, rnd(B, nc, H, Dk), rnd(B, nc, H, Dv)


def f64(*xs):
    return [None if x is None else x.double() for x in xs]


def assert_close(name, got, want, atol):
    assert got.shape == want.shape, name
    if got.numel() == 0:
        return
    assert not got.isnan().any(), f"{name}: NaN"
    same_inf = torch.isinf(want) & (got.double() == want)
    err = torch.where(same_inf, 0.0, (got.double() - want).abs())
    bound = atol * (1 + torch.where(same_inf, 0.0, want.abs()))
    worst = (err / bound).max().item()
    assert worst <= 1, f"{name}: error {worst:.3g} x tolerance"


def check_attention(q, k, v, l, d, cu, atol, with_dlse, seed=1):
    scale = q.shape[-1] ** -0.5
    with poisoned_empty():
        o, lse = kc.compressed_attention_fwd(q, k, v, l, d, scale, cu)
    qd, kd, vd = f64(q, k, v)
    o_ref, lse_ref = ref.compressed_attention(qd, kd, vd, l, d, scale, cu)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert_close("o", o, o_ref, atol)
    assert_close("lse", lse, lse_ref, atol)

    gen = torch.Generator(device="cpu").manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o)
    dlse = torch.randn(lse.shape, generator=gen).to(lse) if with_dlse else None
    with poisoned_empty():
        grads = kc.compressed_attention_bwd(q, k, v, o, lse, do, dlse, l, d, scale, cu)
    grads_ref = ref.compressed_attention_backward(qd, kd, vd, o_ref, lse_ref, *f64(do, dlse),
                                                  l, d, scale, cu)
    for name, g, g_ref, x in zip(("dq", "dk", "dv"), grads, grads_ref, (q, k, v)):
        assert g.dtype == x.dtype
        assert_close(name, g, g_ref, atol)


# --------------------------------------------------------------------------------------------
# Selection checks
# --------------------------------------------------------------------------------------------

def reference_scores(q, k, lse, l, d, sel, scale, cu, chunk=512):
    """Eq.9 + Eq.10 scores [B, T, H, nblk] in float64, straight from the definitions."""
    B, T, HQ, D = q.shape
    nc, H = k.shape[1], k.shape[2]
    q, k, lse = f64(q.view(B, T, H, HQ // H, D), k, lse.view(B, T, H, HQ // H, 1))
    mask_fn = ref.compressed_mask_fn(T, nc, l, d, cu, q.device)
    _, cidx = ref.cmp_layout(nc, cu, l, d, q.device)
    overlap = ref.overlap_matrix(cidx, l, d, sel, max(1, -(-T // sel))).double()
    out = []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        s = torch.einsum("bthgd,bshd->bthgs", q[:, t0:t1], k) * scale
        mask = mask_fn(t0, t1)[0, 0][None, :, None, None]  # [1, tc, 1, 1, nc]
        lse_c = lse[:, t0:t1]
        p = torch.where(mask & torch.isfinite(lse_c), torch.exp(s - lse_c), 0.0)
        out.append(p.sum(3) @ overlap)
    return torch.cat(out, 1)


def check_selection_property(block_idx, score, pos, sel, n, tol):
    """Structure of block_idx plus: no unselected block outscores a selected non-forced one."""
    nblk = score.shape[-1]
    j = torch.arange(nblk, device=score.device)
    cur = (pos // sel)[:, None]
    allowed = (j[None] * sel <= pos[:, None])[None, :, None]  # [1, T, 1, nblk]
    forced = allowed & ((j == 0) | (j == cur) | (j == cur - 1))[None, :, None]

    taken = block_idx >= 0
    count = taken.sum(-1)
    assert torch.equal(count, allowed.sum(-1).clamp(max=n).expand_as(count)), "wrong slot count"
    slot = torch.arange(n, device=score.device)
    assert torch.equal(taken, slot < count[..., None]), "-1 must come last"
    assert (block_idx[..., 1:] > block_idx[..., :-1])[taken[..., 1:]].all(), "not ascending"

    onehot = torch.zeros(*block_idx.shape[:-1], nblk + 1, dtype=torch.bool, device=score.device)
    onehot.scatter_(-1, torch.where(taken, block_idx, nblk).long(), True)
    chosen = onehot[..., :nblk]
    assert not (chosen & ~allowed).any(), "selected a future block"
    assert not (forced & ~chosen).any(), "forced block missing"
    worst_kept = torch.where(chosen & ~forced, score, float("inf")).amin(-1)
    best_left = torch.where(allowed & ~chosen, score, float("-inf")).amax(-1)
    gap = (best_left - worst_kept).max().item()
    assert gap <= tol, f"an unselected block outscores a selected one by {gap:.3g}"


def check_selection(q, k, lse, l, d, sel, n, cu, exact, tol):
    scale = q.shape[-1] ** -0.5
    with poisoned_empty():
        block_idx = kc.select_blocks(q, k, lse, l, d, sel, n, scale, cu)
    assert block_idx.dtype == torch.int32 and block_idx.shape == (*q.shape[:2], k.shape[2], n)
    if exact:
        want = ref.select_blocks(q, k, lse, l, d, sel, n, scale, cu)
        assert torch.equal(block_idx, want), f"{(block_idx != want).sum().item()} entries differ"
    _, pos = ref.token_layout(q.shape[1], cu, q.device)
    score = reference_scores(q, k, lse, l, d, sel, scale, cu)
    check_selection_property(block_idx, score, pos, sel, n, tol)


# --------------------------------------------------------------------------------------------
# CPU (interpreter) tests
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_attention(case, dtype):
    B, T, H, G, Dk, Dv, l, d = case
    q, k, v = make_inputs(B, T, H, G, Dk, Dv, l, d, dtype)
    check_attention(q, k, v, l, d, None, ATOL[dtype], with_dlse=G != 2)  # G=2 cases: dlse None


@pytest.mark.parametrize("tiles", ["short", "long"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=VARLEN_IDS)
def test_attention_varlen(monkeypatch, case, tiles):
    """tiles: the forward and dq tiles of few keys (SHORT_KEYS), which every CPU shape takes,
    or the tier's, which longer sequences take (more tokens a program across the sequences)."""
    if tiles == "long":
        monkeypatch.setattr(kc, "SHORT_KEYS", -1)
    H, G, Dk, Dv, l, d = case
    cu = torch.tensor(VARLEN_CU, dtype=torch.int32, device=_device())
    q, k, v = make_inputs(1, VARLEN_CU[-1], H, G, Dk, Dv, l, d, torch.float32, cu)
    check_attention(q, k, v, l, d, cu, ATOL[torch.float32], with_dlse=True)


@pytest.mark.parametrize("case,varlen,nsplit", [
    (CASES[1], False, 1), (CASES[3], False, 3), (VARLEN_CASES[0], True, 1)],
    ids=["fixed", "fixed-split3", "varlen"])
def test_attention_backward_do_gate(monkeypatch, case, varlen, nsplit):
    """do_gate (nsa_attention's eager backward): the gradients of do_gate * do from do, the
    kernels scaling P (dK dV, in one program or split three ways) and dq rows, against the
    reference given the product, also with the rows' delta given in place of o (NaN there);
    gates of either sign; an lse gradient beside either is refused by name."""
    monkeypatch.setattr(kc, "_dkdv_splits", lambda *args: nsplit)
    if varlen:
        H, G, Dk, Dv, l, d = case
        cu = torch.tensor(VARLEN_CU, dtype=torch.int32, device=_device())
        q, k, v = make_inputs(1, VARLEN_CU[-1], H, G, Dk, Dv, l, d, torch.float32, cu)
    else:
        B, T, H, G, Dk, Dv, l, d = case
        cu = None
        q, k, v = make_inputs(B, T, H, G, Dk, Dv, l, d, torch.float32)
    scale = Dk ** -0.5
    o, lse = kc.compressed_attention_fwd(q, k, v, l, d, scale, cu)
    gen = torch.Generator(device="cpu").manual_seed(3)
    do = torch.randn(o.shape, generator=gen).to(o)
    gate = (torch.rand(lse.shape, generator=gen) - 0.25).to(lse)
    qd, kd, vd = f64(q, k, v)
    o_ref, lse_ref = ref.compressed_attention(qd, kd, vd, l, d, scale, cu)
    want = ref.compressed_attention_backward(qd, kd, vd, o_ref, lse_ref,
                                             gate.double().unsqueeze(-1) * do.double(), None,
                                             l, d, scale, cu)
    delta = (do * o).sum(-1)
    with poisoned_empty():
        grads = kc.compressed_attention_bwd(q, k, v, o, lse, do, None, l, d, scale, cu,
                                            do_gate=gate)
        given = kc.compressed_attention_bwd(q, k, v, torch.full_like(o, float("nan")), lse, do,
                                            None, l, d, scale, cu, do_gate=gate, delta=delta)
    for name, g, h, g_ref in zip(("dq", "dk", "dv"), grads, given, want):
        assert_close(name, g, g_ref, ATOL[torch.float32])
        assert_close(name + " (delta given)", h, g_ref, ATOL[torch.float32])
    with pytest.raises(ValueError, match="do_gate: a backward takes a gate for dO only"):
        kc.compressed_attention_bwd(q, k, v, o, lse, do, torch.zeros_like(lse), l, d, scale, cu,
                                    do_gate=gate)
    with pytest.raises(ValueError, match="delta: give rowsum"):
        kc.compressed_attention_bwd(q, k, v, o, lse, do, torch.zeros_like(lse), l, d, scale, cu,
                                    delta=delta)


def _cmp_lse(q, k, v, l, d, cu):
    return kc.compressed_attention_fwd(q, k, v, l, d, q.shape[-1] ** -0.5, cu)[1]


@pytest.mark.parametrize("case", SEL_CASES, ids=SEL_IDS)
def test_select_blocks(case):
    B, T, H, G, Dk, l, d, sel, n = case
    q, k, v = make_inputs(B, T, H, G, Dk, 16, l, d, torch.float32, seed=2)
    check_selection(q, k, _cmp_lse(q, k, v, l, d, None), l, d, sel, n, None, exact=True, tol=1e-5)


# 16-bit Dk of 129-256 take tier 1's select tiles (`kc._tier`): several key loads a step and one
SEL_WIDE_CASES = [(1, 300, 1, 2, 160, 32, 16, 64, 5), (1, 260, 1, 4, 144, 32, 32, 32, 4)]


@pytest.mark.parametrize("case", SEL_CASES[:2] + SEL_WIDE_CASES,
                         ids=SEL_IDS[:2] + [_sel_id(*c) for c in SEL_WIDE_CASES])
def test_select_blocks_fp16(case):
    B, T, H, G, Dk, l, d, sel, n = case
    q, k, v = make_inputs(B, T, H, G, Dk, 16, l, d, torch.float16, seed=3)
    check_selection(q, k, _cmp_lse(q, k, v, l, d, None), l, d, sel, n, None, exact=False,
                    tol=1e-4)


# lengths 130, 7 (< l), 163: with G = 1 one program holds 64 tokens, so a tile straddles all three
# sequences and the third one's tokens there already choose among more than the forced blocks
SEL_VARLEN_CU = [0, 130, 137, 300]


@pytest.mark.parametrize("G,l,d,sel,n", [(1, 16, 8, 8, 5), (4, 32, 16, 16, 3)])
def test_select_blocks_varlen(G, l, d, sel, n):
    cu = torch.tensor(SEL_VARLEN_CU, dtype=torch.int32, device=_device())
    q, k, v = make_inputs(1, SEL_VARLEN_CU[-1], 2, G, 32, 16, l, d, torch.float32, cu, seed=4)
    check_selection(q, k, _cmp_lse(q, k, v, l, d, cu), l, d, sel, n, cu, exact=True, tol=1e-5)


def test_select_blocks_ties():
    """Identical compressed keys make fully visible blocks tie exactly: the lower index wins."""
    B, T, H, G, Dk, l, d, sel, n = 1, 200, 2, 2, 16, 16, 8, 16, 6
    q, k, v = make_inputs(B, T, H, G, Dk, 16, l, d, torch.float32, seed=6)
    # quarter-integer q and k: every q.k is exact in fp32 whatever the summation order (the
    # interpreter's BLAS gives identical key columns ulp-different results by their position)
    q = torch.round(q * 4) / 4
    k = (torch.round(k[:, :1] * 4) / 4).expand_as(k).contiguous()
    scale = Dk ** -0.5
    lse = _cmp_lse(q, k, v, l, d, None)
    block_idx = kc.select_blocks(q, k, lse, l, d, sel, n, scale)
    # the reference's ulp-level differences between tied sums are rounded away
    score = torch.round(reference_scores(q, k, lse, l, d, sel, scale, None) * 1e6)
    _, pos = ref.token_layout(T, None, q.device)
    assert torch.equal(block_idx, ref.topn_blocks(score, pos, sel, n))


@pytest.mark.parametrize("merge,l,d,sel", [
    (2, 16, 8, 8), (4, 16, 8, 8), (2, 16, 8, 16), (2, 8, 4, 16), (4, 8, 4, 16), (2, 4, 2, 16)],
    ids=["l>l'-2", "l>l'-4", "R2-2", "R4-2", "R4-4", "R8-2"])
def test_select_blocks_merges_several_tiles(monkeypatch, merge, l, d, sel):
    """Score tiles of 16 blocks, merged 2 or 4 at a time, then one tile beside the last merge's
    stale scores (3 / 5 tiles: 40 / 72 blocks). With l <= l' a compressed block
    runs into the next selection block, and what it owes there carries from tile to tile, across
    merges too (R = l'/d = 2, 4, 8, the wide dot's three forms); with l > l' the tiles recompute
    it. G = 3 pads each token's heads to 4 rows."""
    monkeypatch.setattr(kc, "_SELECT_TILES",
                        (((32, 16, merge, 4, 1, None, 0),) * 2,) * len(kc._SELECT_TILES))
    blocks = 16 * merge + 8
    q, k, v = make_inputs(1, blocks * sel - 4, 1, 3, 16, 16, l, d, torch.float32, seed=7)
    lse = ref.compressed_attention(q, k, v, l, d, q.shape[-1] ** -0.5, None)[1]
    check_selection(q, k, lse, l, d, sel, 5, None, exact=True, tol=1e-5)


@pytest.mark.parametrize("l,d,sel", [(16, 8, 16), (32, 16, 64), (16, 8, 64)],
                         ids=["R2", "R4", "R8"])
def test_select_blocks_strided_tiles_one_dot_each(monkeypatch, l, d, sel):
    """Steps wider than `_WIDE_KEYS` (l' = 8d at 32 blocks on a GPU) score their l'/d strided key
    tiles one dot each instead of as one wide dot; here every step does, at l'/d = 2, 4 and 8."""
    monkeypatch.setattr(kc, "_WIDE_KEYS", tl.constexpr(0))
    # 1000 tokens: up to 16 blocks of l' = 64 per query, of which n = 6 are chosen
    q, k, v = make_inputs(1, 1000, 1, 2, 16, 16, l, d, torch.float32, seed=8)
    lse = ref.compressed_attention(q, k, v, l, d, q.shape[-1] ** -0.5, None)[1]
    check_selection(q, k, lse, l, d, sel, 6, None, exact=True, tol=1e-5)


# the ordered adds do not depend on the layout: fixed length only (the CPU suite's time budget)
@pytest.mark.parametrize("cu_list,nsplit,ordered", [
    (None, 1, False), (None, 3, False), (None, 3, True),
    ([0, 150, 155, 300], 1, False), ([0, 150, 155, 300], 3, False)],
    ids=["fixed-whole", "fixed-split3", "fixed-split3-ordered", "varlen-whole", "varlen-split3"])
def test_small_tiles(monkeypatch, cu_list, nsplit, ordered):
    """Tiles much smaller than the visible ranges: unmasked key / query tiles, several score tiles
    per selection pass and, in varlen, tiles straddling sequences (one shorter than l) right where
    the first sequence already sees more than a key tile. split3: the dk/dv query range of every
    key tile is cut in three programs whose partial sums meet through atomics (as on a GPU), or
    in split order in deterministic mode (kernels/ordered.py)."""
    monkeypatch.setattr(kc, "_dkdv_splits", lambda *args: nsplit)
    if ordered:
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(kc, "_TILES", {name: ((16, 16, 4, 1),) * len(tiles)
                                       for name, tiles in kc._TILES.items()})
    monkeypatch.setattr(kc, "SHORT_KEYS", -1)  # the table above, whatever the length
    monkeypatch.setattr(kc, "_SELECT_TILES",
                        (((64, 16, 1, 4, 1, None, 0),) * 2,) * len(kc._SELECT_TILES))
    T = 200 if cu_list is None else cu_list[-1]
    H, G, Dk, Dv, l, d, sel, n = 1, 2, 32, 16, 16, 8, 8, 5
    cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.int32, device=_device())
    q, k, v = make_inputs(1, T, H, G, Dk, Dv, l, d, torch.float32, cu, seed=5)
    check_attention(q, k, v, l, d, cu, ATOL[torch.float32], with_dlse=True)
    check_selection(q, k, _cmp_lse(q, k, v, l, d, cu), l, d, sel, n, cu, exact=True, tol=1e-5)


# --------------------------------------------------------------------------------------------
# GPU tests: realistic shapes in half precision, relative error against a float32 reference
# --------------------------------------------------------------------------------------------

# (B, T, H, G, Dk, Dv); l, d, l', n = 32, 16, 64, 16 (paper defaults)
GPU_CASES = [
    (2, 1000, 4, 1, 64, 64),
    (1, 4096, 4, 4, 128, 128),
    (1, 8192, 4, 16, 128, 128),
    (1, 2048, 8, 16, 192, 128),
    (2, 3001, 8, 4, 64, 64),
    (1, 8192, 8, 1, 128, 128),
    (1, 20000, 2, 16, 128, 128),  # 1249 compressed rows: past SHORT_KEYS, the tier's tiles
]
GPU_VARLEN_CU = [0, 17, 1000, 1031, 4096, 6000]


def check_gpu(q, k, v, cu, dtype):
    l, d, sel, n = 32, 16, 64, 16
    scale = q.shape[-1] ** -0.5
    o, lse = kc.compressed_attention_fwd(q, k, v, l, d, scale, cu)
    q32, k32, v32 = (x.float() for x in (q, k, v))
    o_ref, lse_ref = ref.compressed_attention(q32, k32, v32, l, d, scale, cu)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    assert rel_err(o, o_ref) < RTOL_GPU[dtype]
    finite = torch.isfinite(lse_ref)
    assert (lse - lse_ref)[finite].abs().max().item() < 1e-2

    do = torch.randn_like(o)
    dlse = torch.randn_like(lse)
    grads = kc.compressed_attention_bwd(q, k, v, o, lse, do, dlse, l, d, scale, cu)
    grads_ref = ref.compressed_attention_backward(q32, k32, v32, o_ref, lse_ref, do.float(), dlse,
                                                  l, d, scale, cu)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, g_ref) < RTOL_GPU[dtype], name

    block_idx = kc.select_blocks(q, k, lse, l, d, sel, n, scale, cu)
    _, pos = ref.token_layout(q.shape[1], cu, q.device)
    score = reference_scores(q, k, lse, l, d, sel, scale, cu)
    check_selection_property(block_idx, score, pos, sel, n, tol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "B{}-T{}-H{}-G{}-Dk{}-Dv{}".format(*c))
def test_gpu(case, dtype):
    B, T, H, G, Dk, Dv = case
    check_gpu(*make_inputs(B, T, H, G, Dk, Dv, 32, 16, dtype, device="cuda"), None, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("H,G,Dk,Dv", [(4, 16, 128, 128), (8, 4, 192, 128)])
def test_gpu_varlen(H, G, Dk, Dv, dtype):
    cu = torch.tensor(GPU_VARLEN_CU, dtype=torch.int32, device="cuda")
    q, k, v = make_inputs(1, GPU_VARLEN_CU[-1], H, G, Dk, Dv, 32, 16, dtype, cu, device="cuda")
    check_gpu(q, k, v, cu, dtype)


def test_fp32_rows_take_their_own_tiles():
    """fp32 dots run on CUDA cores, where the 16-bit tiles of the same row bytes spilled tens of
    KB a thread (12x slower forward at D = 128 on an H100): fp32 rows up to 512 bytes take
    FP32_TIER, wider ones tier 2; 16-bit rows stay on their byte tiers."""
    assert kc._tier(torch.float32, 64) == kc._tier(torch.float32, 128, 96) == kc.FP32_TIER
    assert kc._tier(torch.float32, 192) == kc._tier(torch.float32, 256) == 2
    assert [kc._tier(dt, 128) for dt in (torch.float16, torch.bfloat16)] == [0, 0]
    assert [kc._tier(torch.bfloat16, dk, dv) for dk, dv in ((192, 128), (256, 256))] == [1, 1]
    assert all(len(tiles) == kc.FP32_TIER + 1 for tiles in kc._TILES.values())
    assert len(kc._SELECT_TILES) == kc.FP32_TIER + 1


@pytest.mark.parametrize("num_sel", [33, 64, 128, 512])
def test_select_blocks_wide_top_n_keeps_the_tables_step(num_sel):
    """A top-n wider than the table's SB keeps its step where the pending scores of one merge
    hold it (SB = the padded n took n = 64 3.4x n = 16's time on an H100: no wide dot), and
    never merges more scores at a time than the table or the top-n needs (at n = 64 with G = 1,
    8 x 64 pending scores a row kept Triton compiling for minutes)."""
    n_pad = pow2(num_sel)
    for tier in range(len(kc._SELECT_TILES)):
        for loads in (1, 4):
            _, table_sb, table_merge, *_ = kc._SELECT_TILES[tier][loads > 1]
            for G in (1, 16):
                for nblk in (None, 20, 100, 4096):
                    _, _, sb, merge, _ = kc._select_cfg(G, tier, num_sel, nblk, loads)
                    assert merge >= 1 and sb * merge >= n_pad
                    assert sb * merge <= max(table_sb * table_merge, n_pad)
                    if nblk in (None, 4096) and table_sb * table_merge >= n_pad:
                        assert sb == table_sb, (tier, loads, G, nblk)


def test_select_blocks_merges_every_step_up_to_step_merges():
    """The spec geometry's tile (tier 0, several key loads a step) merges its top-n every step
    where a sequence has at most the tile's step_merges steps and a step holds the top-n, every
    MERGE steps beyond them, for a top-n wider than a step, and at a symbolic length."""
    _, sb, merge, *_, step_merges = kc._SELECT_TILES[0][1]
    assert step_merges >= merge
    for nblk, num_sel, want in ((sb * step_merges, 16, (sb, 1)),
                                (sb * step_merges + 1, 16, (sb, merge)),
                                (sb * step_merges, 2 * sb, (sb, merge)),
                                (None, 16, (sb, merge))):
        _, _, got_sb, got_merge, _ = kc._select_cfg(16, 0, num_sel, nblk, 4)
        assert (got_sb, got_merge) == want, (nblk, num_sel)


def test_select_blocks_top_n_wider_than_a_step(monkeypatch):
    """n = 20 (padded 32) over steps of 16 blocks merged 2 at a time: each merge ranks exactly
    the padded n pending scores (the GPU's n = 64 on 32-block steps, scaled down)."""
    monkeypatch.setattr(kc, "_SELECT_TILES",
                        (((64, 16, 2, 4, 1, None, 0),) * 2,) * len(kc._SELECT_TILES))
    assert kc._select_cfg(2, 0, 20, 38, 2)[2:4] == (16, 2)
    # 600 tokens: 38 blocks of l' = 16 for the last query, 3 steps of 16
    q, k, v = make_inputs(1, 600, 1, 2, 16, 16, 16, 8, torch.float32, seed=9)
    lse = ref.compressed_attention(q, k, v, 16, 8, q.shape[-1] ** -0.5, None)[1]
    check_selection(q, k, lse, 16, 8, 16, 20, None, exact=True, tol=1e-5)


def test_select_blocks_compiles_for_sm90_at_wide_steps():
    """l' = 8d at 32 blocks a step: scored as one [128 x 256]-key dot, the kernel took one wgmma
    whose accumulator alone needs the 128 registers its launch caps a thread at, and ptxas
    refused it on the H100 (the GPU sweep's draw 20, l=64 d=32 l'=256); the interpreter runs any
    tile, so only ptxas shows it. T = 4096 gives the long-sequence tile of 32 blocks a step."""
    run = compile_for_sm90("select", 16, 8, 64, 16, 4096, 16, 1, 128)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled _select_kernel" in run.stdout and "'maxnreg': 128" in run.stdout, run.stdout


@pytest.mark.parametrize("l,d,sel,n,T,HQ,H,D", [(32, 16, 192, 19, 192, 8, 2, 96),
                                                (32, 8, 96, 16, 4096, 16, 4, 128)],
                         ids=["l'=12d-D96-G4", "l'=12d-d8-D128"])
def test_select_blocks_fits_sm90_shared_memory_at_many_loads_a_step(l, d, sel, n, T, HQ, H, D):
    """l' = 12d: twelve key loads a step, which Triton double-buffers at two stages: 233472
    bytes of shared memory, over sm_90's 232448, so the launch raised OutOfResources (the GPU
    sweep's draw 5 at SEED = 90210, fp16 D = 96 G = 4, on an H200). Past `PIPELINED_LOADS` a
    step takes one stage."""
    run = compile_for_sm90("select", l, d, sel, n, T, HQ, H, D)
    assert run.returncode == 0, run.stderr[-3000:]
    smem = [int(x) for x in re.findall(r"compiled _select_kernel .* smem (\d+)", run.stdout)]
    assert smem and max(smem) <= SM90_SHARED_BYTES, run.stdout
