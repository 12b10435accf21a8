"""Sliding-window attention kernels (nsa_ops.kernels.window) against nsa_ops.reference.

CPU (TRITON_INTERPRET=1): the Triton backend in fp32 and fp16 vs the float64 reference, on
the same (dtype-rounded) inputs, with a random dlse. Tolerances are elementwise
|out - ref| <= atol + rtol * |ref| (torch.testing.assert_close), data ~ N(0, 1), scale = Dk ** -0.5:
    fp32: atol 2e-5, rtol 1e-4   (fp32 accumulation, ~1e-6 observed)
    fp16: atol 1e-2, rtol 1e-2   (P and dS are rounded to fp16 before their matmuls)
Outputs come from torch.empty, which the `poisoned_empty` fixture fills with NaN, so any element
a kernel forgets to write fails the finiteness check.

GPU (-m gpu): every backend that serves the inputs, in fp16/bf16, vs a float32 reference with
||out - ref|| / ||ref|| < 1e-2 (bf16: 2e-2) for o, lse, dq, dk, dv; the backends vs each other;
Triton in fp32 vs a float64 reference (< 1e-5, i.e. no tf32); routing of Dk != Dv to Triton.
"""
import dataclasses
import itertools

import pytest
import torch

from nsa_ops import reference as ref
from nsa_ops import routing
from nsa_ops.kernels import window as win

CPU_TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2)}
GPU_REL_TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
NAMES = ("o", "lse", "dq", "dk", "dv")

# (B, T, G, Dk, Dv, window, dtype): every (window, G, dtype) triple, and every pair of values of
# any two parameters (B in {1,2}, T in {37,100}, (Dk,Dv) in {(16,16),(32,16)}) appears at least
# once; the full product would take minutes in the interpreter. window 200 > T is full causal.
F32, F16 = torch.float32, torch.float16
CASES = [
    (1, 100, 1, 32, 16, 1, F32), (2, 37, 1, 32, 16, 1, F16),
    (1, 100, 2, 16, 16, 1, F32), (1, 37, 2, 16, 16, 1, F16),
    (1, 37, 3, 16, 16, 1, F32), (1, 37, 3, 32, 16, 1, F16),
    (1, 100, 1, 16, 16, 8, F32), (1, 37, 1, 16, 16, 8, F16),
    (2, 37, 2, 32, 16, 8, F32), (1, 37, 2, 16, 16, 8, F16),
    (1, 37, 3, 32, 16, 8, F32), (2, 37, 3, 32, 16, 8, F16),
    (2, 100, 1, 16, 16, 200, F32), (2, 37, 1, 32, 16, 200, F16),
    (1, 37, 2, 32, 16, 200, F32), (1, 37, 2, 32, 16, 200, F16),
    (1, 37, 3, 32, 16, 200, F32), (1, 100, 3, 32, 16, 200, F16),
]
H = 2  # KV heads on CPU


def _case_id(case):
    B, T, G, Dk, Dv, w, dtype = case
    return f"B{B}-T{T}-G{G}-D{Dk}x{Dv}-w{w}-{str(dtype).split('.')[-1]}"


def _inputs(B, T, H, G, Dk, Dv, dtype, device="cpu", seed=0):
    """q, k, v, dO in `dtype` and a float32 dlse, from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)
    HQ = H * G
    return (rnd(B, T, HQ, Dk), rnd(B, T, H, Dk), rnd(B, T, H, Dv), rnd(B, T, HQ, Dv),
            rnd(B, T, HQ, dt=torch.float32))


def _reference(q, k, v, do, dlse, w, scale, cu_seqlens, dtype):
    """(o, lse, dq, dk, dv) of the reference in `dtype` on the given inputs."""
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))
    dlse = None if dlse is None else dlse.to(dtype)
    o, lse = ref.sliding_window_attention(q, k, v, w, scale, cu_seqlens)
    grads = ref.sliding_window_attention_backward(q, k, v, o, lse, do, dlse, w, scale, cu_seqlens)
    return (o, lse, *grads)


def _kernel(q, k, v, do, dlse, w, scale, cu_seqlens, backend):
    o, lse = win.sliding_window_fwd(q, k, v, w, scale, cu_seqlens, backend=backend)
    grads = win.sliding_window_bwd(q, k, v, o, lse, do, dlse, w, scale, cu_seqlens,
                                   backend=backend)
    return (o, lse, *grads)


def _check_close(outs, refs, dtype):
    assert outs[1].dtype == torch.float32
    for name, out, exp in zip(NAMES, outs, refs):
        assert out.shape == exp.shape, name
        assert torch.isfinite(out).all(), f"{name} has non-finite (unwritten?) elements"
        torch.testing.assert_close(out.double(), exp.double(), **CPU_TOL[dtype], msg=name)


def _compare_cpu(B, T, G, Dk, Dv, w, dtype, cu_seqlens=None, with_dlse=True, seed=0):
    q, k, v, do, dlse = _inputs(B, T, H, G, Dk, Dv, dtype, seed=seed)
    dlse = dlse if with_dlse else None
    scale = Dk ** -0.5
    outs = _kernel(q, k, v, do, dlse, w, scale, cu_seqlens, "triton")
    assert [x.dtype for x in outs] == [dtype, torch.float32, dtype, dtype, dtype]
    _check_close(outs, _reference(q, k, v, do, dlse, w, scale, cu_seqlens, torch.float64), dtype)


# --------------------------------------------------------------------------------------------
# CPU: Triton backend in interpreter mode
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_matches_reference(case, poisoned_empty):
    B, T, G, Dk, Dv, w, dtype = case
    _compare_cpu(B, T, G, Dk, Dv, w, dtype, seed=CASES.index(case))


@pytest.mark.parametrize("w", [8, 200])
def test_triton_varlen_matches_reference(w, poisoned_empty):
    # sequences of 13, 1, 36 and 50 tokens: windows must stop at every boundary
    cu = torch.tensor([0, 13, 14, 50, 100], dtype=torch.int32)
    _compare_cpu(1, 100, 2, 16, 16, w, torch.float32, cu_seqlens=cu, seed=w)


def test_triton_gpu_tiles_without_dlse(monkeypatch, poisoned_empty):
    """The GPU tile shapes (larger than the interpreter's) and the dlse=None path."""
    real = win._tile_config
    monkeypatch.setattr(win, "_tile_config",
                        lambda kernel, kv_bytes, on_gpu: real(kernel, kv_bytes, True))
    _compare_cpu(1, 300, 2, 16, 16, 40, torch.float16, with_dlse=False, seed=3)


@pytest.mark.parametrize("width", [512, 768, 1024])
def test_triton_fp32_dkdv_tiles(width, monkeypatch, poisoned_empty):
    """The dK dV tiles fp32 rows take on a GPU (`Tiles.dkdv_fp32`), run by the interpreter with
    G = 16 (two tokens per 32-row tile) and queries past the last full tile."""
    tile = win._tile_config("dkdv_fp32", width, True)
    assert tile is not None
    monkeypatch.setattr(win, "_fp32_dkdv_tile", lambda q, kv_bytes: tile)
    _compare_cpu(1, 150, 16, 16, 16, 70, torch.float32, seed=width)


def test_triton_gpu_tiles_wide_group(monkeypatch, poisoned_empty):
    """With TMA and G >= WIDE_GROUP the dK dV kernel takes its tier's wide-group tile, in the
    transposed form; run by the interpreter at that tile."""
    real = win._tile_config
    monkeypatch.setattr(win, "_tile_config",
                        lambda kernel, kv_bytes, on_gpu: real(kernel, kv_bytes, True))
    G = win.WIDE_GROUP
    q, k, v, do, dlse = _inputs(1, 40, 1, G, 16, 16, torch.float32, seed=11)
    assert win._routed_tile("dkdv_tma", q, k, v).keys_as_rows
    assert not win._routed_tile("dkdv_tma", q[:, :, :G // 2], k, v).keys_as_rows
    scale = 16 ** -0.5
    o, lse = win.sliding_window_fwd(q, k, v, 24, scale, backend="triton")
    grads = win.sliding_window_bwd(q, k, v, o, lse, do, dlse, 24, scale, backend="triton",
                                   tma=True)
    _check_close((o, lse, *grads), _reference(q, k, v, do, dlse, 24, scale, None, torch.float64),
                 torch.float32)


@pytest.mark.parametrize("B,Tq,Tk,G,w,lengths,tma", [
    (2, 37, 37, 2, 8, None, False),  # the last key and row tiles run past the end
    (1, 30, 70, 4, 20, None, True),  # queries at an offset, Q/dO through TMA
    (1, 100, 100, 2, 40, (13, 1, 36, 50), True),  # windows stop at sequence boundaries
    (2, 80, 80, 2, 40, None, False),  # interior tiles skip the band mask
])
def test_triton_dkdv_keys_as_rows(B, Tq, Tk, G, w, lengths, tma, monkeypatch, poisoned_empty):
    """The dK dV kernel's transposed form (scores as [keys, rows]), which GPU tiles take where
    `TileConfig.keys_as_rows` says, at the interpreter's tile."""
    tile = dataclasses.replace(win._INTERPRETER_TILES, keys_as_rows=True)
    monkeypatch.setattr(win, "_INTERPRETER_TILES", tile)
    q, k, v, do, dlse = _inputs(B, Tk, H, G, 16, 32, torch.float32, seed=Tk + G)
    q, do, dlse = q[:, Tk - Tq:], do[:, Tk - Tq:], dlse[:, Tk - Tq:]
    cu = None if lengths is None else torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    scale = 16 ** -0.5
    o, lse = win.sliding_window_fwd(q, k, v, w, scale, cu, backend="triton")
    grads = win.sliding_window_bwd(q, k, v, o, lse, do, dlse, w, scale, cu, backend="triton",
                                   tma=tma)
    _check_close((o, lse, *grads), _reference(q, k, v, do, dlse, w, scale, cu, torch.float64),
                 torch.float32)


@pytest.mark.parametrize("B,Tq,Tk,G,w,lengths,tma,keys_as_rows", [
    (2, 37, 37, 2, 8, None, False, False),  # the last key and row tiles run past the end
    (1, 30, 70, 4, 20, None, True, True),  # queries at an offset, Q/dO through TMA
    (1, 100, 100, 2, 40, (13, 1, 36, 50), True, False),  # windows stop at sequence boundaries
    (2, 80, 80, 2, 40, None, False, True),  # interior tiles skip the band mask
])
def test_triton_dkdv_rotated_rows(B, Tq, Tk, G, w, lengths, tma, keys_as_rows, monkeypatch,
                                  poisoned_empty):
    """The dK dV kernel walking its row tiles rotated (`TileConfig.rotate_rows_from`, which GPU
    tiles take from a measured length on), in both score forms, at the interpreter's tile; the
    launch rotates from that length on only."""
    tile = dataclasses.replace(win._INTERPRETER_TILES, keys_as_rows=keys_as_rows,
                               rotate_rows_from=Tq)
    monkeypatch.setattr(win, "_INTERPRETER_TILES", tile)
    q, k, v, do, dlse = _inputs(B, Tk, H, G, 16, 32, torch.float32, seed=Tk + G + 1)
    q, do, dlse = q[:, Tk - Tq:], do[:, Tk - Tq:], dlse[:, Tk - Tq:]
    assert win._kernel_meta(q, k, v, "dkdv")["ROTATE_ROWS"]
    assert not win._kernel_meta(q[:, 1:], k, v, "dkdv")["ROTATE_ROWS"]
    cu = None if lengths is None else torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    scale = 16 ** -0.5
    o, lse = win.sliding_window_fwd(q, k, v, w, scale, cu, backend="triton")
    grads = win.sliding_window_bwd(q, k, v, o, lse, do, dlse, w, scale, cu, backend="triton",
                                   tma=tma)
    _check_close((o, lse, *grads), _reference(q, k, v, do, dlse, w, scale, cu, torch.float64),
                 torch.float32)


@pytest.mark.parametrize("B,Tq,Tk,G,Dk,Dv,w,lengths", [
    (2, 37, 37, 2, 32, 16, 8, None),  # the last key and row tiles run past the end; two box widths
    (1, 30, 70, 4, 16, 16, 20, None),  # queries at an offset
    (1, 100, 100, 2, 16, 16, 40, (13, 1, 36, 50)),  # windows stop at sequence boundaries
    (1, 30, 30, 3, 16, 16, 20, None),  # row tiles split groups: the dK dV kernel reads pointers
    # windows wider than a row tile plus a key tile: interior tiles skip the band mask
    (2, 80, 80, 2, 16, 16, 40, None),
    (1, 60, 100, 2, 16, 16, 48, None),
    (1, 100, 100, 2, 16, 16, 48, (13, 1, 36, 50)),
])
def test_triton_tma(B, Tq, Tk, G, Dk, Dv, w, lengths, poisoned_empty):
    """Tiles through TMA descriptors (sm90+ GPUs; forced here, in the interpreter): K/V in the
    forward and dQ kernels, Q/dO in the dK dV kernel where G is a power of two dividing its row
    tile. The same tiles as the pointer loads, so bitwise the same o, lse and grads, and the
    reference's."""
    q, k, v, _, _ = _inputs(B, Tk, H, G, Dk, Dv, torch.float32, seed=5)
    q = q[:, Tk - Tq:]
    cu = None if lengths is None else torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0)
    cu = None if cu is None else cu.to(torch.int32)
    scale = Dk ** -0.5
    do = torch.randn(*q.shape[:3], Dv, generator=torch.Generator().manual_seed(6))
    outs = {}
    for tma in (True, False):
        o, lse = win.sliding_window_fwd(q, k, v, w, scale, cu, backend="triton", tma=tma)
        grads = win.sliding_window_bwd(q, k, v, o, lse, do, None, w, scale, cu,
                                       backend="triton", tma=tma and not G & (G - 1))
        outs[tma] = (o, lse, *grads)
    for name, a, b in zip(NAMES, outs[True], outs[False]):
        assert torch.equal(a, b), name
    _check_close(outs[True], _reference(q, k, v, do, None, w, scale, cu, torch.float64),
                 torch.float32)


@pytest.mark.parametrize("B,Tq,Tk,G,w,lengths,tma,keys_as_rows,dtype", [
    (2, 37, 37, 2, 8, None, False, False, torch.float32),
    (1, 30, 70, 4, 20, None, True, True, torch.float32),
    (1, 100, 100, 2, 40, (13, 1, 36, 50), False, True, torch.float16),
    (2, 80, 80, 2, 40, None, True, False, torch.float16),
])
def test_triton_backward_do_gate(B, Tq, Tk, G, w, lengths, tma, keys_as_rows, dtype, monkeypatch,
                                 poisoned_empty):
    """do_gate (nsa_attention's eager backward): the gradients of do_gate * do from do, the
    kernels scaling P (both forms of the dK dV kernel, pointer and TMA row loads), against the
    reference given the product, also with the rows' delta given in place of o; an lse gradient
    beside either is refused by name, as a delta of the wrong shape; other backends refuse
    both."""
    tile = dataclasses.replace(win._INTERPRETER_TILES, keys_as_rows=keys_as_rows)
    monkeypatch.setattr(win, "_INTERPRETER_TILES", tile)
    q, k, v, do, dlse = _inputs(B, Tk, H, G, 16, 16, dtype, seed=Tk + 7 * G)
    q, do, dlse = q[:, Tk - Tq:], do[:, Tk - Tq:], dlse[:, Tk - Tq:]
    gate = torch.rand(q.shape[:3], generator=torch.Generator().manual_seed(9)).to(dtype) - 0.25
    cu = None if lengths is None else torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    scale = 16 ** -0.5
    o, lse = win.sliding_window_fwd(q, k, v, w, scale, cu, backend="triton")
    grads = win.sliding_window_bwd(q, k, v, o, lse, do, None, w, scale, cu, backend="triton",
                                   tma=tma, do_gate=gate)
    gated = gate.double().unsqueeze(-1) * do.double()
    refs = _reference(q, k, v, gated, None, w, scale, cu, torch.float64)
    _check_close((o, lse, *grads), refs, dtype)
    # with the rows' delta given (the layer's gate backward sums it), o goes unread: NaN there
    # leaves the same gradients
    delta = (do.float() * o.float()).sum(-1)
    given = win.sliding_window_bwd(q, k, v, torch.full_like(o, float("nan")), lse, do, None, w,
                                   scale, cu, backend="triton", tma=tma, do_gate=gate,
                                   delta=delta)
    _check_close((o, lse, *given), refs, dtype)
    with pytest.raises(ValueError, match="delta: give rowsum"):
        win.sliding_window_bwd(q, k, v, o, lse, do, dlse, w, scale, cu, backend="triton",
                               delta=delta)
    with pytest.raises(ValueError, match="delta must be shaped like dO"):
        win.sliding_window_bwd(q, k, v, o, lse, do, None, w, scale, cu, backend="triton",
                               delta=delta[:, 1:])
    with pytest.raises(ValueError, match="delta: only the triton backend"):
        win._triton_extra("aten_fa2", None, None, None, delta)
    with pytest.raises(ValueError, match="do_gate: a backward takes a gate for dO only"):
        win.sliding_window_bwd(q, k, v, o, lse, do, dlse, w, scale, cu, backend="triton",
                               do_gate=gate)
    with pytest.raises(ValueError, match="do_gate: only the triton backend"):
        win._triton_extra("aten_fa2", None, None, gate)


def test_triton_tma_refuses(poisoned_empty):
    q, k, v, _, _ = _inputs(1, 20, H, 2, 16, 16, torch.float32)
    k_odd = torch.randn(1, 20, H, 17)[..., :16]  # token stride 68 bytes: no TMA descriptor
    with pytest.raises(ValueError, match="tma=True: k or v has a layout TMA cannot describe"):
        win.sliding_window_fwd(q, k_odd, v, 8, 0.25, backend="triton", tma=True)
    o, lse = win.sliding_window_fwd(q, k, v, 8, 0.25, backend="triton")
    do_odd = torch.randn(*q.shape[:3], 17)[..., :16]
    with pytest.raises(ValueError, match="tma=True: q or do has a layout TMA cannot describe"):
        win.sliding_window_bwd(q, k, v, o, lse, do_odd, None, 8, 0.25, backend="triton",
                               tma=True)
    q3, k3, v3, _, _ = _inputs(1, 20, H, 3, 16, 16, torch.float32)
    o, lse = win.sliding_window_fwd(q3, k3, v3, 8, 0.25, backend="triton")
    with pytest.raises(ValueError, match="tma=True: G=3 query heads per KV head"):
        win.sliding_window_bwd(q3, k3, v3, o, lse, torch.randn_like(o), None, 8, 0.25,
                               backend="triton", tma=True)


def test_triton_strided_inputs(poisoned_empty):
    """q, k, v as head slices of one packed qkv tensor (non-contiguous token/head strides)."""
    B, T, G, D, w = 2, 37, 2, 16, 8
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(B, T, H * G + 2 * H, D, generator=gen)
    q, k, v = qkv.split([H * G, H, H], dim=2)
    do = torch.randn(B, T, H * G, D, generator=gen)
    outs = _kernel(q, k, v, do, None, w, D ** -0.5, None, "triton")
    _check_close(outs, _reference(q, k, v, do, None, w, D ** -0.5, None, torch.float64),
                 torch.float32)


# --------------------------------------------------------------------------------------------
# CPU: routing and argument checks
# --------------------------------------------------------------------------------------------

def test_cpu_routing():
    """The backends' limits come from the routing table's rows: on CPU the FA-2 rows refuse for
    the device, the Triton kernel runs under the interpreter."""
    from nsa_ops import routing
    q = torch.zeros(1, 4, 2, 16)
    assert win.select_backend(q, q) == "triton"
    for name in ("flash_attn", "aten_fa2"):
        reason = win.backend_refusal(name, q)
        assert reason is not None
        if name == "aten_fa2":
            assert reason == routing.route("sliding_window_attention", name).refuse(
                routing.Inputs.of(q, q))
        with pytest.raises(ValueError, match=name):
            win.sliding_window_fwd(q, q, q, 2, 0.25, backend=name)
    assert "unknown" in win.backend_refusal("cudnn", q)
    with pytest.raises(ValueError, match="unknown"):
        win.sliding_window_fwd(q, q, q, 2, 0.25, backend="cudnn")


def test_cpu_refusals():
    bf16 = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16)
    assert "bfloat16" in win.backend_refusal("triton", bf16)
    f64 = torch.zeros(1, 4, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="no sliding-window backend"):
        win.sliding_window_fwd(f64, f64, f64, 2, 0.25)
    wide = torch.zeros(1, 4, 1, 512)
    assert "256" in win.backend_refusal("triton", wide)


def test_argument_checks():
    q = torch.zeros(1, 4, 3, 16)
    kv = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        win.sliding_window_fwd(q, kv, kv, 2, 0.25)
    with pytest.raises(ValueError, match="window"):
        win.sliding_window_fwd(kv, kv, kv, 0, 0.25)
    with pytest.raises(ValueError, match="varlen"):
        win.sliding_window_fwd(torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16),
                               torch.zeros(2, 4, 2, 16), 2, 0.25,
                               cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


def test_empty_sequence():
    q = torch.zeros(1, 0, 4, 16)
    kv = torch.zeros(1, 0, 2, 16)
    o, lse = win.sliding_window_fwd(q, kv, kv, 8, 0.25)
    assert o.shape == (1, 0, 4, 16) and lse.shape == (1, 0, 4) and lse.dtype == torch.float32
    dq, dk, dv = win.sliding_window_bwd(q, kv, kv, o, lse, o, None, 8, 0.25)
    assert dq.shape == q.shape and dk.shape == kv.shape and dv.shape == kv.shape


# --------------------------------------------------------------------------------------------
# GPU: every backend, bf16/fp16, realistic sizes
# --------------------------------------------------------------------------------------------

GPU_CASES = {
    "H4-G1-D64-T2048": dict(B=2, T=2048, H=4, G=1, Dk=64, Dv=64, w=512),
    "H8-G4-D128-T8192": dict(B=1, T=8192, H=8, G=4, Dk=128, Dv=128, w=512),
    "H4-G16-D64-T4096": dict(B=1, T=4096, H=4, G=16, Dk=64, Dv=64, w=512),
    "H8-G16-D128-T2048": dict(B=1, T=2048, H=8, G=16, Dk=128, Dv=128, w=512),
    "H4-G4-D192x128-T2048": dict(B=2, T=2048, H=4, G=4, Dk=192, Dv=128, w=512),
    "H2-G16-D256-T2048": dict(B=1, T=2048, H=2, G=16, Dk=256, Dv=256, w=512),
    "H8-G4-D128-varlen": dict(B=1, T=8192, H=8, G=4, Dk=128, Dv=128, w=512,
                              cu=[0, 1, 700, 4096, 4097, 8192]),
}
GPU_DTYPES = [torch.bfloat16, torch.float16]


def _rel(out, exp):
    return ((out.float() - exp.float()).norm() / exp.float().norm()).item()


def _gpu_inputs(cfg, dtype, seed=0):
    q, k, v, do, dlse = _inputs(cfg["B"], cfg["T"], cfg["H"], cfg["G"], cfg["Dk"], cfg["Dv"],
                                dtype, device="cuda", seed=seed)
    cu = cfg.get("cu")
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    return q, k, v, do, dlse, cu


@pytest.mark.gpu
def test_gpu_routing():
    q = torch.zeros(1, 16, 8, 192, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros(1, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    assert win.select_backend(q, v) == "triton"  # Dk != Dv: FA-2 cannot serve it
    # Dk == Dv = 192: FA-2 runs the backward; on sm90 the Triton kernel the forward
    forward = "triton" if torch.cuda.get_device_capability() == (9, 0) else "aten_fa2"
    if win.backend_refusal("aten_fa2", q, q) is None:
        assert win.select_backend(q, q) in (forward, "flash_attn")
        assert win.select_backend(q, q, backward=True) in ("aten_fa2", "flash_attn")
    assert win.select_backend(q.float(), q.float()) == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["H4-G4-D192x128-T2048", "H8-G16-D128-T2048",
                                  "H4-G16-D64-T4096"])
def test_gpu_triton_fp32(case):
    """fp32 on the GPU must use exact (non-tf32) dots: near-fp32 agreement with the reference.
    D = 128 runs the 1024-byte keys' tiles (K + V rows) and D = 64 the 512-byte keys' (their
    dkdv_fp32 tiles in the dK dV kernel), Dk = 192 / Dv = 128 the widest tier's."""
    cfg = GPU_CASES[case]
    q, k, v, do, dlse, cu = _gpu_inputs(cfg, torch.float32)
    scale = cfg["Dk"] ** -0.5
    outs = _kernel(q, k, v, do, dlse, 512, scale, cu, "triton")
    refs = _reference(q, k, v, do, dlse, 512, scale, cu, torch.float64)
    for name, out, exp in zip(NAMES, outs, refs):
        assert _rel(out, exp) < 1e-5, (name, _rel(out, exp))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("cfg", list(GPU_CASES.values()), ids=list(GPU_CASES))
@pytest.mark.parametrize("backend", ["flash_attn", "aten_fa2", "triton"])
def test_gpu_backend_matches_reference(backend, cfg, dtype):
    q, k, v, do, dlse, cu = _gpu_inputs(cfg, dtype)
    reason = win.backend_refusal(backend, q, v)
    if reason is not None:
        if backend == "triton":
            pytest.fail(f"triton must serve every GPU case: {reason}")
        pytest.skip(reason)
    scale = cfg["Dk"] ** -0.5
    outs = _kernel(q, k, v, do, dlse, cfg["w"], scale, cu, backend)
    refs = _reference(q, k, v, do, dlse, cfg["w"], scale, cu, torch.float32)
    for name, out, exp in zip(NAMES, outs, refs):
        assert torch.isfinite(out).all(), name
        assert _rel(out, exp) < GPU_REL_TOL[dtype], (name, _rel(out, exp))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("cfg", [GPU_CASES["H8-G4-D128-T8192"], GPU_CASES["H8-G4-D128-varlen"]],
                         ids=["dense", "varlen"])
def test_gpu_backends_agree(cfg, dtype):
    q, k, v, do, dlse, cu = _gpu_inputs(cfg, dtype, seed=1)
    names = [n for n in win._BACKENDS if win.backend_refusal(n, q, v) is None]
    assert win.select_backend(q, v) == routing.choose(
        "sliding_window_attention", routing.Inputs.of(q, v)).impl
    scale = cfg["Dk"] ** -0.5
    results = {n: _kernel(q, k, v, do, dlse, cfg["w"], scale, cu, n) for n in names}
    for a, b in itertools.combinations(names, 2):
        for name, x, y in zip(NAMES, results[a], results[b]):
            assert _rel(x, y) < GPU_REL_TOL[dtype], (a, b, name, _rel(x, y))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", ["H2-G16-D256-T2048", "H8-G4-D128-varlen"])
def test_gpu_fa2_backward_of_triton_forward(case, dtype):
    """At head dims 129-256 on sm90 the routing table runs the forward on Triton and the backward
    on FA-2 (`routing.Inputs.backward`): FA-2's backward from the Triton forward's o and lse,
    with an lse gradient too, against the reference."""
    cfg = GPU_CASES[case]
    q, k, v, do, dlse, cu = _gpu_inputs(cfg, dtype, seed=2)
    names = [n for n in ("flash_attn", "aten_fa2") if win.backend_refusal(n, q, v) is None]
    if not names:
        pytest.skip("no FlashAttention-2 here")
    scale = cfg["Dk"] ** -0.5
    o, lse = win.sliding_window_fwd(q, k, v, cfg["w"], scale, cu, backend="triton")
    refs = _reference(q, k, v, do, dlse, cfg["w"], scale, cu, torch.float32)
    for backend in names:
        grads = win.sliding_window_bwd(q, k, v, o, lse, do, dlse, cfg["w"], scale, cu,
                                       backend=backend)
        for name, out, exp in zip(NAMES, (o, lse, *grads), refs):
            assert _rel(out, exp) < GPU_REL_TOL[dtype], (backend, name, _rel(out, exp))


@pytest.mark.gpu
def test_gpu_routed_window_by_direction():
    """torch.ops.nsa.sliding_window_attention at D = 256 under autograd: each direction runs the
    row the routing table picks for it (on sm90 with FA-2: Triton forward, FA-2 backward)."""
    cfg = GPU_CASES["H2-G16-D256-T2048"]
    q, k, v, do, _, _ = _gpu_inputs(cfg, torch.bfloat16, seed=3)
    x = routing.Inputs.of(q, v)
    fwd = routing.choose("sliding_window_attention", x).impl
    bwd = routing.choose("sliding_window_attention", dataclasses.replace(x, backward=True)).impl
    if x.sm == (9, 0) and win.backend_refusal("aten_fa2", q, v) is None:
        assert (fwd, bwd) in (("triton", "flash_attn"), ("triton", "aten_fa2"))
    scale = cfg["Dk"] ** -0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = torch.ops.nsa.sliding_window_attention(*leaves, cfg["w"], scale)
    o.backward(do)
    refs = _reference(q, k, v, do, None, cfg["w"], scale, None, torch.float32)
    for name, out, exp in zip(NAMES, (o, lse, *(t.grad for t in leaves)), refs):
        assert _rel(out, exp) < GPU_REL_TOL[torch.bfloat16], (fwd, bwd, name, _rel(out, exp))
