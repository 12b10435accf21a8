"""The Inductor lowering of nsa.selection_attention (nsa_ops.lowering).

CPU: the lowering is registered and emits the op's generic fallback, the gate is one fused kernel,
outputs equal eager, no recompiles across lengths, and a torch without the template API falls back
with a warning. GPU: the Triton template (not an opaque call) is in the generated code, with the
gate fused into its epilogue or one pointwise kernel, and routing to packed SDPA is honoured.
"""
import re
import subprocess
import sys

import pytest
import torch
import torch._dynamo.testing
from torch._inductor.utils import run_and_get_code

import nsa_ops
from nsa_ops import lowering, routing
from nsa_ops.lowering import selection as sel_lowering
from helpers import SMALL, TOL, cu_seqlens, gates, qkv, selection_for

GEO = dict(SMALL, num_sel=4)
FALLBACK_CALL = "= torch.ops.nsa.selection_attention.default("  # the opaque call, not comments


def gated_selection(q, k, v, block_idx, g_cmp, g_slc, g_win, o_cmp, o_win):
    """The selection branch and the gate that consumes it, as nsa_attention runs them."""
    o_slc, _ = torch.ops.nsa.selection_attention(q, k, v, block_idx, GEO["sel_block"],
                                                 q.shape[-1] ** -0.5)
    return nsa_ops.reference.gate_combine(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win)


def make_inputs(T, dtype=torch.float32, device="cpu", B=1, HQ=8, H=2, D=32, seed=0):
    q, k, v = qkv(B, T, HQ, H, D, D, dtype=torch.float32, seed=seed)
    idx = selection_for(q, k, v, GEO)
    g = gates(B, T, HQ, dtype=torch.float32, seed=seed + 1)
    o_cmp, o_win = qkv(B, T, HQ, HQ, D, D, seed=seed + 2)[1:]
    tensors = [q, k, v, idx, *g, o_cmp, o_win]
    return [t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
            for t in tensors]


def test_lowering_registered_with_inductor():
    from torch._inductor.lowering import lowerings
    assert lowering.registered()
    fn = lowerings[torch.ops.nsa.selection_attention.default]
    assert fn.__name__ == "lower_selection_attention"  # wrapped by register_lowering


EXTERN_KERNELS = ("nsa_selection_kernel", "nsa_selection_packed_sdpa")


@pytest.mark.parametrize("first", ["nsa_ops", "inductor", "select_algorithm"])
def test_registered_whichever_is_imported_first(first):
    """import nsa_ops leaves Inductor unloaded (seconds of import time), yet the lowering is in
    place as soon as Inductor loads, before or after nsa_ops. So are the extern kernels the
    autotuner may pick, which code from the FX graph cache calls without lowering anything."""
    imports = {"nsa_ops": "import nsa_ops\nassert 'torch._inductor.lowering' not in sys.modules",
               "inductor": "import torch._inductor.lowering",
               "select_algorithm": "import torch._inductor.select_algorithm"}
    second = "nsa_ops" if first != "nsa_ops" else "inductor"
    code = "\n".join(["import sys, torch", imports[first], imports[second].split("\n")[0],
                      "from torch._inductor.lowering import lowerings",
                      "from torch._inductor.select_algorithm import extern_kernels",
                      "assert torch.ops.nsa.selection_attention.default in lowerings",
                      f"assert all(hasattr(extern_kernels, n) for n in {EXTERN_KERNELS})"])
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cpu_compiles_to_the_op_fallback_with_one_fused_gate_kernel():
    torch._dynamo.reset()
    args = make_inputs(45)
    compiled = torch.compile(gated_selection, fullgraph=True)
    out, (code,) = run_and_get_code(compiled, *args)
    torch.testing.assert_close(out, gated_selection(*args), atol=2e-5, rtol=1e-4)
    assert code.count(FALLBACK_CALL) == 1
    # the gate multiply-add over three branch outputs is a single C++ kernel
    assert len(re.findall(r"cpp_fused_\w+ = ", code)) == 1, code


def test_cpu_dynamic_lengths_no_recompile():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(gated_selection, backend=counter, fullgraph=True, dynamic=True)
    for T in (40, 57, 83):
        args = make_inputs(T, seed=T)
        torch.testing.assert_close(compiled(*args), gated_selection(*args), atol=2e-5, rtol=1e-4)
    assert counter.frame_count == 1


def test_missing_inductor_api_warns_and_falls_back(monkeypatch):
    """A torch whose Inductor lacks the template API: one warning, then the opaque op call."""
    import torch._inductor.select_algorithm as select_algorithm
    monkeypatch.setattr(sel_lowering, "_api", None)
    monkeypatch.setattr(sel_lowering, "_api_error", None)
    monkeypatch.delattr(select_algorithm, "TritonTemplate")
    with pytest.warns(RuntimeWarning, match="lacks an Inductor API"):
        assert sel_lowering.inductor_api() is None
    assert sel_lowering.inductor_api() is None  # warned once, remembered


def test_unregistered_lowering_uses_inductor_generic_fallback():
    torch._dynamo.reset()
    args = make_inputs(45)
    lowering.unregister()
    try:
        out, (code,) = run_and_get_code(torch.compile(gated_selection, fullgraph=True), *args)
    finally:
        assert lowering.register()
    torch.testing.assert_close(out, gated_selection(*args), atol=2e-5, rtol=1e-4)
    assert FALLBACK_CALL in code


def test_lowering_routes_by_the_table(monkeypatch):
    """On a faked sm89 GPU the lowering asks routing, which sends selection to packed SDPA."""
    x = routing.Inputs("cuda", (8, 9), torch.bfloat16, 128, 128, 32768)
    assert routing.choose("selection_attention", x).impl == "packed_sdpa"
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "triton")
    assert routing.choose("selection_attention", x).impl == "triton"


# ---- GPU ---------------------------------------------------------------------------------------

def _triton_kernels(code: str) -> dict[str, str]:
    """name -> source of every Triton kernel in Inductor's output code."""
    return dict(re.findall(r"^(\w+) = async_compile\.triton\('\w+', '{3}(.*?)'{3},", code,
                           flags=re.M | re.S))


class _Withheld:
    """Stands in for an extern choice the test keeps from the autotuner."""

    def maybe_append_choice(self, choices, **kwargs):
        pass


def only_templates(monkeypatch):
    """The template's launch configs as the autotuner's only choices."""
    api = sel_lowering.inductor_api()
    for extern in ("kernel", "packed"):
        monkeypatch.setattr(api, extern, _Withheld())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_template_in_generated_code(dtype, monkeypatch):
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "triton")
    only_templates(monkeypatch)
    torch._dynamo.reset()
    args = make_inputs(2048, dtype=dtype, device="cuda", B=2, HQ=16, H=4, D=64)
    out, (code,) = run_and_get_code(torch.compile(gated_selection, fullgraph=True), *args)
    ref = gated_selection(*args)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    assert FALLBACK_CALL not in code
    kernels = _triton_kernels(code)
    assert any("selection_fwd_rows(" in src for src in kernels.values()), code
    # gate fused: into the template's epilogue, or one pointwise kernel beside it
    assert len(kernels) <= 2, list(kernels)


@pytest.mark.gpu
def test_gpu_packed_sdpa_route_is_an_extern_kernel(monkeypatch):
    """Where routing picks packed SDPA (forced here: sm89 / untuned SMs) it is the only choice."""
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "packed_sdpa")
    torch._dynamo.reset()
    args = make_inputs(300, dtype=torch.bfloat16, device="cuda", HQ=16, H=4, D=64)
    out, (code,) = run_and_get_code(torch.compile(gated_selection, fullgraph=True), *args)
    torch.testing.assert_close(out.float(), gated_selection(*args).float(), atol=5e-2, rtol=5e-2)
    assert "nsa_selection_packed_sdpa" in code and FALLBACK_CALL not in code


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [False, True])
def test_gpu_eager_kernel_is_an_extern_choice(offset, monkeypatch):
    """Where routing picks Triton the eager kernel is offered beside the template (here the only
    choice left): it writes Inductor's o and lse, fixed length and queries at an offset, dynamic
    lengths in one graph, the gradient through the op's backward."""
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "triton")
    monkeypatch.setattr(sel_lowering.inductor_api(), "packed", _Withheld())
    from nsa_ops.kernels import selection as sel_kernels
    monkeypatch.setattr(sel_kernels, "PER_TOKEN_CONFIGS", [])
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def fn(q, k, v, idx, g):
        o, lse = torch.ops.nsa.selection_attention(q, k, v, idx, GEO["sel_block"],
                                                   q.shape[-1] ** -0.5)
        return o * g[..., None], lse
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for T in (2048, 2600):
        q, k, v, idx, g = make_inputs(T, dtype=torch.bfloat16, device="cuda", HQ=16, H=4, D=64,
                                      seed=T)[:5]
        rows = slice(T - 700, T) if offset else slice(None)  # the last 700 queries
        args = [q[:, rows].detach().requires_grad_(), k, v, idx[:, rows], g[:, rows]]
        if counter.frame_count == 0:
            (out, lse), codes = run_and_get_code(compiled, *args)  # forward, backward
            assert "extern_kernels.nsa_selection_kernel(" in codes[0]
            assert FALLBACK_CALL not in codes[0]
        else:
            out, lse = compiled(*args)
        ref_out, ref_lse = fn(*args)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
        dq, = torch.autograd.grad(out.float().square().sum(), args[0])
        ref_dq, = torch.autograd.grad(ref_out.float().square().sum(), args[0])
        assert ((dq.float() - ref_dq.float()).norm() / ref_dq.float().norm()) < 2e-2
    assert counter.frame_count == 1


@pytest.mark.gpu
def test_gpu_dynamic_lengths_no_recompile_with_backward(monkeypatch):
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "triton")
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(gated_selection, backend=counter, fullgraph=True, dynamic=True)
    for T in (1500, 2047, 3000):
        args = make_inputs(T, dtype=torch.bfloat16, device="cuda", HQ=16, H=4, D=64, seed=T)
        q, k, v = (a.requires_grad_() for a in args[:3])
        out = compiled(*args)
        ref = gated_selection(*args)
        torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        rgrads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
        for g, r in zip(grads, rgrads):
            assert ((g.float() - r.float()).norm() / r.float().norm()) < 2e-2
    assert counter.frame_count == 1


def _packed_selection(q, k, v, block_idx, g_slc, cu_q, cu_k):
    """Selection over packed sequences (cu_k None: the cu_seqlens shorthand), gated."""
    keys = dict(cu_seqlens=cu_q) if cu_k is None else dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    o, _ = torch.ops.nsa.selection_attention(q, k, v, block_idx, GEO["sel_block"],
                                             q.shape[-1] ** -0.5, **keys)
    return o * g_slc[..., None]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["varlen", "varlen_k", "offset"])
def test_gpu_template_serves_packed_sequences_and_offsets(layout, monkeypatch):
    """The template (not the opaque op) serves packed sequences and queries at an offset, one
    graph across packings under dynamic shapes, equal to eager."""
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "triton")
    only_templates(monkeypatch)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    fn = _packed_selection if layout != "offset" else (
        lambda q, k, v, idx, g, cu_q, cu_k: torch.ops.nsa.selection_attention(
            q, k, v, idx, GEO["sel_block"], q.shape[-1] ** -0.5)[0] * g[..., None])
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    # sequence counts unlike every other size here: Dynamo would duck-size cu_seqlens with them
    for lengths in ((700, 1345), (2000, 33, 900, 1100)):
        total = sum(lengths)
        q_full, k, v = qkv(1, total, 16, 4, 64, 64, seed=total)
        idx_full = selection_for(q_full, k, v, GEO, cu_seqlens(lengths))
        if layout == "varlen":
            rows, cu_q, cu_k = torch.arange(total), cu_seqlens(lengths), None
        elif layout == "varlen_k":  # the last third of each sequence's queries
            tails = [n - n // 3 for n in lengths]
            rows = torch.cat([torch.arange(s + t, s + n) for s, t, n in
                              zip(cu_seqlens(lengths)[:-1].tolist(), tails, lengths)])
            cu_q, cu_k = cu_seqlens([n // 3 for n in lengths]), cu_seqlens(lengths)
        else:  # one sequence, its last 600 queries
            idx_full = selection_for(q_full, k, v, GEO)
            rows, cu_q, cu_k = torch.arange(total - 600, total), None, None
        g = gates(1, total, 16, seed=total)[1]
        args = [t.to("cuda", torch.bfloat16) for t in (q_full[:, rows], k, v)] + [
            idx_full[:, rows].cuda(), g[:, rows].to("cuda", torch.bfloat16),
            None if cu_q is None else cu_q.cuda(), None if cu_k is None else cu_k.cuda()]
        if counter.frame_count == 0:
            out, (code,) = run_and_get_code(compiled, *args)
            assert FALLBACK_CALL not in code
            assert any("selection_fwd_rows(" in src for src in _triton_kernels(code).values())
        else:
            out = compiled(*args)
        torch.testing.assert_close(out.float(), fn(*args).float(), atol=2e-2, rtol=2e-2)
    assert counter.frame_count == 1
