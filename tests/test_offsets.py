"""Queries at an offset (Tq <= Tk, bottom-right aligned): every branch over the last Tq queries of a
sequence equals the same rows of the full-length computation, fixed length and varlen."""
import dataclasses
import random

import pytest
import torch

import nsa_ops
from nsa_ops import reference as R
from helpers import SMALL, TOL, cu_seqlens, qkv, random_blocks

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


def _inputs(B, Tk, Tq, lengths_k, lengths_q, G=2, H=2, Dk=16, Dv=8):
    q_full, k, v = qkv(B, Tk, G * H, H, Dk, Dv, torch.float64, seed=Tk + Tq)
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


@pytest.mark.parametrize("B,Tk,Tq,lengths_k,lengths_q", CASES)
def test_ops_and_nsa_attention_at_an_offset(B, Tk, Tq, lengths_k, lengths_q):
    """torch.ops.nsa.* and nsa_attention with Tq <= Tk: forward and gradients equal the last
    rows of the full-length call (the full call's upstream gradient zero elsewhere)."""
    q_full, _, k, v, rows, cu_k, cu_q = _inputs(B, Tk, Tq, lengths_k, lengths_q)
    g = [torch.rand(B, Tk, q_full.shape[2], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(i)) for i in range(3)]
    seqs = dict(cu_seqlens=cu_k) if cu_k is not None else {}
    offset = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k) if cu_k is not None else {}
    geo = dict(block_len=L, block_stride=D, sel_block=LP, num_sel=N, window=24)

    q_full = q_full.detach().requires_grad_()
    k, v = k.detach().requires_grad_(), v.detach().requires_grad_()
    o_full = nsa_ops.nsa_attention(q_full, k, v, *g, **geo, **seqs)
    do = torch.randn(o_full[:, rows].shape, dtype=torch.float64)
    (o_full[:, rows] * do).sum().backward()
    want = [o_full[:, rows].detach(), q_full.grad[:, rows], k.grad.clone(), v.grad.clone()]

    q = q_full.detach()[:, rows].requires_grad_()
    k.grad = v.grad = None
    o = nsa_ops.nsa_attention(q, k, v, *(x[:, rows] for x in g), **geo, **offset)
    (o * do).sum().backward()
    atol, rtol = TOL[torch.float64]
    for got, expected in zip((o.detach(), q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


def test_offset_validation():
    q, k, v = qkv(1, 20, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="at least as long as q"):
        torch.ops.nsa.sliding_window_attention(q, k[:, :10], v[:, :10], 8, 0.25)
    with pytest.raises(ValueError, match="given together"):
        torch.ops.nsa.sliding_window_attention(q, k, v, 8, 0.25, cu_seqlens_q=cu_seqlens([20]))
    with pytest.raises(ValueError, match="not both"):
        torch.ops.nsa.sliding_window_attention(q, k, v, 8, 0.25, cu_seqlens_q=cu_seqlens([20]),
                                               cu_seqlens_k=cu_seqlens([20]),
                                               cu_seqlens=cu_seqlens([20]))
    with pytest.raises(ValueError, match="cu_seqlens_k must give every sequence"):
        torch.ops.nsa.sliding_window_attention(q, k, v, 8, 0.25, cu_seqlens_q=cu_seqlens([15, 5]),
                                               cu_seqlens_k=cu_seqlens([10, 10]))
    with pytest.raises(ValueError, match="cu_seqlens_k must have the shape"):
        torch.ops.nsa.sliding_window_attention(q, k, v, 8, 0.25, cu_seqlens_q=cu_seqlens([20]),
                                               cu_seqlens_k=cu_seqlens([10, 10]))
    k_cmp = R.compress_mean(k, L, D)
    with pytest.raises(ValueError, match="seqlen_k"):
        torch.ops.nsa.compressed_attention(q, k_cmp, k_cmp, L, D, 0.25, seqlen_k=10)


def test_offset_routing():
    """The Triton kernels take offsets; packed SDPA, FA-2 and cuDNN refuse them with a reason."""
    from nsa_ops import routing
    x = routing.Inputs("cuda", (9, 0), torch.bfloat16, 128, 128, 512, offset=True)
    assert routing.choose("selection_attention", x).impl == "triton"
    assert "offset" in dict(routing.explain("selection_attention", x))["packed_sdpa"]
    assert routing.choose("sliding_window_attention", x).impl == "triton"
    assert "offset" in dict(routing.explain("sliding_window_attention", x))["aten_fa2"]
    assert routing.choose("select_blocks", x).impl == "triton"
    x = routing.Inputs.of_compressed(torch.empty(1, 65536, 64, 128, device="meta"),
                                     torch.empty(1, 4096, 4, 128, device="meta"), 32, 16)
    x = dataclasses.replace(x, device_type="cuda", sm=(9, 0), dtype=torch.bfloat16, offset=True)
    assert routing.choose("compressed_attention", x).impl == "triton"
    assert "offset" in dict(routing.explain("compressed_attention", x))["cudnn"]


def _offset_draw(index: int) -> dict:
    """A geometry (helpers.random_blocks), window, G, H, head dims and key / query lengths: fixed
    length or varlen with empty, shorter-than-l and query-less sequences."""
    rng = random.Random(index)
    draw = dict(random_blocks(rng), G=rng.randint(1, 4), H=rng.randint(1, 3),
                Dk=rng.choice((16, 32)), Dv=rng.choice((8, 16, 32)))
    if index % 2:
        long = [rng.randint(draw["block_len"], 100) for _ in range(2)]
        short = [rng.choice((0, rng.randint(1, draw["block_len"]))) for _ in range(2)]
        lengths_k = rng.sample(long + short, 4)
        lengths_q = [rng.randint(1, lk) if lk in long else rng.choice((0, lk))
                     for lk in lengths_k]
        draw.update(B=1, Tk=sum(lengths_k), Tq=sum(lengths_q), lengths_k=lengths_k,
                    lengths_q=lengths_q)
    else:
        Tk = rng.randint(1, 120)
        draw.update(B=rng.randint(1, 2), Tk=Tk, Tq=rng.randint(1, Tk), lengths_k=None,
                    lengths_q=None)
    # inside the keys, past them, 1 (the diagonal alone), inside again
    inside = rng.randint(2, max(2, draw["Tk"]))
    return dict(draw, window=(inside, draw["Tk"] + rng.randint(1, 50), 1, inside)[index % 4])


def _as_sets(idx):
    """Block rows in another form of the same sets: -1 first, the first block named twice."""
    return torch.cat([idx.flip(-1), idx[..., :1]], -1)


# CASES at SMALL's geometry, then drawn geometry
OFFSET_DRAWS = [dict(SMALL, G=2, H=2, Dk=16, Dv=8, window=20, B=B, Tk=Tk, Tq=Tq,
                     lengths_k=lengths_k, lengths_q=lengths_q)
                for B, Tk, Tq, lengths_k, lengths_q in CASES] + \
    [_offset_draw(i) for i in range(4)]


@pytest.mark.parametrize("draw", OFFSET_DRAWS, ids=lambda d: "-".join(
    f"{k}{v}" for k, v in d.items() if k in ("block_len", "block_stride", "sel_block", "B",
                                            "Tk", "Tq", "G", "H")))
def test_kernels_at_an_offset(draw, poisoned_empty):
    """Each Triton kernel family (interpreter, fp32: the compressed, selection and window
    forwards and backwards, select_blocks) with queries at an offset, against the float64
    reference's full-length call at the same rows (forward) and the reference at the offset
    (gradients). k_cmp in the padded layout phi returns; the selection reads its block rows as
    sets, given with -1 first and a block named twice."""
    from nsa_ops.kernels import compressed as C, selection as S, window as W
    l, d, lp, n = (draw[key] for key in ("block_len", "block_stride", "sel_block", "num_sel"))
    q_full, q, k, v, rows, cu_k, cu_q = _inputs(draw["B"], draw["Tk"], draw["Tq"],
                                                draw["lengths_k"], draw["lengths_q"],
                                                G=draw["G"], H=draw["H"], Dk=draw["Dk"],
                                                Dv=draw["Dv"])
    off = dict(cu_seqlens_k=cu_k) if cu_k is not None else {}
    cmp_off = off or dict(seqlen_k=draw["Tk"])
    k_cmp, v_cmp = R.compress_mean(k, l, d, cu_k), R.compress_mean(v, l, d, cu_k)
    _, lse_cmp = R.compressed_attention(q_full, k_cmp, v_cmp, l, d, 0.3, cu_k)
    idx_full = R.select_blocks(q_full, k_cmp, lse_cmp, l, d, lp, n, 0.3, cu_k)
    idx = C.select_blocks(q.float(), k_cmp.float(), lse_cmp[:, rows].float(), l, d, lp, n, 0.3,
                          cu_q, **cmp_off)
    assert torch.equal(idx, idx_full[:, rows]), "select_blocks"
    families = {  # (kernel forward, kernel backward, reference forward, its backward, args, keys)
        "compressed": (C.compressed_attention_fwd, C.compressed_attention_bwd,
                       R.compressed_attention, R.compressed_attention_backward, (l, d, 0.3),
                       cmp_off, (k_cmp, v_cmp)),
        "selection": (S.selection_attention_fwd, S.selection_attention_bwd,
                      R.selection_attention, R.selection_attention_backward, (lp, 0.3), off,
                      (k, v)),
        "window": (W.sliding_window_fwd, W.sliding_window_bwd, R.sliding_window_attention,
                   R.sliding_window_attention_backward, (draw["window"], 0.3), off, (k, v)),
    }
    atol, rtol = TOL[torch.float32]
    gen = torch.Generator().manual_seed(9)
    for name, (fwd, bwd, ref_fwd, ref_bwd, args, keys, (kk, vv)) in families.items():
        with_idx = (_as_sets(idx_full),) if name == "selection" else ()
        o_full, lse_full = ref_fwd(q_full, kk, vv, *with_idx, *args, cu_k)
        with_idx = (_as_sets(idx),) if name == "selection" else ()
        f32 = [t.float() for t in (q, kk, vv)]
        o, lse = fwd(*f32, *with_idx, *args, cu_q, **keys)
        torch.testing.assert_close(o.double(), o_full[:, rows], atol=atol, rtol=rtol, msg=name)
        torch.testing.assert_close(lse.double(), lse_full[:, rows], atol=atol, rtol=rtol,
                                   msg=name)
        do, dlse = torch.randn(o.shape, generator=gen), torch.randn(lse.shape, generator=gen)
        grads = bwd(*f32, o, lse, do, dlse, *with_idx, *args, cu_q, **keys)
        want = ref_bwd(q, kk, vv, o_full[:, rows], lse_full[:, rows], do.double(),
                       dlse.double(), *with_idx, *args, cu_q, **keys)
        for got, expected in zip(grads, want):
            torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol, msg=name)


def test_offset_ops_pass_opcheck():
    from torch.library import opcheck
    q_full, q, k, v, rows, _, _ = _inputs(1, 45, 13, None, None)
    k_cmp = R.compress_mean(k, L, D)
    _, lse = R.compressed_attention(q, k_cmp, k_cmp, L, D, 0.25, seqlen_k=45)
    idx = R.select_blocks(q, k_cmp, lse, L, D, LP, N, 0.25, seqlen_k=45)
    for t in (q, k, v, k_cmp):
        t.requires_grad_()
    opcheck(torch.ops.nsa.compressed_attention.default, (q, k_cmp, k_cmp, L, D, 0.25),
            dict(seqlen_k=45))
    opcheck(torch.ops.nsa.select_blocks.default, (q, k_cmp, lse, L, D, LP, N, 0.25),
            dict(seqlen_k=45))
    opcheck(torch.ops.nsa.selection_attention.default, (q, k, v, idx, LP, 0.25))
    opcheck(torch.ops.nsa.sliding_window_attention.default, (q, k, v, 24, 0.25))


@pytest.mark.gpu
@pytest.mark.parametrize("B,Tk,Tq,lengths_k,lengths_q", CASES + [
    (2, 3000, 1100, None, None), (1, 3000, 700, (1000, 1500, 500), (300, 400, 0))])
def test_gpu_ops_at_an_offset(B, Tk, Tq, lengths_k, lengths_q):
    """CUDA, float32: each op's kernel with queries at an offset, forward and gradients, against
    the same op in float64 on CPU (the reference); selection reads the reference's block_idx,
    select_blocks' own indices may differ only at near-ties."""
    _, q, k, v, _, cu_k, cu_q = _inputs(B, Tk, Tq, lengths_k, lengths_q)
    varlen = cu_k is not None
    keys = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k) if varlen else {}
    cmp_keys = keys if varlen else dict(seqlen_k=Tk)
    k_cmp, v_cmp = R.compress_mean(k, L, D, cu_k), R.compress_mean(v, L, D, cu_k)
    ref_keys = dict(cu_seqlens_k=cu_k) if varlen else dict(seqlen_k=Tk)
    _, lse_cmp = R.compressed_attention(q, k_cmp, v_cmp, L, D, 0.3, cu_q, **ref_keys)
    idx = R.select_blocks(q, k_cmp, lse_cmp, L, D, LP, N, 0.3, cu_q, **ref_keys)
    nsa = torch.ops.nsa
    calls = {
        "compressed": (lambda q, k, v, on: nsa.compressed_attention(q, k, v, L, D, 0.3, **on),
                       (q, k_cmp, v_cmp), cmp_keys),
        "selection": (lambda q, k, v, on: nsa.selection_attention(q, k, v, idx.to(q.device), LP,
                                                                  0.3, **on), (q, k, v), keys),
        "window": (lambda q, k, v, on: nsa.sliding_window_attention(q, k, v, 24, 0.3, **on),
                   (q, k, v), keys),
    }
    gen = torch.Generator().manual_seed(3)
    for name, (call, tensors, on) in calls.items():
        do = torch.randn(q.shape[:3] + (tensors[2].shape[3],), dtype=torch.float64, generator=gen)

        def run(device, dtype):
            leaves = [t.detach().to(device, dtype).requires_grad_() for t in tensors]
            moved = {key: x.to(device) if torch.is_tensor(x) else x for key, x in on.items()}
            o, lse = call(*leaves, moved)
            (o * do.to(device, dtype)).sum().backward()
            return [t.double().cpu() for t in (o.detach(), lse.detach(),
                                               *(x.grad for x in leaves))]

        for got, want in zip(run("cuda", torch.float32), run("cpu", torch.float64)):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-3, msg=name)
    on = {key: x.to("cuda") if torch.is_tensor(x) else x for key, x in cmp_keys.items()}
    got = nsa.select_blocks(*(t.to("cuda", torch.float32) for t in (q, k_cmp, lse_cmp)), L, D,
                            LP, N, 0.3, **on).cpu()
    assert (got != idx).any(-1).float().mean() < 1e-3


def _rel_err(got, want):
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.gpu_memory
def test_gpu_ops_past_int32_elements():
    """q, o and dq of T = 266240 tokens x 64 heads x 128 hold 2.18e9 elements, past 2**31: each
    op's CUDA route at that length (offsets must be int64), forward and gradients, against the
    same op over the last 64 queries only (queries at an offset: small q, o and dq). The full
    call's upstream gradient is zero outside those rows, so its k/v gradients must match too.
    The two calls may take different routes (cuDNN / FA-2 refuse offsets, Triton serves them):
    bf16 rounding of the two differs by up to ~2% on the small dq (measured 2.2% for compressed
    attention); an offset past int32 would give errors of order 1."""
    T, TQ, HQ, H, Dh, l, d, lp, n, w = 266240, 64, 64, 4, 128, 32, 16, 64, 16, 512
    assert T * HQ * Dh > 2 ** 31
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    q = torch.randn(1, T, HQ, Dh, **bf16)
    k, v = torch.randn(1, T, H, Dh, **bf16), torch.randn(1, T, H, Dh, **bf16)
    k_cmp, v_cmp = R.compress_mean(k, l, d), R.compress_mean(v, l, d)
    scale, nsa, tail = Dh ** -0.5, torch.ops.nsa, slice(T - TQ, T)

    _, lse_cmp = nsa.compressed_attention(q, k_cmp, v_cmp, l, d, scale)
    idx = nsa.select_blocks(q, k_cmp, lse_cmp, l, d, lp, n, scale)
    idx_tail = nsa.select_blocks(q[:, tail], k_cmp, lse_cmp[:, tail], l, d, lp, n, scale,
                                 seqlen_k=T)
    assert (idx[:, tail] != idx_tail).any(-1).float().mean() < 0.01

    calls = {
        "compressed": (lambda q, k, v, rows, **on: nsa.compressed_attention(
            q, k, v, l, d, scale, **on), (k_cmp, v_cmp), dict(seqlen_k=T)),
        "selection": (lambda q, k, v, rows, **on: nsa.selection_attention(
            q, k, v, idx[:, rows].contiguous(), lp, scale), (k, v), {}),
        "window": (lambda q, k, v, rows, **on: nsa.sliding_window_attention(
            q, k, v, w, scale), (k, v), {}),
    }
    do_tail = torch.randn(1, TQ, HQ, Dh, **bf16)
    for name, (call, (kk, vv), offset) in calls.items():
        def run(q_rows, rows, do, **on):
            leaves = [x.detach().clone().requires_grad_() for x in (q_rows, kk, vv)]
            o, lse = call(*leaves, rows, **on)
            o.backward(do)
            return o.detach(), lse, *(x.grad for x in leaves)

        do_full = torch.zeros_like(q)
        do_full[:, tail] = do_tail
        o, lse, dq, dk, dv = run(q, slice(0, T), do_full)
        del do_full
        want = run(q[:, tail], tail, do_tail, **offset)
        for part, got, ref in zip(("o", "lse", "dq", "dk", "dv"),
                                  (o[:, tail], lse[:, tail], dq[:, tail], dk, dv), want):
            assert _rel_err(got, ref) < 5e-2, f"{name} {part}: rel err {_rel_err(got, ref):.3g}"
        assert dq[:, :T - TQ].abs().max() == 0, f"{name}: dq of rows without upstream gradient"
        del o, lse, dq, dk, dv, want
        torch.cuda.empty_cache()
