"""Every malformed input raises ValueError naming the argument and what was expected."""
import pytest
import torch

import nsa_ops
from helpers import SMALL, compressed, cu_seqlens, gates, qkv, selection_for

L, D, LP, N = SMALL["block_len"], SMALL["block_stride"], SMALL["sel_block"], SMALL["num_sel"]
B, T, HQ, H, DK, DV = 2, 45, 4, 2, 16, 8
SCALE = DK ** -0.5


def inputs():
    q, k, v = qkv(B, T, HQ, H, DK, DV)
    k_cmp, v_cmp = compressed(k, v, SMALL)
    _, lse = torch.ops.nsa.compressed_attention(q, k_cmp, v_cmp, L, D, SCALE)
    idx = selection_for(q, k, v, SMALL)
    return dict(q=q, k=k, v=v, k_cmp=k_cmp, v_cmp=v_cmp, lse=lse, idx=idx)


def call(op, x, **over):
    a = {**x, **over}
    if op == "cmp":
        return torch.ops.nsa.compressed_attention(a["q"], a["k_cmp"], a["v_cmp"], a.get("l", L),
                                                  a.get("d", D), a.get("scale", SCALE), a.get("cu"))
    if op == "select":
        return torch.ops.nsa.select_blocks(a["q"], a["k_cmp"], a["lse"], a.get("l", L), a.get("d", D),
                                           a.get("lp", LP), a.get("n", N), a.get("scale", SCALE),
                                           a.get("cu"))
    if op == "sel":
        return torch.ops.nsa.selection_attention(a["q"], a["k"], a["v"], a["idx"], a.get("lp", LP),
                                                 a.get("scale", SCALE), a.get("cu"))
    return torch.ops.nsa.sliding_window_attention(a["q"], a["k"], a["v"], a.get("w", 8),
                                                  a.get("scale", SCALE), a.get("cu"))


def expect(match, op, x, **over):
    with pytest.raises(ValueError, match=match):
        call(op, x, **over)


@pytest.fixture(scope="module")
def x():
    return inputs()


@pytest.mark.parametrize("op", ["cmp", "select", "sel", "win"])
def test_valid_inputs_pass(op, x):
    call(op, x)


@pytest.mark.parametrize("op", ["sel", "win"])
def test_dtype_mix(op, x):
    expect(r"k must have the same dtype as q", op, x, k=x["k"].double())
    expect(r"v must have the same dtype as q", op, x, v=x["v"].half())


def test_dtype_mix_compressed(x):
    expect(r"k_cmp must have the same dtype as q", "cmp", x, k_cmp=x["k_cmp"].double())
    expect(r"q must be float16/bfloat16/float32/float64", "cmp", x, q=x["q"].int())


@pytest.mark.parametrize("op", ["cmp", "select", "sel", "win"])
def test_wrong_rank(op, x):
    expect(r"q must have rank 4 \(\[B, T, HQ, Dk\]\)", op, x, q=x["q"][0])


def test_wrong_rank_kv(x):
    expect(r"k must have rank 4", "sel", x, k=x["k"][0])
    expect(r"v_cmp must have rank 4", "cmp", x, v_cmp=x["v_cmp"][..., 0])
    expect(r"lse must have rank 3", "select", x, lse=x["lse"][..., None])
    expect(r"block_idx must have rank 4", "sel", x, idx=x["idx"][0])


@pytest.mark.parametrize("op", ["cmp", "select", "sel", "win"])
def test_heads_not_multiple(op, x):
    q3 = x["q"][:, :, :3].contiguous()
    over = dict(q=q3)
    if op == "select":
        over["lse"] = x["lse"][:, :, :3].contiguous()
    expect(r"q heads HQ=3 must be a multiple of (k|k_cmp) heads H=2", op, x, **over)


@pytest.mark.parametrize("op", ["cmp", "select", "sel", "win"])
def test_empty_head_dim(op, x):
    keys = ("k_cmp", "v_cmp") if op in ("cmp", "select") else ("k", "v")
    expect(r"head dims must be >= 1, got Dk=0", op, x, q=x["q"][..., :0],
           **{keys[0]: x[keys[0]][..., :0]})
    if op != "select":  # select_blocks takes no values
        expect(r"head dims must be >= 1, got Dk=16 \(q, k(_cmp)?\) and Dv=0", op, x,
               **{keys[1]: x[keys[1]][..., :0]})
    if op == "win":  # the layer's default scale, Dk ** -0.5, had raised ZeroDivisionError
        with pytest.raises(ValueError, match="head dims must be >= 1"):
            nsa_ops.nsa_attention(x["q"][..., :0], x["k"][..., :0], x["v"],
                                  *gates(B, T, HQ), **SMALL)


@pytest.mark.parametrize("l,d,lp,match", [
    (16, 6, 16, r"block_stride must divide block_len \(d \| l\)"),
    (16, 8, 12, r"block_stride must divide sel_block \(d \| l'\)"),
    (0, 8, 16, r"block_len must be a positive int"),
])
def test_block_geometry(l, d, lp, match, x):
    expect(match, "select", x, l=l, d=d, lp=lp)


def test_block_geometry_compressed(x):
    expect(r"block_stride must divide block_len", "cmp", x, l=16, d=6)


@pytest.mark.parametrize("w", [0, -3])
def test_window_not_positive(w, x):
    expect(r"window must be a positive int", "win", x, w=w)


def test_num_sel_too_small(x):
    expect(r"num_sel must be >= 3", "select", x, n=2)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_scale(scale, x):
    expect(r"scale must be a finite positive float", "win", x, scale=scale)


def test_k_cmp_rows(x):
    expect(r"k_cmp must have num_cmp\(T\) = 4 rows", "cmp", x, k_cmp=x["k_cmp"][:, :3],
           v_cmp=x["v_cmp"][:, :3])


def varlen_inputs(lengths=(20, 25)):
    q, k, v = qkv(1, sum(lengths), HQ, H, DK, DV)
    cu = cu_seqlens(lengths)
    k_cmp, v_cmp = compressed(k, v, SMALL, cu)
    return dict(q=q, k=k, v=v, k_cmp=k_cmp, v_cmp=v_cmp, cu=cu,
                idx=selection_for(q, k, v, SMALL, cu))


@pytest.mark.parametrize("op", ["cmp", "sel", "win"])
@pytest.mark.parametrize("cu,match", [
    (torch.tensor([0, 20, 45], dtype=torch.int64), r"cu_seqlens must be int32"),
    (torch.tensor([0, 20, 44], dtype=torch.int32), r"cu_seqlens must start at 0 and end at T=45"),
    (torch.tensor([1, 20, 45], dtype=torch.int32), r"cu_seqlens must start at 0"),
    (torch.tensor([0, 30, 20, 45], dtype=torch.int32), r"cu_seqlens must be non-decreasing"),
    (torch.tensor([45], dtype=torch.int32), r"cu_seqlens must have N\+1 >= 2 entries"),
    (torch.tensor([[0, 45]], dtype=torch.int32), r"cu_seqlens must have rank 1"),
])
def test_bad_cu_seqlens(op, cu, match):
    expect(match, op, varlen_inputs(), cu=cu)


def test_cu_seqlens_needs_batch_one(x):
    expect(r"q must have B == 1 when cu_seqlens is given", "win", x,
           cu=torch.tensor([0, 45], dtype=torch.int32))


def test_varlen_k_cmp_rows():
    vx = varlen_inputs()
    expect(r"k_cmp must pack sum_i num_cmp\(S_i\) = \d+ rows", "cmp", vx,
           k_cmp=vx["k_cmp"][:, :-1], v_cmp=vx["v_cmp"][:, :-1])


@pytest.mark.parametrize("bad", [3, -2])
def test_block_idx_out_of_range(bad, x):
    idx = x["idx"].clone()
    idx[0, -1, 0, 0] = bad  # ceil(45 / 16) = 3 blocks: 3 is one past the end
    expect(r"block_idx entries must be -1 \(empty\) or in \[0, ceil\(T/sel_block\)\) = \[0, 3\)",
           "sel", x, idx=idx)


def test_block_idx_dtype_and_shape(x):
    expect(r"block_idx must be int32", "sel", x, idx=x["idx"].float())
    expect(r"block_idx must have shape \[B, T, H, n\]", "sel", x, idx=x["idx"][:, :-1])


def test_device_mix(x):
    expect(r"k must be on the same device as q \(cpu\), got meta", "win", x,
           k=x["k"].to("meta"))
    expect(r"block_idx must be on the same device as k", "sel", x, idx=x["idx"].to("meta"))


def test_length_mismatch(x):
    # longer keys are queries at an offset (tests/test_offsets.py); shorter ones are refused
    expect(r"k must be at least as long as q \(Tq=45", "win", x, k=x["k"][:, :40],
           v=x["v"][:, :40])
    expect(r"k must be at least as long as q \(Tq=45", "sel", x, k=x["k"][:, :40],
           v=x["v"][:, :40])


def test_nsa_attention_gates_and_phi(x):
    g = gates(B, T, HQ)
    with pytest.raises(ValueError, match=r"g_slc must have shape \[B, T, HQ\]"):
        nsa_ops.nsa_attention(x["q"], x["k"], x["v"], g[0], g[1][:, :, :2], g[2], **SMALL)
    with pytest.raises(ValueError, match=r'phi="mlp" has learnable weights'):
        nsa_ops.nsa_attention(x["q"], x["k"], x["v"], *g, phi="mlp", **SMALL)
    with pytest.raises(ValueError, match=r"window must be a positive int, or 0"):
        nsa_ops.nsa_attention(x["q"], x["k"], x["v"], *g, **{**SMALL, "window": -1})
    with pytest.raises(ValueError, match=r"g_slc must be a torch.Tensor"):
        nsa_ops.nsa_attention(x["q"], x["k"], x["v"], g[0], None, None, **{**SMALL, "window": 0})
