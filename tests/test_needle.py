"""Needle in a haystack: the selection branch must pick the block holding a planted key.

One key (the needle) at position p points along u; the last queries point along u too. Its
compressed blocks then dominate p_cmp, Eq.9/10 carry that to the selection block p // l', and
top-n must pick it against ~T/l' random competitors; selection attention then returns ~v[p].
CPU runs a 4k haystack through the reference path; `-m gpu` runs 64k through the kernels.
"""
import pytest
import torch

import nsa_ops  # noqa: F401  (registers torch.ops.nsa)
from nsa_ops import reference

L, D_STRIDE, LP, N = 32, 16, 64, 16


def plant_needle(T, device, dtype, HQ=8, H=2, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, HQ, D, generator=g)
    k = torch.randn(1, T, H, D, generator=g)
    v = torch.randn(1, T, H, D, generator=g)
    u = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    p = T // 3 + 5  # deep in the past, not near a block edge, far from the local blocks
    k[0, p] = 64 * u
    v[0, p] = 10 * torch.nn.functional.normalize(torch.randn(H, D, generator=g), dim=-1)
    q[0, -8:] = 40 * u  # the last 8 queries, every head, ask for the needle
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], p


def find_needle(T, device, dtype):
    (q, k, v), p = plant_needle(T, device, dtype)
    scale = q.shape[-1] ** -0.5
    k_cmp = reference.compress_mean(k, L, D_STRIDE)
    v_cmp = reference.compress_mean(v, L, D_STRIDE)
    _, lse = torch.ops.nsa.compressed_attention(q, k_cmp, v_cmp, L, D_STRIDE, scale)
    block_idx = torch.ops.nsa.select_blocks(q, k_cmp, lse, L, D_STRIDE, LP, N, scale)
    o, _ = torch.ops.nsa.selection_attention(q, k, v, block_idx, LP, scale)
    last = block_idx[0, -8:]  # [8, H, n]
    assert bool((last == p // LP).any(-1).all()), \
        f"needle block {p // LP} missing from the selection of the last queries: {last[0]}"
    G = q.shape[2] // k.shape[2]
    want = v[0, p].repeat_interleave(G, 0).float()  # [HQ, D]
    cos = torch.nn.functional.cosine_similarity(o[0, -8:].float(), want[None], dim=-1)
    assert bool((cos > 0.99).all()), f"selection output does not retrieve v[needle]: {cos.min()}"
    # a query that did not ask for the needle is not forced onto it
    assert not bool((block_idx[0, T // 2 + 100] == p // LP).all())


def test_needle_cpu_4k():
    find_needle(4096, "cpu", torch.float32)


@pytest.mark.gpu
def test_needle_gpu_64k():
    find_needle(65536, "cuda", torch.bfloat16)
