"""A training step captured as CUDA graphs by torch.cuda.make_graphed_callables, the way to take
the host out of short sequences' steps (at 2k-4k tokens the eager step's host time is 1.5-3x its
GPU time): replays give the eager step's output and gradients, for the functional core, packed
sequences whose lengths change between capture and replay, and the NSAAttention module; bit for
bit under deterministic algorithms. Inside a capture cuDNN serves compressed attention where an
eager call built its plans."""
import gc

import pytest
import torch

import nsa_ops
from nsa_ops import reference as R, routing
from helpers import CUDNN_COMPRESSED_T, cu_seqlens, gates, qkv, rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _collect_graphs():
    """A graphed callable keeps its graphs in a reference cycle (its autograd Function's class),
    which only the cyclic GC frees: if a collection starts inside a later test's capture (a first
    call there compiles kernels, allocating plenty), releasing those graphs there can invalidate
    the capture (seen once, on a fresh H100: "operation failed due to a previous error during
    capture"). Collect each test's graphs when it ends."""
    yield
    gc.collect()
    torch.cuda.synchronize()


# bf16 outputs of the same kernels; dk / dv differ by the order of the selection backward's fp32
# atomic adds (about 1e-5 relative), wrong results by O(1)
TOL = 1e-4


def _grads(fn, inputs, do):
    """fn's output and the gradients of its inputs that require them, after backward(do)."""
    for x in inputs:
        x.grad = None
    out = fn(*inputs)
    out.backward(do)
    return [out.detach().clone()] + [x.grad.clone() for x in inputs if x.requires_grad]


def _inputs(T, seed, lengths=None):
    q, k, v = qkv(1, T, 64, 4, 128, 128, torch.bfloat16, seed=seed, requires_grad=True,
                  device="cuda")
    g = [x.cuda().requires_grad_() for x in gates(1, T, 64, torch.bfloat16, seed=seed + 1)]
    extra = [] if lengths is None else [cu_seqlens(lengths, "cuda")]
    return [q, k, v, *g, *extra]


def _core(q, k, v, g_cmp, g_slc, g_win, cu=None):
    return nsa_ops.nsa_attention(q, k, v, g_cmp, g_slc, g_win, cu_seqlens=cu)


def _assert_same(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < TOL, f"output {i}: relative error {rel_err(a, b):.2e}"


# the capture's lengths, then the replay's: a graph must read cu_seqlens on the device;
# CUDNN_COMPRESSED_T: compressed attention through cuDNN, inside the capture too
@pytest.mark.parametrize("T,captured,replayed", [
    (2048, None, None),
    (4096, None, None),
    (CUDNN_COMPRESSED_T, None, None),
    (3000, (1000, 37, 1963), (64, 2500, 436)),
])
def test_graphed_core_step_matches_eager(T, captured, replayed):
    graphed = torch.cuda.make_graphed_callables(_core, tuple(_inputs(T, 5, captured)))
    for seed, lengths in ((7, captured), (9, replayed)):
        inputs = _inputs(T, seed, lengths)
        do = torch.randn(1, T, 64, 128, device="cuda", dtype=torch.bfloat16)
        _assert_same(_grads(graphed, inputs, do), _grads(_core, inputs, do))


# bf16 weights, or fp32 weights under bf16 autocast (without its cast cache, as
# make_graphed_callables asks)
@pytest.mark.parametrize("weights,autocast", [(torch.bfloat16, False), (torch.float32, True)],
                         ids=["bf16", "autocast"])
def test_graphed_module_step_matches_eager(weights, autocast):
    torch.manual_seed(0)
    cfg = nsa_ops.NSAConfig(hidden_size=1024, num_heads=16, num_kv_heads=2, head_dim_qk=64,
                            head_dim_v=64)
    layer = nsa_ops.NSAAttention(cfg).cuda().to(weights)
    with torch.no_grad():  # gates away from their initial 0.5 so that every branch matters
        layer.gate[-1].weight.normal_(0, 0.02)
    T = 2048
    x = torch.randn(1, T, cfg.hidden_size, device="cuda", dtype=weights, requires_grad=True)
    eager = nsa_ops.NSAAttention(cfg).cuda().to(weights)
    eager.load_state_dict(layer.state_dict())
    cast = lambda: torch.autocast("cuda", torch.bfloat16, enabled=autocast, cache_enabled=False)
    with cast():
        graphed = torch.cuda.make_graphed_callables(layer, (x.detach().clone().requires_grad_(),))
    do = torch.randn(1, T, cfg.hidden_size, device="cuda", dtype=weights)
    for module in (graphed, eager):
        module.zero_grad(set_to_none=True)
    with cast():
        got = _grads(graphed, [x], do)
        want = _grads(eager, [x], do)
    _assert_same(got, want)
    params = dict(eager.named_parameters())
    for name, p in layer.named_parameters():
        assert rel_err(p.grad, params[name].grad) < TOL, name


def test_capture_runs_cudnn_where_an_eager_call_built_its_plans():
    """Inside a capture cuDNN serves compressed attention only for a layout an eager call on this
    thread ran before (its first call would allocate while building the plan); the Triton kernel
    otherwise. A layout no other test uses, so that the first capture comes before any call."""
    T = CUDNN_COMPRESSED_T + 16  # a row past the routing threshold: cuDNN's side
    q, k, v = qkv(1, T, 8, 2, 64, 64, torch.bfloat16, seed=2, device="cuda")
    g = [x.cuda() for x in gates(1, T, 8, torch.bfloat16)]
    v_cmp = R.compress_mean(v, 32, 16)  # laid out as the layer's
    inputs = lambda: routing.Inputs.of_compressed(q, v_cmp, 32, 16)
    if routing.choose("compressed_attention", inputs()).impl != "cudnn":
        pytest.skip("cuDNN does not serve compressed attention on this GPU")
    chosen = []

    def captured():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chosen.append(routing.choose("compressed_attention", inputs()).impl)
            out = nsa_ops.nsa_attention(q, k, v, *g)
        graph.replay()
        torch.cuda.synchronize()
        return out

    captured()
    eager = nsa_ops.nsa_attention(q, k, v, *g)
    replayed = captured()
    assert chosen == ["triton", "cudnn"]
    assert torch.equal(replayed, eager)


def test_graphed_step_is_bitwise_eager_under_deterministic_algorithms(deterministic):
    """With torch.use_deterministic_algorithms(True) every backward adds in a fixed order, so a
    replay is the eager step bit for bit."""
    T = 4096
    graphed = torch.cuda.make_graphed_callables(_core, tuple(_inputs(T, 5)))
    inputs = _inputs(T, 7)
    do = torch.randn(1, T, 64, 128, device="cuda", dtype=torch.bfloat16)
    for got, want in zip(_grads(graphed, inputs, do), _grads(_core, inputs, do)):
        assert torch.equal(got, want)
