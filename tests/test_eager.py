"""nsa_attention's eager path (nsa_ops.eager, one autograd node over the ops' bodies) against the
same call through the torch.ops.nsa ops (NSA_OPS_EAGER_LAYER=0): the same outputs, gradients
and selections, and the ops wherever the one node could be told apart from them."""
import collections

import pytest
import torch

import nsa_ops
from nsa_ops import reference as R
from nsa_ops import routing
from helpers import SMALL, cu_seqlens, gates, qkv

# (Tq, Tk, window, gate grads, packed lengths, given block_idx)
CASES = [
    (64, 64, 16, True, None, False),
    (64, 64, 0, True, None, False),
    (64, 64, 24, False, None, False),
    (40, 72, 16, True, None, False),
    (72, 72, 16, True, (30, 42), False),
    (64, 64, 16, True, None, True),
]


def _layer(monkeypatch, eager, Tq, Tk, window, gate_grad, lengths, given, phi="mean"):
    monkeypatch.setenv("NSA_OPS_EAGER_LAYER", "1" if eager else "0")
    q, k, v = qkv(1, Tk, 4, 2, 16, 16, requires_grad=True, seed=3)
    q = q.detach()[:, Tk - Tq:].requires_grad_()
    g = [x[:, :Tq].requires_grad_(gate_grad) for x in gates(1, Tk, 4, seed=4)]
    kw = dict(SMALL, window=window, phi=phi)
    if lengths is not None:
        kw["cu_seqlens"] = cu_seqlens(lengths)
    if given:
        score = torch.rand(1, Tq, 2, -(-Tk // 16), generator=torch.Generator().manual_seed(5))
        kw["block_idx"] = R.topn_blocks(score, torch.arange(Tk - Tq, Tk), 16, 3)
    seen = []
    o = nsa_ops.nsa_attention(q, k, v, *g, on_block_idx=seen.append, **kw)
    o.backward(torch.randn(o.shape, generator=torch.Generator().manual_seed(6)))
    return o, [q.grad, k.grad, v.grad, *(x.grad for x in g)], seen[0]


def _assert_grads_match(grads, grads_ops, atol=1e-6, rtol=1e-5):
    """The layer's (dq, dk, dv, dg_cmp, dg_slc, dg_win) against the ops': the same branch
    gradients, summed in another order (or, with tolerances given, computed otherwise)."""
    for name, got, want in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_win"), grads,
                               grads_ops):
        if want is None:
            assert got is None, name
        else:
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("Tq,Tk,window,gate_grad,lengths,given", CASES)
def test_eager_layer_matches_ops(monkeypatch, Tq, Tk, window, gate_grad, lengths, given):
    o, grads, block_idx = _layer(monkeypatch, True, Tq, Tk, window, gate_grad, lengths, given)
    assert type(o.grad_fn).__name__ == "_LayerBackward"  # the eager path ran
    o_ops, grads_ops, block_idx_ops = _layer(monkeypatch, False, Tq, Tk, window, gate_grad,
                                             lengths, given)
    assert type(o_ops.grad_fn).__name__ != "_LayerBackward"
    torch.testing.assert_close(o, o_ops, atol=0, rtol=0)
    assert torch.equal(block_idx, block_idx_ops)
    _assert_grads_match(grads, grads_ops)


def test_eager_layer_leaves_learnable_phi_to_the_ops(monkeypatch):
    phi = (nsa_ops.PhiMLP(16, 16), nsa_ops.PhiMLP(16, 16))
    o, _, _ = _layer(monkeypatch, True, 48, 48, 16, True, None, False, phi=phi)
    assert type(o.grad_fn).__name__ != "_LayerBackward"
    assert all(p.grad is not None for m in phi for p in m.parameters())


def test_eager_layer_steps_aside_for_function_modes(monkeypatch):
    monkeypatch.setenv("NSA_OPS_EAGER_LAYER", "1")
    q, k, v = qkv(1, 48, 4, 2, 16, 16, requires_grad=True)
    with torch.device("cpu"):  # a TorchFunctionMode: it sees every op, as the ops let it
        o = nsa_ops.nsa_attention(q, k, v, *gates(1, 48, 4), window=16, **SMALL)
    assert type(o.grad_fn).__name__ != "_LayerBackward"


def test_eager_layer_without_grad(monkeypatch):
    monkeypatch.setenv("NSA_OPS_EAGER_LAYER", "1")
    q, k, v = qkv(1, 48, 4, 2, 16, 16, requires_grad=True)
    with torch.no_grad():
        o = nsa_ops.nsa_attention(q, k, v, *gates(1, 48, 4), window=16, **SMALL)
    monkeypatch.setenv("NSA_OPS_EAGER_LAYER", "0")
    with torch.no_grad():
        o_ops = nsa_ops.nsa_attention(q, k, v, *gates(1, 48, 4), window=16, **SMALL)
    assert o.grad_fn is None
    torch.testing.assert_close(o, o_ops, atol=0, rtol=0)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_eager_dq_sum_on_either_route(monkeypatch, impl):
    """The branches' dq meet in the selection backward where its route takes them
    (`Route.adds_dq`: the Triton dq kernel's epilogue) and are added after it elsewhere."""
    pytest.importorskip("triton")
    assert routing.route("selection_attention", impl).adds_dq == (impl == "triton")
    with routing.force(selection_attention=impl):
        o, grads, _ = _layer(monkeypatch, True, *CASES[0])
        assert type(o.grad_fn).__name__ == "_LayerBackward"
        _, grads_ops, _ = _layer(monkeypatch, False, *CASES[0])
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ops):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)


def test_eager_gate_in_selection_epilogue(monkeypatch):
    """Where the selection route has a gated form (`Route.gated`: the Triton kernel's), the layer
    writes the combine from the selection forward's epilogue, not through the gate_combine op:
    the same output and gradients as the ops within rounding; in parity mode, which checks each
    op's forward, and on the reference route the op runs."""
    pytest.importorskip("triton")
    from nsa_ops import observe, ops
    combines = []
    body = ops.gate_combine._init_fn
    monkeypatch.setattr(ops.gate_combine, "_init_fn",
                        lambda *a: combines.append(1) or body(*a))
    with routing.force(selection_attention="triton"):
        o, grads, _ = _layer(monkeypatch, True, *CASES[0])
        assert combines == []
        o_ops, grads_ops, _ = _layer(monkeypatch, False, *CASES[0])
        torch.testing.assert_close(o, o_ops, atol=1e-6, rtol=1e-5)
        _assert_grads_match(grads, grads_ops)
        with observe.parity(1.0):
            _layer(monkeypatch, True, *CASES[1])
        assert len(combines) == 1
    with routing.force(selection_attention="reference"):
        _layer(monkeypatch, True, *CASES[0])
    assert len(combines) == 2


@pytest.mark.parametrize("window_impl", ["triton", "reference"])
def test_eager_branch_backward_takes_the_gate(monkeypatch, window_impl):
    """The layer's gate backward writes g * dO only for the branches whose route takes no gate:
    the compressed, selection and window backward take dO and their gate where their route does
    (`Route.scales_do`: the Triton kernels scale P), the reference window gets the product from
    the gate's backward: the same gradients as through the ops, with packed sequences and
    queries at an offset too; the gated branches get the gate backward's row sums as their
    delta; a gate for a route that takes none is refused by name."""
    pytest.importorskip("triton")
    from nsa_ops import ops
    calls, deltas = [], []
    backward = ops.gate_backward
    monkeypatch.setattr(ops, "gate_backward",
                        lambda *a, **kw: calls.append(kw.get("branch_grads"))
                        or backward(*a, **kw))
    for name in ("window_backward", "selection_backward_adding", "compressed_backward"):
        branch = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, branch=branch, name=name, **kw: deltas.append(
            (name, kw.get("delta") is not None)) or branch(*a, **kw))
    with routing.force(selection_attention="triton", sliding_window_attention=window_impl,
                       compressed_attention="triton"):
        for case in (CASES[0], CASES[2], CASES[3], CASES[4]):
            _, grads, _ = _layer(monkeypatch, True, *case)
            _, grads_ops, _ = _layer(monkeypatch, False, *case)
            # P takes the gate where the ops' path rounds g * dO first
            _assert_grads_match(grads, grads_ops, atol=1e-5, rtol=1e-4)
    # the layer's (compressed, selection, window), then the gate op's
    assert calls == [(False, False, window_impl != "triton"), None] * 4
    # the layer's branches that take the gate take the gate backward's row sums as their
    # delta; the ops' backward (the comparison) takes none
    gated_window = window_impl == "triton"
    assert collections.Counter(deltas) == collections.Counter(
        {("selection_backward_adding", True): 4, ("selection_backward_adding", False): 4,
         ("compressed_backward", True): 4, ("compressed_backward", False): 4,
         ("window_backward", True): 4 * gated_window,
         ("window_backward", False): 8 - 4 * gated_window})
    q, k, v = qkv(1, 64, 4, 2, 16, 16)
    gate = gates(1, 64, 4)[0]
    with routing.force(sliding_window_attention="reference"), \
            pytest.raises(ValueError, match="do_gate: the reference backward of "
                                            "nsa.sliding_window_attention takes no gate"):
        ops.window_backward(q, k, v, q, gate, q, None, 16, 0.25, do_gate=gate)


def test_eager_gates_of_a_wider_dtype(monkeypatch):
    """fp32 gates over fp16 branches make the layer's output, and so its dO, fp32: the gate
    op combines (the epilogue keeps q's dtype only), and the Triton window and selection
    backward, which take dO and the gate, get dO in their branch's dtype, as the gate's
    backward gave it; the same gradients as through the ops."""
    pytest.importorskip("triton")
    results = {}
    with routing.force(selection_attention="triton", sliding_window_attention="triton"):
        for eager in (True, False):
            monkeypatch.setenv("NSA_OPS_EAGER_LAYER", "1" if eager else "0")
            q, k, v = qkv(1, 64, 4, 2, 16, 16, torch.float16, requires_grad=True, seed=3)
            g = [x.requires_grad_() for x in gates(1, 64, 4, seed=4)]
            o = nsa_ops.nsa_attention(q, k, v, *g, window=16, **SMALL)
            assert o.dtype == torch.float32
            o.backward(torch.randn(o.shape, generator=torch.Generator().manual_seed(6)))
            results[eager] = [q.grad, k.grad, v.grad, *(x.grad for x in g)]
    _assert_grads_match(results[True], results[False], atol=2e-3, rtol=2e-3)


def test_pool_backward_matches_autograd():
    """reference.compress_mean_backward, which the eager backward uses for fixed-length mean
    pooling with d | l, against autograd through compress_mean (T short of a block, ragged
    ends, l = d, l = 3d), returned and added into a gradient so far."""
    for T, l, d in [(100, 32, 16), (64, 16, 16), (10, 32, 16), (97, 24, 8), (50, 16, 4)]:
        x = torch.randn(2, T, 3, 5, dtype=torch.float64, requires_grad=True)
        y = R.compress_mean(x, l, d)
        g = torch.randn(y.shape, dtype=torch.float64)
        want, = torch.autograd.grad(y, x, g)
        torch.testing.assert_close(R.compress_mean_backward(g, T, l, d), want)
        so_far = torch.randn(x.shape, dtype=torch.float64)
        out = so_far.clone()
        assert R.compress_mean_backward(g, T, l, d, out=out) is out
        torch.testing.assert_close(out, so_far + want)
    assert R.compress_mean_backward(g, 50, 20, 8) is None  # d does not divide l: autograd's


@pytest.mark.parametrize("lengths", [None, (30, 42)])
def test_eager_layer_backward_twice(monkeypatch, lengths):
    """backward(retain_graph=True) then backward again adds the same gradients once more, as
    through the ops (packed sequences take mean pooling's backward from autograd)."""
    grads = {}
    for eager in (True, False):
        monkeypatch.setenv("NSA_OPS_EAGER_LAYER", "1" if eager else "0")
        q, k, v = qkv(1, 72, 4, 2, 16, 16, requires_grad=True, seed=3)
        kw = dict(SMALL, window=16)
        if lengths is not None:
            kw["cu_seqlens"] = cu_seqlens(lengths)
        o = nsa_ops.nsa_attention(q, k, v, *gates(1, 72, 4), **kw)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(6))
        o.backward(do, retain_graph=True)
        once = [x.grad.clone() for x in (q, k, v)]
        o.backward(do)
        for a, b in zip(once, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(b, 2 * a)
        grads[eager] = once
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
