"""The gated-combine kernels (nsa_ops.kernels.gate) against the float64 reference: in the Triton
interpreter on CPU (fp32, fp16) and on CUDA (-m gpu: bf16, fp16, fp32). Outputs come from
torch.empty, poisoned with NaN by the `poisoned_empty` fixture, so an unwritten element fails.
Tolerance: ||out - ref|| / ||ref|| per dtype (TOL)."""
import pytest
import torch

from helpers import rel_err

pytest.importorskip("triton")
from nsa_ops import reference as R  # noqa: E402
from nsa_ops.kernels import gate  # noqa: E402

# the kernel sums in fp32 and rounds once; the reference rounds after every multiply and add
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _inputs(B, T, HQ, Dv, dtype, gate_dtype, device, strided_gates, seed):
    gen = torch.Generator().manual_seed(seed)
    o = [torch.randn(B, T, HQ, Dv, generator=gen).to(device, dtype) for _ in range(3)]
    if strided_gates:  # NSAAttention's layout: one [B,T,HQ,3] tensor, sliced
        g = list(torch.rand(B, T, HQ, 3, generator=gen).to(device, gate_dtype).unbind(-1))
    else:
        g = [torch.rand(B, T, HQ, generator=gen).to(device, gate_dtype) for _ in range(3)]
    return o, g


CASES = [  # (B, T, HQ, Dv, strided gates)
    (1, 37, 4, 16, False), (2, 19, 8, 24, True), (1, 5, 2, 192, True), (3, 1, 1, 8, False)]


def _check(device, dtype, gate_dtype, B, T, HQ, Dv, strided, gate_grads, seed=0):
    o, g = _inputs(B, T, HQ, Dv, dtype, gate_dtype, device, strided, seed)
    want = R.gate_combine(*(x.double() for x in o), *(x.double() for x in g))
    got = gate.gate_combine_fwd(*o, *g)
    assert got.dtype == torch.promote_types(dtype, gate_dtype)
    tol = TOL[dtype]
    assert rel_err(got, want) < tol

    do = torch.randn(B, T, HQ, Dv, generator=torch.Generator().manual_seed(seed + 1)).to(
        device, got.dtype)
    want_grads = R.gate_combine_backward(do.double(), *(x.double() for x in o),
                                         *(x.double() for x in g), gate_grads)
    got_grads = gate.gate_combine_bwd(do, *o, *g, gate_grads)
    for got_d, want_d, like in zip(got_grads, want_grads, (*o, *g)):
        assert got_d.dtype == like.dtype
        if not gate_grads and got_d.dim() == 1:
            assert got_d.numel() == 0
            continue
        assert rel_err(got_d, want_d) < tol


@pytest.mark.parametrize("gate_grads", [True, False])
@pytest.mark.parametrize("B,T,HQ,Dv,strided", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gate_kernels_interpreted(poisoned_empty, dtype, B, T, HQ, Dv, strided, gate_grads):
    _check("cpu", dtype, dtype, B, T, HQ, Dv, strided, gate_grads)


def test_gate_kernel_mixed_dtypes_promote(poisoned_empty):
    """fp32 gates (e.g. a softmax under autocast) over fp16 branch outputs give fp32, like the
    torch expression."""
    _check("cpu", torch.float16, torch.float32, 1, 9, 4, 16, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_grads", [True, False])
@pytest.mark.parametrize("B,T,HQ,Dv,strided", CASES + [(1, 4099, 64, 128, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gate_kernels_cuda(poisoned_empty, dtype, B, T, HQ, Dv, strided, gate_grads):
    _check("cuda", dtype, dtype, B, T, HQ, Dv, strided, gate_grads)


@pytest.mark.parametrize("gate_grads", [True, False])
def test_gate_kernels_without_window_branch(poisoned_empty, gate_grads):
    o, g = _inputs(2, 11, 4, 16, torch.float32, torch.float32, "cpu", True, seed=3)
    o[2] = g[2] = None
    want = R.gate_combine(*o, *g)
    assert rel_err(gate.gate_combine_fwd(*o, *g), want) < TOL[torch.float32]
    do = torch.randn_like(want)
    got = gate.gate_combine_bwd(do, *o, *g, gate_grads)
    for got_d, want_d in zip(got, R.gate_combine_backward(do, *o, *g, gate_grads)):
        assert got_d.shape == want_d.shape and got_d.dtype == want_d.dtype
        if want_d.numel():
            assert rel_err(got_d, want_d) < TOL[torch.float32]


@pytest.mark.parametrize("gate_grads", [True, False])
@pytest.mark.parametrize("window", [True, False])
@pytest.mark.parametrize("branch_grads", [(True, False, False), (True, True, False),
                                          (True, False, True), (False, True, True),
                                          (False, False, False)])
def test_gate_backward_branch_sums(poisoned_empty, branch_grads, window, gate_grads):
    """branch_grads (compressed, selection, window) False: that branch's slot holds its rows'
    fp32 rowsum(dO * o) in place of g * dO, in the kernel and the reference, whether or not the
    gates need grads (nsa_attention's eager backward hands the branch dO, its gate and these
    sums as its delta); the other grads as with every branch's."""
    o, g = _inputs(1, 13, 4, 16, torch.float16, torch.float16, "cpu", True, seed=5)
    if not window:
        o[2] = g[2] = None
    do = torch.randn(o[0].shape, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    every = R.gate_combine_backward(do, *o, *g, gate_grads)
    sums = [None if x is None else (do.double() * x.double()).sum(-1) for x in o]
    for impl in (gate.gate_combine_bwd, R.gate_combine_backward):
        got = impl(do, *o, *g, gate_grads, branch_grads=branch_grads)
        wanted = (*branch_grads, True, True, True)
        for i, (got_d, want_d, want) in enumerate(zip(got, every, wanted)):
            if not want and o[i] is not None:
                assert got_d.dtype == torch.float32 and got_d.shape == o[i].shape[:-1], i
                assert rel_err(got_d, sums[i]) < TOL[torch.float32], i
            elif want_d.numel():
                assert rel_err(got_d, want_d) < TOL[torch.float16], i
            else:
                assert got_d.numel() == 0, i
