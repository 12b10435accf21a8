"""The selection backward's inverse index as Triton kernels: `reference.selection_index` (the
oracle, bit for bit), in four launches around one stable sort instead of some 40 torch ops.

Each op cost the host 10-40 us to enqueue, about 1.5 ms of an 8k layer step whose host time (8.0
ms) matched its GPU time on an H100 machine (so the synced step waited on the host), and the
side stream ran their passes over the [E] entry arrays beside the window and compressed
backward. Here a block is keyed by (b * H + h) * NBK + first_key // l' + sequence: dense (NBK =
Tk // l' + sequences + 1 a head: 4104 keys at 64k tokens and 4 heads, against the oracle's B * H *
Tk) and in the oracle's order, as a block's first packed key is below the next sequence's, so the
sort and the entry arrays come out the same, and bounds, chunk bases and chunks are per-key
passes rather than searches over every packed key.

1. `_keys_kernel`: each (b, t, h, slot) entry's key (NUM_KEYS where no query reads it);
2. a stable torch.sort of the keys (order: the entries' flat (b, t, h, slot) index);
3. `_bounds_kernel`: each key's first and end entry, from the sorted keys' edges;
4. `_chunk_base_kernel`: one program, each key's first chunk (a running sum of its chunk count);
5. `_entries_kernel`: ent_tok / ent_pos / ent_slot of each sorted entry, and the chunk rows its
   chunk-starting entries write; with token_major the chunks' ranks, then a stable argsort.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_ops.kernels.utils import cdiv, launch, pow2

_TOKENS = 16  # query tokens a `_keys_kernel` program takes at most (rows of H * n entries)
_KEY_ENTRIES = 4096  # entries a `_keys_kernel` program holds at most (many heads x slots)
_ENTRIES = 1024  # sorted entries a `_bounds_kernel` / `_entries_kernel` program takes
_KEYS = 1024  # keys a `_chunk_base_kernel` step sums
# sort keys and chunk ranks up to this sort as int32: their stable sorts then take 4 radix
# passes, not 8
_SORT32_MAX = 2 ** 31 - 1


@triton.jit
def _query_keys(t, cu_q, cu_k, NSEQ, SEARCH_STEPS, IS_VARLEN: tl.constexpr, OFF):
    """Vector t (int64 query tokens) -> (sequence, its first packed key, the packed key t sits
    at): for fixed length (0, 0, t + OFF); packed, a binary search over cu_q's NSEQ + 1 offsets
    in SEARCH_STEPS steps (bottom-right aligned queries, as `reference.query_keys`)."""
    if IS_VARLEN:
        lo = tl.zeros(t.shape, tl.int32)
        hi = tl.zeros(t.shape, tl.int32) + NSEQ
        # invariant cu_q[lo] <= t < cu_q[hi]; an empty sequence never holds t
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            right = tl.load(cu_q + mid).to(tl.int64) <= t
            live = hi - lo > 1
            lo = tl.where(live & right, mid, lo)
            hi = tl.where(live & ~right, mid, hi)
        start = tl.load(cu_k + lo).to(tl.int64)
        last = tl.load(cu_k + lo + 1).to(tl.int64) - tl.load(cu_q + lo + 1).to(tl.int64) + t
        return lo.to(tl.int64), start, last
    zero = tl.zeros(t.shape, tl.int64)
    return zero, zero, t + OFF


@triton.jit
def _keys_kernel(bidx, keys, cu_q, cu_k, NSEQ, SEARCH_STEPS, OFF, sb, T, NBK, NUM_KEYS,
                 H: tl.constexpr, N: tl.constexpr, HNP: tl.constexpr, SEL: tl.constexpr,
                 TOKENS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """keys[(b, t, h, slot)] = (b * H + h) * NBK + first key // SEL + sequence where query t may
    read the block that slot names, else NUM_KEYS."""
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    cols = tl.arange(0, HNP)  # h * N + slot
    inside = (t < T)[:, None] & (cols < H * N)[None, :]
    flat = t[:, None] * (H * N) + cols[None, :]
    idx = tl.load(bidx + b * sb + flat, mask=inside, other=-1).to(tl.int64)
    seq, start, last = _query_keys(t, cu_q, cu_k, NSEQ, SEARCH_STEPS, IS_VARLEN, OFF)
    first = start[:, None] + idx * SEL
    valid = inside & (idx >= 0) & (first <= last[:, None])
    bh = b * H + cols // N
    key = tl.where(valid, bh[None, :] * NBK + first // SEL + seq[:, None], NUM_KEYS)
    tl.store(keys + b * T * (H * N) + flat, key.to(keys.dtype.element_ty), mask=inside)


@triton.jit
def _bounds_kernel(keys, bounds, E, NUM_KEYS, ENTRIES: tl.constexpr):
    """bounds[0, key] / bounds[1, key] = the first / end sorted entry of each key present (the
    others stay 0)."""
    e = tl.program_id(0).to(tl.int64) * ENTRIES + tl.arange(0, ENTRIES)
    inside = e < E
    key = tl.load(keys + e, mask=inside, other=NUM_KEYS).to(tl.int64)
    prev = tl.load(keys + e - 1, mask=inside & (e > 0), other=-1).to(tl.int64)
    succ = tl.load(keys + e + 1, mask=e + 1 < E, other=-1).to(tl.int64)
    live = key < NUM_KEYS
    tl.store(bounds + key, e, mask=live & (key != prev))
    tl.store(bounds + NUM_KEYS + key, e + 1, mask=live & (key != succ))


@triton.jit
def _chunk_base_kernel(bounds, base, NUM_KEYS, C, KEYS: tl.constexpr):
    """base[key] = the chunks of the keys before it, ceil(entries / C) each (one program)."""
    carry = tl.zeros([], tl.int64)
    for k0 in range(0, NUM_KEYS, KEYS):
        key = k0 + tl.arange(0, KEYS)
        inside = key < NUM_KEYS
        count = tl.load(bounds + NUM_KEYS + key, mask=inside, other=0) - \
            tl.load(bounds + key, mask=inside, other=0)
        chunks = (count + C - 1) // C
        tl.store(base + key, carry + tl.cumsum(chunks, 0) - chunks, mask=inside)
        carry += tl.sum(chunks, 0)


@triton.jit
def _entries_kernel(keys, order, bidx, bounds, base, ent_tok, ent_pos, ent_slot, chunks, rank,
                    cu_q, cu_k, NSEQ, SEARCH_STEPS, OFF, sb, T, TK, E, NUM_KEYS, C,
                    H: tl.constexpr, N: tl.constexpr, SEL: tl.constexpr,
                    ENTRIES: tl.constexpr, IS_VARLEN: tl.constexpr, WITH_SLOTS: tl.constexpr,
                    TOKEN_MAJOR: tl.constexpr):
    """The sorted entries' ent_tok (-1 for a row's repeat of a block) / ent_pos / ent_slot, and
    for each entry that starts a chunk (every C-th of its key) the chunk's row (first entry, end
    entry, b * H + h, the block's first packed key) and, token_major, its rank (b * H + h) *
    (TK + 1) + the key position of its first query."""
    e = tl.program_id(0).to(tl.int64) * ENTRIES + tl.arange(0, ENTRIES)
    inside = e < E
    key = tl.load(keys + e, mask=inside, other=NUM_KEYS).to(tl.int64)
    at = tl.load(order + e, mask=inside, other=0)
    has_prev = inside & (e > 0)
    prev_key = tl.load(keys + e - 1, mask=has_prev, other=-1).to(tl.int64)
    prev_row = tl.load(order + e - 1, mask=has_prev, other=0) // N
    row = at // N
    repeat = has_prev & (key == prev_key) & (row == prev_row)
    t = row // H % T
    seq, start, last = _query_keys(t, cu_q, cu_k, NSEQ, SEARCH_STEPS, IS_VARLEN, OFF)
    tl.store(ent_tok + e, tl.where(repeat, -1, t).to(tl.int32), mask=inside)
    tl.store(ent_pos + e, last.to(tl.int32), mask=inside)
    if WITH_SLOTS:
        tl.store(ent_slot + e, (at % N).to(tl.int32), mask=inside)

    live = inside & (key < NUM_KEYS)
    first = tl.load(bounds + key, mask=live, other=0)
    end = tl.load(bounds + NUM_KEYS + key, mask=live, other=0)
    starts = live & ((e - first) % C == 0)
    chunk = tl.load(base + key, mask=starts, other=0) + (e - first) // C
    b = row // (T * H)
    bh = b * H + row % H
    block = tl.load(bidx + b * sb + at % (T * H * N), mask=starts, other=0).to(tl.int64)
    tl.store(chunks + chunk * 4, e, mask=starts)
    tl.store(chunks + chunk * 4 + 1, tl.minimum(e + C, end), mask=starts)
    tl.store(chunks + chunk * 4 + 2, bh, mask=starts)
    tl.store(chunks + chunk * 4 + 3, start + block * SEL, mask=starts)
    if TOKEN_MAJOR:
        tl.store(rank + chunk, (bh * (TK + 1) + last).to(rank.dtype.element_ty), mask=starts)


def selection_index(block_idx: Tensor, sel_block: int, Tk: int, cu_seqlens: Optional[Tensor],
                    cu_seqlens_k: Optional[Tensor], queries_per_chunk: int, token_major: bool,
                    with_slots: bool) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """`reference.selection_index` (arguments and results alike) on the GPU, or on the CPU under
    the Triton interpreter; no host sync, CUDA-graph capturable. block_idx int32 [B, T, H, n]
    with its (t, h, slot) dims dense (a window of query rows of a contiguous block_idx is)."""
    B, T, H, n = block_idx.shape
    if block_idx.dtype != torch.int32 or block_idx.stride()[1:] != (H * n, n, 1):
        raise ValueError(f"block_idx must be int32 with dense (t, h, slot) dims, got "
                         f"{block_idx.dtype} with strides {block_idx.stride()}")
    device = block_idx.device
    varlen = cu_seqlens is not None
    num_seq = cu_seqlens.numel() - 1 if varlen else 1
    cu_q = cu_seqlens if varlen else block_idx
    cu_k = (cu_seqlens if cu_seqlens_k is None else cu_seqlens_k) if varlen else block_idx
    seq_args = (cu_q, cu_k, num_seq, num_seq.bit_length(), Tk - T)
    nbk = Tk // sel_block + num_seq + 1  # keys a (b, h): first key // l' + sequence < nbk
    num_keys = B * H * nbk
    E = block_idx.numel()
    C = queries_per_chunk
    # sum of ceil(count / C) <= E / C + (number of distinct blocks); blocks per (b, h) are at most
    # Tk // l' + (number of sequences)
    P = max(1, -(-E // C) + min(E, B * H * (Tk // sel_block + num_seq)))
    chunks = torch.zeros(P, 4, dtype=torch.int64, device=device)
    if E == 0:
        empty = torch.empty(0, dtype=torch.int32, device=device)
        return empty, empty, empty if with_slots else None, chunks
    key_dtype = torch.int32 if num_keys < _SORT32_MAX else torch.int64
    keys = torch.empty(E, dtype=key_dtype, device=device)
    hnp = pow2(H * n)
    tokens = max(1, min(_TOKENS, _KEY_ENTRIES // hnp))
    launch(_keys_kernel)[(cdiv(T, tokens), B)](
        block_idx, keys, *seq_args, block_idx.stride(0), T, nbk, num_keys, H=H, N=n, HNP=hnp,
        SEL=sel_block, TOKENS=tokens, IS_VARLEN=varlen, num_warps=4)
    keys, order = torch.sort(keys, stable=True)  # unread entries (num_keys) go last

    entry_grid = (max(1, cdiv(E, _ENTRIES)),)
    bounds = torch.zeros(2, num_keys, dtype=torch.int64, device=device)
    launch(_bounds_kernel)[entry_grid](keys, bounds, E, num_keys, ENTRIES=_ENTRIES, num_warps=4)
    base = torch.empty(num_keys, dtype=torch.int64, device=device)
    launch(_chunk_base_kernel)[(1,)](bounds, base, num_keys, C, KEYS=_KEYS, num_warps=4)

    ent_tok = torch.empty(E, dtype=torch.int32, device=device)
    ent_pos = torch.empty(E, dtype=torch.int32, device=device)
    ent_slot = torch.empty(E, dtype=torch.int32, device=device) if with_slots else None
    last_rank = B * H * (Tk + 1)
    rank_dtype = torch.int32 if last_rank <= _SORT32_MAX else torch.int64
    rank = torch.full((P,), last_rank, dtype=rank_dtype, device=device) if token_major \
        else chunks
    launch(_entries_kernel)[entry_grid](
        keys, order, block_idx, bounds, base, ent_tok, ent_pos,
        ent_tok if ent_slot is None else ent_slot, chunks, rank, *seq_args,
        block_idx.stride(0), T, Tk, E, num_keys, C, H=H, N=n, SEL=sel_block, ENTRIES=_ENTRIES,
        IS_VARLEN=varlen, WITH_SLOTS=with_slots, TOKEN_MAJOR=token_major, num_warps=4)
    if token_major:
        chunks = chunks.index_select(0, torch.argsort(rank, stable=True))
    return ent_tok, ent_pos, ent_slot, chunks
