"""Triton selection-attention kernels (nsa_ops.kernels.selection) against the PyTorch reference.

CPU cases run the kernels under TRITON_INTERPRET (set by conftest.py) and compare with the reference
in float64. Tolerances (elementwise |out - ref| <= atol + rtol * |ref|): fp32 1e-4 / 1e-4, fp16
2e-2 / 2e-2. bf16 is GPU-only (the interpreter's bf16 tl.dot is wrong). GPU cases (-m gpu) compare
||out - ref|| / ||ref|| against a float32 reference: < 1e-2 (fp16), < 2e-2 (bf16).

Outputs are allocated with torch.empty inside the wrappers; the CPU tests make torch.empty return
NaN-filled memory while the kernels run, so any element a kernel fails to write shows up.
"""

import pytest
import torch

from nsa_ops import reference as ref
from nsa_ops.kernels import selection as sel_kernels
from nsa_ops.kernels.selection import selection_attention_bwd, selection_attention_fwd
from helpers import rel_err

CMP_LEN, CMP_STRIDE = 32, 16
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2)}
GPU_TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

def make_qkv(B, T, H, G, Dk, Dv, dtype, device="cpu", strided=False, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    if strided:
        # views into one fused projection: non-contiguous along tokens and heads
        fused = torch.randn(B, T, H * G + 2 * H, max(Dk, Dv), generator=gen, device=device)
        fused = fused.to(dtype)
        return (fused[:, :, : H * G, :Dk], fused[:, :, H * G: H * G + H, :Dk],
                fused[:, :, H * G + H:, :Dv])
    q = torch.randn(B, T, H * G, Dk, generator=gen, device=device).to(dtype)
    k = torch.randn(B, T, H, Dk, generator=gen, device=device).to(dtype)
    v = torch.randn(B, T, H, Dv, generator=gen, device=device).to(dtype)
    return q, k, v


def spec_block_idx(q, k, sel_block, n, scale, cu_seqlens=None):
    """block_idx as NSA computes it (mean pooling, Eq.9/10, forced blocks), as in ref.nsa."""
    q32, k32 = q.float(), k.float()
    k_cmp = ref.compress_mean(k32, CMP_LEN, CMP_STRIDE, cu_seqlens)
    _, lse_cmp = ref.compressed_attention(q32, k_cmp, k_cmp, CMP_LEN, CMP_STRIDE, scale, cu_seqlens)
    return ref.select_blocks(q32, k_cmp, lse_cmp, CMP_LEN, CMP_STRIDE, sel_block, n, scale,
                             cu_seqlens)


def random_block_idx(B, T, H, n, sel_block, cu_seqlens=None, seed=1):
    """Random valid selections: 0..n distinct causal blocks per row (some rows empty), -1 last."""
    gen = torch.Generator().manual_seed(seed)
    _, pos = ref.token_layout(T, cu_seqlens, "cpu")
    nblk = max(n, -(-T // sel_block))
    avail = torch.arange(nblk)[None] * sel_block <= pos[:, None]  # [T, nblk]
    score = torch.rand(B, T, H, nblk, generator=gen).masked_fill(~avail[None, :, None], -1.0)
    count = torch.randint(0, n + 1, (B, T, H, 1), generator=gen)
    order = score.argsort(-1, descending=True)[..., :n]
    take = (torch.arange(n) < count) & (torch.gather(score, -1, order) >= 0)
    picked = torch.where(take, order, nblk).sort(-1).values
    return torch.where(picked == nblk, -1, picked).to(torch.int32)


def as_set(block_idx, seed=2):
    """The same selections written as a set may be: slots shuffled, -1 anywhere, each row's
    first slot repeated in its last (a block named twice counts once)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.rand(block_idx.shape, generator=gen).argsort(-1)
    shuffled = torch.gather(block_idx, -1, perm)
    return torch.cat([shuffled, shuffled[..., :1]], -1)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------

def assert_close(name, out, expected, dtype):
    atol, rtol = TOL[dtype]
    out64 = out.double()
    assert torch.isfinite(out64).all(), f"{name}: non-finite values"
    err = (out64 - expected).abs() - rtol * expected.abs()
    assert err.max() <= atol, f"{name}: max excess error {err.max().item():.3e} (atol {atol})"


def assert_lse(lse, expected, dtype):
    assert lse.dtype == torch.float32
    empty = torch.isneginf(expected)
    assert torch.equal(torch.isneginf(lse), empty), "lse: -inf rows differ"
    assert not torch.isnan(lse).any()
    assert_close("lse", lse[~empty], expected[~empty], dtype)


# --------------------------------------------------------------------------------------------
# CPU (interpreter) cases
# --------------------------------------------------------------------------------------------

# (B, T, H, G, Dk, Dv, sel_block, n, dtype, selection, dlse, extra) with extra in
# {"", "strided", "chunks"}; "chunks" cuts the dk/dv inverse index into one tile per chunk so that
# blocks span many chunks (exercises the atomic accumulation). selection "set": random selections
# shuffled, with a repeated slot. l' = 24 / 48 / 96 are not multiples of a power-of-two key tile
# >= 16 (24: one masked 32-key tile; 96: three 32-key tiles).
CASES = [
    (1, 50, 2, 1, 16, 16, 16, 3, torch.float32, "spec", False, ""),
    (2, 50, 1, 2, 32, 16, 32, 4, torch.float16, "random", True, ""),
    (1, 97, 1, 4, 32, 16, 16, 4, torch.float32, "random", True, "chunks"),
    (1, 97, 1, 4, 16, 16, 32, 3, torch.float16, "spec", False, "chunks"),
    (1, 50, 2, 2, 32, 16, 16, 4, torch.float32, "spec", True, "strided"),
    (1, 50, 1, 3, 32, 16, 32, 3, torch.float32, "random", True, "chunks"),
    (1, 50, 1, 2, 16, 16, 128, 2, torch.float32, "random", True, ""),
    (1, 60, 1, 2, 16, 16, 16, 4, torch.float32, "set", True, "chunks"),
    (1, 60, 1, 2, 16, 16, 24, 3, torch.float32, "set", True, ""),
    (1, 70, 1, 2, 16, 24, 48, 3, torch.float32, "random", True, "chunks"),
    (1, 100, 1, 2, 16, 16, 96, 2, torch.float32, "set", False, ""),
    # wide heads (padded Dk + Dv > 256): dK dV's wide configs, dq's 32-key tiles
    (1, 40, 1, 2, 144, 136, 32, 2, torch.float32, "random", True, "chunks"),
    (1, 40, 1, 2, 160, 112, 16, 3, torch.float16, "spec", False, ""),
]


def run_case(q, k, v, block_idx, sel_block, dtype, with_dlse, cu_seqlens=None, tma=None,
             stored_ds=None):
    scale = q.shape[-1] ** -0.5
    gen = torch.Generator().manual_seed(2)
    o, lse = selection_attention_fwd(q, k, v, block_idx, sel_block, scale, cu_seqlens, tma=tma)
    do = torch.randn(o.shape, generator=gen).to(dtype)
    dlse = torch.randn(lse.shape, generator=gen) if with_dlse else None
    dq, dk, dv = selection_attention_bwd(q, k, v, o, lse, do, dlse, block_idx, sel_block, scale,
                                         cu_seqlens, stored_ds=stored_ds)

    q64, k64, v64 = q.double(), k.double(), v.double()
    o_ref, lse_ref = ref.selection_attention(q64, k64, v64, block_idx, sel_block, scale, cu_seqlens)
    grads_ref = ref.selection_attention_backward(
        q64, k64, v64, o_ref, lse_ref, do.double(), None if dlse is None else dlse.double(),
        block_idx, sel_block, scale, cu_seqlens)

    assert o.dtype == dtype and o.shape == o_ref.shape
    assert_close("o", o, o_ref, dtype)
    assert_lse(lse, lse_ref, dtype)
    for name, g, g_ref, x in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close(name, g, g_ref, dtype)


def case_inputs(B, T, H, G, Dk, Dv, sel_block, n, dtype, selection, extra):
    """(q, k, v, block_idx) of a CASES row."""
    q, k, v = make_qkv(B, T, H, G, Dk, Dv, dtype, strided=extra == "strided")
    if selection == "spec":
        block_idx = spec_block_idx(q, k, sel_block, n, Dk ** -0.5)
    else:
        block_idx = random_block_idx(B, T, H, n, sel_block)
    if selection == "set":
        block_idx = as_set(block_idx)
    return q, k, v, block_idx


@pytest.mark.parametrize("B,T,H,G,Dk,Dv,sel_block,n,dtype,selection,with_dlse,extra", CASES)
def test_selection_kernels(B, T, H, G, Dk, Dv, sel_block, n, dtype, selection, with_dlse, extra,
                           monkeypatch, poisoned_empty):
    if extra == "chunks":
        monkeypatch.setattr(sel_kernels, "ROWS_PER_CHUNK", 1)
    q, k, v, block_idx = case_inputs(B, T, H, G, Dk, Dv, sel_block, n, dtype, selection, extra)
    if selection == "set":
        assert (block_idx[..., :-1] < 0).any() and (block_idx[..., 0] >= 0).any()
    assert (block_idx < 0).any(), "cases must include empty slots"
    run_case(q, k, v, block_idx, sel_block, dtype, with_dlse)


# dq worked out again from K and V (`_dq_kernel`), where the dS buffer would not fit: the cases
# above run dq from the dS the dK dV pass stored (the default wherever it fits, the CPU too)
@pytest.mark.parametrize("B,T,H,G,Dk,Dv,sel_block,n,dtype,selection,with_dlse,extra",
                         [CASES[i] for i in (1, 2, 7, 10, 12)])
def test_selection_kernels_recomputed_ds(B, T, H, G, Dk, Dv, sel_block, n, dtype, selection,
                                         with_dlse, extra, monkeypatch, poisoned_empty):
    if extra == "chunks":
        monkeypatch.setattr(sel_kernels, "ROWS_PER_CHUNK", 1)
    q, k, v, block_idx = case_inputs(B, T, H, G, Dk, Dv, sel_block, n, dtype, selection, extra)
    run_case(q, k, v, block_idx, sel_block, dtype, with_dlse, stored_ds=False)


@pytest.mark.parametrize("stored_ds", [True, False])
def test_selection_dq_paths_launch(stored_ds, monkeypatch):
    """stored_ds picks dq's kernel: one launch of `_dq_ds_kernel` after the dK dV pass, or of
    `_dq_kernel` before it, never both; forcing it where it cannot run names the reason."""
    spies = {name: LaunchSpy(getattr(sel_kernels, name))
             for name in ("_dq_kernel", "_dq_ds_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(sel_kernels, name, spy)
    q, k, v = make_qkv(1, 40, 1, 2, 16, 16, torch.float32)
    block_idx = random_block_idx(1, 40, 1, 2, 16)
    o, lse = selection_attention_fwd(q, k, v, block_idx, 16, 0.25)
    selection_attention_bwd(q, k, v, o, lse, o, None, block_idx, 16, 0.25, stored_ds=stored_ds)
    assert spies["_dq_ds_kernel"].launches == int(stored_ds)
    assert spies["_dq_kernel"].launches == int(not stored_ds)
    with pytest.raises(ValueError, match="stored_ds=True: too big"):
        sel_kernels._stored_ds(True, "too big")
    assert sel_kernels._stored_ds(None, "too big") is False
    assert sel_kernels._stored_ds(None, None) is True
    assert sel_kernels._stored_ds(None, None, preferred=False) is False
    assert sel_kernels._stored_ds(True, None, preferred=False) is True


def test_stored_ds_pays_from_min_tokens_without_an_early_index():
    """On a GPU without an index started early (torch.compile's backward) the exposed index
    costs more than dq from dS saves below STORED_DS_MIN_TOKENS; with one, or off a GPU, it
    always pays."""
    short, long_ = sel_kernels.STORED_DS_MIN_TOKENS - 1, sel_kernels.STORED_DS_MIN_TOKENS
    assert not sel_kernels._stored_ds_preferred(True, short, False)
    assert sel_kernels._stored_ds_preferred(True, long_, False)
    assert sel_kernels._stored_ds_preferred(True, short, True)
    assert sel_kernels._stored_ds_preferred(False, short, False)


def ds_budget(monkeypatch, q, n, sel_block, tokens):
    """Gives the dS buffer a budget of `tokens` query tokens' dS, as a GPU's memory would."""
    per_token = q.shape[0] * q.shape[2] * n * sel_block * q.element_size()
    monkeypatch.setattr(sel_kernels, "_ds_budget", lambda device: int(tokens * per_token))


@pytest.mark.parametrize("case,window", [(CASES[1], 16), (CASES[2], 32), (CASES[9], 8),
                                         (CASES[12], 16)],
                         ids=["fp16-B2", "fp32-chunks", "fp32-l48", "wide-fp16"])
def test_selection_stored_ds_windows(case, window, monkeypatch, poisoned_empty):
    """A dS buffer over its budget: the passes run window by window over the queries, the dS of
    one window at a time (a budget of 1.5 windows' tokens: windows of the power of two below),
    dk / dv summed over the windows."""
    B, T, H, G, Dk, Dv, sel_block, n, dtype, selection, with_dlse, extra = case
    if extra == "chunks":
        monkeypatch.setattr(sel_kernels, "ROWS_PER_CHUNK", 1)
    q, k, v, block_idx = case_inputs(B, T, H, G, Dk, Dv, sel_block, n, dtype, selection, extra)
    ds_budget(monkeypatch, q, n, sel_block, window * 3 // 2)
    assert sel_kernels._ds_window(q, n, sel_block) == window
    spy = LaunchSpy(sel_kernels._dq_ds_kernel)
    monkeypatch.setattr(sel_kernels, "_dq_ds_kernel", spy)
    run_case(q, k, v, block_idx, sel_block, dtype, with_dlse)
    assert spy.launches == -(-T // window)


def test_stored_ds_window_rule(monkeypatch):
    """All queries in one window (None) where their dS fits the budget, else windows of the
    largest power of two that does; packed sequences are not cut, and a budget below one
    token's dS is refused with the reason."""
    q = torch.empty(2, 100, 8, 16)
    ds_budget(monkeypatch, q, 4, 16, 100)
    assert sel_kernels._ds_window(q, 4, 16) is None
    assert sel_kernels._stored_ds_reason(q, 4, 16, True) is None
    ds_budget(monkeypatch, q, 4, 16, 99)
    assert sel_kernels._ds_window(q, 4, 16) == 64
    assert sel_kernels._stored_ds_reason(q, 4, 16, False) is None
    assert "dS buffer of packed sequences" in sel_kernels._stored_ds_reason(q, 4, 16, True)
    ds_budget(monkeypatch, q, 4, 16, 0.5)
    assert "dS buffer of one query token" in sel_kernels._stored_ds_reason(q, 4, 16, False)
    monkeypatch.setattr(sel_kernels, "_ds_budget", lambda device: None)  # off a GPU: no bound
    assert sel_kernels._ds_window(q, 4, 16) is None


@pytest.mark.parametrize("stored_ds", [True, False])
def test_selection_backward_index(stored_ds, monkeypatch, poisoned_empty):
    """index= (`backward_index`, which the eager layer starts early): the gradients of the
    backward that builds its own, bitwise; an index built for another backward is refused."""
    monkeypatch.setattr(sel_kernels, "ROWS_PER_CHUNK", 1)
    q, k, v, block_idx = case_inputs(*CASES[7][:10], CASES[7][11])
    ds_budget(monkeypatch, q, block_idx.shape[3], 16, 20)  # stored: windows of 16 queries
    o, lse = selection_attention_fwd(q, k, v, block_idx, 16, 0.25)
    args = (q, k, v, o, lse, o, None, block_idx, 16, 0.25)
    index = sel_kernels.backward_index(q, k, v, block_idx, 16, stored_ds=stored_ds)
    assert len(index.windows) == (4 if stored_ds else 1)
    got = selection_attention_bwd(*args, stored_ds=stored_ds, index=index)
    want = selection_attention_bwd(*args, stored_ds=stored_ds)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="index: built for"):
        selection_attention_bwd(*args, stored_ds=not stored_ds, index=index)
    if stored_ds:  # windows of another length
        ds_budget(monkeypatch, q, block_idx.shape[3], 16, 40)
        with pytest.raises(ValueError, match="index: built for"):
            selection_attention_bwd(*args, stored_ds=True, index=index)


# The forward's TMA loads (sm90+ GPUs pick them; the interpreter runs them when asked): whole
# boxes, no row mask, the query's own partial tile from masked loads; the cases cover blocks of
# several tiles (l' = 48, 96, 128), empty and repeated slots, strided views, varlen (below), fp16,
# wide heads (their 16-key tiles)
TMA_CASES = [CASES[i] for i in (1, 2, 4, 6, 9, 10, 11, 12)]


def test_selection_tma_refuses_partial_tiles():
    q, k, v = make_qkv(1, 40, 1, 2, 16, 16, torch.float32)
    block_idx = random_block_idx(1, 40, 1, 2, 24)
    with pytest.raises(ValueError, match="tma=True: sel_block=24"):
        selection_attention_fwd(q, k, v, block_idx, 24, 0.25, tma=True)


@pytest.mark.parametrize("B,T,H,G,Dk,Dv,sel_block,n,dtype,selection,with_dlse,extra", TMA_CASES)
def test_selection_kernels_tma(B, T, H, G, Dk, Dv, sel_block, n, dtype, selection, with_dlse,
                               extra, poisoned_empty):
    q, k, v, block_idx = case_inputs(B, T, H, G, Dk, Dv, sel_block, n, dtype, selection, extra)
    run_case(q, k, v, block_idx, sel_block, dtype, with_dlse, tma=True)


# The forward's shared pass (fixed length, TMA): groups of queries attend the blocks they all
# picked as one tile first. (B, Tk, Tq, H, G, Dk, Dv, l', n, dtype, run, drop): block_idx over the
# Tk keys, the last Tq rows (queries at an offset); run = 0: as NSA selects it (the groups share
# the forced blocks), run > 0: random scores shared by runs of `run` queries (neighbouring queries
# select alike, as in trained models; runs of 3 and 6 straddle the groups), then a fraction `drop`
# of the rows' blocks (run = 0: of their forced blocks) dropped, so that groups share some blocks
# and not others, and slots shuffled. G = 4 / 2 / 16 / 1 make groups of 16 / 32 / 4 / 16 queries;
# the wide heads' 16-key walk tiles (padded Dk + Dv > 256) bound a group to 16 queries.
SHARED_CASES = [
    (1, 97, 97, 1, 4, 32, 16, 16, 4, torch.float32, 0, 0.0),
    (2, 90, 61, 2, 2, 16, 16, 32, 3, torch.float16, 0, 0.3),
    (1, 80, 80, 1, 16, 16, 16, 16, 3, torch.float32, 0, 0.1),
    (1, 70, 33, 1, 1, 16, 8, 16, 3, torch.float32, 0, 0.2),
    (1, 160, 160, 2, 16, 16, 16, 16, 5, torch.float32, 8, 0.0),
    (1, 150, 117, 1, 16, 32, 16, 16, 6, torch.float16, 6, 0.05),
    (2, 140, 140, 1, 4, 16, 16, 16, 4, torch.float32, 3, 0.02),
    (1, 120, 90, 1, 2, 160, 112, 32, 3, torch.float16, 4, 0.05),
]


def shared_case_block_idx(q, k, Tq, sel_block, n, run, drop):
    B, Tk, H = k.shape[:3]
    pos = torch.arange(Tk - Tq, Tk)
    gen = torch.Generator().manual_seed(8)
    if run:
        score = torch.rand(B, -(-Tk // run), H, -(-Tk // sel_block), generator=gen)
        block_idx = ref.topn_blocks(score.repeat_interleave(run, 1)[:, :Tk], torch.arange(Tk),
                                    sel_block, n)[:, Tk - Tq:]
        victim = torch.rand(block_idx.shape, generator=gen) < drop
    else:
        block_idx = spec_block_idx(q, k, sel_block, n, q.shape[-1] ** -0.5)[:, Tk - Tq:]
        blk_pos = pos[None, :, None, None] // sel_block
        forced = (block_idx == 0) | (block_idx == blk_pos) | (block_idx == blk_pos - 1)
        victim = forced & (torch.rand(block_idx.shape, generator=gen) < drop / 3)
    return as_set(torch.where(victim, -1, block_idx))


@pytest.mark.parametrize("B,Tk,Tq,H,G,Dk,Dv,sel_block,n,dtype,run,drop,stored_ds,window",
                         [case + (True, None) for case in SHARED_CASES]
                         + [SHARED_CASES[i] + (False, None) for i in (1, 5, 7)]
                         + [SHARED_CASES[1] + (True, 16), SHARED_CASES[4] + (True, 32)])
def test_selection_shared_pass(B, Tk, Tq, H, G, Dk, Dv, sel_block, n, dtype, run, drop,
                               stored_ds, window, monkeypatch, poisoned_empty):
    """The forward's pass and dq's (`_shared_dq_kernel`), the latter taking groups that share
    2 blocks or more here, so that some groups leave it all to the walk and others do not; the
    walk sums dq from stored dS (finding each of its blocks' slots in block_idx, which repeats
    some) or works it out again. window: dS over windows of that many queries (the groups of
    16 / 4 queries of the two cases straddle none / some of their edges)."""
    monkeypatch.setattr(sel_kernels, "SHARED_DQ_MIN", 2)
    q, k, v = make_qkv(B, Tk, H, G, Dk, Dv, dtype, seed=7)
    block_idx = shared_case_block_idx(q, k, Tq, sel_block, n, run, drop)
    q = q[:, Tk - Tq:]
    if window:
        ds_budget(monkeypatch, q, n, sel_block, window + 1)
    scale = Dk ** -0.5
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(q.shape[:3] + (Dv,), generator=gen).to(dtype)
    dlse = torch.randn(q.shape[:3], generator=gen)
    o, lse = selection_attention_fwd(q, k, v, block_idx, sel_block, scale, tma=True, shared=True)
    grads = selection_attention_bwd(q, k, v, o, lse, do, dlse, block_idx, sel_block, scale,
                                    shared=True, stored_ds=stored_ds)
    q64, k64, v64 = q.double(), k.double(), v.double()
    o_ref, lse_ref = ref.selection_attention(q64, k64, v64, block_idx, sel_block, scale)
    grads_ref = ref.selection_attention_backward(q64, k64, v64, o_ref, lse_ref, do.double(),
                                                 dlse.double(), block_idx, sel_block, scale)
    assert_close("o", o, o_ref, dtype)
    assert_lse(lse, lse_ref, dtype)
    for name, grad, expected in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(name, grad, expected, dtype)


# the interpreter takes the max of a NaN row with numpy, which warns
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
@pytest.mark.parametrize("poison", ["q", "key"])
def test_selection_shared_pass_keeps_nan_rows_nan(poison):
    """The walk merges the pass's output by its lse: a NaN lse had counted as an empty row's, so
    a NaN key in a shared block left the row's lse finite. The NaN rows of o and lse are those of
    the reference (tests/test_semantics.py: the rows that see the NaN)."""
    B, Tk, Tq, H, G, Dk, Dv, sel_block, n, dtype, run, drop = SHARED_CASES[0]
    q, k, v = make_qkv(B, Tk, H, G, Dk, Dv, dtype, seed=7)
    block_idx = shared_case_block_idx(q, k, Tq, sel_block, n, run, drop)
    if poison == "q":
        q[0, 50, 1, 3] = float("nan")
    else:
        k[0, 5, 0, 3] = float("nan")  # in block 0, which every query takes
    o, lse = selection_attention_fwd(q, k, v, block_idx, sel_block, Dk ** -0.5, tma=True,
                                     shared=True)
    o_ref, lse_ref = ref.selection_attention(q.double(), k.double(), v.double(), block_idx,
                                             sel_block, Dk ** -0.5)
    assert o_ref.isnan().any() and not o_ref.isnan().all()
    assert torch.equal(o.isnan().any(-1), o_ref.isnan().any(-1))
    assert torch.equal(lse.isnan(), lse_ref.isnan())


def test_selection_shared_pass_refuses():
    q, k, v = make_qkv(1, 40, 1, 2, 16, 16, torch.float32)
    block_idx = random_block_idx(1, 40, 1, 2, 16)
    with pytest.raises(ValueError, match="shared=True: the per-token walk reads K/V without TMA"):
        selection_attention_fwd(q, k, v, block_idx, 16, 0.25, tma=False, shared=True)
    cu_seqlens = torch.tensor([0, 15, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="shared=True: packed sequences"):
        selection_attention_fwd(q, k, v, block_idx, 16, 0.25, cu_seqlens, tma=True, shared=True)
    o, lse = selection_attention_fwd(q, k, v, block_idx, 16, 0.25, cu_seqlens)
    with pytest.raises(ValueError, match="shared=True: packed sequences"):
        selection_attention_bwd(q, k, v, o, lse, o, None, block_idx, 16, 0.25, cu_seqlens,
                                shared=True)


class LaunchSpy:
    """Stands in for a Triton kernel, counting its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("dtype,shared,launched", [
    (torch.float16, None, True), (torch.float32, None, False), (torch.float32, True, True)])
def test_fp32_leaves_shared_passes_out_unless_forced(dtype, shared, launched, monkeypatch):
    """fp32 dots run on CUDA cores, where the shared passes' 64-row tiles spill (backward 94 ms
    without dq's, 137-576 with it, H100, T = 8k): left to us (None), fp32 runs no shared pass
    and no TMA loads; forced, they run; 16-bit inputs keep them; the launch picks are fp32's."""
    spy = LaunchSpy(sel_kernels._shared_dq_kernel)
    monkeypatch.setattr(sel_kernels, "_shared_dq_kernel", spy)
    q, k, v = make_qkv(1, 40, 1, 2, 16, 16, dtype)
    block_idx = random_block_idx(1, 40, 1, 2, 16)
    o, lse = selection_attention_fwd(q, k, v, block_idx, 16, 0.25, tma=shared, shared=shared)
    selection_attention_bwd(q, k, v, o, lse, o, None, block_idx, 16, 0.25, shared=shared)
    assert (spy.launches == 1) == launched
    cuda_cores = dtype == torch.float32
    assert (sel_kernels._cuda_core_default(None, dtype) is False) == cuda_cores
    for kernel in ("fwd", "dq"):
        pick = sel_kernels._PER_TOKEN_PICK[f"{kernel}_fp32" if cuda_cores else kernel]
        assert tuple(sel_kernels._per_token_launch(kernel, dtype).values()) == pick


@pytest.mark.parametrize("tma,shared", [(False, False), (True, True)])
def test_selection_fwd_writes_given_buffers(tma, shared):
    """out=(o, lse) (the compiled forward hands Inductor's buffers): every element written, o
    through its own strides (a head slice here), bitwise what the kernel returns unasked; buffers
    that do not fit are refused by name."""
    q, k, v = make_qkv(1, 70, 1, 4, 16, 16, torch.float32, seed=3)
    block_idx = shared_case_block_idx(q, k, 70, 16, 3, 6, 0.1)
    o_wide = torch.full((1, 70, 6, 16), float("nan"))
    o, lse = o_wide[:, :, 1:5], torch.full((1, 70, 4), float("nan"))
    got = selection_attention_fwd(q, k, v, block_idx, 16, 0.25, tma=tma, shared=shared,
                                  out=(o, lse))
    assert got[0] is o and got[1] is lse
    expected = selection_attention_fwd(q, k, v, block_idx, 16, 0.25, tma=tma, shared=shared)
    assert torch.equal(o, expected[0]) and torch.equal(lse, expected[1])
    assert o_wide[:, :, [0, 5]].isnan().all()
    with pytest.raises(ValueError, match=r"out\[0\] \(o\) must be"):
        selection_attention_fwd(q, k, v, block_idx, 16, 0.25, out=(o.half(), lse))
    with pytest.raises(ValueError, match=r"out\[1\] \(lse\) must be a contiguous"):
        selection_attention_fwd(q, k, v, block_idx, 16, 0.25, out=(o, lse.mT.contiguous().mT))


@pytest.mark.parametrize("tma,shared,window,keep,dtype,strided,lengths", [
    (False, False, True, True, torch.float32, True, None),
    (False, False, False, False, torch.float16, False, None),
    (True, False, True, False, torch.float32, False, None),
    (True, True, True, True, torch.float16, True, None),
    (True, True, True, False, torch.float32, False, None),
    (True, True, False, True, torch.float32, True, None),
    (None, None, True, False, torch.float32, True, (21, 39, 37)),
])
def test_selection_gated_forward(tma, shared, window, keep, dtype, strided, lengths,
                                 poisoned_empty):
    """The forward with the gated combine in its epilogue (nsa_attention's last step): o against
    the float64 combine of the reference's branch output with the other two given, the branch's
    own output (where kept) and lse bitwise those of the forward alone; with and without a
    window branch, the pass's buffer shared with the combine (not kept), gates sliced from one
    [B, T, HQ, 3] tensor (strided), packed sequences."""
    from nsa_ops.kernels.selection import selection_attention_gated_fwd
    B, T, H, G, D, sel_block, n = 2, 97, 1, 4, 16, 16, 4
    cu = None
    if lengths is not None:
        B, T = 1, sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = make_qkv(B, T, H, G, D, D, dtype, seed=11)
    if lengths is None:
        block_idx = shared_case_block_idx(q, k, T, sel_block, n, 6, 0.1)
    else:
        block_idx = random_block_idx(B, T, H, n, sel_block, cu)
    gen = torch.Generator().manual_seed(12)
    o_cmp, o_win = (torch.randn(B, T, H * G, D, generator=gen).to(dtype) for _ in range(2))
    if strided:
        g_cmp, g_slc, g_win = torch.rand(B, T, H * G, 3, generator=gen).to(dtype).unbind(-1)
    else:
        g_cmp, g_slc, g_win = (torch.rand(B, T, H * G, generator=gen).to(dtype) for _ in range(3))
    if not window:
        o_win = g_win = None
    scale = D ** -0.5
    o, o_slc, lse = selection_attention_gated_fwd(
        q, k, v, block_idx, sel_block, scale, cu, o_cmp=o_cmp, o_win=o_win, g_cmp=g_cmp,
        g_slc=g_slc, g_win=g_win, keep_branch=keep, tma=tma, shared=shared)
    alone, lse_alone = selection_attention_fwd(q, k, v, block_idx, sel_block, scale, cu, tma=tma,
                                               shared=shared)
    assert torch.equal(lse, lse_alone)
    assert torch.equal(o_slc, alone) if keep else o_slc is None
    o_ref, _ = ref.selection_attention(q.double(), k.double(), v.double(), block_idx, sel_block,
                                       scale, cu)
    want = ref.gate_combine(o_cmp.double(), o_ref, None if o_win is None else o_win.double(),
                            g_cmp.double(), g_slc.double(),
                            None if g_win is None else g_win.double())
    assert o.dtype == dtype
    assert_close("o", o, want, dtype)


@pytest.mark.parametrize("case,stored_ds,shared,window,lengths", [
    (SHARED_CASES[1], True, True, None, None),
    (SHARED_CASES[5], False, True, None, None),
    (SHARED_CASES[4], True, True, 32, None),
    (SHARED_CASES[0], True, False, None, None),
    (SHARED_CASES[0], False, None, None, (21, 39, 37)),
])
def test_selection_backward_do_gate(case, stored_ds, shared, window, lengths, monkeypatch,
                                    poisoned_empty):
    """do_gate (nsa_attention's eager backward): the gradients of do_gate * do from do, the
    kernels scaling P (dK dV, so the dS stored too) and dq rows (the walk and dq's shared pass,
    which takes groups sharing 2 blocks here), over query windows and packed sequences, against
    the reference given the product, also with the rows' delta given in place of o; gates of
    either sign; an lse gradient beside either refused."""
    monkeypatch.setattr(sel_kernels, "SHARED_DQ_MIN", 2)
    B, Tk, Tq, H, G, Dk, Dv, sel_block, n, dtype, run, drop = case
    cu = None
    q, k, v = make_qkv(B, Tk, H, G, Dk, Dv, dtype, seed=7)
    if lengths is None:
        block_idx = shared_case_block_idx(q, k, Tq, sel_block, n, run, drop)
        q = q[:, Tk - Tq:]
    else:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        block_idx = random_block_idx(B, Tk, H, n, sel_block, cu)
    if window:
        ds_budget(monkeypatch, q, n, sel_block, window + 1)
    scale = Dk ** -0.5
    gen = torch.Generator().manual_seed(10)
    do = torch.randn(q.shape[:3] + (Dv,), generator=gen).to(dtype)
    gate = (torch.rand(q.shape[:3], generator=gen) - 0.25).to(dtype)
    o, lse = selection_attention_fwd(q, k, v, block_idx, sel_block, scale, cu,
                                     tma=shared, shared=shared)
    grads = selection_attention_bwd(q, k, v, o, lse, do, None, block_idx, sel_block, scale, cu,
                                    shared=shared, stored_ds=stored_ds, do_gate=gate)
    q64, k64, v64 = q.double(), k.double(), v.double()
    o_ref, lse_ref = ref.selection_attention(q64, k64, v64, block_idx, sel_block, scale, cu)
    grads_ref = ref.selection_attention_backward(
        q64, k64, v64, o_ref, lse_ref, gate.double().unsqueeze(-1) * do.double(), None,
        block_idx, sel_block, scale, cu)
    for name, grad, expected in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(name, grad, expected, dtype)
    # with the rows' delta given (the layer's gate backward sums it), o goes unread: NaN there
    # leaves the same gradients
    delta = (do.float() * o.float()).sum(-1)
    given = selection_attention_bwd(q, k, v, torch.full_like(o, float("nan")), lse, do, None,
                                    block_idx, sel_block, scale, cu, shared=shared,
                                    stored_ds=stored_ds, do_gate=gate, delta=delta)
    for name, grad, expected in zip(("dq", "dk", "dv"), given, grads_ref):
        assert_close(name, grad, expected, dtype)
    with pytest.raises(ValueError, match="do_gate: a backward takes a gate for dO only"):
        selection_attention_bwd(q, k, v, o, lse, do, torch.zeros_like(lse), block_idx, sel_block,
                                scale, cu, do_gate=gate)
    with pytest.raises(ValueError, match="delta: give rowsum"):
        selection_attention_bwd(q, k, v, o, lse, do, torch.zeros_like(lse), block_idx, sel_block,
                                scale, cu, delta=delta)


@pytest.mark.parametrize("tma,shared", [(False, False), (True, False), (True, True)])
def test_selection_future_keys_unread(tma, shared, poisoned_empty):
    """Keys a query may not see never reach its sums, even non-finite ones: NaN keys and values
    from token CUT on leave o, lse and dq of the earlier queries bitwise as with finite ones
    (their blocks run past CUT; the forced local blocks always do, and the shared pass's groups
    straddle it)."""
    T, H, G, D, sel_block, n, CUT = 80, 1, 2, 16, 32, 4, 45
    q, k, v = make_qkv(1, T, H, G, D, D, torch.float32, seed=4)
    score = torch.rand(1, T, H, -(-T // sel_block), generator=torch.Generator().manual_seed(5))
    block_idx = ref.topn_blocks(score, torch.arange(T), sel_block, n)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    results = []
    for future in (0.5, float("nan")):
        kf, vf = k.clone(), v.clone()
        kf[:, CUT:], vf[:, CUT:] = future, future
        o, lse = selection_attention_fwd(q, kf, vf, block_idx, sel_block, 0.25, tma=tma,
                                         shared=shared)
        dq, _, _ = selection_attention_bwd(q, kf, vf, o, lse, do, None, block_idx, sel_block,
                                           0.25)
        results.append([x[:, :CUT] for x in (o, lse, dq)])
    for name, a, b in zip(("o", "lse", "dq"), *results):
        assert not torch.isnan(b).any() and torch.equal(a, b), name


@pytest.mark.parametrize("case,stored_ds,window", [(CASES[2], True, None), (CASES[9], True, None),
                                                   (CASES[2], False, None), (CASES[2], True, 32)],
                         ids=["fp32-l16", "fp32-l48", "fp32-l16-recomputed", "fp32-l16-windows"])
def test_selection_kernels_ordered(case, stored_ds, window, monkeypatch, poisoned_empty,
                                   deterministic):
    """Deterministic mode (kernels/ordered.py): the chunks of a block add in chunk order, with
    one query per chunk so that blocks span many chunks; windows: one window's after another's."""
    B, T, H, G, Dk, Dv, sel_block, n, dtype, _, with_dlse, _ = case
    monkeypatch.setattr(sel_kernels, "ROWS_PER_CHUNK", 1)
    q, k, v = make_qkv(B, T, H, G, Dk, Dv, dtype)
    if window:
        ds_budget(monkeypatch, q, n, sel_block, window)
    run_case(q, k, v, random_block_idx(B, T, H, n, sel_block), sel_block, dtype, with_dlse,
             stored_ds=stored_ds)


@pytest.mark.parametrize("adds,dtype", [(1, torch.float32), (2, torch.float32),
                                         (2, torch.float16)])
def test_selection_dq_add(adds, dtype, poisoned_empty):
    """dq_add: the dq kernel comes back with the given gradients summed in (fp32, one rounding),
    dk and dv untouched; a wrong shape is refused by name."""
    q, k, v = make_qkv(1, 50, 2, 2, 32, 16, dtype)
    block_idx = random_block_idx(1, 50, 2, 3, 16)
    scale = 32 ** -0.5
    o, lse = selection_attention_fwd(q, k, v, block_idx, 16, scale)
    gen = torch.Generator().manual_seed(8)
    do = torch.randn(o.shape, generator=gen).to(dtype)
    parts = [torch.randn(q.shape, generator=gen).to(dtype) for _ in range(adds)]
    plain = selection_attention_bwd(q, k, v, o, lse, do, None, block_idx, 16, scale)
    summed = selection_attention_bwd(q, k, v, o, lse, do, None, block_idx, 16, scale,
                                     dq_add=parts)
    assert summed[0].dtype == dtype
    assert_close("dq", summed[0], plain[0].double() + sum(x.double() for x in parts), dtype)
    assert torch.equal(summed[1], plain[1]) and torch.equal(summed[2], plain[2])
    with pytest.raises(ValueError, match="dq_add must hold at most two tensors shaped like q"):
        selection_attention_bwd(q, k, v, o, lse, do, None, block_idx, 16, scale,
                                dq_add=[parts[0][:, :-1]])


@pytest.mark.parametrize("selection,tma", [("spec", None), ("random", None), ("random", True)])
def test_selection_kernels_varlen(selection, tma, poisoned_empty):
    cu_seqlens = torch.tensor([0, 21, 60, 97], dtype=torch.int32)
    T, H, G, Dk, Dv, sel_block, n = 97, 1, 2, 32, 16, 16, 3
    q, k, v = make_qkv(1, T, H, G, Dk, Dv, torch.float32, seed=3)
    if selection == "spec":
        block_idx = spec_block_idx(q, k, sel_block, n, Dk ** -0.5, cu_seqlens)
    else:
        block_idx = random_block_idx(1, T, H, n, sel_block, cu_seqlens)
    run_case(q, k, v, block_idx, sel_block, torch.float32, True, cu_seqlens, tma=tma)


# --------------------------------------------------------------------------------------------
# GPU cases (pytest -m gpu)
# --------------------------------------------------------------------------------------------

def run_gpu_case(B, T, H, G, Dk, Dv, dtype, cu_seqlens=None, sel_block=64, n=16, device="cuda",
                 stored_ds=None):
    q, k, v = make_qkv(B, T, H, G, Dk, Dv, dtype, device=device)
    scale = Dk ** -0.5
    block_idx = spec_block_idx(q, k, sel_block, n, scale, cu_seqlens)
    gen = torch.Generator(device=device).manual_seed(2)
    o, lse = selection_attention_fwd(q, k, v, block_idx, sel_block, scale, cu_seqlens)
    do = torch.randn(o.shape, generator=gen, device=device).to(dtype)
    dlse = torch.randn(lse.shape, generator=gen, device=device) * 0.1
    grads = selection_attention_bwd(q, k, v, o, lse, do, dlse, block_idx, sel_block, scale,
                                    cu_seqlens, stored_ds=stored_ds)

    # bound the reference's [B, H, G, chunk, T] fp32 score tensors to ~256 MiB each
    chunk = max(16, 2 ** 26 // (H * G * T * B))
    q32, k32, v32 = q.float(), k.float(), v.float()
    o_ref, lse_ref = ref.selection_attention(q32, k32, v32, block_idx, sel_block, scale, cu_seqlens,
                                             chunk=chunk)
    grads_ref = ref.selection_attention_backward(q32, k32, v32, o_ref, lse_ref, do.float(), dlse,
                                                 block_idx, sel_block, scale, cu_seqlens,
                                                 chunk=chunk)
    tol = GPU_TOL[dtype]
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert rel_err(lse[finite], lse_ref[finite]) < tol
    for name, out, expected in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref)):
        assert torch.isfinite(out).all(), name
        err = rel_err(out, expected)
        assert err < tol, f"{name}: relative error {err:.3e}"


# Below STORED_DS_MIN_TOKENS a GPU backward without an early index works dq out again by
# default: stored_ds=True runs dq from stored dS (through TMA on sm90+) at these lengths too
@pytest.mark.gpu
@pytest.mark.parametrize("stored_ds", [None, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [4, 8])
@pytest.mark.parametrize("G", [1, 4, 16])
@pytest.mark.parametrize("Dk,Dv", [(64, 64), (128, 128), (192, 128)])
def test_selection_kernels_gpu_1k(dtype, H, G, Dk, Dv, stored_ds):
    run_gpu_case(2, 1024, H, G, Dk, Dv, dtype, stored_ds=stored_ds)


@pytest.mark.gpu
@pytest.mark.parametrize("stored_ds", [None, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,G,Dk,Dv", [(4, 16, 128, 128), (8, 4, 192, 128), (4, 1, 64, 64)])
def test_selection_kernels_gpu_8k(dtype, H, G, Dk, Dv, stored_ds):
    run_gpu_case(1, 8192, H, G, Dk, Dv, dtype, stored_ds=stored_ds)


@pytest.mark.gpu
@pytest.mark.parametrize("stored_ds", [None, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1024, 8192])
def test_selection_kernels_gpu_varlen(dtype, T, stored_ds):
    lens = torch.tensor([T // 8, T // 2 - 77, T - T // 8 - (T // 2 - 77)])
    cu_seqlens = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32).cuda()
    run_gpu_case(1, T, 4, 16, 128, 128, dtype, cu_seqlens, stored_ds=stored_ds)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,keep", [(True, False), (True, True), (False, False)])
def test_selection_gated_forward_gpu(dtype, window, keep):
    """The forward with the combine in its epilogue on the GPU's own path (TMA loads and the
    shared pass on sm90+) at 4k, spec geometry: o within a rounding of the forward then the gate
    kernel (which rounds the branch's output once more), the branch's output and lse bitwise."""
    from nsa_ops.kernels.gate import gate_combine_fwd
    from nsa_ops.kernels.selection import selection_attention_gated_fwd
    q, k, v = make_qkv(1, 4096, 4, 16, 128, 128, dtype, device="cuda")
    block_idx = spec_block_idx(q, k, 64, 16, 128 ** -0.5)
    gen = torch.Generator(device="cuda").manual_seed(3)
    o_cmp, o_win = (torch.randn(q.shape, generator=gen, device="cuda").to(dtype)
                    for _ in range(2))
    g_cmp, g_slc, g_win = torch.rand(1, 4096, 64, 3, generator=gen, device="cuda").to(
        dtype).unbind(-1)
    if not window:
        o_win = g_win = None
    o, o_slc, lse = selection_attention_gated_fwd(
        q, k, v, block_idx, 64, 128 ** -0.5, o_cmp=o_cmp, o_win=o_win, g_cmp=g_cmp, g_slc=g_slc,
        g_win=g_win, keep_branch=keep)
    alone, lse_alone = selection_attention_fwd(q, k, v, block_idx, 64, 128 ** -0.5)
    assert torch.equal(lse, lse_alone)
    assert torch.equal(o_slc, alone) if keep else o_slc is None
    want = gate_combine_fwd(o_cmp, alone, o_win, g_cmp, g_slc, g_win)
    assert o.dtype == dtype and rel_err(o, want) < GPU_TOL[dtype] / 4


@pytest.mark.gpu
@pytest.mark.parametrize("stored_ds", [False, True])
def test_selection_backward_given_delta_gpu(stored_ds):
    """The backward with do_gate and the rows' delta given (nsa_attention's eager backward) on
    the GPU's own path at 4k, spec geometry: o unread (NaN there), and the gradients of the
    backward that works delta out itself, within fp32 summation order."""
    q, k, v = make_qkv(1, 4096, 4, 16, 128, 128, torch.bfloat16, device="cuda")
    block_idx = spec_block_idx(q, k, 64, 16, 128 ** -0.5)
    gen = torch.Generator(device="cuda").manual_seed(4)
    do = torch.randn(q.shape, generator=gen, device="cuda").to(torch.bfloat16)
    gate = torch.rand(q.shape[:3], generator=gen, device="cuda").to(torch.bfloat16)
    o, lse = selection_attention_fwd(q, k, v, block_idx, 64, 128 ** -0.5)
    want = selection_attention_bwd(q, k, v, o, lse, do, None, block_idx, 64, 128 ** -0.5,
                                   stored_ds=stored_ds, do_gate=gate)
    delta = (do.float() * o.float()).sum(-1)
    got = selection_attention_bwd(q, k, v, torch.full_like(o, float("nan")), lse, do, None,
                                  block_idx, 64, 128 ** -0.5, stored_ds=stored_ds, do_gate=gate,
                                  delta=delta)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(a, b) < 1e-3, name


@pytest.mark.gpu
def test_selection_kernels_gpu_windows(monkeypatch):
    """The stored-dS backward over query windows of 2048 tokens (a budget of 3000 tokens' dS, as
    a GPU too small for the whole buffer would give) at 8k."""
    monkeypatch.setattr(sel_kernels, "_ds_budget", lambda device: 3000 * 64 * 16 * 64 * 2)
    spy = LaunchSpy(sel_kernels._dq_ds_kernel)
    monkeypatch.setattr(sel_kernels, "_dq_ds_kernel", spy)
    run_gpu_case(1, 8192, 4, 16, 128, 128, torch.bfloat16, stored_ds=True)
    assert spy.launches == 4


@pytest.mark.gpu
@pytest.mark.parametrize("stored_ds,windows", [(False, 1), (True, 1), (True, 2)])
def test_gpu_backward_index_stream(stored_ds, windows, monkeypatch):
    """The inverse index built on the side stream while the passes before dK dV run: gradients
    bitwise those of the one-stream backward (deterministic mode: ordered dK dV adds), eagerly
    and replayed from a CUDA graph, whose capture forks and joins the side stream (stored dS:
    once per query window, here 1 or 2)."""
    if windows > 1:
        monkeypatch.setattr(sel_kernels, "_ds_budget", lambda device: 3000 * 64 * 16 * 64 * 2)
    torch.use_deterministic_algorithms(True)
    try:
        q, k, v = make_qkv(1, 4096, 4, 16, 128, 128, torch.bfloat16, device="cuda")
        scale = 128 ** -0.5
        block_idx = spec_block_idx(q, k, 64, 16, scale)
        o, lse = selection_attention_fwd(q, k, v, block_idx, 64, scale)
        do = torch.randn_like(o)
        bwd = lambda: selection_attention_bwd(q, k, v, o, lse, do, None, block_idx, 64, scale,
                                              stored_ds=stored_ds)
        assert sel_kernels._ds_window(q, 16, 64) == (2048 if windows > 1 else None)
        with monkeypatch.context() as one_stream:
            one_stream.setattr(sel_kernels, "_index_stream", lambda device: None)
            want = bwd()
        got = bwd()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            bwd()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = bwd()
        graph.replay()
        torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b, c in zip(("dq", "dk", "dv"), want, got, replayed):
        assert torch.equal(a, b) and torch.equal(a, c), name
