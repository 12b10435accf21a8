"""Context-parallel NSA attention over a torch.distributed process group.

The sequence is cut into 2 * world chunks; rank r holds chunks r and 2 * world - 1 - r (zigzag),
so every rank has an early and a late chunk and causal work is balanced. Each rank all-gathers
K/V (NSA's selection is global: any query may pick any earlier block, so ring passing does not
fit, and Ulysses is capped by the few KV heads), then runs its two query chunks through
`nsa_attention` with the queries at the end of the keys up to the chunk's end (the ops at an
offset), compressed K/V computed from those keys. The backward sums each rank's dK/dV
contributions and hands every rank the gradient of its own tokens: reduce-scatter on NCCL,
all-reduce then slice on backends without reduce-scatter (gloo).

Fixed-length batches only ([B, T, ...] with T divisible by 2 * world); the output and the
gradients equal the single-device `nsa_attention` on the unsharded tensors.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .functional import nsa_attention


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _chunk_bounds(T: int, world: int, rank: int) -> list[tuple[int, int]]:
    if T % (2 * world):
        raise ValueError(f"the sequence length T={T} must be divisible by 2 * world size "
                         f"({2 * world}) for the zigzag split")
    c = T // (2 * world)
    return [(rank * c, (rank + 1) * c), ((2 * world - 1 - rank) * c, (2 * world - rank) * c)]


def shard(x: Tensor, group=None, dim: int = 1) -> Tensor:
    """This rank's zigzag share of x along dim (the token dimension): chunks r and 2W-1-r."""
    world, rank = _world(group)
    return torch.cat([x.narrow(dim, a, b - a) for a, b in _chunk_bounds(x.shape[dim], world, rank)],
                     dim)


def _rank_major_order(T: int, world: int, device) -> Tensor:
    """Token indices in the order the all-gather returns them (rank 0's two chunks first)."""
    return torch.cat([torch.arange(a, b, device=device) for r in range(world)
                      for a, b in _chunk_bounds(T, world, r)])


def _all_gather(x: Tensor, group, world: int) -> Tensor:
    """Shards [B, t, ...] of every rank, rank-major along dim 1."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, 1)


class _GatherTokens(torch.autograd.Function):
    """All-gather of zigzag shards into the full sequence; the backward sums the ranks' grads of
    the full sequence and returns each rank its own tokens' share."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        world, _ = _world(group)
        ctx.group, ctx.local = group, x.shape[1]
        full = _all_gather(x, group, world)
        order = _rank_major_order(full.shape[1], world, x.device)
        out = torch.empty_like(full)
        out[:, order] = full
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        world, rank = _world(ctx.group)
        order = _rank_major_order(grad.shape[1], world, grad.device)
        rank_major = grad[:, order]  # [B, world * local, ...]
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            # tokens first, so each rank's share is one contiguous slab of the buffer
            slabs = rank_major.transpose(0, 1).contiguous()
            mine = slabs.new_empty(slabs.shape[0] // world, *slabs.shape[1:])
            dist.reduce_scatter_tensor(mine, slabs, group=ctx.group)
            return mine.transpose(0, 1), None
        summed = rank_major.contiguous()
        dist.all_reduce(summed, group=ctx.group)
        return summed[:, rank * ctx.local:(rank + 1) * ctx.local], None


def gather_tokens(x: Tensor, group=None) -> Tensor:
    """The full sequence [B, T, ...] from every rank's zigzag shard (differentiable)."""
    return _GatherTokens.apply(x, group)


def context_parallel_nsa_attention(q: Tensor, k: Tensor, v: Tensor, g_cmp: Tensor, g_slc: Tensor,
                                   g_win: Optional[Tensor], *, group=None,
                                   **nsa_kwargs) -> Tensor:
    """NSA of this rank's zigzag shard: q, k, v, gates [B, T / world, ...] as `shard` cuts them;
    returns o [B, T / world, HQ, Dv] for the same tokens. nsa_kwargs: nsa_attention's geometry
    (block_len, block_stride, sel_block, num_sel, window, phi, scale); no cu_seqlens."""
    if "cu_seqlens" in nsa_kwargs or "block_idx" in nsa_kwargs:
        raise ValueError("context_parallel_nsa_attention takes fixed-length shards: no "
                         "cu_seqlens or block_idx")
    world, rank = _world(group)
    k_full, v_full = gather_tokens(k, group), gather_tokens(v, group)
    bounds = _chunk_bounds(k_full.shape[1], world, rank)
    outs, start = [], 0
    for a, b in bounds:
        local = slice(start, start + b - a)
        start += b - a
        gates = [None if g is None else g[:, local] for g in (g_cmp, g_slc, g_win)]
        # the chunk's queries sit at the end of keys 0 .. b
        outs.append(nsa_attention(q[:, local], k_full[:, :b], v_full[:, :b], *gates,
                                  **nsa_kwargs))
    return torch.cat(outs, 1)
