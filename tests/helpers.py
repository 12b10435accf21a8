"""Shared input builders for the tests: random data, fixed seeds, never zeros."""
from __future__ import annotations

import contextlib

import torch

from nsa_ops import reference

# Small NSA geometry that keeps every branch non-trivial at T ~ 50-100: l=16, d=8, l'=16.
SMALL = dict(block_len=16, block_stride=8, sel_block=16, num_sel=3)

# Per-dtype tolerances (atol, rtol) for comparisons against the reference.
TOL = {torch.float64: (1e-10, 1e-8), torch.float32: (2e-5, 1e-4),
       torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}


def qkv(B, T, HQ, H, Dk, Dv, dtype=torch.float32, seed=0, requires_grad=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    q, k, v = mk(B, T, HQ, Dk), mk(B, T, H, Dk), mk(B, T, H, Dv)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def gates(B, T, HQ, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(B, T, HQ, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


def cu_seqlens(lengths, device="cpu"):
    lens = torch.tensor([0] + list(lengths))
    return lens.cumsum(0).to(dtype=torch.int32, device=device)


def compressed(k, v, geo, cu=None):
    return (reference.compress_mean(k, geo["block_len"], geo["block_stride"], cu),
            reference.compress_mean(v, geo["block_len"], geo["block_stride"], cu))


def selection_for(q, k, v, geo, cu=None):
    """A realistic block_idx: what the reference NSA selects for these inputs."""
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        k_cmp, v_cmp = compressed(k, v, geo, cu)
        _, lse = reference.compressed_attention(q, k_cmp, v_cmp, geo["block_len"],
                                                geo["block_stride"], scale, cu)
        return reference.select_blocks(q, k_cmp, lse, geo["block_len"], geo["block_stride"],
                                       geo["sel_block"], geo["num_sel"], scale, cu)


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty / empty_like return NaN (floats) or -7 (ints): whatever a kernel leaves
    unwritten, in outputs or scratch, cannot pass as zeros."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(x):
        return x.fill_(float("nan") if x.is_floating_point() else -7)
    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def rel_err(got, want):
    """Relative Frobenius error ||got - want|| / ||want||, in float32."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
