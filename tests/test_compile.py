"""torch.compile(fullgraph=True, dynamic=True) over nsa_attention and NSAAttention: no graph
breaks, no recompiles across lengths (T < block_len included) or varlen packings, equal to eager
forward and backward."""
import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.utils import counters

import nsa_ops
from nsa_ops import NSAAttention, NSAConfig
from helpers import CUDNN_COMPRESSED_T, SMALL, cu_seqlens, rel_err


class TinyNSA(torch.nn.Module):
    """Projections + gate MLP around nsa_attention, the way a model would call it."""

    def __init__(self, dim=32, heads_q=4, heads_kv=2, head_dim=16, window=24):
        super().__init__()
        self.shape = (heads_q, heads_kv, head_dim)
        self.window = window
        self.q = torch.nn.Linear(dim, heads_q * head_dim)
        self.kv = torch.nn.Linear(dim, 2 * heads_kv * head_dim)
        self.gate = torch.nn.Linear(dim, 3 * heads_q)
        self.o = torch.nn.Linear(heads_q * head_dim, dim)

    def forward(self, x, cu_seqlens=None):
        B, T, _ = x.shape
        hq, hk, d = self.shape
        q = self.q(x).view(B, T, hq, d)
        k, v = self.kv(x).view(B, T, 2, hk, d).unbind(2)
        g = torch.sigmoid(self.gate(x)).view(B, T, 3, hq).unbind(2)
        o = nsa_ops.nsa_attention(q, k, v, *g, **SMALL, window=self.window,
                                  cu_seqlens=cu_seqlens)
        return self.o(o.reshape(B, T, hq * d))


# none a multiple of any block size; 5 and 12 are shorter than block_len (no compressed block)
LENGTHS = (50, 77, 131, 5, 12)
# packed batches: sequences shorter than l, an empty one, a lone sequence, T < 2l
PACKINGS = ((20, 30), (40, 7, 33), (64,), (16, 0, 50, 9), (5, 3))
LAYER = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim_qk=8, head_dim_v=12,
             block_len=16, block_stride=8, sel_block=16, num_sel=4, window=24)


def x_for(B, T, seed, requires_grad=False, device="cpu", dtype=torch.float32, dim=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, dim, generator=g).to(device=device, dtype=dtype)
    return x.requires_grad_(requires_grad)


def check_fwd_bwd(compiled, model, x, atol, rtol, **kwargs):
    out, ref = compiled(x, **kwargs), model(x, **kwargs)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    gx, = torch.autograd.grad(out.square().sum(), x)
    rx, = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(gx, rx, atol=atol, rtol=rtol)


def test_compile_no_graph_break_no_recompile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyNSA()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for T in LENGTHS:
        x = torch.randn(2, T, 32)
        torch.testing.assert_close(compiled(x), model(x))
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for {LENGTHS}"
    assert counter.op_count > 0


def test_compile_inductor_matches_eager_with_backward():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyNSA()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for T in LENGTHS[:3]:
        check_fwd_bwd(compiled, model, x_for(1, T, T, requires_grad=True), 1e-5, 1e-4)
    assert counter.frame_count == 1


def test_varlen_inductor_matches_eager_with_backward():
    """Packed batches compile into one graph with no host read of cu_seqlens: compressed rows
    in the padded layout (reference.cmp_rows), value checks left to the ops' kernels."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyNSA()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for i, lengths in enumerate(PACKINGS[:3]):
        x = x_for(1, sum(lengths), i, requires_grad=True)
        check_fwd_bwd(compiled, model, x, 1e-5, 1e-4, cu_seqlens=cu_seqlens(lengths))
    assert counter.frame_count == 1


@pytest.mark.parametrize("phi", ["mean", "mlp"])
def test_layer_compiles_once_per_layout(phi):
    """NSAAttention: one graph for every fixed length >= 2 at every B >= 2, one more for every
    packing (the varlen graph); none recompiles for T < block_len or a different N."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = NSAAttention(NSAConfig(**LAYER, phi=phi, max_position=256))
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for i, (B, T) in enumerate([(2, 50), (3, 77), (2, 5), (2, 12), (3, 2), (2, 16)]):
        check_fwd_bwd(compiled, model, x_for(B, T, i, requires_grad=True), 1e-5, 1e-4)
    assert counter.frame_count == 1
    for i, lengths in enumerate(PACKINGS):
        x = x_for(1, sum(lengths), i, requires_grad=True)
        check_fwd_bwd(compiled, model, x, 1e-5, 1e-4, cu_seqlens=cu_seqlens(lengths))
    assert counter.frame_count == 2


def test_compiled_varlen_still_checks_values_on_cpu():
    """Tracing skips the checks that read cu_seqlens; the ops' kernels run them on CPU."""
    torch._dynamo.reset()
    model = TinyNSA()
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
    compiled(x_for(1, 50, 0), cu_seqlens=cu_seqlens((20, 30)))
    bad = torch.tensor([0, 30, 20, 50], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        compiled(x_for(1, 50, 0), cu_seqlens=bad)


# ---- GPU ------------------------------------------------------------------------------------

GPU_PACKINGS = ((1000, 37, 2011), (3000,), (700, 900, 15, 1400))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_varlen_compile_matches_eager_without_sync(dtype, monkeypatch):
    """Varlen on CUDA through Inductor (selection lowering registered, the Triton kernels forced
    where routing allows them): one graph for every packing, equal to eager forward and
    backward, and a compiled step never synchronises with the device."""
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "triton")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyNSA(dim=256, heads_q=16, heads_kv=2, head_dim=64, window=128).to("cuda", dtype)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    bound = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for i, lengths in enumerate(GPU_PACKINGS):
        cu = cu_seqlens(lengths, device="cuda")
        x = x_for(1, sum(lengths), i, requires_grad=True, device="cuda", dtype=dtype, dim=256)
        out, ref = compiled(x, cu_seqlens=cu), model(x, cu_seqlens=cu)
        assert rel_err(out, ref) < bound
        gx, = torch.autograd.grad(out.float().square().sum(), x)
        rx, = torch.autograd.grad(ref.float().square().sum(), x)
        assert rel_err(gx, rx) < bound
        torch.cuda.set_sync_debug_mode("error")
        try:
            compiled(x, cu_seqlens=cu).float().square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_gpu_layer_compile_modes_match_eager(mode):
    """The modes users reach for: "reduce-overhead" (CUDA graph trees: a warm-up run, a
    recording, then replays) and "max-autotune" (the selection lowering's template choices
    and every matmul benchmarked). An NSAAttention layer in bf16 at the length from which cuDNN
    serves compressed attention (plans built in the warm-up run, before the recording), three
    training steps: the output and the gradients of x and of every parameter against eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = NSAConfig(hidden_size=512, num_heads=16, num_kv_heads=2, head_dim_qk=64, head_dim_v=64)
    layer = NSAAttention(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():  # gates away from their initial 0.5 so that every branch matters
        layer.gate[-1].weight.normal_(0, 0.02)
    compiled = torch.compile(layer, mode=mode)
    params = list(layer.parameters())
    counters.clear()

    def step(fn, x):
        out = fn(x)
        grads = torch.autograd.grad(out.float().square().sum(), [x, *params])
        return [t.detach().clone() for t in (out, *grads)]  # graph trees reuse their outputs

    for i in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        x = x_for(1, CUDNN_COMPRESSED_T, i, requires_grad=True, device="cuda",
                  dtype=torch.bfloat16, dim=cfg.hidden_size)
        got, want = step(compiled, x), step(layer, x)
        names = ["out", "x"] + [name for name, _ in layer.named_parameters()]
        for name, a, b in zip(names, got, want):
            assert rel_err(a, b) < 2e-2, (i, name, rel_err(a, b))
    if mode == "reduce-overhead":  # Inductor falls back to no graphs where a graph is unsafe
        assert counters["inductor"]["cudagraph_skips"] == 0


def test_inductor_layer_gradients_equal_eager():
    """Every parameter gradient of a compiled NSAAttention (Inductor) equals eager's. With the
    gate fused as a torch expression, Inductor returned q/k/v projection gradients ~0 here."""
    torch.manual_seed(0)
    m = NSAAttention(NSAConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim_qk=8,
                               head_dim_v=8, block_len=16, block_stride=8, sel_block=16,
                               num_sel=3, window=24))
    x = torch.randn(4, 40, 32, generator=torch.Generator().manual_seed(1))

    def grads(fn):
        m.zero_grad()
        fn(x).square().mean().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    torch._dynamo.reset()
    want, got = grads(m), grads(torch.compile(m))
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4, msg=name)
