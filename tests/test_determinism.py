"""Deterministic backward: under torch.use_deterministic_algorithms(True) a backward run twice on the
same inputs gives bitwise equal gradients, on every CUDA route the spec geometry takes (the CPU
interpreter runs programs one after another, so only the GPU can tell)."""
import pytest
import torch

import nsa_ops
from nsa_ops import reference as R

T, HQ, H, Dh, L, D, LP, N, W = 16384, 64, 4, 128, 32, 16, 64, 16, 512


def _inputs():
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, T, HQ, Dh, **bf16)
    k, v = torch.randn(1, T, H, Dh, **bf16), torch.randn(1, T, H, Dh, **bf16)
    gates = torch.rand(3, 1, T, HQ, **bf16)
    return q, k, v, gates


def _calls(q, k, v):
    """op name -> a function of (q, k, v, gates). Compressed attention runs the Triton kernel, its
    dk/dv splits adding in order (routing refuses cuDNN in this mode at any length: its backward
    differed bitwise between runs). The window takes FA-2, or the forced Triton kernel."""
    scale, nsa = Dh ** -0.5, torch.ops.nsa
    k_cmp, v_cmp = R.compress_mean(k, L, D), R.compress_mean(v, L, D)
    _, lse = nsa.compressed_attention(q, k_cmp, v_cmp, L, D, scale)
    idx = nsa.select_blocks(q, k_cmp, lse, L, D, LP, N, scale)
    def compressed(q, k, v, g):
        return nsa.compressed_attention(q, R.compress_mean(k, L, D), R.compress_mean(v, L, D), L,
                                        D, scale)[0]

    def forced(call, **impls):
        """call with routing.force(**impls): its backward routes as its forward did."""
        def run(*args):
            with nsa_ops.routing.force(**impls):
                return call(*args)
        return run

    window = lambda q, k, v, g: nsa.sliding_window_attention(q, k, v, W, scale)[0]  # noqa: E731
    return {
        "compressed": compressed,
        "selection": lambda q, k, v, g: nsa.selection_attention(q, k, v, idx, LP, scale)[0],
        "window": window,
        "window_triton": forced(window, sliding_window_attention="triton"),
        "nsa_attention": lambda q, k, v, g: nsa_ops.nsa_attention(q, k, v, *g),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["compressed", "selection", "window", "window_triton",
                                "nsa_attention"])
def test_gpu_backward_is_bitwise_reproducible(op, deterministic):
    q, k, v, gates = _inputs()
    call = _calls(q, k, v)[op]
    do = torch.randn(1, T, HQ, Dh, device="cuda", dtype=torch.bfloat16)

    def grads():
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, gates)]
        out = call(*leaves)
        return torch.autograd.grad(out, leaves, do, allow_unused=True)

    first, second = grads(), grads()
    for name, a, b in zip(("dq", "dk", "dv", "dgates"), first, second):
        if a is None:
            continue
        assert torch.equal(a, b), f"{op} {name}: {(a != b).sum().item()} entries differ"
