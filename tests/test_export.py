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


def test_launches_traced_only_under_an_active_mode():
    """Kernel launches become graph nodes (wrap_triton, no TMA, no register cap) only while a
    dispatch mode traces them. Inductor's autotuner pops its modes to time real launches, and
    torch's is_in_torch_dispatch_mode() flag stays set there: the launches must be the eager
    ones, or the autotuner times another kernel than the compiled code runs."""
    from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes,
                                              is_in_torch_dispatch_mode)
    from nsa_ops.kernels import utils

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    capped = dict(num_warps=4, num_stages=2, maxnreg=128)
    assert not utils.traced() and utils.launch_options(4, 2, 128) == capped
    with PassThrough():
        assert utils.traced() and "maxnreg" not in utils.launch_options(4, 2, 128)
        with _disable_current_modes():
            assert is_in_torch_dispatch_mode()
            assert not utils.traced() and utils.launch_options(4, 2, 128) == capped


# Runs in a fresh interpreter that never imports nsa_ops: the package must hold every NSA kernel.
_RUN_PACKAGE = """
import sys, torch
runner = torch._inductor.aoti_load_package(sys.argv[1])
with torch.no_grad():
    outs = [runner(x) for x in torch.load(sys.argv[2])]
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "nsa_ops")
if loaded:
    raise SystemExit(f"the package imported {loaded}")
torch.save(outs, sys.argv[3])
"""

# fp32 at CFG's tiny geometry; bf16 where every branch takes its fast route (cuDNN aside: a
# symbolic T cannot size the residue views, so the Triton kernel serves)
AOTI_CONFIGS = {
    "fp32": (CFG, torch.float32, 1e-5),
    "bf16": (nsa_ops.NSAConfig(hidden_size=512, num_heads=8, num_kv_heads=2, head_dim_qk=64,
                               head_dim_v=64, block_len=32, block_stride=16, sel_block=64,
                               num_sel=4, window=128), torch.bfloat16, 2e-2),
}


def test_tma_choice_reads_no_address_of_traced_tensors():
    """While AOTInductor traces the CUDA ops, their tensors are fake or functional: asking
    whether TMA can describe them must not read their address (a functional tensor raises; that
    failed every package export on an H100), and their launches keep pointer loads."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from nsa_ops.kernels import selection, utils, window
    with FakeTensorMode(), FunctionalTensorMode():
        q = torch.empty(1, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.empty(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        assert not utils.tma_layout(k)
        assert not window._tma_loads("fwd", None, q, k, v)
        assert not window._tma_loads("dkdv", None, q, k, v, q)
        assert not selection._tma_loads(None, k, v, 64, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(AOTI_CONFIGS))
def test_gpu_aoti_package_runs_without_nsa_ops(name, tmp_path):
    """An AOTInductor package of an NSA layer, exported with dynamic batch and length, loads and
    runs in a process without nsa_ops (no Python op left in it) and equals eager. On a machine
    whose default g++ builds packages that crash on load (any package, a plain nn.Linear too),
    point Inductor at another compiler with CXX."""
    import subprocess
    import sys
    cfg, dtype, tol = AOTI_CONFIGS[name]
    torch.manual_seed(0)
    module = nsa_ops.NSAAttention(cfg).to("cuda", dtype).eval()
    x = torch.randn(2, 300, cfg.hidden_size, device="cuda", dtype=dtype)
    dims = {0: Dim("B", min=1, max=8), 1: Dim("T", min=1, max=4096)}
    ep = torch.export.export(module, (x,), dynamic_shapes={"x": dims})
    package = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(tmp_path / "nsa.pt2"),
        inductor_configs={"triton.coalesce_tiling_analysis": False})
    inputs = [torch.randn(B, T, cfg.hidden_size, device="cuda", dtype=dtype)
              for B, T in SHAPES + [(2, 1000)]]
    torch.save(inputs, tmp_path / "inputs.pt")
    run = subprocess.run([sys.executable, "-c", _RUN_PACKAGE, package, str(tmp_path / "inputs.pt"),
                          str(tmp_path / "outputs.pt")], capture_output=True, text=True,
                         cwd=tmp_path)
    crashed = (f"the package's process died of signal {-run.returncode}: if a plain nn.Linear "
               "package crashes too, this machine's compiler builds bad packages (set CXX)"
               if run.returncode < 0 else "")
    assert run.returncode == 0, crashed or run.stderr[-3000:]
    outs = torch.load(tmp_path / "outputs.pt")
    with torch.no_grad():
        for x, got in zip(inputs, outs):
            assert _rel(got.float(), module(x).float()) < tol, tuple(x.shape)
