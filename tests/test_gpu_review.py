"""GPU regression tests for the defects a kernel review found (issue 16): head-major offsets past
2**31, a first call inside CUDA-graph capture, the FA-2 lse-gradient pass in fp16, the compiled
selection template on sliced / permuted inputs, and l' that no power-of-two key tile divides."""
import subprocess
import sys
import textwrap

import pytest
import torch

import nsa_ops  # noqa: F401  (registers torch.ops.nsa)
from nsa_ops import reference as R
from nsa_ops.kernels import compressed as cmp_kernels, selection as sel_kernels, window
from helpers import CUDNN_COMPRESSED_T, qkv, rel_err

pytestmark = pytest.mark.gpu


def _head_major(x):
    """x [B,T,H,D] as the view a model gets from a [B,H,T,D] tensor: head stride T * D."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _forced_blocks(B, T, H, n, sel_block, device):
    """Block 0, the two local blocks and n - 3 blocks spread over the prefix, per token."""
    cur = torch.arange(T, device=device) // sel_block
    spread = (cur[:, None] * torch.arange(1, n - 2, device=device) // (n - 2))
    idx = torch.cat([torch.zeros_like(cur)[:, None], spread, (cur - 1).clamp(min=0)[:, None],
                     cur[:, None]], 1)
    return idx.to(torch.int32)[None, :, None].expand(B, T, H, n).contiguous()


# (HQ - 1) * T * D = 63 * 267264 * 128 > 2**31: query-head offsets of head-major q pass int32
BIG_T, BIG_HQ, BIG_H, BIG_D = 267264, 64, 4, 128


@pytest.fixture(scope="module")
def big_inputs():
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.bfloat16)
    q = mk(1, BIG_T, BIG_HQ, BIG_D)
    k, v = mk(1, BIG_T, BIG_H, BIG_D), mk(1, BIG_T, BIG_H, BIG_D)
    return q, _head_major(q), k, v


@pytest.mark.gpu_memory
def test_selection_head_major_past_int32(big_inputs):
    q, q_hm, k, v = big_inputs
    idx = _forced_blocks(1, BIG_T, BIG_H, 16, 64, "cuda")
    o, lse = sel_kernels.selection_attention_fwd(q, k, v, idx, 64, BIG_D ** -0.5)
    o_hm, lse_hm = sel_kernels.selection_attention_fwd(q_hm, k, v, idx, 64, BIG_D ** -0.5)
    assert torch.equal(o, o_hm) and torch.equal(lse, lse_hm)
    do = _head_major(torch.randn_like(o))
    grads = sel_kernels.selection_attention_bwd(q, k, v, o, lse, do.contiguous(), None, idx, 64,
                                                BIG_D ** -0.5)
    grads_hm = sel_kernels.selection_attention_bwd(q_hm, k, v, o_hm, lse_hm, do, None, idx, 64,
                                                   BIG_D ** -0.5)
    assert torch.equal(grads[0], grads_hm[0])
    for ours, theirs in zip(grads[1:], grads_hm[1:]):  # dk/dv: fp32 atomics in any order
        assert rel_err(theirs, ours) < 1e-3


@pytest.mark.gpu_memory
def test_compressed_head_major_past_int32(big_inputs):
    q, q_hm, k, v = big_inputs
    k_cmp, v_cmp = R.compress_mean(k, 32, 16), R.compress_mean(v, 32, 16)
    k_cmp, v_cmp = k_cmp[:, :R.num_cmp(BIG_T, 32, 16)], v_cmp[:, :R.num_cmp(BIG_T, 32, 16)]
    args = (32, 16, BIG_D ** -0.5)
    o, lse = cmp_kernels.compressed_attention_fwd(q, k_cmp, v_cmp, *args)
    o_hm, lse_hm = cmp_kernels.compressed_attention_fwd(q_hm, k_cmp, v_cmp, *args)
    assert torch.equal(o, o_hm) and torch.equal(lse, lse_hm)
    do = torch.randn_like(o)
    dq = cmp_kernels.compressed_attention_bwd(q, k_cmp, v_cmp, o, lse, do, None, *args)[0]
    dq_hm = cmp_kernels.compressed_attention_bwd(q_hm, k_cmp, v_cmp, o, lse, do, None, *args)[0]
    assert dq_hm.is_contiguous() and torch.equal(dq, dq_hm)


@pytest.mark.gpu_memory
def test_window_triton_head_major_past_int32(big_inputs):
    q, q_hm, k, v = big_inputs
    o, lse = window.sliding_window_fwd(q, k, v, 512, BIG_D ** -0.5, backend="triton")
    o_hm, lse_hm = window.sliding_window_fwd(q_hm, k, v, 512, BIG_D ** -0.5, backend="triton")
    assert torch.equal(o, o_hm) and torch.equal(lse, lse_hm)


# CUDNN_COMPRESSED_T sends compressed attention through cuDNN on sm90
@pytest.mark.parametrize("T", [3000, CUDNN_COMPRESSED_T])
def test_first_call_inside_cuda_graph_capture(T):
    """No autotuning on a first call: a fresh process may capture the ops before running them."""
    script = textwrap.dedent(f"""
        import torch, nsa_ops
        torch.manual_seed(0)
        T, HQ, H, D = {T}, 16, 2, 64
        q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        g = [torch.rand(1, T, HQ, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = nsa_ops.nsa_attention(q, k, v, *g)
        graph.replay()
        torch.cuda.synchronize()
        # inside capture compressed attention runs the Triton kernel, not cuDNN (routing's
        # capture refusal): compare with eager on the same route
        with nsa_ops.routing.force(compressed_attention="triton"):
            torch.testing.assert_close(out, nsa_ops.nsa_attention(q, k, v, *g))
        print("captured")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and "captured" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fa2_lse_gradient_keeps_fp32_values(dtype, monkeypatch):
    """dlse reaches the FA-2 backward's second pass in o's dtype: above 65504 it overflowed fp16,
    and bf16 rounded it to 8 bits. With dO = 0 the grads are the dlse term alone.

    Only rows that see the whole window get a large dlse: FA-2 rounds dS = P * dlse to fp16 for
    its dQ / dK products, so a row with P near 1 (the first tokens) would overflow there however
    dlse arrives; past 256 keys P stays far below 65504 / dlse."""
    if window.backend_refusal("aten_fa2", torch.empty(1, 1, 1, 64, device="cuda", dtype=dtype)):
        pytest.skip("no bundled FA-2")
    T, HQ, H, D = 1024, 8, 2, 64
    q, k, v = qkv(1, T, HQ, H, D, D, dtype, seed=3, device="cuda")
    scale = D ** -0.5
    o, lse = window.sliding_window_fwd(q, k, v, 256, scale, backend="aten_fa2")
    big = torch.arange(T, device="cuda")[None, :, None] >= 256
    dlse = torch.where(big, 6.6e4 + 1e3 * torch.rand_like(lse), torch.randn_like(lse))
    do = torch.zeros_like(o)
    got = window.sliding_window_bwd(q, k, v, o, lse, do, dlse, 256, scale, backend="aten_fa2")
    q32, k32, v32 = q.float(), k.float(), v.float()
    mask_fn = R.window_mask_fn(T, 256, None, "cuda")
    o32, lse32 = R.masked_attention(q32, k32, v32, mask_fn, scale)
    want = R.masked_attention_backward(q32, k32, v32, o32, lse32, do.float(), dlse, mask_fn, scale)
    for name, ours, theirs in zip(("dq", "dk"), got, want):
        assert torch.isfinite(ours).all(), name
        assert rel_err(ours, theirs) < 1e-2, name


def test_compiled_selection_reads_sliced_and_permuted_inputs():
    """The Inductor template gets block_idx as a slice of a wider tensor and q with a non-unit
    last stride: it must read them as eager does, whichever autotune choice wins."""
    B, T, HQ, H, D, sel, n = 1, 2048, 16, 2, 64, 64, 8
    _, k, v = qkv(B, T, HQ, H, D, D, torch.bfloat16, seed=5, device="cuda")
    q = torch.randn(B, T, D, HQ, device="cuda", dtype=torch.bfloat16).transpose(2, 3)
    wide = torch.cat([_forced_blocks(B, T, H, n, sel, "cuda"),
                      torch.full((B, T, H, 3), 1, dtype=torch.int32, device="cuda")], -1)

    def f(q, k, v, wide):
        o, lse = torch.ops.nsa.selection_attention(q, k, v, wide[..., :n], sel, D ** -0.5)
        return o * 2, lse

    eager = f(q, k, v, wide)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)(q, k, v, wide)
    torch.testing.assert_close(compiled[0], eager[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("sel_block", [24, 48, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sel_block_without_power_of_two_tile(sel_block, dtype):
    """l' that no key tile >= 16 divides, or that spans several tiles, on every CUDA route."""
    T, HQ, H, Dk, Dv = 2000, 16, 2, 64, 64
    q, k, v = qkv(1, T, HQ, H, Dk, Dv, dtype, seed=sel_block, device="cuda",
                  requires_grad=True)
    idx = _forced_blocks(1, T, H, 6, sel_block, "cuda")
    scale = Dk ** -0.5
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = R.selection_attention(q32, k32, v32, idx, sel_block, scale)
    do = torch.randn_like(o_ref)
    (o_ref * do).sum().backward()
    for impl in ("triton", "packed_sdpa"):
        for t in (q, k, v):
            t.grad = None
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", impl)
            o, lse = torch.ops.nsa.selection_attention(q, k, v, idx, sel_block, scale)
            (o.float() * do).sum().backward()
        assert rel_err(o, o_ref) < 2e-2, impl
        assert rel_err(lse, lse_ref) < 1e-3, impl
        for name, ours, theirs in zip("qkv", (q.grad, k.grad, v.grad), (q32.grad, k32.grad, v32.grad)):
            assert rel_err(ours, theirs) < 3e-2, f"{impl} d{name}"
