"""torch.library.opcheck (also over head-major and strided layouts) and float64 gradcheck for
every nsa op."""
import pytest
import torch
from torch.library import opcheck
from torch.utils._python_dispatch import TorchDispatchMode

import nsa_ops  # noqa: F401  (registers torch.ops.nsa)
from helpers import (INDEX_LAYOUTS, ROW_LAYOUTS, SMALL, compressed, cu_seqlens, in_layout,
                     index_in_layout, qkv, rows_in_layout, selection_for)

L, D, LP, N = SMALL["block_len"], SMALL["block_stride"], SMALL["sel_block"], SMALL["num_sel"]

CASES = [  # (B, T, G, varlen lengths or None)
    *[(B, T, G, None) for B, T in ((1, 45), (2, 70)) for G in (1, 2, 4, 16)],
    (1, 75, 2, (30, 5, 40)),
    (1, 61, 4, (20, 41)),
]
DTYPES = [torch.float32, torch.float64]


def _args(op, B, T, G, lengths, dtype):
    H, Dk, Dv = 2, 16, 8
    q, k, v = qkv(B, T, G * H, H, Dk, Dv, dtype, seed=B * 100 + T + G, requires_grad=True)
    cu = cu_seqlens(lengths) if lengths else None
    scale = Dk ** -0.5
    k_cmp, v_cmp = (t.detach().requires_grad_() for t in compressed(k.detach(), v.detach(), SMALL, cu))
    if op == "compressed_attention":
        return (q, k_cmp, v_cmp, L, D, scale, cu)
    if op == "select_blocks":
        _, lse = torch.ops.nsa.compressed_attention(q.detach(), k_cmp.detach(), v_cmp.detach(), L, D,
                                                    scale, cu)
        return (q, k_cmp, lse, L, D, LP, N, scale, cu)
    if op == "selection_attention":
        return (q, k, v, selection_for(q.detach(), k.detach(), v.detach(), SMALL, cu), LP, scale, cu)
    return (q, k, v, 24, scale, cu)


OPS = ["compressed_attention", "select_blocks", "selection_attention", "sliding_window_attention"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,G,lengths", CASES)
@pytest.mark.parametrize("op", OPS)
def test_opcheck(op, B, T, G, lengths, dtype):
    opcheck(getattr(torch.ops.nsa, op).default, _args(op, B, T, G, lengths, dtype))


@pytest.mark.parametrize("op", ["compressed_attention", "selection_attention",
                                "sliding_window_attention"])
def test_opcheck_backward_ops(op):
    args = _args(op, 2, 45, 2, None, torch.float64)
    o, lse = getattr(torch.ops.nsa, op)(*args)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    q, k, v, *rest = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    cu = rest[-1]
    params = rest[:-1]
    bwd = getattr(torch.ops.nsa, op + "_backward").default
    opcheck(bwd, (q, k, v, o.detach(), lse.detach(), do, dlse, *params, cu))
    opcheck(bwd, (q, k, v, o.detach(), lse.detach(), do, None, *params, cu))


def _finite_lse(fn):
    # lse = -inf on rows that see nothing: map to 0 so finite differences stay defined
    def wrapped(*args):
        o, lse = fn(*args)
        return o, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return wrapped


@pytest.mark.parametrize("B,T,G,lengths", [(1, 37, 1, None), (2, 29, 2, None), (1, 40, 4, (17, 23))])
@pytest.mark.parametrize("op", ["compressed_attention", "selection_attention",
                                "sliding_window_attention"])
def test_gradcheck(op, B, T, G, lengths):
    args = _args(op, B, T, G, lengths, torch.float64)
    fn = _finite_lse(getattr(torch.ops.nsa, op))
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


def test_select_blocks_is_not_differentiable():
    q, k_cmp, lse, *rest = _args("select_blocks", 1, 45, 2, None, torch.float64)
    idx = torch.ops.nsa.select_blocks(q, k_cmp, lse.requires_grad_(), *rest)
    assert idx.dtype == torch.int32 and not idx.requires_grad


class _RecordBackwardCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dlse_args = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().endswith("_backward"):
            self.dlse_args.append(args[6])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("used", ["o", "lse"])
@pytest.mark.parametrize("op", ["compressed_attention", "selection_attention",
                                "sliding_window_attention"])
def test_grads_when_one_output_is_unused(op, used):
    """An unused output reaches the backward op as None (no zero-filled dlse: the FA-2 window
    backward would run a second pass for it); the grads equal explicit zeros' grads."""
    args = _args(op, 2, 45, 2, None, torch.float64)
    o, lse = getattr(torch.ops.nsa, op)(*args)
    weight = torch.randn_like(o if used == "o" else lse)
    loss = (o * weight).sum() if used == "o" else (torch.nan_to_num(lse, neginf=0.0) * weight).sum()
    inputs = args[:3]
    with _RecordBackwardCalls() as calls:
        grads = torch.autograd.grad(loss, inputs)
    assert len(calls.dlse_args) == 1
    if used == "o":
        assert calls.dlse_args[0] is None
    do = weight if used == "o" else torch.zeros_like(o)
    dlse = torch.zeros_like(lse) if used == "o" else torch.where(torch.isfinite(lse), weight, 0.0)
    q, k, v, *rest = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    expected = getattr(torch.ops.nsa, op + "_backward")(q, k, v, o.detach(), lse.detach(), do,
                                                       dlse, *rest)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _gate_args(B, T, HQ, Dv, dtype, gate_requires_grad=True):
    gen = torch.Generator().manual_seed(B * 10 + T)
    o = [torch.randn(B, T, HQ, Dv, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]
    g = [torch.rand(B, T, HQ, generator=gen, dtype=dtype).requires_grad_(gate_requires_grad)
         for _ in range(3)]
    return (*o, *g)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,HQ,Dv", [(1, 45, 4, 8), (2, 7, 2, 16)])
def test_opcheck_gate_combine(B, T, HQ, Dv, dtype):
    opcheck(torch.ops.nsa.gate_combine.default, _gate_args(B, T, HQ, Dv, dtype))
    opcheck(torch.ops.nsa.gate_combine.default, _gate_args(B, T, HQ, Dv, dtype, False))
    args = [a.detach() for a in _gate_args(B, T, HQ, Dv, dtype)]
    do = torch.randn(B, T, HQ, Dv, dtype=dtype)
    for gate_grads in (True, False):
        opcheck(torch.ops.nsa.gate_combine_backward.default, (do, *args, gate_grads))


def test_opcheck_gate_combine_without_window_branch():
    o_cmp, o_slc, _, g_cmp, g_slc, _ = _gate_args(1, 9, 2, 8, torch.float32)
    opcheck(torch.ops.nsa.gate_combine.default, (o_cmp, o_slc, None, g_cmp, g_slc, None))
    do = torch.randn_like(o_cmp)
    opcheck(torch.ops.nsa.gate_combine_backward.default,
            (do, o_cmp.detach(), o_slc.detach(), None, g_cmp.detach(), g_slc.detach(), None, True))


@pytest.mark.parametrize("window_branch", [True, False])
def test_gradcheck_gate_combine(window_branch):
    args = list(_gate_args(2, 5, 3, 4, torch.float64))
    if not window_branch:
        args[2] = args[5] = None
    assert torch.autograd.gradcheck(torch.ops.nsa.gate_combine, tuple(args))


def test_gate_combine_validates():
    o_cmp, o_slc, o_win, g_cmp, g_slc, g_win = _gate_args(1, 5, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="o_win must have the shape of o_cmp"):
        torch.ops.nsa.gate_combine(o_cmp, o_slc, o_win[:, :4], g_cmp, g_slc, g_win)
    with pytest.raises(ValueError, match=r"g_slc must have shape \[B, T, HQ\]"):
        torch.ops.nsa.gate_combine(o_cmp, o_slc, o_win, g_cmp, g_slc[:, :, :1], g_win)
    with pytest.raises(ValueError, match="o_win and g_win must both be tensors, or both None"):
        torch.ops.nsa.gate_combine(o_cmp, o_slc, None, g_cmp, g_slc, g_win)


# ---- opcheck over head-major and strided layouts ---------------------------------------------
#
# Every op, backward ops and the gate included, with its tensor arguments as head-major or
# strided views (helpers.LAYOUTS): test_faketensor compares the fake kernel's output strides with
# the real ones, and every output must be contiguous whatever the inputs' layout (the ops'
# contract, which the fake kernels state). "mixed" gives each argument another layout.

LAYOUT_CASES = ["head", "wide", "tslice", "heads", "dstride", "mixed"]
_ROW_OF = {"head": "perm", "wide": "wide", "tslice": "tslice", "heads": "contig",
           "dstride": "stack3"}
_INDEX_OF = {"head": "perm", "wide": "wide", "tslice": "tslice", "heads": "contig",
             "dstride": "perm"}
_MIXED = ("head", "wide", "tslice", "dstride", "heads", "token")


def _relaid(args, layout, num_blocks):
    """args with every tensor but cu_seqlens in `layout`; grad requirements kept."""
    out, i = [], 0
    for a in args:
        if not isinstance(a, torch.Tensor) or a.dtype == torch.int32 and a.dim() == 1:
            out.append(a)
            continue
        if a.dim() == 4 and a.is_floating_point():
            lay = _MIXED[i % len(_MIXED)] if layout == "mixed" else layout
            b = in_layout(a.detach(), lay)
        elif a.dim() == 3:
            lay = ROW_LAYOUTS[i % len(ROW_LAYOUTS)] if layout == "mixed" else _ROW_OF[layout]
            b = rows_in_layout(a.detach(), lay, i)
        else:  # block_idx
            lay = INDEX_LAYOUTS[i % len(INDEX_LAYOUTS)] if layout == "mixed" else _INDEX_OF[layout]
            b = index_in_layout(a.to(torch.int64) if layout == "mixed" else a, lay, num_blocks)
        out.append(b.requires_grad_(a.requires_grad))
        i += 1
    return tuple(out)


def _assert_contiguous(op, out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for j, t in enumerate(outs):
        assert t.is_contiguous(), f"{op} output {j} is not contiguous: strides {t.stride()}"


# (layout, B, T, G, varlen lengths): every layout at a fixed length, mixed layouts in varlen too
LAYOUT_GEOMETRIES = [*[pytest.param(layout, 2, 45, 2, None, id=layout) for layout in LAYOUT_CASES],
                     pytest.param("mixed", 1, 61, 4, (20, 41), id="mixed-varlen")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout,B,T,G,lengths", LAYOUT_GEOMETRIES)
@pytest.mark.parametrize("op", OPS)
def test_opcheck_layouts(op, layout, B, T, G, lengths, dtype):
    args = _relaid(_args(op, B, T, G, lengths, dtype), layout, -(-T // LP))
    opcheck(getattr(torch.ops.nsa, op).default, args)
    _assert_contiguous(op, getattr(torch.ops.nsa, op)(*args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout,B,T,G,lengths", LAYOUT_GEOMETRIES)
@pytest.mark.parametrize("op", ["compressed_attention", "selection_attention",
                                "sliding_window_attention"])
def test_opcheck_backward_ops_layouts(op, layout, B, T, G, lengths, dtype):
    args = _relaid([a.detach() if isinstance(a, torch.Tensor) else a
                    for a in _args(op, B, T, G, lengths, dtype)], layout, -(-T // LP))
    o, lse = getattr(torch.ops.nsa, op)(*args)
    gen = torch.Generator().manual_seed(T + G)
    do = torch.randn(o.shape, generator=gen, dtype=dtype)
    dlse = torch.randn(lse.shape, generator=gen, dtype=lse.dtype)
    do, dlse = _relaid((do, dlse), "head" if layout == "mixed" else layout, 1)
    q, k, v, *rest = args
    bwd = getattr(torch.ops.nsa, op + "_backward")
    for dl in (dlse, None):
        bwd_args = (q, k, v, o, lse, do, dl, *rest)
        opcheck(bwd.default, bwd_args)
        _assert_contiguous(op + "_backward", bwd(*bwd_args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window_branch", [True, False], ids=["win", "nowin"])
@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_opcheck_gate_combine_layouts(layout, window_branch, dtype):
    B, T, HQ, Dv = 2, 19, 4, 8
    args = list(_relaid(_gate_args(B, T, HQ, Dv, dtype), layout, 1))
    if not window_branch:
        args[2] = args[5] = None
    opcheck(torch.ops.nsa.gate_combine.default, tuple(args))
    _assert_contiguous("gate_combine", torch.ops.nsa.gate_combine(*args))
    do = torch.randn(B, T, HQ, Dv, generator=torch.Generator().manual_seed(3), dtype=dtype)
    do, = _relaid((do,), "dstride" if layout == "mixed" else layout, 1)
    plain = [a.detach() if a is not None else None for a in args]
    for gate_grads in (True, False):
        bwd_args = (do, *plain, gate_grads)
        opcheck(torch.ops.nsa.gate_combine_backward.default, bwd_args)
        _assert_contiguous("gate_combine_backward", torch.ops.nsa.gate_combine_backward(*bwd_args))
