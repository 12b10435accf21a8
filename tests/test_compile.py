"""torch.compile(fullgraph=True, dynamic=True) over nsa_attention: no graph breaks, no recompiles."""
import torch
import torch._dynamo.testing

import nsa_ops
from helpers import SMALL, gates, qkv


class TinyNSA(torch.nn.Module):
    """Projections + gate MLP around nsa_attention, the way a model would call it."""

    def __init__(self, dim=32, heads_q=4, heads_kv=2, head_dim=16):
        super().__init__()
        self.shape = (heads_q, heads_kv, head_dim)
        self.q = torch.nn.Linear(dim, heads_q * head_dim)
        self.kv = torch.nn.Linear(dim, 2 * heads_kv * head_dim)
        self.gate = torch.nn.Linear(dim, 3 * heads_q)
        self.o = torch.nn.Linear(heads_q * head_dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        hq, hk, d = self.shape
        q = self.q(x).view(B, T, hq, d)
        k, v = self.kv(x).view(B, T, 2, hk, d).unbind(2)
        g = torch.sigmoid(self.gate(x)).view(B, T, 3, hq).unbind(2)
        o = nsa_ops.nsa_attention(q, k, v, *g, **SMALL, window=24)
        return self.o(o.reshape(B, T, hq * d))


LENGTHS = (50, 77, 131)  # none a multiple of any block size


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
    for T in LENGTHS:
        x = torch.randn(1, T, 32, requires_grad=True)
        out = compiled(x)
        ref = model(x)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        gx, = torch.autograd.grad(out.sum(), x)
        rx, = torch.autograd.grad(ref.sum(), x)
        torch.testing.assert_close(gx, rx, atol=1e-5, rtol=1e-4)
    assert counter.frame_count == 1
