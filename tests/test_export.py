"""torch.export of NSA: one exported program serves every length from the one-token decode step to
the maximum, and any batch; it saves, loads and equals eager."""
import io

import pytest
import torch
from torch.export import Dim

import nsa_ops

CFG = nsa_ops.NSAConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim_qk=8, head_dim_v=8,
                        block_len=16, block_stride=8, sel_block=16, num_sel=3, window=16)
# T = 1 (decode), T < l, a few compressed and selection blocks, varied batches
SHAPES = [(1, 1), (3, 7), (2, 40), (1, 300)]


def _rel(got, want):
    return ((got - want).norm() / want.norm()).item()


class Functional(torch.nn.Module):
    """nsa_attention on q, k, v and the three gates, at CFG's geometry."""

    def forward(self, q, k, v, g_cmp, g_slc, g_win):
        return nsa_ops.nsa_attention(q, k, v, g_cmp, g_slc, g_win, block_len=CFG.block_len,
                                     block_stride=CFG.block_stride, sel_block=CFG.sel_block,
                                     num_sel=CFG.num_sel, window=CFG.window)


def functional_inputs(B, T, device="cpu"):
    g = torch.Generator(device=device).manual_seed(B * 1000 + T)
    kw = dict(generator=g, device=device)
    HQ, H, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim_qk
    return (torch.randn(B, T, HQ, D, **kw), torch.randn(B, T, H, D, **kw),
            torch.randn(B, T, H, D, **kw), *(torch.rand(B, T, HQ, **kw) for _ in range(3)))


def export_module(device="cpu"):
    torch.manual_seed(0)
    module = nsa_ops.NSAAttention(CFG).to(device).eval()
    x = torch.randn(2, 40, CFG.hidden_size, device=device)
    dims = {0: Dim("B", min=1, max=8), 1: Dim("T", min=1, max=4096)}
    return module, torch.export.export(module, (x,), dynamic_shapes={"x": dims})


def export_functional(device="cpu"):
    dims = {0: Dim("B", min=1, max=8), 1: Dim("T", min=1, max=4096)}
    return torch.export.export(Functional(), functional_inputs(2, 40, device),
                               dynamic_shapes=(dims,) * 6)


def nsa_ops_called(ep) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("nsa.")]


def _length_range(ep):
    """(min, max) the exported program accepts for the length symbol."""
    T = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ("x", "q"))
    sym = T.meta["val"].shape[1].node.expr
    r = ep.range_constraints[sym]
    return int(r.lower), int(r.upper)


@pytest.fixture(scope="module")
def exported_module():
    return export_module()


def test_module_exports_for_every_length_and_batch(exported_module):
    module, ep = exported_module
    assert _length_range(ep) == (1, 4096), "a guard split the exported lengths"
    for B, T in SHAPES:
        x = torch.randn(B, T, CFG.hidden_size)
        with torch.no_grad():
            assert _rel(ep.module()(x), module(x)) < 1e-6, (B, T)


def test_exported_module_saves_and_loads(exported_module):
    module, ep = exported_module
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    assert nsa_ops_called(loaded) == nsa_ops_called(ep)
    x = torch.randn(3, 21, CFG.hidden_size)
    with torch.no_grad():
        assert _rel(loaded.module()(x), module(x)) < 1e-6


def test_functional_exports_for_every_length_and_batch():
    ep = export_functional()
    assert _length_range(ep) == (1, 4096)
    for B, T in SHAPES:
        args = functional_inputs(B, T)
        assert _rel(ep.module()(*args), Functional()(*args)) < 1e-6, (B, T)


@pytest.mark.gpu
def test_gpu_exported_module_equals_eager():
    module, ep = export_module("cuda")
    assert _length_range(ep) == (1, 4096)
    for B, T in SHAPES + [(2, 4096)]:
        x = torch.randn(B, T, CFG.hidden_size, device="cuda")
        with torch.no_grad():
            assert _rel(ep.module()(x), module(x)) < 1e-5, (B, T)
