"""End-to-end GPU checks of the torch.ops.nsa path (routing -> Triton / FA-2) against the reference."""
import warnings

import pytest
import torch

import nsa_ops
from nsa_ops import reference as R, routing
from nsa_ops.kernels import selection
from helpers import CUDNN_COMPRESSED_T, cu_seqlens, gates, qkv, rel_err

pytestmark = pytest.mark.gpu

REL = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
# window: the selection backward's stored dS over query windows of that many tokens (a budget
# as a GPU too small for the whole buffer would give), through the eager layer's early index
@pytest.mark.parametrize("T,HQ,H,Dk,Dv,lengths,window", [
    (2048, 16, 4, 64, 64, None, None),
    (4096, 64, 4, 128, 128, None, None),
    (4096, 64, 4, 128, 128, None, 1024),
    (1500, 8, 8, 192, 128, None, None),
    (3000, 32, 2, 128, 128, (1000, 37, 1963), None),
])
def test_nsa_attention_cuda_matches_reference(T, HQ, H, Dk, Dv, lengths, window, dtype,
                                              monkeypatch):
    if window:
        per_token = HQ * 16 * 64 * dtype.itemsize
        monkeypatch.setattr(selection, "_ds_budget", lambda device: window * per_token)
    q, k, v = qkv(1, T, HQ, H, Dk, Dv, dtype, seed=T, requires_grad=True, device="cuda")
    if window:
        assert selection._ds_window(q, 16, 64) == window
    g = [x.cuda() for x in gates(1, T, HQ, dtype)]
    cu = cu_seqlens(lengths, "cuda") if lengths else None
    x = routing.Inputs.of(q, v, cu)
    assert routing.choose("selection_attention", x).impl == "triton"
    o = nsa_ops.nsa_attention(q, k, v, *g, cu_seqlens=cu)
    do = torch.randn_like(o)
    o.backward(do)
    # reference in float32 on the same selection (bf16 rounding may flip near-tied blocks)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    _, lse = torch.ops.nsa.compressed_attention(q.detach(), R.compress_mean(k.detach(), 32, 16, cu),
                                                R.compress_mean(v.detach(), 32, 16, cu), 32, 16,
                                                Dk ** -0.5, cu)
    idx = torch.ops.nsa.select_blocks(q.detach(), R.compress_mean(k.detach(), 32, 16, cu), lse,
                                      32, 16, 64, 16, Dk ** -0.5, cu)
    with torch.enable_grad():
        ref = R.nsa(q32, k32, v32, *(t.float() for t in g), cu_seqlens=cu, block_idx=idx)
        ref.backward(do.float())
    assert rel_err(o, ref) < REL[dtype]
    for ours, theirs in ((q.grad, q32.grad), (k.grad, k32.grad), (v.grad, v32.grad)):
        assert rel_err(ours, theirs) < 2 * REL[dtype]


def test_nsa_attention_cuda_fp32_gates():
    """fp32 gates needing grads over bf16 branches (a gate projection kept in fp32): the layer's
    output and dO are fp32, the window and selection kernels get dO in the branches' dtype, their
    gate and the gate backward's row sums as delta; output, q/k/v and gate grads against the
    float32 reference on the same selection."""
    T, HQ, H, D = 4096, 64, 4, 128
    q, k, v = qkv(1, T, HQ, H, D, D, torch.bfloat16, seed=T + 1, requires_grad=True,
                  device="cuda")
    g = [x.cuda().requires_grad_() for x in gates(1, T, HQ, torch.float32)]
    o = nsa_ops.nsa_attention(q, k, v, *g)
    assert o.dtype == torch.float32
    do = torch.randn_like(o)
    o.backward(do)
    k_cmp, v_cmp = (R.compress_mean(x.detach(), 32, 16) for x in (k, v))
    _, lse = torch.ops.nsa.compressed_attention(q.detach(), k_cmp, v_cmp, 32, 16, D ** -0.5)
    idx = torch.ops.nsa.select_blocks(q.detach(), k_cmp, lse, 32, 16, 64, 16, D ** -0.5)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v, *g)]
    with torch.enable_grad():
        ref = R.nsa(*leaves, block_idx=idx)
        ref.backward(do)
    assert rel_err(o, ref) < REL[torch.bfloat16]
    for ours, theirs in zip((q, k, v, *g), leaves):
        assert rel_err(ours.grad, theirs.grad) < 2 * REL[torch.bfloat16]


def test_matches_fla_naive_nsa():
    fla_naive = pytest.importorskip("fla.ops.nsa.naive")
    T, HQ, H, D = 300, 16, 1, 64
    q, k, v = qkv(1, T, HQ, H, D, D, torch.float32, seed=4, device="cuda")
    g = [x.cuda() for x in gates(1, T, HQ)]
    ours = nsa_ops.nsa_attention(q, k, v, g[0], g[1], None, block_len=64, block_stride=64,
                                 sel_block=64, num_sel=4, window=0)
    theirs = fla_naive.naive_nsa(q, k, v, g[0], g[1], None, block_counts=4, block_size=64,
                                 window_size=0)
    assert rel_err(ours, theirs) < 1e-4


# fla's geometry (l = d = l' = block_size, mean pooling, no window branch); its fp32 dots run
# in tf32, so 16-bit inputs only
@pytest.mark.parametrize("B,T,Tk,HQ,H,D,S,BS,lengths,dtype", [
    (2, 2048, 2048, 32, 2, 128, 16, 64, None, torch.bfloat16),
    (2, 2048, 2048, 16, 1, 64, 8, 32, None, torch.float16),
    (1, 777, 777, 16, 1, 128, 16, 64, None, torch.bfloat16),
    (1, 3000, 3000, 32, 2, 128, 16, 64, (1000, 37, 1963), torch.bfloat16),
    (1, 700, 1500, 16, 1, 128, 16, 64, None, torch.bfloat16),
], ids=["batch", "fp16", "ragged-T", "varlen", "offset"])
def test_matches_fla_parallel_nsa_on_the_same_blocks(B, T, Tk, HQ, H, D, S, BS, lengths, dtype):
    """fla's Triton NSA given the blocks our selection chose: output and every gradient agree
    (the selection rules differ, e.g. our forced blocks, so fla's own choice is not compared).
    Queries at an offset (T < Tk) are checked against fla's full-length call, its last T rows
    (upstream gradient zero on the others): fla-core 0.5.2's backward at an offset gives other
    q/k/v gradients than its own full-length call (H200: relative 0.85 / 1.09 / 2.61), where
    ours equal the full call's (tests/test_offsets.py)."""
    fla = pytest.importorskip("fla.ops.nsa")
    g = torch.Generator().manual_seed(T + HQ)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype=dtype, device="cuda")
    q_full, k, v = mk(B, Tk, HQ, D), mk(B, Tk, H, D), mk(B, Tk, H, D)
    g_cmp, g_slc = (x.cuda() for x in gates(B, Tk, HQ, dtype)[:2])
    rows = slice(Tk - T, Tk)
    geo = dict(block_len=BS, block_stride=BS, sel_block=BS, num_sel=S, window=0,
               cu_seqlens=cu_seqlens(lengths, "cuda") if lengths else None)
    used = []
    with torch.no_grad():  # the full-length call's blocks: fla's own call is full-length
        nsa_ops.nsa_attention(q_full, k, v, g_cmp, g_slc, None, **geo, on_block_idx=used.append)
    do = torch.zeros(B, Tk, HQ, D, dtype=dtype, device="cuda")
    do[:, rows] = mk(B, T, HQ, D)

    leaves = [x.detach().requires_grad_() for x in (q_full[:, rows], k, v, g_cmp[:, rows],
                                                    g_slc[:, rows])]
    o = nsa_ops.nsa_attention(*leaves, None, **geo)
    ours = [o] + list(torch.autograd.grad(o, leaves, do[:, rows]))

    leaves = [x.detach().requires_grad_() for x in (q_full, k, v, g_cmp, g_slc)]
    with warnings.catch_warnings():  # fla warns that block_indices override its selection
        warnings.simplefilter("ignore")
        o = fla.parallel_nsa(*leaves, None, block_indices=used[0].long(), block_counts=S,
                             block_size=BS, window_size=0,
                             cu_seqlens=geo["cu_seqlens"].long() if lengths else None)
    theirs = [o] + list(torch.autograd.grad(o, leaves, do))
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg_cmp", "dg_slc"), ours, theirs):
        assert rel_err(a, b if name in ("dk", "dv") else b[:, rows]) < REL[dtype], name


# CUDNN_COMPRESSED_T routes compressed attention to cuDNN (nsa_ops.compressed_sdpa)
@pytest.mark.parametrize("T", [2048, CUDNN_COMPRESSED_T])
def test_cuda_graph_capture_forward(T):
    HQ, H, D = 16, 2, 64
    q, k, v = qkv(1, T, HQ, H, D, D, torch.bfloat16, seed=1, device="cuda")
    g = [x.cuda() for x in gates(1, T, HQ, torch.bfloat16)]
    if T == CUDNN_COMPRESSED_T and torch.cuda.get_device_capability() == (9, 0):
        x = routing.Inputs.of_compressed(q, v, 32, 16)
        assert routing.choose("compressed_attention", x).impl == "cudnn"
    eager = nsa_ops.nsa_attention(q, k, v, *g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        nsa_ops.nsa_attention(q, k, v, *g)  # warm up (compile, cuDNN's plans) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nsa_ops.nsa_attention(q, k, v, *g)
    graph.replay()
    torch.cuda.synchronize()
    # the capture runs the eager call's kernels, cuDNN's at CUDNN_COMPRESSED_T too (the warm-up
    # on this thread built its plans): replay is bitwise the eager call
    assert torch.equal(out, eager)


def _layer_step(m, x, weight):
    """Output and parameter gradients of one forward/backward of the layer."""
    m.zero_grad(set_to_none=True)
    out = m(x)
    (out.float() * weight).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters()
                          if p.grad is not None}


@pytest.mark.parametrize("phi", ["mean", "mlp"])
def test_training_shaped_layer_grads_match_reference(phi, monkeypatch):
    """The layer as `python -m nsa_ops.train --preset gpu` builds it (T=4096, HQ=8, H=2, D=64):
    every parameter gradient of the Triton path equals the reference's in float32, and bf16
    autocast stays close to both."""
    cfg = nsa_ops.NSAConfig(hidden_size=512, num_heads=8, num_kv_heads=2, head_dim_qk=64,
                            head_dim_v=64, phi=phi)
    torch.manual_seed(0)
    m = nsa_ops.NSAAttention(cfg).cuda()
    with torch.no_grad():  # off the initial point, so every branch and phi's MLP matter
        for p in m.gate[-1].parameters():
            p.normal_(0, 0.3)
        if phi == "mlp":
            for p in list(m.phi_k.parameters()) + list(m.phi_v.parameters()):
                p.normal_(0, 0.02)
    x = torch.randn(2, 4096, 512, device="cuda")
    weight = torch.randn(2, 4096, 512, device="cuda")
    out, grads = _layer_step(m, x, weight)
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL", "reference")
    ref_out, ref_grads = _layer_step(m, x, weight)
    monkeypatch.delenv("NSA_OPS_FORCE_IMPL")
    # phi's output bias moves every compressed key of a head alike, which no softmax over those
    # keys sees: its gradient is zero up to rounding, and a relative error of noise means nothing
    scale = max(g.norm() for g in ref_grads.values())
    checked = {n: g for n, g in ref_grads.items() if g.norm() > 1e-4 * scale}
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight", "gate.2.weight"} <= set(checked)
    assert rel_err(out, ref_out) < REL[torch.float32]
    for name, g in checked.items():
        assert rel_err(grads[name], g) < 1e-2, name
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf_out, bf_grads = _layer_step(m, x, weight)
    assert rel_err(bf_out, ref_out) < 3e-2
    for name, g in checked.items():
        assert rel_err(bf_grads[name], g) < 1e-1, name
