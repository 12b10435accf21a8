"""Selected-block attention (NSA-SPEC "Selected attention") as Triton kernels, forward and backward.

Query t attends the tokens of its selected blocks (block_idx [B,T,H,n], local to the token's
sequence), clamped causally. A row is a set: slots may come in any order, -1 (empty) anywhere, and a
block named twice counts once, as in `nsa_ops.reference.selection_attention` /
`selection_attention_backward`, the oracle.

Forward and dq are group-centric: one program per (query token, batch * KV head) holds the G query
heads of the group as one [GP, D] tile (GP >= 16 so tl.dot has M >= 16) and walks the token's
selected blocks, so each K/V block is read once per group rather than once per query head.
Blocks that neighbouring queries share would still be read once per query: block 0 and the two
local blocks, which NSA forces on every query, and in trained models most of the rest, since
neighbouring tokens select alike. Where the forward reads K/V through TMA (sm90+, fixed length) a
shared pass first attends, for groups of consecutive queries, the blocks all of the group's
queries selected, as one tile (`_shared_fwd_kernel`, its lists from `_shared_plan_kernel`), and
the per-token walk takes only each query's other blocks and merges that pass's output last (the
merge rounds it to o's dtype once more). H100, bf16, spec geometry, T = 64k: forced blocks
alone shared, 16.69 -> 15.43 ms (the walk 13.70 of it); every block the group shares, random
selections 15.37-15.43 -> 15.61-15.65 ms, runs of 64 tokens selecting alike 13.29-13.60 ->
8.17-8.30, the same with 5% / 20% of their blocks replaced at random 13.33-13.53 -> 9.40-9.54 /
13.61-13.63 -> 11.72-11.79.

dq does the same where a group of queries shares at least SHARED_DQ_MIN blocks before its own
(`_dq_plan_kernel`, `_shared_dq_kernel`): H100, 64k, whole selection backward, runs of 64 tokens
selecting alike 31.67-35.26 -> 24.56-26.74 ms, random selections 33.51-33.61 -> 33.02-34.37.

dk/dv are key-centric: each K/V block must sum over every query that selected it, and block 0 and
the local blocks are selected by (nearly) every query. Atomics from the per-token programs would add
n * l' * (Dk + Dv) values per (token, KV head) with heavy contention on block 0, so instead an
inverse index (`kernels/index.py`: built on device around one torch.sort, no host sync) lists, per
(batch, KV head, block), the queries that picked it, cut into chunks of about ROWS_PER_CHUNK query
rows. One program per (chunk, key tile) recomputes P and dS for its rows with [BM, BN] tiles and
atomically adds its partial dk/dv into fp32 buffers; only blocks spanning several chunks contend.
Under torch.use_deterministic_algorithms(True) the chunks of a block add in chunk order instead
(kernels/ordered.py), so gradients are bitwise reproducible.

dq can instead come after dk/dv, from the dS the dK dV pass works out anyway and stores
(`_dq_ds_kernel`, `_stored_ds`: the default, on a GPU without an index started early from
STORED_DS_MIN_TOKENS query tokens; where the buffer would pass its budget, over windows of
queries, `_ds_window`; packed sequences whose whole buffer does not fit work dq out again): each
(query, block) then gathers K alone, with one dot, where `_dq_kernel` gathers K and V and works P
and dS out again.
H100, bf16, spec geometry, whole selection backward, three interleaved rounds, recomputed ->
stored: random selections at 8k / 16k / 64k 3.74-3.75 / 7.74-8.06 / 34.02-34.04 -> 3.64-3.65 /
7.10-7.13 / 29.88-30.16 ms; runs of 64 tokens selecting alike 2.84-2.85 / 5.84-6.00 /
24.84-25.15 -> 3.20 / 6.22-6.35 / 25.70-26.01 (dq's shared pass already served most of their
blocks; a pass of its own for delta, and the index, which hid behind the dq kernel, now runs
before dK dV: the eager layer starts it early, `backward_index`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_ops.kernels import ordered
from nsa_ops.kernels.delta import row_delta
from nsa_ops.kernels.gate import gated_rows, gated_rows_args
from nsa_ops.kernels.index import selection_index
from nsa_ops.kernels.softmax import LOG2E, attend_tile, finish
from nsa_ops.kernels.utils import (cdiv, cuda_core_dots, dot_precision, given_delta, launch,
                                   launch_options, pow2, tma_descriptors, tma_kv_reason, traced,
                                   unit_last_stride, unscaled_do_gate, use_tma)

# Query rows (tokens x heads of a group) per dk/dv program: large enough that the chunks of a block
# selected by every query rarely contend on the atomics, small enough to keep the grid balanced.
# H100, spec geometry, random selection, whole selection backward at 16k / 64k (.gpu-style
# sweep, chunks in block order): 512 rows 8.61 / 36.26 ms, 1024 8.29 / 36.25, 2048 8.13 / 34.36,
# 4096 8.17 / 34.38, 8192 8.19 / 35.04, 32768 8.61 / 34.06. With chunks in token order (three
# rounds, random / coherent at 64k): 1024 34.55-34.79 / 33.27-33.44, 2048 34.40-34.50 /
# 33.08-33.22, 3072-6144 34.44-34.58 / 33.30-33.68, 16384 35.00-35.11 / 34.36-34.45 ms.
ROWS_PER_CHUNK = 2048


# --------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------

@triton.jit
def _load_tile(ptr, row_off, row_mask, D: tl.constexpr, DP: tl.constexpr):
    """[rows, DP] tile, row i at ptr + row_off[i]; zero outside row_mask and in columns >= D."""
    cols = tl.arange(0, DP)
    mask = row_mask[:, None] & (cols[None, :] < D)
    return tl.load(ptr + row_off[:, None] + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _load_tile_t(ptr, row_off, row_mask, D: tl.constexpr, DP: tl.constexpr):
    """`_load_tile` transposed, [DP, rows], loaded as such: a tile transposed after its load
    reaches a dot through registers and shared memory, where this one's loads stay async copies
    into the dot's operand."""
    cols = tl.arange(0, DP)
    mask = row_mask[None, :] & (cols[:, None] < D)
    return tl.load(ptr + row_off[None, :] + cols[:, None], mask=mask, other=0.0)


@triton.jit
def _store_tile(ptr, row_off, row_mask, x, D: tl.constexpr, DP: tl.constexpr):
    cols = tl.arange(0, DP)
    mask = row_mask[:, None] & (cols[None, :] < D)
    tl.store(ptr + row_off[:, None] + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lse_log2(lse):
    """lse in base 2; rows that saw nothing (-inf) get +inf so exp2(s - lse) is 0, never NaN."""
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _query_keys(cu_q, cu_k, NSEQ, t):
    """In-kernel `reference.query_keys` for packed sequences: (the first packed key of query t's
    sequence, the packed key t sits at), found by binary search over cu_q's NSEQ + 1 offsets, so
    callers (the Inductor template too) need no per-query arrays built on the host side."""
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + NSEQ
    # invariant cu_q[lo] <= t < cu_q[hi]; an empty sequence never holds t
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = tl.load(cu_q + mid).to(tl.int64) <= t
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    # bottom-right alignment: the sequence's last query sits at its last key
    last = tl.load(cu_k + lo + 1).to(tl.int64) - tl.load(cu_q + lo + 1).to(tl.int64) + t
    return tl.load(cu_k + lo).to(tl.int64), last


@triton.jit
def _group_rows(bidx, b, h, base, OFF, T, N, H: tl.constexpr, TT: tl.constexpr,
                NP: tl.constexpr):
    """(rows, real, toks): the block_idx rows [TT, NP] of the group of TT queries toks at key
    positions base .. base + TT - 1 (fixed length), -1 past slot N and for the group's queries
    outside [0, T), which real [TT] marks."""
    toks = base - OFF + tl.arange(0, TT)
    real = (toks >= 0) & (toks < T)
    slots = tl.arange(0, NP)
    rows = tl.load(bidx + (((b * T + toks) * H + h) * N)[:, None] + slots[None, :],
                   mask=real[:, None] & (slots[None, :] < N), other=-1)
    return rows, real, toks


@triton.jit
def _shared_by_group(blk, rows, real, c):
    """Which of the blocks blk [NP] the shared pass (`_shared_fwd_kernel`) attends for the group
    of `_group_rows` (rows, real), whose queries share selection block c (TT divides l'): the
    blocks up to c that every query of the group selected, so that no query sees a block it did
    not pick. NSA's forced blocks (0 and the two local ones) always qualify; where neighbouring
    queries select alike, as trained models' do, the rest of their blocks do too."""
    picked = tl.max((blk[:, None, None] == rows[None, :, :]).to(tl.int32), axis=2)
    every = tl.min(tl.where(real[None, :], picked, 1), axis=1) > 0
    return every & (blk >= 0) & (blk <= c)


@triton.jit
def _distinct(rows):
    """rows [R, NP] of block_idx: where a slot holds a block (>= 0) that no earlier slot of its
    row names."""
    slots = tl.arange(0, rows.shape[1])
    repeat = tl.max(((rows[:, :, None] == rows[:, None, :])
                     & (slots[None, None, :] < slots[None, :, None])).to(tl.int32), axis=2) > 0
    return (rows >= 0) & ~repeat


@triton.jit
def _compact(blk, keep):
    """The blocks blk [R, NP] where keep, in slot order, moved to the front of their rows:
    ([R, NP] blocks, 0 past each row's count; [R] counts)."""
    slots = tl.arange(0, blk.shape[1])
    at = tl.cumsum(keep.to(tl.int32), axis=1) - 1
    front = tl.sum(tl.where(keep[:, :, None] & (at[:, :, None] == slots[None, None, :]),
                            blk[:, :, None], 0), axis=1)
    return front, tl.sum(keep.to(tl.int32), axis=1)


@triton.jit
def _shared_list(rows, real, c):
    """The blocks the shared pass attends for the group of `_group_rows` (rows, real) at
    selection block c (`_shared_by_group`), once each, from the group's first real query's row:
    ([NP] blocks, the first `count` of them real; count)."""
    member = tl.arange(0, rows.shape[0])
    first = tl.min(tl.where(real, member, rows.shape[0]), axis=0)
    blk = tl.sum(tl.where(member[:, None] == first, rows, 0), axis=0)
    shared = _shared_by_group(blk, rows, real, c) & tl.reshape(_distinct(blk[None, :]), blk.shape)
    listed, count = _compact(blk[None, :], shared[None, :])
    return tl.reshape(listed, blk.shape), tl.sum(count, axis=0)


@triton.jit
def _listed_slots(rows, listed, count):
    """[R, NP]: where the slot of rows [R, NP] names one of the blocks listed[:count]."""
    slots = tl.arange(0, rows.shape[1])
    listed_now = (listed[None, None, :] == rows[:, :, None]) & (slots < count)[None, None, :]
    return tl.max(listed_now.to(tl.int32), axis=2) > 0


@triton.jit
def _rest_rows(rest, rows, real, listed, count, toks, b, h, T, N, H: tl.constexpr, c):
    """Writes the walk's rows (`_token_blocks` with TT > 0) for the group's queries toks [TT]
    into rest (shaped like block_idx): each query's distinct blocks less the shared ones
    (listed[:count]), first, then -2 where the shared pass attended block c (the queries' own,
    which the walk then finishes after the pass's keys), -3 where it attended others, -1 where
    it attended none (count 0; a row of N distinct blocks has no room for a mark, and then no
    block was shared, since a shared block leaves every row). One program works them out for
    TT queries, rather than every per-token program for its group again."""
    slots = tl.arange(0, rows.shape[1])
    keep = _distinct(rows) & ~_listed_slots(rows, listed, count)
    front, kept = _compact(rows, keep)
    own = tl.max(((listed == c) & (slots < count)).to(tl.int32), axis=0) > 0
    front = tl.where(slots[None, :] < kept[:, None], front,
                     tl.where(own, -2, tl.where(count > 0, -3, -1)))
    tl.store(rest + (((b * T + toks) * H + h) * N)[:, None] + slots[None, :], front,
             mask=real[:, None] & (slots[None, :] < N))


@triton.jit
def _group_tile(base, OFF, T, h, G, GPD: tl.constexpr, TT: tl.constexpr):
    """(tokens, mask, query heads) of the [TT x GPD] rows of a shared pass's tile: the TT queries
    at key positions base .. base + TT - 1, each with the G heads of KV head h (padded to GPD)."""
    r = tl.arange(0, TT * GPD)
    toks = base - OFF + r // GPD
    g = r % GPD
    return toks, (toks >= 0) & (toks < T) & (g < G), h * G + g


@triton.jit
def _listed_keys(listed, it, SEL: tl.constexpr, BN: tl.constexpr):
    """(offsets in the block, keys) of step `it` of a shared pass's walk over (its listed
    blocks [NP], key tiles of BN)."""
    NSUB: tl.constexpr = (SEL + BN - 1) // BN
    offs = (it % NSUB) * BN + tl.arange(0, BN)
    blk = tl.sum(tl.where(tl.arange(0, listed.shape[0]) == it // NSUB, listed, 0), axis=0)
    return offs, blk * SEL + offs


@triton.jit
def _delta(dot_, ot, dlse, stat, mask, HAS_DLSE: tl.constexpr):
    """delta = rowsum(dO * O) - dlse of the rows at stat, 0 outside mask."""
    dlt = tl.sum(dot_.to(tl.float32) * ot.to(tl.float32), axis=1)
    if HAS_DLSE:
        dlt -= tl.load(dlse + stat, mask=mask, other=0.0)
    return dlt


@triton.jit
def _token_blocks(bidx, cu_q, cu_k, OFF, NSEQ, b, t, h, T, N, H: tl.constexpr,
                  NP: tl.constexpr, IS_VARLEN: tl.constexpr, SEL: tl.constexpr,
                  TT: tl.constexpr):
    """The query's block_idx row as a set, less what the shared pass covered, its sequence's
    first key and the key it sits at.

    Returns (row: the row's pointer; kept: bit s set where slot s holds a block that no earlier
    slot names (-1 is empty), as an int64 for NP <= 64, else the [NP] vector of the slots' blocks
    with -1 where not kept; the slots to walk, first .. n_walk - 1, from the first kept one to the
    last; start; last: the packed key position of query t, t + OFF for fixed length, where
    OFF = Tk - Tq puts queries at the end of longer keys; varlen: from the offsets cu_q / cu_k of
    NSEQ sequences; done: the last key of the query's own block the shared pass attended, -1
    where it did not). TT > 0 (fixed length): the shared pass over groups of TT queries ran, and
    bidx holds its `_rest_rows` instead of block_idx. `_slot_block` reads slot s back.
    """
    row = bidx + ((b * T + t) * H + h) * N
    slots = tl.arange(0, NP)
    blk = tl.load(row + slots, mask=slots < N, other=-1)
    if IS_VARLEN:
        start, last = _query_keys(cu_q, cu_k, NSEQ, t)
    else:
        start = tl.zeros([], tl.int64)
        last = t + OFF
    if TT > 0:
        keep = blk >= 0
        done = tl.where(tl.max((blk == -2).to(tl.int32), axis=0) > 0, last // TT * TT, -1)
    else:
        keep = tl.reshape(_distinct(blk[None, :]), blk.shape)
        done = tl.full([], -1, tl.int64)
    if NP <= 64:
        kept = tl.sum(tl.where(keep, tl.full([NP], 1, tl.int64) << slots.to(tl.int64), 0), axis=0)
    else:
        kept = tl.where(keep, blk, -1)
    first_slot = tl.min(tl.where(keep, slots, NP), axis=0)
    n_walk = tl.max(tl.where(keep, slots + 1, 0), axis=0)
    return row, kept, first_slot, n_walk, start, last, done


@triton.jit
def _slot_block(row, kept, s, NP: tl.constexpr):
    """Slot s's block, or -1 where `_token_blocks` did not keep it. With the kept slots as bits
    this is a scalar load (the row is in L1 after the first read), not a register reduction over
    the row each iteration: forward 17.84 -> 17.52 ms at T=64k (H100, bench/tune_selection.py)."""
    if NP <= 64:
        return tl.where(((kept >> s) & 1) != 0, tl.load(row + s), -1)
    else:
        return tl.sum(tl.where(tl.arange(0, NP) == s, kept, 0), axis=0)


@triton.jit
def _tile_keys(row, kept, it, start, last, SEL: tl.constexpr, BN: tl.constexpr,
               NP: tl.constexpr):
    """(first key, keys [BN], visible mask) of step `it` of the per-token walk over (slot, key
    tile); an empty slot (-1) points past the query, so the causal mask closes it."""
    NSUB: tl.constexpr = (SEL + BN - 1) // BN
    blk = _slot_block(row, kept, it // NSUB, NP)
    sub = (it % NSUB) * BN
    first = tl.where(blk >= 0, start + blk * SEL, last + 1) + sub
    toks = first + tl.arange(0, BN)
    kmask = toks <= last
    if SEL % BN != 0:  # the block's last tile runs past its end
        kmask = kmask & (sub + tl.arange(0, BN) < SEL)
    return first, toks, kmask


@triton.jit
def _kv_tiles(k, v, b, toks, h, kmask, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, DK: tl.constexpr,
              DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr):
    """The K [BN, DKP] and V [BN, DVP] rows of keys toks of head h; zero outside kmask."""
    return (_load_tile(k, b * sk_b + toks * sk_t + h * sk_h, kmask, DK, DKP),
            _load_tile(v, b * sv_b + toks * sv_t + h * sv_h, kmask, DV, DVP))


@triton.jit
def _tma_tiles(kd, vd, b, first, h, start, last, BN: tl.constexpr, DKP: tl.constexpr,
               DVP: tl.constexpr):
    """(whole, K, V): `_kv_tiles` of keys first .. first + BN - 1 through the TMA descriptors kd,
    vd of k, v [B, Tk, H, D] (`utils.tma_descriptors`), whole when the query sees them all. A box
    has no row mask, and a key past the query must never reach a sum, not even a non-finite one: a
    tile that is not whole (the query's own partial tile, empty slots, blocks past the query)
    reads the sequence's first tile instead, which the caller masks; `_edge_tile` brings the
    partial tile's visible keys afterwards. (A box at a negative row would read zeros, but
    TMA's out-of-bounds path cost 6% of the forward on an H100.)"""
    whole = first + BN - 1 <= last
    at = tl.where(whole, first, tl.where(start + BN - 1 <= last, start, -BN))
    at = [b.to(tl.int32), at.to(tl.int32), h.to(tl.int32), 0]
    return whole, tl.reshape(kd.load(at), (BN, DKP)), tl.reshape(vd.load(at), (BN, DVP))


@triton.jit
def _edge_tile(row, N, start, last, done, SEL: tl.constexpr, BN: tl.constexpr,
               NP: tl.constexpr):
    """(keys, mask) of the tile that `_tma_tiles` leaves out: the [BN] tile holding the query's
    own key when it reaches past it and the query selected its block; with done >= 0 (the
    shared pass attended the block's keys up to done) the keys after done; all masked
    otherwise."""
    slots = tl.arange(0, NP)
    own = (last - start) // SEL
    picked = tl.sum((tl.load(row + slots, mask=slots < N, other=-1) == own).to(tl.int32),
                    axis=0) > 0
    first = start + (last - start) // BN * BN
    toks = first + tl.arange(0, BN)
    # a vector & scalar-bool mask is mis-typed by the interpreter, hence the wheres
    edge = tl.where(done >= 0, toks > done, picked & (first + BN - 1 > last))
    return toks, tl.where(edge, toks <= last, False)


@triton.jit
def _attend(qt, kt, vt, kmask, m, l, acc, qk_scale, PREC: tl.constexpr):
    """One key tile of the online softmax (`softmax.attend_tile`), its keys masked by kmask."""
    s = tl.where(kmask[None, :], tl.dot(qt, tl.trans(kt), input_precision=PREC), float("-inf"))
    return attend_tile(s, vt, m, l, acc, qk_scale, PREC)


@triton.jit
def _dq_step(qt, dot_, kt, vt, kmask, lse2, dlt, acc, qk_scale, PREC: tl.constexpr):
    """One key tile's share of dq (unscaled)."""
    p = tl.exp2(tl.dot(qt, tl.trans(kt), input_precision=PREC) * qk_scale - lse2[:, None])
    p = tl.where(kmask[None, :], p, 0.0)
    dp = tl.dot(dot_, tl.trans(vt), input_precision=PREC)
    ds = p * (dp - dlt[:, None])
    return acc + tl.dot(ds.to(kt.dtype), kt, input_precision=PREC)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

# (num_warps, num_stages) the per-token kernels (fwd, dq) can launch with. The Inductor template
# autotunes over all of them. Eager calls launch the one _per_token_launch names, not an autotuned
# pick: autotuning times the kernel on its first call, which fails inside CUDA-graph capture and
# depends on whichever shape came first. Both kernels are bound by moving K/V blocks from L2, so
# what matters is how many loads are in flight: pipeline depth and programs per SM. The picks,
# with the key tiles of `_key_tile_size`, are the fastest measured on an H100 (bf16, spec
# geometry, the kernels alone). Pointer loads (the template, AOTInductor, GPUs before sm90):
# forward 32-key tiles at (2, 3) 1.96 / 17.09 ms at T = 8k / 64k against 2.09-2.10 /
# 17.54-17.99 for 64-key tiles at (4, 3), (4, 2), (2, 2) and 2.11-4.23 / 18.3-35.0 for the other
# 32-key configs; dq 64-key tiles at (2, 2) 2.11 / 18.30 against (2, 3) 2.18 / 18.3-21.2 and
# 2.08-2.56 / 18.7-23.4 for (4, 3), (4, 2) and 32-key tiles; one warp 23.0-29.4 ms forward,
# 41.0-53.2 ms dq at 64k. TMA loads (the eager forward on sm90+, `_tma_loads`) free the warps
# from address math, so one warp keeps three tiles in flight: 32-key tiles at (1, 3) 3.59 /
# 16.59 ms at 16k / 64k against 3.93 / 16.46 with pointer loads (the query's own partial tile,
# loaded apart by `_edge_tile`, costs 0.13 / 0.34 ms of that); the other TMA_CONFIGS 3.92-5.10 /
# 17.5-20.5 (tune_selection.py). dq keeps pointer loads: a build reading its K/V through TMA
# as the forward does (whole tiles by descriptor, the partial tile apart) measured, whole
# backward on an H200 at 16k / 64k, 8.00-8.06 / 33.41-34.28 ms at its best TMA_CONFIGS (32-key
# tiles at (1, 2), (2, 3); 64-key at (2, 2)) against 8.05 / 33.53 with pointer loads at (2, 2):
# no gain for a second K/V path. On that H200 the forward with TMA loads measured 3.22 / 14.01
# at (1, 2) and 3.28 / 14.08 at (1, 3); 64-key tiles 3.79-8.05 / 15.58-32.58. dq's registers
# capped (maxnreg 160 / 168 / 176, so that more programs share an SM) or 32-key tiles at (1, 2):
# whole backward at 64k 34.4-35.2 / 34.5-35.3 / 35.3-36.2 / 34.2-35.2 ms against 34.9-35.8 for
# the pick, four interleaved rounds on an H100 (`ba542f5`): within the spread, the pick stays.
# fp32 inputs ("fwd_fp32", "dq_fp32"): tl.dot runs their ieee dots on CUDA cores, and the
# 16-bit picks spill there (ptxas, sm_90a: dq at (2, 2) 22.8 KB a thread, at (4, 2) none). H100,
# fp32, spec geometry, D = 128, T = 8k, both without the shared passes (`_cuda_core_default`):
# forward at (2, 2) 21.0 ms against 22.3 at (2, 3), 32.7-42.2 at (1, 2), (4, 1), (4, 2), (4, 3);
# whole backward with dq at (4, 2) 94.9 ms against 474.4 at (2, 2) and 125.8 at (8, 2) (32-key
# tiles 93.1-125.4, 16-key 98.6-128.6). D = 256: forward at (2, 2) 52.8 ms against 75.6-80.0 at
# (4, 2), (8, 2), though ptxas reports 16 KB spilled a thread there and none at (8, 2).
# Wide 16-bit heads ("_wide": padded Dk + Dv over 256), H100, bf16, T = 16k, random
# selections, Dk = 192 with Dv = 128 (HQ = 64, H = 4) / D = 256 (HQ = 32, H = 2), whole forward
# (the shared pass with the walk) and one sweep each (`.gpu`-style script on `e3216d1`): TMA
# loads on 16-key tiles (`_key_tile_size`) at (1, 3) 6.58 / 4.00 ms against the 32-key (1, 3)
# they had, 7.28 / 7.25; 16-key (1, 2) 6.90 / 3.98, (1, 4) 6.56 / 5.13, (2, *) 7.62-8.08 /
# 4.62-4.76; 32-key (2, 2), (2, 3) 6.95-7.61 / 4.17-4.18, (1, 4) 9.55 / 8.89; 64-key 7.18-25.3 /
# 4.87-28.1. Pointer loads (32-key tiles, no shared pass) at (2, 2) 6.21 / 4.22 against (2, 3)
# 7.86 / 4.45 and (4, 3) 8.01 / 4.43. dq keeps its pick: at its key tiles (64 / 32), whole
# backward 20.92 / 12.13 ms against the best of 18 configs 20.00 / 12.13.
# dq from stored dS ("dq_ds", K alone): 64-key tiles at (2, 3), whole stored backward at 64k
# (tune_selection.py, H100, `6082672`) 29.31 ms against 29.22-30.73 at (2, 2), (4, *) and
# 31.00-31.46 on 32-key tiles; 8 warps 33.8-36.7. Through TMA descriptors (whole K tiles by box,
# the query's own partial tile apart, as the forward): 64-key tiles at (1, 2) against pointer
# loads, four interleaved rounds, random / runs of 64 alike: 8k 3.57-3.59 / 3.24 against
# 3.63-3.65 / 3.21, 16k 7.03-7.04 / 6.26-6.29 against 7.13-7.14 / 6.20-6.24, 64k 29.2-29.7 /
# 25.7-26.2 against 29.4-30.0 / 25.3-26.0; 32-key tiles and the other TMA_CONFIGS 29.2-32.9 at
# 64k. Within 2% either way: no second K path.
PER_TOKEN_CONFIGS = ((4, 2), (4, 3), (4, 4), (2, 2), (2, 3), (8, 3))
TMA_CONFIGS = ((1, 2), (1, 3), (1, 4), (2, 2), (2, 3), (4, 3))
_PER_TOKEN_PICK = {"fwd": (2, 3), "fwd_tma": (1, 3), "dq": (2, 2), "dq_ds": (2, 3),
                   "fwd_fp32": (2, 2), "dq_fp32": (4, 2), "dq_ds_fp32": (4, 2),
                   "fwd_wide": (2, 2)}


def _wide(dkp: int, dvp: int) -> bool:
    """Heads whose padded K and V rows hold over 256 values together: tiled apart from D <= 128."""
    return dkp + dvp > 256


def _pick_name(kernel: str, dtype: torch.dtype, wide: bool = False) -> str:
    """The `_PER_TOKEN_PICK` entry of the forward ("fwd", "fwd_tma": with TMA loads) or dq ("dq")
    kernel for inputs of this dtype and head width: fp32's own where the table lists one, else
    wide heads' own where it lists one."""
    for own in (f"{kernel}_fp32" if cuda_core_dots(dtype) else None,
                f"{kernel}_wide" if wide else None):
        if own in _PER_TOKEN_PICK:
            return own
    return kernel


def _per_token_launch(kernel: str, dtype: torch.dtype, wide: bool = False) -> dict:
    """Launch config of the eager forward or dq kernel (`_pick_name`)."""
    num_warps, num_stages = _PER_TOKEN_PICK[_pick_name(kernel, dtype, wide)]
    return dict(num_warps=num_warps, num_stages=num_stages)


def _cuda_core_default(choice: Optional[bool], dtype: torch.dtype) -> Optional[bool]:
    """choice, or False where the caller left it to us (None) and tl.dot runs this dtype on CUDA
    cores (fp32): there the forward's walk reads K/V faster through pointers, and the shared
    passes' 64-row tiles spill (ptxas, sm_90a: dq's 35.3 KB a thread). H100, fp32, spec
    geometry, D = 128, T = 8k: forward with pointer loads 21.0 ms against 29.2-41.8 through TMA
    at TMA_CONFIGS' (1, 3), (2, 2), (2, 3), (4, 2) and 138-373 with the shared pass as well;
    whole backward on runs of 64 tokens selecting alike 94.4 ms without dq's shared pass against
    136.8-575.9 with it. Forced (True), both still run: the CPU tests check them in fp32."""
    return False if choice is None and cuda_core_dots(dtype) else choice


def _tma_reason(k: Tensor, v: Tensor, sel_block: int, bn: int) -> Optional[str]:
    """Why the per-token kernels cannot read these K/V tiles through TMA descriptors (None: they
    can): whole boxes must tile the blocks exactly, and TMA must be able to describe k and v."""
    if sel_block % bn:
        return f"sel_block={sel_block} is not a multiple of the {bn}-key tile"
    return tma_kv_reason(k, v)


def _tma_loads(tma: Optional[bool], k: Tensor, v: Tensor, sel_block: int, bn: int) -> bool:
    """Whether the per-token kernels read K/V tiles through TMA descriptors (`utils.use_tma`:
    None where `_tma_reason` allows on sm90+, in eager launches, never for fp32
    (`_cuda_core_default`); True forces them)."""
    return use_tma(_cuda_core_default(tma, k.dtype), _tma_reason(k, v, sel_block, bn), k)


# The shared pass (`_shared_fwd_kernel`): query rows per tile (queries of a group x the group's
# heads padded to a power of two) and the (num_warps, num_stages, maxnreg) it launches with;
# measured on an H100 (bf16, spec geometry, the whole selection forward at T = 8k / 16k / 64k, in a
# build whose walk started from the pass's output instead of merging it last): 64 rows at (4, 3)
# 1.70 / 3.63 / 15.79 ms, at (4, 2) and (4, 1) 1.71-1.72 / 3.66-3.68 / 15.92-15.95, at (8, *)
# 1.91-1.96 / 4.06-4.13 / 17.4-17.8; 128 and 256 rows 1.70-2.13 / 3.66-4.48 / 15.87-19.06. Since
# the pass reads its block lists from `_shared_plan_kernel` and its whole blocks through TMA
# (158 registers, 64 KB of shared memory at (4, 3)), H200, three interleaved rounds, random /
# runs of 64 tokens selecting alike, 8k and 64k: (4, 2, 128) 1.478-1.481 / 0.940-0.941 and
# 13.40-13.41 / 7.58-7.69 ms, (4, 3) 1.482-1.490 / 0.983-0.985 and 13.41-13.43 / 8.07-8.10,
# (4, 2) 1.481 / 0.978-0.979 and 13.39-13.41 / 8.10-8.13, (4, 3, 128) 1.513-1.515 / 1.035 and
# 13.66-13.68 / 8.46-8.53, (4, 4) 1.538-1.540 / 1.127-1.128 and 13.82-13.83 / 9.57-9.68, (8, 3)
# 1.70 / 1.72 and 14.73-14.78 / 14.18-14.32; the pass with its lists worked out inside, at (4,
# 3), 1.520-1.523 / 0.982-0.984 and 13.75-13.78 / 7.96-8.03, without the pass 1.548-1.550 /
# 1.526-1.527 and 13.44-13.47 / 12.58-12.62. Wide heads (`_wide`) keep the uncapped (4, 3),
# unmeasured since: at D = 256 the pass's [64, 256] fp32 output alone takes 128 registers a
# thread, and ptxas refuses the cap.
SHARED_ROWS = 64
SHARED_CONFIGS = ((4, 2, 128), (4, 3, None), (4, 2, None), (4, 3, 128), (4, 1, None),
                  (8, 2, None))
_SHARED_PICK = {"narrow": (4, 2, 128), "wide": (4, 3, None)}


def _shared_group(G: int, bn: int) -> int:
    """Queries per group of the shared pass: enough to fill SHARED_ROWS rows, at most the
    per-token kernel's key tile bn, so that a group's keys after its first lie in the one tile
    the walk's `_edge_tile` reads (both powers of two: the group divides the tile)."""
    return min(bn, max(1, SHARED_ROWS // pow2(G)))


# Values a thread of the plan kernels (`_shared_plan_kernel`, `_dq_plan_kernel`) holds at most in
# their [TT, NP, NP] slot comparisons (`_distinct`, `_compact`, `_listed_slots`): at one warp
# and G = 1, n = 19 (TT = 32 / 64, NP = 32: 1024 / 2048 values a thread) ptxas took 56 s over the
# forward's plan (44 KB of spill stores) and over 5 minutes over dq's (sm_90 compiles on the CPU
# machine, Triton 3.9): the layer's first backward waited on it (the GPU sweep's draw 13 at
# SEED = 90210, G = 1 n = 19, ran past 4 minutes on an H200). Spread over `_plan_warps` (8 / 16
# there) they compiled in 4 and 8 s, and at n = 40 (NP = 64) and 32 warps in 5 and 10 s. The
# spec's groups (TT = 4, NP = 16) keep the one warp they were timed at (`SHARED_CONFIGS`).
_PLAN_VALUES_PER_THREAD = 128


def _plan_warps(group: int, np_: int) -> int:
    """num_warps of the plan kernels for groups of `group` queries and NP = np_ slots."""
    return min(32, pow2(cdiv(group * np_ * np_, 32 * _PLAN_VALUES_PER_THREAD)))


def _shared_reason(varlen: bool, G: int, bn: int, tma: bool = True) -> Optional[str]:
    """Why a kernel runs without its shared pass (None: it can run it). tma: whether the forward's
    per-token walk reads K/V through TMA descriptors (its pointer walk has no edge step)."""
    if not tma:
        return "the per-token walk reads K/V without TMA descriptors"
    if varlen:
        return "packed sequences (a group of queries could straddle two)"
    if _shared_group(G, bn) < 2:
        return f"G={G} query heads fill the shared pass's {SHARED_ROWS}-row tile alone"
    return None


def _shared_pass(shared: Optional[bool], reason: Optional[str], G: int, bn: int,
                 dtype: torch.dtype) -> int:
    """Queries per group of a shared pass, 0 without it. None: wherever it can run
    (`_shared_reason`), never for fp32 (`_cuda_core_default`); True forces it (ValueError where
    it cannot), False leaves it out."""
    shared = _cuda_core_default(shared, dtype)
    if shared and reason is not None:
        raise ValueError(f"shared=True: {reason}")
    return _shared_group(G, bn) if shared is not False and reason is None else 0


# dq's shared pass (`_shared_dq_kernel`) takes a group's shared blocks only where there are at
# least SHARED_DQ_MIN of them (`_dq_plan_kernel`; at least 1), and the (num_warps, num_stages)
# it launches with, _SHARED_DQ_PROGRAMS of them per SM. Random selections share 2 blocks before
# their own (0 and the previous one), so they leave the pass idle. H100, bf16, spec geometry,
# whole selection backward at 64k, SHARED_DQ_MIN 3 / 4 / 8 / never: runs of 64 tokens selecting
# alike 24.85 / 24.82 / 25.42 / 32.49 ms, with 5% of their blocks replaced 26.70 / 28.06 /
# 27.02 / 34.06, 20% 31.14 / 30.76 / 32.22 / 33.98, random 33.02 / 33.02 / 33.06 / 33.07;
# (num_warps, num_stages) (4, 1) / (4, 3) 26.23 / 26.01 against 24.56-26.74 at (4, 2), (8, 2)
# 36.3; programs per SM 1 / 3 / 4: 27.89 / 26.92 / 24.84. With dS stored (the dK dV pass then
# skips the blocks the pass takes), three interleaved rounds at `bf10887`, SHARED_DQ_MIN 4 / 3 /
# 2: 64k random 29.12-29.16 / 29.97-30.47 / 29.56-29.62, alike 25.01-25.27 / 25.87-26.34 /
# 25.22-25.43; 16k random 6.98-7.00 / 6.98-7.01 / 7.08-7.11.
SHARED_DQ_MIN = 4
_SHARED_DQ_PICK = (4, 2)
_SHARED_DQ_PROGRAMS = 2


# dq from stored dS (`_dq_ds_kernel`): the dK dV pass, which works P and dS out for every
# (query, selected block) anyway, stores dS, and dq sums dS K reading K alone: half the gathered
# bytes of the dq kernel, which reads K and V to work out P and dS again, and one dot instead of
# three. The cost is a dS buffer of B * T * HQ * n * l' values (128 KB a token at the spec's
# geometry in bf16: 1 GiB at 8k, 8 GiB at 64k), and a pass of its own for delta. The buffer
# takes at most 1 / STORED_DS_SHARE of the GPU's memory: past that, the passes run over windows
# of queries (`_ds_window`), one window's dS at a time, at the spec's geometry on an 80 GB GPU
# 32k tokens a window. Whole selection backward on an H100, three interleaved rounds, windows of
# 64k / 32k / 16k tokens: 64k random 29.15-29.39 / 29.46-30.49 / 30.32-30.71 ms, runs of 64 alike
# 25.24-25.32 / 25.33-26.29 / 26.46-26.49, the backward's own peak 9.55 / 5.40 / 3.38 GiB; 128k
# random, dq worked out again / windows of 64k / 32k: 69.06-70.76 / 61.53-62.39 / 63.46-65.66,
# alike 50.52-51.11 / 51.70-52.27 / 52.28-52.97, peak 3.06 / 10.80 / 6.75 GiB. So 1/16: at 64k a
# layer's step keeps about the peak it had before dS was stored, for at most 1% of the step,
# and 128k stores dS too. Its inverse index must be built before the dK dV pass, where it hid
# behind the dq kernel: left to the backward (a GPU, no `backward_index` started early, as under
# torch.compile), the index (then some 60 small torch kernels, `kernels/index.py` since) is
# exposed, and below STORED_DS_MIN_TOKENS query tokens that costs more than dq from dS saves
# where neighbouring queries select alike (H100, spec geometry, whole selection backward,
# recomputed -> stored: runs of 64 alike 8k 2.84 -> 3.20 ms, 16k 5.84-6.00 -> 6.22-6.35; random
# 8k 3.74 -> 3.64, 16k 7.74-8.06 -> 7.10-7.13), so there it works dq out again.
# The buffer was laid out [B, T, H, N, G, SEL]: a (query, block)'s dS for the G heads of its
# group is one contiguous piece (2 KB at the spec's geometry) for the dK dV pass to write and dq
# to read, where [B, T, HQ, N, SEL] cut it into G rows 2 KB apart. H100, whole stored backward,
# four interleaved rounds, [B, T, HQ, N, SEL] -> [B, T, H, N, G, SEL]: 16k random 7.11-7.12 ->
# 6.96 ms, alike 6.18-6.19 -> 6.14; 64k random 29.70-29.75 -> 29.47-29.56, alike 25.36-25.71 ->
# 25.00-25.25; dq bitwise the same. Not kept (three rounds, within the spread): the stores with
# an evict-first or streaming (.cs) hint, dq's dS loads evict-first. With dS stored the dK dV
# kernel takes 17.35 ms at 64k against 13.67 without (8.6 GB written at 2.3 TB/s).
# Since then each piece is [SEL, G], dS^T as the dK dV pass's dot leaves it in registers (its
# rows are (query, head) pairs): on its way to the 16-byte global stores the tile passes through
# shared memory as a plain copy (sm_90 SASS: two 16-byte shared stores and two ldmatrix a
# thread, one barrier a step) where [G, SEL] took two transposing stmatrix and three barriers.
# dq sums dq^T = K^T dS^T with K^T loaded as such (async copies, as before; reading dS [G, SEL]
# out of this layout, or transposing a loaded K tile, took registers through shared memory: dq
# from dS 7.5 -> 7.7 / 12.8 ms at 64k). H200, old and new kernels side by side, three interleaved
# rounds in each of two runs, dK dV / dq from dS: random 8k 1.67-1.72 / 0.76 -> 1.57-1.63 / 0.76
# ms, 64k 14.1-15.6 / 7.4-7.7 -> 13.5-15.1 (five rounds of six 13.5-14.6) / 7.4-7.8; runs of 64
# alike 8k 1.49-1.63 / 0.15 -> 1.38-1.50 / 0.14, 64k 12.6-13.0 / 1.19-1.22 -> 12.0-12.4 /
# 1.11-1.13 (dq's sums in another order: 1e-6 apart).
STORED_DS_SHARE = 16
STORED_DS_MIN_TOKENS = 16384


@functools.cache
def _ds_budget(device: torch.device) -> Optional[int]:
    """Bytes the dS buffer may take on device: 1 / STORED_DS_SHARE of a GPU's memory; None off a
    GPU (the interpreter: no bound). Asked once per device, as `utils.device_capability`: every
    backward asks it two or three times (`_ds_choice`)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory // STORED_DS_SHARE


def _ds_token_bytes(q: Tensor, n: int, sel_block: int) -> int:
    """Bytes of one query token's dS: B * HQ * n * l' values in q's dtype."""
    return q.shape[0] * q.shape[2] * n * sel_block * q.element_size()


def _ds_window(q: Tensor, n: int, sel_block: int) -> Optional[int]:
    """Query tokens per window of the stored-dS backward, which then runs its passes window by
    window over one buffer of that many tokens' dS: where all T tokens' buffer would pass
    `_ds_budget`, the largest power of two whose buffer fits (`_stored_ds_reason` refuses where
    none does, and packed sequences, which are not cut); None where one window takes them all."""
    T, budget = q.shape[1], _ds_budget(q.device)
    per_token = _ds_token_bytes(q, n, sel_block)
    if budget is None or not isinstance(T, int) or T * per_token <= budget:
        return None
    return 1 << max(0, (budget // per_token).bit_length() - 1)


def _stored_ds_reason(q: Tensor, n: int, sel_block: int, varlen: bool) -> Optional[str]:
    """Why the backward works dq out from K and V again (`_dq_kernel`) instead of summing it from
    the dS its dK dV pass stores (None: it can store them, over `_ds_window`s where needed)."""
    T = q.shape[1]
    if not isinstance(T, int):
        return "the length is symbolic (a dynamic-length trace): the dS buffer has no known size"
    if _ds_window(q, n, sel_block) is None:
        return None
    per_token = _ds_token_bytes(q, n, sel_block)
    share = f"would take over 1/{STORED_DS_SHARE} of the GPU's memory"
    if varlen:
        return (f"the dS buffer of packed sequences ({T * per_token / 2 ** 30:.1f} GiB), which "
                f"are not cut into windows, {share}")
    if per_token > _ds_budget(q.device):
        return f"the dS buffer of one query token ({per_token / 2 ** 30:.1f} GiB) {share}"
    return None


def _stored_ds_preferred(on_gpu: bool, tokens: int, early_index: bool) -> bool:
    """Whether storing dS pays, where it can run (STORED_DS_MIN_TOKENS): always with an index
    started early or off a GPU (the interpreter: the CPU tests run it by default)."""
    return early_index or not on_gpu or (isinstance(tokens, int)
                                         and tokens >= STORED_DS_MIN_TOKENS)


def _stored_ds(choice: Optional[bool], reason: Optional[str], preferred: bool = True) -> bool:
    """Whether the backward stores dS (`selection_attention_bwd`'s stored_ds): None where reason
    is None and it pays (preferred); True forces it (ValueError with the reason where it
    cannot), False leaves it."""
    if choice and reason is not None:
        raise ValueError(f"stored_ds=True: {reason}")
    return reason is None and preferred if choice is None else choice


def _num_groups(T: int, off: int, group: int) -> int:
    """Groups of `group` queries at consecutive key positions that T queries sitting off keys in
    (queries at an offset) span: a shared pass's grid."""
    return (T - 1 + off) // group - off // group + 1


@functools.cache
def _index_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the backward builds its inverse index on, one per device. High priority:
    the index's small kernels take SM slots as the dq kernel's programs free them, rather than
    after its last one. H100, spec geometry, whole selection backward, three interleaved rounds,
    one stream / this stream / a side stream of normal priority: 8k random 4.07-4.13 / 3.75-3.76
    / 4.13-4.15 ms, coherent 3.19-3.20 / 2.85-2.86 / 3.20; 16k random 8.03-8.13 / 7.66-7.94,
    coherent 6.02-6.23 / 5.69-5.76; 64k random 33.89-33.92 / 33.48-33.60, coherent 24.93-25.52 /
    24.70-24.74. The layer's synced forward+backward step: 8k 10.22-10.28 / 9.85-10.11, 16k
    20.96-21.42 / 20.81-21.02, 64k 109.5-111.4 / 110.6-110.8."""
    return torch.cuda.Stream(device, priority=-1)


def _persistent_programs(device: torch.device) -> int:
    """Programs of the persistent dq pass: _SHARED_DQ_PROGRAMS per SM (4 under the CPU
    interpreter, which runs them one after another)."""
    if device.type != "cuda":
        return 4
    return _SHARED_DQ_PROGRAMS * torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def selection_fwd_rows(q, k, v, kd, vd, bidx, cu_q, cu_k, OFF, NSEQ, b, t, h,
                       sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, T, N, qk_scale,
                       o, so_b, so_t, so_h, lse,
                       H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, SEL: tl.constexpr,
                       BN: tl.constexpr, NP: tl.constexpr, IS_VARLEN: tl.constexpr,
                       PREC: tl.constexpr, TMA: tl.constexpr, TT: tl.constexpr):
    """Attention of the G query heads of (b, t, KV head h) over the token's selected blocks
    (cu_q, cu_k, OFF, NSEQ: see _token_blocks). With TMA, kd and vd are TMA descriptors of k and
    v (`_tma_tiles`); without, they go unread. TT > 0 (TMA, fixed length): the shared pass
    (`_shared_fwd_kernel`, groups of TT queries) left its normalised output and lse in o [B, T,
    HQ, Dv] and lse [B, T, HQ] and the blocks left to the walk in bidx (`_rest_rows`); the walk
    merges the pass's output last. TT == 0: o, so_* and lse go unread.

    Returns the normalised output [GP, DVP] (fp32), lse [GP] (natural log, -inf for rows that saw
    nothing), the query-head indices and their mask. Shared by the eager forward kernel and the
    Inductor template (nsa_ops.lowering), which differ only in how they store the output.
    """
    g = tl.arange(0, GP)
    gmask = g < G
    heads = h * G + g
    qt = _load_tile(q, b * sq_b + t * sq_t + heads * sq_h, gmask, DK, DKP)
    row, kept, first_slot, n_walk, start, last, done = _token_blocks(
        bidx, cu_q, cu_k, OFF, NSEQ, b, t, h, T, N, H, NP, IS_VARLEN, SEL, TT)

    # finite start for the running max: fully masked tiles then give exp2(-inf - m) = 0, no NaN
    m = tl.full([GP], -1e30, tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DVP], tl.float32)
    NSUB: tl.constexpr = (SEL + BN - 1) // BN
    # one flat loop over (slot, key tile)
    for it in range(first_slot * NSUB, n_walk * NSUB):
        first, toks, kmask = _tile_keys(row, kept, it, start, last, SEL, BN, NP)
        if TMA:  # (only where BN divides SEL: `_tma_loads`)
            whole, kt, vt = _tma_tiles(kd, vd, b, first, h, start, last, BN, DKP, DVP)
            kmask = tl.where(whole, kmask, False)
        else:
            kt, vt = _kv_tiles(k, v, b, toks, h, kmask, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                               DK, DV, DKP, DVP)
        m, l, acc = _attend(qt, kt, vt, kmask, m, l, acc, qk_scale, PREC)
    if TMA:
        toks, kmask = _edge_tile(row, N, start, last, done, SEL, BN, NP)
        kt, vt = _kv_tiles(k, v, b, toks, h, kmask, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                           DK, DV, DKP, DVP)
        m, l, acc = _attend(qt, kt, vt, kmask, m, l, acc, qk_scale, PREC)
    if TT > 0:
        # merge the shared pass's softmax: its max is its lse (base 2), its sum 1, its output o
        lse0 = tl.load(lse + (b * T + t) * (H * G) + heads, mask=gmask, other=float("-inf"))
        seen0 = lse0 != float("-inf")  # a NaN row stays NaN
        m0 = tl.where(seen0, lse0 * LOG2E, -1e30)
        o0 = _load_tile(o, b * so_b + t * so_t + heads * so_h, gmask, DV, DVP).to(tl.float32)
        m_new = tl.maximum(m, m0)
        alpha = tl.exp2(m - m_new)
        alpha0 = tl.where(seen0, tl.exp2(m0 - m_new), 0.0)
        m, l, acc = m_new, l * alpha + alpha0, acc * alpha[:, None] + o0 * alpha0[:, None]

    o_row, lse_row = finish(m, l, acc)
    return o_row, lse_row, heads, gmask


@triton.jit
def _fwd_kernel(q, k, v, kd, vd, o, lse, bidx, cu_q, cu_k, OFF, NSEQ,
                sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
                T, N, qk_scale, og, oc, ow, gc, gs, gw, sgc, sgs, sgw,
                H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr,
                DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, SEL: tl.constexpr,
                BN: tl.constexpr, NP: tl.constexpr, IS_VARLEN: tl.constexpr,
                PREC: tl.constexpr, TMA: tl.constexpr, TT: tl.constexpr,
                GATED: tl.constexpr, HAS_WIN: tl.constexpr, KEEP_BRANCH: tl.constexpr):
    """GATED: also writes the gated combine of the rows into og (contiguous, gate.gated_rows
    over oc, ow, gc, gs, gw), and the branch's own output into o only if KEEP_BRANCH; og may be
    o then (the merge reads o's rows before the program writes them)."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # AOTInductor passes Python floats as fp64
    t = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1)
    # int64: head offsets of head-major inputs (stride T * D) pass 2**31 at long T
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    out, lse_row, heads, gmask = selection_fwd_rows(
        q, k, v, kd, vd, bidx, cu_q, cu_k, OFF, NSEQ, b, t, h, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
        sv_b, sv_t, sv_h, T, N, qk_scale, o, so_b, so_t, so_h, lse, H, G, GP, DK, DV, DKP, DVP,
        SEL, BN, NP, IS_VARLEN, PREC, TMA, TT)
    rows = (b * T + t) * (H * G) + heads
    if GATED:
        gated = gated_rows(out, oc, ow, gc, gs, gw, rows, gmask, sgc, sgs, sgw, DV, DVP, HAS_WIN)
        _store_tile(og, rows * DV, gmask, gated, DV, DVP)
    if KEEP_BRANCH:
        _store_tile(o, b * so_b + t * so_t + heads * so_h, gmask, out, DV, DVP)
    tl.store(lse + rows, lse_row, mask=gmask)


@triton.jit
def _shared_plan_kernel(bidx, rest, listed, OFF, T, N, H: tl.constexpr, SEL: tl.constexpr,
                        TT: tl.constexpr, NP: tl.constexpr):
    """What the forward's shared pass (`_shared_fwd_kernel`) attends: one program per (group of
    TT queries at consecutive key positions, batch * KV head) writes the group's blocks
    (`_shared_list`: those up to its own that all its queries selected), its own block last,
    into listed [B * H, groups, NP], -1 past them, and the walk's rows into rest (`_rest_rows`).
    Apart from the pass because this block-list logic, inside it, at the two programs an SM its
    tiles then allowed, stalled on latencies nothing else hid: ncu on an H200 put half the
    pass's stall samples in the ~1400 instructions before its first dot; here, with no tiles,
    many programs an SM hide each other's (`SHARED_CONFIGS` has the times)."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    base = (OFF // TT + tl.program_id(0).to(tl.int64)) * TT
    c = base // SEL
    rows, real, toks = _group_rows(bidx, b, h, base, OFF, T, N, H, TT, NP)
    # the blocks before the group's own as dq's plan lists them, then its own where all took it
    before, n_before = _shared_list(rows, real, c - 1)
    own = tl.sum(_shared_by_group(tl.full([1], c, tl.int32), rows, real, c).to(tl.int32), axis=0)
    slots = tl.arange(0, NP)
    blocks = tl.where(slots < n_before, before,
                      tl.where((slots == n_before) & (own > 0), c.to(tl.int32), -1))
    _rest_rows(rest, rows, real, blocks, n_before + own, toks, b, h, T, N, H, c)
    tl.store(listed + (bh * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * NP + slots,
             blocks)


@triton.jit
def _shared_fwd_kernel(q, k, v, kd, vd, o, lse, listed, OFF, sq_b, sq_t, sq_h, sk_b, sk_t,
                       sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h, T, qk_scale,
                       H: tl.constexpr, G: tl.constexpr, GPD: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr,
                       SEL: tl.constexpr, BN: tl.constexpr, TT: tl.constexpr,
                       NP: tl.constexpr, PREC: tl.constexpr):
    """The shared pass of the forward (fixed length). NSA forces block 0 and the two local blocks
    on every query, and trained models' neighbouring queries select mostly the same blocks, so
    the per-token walk would read them once per query: here one program per (group of TT
    queries at consecutive key positions, batch * KV head) attends the blocks all the group's
    queries selected (`_shared_by_group`, listed by `_shared_plan_kernel`) with its TT x G query
    rows as one tile, reading their K/V once per group, keys up to its first query's, which all
    of them see. The blocks before the group's own come whole through the walk's TMA
    descriptors kd, vd (boxes of BN keys); the own block, listed last, through masked loads:
    its keys past the group's first query never reach a sum, not even non-finite ones. Writes
    the normalised o and lse (-inf: nothing attended), which the walk (TT > 0) merges."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    base = (OFF // TT + tl.program_id(0).to(tl.int64)) * TT
    c = base // SEL
    plan = listed + (bh * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * NP
    row = tl.load(plan + tl.arange(0, NP))
    own = tl.max((row == c).to(tl.int32), axis=0)
    toks, rmask, heads = _group_tile(base, OFF, T, h, G, GPD, TT)
    qt = _load_tile(q, b * sq_b + toks * sq_t + heads * sq_h, rmask, DK, DKP)

    m = tl.full([TT * GPD], -1e30, tl.float32)
    l = tl.zeros([TT * GPD], tl.float32)
    acc = tl.zeros([TT * GPD, DVP], tl.float32)
    NSUB: tl.constexpr = (SEL + BN - 1) // BN
    offs = tl.arange(0, BN)
    whole = offs >= 0
    for it in range((tl.sum((row >= 0).to(tl.int32), axis=0) - own) * NSUB):
        at = [b.to(tl.int32), (tl.load(plan + it // NSUB) * SEL + it % NSUB * BN).to(tl.int32),
              h.to(tl.int32), 0]
        m, l, acc = _attend(qt, tl.reshape(kd.load(at), (BN, DKP)),
                            tl.reshape(vd.load(at), (BN, DVP)), whole, m, l, acc, qk_scale, PREC)
    for it in range(own * ((base - c * SEL) // BN + 1)):
        keys = c * SEL + it * BN + offs
        kmask = keys <= base
        kt, vt = _kv_tiles(k, v, b, keys, h, kmask, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                           DK, DV, DKP, DVP)
        m, l, acc = _attend(qt, kt, vt, kmask, m, l, acc, qk_scale, PREC)

    o_row, lse_row = finish(m, l, acc)
    _store_tile(o, b * so_b + toks * so_t + heads * so_h, rmask, o_row, DV, DVP)
    tl.store(lse + (b * T + toks) * (H * G) + heads, lse_row, mask=rmask)


@triton.jit
def _dq_plan_kernel(bidx, rest, plan, plan_blocks, plan_len, passed_slots, OFF, T, N,
                    H: tl.constexpr, SEL: tl.constexpr, TT: tl.constexpr, NP: tl.constexpr,
                    MIN_SHARED: tl.constexpr, STORED_DS: tl.constexpr):
    """Which groups of TT queries dq's shared pass (`_shared_dq_kernel`) takes: one program per
    (group, batch * KV head) lists the blocks before the group's own that all its queries
    selected; where there are at least MIN_SHARED of them, appends the group (group * B * H +
    batch * H + KV head) to plan and its blocks to plan_blocks [*, NP] (-1 past them), at an index
    taken from the counter plan_len. Writes the walk's rows into rest either way (`_rest_rows`).
    Below MIN_SHARED the walk does it all: dq over the forced blocks alone (0 and the one before
    the group's own) costs a pass more than it saves the walk. The pass takes the groups in
    whatever order they were appended; each group's dq comes from one program alone, so the
    order changes no bit. STORED_DS: also writes, per query, the slots whose blocks the pass
    takes as bits into passed_slots [B, T, H] (int64), so that the dK dV pass stores no dS for
    them (`_dq_ds_kernel` never reads it)."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    base = (OFF // TT + tl.program_id(0).to(tl.int64)) * TT
    rows, real, toks = _group_rows(bidx, b, h, base, OFF, T, N, H, TT, NP)
    # the group's own block stays with the walk, which masks its keys per query anyway
    listed, count = _shared_list(rows, real, base // SEL - 1)
    count = tl.where(count >= MIN_SHARED, count, 0)
    _rest_rows(rest, rows, real, listed, count, toks, b, h, T, N, H, base // SEL)
    if STORED_DS:
        bits = tl.where(_listed_slots(rows, listed, count),
                        tl.full([1, NP], 1, tl.int64) << tl.arange(0, NP)[None, :].to(tl.int64), 0)
        tl.store(passed_slots + (b * T + toks) * H + h, tl.sum(bits, axis=1), mask=real)
    if count > 0:
        at = tl.atomic_add(plan_len, 1)
        tl.store(plan + at, tl.program_id(0).to(tl.int64) * tl.num_programs(1) + bh)
        slots = tl.arange(0, NP)
        tl.store(plan_blocks + at * NP + slots, tl.where(slots < count, listed, -1))


@triton.jit
def _shared_dq_kernel(q, k, v, o, do, lse, dlse, delta, gate, dq, plan, plan_blocks, plan_len,
                      OFF, NBH,
                      sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
                      sdo_b, sdo_t, sdo_h, sdq_b, sdq_t, sdq_h, T, scale, qk_scale,
                      H: tl.constexpr, G: tl.constexpr, GPD: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr,
                      SEL: tl.constexpr, BN: tl.constexpr, TT: tl.constexpr, NP: tl.constexpr,
                      HAS_DLSE: tl.constexpr, PREC: tl.constexpr, DELTA_DONE: tl.constexpr,
                      HAS_GATE: tl.constexpr):
    """The forward's shared pass (`_shared_fwd_kernel`) for dq: for each group of TT queries
    `_dq_plan_kernel` planned, the dq of its TT x G rows as one tile over the blocks before
    their own that all of them selected, scaled, in dq's dtype, into dq, for the walk
    (`_dq_kernel` or `_dq_ds_kernel`, TT > 0) to add to, and their delta = rowsum(dO * O) -
    dlse, which the walk then need not work out again (DELTA_DONE: read from delta, where a
    pass of its own wrote every row's). HAS_GATE: dO is scaled by the rows' gates
    (`utils.unscaled_do_gate`).
    Persistent: the programs stride over the plan, whose length only the GPU knows, so that a
    plan with few groups (random selections) costs no launch of one program per group."""
    scale = tl.cast(scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    NSUB: tl.constexpr = (SEL + BN - 1) // BN
    for i in range(tl.program_id(0), tl.load(plan_len), tl.num_programs(0)):
        at = tl.load(plan + i)
        b = (at % NBH) // H
        h = at % NBH % H
        base = (OFF // TT + at // NBH) * TT
        listed = tl.load(plan_blocks + i * NP + tl.arange(0, NP))
        toks, rmask, heads = _group_tile(base, OFF, T, h, G, GPD, TT)
        qt = _load_tile(q, b * sq_b + toks * sq_t + heads * sq_h, rmask, DK, DKP)
        dot_ = _load_tile(do, b * sdo_b + toks * sdo_t + heads * sdo_h, rmask, DV, DVP)
        stat = (b * T + toks) * (H * G) + heads
        if DELTA_DONE:
            dlt = tl.load(delta + stat, mask=rmask, other=0.0)
        else:
            ot = _load_tile(o, b * so_b + toks * so_t + heads * so_h, rmask, DV, DVP)
            dlt = _delta(dot_, ot, dlse, stat, rmask, HAS_DLSE)
            tl.store(delta + stat, dlt, mask=rmask)
        lse2 = _lse_log2(tl.load(lse + stat, mask=rmask, other=float("-inf")))
        acc = tl.zeros([TT * GPD, DKP], tl.float32)
        # blocks before the group's own: every key is visible to every query of the group
        for it in range(tl.sum((listed >= 0).to(tl.int32), axis=0) * NSUB):
            offs, keys = _listed_keys(listed, it, SEL, BN)
            kmask = offs < SEL
            kt, vt = _kv_tiles(k, v, b, keys, h, kmask, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                               DK, DV, DKP, DVP)
            acc = _dq_step(qt, dot_, kt, vt, kmask, lse2, dlt, acc, qk_scale, PREC)
        acc *= _row_gates(gate, stat, rmask, scale, HAS_GATE)[:, None]
        _store_tile(dq, b * sdq_b + toks * sdq_t + heads * sdq_h, rmask, acc, DK, DKP)


@triton.jit
def _row_gates(gate, stat, mask, scale, HAS_GATE: tl.constexpr):
    """The factor a dq row takes last: scale, times the row's gate where dO comes unscaled
    (HAS_GATE, `utils.unscaled_do_gate`)."""
    if HAS_GATE:
        return tl.load(gate + stat, mask=mask, other=0.0) * scale
    return tl.full(stat.shape, 1.0, tl.float32) * scale


@triton.jit
def _pass_took(row, N, NP: tl.constexpr, TT: tl.constexpr):
    """Whether dq's shared pass (`_shared_dq_kernel`) took any of the query's blocks and wrote
    its dq rows, which its `_rest_rows` row then marks (-3); never without the pass (TT = 0)."""
    if TT > 0:
        slots = tl.arange(0, NP)
        return tl.max((tl.load(row + slots, mask=slots < N, other=-1) < -1).to(tl.int32),
                      axis=0) > 0
    return tl.zeros([], tl.int1)


@triton.jit
def _group_program(H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """(t, b, h, query heads [GP], their mask) of a per-token dq program: query token t (grid
    axis 0) of batch b and KV head h (axis 1, b * H + h), the G heads of its group padded to GP."""
    t = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1)
    # int64: head offsets of head-major inputs (stride T * D) pass 2**31 at long T
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    g = tl.arange(0, GP)
    return t, b, h, h * G + g, g < G


@triton.jit
def _store_dq(acc, dq, dq_add0, dq_add1, rows, gmask, passed, DK: tl.constexpr,
              DKP: tl.constexpr, ADDS: tl.constexpr, TT: tl.constexpr):
    """Writes a walk's dq rows (acc, scaled): plus what dq's shared pass wrote there (passed)
    and the first ADDS of dq_add0, dq_add1, in fp32, rounded once."""
    if TT > 0:
        acc += _load_tile(dq, rows, tl.where(passed, gmask, False), DK, DKP).to(tl.float32)
    if ADDS > 0:
        acc += _load_tile(dq_add0, rows, gmask, DK, DKP).to(tl.float32)
    if ADDS > 1:
        acc += _load_tile(dq_add1, rows, gmask, DK, DKP).to(tl.float32)
    _store_tile(dq, rows, gmask, acc, DK, DKP)


@triton.jit
def _dq_kernel(q, k, v, o, do, lse, dlse, delta, gate, dq, dq_add0, dq_add1, bidx, cu_q, cu_k,
               OFF, NSEQ, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
               sdo_b, sdo_t, sdo_h, sdq_b, sdq_t, sdq_h,
               T, N, scale, qk_scale,
               H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr,
               DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, SEL: tl.constexpr,
               BN: tl.constexpr, NP: tl.constexpr, IS_VARLEN: tl.constexpr,
               HAS_DLSE: tl.constexpr, ADDS: tl.constexpr, TT: tl.constexpr,
               PREC: tl.constexpr, HAS_GATE: tl.constexpr, DELTA_DONE: tl.constexpr):
    """dq of one (token, group), plus the first ADDS of dq_add0, dq_add1 (gradients laid out
    like dq); also writes delta = rowsum(dO * O) - dlse for the dk/dv pass, unless DELTA_DONE
    (the caller gave every row's: O goes unread). HAS_GATE: dO is scaled by the rows' gates
    (`utils.unscaled_do_gate`). TT > 0 (fixed length): the dq pass over groups of TT queries
    (`_shared_dq_kernel`) ran, bidx holds its `_rest_rows`, and dq its share where it took any
    blocks (marked -3 in the row)."""
    # AOTInductor passes Python floats as fp64
    scale = tl.cast(scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    t, b, h, heads, gmask = _group_program(H, G, GP)
    qt = _load_tile(q, b * sq_b + t * sq_t + heads * sq_h, gmask, DK, DKP)
    dot_ = _load_tile(do, b * sdo_b + t * sdo_t + heads * sdo_h, gmask, DV, DVP)
    row, kept, first_slot, n_walk, start, last, _ = _token_blocks(
        bidx, cu_q, cu_k, OFF, NSEQ, b, t, h, T, N, H, NP, IS_VARLEN, SEL, TT)
    passed = _pass_took(row, N, NP, TT)  # (and wrote the rows' delta)
    stat = (b * T + t) * (H * G) + heads
    if DELTA_DONE:
        dlt = tl.load(delta + stat, mask=gmask, other=0.0)
    else:
        mine = tl.where(passed, False, gmask)
        ot = _load_tile(o, b * so_b + t * so_t + heads * so_h, mine, DV, DVP)
        dlt = _delta(dot_, ot, dlse, stat, mine, HAS_DLSE)
        dlt += tl.load(delta + stat, mask=tl.where(passed, gmask, False), other=0.0)
        tl.store(delta + stat, dlt, mask=mine)
    lse2 = _lse_log2(tl.load(lse + stat, mask=gmask, other=float("-inf")))

    acc = tl.zeros([GP, DKP], tl.float32)
    NSUB: tl.constexpr = (SEL + BN - 1) // BN
    for it in range(first_slot * NSUB, n_walk * NSUB):
        _, toks, kmask = _tile_keys(row, kept, it, start, last, SEL, BN, NP)
        kt, vt = _kv_tiles(k, v, b, toks, h, kmask, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                           DK, DV, DKP, DVP)
        acc = _dq_step(qt, dot_, kt, vt, kmask, lse2, dlt, acc, qk_scale, PREC)
    acc *= _row_gates(gate, stat, gmask, scale, HAS_GATE)[:, None]
    _store_dq(acc, dq, dq_add0, dq_add1, b * sdq_b + t * sdq_t + heads * sdq_h, gmask,
              passed, DK, DKP, ADDS, TT)


@triton.jit
def _dq_ds_kernel(k, ds, dq, dq_add0, dq_add1, bidx, orig, cu_q, cu_k, OFF, NSEQ,
                  sk_b, sk_t, sk_h, sdq_b, sdq_t, sdq_h, T, N, scale,
                  H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr,
                  DKP: tl.constexpr, SEL: tl.constexpr, BN: tl.constexpr, NP: tl.constexpr,
                  IS_VARLEN: tl.constexpr, ADDS: tl.constexpr, TT: tl.constexpr,
                  PREC: tl.constexpr):
    """dq of one (token, group) as the sum over its selected keys of dS K, with dS as the dK dV
    pass stored it (`_dkdv_kernel`, STORE_DS; ds [B, T, H, N, SEL, G] by the slot of the block
    in block_idx): only K is read, one dot per tile, where `_dq_kernel` reads K and V and works
    P and dS out again. Adds dq_add0 / dq_add1 as `_dq_kernel` does. TT > 0: the shared pass ran,
    bidx holds its `_rest_rows` and orig the block_idx rows, where a block's slot is found."""
    scale = tl.cast(scale, tl.float32)
    t, b, h, heads, gmask = _group_program(H, G, GP)
    row, kept, first_slot, n_walk, start, last, _ = _token_blocks(
        bidx, cu_q, cu_k, OFF, NSEQ, b, t, h, T, N, H, NP, IS_VARLEN, SEL, TT)
    passed = _pass_took(row, N, NP, TT)
    slots = tl.arange(0, NP)
    if TT > 0:
        named = tl.load(orig + ((b * T + t) * H + h) * N + slots, mask=slots < N, other=-1)
    g = heads - h * G
    ds_rows = ((b * T + t) * H + h) * N

    accT = tl.zeros([DKP, GP], tl.float32)
    NSUB: tl.constexpr = (SEL + BN - 1) // BN
    for it in range(first_slot * NSUB, n_walk * NSUB):
        first, toks, kmask = _tile_keys(row, kept, it, start, last, SEL, BN, NP)
        if TT > 0:  # the first slot naming the walk's block: the one the dK dV pass wrote
            blk = _slot_block(row, kept, it // NSUB, NP)
            slot = tl.min(tl.where(named == blk, slots, NP), axis=0)
        else:
            slot = it // NSUB
        sub = (it % NSUB) * BN + tl.arange(0, BN)
        ktT = _load_tile_t(k, b * sk_b + toks * sk_t + h * sk_h, kmask, DK, DKP)
        # dS whole: the dK dV pass wrote every key of a block the query sees (zeros past the
        # query, where K loads zeros too), so a mask per head (the group's where the pass
        # stored the block, else none) keeps the loads 16 bytes wide; a key mask made them
        # 2-byte loads (ncu, H200: a fifth of the kernel's stalls). A bound, not an & with a
        # scalar: the interpreter's broadcast & of booleans gives int32
        dmask = (g < tl.where(first - (it % NSUB) * BN <= last, G, 0))[None, :]
        if SEL % BN != 0:  # the block's last tile runs past its end, into the next slot
            dmask = dmask & (sub < SEL)[:, None]
        dsT = tl.load(ds + ((ds_rows + slot) * (SEL * G) + g)[None, :] + (sub * G)[:, None],
                      mask=dmask, other=0.0)
        accT += tl.dot(ktT, dsT, input_precision=PREC)
    acc = tl.trans(accT)
    _store_dq(acc * scale, dq, dq_add0, dq_add1, b * sdq_b + t * sdq_t + heads * sdq_h, gmask,
              passed, DK, DKP, ADDS, TT)


@triton.jit
def _dkdv_rows(q, do, lse, delta, gate, ds, ent_tok, ent_pos, ent_slot, passed_slots, e_start,
               e_stop, e1, b, h, offs, toks32, kt, vt, dk_acc, dv_acc, sq_b, sq_t, sq_h, sdo_b,
               sdo_t, sdo_h, T, N, qk_scale, H: tl.constexpr, G: tl.constexpr,
               GP2: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
               DVP: tl.constexpr, SEL: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr,
               STORE_DS: tl.constexpr, SKIP_PASSED: tl.constexpr, HAS_GATE: tl.constexpr,
               CAUSAL: tl.constexpr):
    """`_dkdv_kernel`'s steps over the chunk's entries e_start:e_stop (of e1), [BM] rows a
    step, in transposed form (scores as [BN, BM]: P^T and dS^T feed the dk / dv dots directly).
    CAUSAL: some row precedes some key, where P and dS are zeroed (dP of a key the row does not
    see may be non-finite, its V); without it rows see the whole tile."""
    QPT: tl.constexpr = BM // GP2
    r = tl.arange(0, BM)
    g = r % GP2
    heads = h * G + g
    # each step's query tokens come from the step before: the gathers' addresses then wait on
    # no load of their own step
    ent = e_start + r // GP2
    tq_next = tl.load(ent_tok + ent, mask=ent < e1, other=-1)
    for e in range(e_start, e_stop, QPT):
        ent = e + r // GP2
        tq = tq_next.to(tl.int64)
        tq_next = tl.load(ent_tok + ent + QPT, mask=ent + QPT < e1, other=-1)
        rmask = (tq >= 0) & (g < G)  # -1: past the chunk, or a row's repeat of the block
        if STORE_DS:  # loaded early, used late
            slot = tl.load(ent_slot + ent, mask=rmask, other=0).to(tl.int64)
            if SKIP_PASSED:
                passed = tl.load(passed_slots + (b * T + tq) * H + h, mask=rmask, other=0)
        qT = _load_tile_t(q, b * sq_b + tq * sq_t + heads * sq_h, rmask, DK, DKP)
        dot_ = _load_tile(do, b * sdo_b + tq * sdo_t + heads * sdo_h, rmask, DV, DVP)
        stat = (b * T + tq) * (H * G) + heads
        # rows past the chunk or repeats load lse = -inf, so exp2 gives them P = 0
        lse2 = _lse_log2(tl.load(lse + stat, mask=rmask, other=float("-inf")))
        dlt = tl.load(delta + stat, mask=rmask, other=0.0)
        pT = tl.exp2(tl.dot(kt, qT, input_precision=PREC) * qk_scale - lse2[None, :])
        if CAUSAL:
            seen = toks32[:, None] <= tl.load(ent_pos + ent, mask=rmask, other=0)[None, :]
            pT = tl.where(seen, pT, 0.0)
        if HAS_GATE:
            pT = pT * tl.load(gate + stat, mask=rmask, other=0.0)[None, :]
        dv_acc += tl.dot(pT.to(dot_.dtype), dot_, input_precision=PREC)
        dpT = tl.dot(vt, tl.trans(dot_), input_precision=PREC)
        dsT = pT * (dpT - dlt[None, :])
        if CAUSAL:
            dsT = tl.where(seen, dsT, 0.0)
        dsT = dsT.to(qT.dtype)
        dk_acc += tl.dot(dsT, tl.trans(qT), input_precision=PREC)
        if STORE_DS:
            store = rmask
            if SKIP_PASSED:
                store = store & (((passed >> slot) & 1) == 0)
            at = (((b * T + tq) * H + h) * N + slot) * (SEL * G) + g
            tl.store(ds + at[None, :] + (offs * G)[:, None], dsT,
                     mask=store[None, :] & (offs[:, None] < SEL))
    return dk_acc, dv_acc


@triton.jit
def _dkdv_kernel(q, k, v, do, lse, delta, gate, dk, dv, ds, chunks, ent_tok, ent_pos, ent_slot,
                 passed_slots, sync,
                 sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sdo_b, sdo_t, sdo_h,
                 T, TK, N, scale, qk_scale,
                 H: tl.constexpr, G: tl.constexpr, GP2: tl.constexpr, DK: tl.constexpr,
                 DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, SEL: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, CE: tl.constexpr, PREC: tl.constexpr,
                 ORDERED: tl.constexpr, STORE_DS: tl.constexpr, SKIP_PASSED: tl.constexpr,
                 HAS_GATE: tl.constexpr):
    """Partial dk/dv of one key tile from one chunk of the queries that selected its block.

    chunks[pid] = (first entry, end entry, b * H + h, first token of the block), int64; entries
    ent_tok[e0:e1] are the query tokens, ascending (-1: a repeat, skipped), ent_pos[e0:e1] the
    key positions they sit at (T queries over TK keys). Rows of a [BM, *] tile are (query, head)
    pairs. ORDERED (the deterministic mode, kernels/ordered.py): a 1-D grid of tickets,
    chunk-major, and the chunks of one block add into dk/dv in chunk order instead of
    atomically. STORE_DS: also writes each row's dS (unscaled, in q's dtype, as the dK dot takes
    it) into ds [B, T, H, N, SEL, G] at the slot ent_slot names, for `_dq_ds_kernel`;
    SKIP_PASSED: not for the slots `_dq_plan_kernel` marked in passed_slots (dq's shared pass
    took their blocks). HAS_GATE: dO is scaled by the rows' gates (`utils.unscaled_do_gate`): P
    takes them (and so the dS stored). CE: a power of two no smaller than any chunk's entries
    (the index's queries_per_chunk), over which a chunk's causal ones are counted.
    """
    # AOTInductor passes Python floats as fp64
    scale = tl.cast(scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    NT: tl.constexpr = (SEL + BN - 1) // BN
    if ORDERED:
        ticket = ordered.take_ticket(sync)
        pid = ticket // NT
        tile = ticket % NT
    else:
        pid = tl.program_id(0)
        tile = tl.program_id(1)
    e0 = tl.load(chunks + pid * 4)
    e1 = tl.load(chunks + pid * 4 + 1)
    if e1 > e0:
        bh = tl.load(chunks + pid * 4 + 2)
        b = bh // H
        h = bh % H
        # keys past the chunk's last query get nothing from it (and stay inside the sequence)
        t_last = tl.load(ent_pos + e1 - 1)
        offs = tile * BN + tl.arange(0, BN)
        block_first = tl.load(chunks + pid * 4 + 3)
        toks = block_first + offs
        kmask = toks <= t_last
        if SEL % BN != 0:  # the block's last tile runs past its end
            kmask = kmask & (offs < SEL)
        kt = _load_tile(k, b * sk_b + toks * sk_t + h * sk_h, kmask, DK, DKP)
        vt = _load_tile(v, b * sv_b + toks * sv_t + h * sv_h, kmask, DV, DVP)

        toks32 = toks.to(tl.int32)  # key positions < 2**31: 32-bit compares
        # the tile's last key, masked or not: a tile running past t_last (or past the block)
        # always takes the causal mask below, which zeroes its keys past every query
        key_last = (block_first + tile * BN + BN - 1).to(tl.int32)
        dk_acc = tl.zeros([BN, DKP], tl.float32)
        dv_acc = tl.zeros([BN, DVP], tl.float32)
        # only entries before the tile's last key need the causal mask: ascending, the chunk's
        # first ones, which a loop of their own takes, so that the others never compare (the
        # mask's compares were a tenth of the loop's SASS, and kept on the others' path)
        QPT: tl.constexpr = BM // GP2  # queries per tile
        firsts = e0 + tl.arange(0, CE)
        causal_entries = tl.sum((tl.load(ent_pos + firsts, mask=firsts < e1, other=key_last)
                                 < key_last).to(tl.int32), 0)
        e_split = tl.minimum(e0 + (causal_entries + QPT - 1) // QPT * QPT, e1)
        dk_acc, dv_acc = _dkdv_rows(
            q, do, lse, delta, gate, ds, ent_tok, ent_pos, ent_slot, passed_slots, e0, e_split,
            e1, b, h, offs, toks32, kt, vt, dk_acc, dv_acc, sq_b, sq_t, sq_h, sdo_b, sdo_t,
            sdo_h, T, N, qk_scale, H, G, GP2, DK, DV, DKP, DVP, SEL, BM, PREC, STORE_DS,
            SKIP_PASSED, HAS_GATE, True)
        dk_acc, dv_acc = _dkdv_rows(
            q, do, lse, delta, gate, ds, ent_tok, ent_pos, ent_slot, passed_slots, e_split, e1,
            e1, b, h, offs, toks32, kt, vt, dk_acc, dv_acc, sq_b, sq_t, sq_h, sdo_b, sdo_t,
            sdo_h, T, N, qk_scale, H, G, GP2, DK, DV, DKP, DVP, SEL, BM, PREC, STORE_DS,
            SKIP_PASSED, HAS_GATE, False)

        kcols = tl.arange(0, DKP)
        vcols = tl.arange(0, DVP)
        out = (b * TK + toks) * H + h
        dk_ptr = dk + out[:, None] * DK + kcols[None, :]
        dv_ptr = dv + out[:, None] * DV + vcols[None, :]
        dk_mask = kmask[:, None] & (kcols[None, :] < DK)
        dv_mask = kmask[:, None] & (vcols[None, :] < DV)
        if ORDERED:
            # the previous chunk of the same block (chunks of a block are consecutive)
            # chunk 0 reads its own row: & does not short-circuit, and the 16 bytes before
            # chunks may be unmapped (an illegal address at 64k on an H200)
            prev = tl.maximum(pid - 1, 0) * 4
            same_block = (pid > 0) & (tl.load(chunks + prev + 2) == bh) & \
                (tl.load(chunks + prev + 3) == block_first)
            if same_block:
                ordered.wait_for(sync, ticket - NT)
            # .cg: read what the previous chunk wrote through L2, not a stale L1 line
            tl.store(dk_ptr, tl.load(dk_ptr, mask=dk_mask, cache_modifier=".cg") +
                     dk_acc * scale, mask=dk_mask)
            tl.store(dv_ptr, tl.load(dv_ptr, mask=dv_mask, cache_modifier=".cg") + dv_acc,
                     mask=dv_mask)
        else:
            tl.atomic_add(dk_ptr, dk_acc * scale, mask=dk_mask, sem="relaxed")
            tl.atomic_add(dv_ptr, dv_acc, mask=dv_mask, sem="relaxed")
    if ORDERED:
        ordered.pass_turn(sync, ticket)


# --------------------------------------------------------------------------------------------
# Host side: shapes, configs, the inverse index
# --------------------------------------------------------------------------------------------

def _key_tile(sel_block: int, cap: int) -> int:
    """Keys per tile, at most cap: the largest power of two dividing l' if that is >= 16 (tl.dot's
    minimum), else l' padded to a power of two with the block's tail masked (l' = 24, 40, ...)."""
    divisor = sel_block & -sel_block
    return min(cap, divisor if divisor >= 16 else pow2(sel_block, 16))


def _key_tile_size(kernel: str, sel_block: int, dkp: int, dvp: int) -> int:
    """Keys per tile of the forward ("fwd": pointer loads, "fwd_tma": TMA loads) / dq ("dq"; from
    stored dS "dq_ds"): 32 forward (16 through TMA for wide heads, `_wide`), up to 64 dq (32 for
    very wide heads, to bound the K/V tiles), 64 dq from dS (K alone); measured with
    `_PER_TOKEN_PICK`."""
    if kernel == "dq":
        return _key_tile(sel_block, 64 if dkp + dvp <= 384 else 32)
    if kernel == "dq_ds":
        return _key_tile(sel_block, 64)
    return _key_tile(sel_block, 16 if kernel == "fwd_tma" and _wide(dkp, dvp) else 32)


def _dkdv_config(dtype: torch.dtype, sel_block: int, dkp: int, dvp: int, gp2: int
                 ) -> tuple[int, int, int, int]:
    """(keys per tile BN, query rows per tile BM, num_warps, num_stages) of the dk/dv kernel.

    The fp32 [BN, D] dk and dv accumulators live in registers, so wide heads and fp32 inputs
    halve BN. Narrow 16-bit heads: measured on an H100 at T=64k, bf16, D=128, G=16, l'=64, BN=64
    (kernel alone, .gpu-style sweep): BM=32 with (warps, stages) (4, 2) 15.30 ms, (4, 3) 15.90,
    (4, 4) 15.89, capped at 232 registers 16.41, (8, 3) 35.0, (2, 3) 65.3; BM=64 (4, 3) 17.57;
    BM=16 19.8-20.7. fp32 (dots on CUDA cores), whole backward at T=8k, without dq's shared
    pass: D=128 (32, 32, 4, 2) 94.3 ms against (64, 32, 8, 2) 97.5, 113.8-118.6 for (16, 32,
    4, 2), (32, 16, 4, 2), (16, 16, 2, 2), (32, 32, 8, 2), and 631.7-775.7 for BM=64; D=256
    (32, 16, 8, 2) 298.8 against (16, 16, 4, 2) 297.3, (16, 32, 8, 2) 300.4 and (32, 32, 4, 2)
    442.1 (31 KB spilled a thread). Wide 16-bit heads, whole backward at T=16k, G=16, random
    selections, one sweep (H100, `e3216d1` with each config swapped in): Dk=192 with Dv=128
    (64, 64, 8, 2) 15.50-15.71 ms, (64, 16, 4, 2) 15.08, (64, 64, 8, 3) 15.55, (64, 32, 4, 2)
    16.34, (64, 32, 8, 2) 16.65, against 20.88-21.16 for the (32, 64, 8, 2) they had (sized from
    ptxas reports) and 17.10-35.89 for ten others ((64, 128, 8, 2) asks too much shared
    memory); D=256 (64, 32, 8, 2) 10.51, (64, 64, 8, 2) 11.21, (32, 32, 4, 2) 11.75, against
    12.00 and 13.0-15.8 for six others. Heads wider still keep (32, 64, 8, 2), unmeasured.
    Storing dS (whole stored backward, three interleaved rounds at `bf10887`, 64k random /
    runs of 64 alike): (64, 32, 4, 2) 29.12-29.16 / 25.01-25.27 ms, (64, 32, 4, 3) 30.35-30.87 /
    26.12-26.33, (64, 16, 4, 2) 33.82-33.83 / 29.80-30.04, (64, 32, 8, 2) 47.58-47.59 /
    42.93-43.15: the pick stays. Since each step's query tokens come from the step before
    (`_dkdv_rows`), a third stage prefetches whole steps ahead (H200, stored backward, three
    interleaved rounds, dK dV kernel alone, 8k / 64k random / 64k runs of 64 alike): (64, 32,
    4, 2) 1.68-1.72 / 14.68-15.86 / 13.09-13.45 ms, (64, 32, 4, 3) 1.65-1.67 / 14.25-14.97 /
    12.94-13.34.
    """
    wide, width = _wide(dkp, dvp), dkp + dvp
    if cuda_core_dots(dtype):
        return _key_tile(sel_block, 32), max(16 if wide else 32, gp2), 8 if wide else 4, 2
    if not wide:
        return _key_tile(sel_block, 64), max(32, gp2), 4, 3
    if width <= 512:
        return _key_tile(sel_block, 64), max(64 if width <= 384 else 32, gp2), 8, 2
    return _key_tile(sel_block, 32), max(64, gp2), 8, 2


def _strides(x: Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


class _Queries(NamedTuple):
    """Where each of the Tq queries sits among the Tk keys (bottom-right aligned, see
    reference.query_layout). Fixed-length kernels need only off = Tk - Tq; packed ones find each
    query's sequence in-kernel from the offsets (`kernel_args`)."""
    Tq: int
    Tk: int
    cu_seqlens: Optional[Tensor]
    cu_seqlens_k: Optional[Tensor]

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    def span(self, rows: slice) -> "_Queries":
        """The queries of rows (a `_spans` window) over the keys up to their last one's (fixed
        length, when rows cut them)."""
        if rows == slice(None):
            return self
        if self.varlen:
            raise ValueError("packed sequences are not cut into query windows")
        return _Queries(rows.stop - rows.start, rows.stop + self.Tk - self.Tq, None, None)

    def kernel_args(self, placeholder: Tensor) -> tuple:
        """(cu_q, cu_k, OFF, NSEQ) for the per-token kernels: the offsets unread for fixed
        length."""
        if not self.varlen:
            return placeholder, placeholder, self.Tk - self.Tq, 0
        cu_k = self.cu_seqlens if self.cu_seqlens_k is None else self.cu_seqlens_k
        return self.cu_seqlens, cu_k, 0, self.cu_seqlens.numel() - 1


def _check(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, sel_block: int,
           cu_seqlens: Optional[Tensor]) -> None:
    """What the launchers rely on (the ops validate fully before routing here)."""
    B, T, HQ, _ = q.shape
    H = k.shape[2]
    if H == 0 or HQ % H:
        raise ValueError(f"q heads HQ={HQ} must be a multiple of k heads H={H}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if sel_block <= 0:
        raise ValueError(f"sel_block must be a positive int, got {sel_block}")
    if tuple(block_idx.shape[:3]) != (B, T, H):
        raise ValueError(f"block_idx must be [B, T, H, n] with (B, T, H) = {(B, T, H)}, got "
                         f"{tuple(block_idx.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"q must have B == 1 with cu_seqlens (packed sequences), got B={B}")


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def _outputs(out: Optional[tuple[Tensor, Tensor]], o_shape: tuple, q: Tensor
             ) -> tuple[Tensor, Tensor]:
    """The forward's (o, lse): out checked against what the kernels write (o with a unit last
    stride, lse dense, which they index as rows of HQ), or new tensors."""
    if out is None:
        return (torch.empty(o_shape, dtype=q.dtype, device=q.device),
                torch.empty(o_shape[:3], dtype=torch.float32, device=q.device))
    o, lse = out
    if o.shape != o_shape or o.dtype != q.dtype or o.device != q.device or o.stride(-1) != 1:
        raise ValueError(f"out[0] (o) must be {o_shape} {q.dtype} on {q.device} with a unit last "
                         f"stride, got {tuple(o.shape)} {o.dtype} on {o.device}, strides "
                         f"{o.stride()}")
    if lse.shape != o_shape[:3] or lse.dtype != torch.float32 or lse.device != q.device or \
            not lse.is_contiguous():
        raise ValueError(f"out[1] (lse) must be a contiguous {o_shape[:3]} float32 tensor on "
                         f"{q.device}, got {tuple(lse.shape)} {lse.dtype} on {lse.device}, "
                         f"strides {lse.stride()}")
    return o, lse


def selection_attention_fwd(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, sel_block: int,
                            scale: float, cu_seqlens: Optional[Tensor] = None, *,
                            cu_seqlens_k: Optional[Tensor] = None,
                            tma: Optional[bool] = None,
                            shared: Optional[bool] = None,
                            out: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor]:
    """o [B,T,HQ,Dv] (q.dtype), lse [B,T,HQ] float32; rows that see nothing: o = 0, lse = -inf.
    k/v may be longer than q: queries sit at the end of their keys (cu_seqlens_k for varlen).
    tma: read K/V through TMA descriptors (None: where `_tma_loads` allows, never for fp32; the
    CPU tests force it under the Triton interpreter). shared: run the shared pass first
    (`_shared_fwd_kernel`; None: where `_shared_pass` allows, never for fp32). out: (o, lse)
    buffers to write and return instead of new ones (Inductor's, when the compiled forward picks
    this kernel)."""
    _check(q, k, v, block_idx, sel_block, cu_seqlens)
    B, T, HQ = q.shape[:3]
    o, lse = _outputs(out, (B, T, HQ, v.shape[3]), q)
    _forward(q, k, v, block_idx, sel_block, scale, cu_seqlens, cu_seqlens_k, tma, shared, o, lse)
    return o, lse


def selection_attention_gated_fwd(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor,
                                  sel_block: int, scale: float,
                                  cu_seqlens: Optional[Tensor] = None, *,
                                  o_cmp: Tensor, o_win: Optional[Tensor], g_cmp: Tensor,
                                  g_slc: Tensor, g_win: Optional[Tensor], keep_branch: bool,
                                  cu_seqlens_k: Optional[Tensor] = None,
                                  tma: Optional[bool] = None, shared: Optional[bool] = None
                                  ) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """nsa_attention's last forward step: (o, o_slc, lse_slc), o the gated combine of the three
    branches (`nsa_ops.kernels.gate`, in q's dtype: the other branches' outputs and the gates
    must promote to it) written by the forward's epilogue, so that the branch's output need not
    go through memory to a combine pass; o_slc the branch's own output where keep_branch (a
    backward reads it), else None. H100, bf16, spec geometry, T = 64k: the combine pass took
    1.39 ms of the 35.8 ms forward. Arguments otherwise as `selection_attention_fwd`'s."""
    _check(q, k, v, block_idx, sel_block, cu_seqlens)
    B, T, HQ = q.shape[:3]
    o_slc, lse = _outputs(None, (B, T, HQ, v.shape[3]), q)
    # without the branch's output the pass's partial output and the combine share one buffer
    o = torch.empty_like(o_slc) if keep_branch else o_slc
    _forward(q, k, v, block_idx, sel_block, scale, cu_seqlens, cu_seqlens_k, tma, shared,
             o_slc, lse, (o, o_cmp, o_win, g_cmp, g_slc, g_win))
    return o, o_slc if keep_branch else None, lse


def _forward(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, sel_block: int, scale: float,
             cu_seqlens: Optional[Tensor], cu_seqlens_k: Optional[Tensor], tma: Optional[bool],
             shared: Optional[bool], o: Tensor, lse: Tensor,
             gated: Optional[tuple] = None) -> None:
    """The forward's launches, writing o and lse; gated: (og, o_cmp, o_win, g_cmp, g_slc,
    g_win), the combine to write into og (`selection_attention_gated_fwd`), where og is o the
    branch's own output is not kept."""
    B, T, HQ, Dk = q.shape
    Tk, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    n = block_idx.shape[3]
    if o.numel() == 0:
        lse.fill_(float("-inf"))
        return
    q, k, v = (unit_last_stride(x) for x in (q, k, v))
    bidx = block_idx.to(torch.int32).contiguous()
    queries = _Queries(T, Tk, cu_seqlens, cu_seqlens_k)
    dkp, dvp = pow2(Dk, 16), pow2(Dv, 16)
    tma = _tma_loads(tma, k, v, sel_block, _key_tile_size("fwd_tma", sel_block, dkp, dvp))
    constants = forward_constants(HQ, H, Dk, Dv, n, sel_block, q.dtype, tma)
    group = _shared_pass(shared, _shared_reason(queries.varlen, HQ // H, constants["BN"], tma),
                         HQ // H, constants["BN"], q.dtype)
    qk_scale = scale * LOG2E.value
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(o))
    kv = tma_descriptors(k, v, constants["BN"], constants["DKP"], constants["DVP"]) if tma \
        else (k, v)
    if group:
        off = Tk - T
        shared_constants = dict(constants, GPD=pow2(HQ // H))
        del shared_constants["GP"]
        rest = torch.empty_like(bidx)
        groups = _num_groups(T, off, group)
        listed = torch.empty(B * H, groups, constants["NP"], dtype=torch.int32, device=q.device)
        launch(_shared_plan_kernel)[(groups, B * H)](
            bidx, rest, listed, off, T, n, H=H, SEL=sel_block, TT=group, NP=constants["NP"],
            num_warps=_plan_warps(group, constants["NP"]))
        launch(_shared_fwd_kernel)[(groups, B * H)](
            q, k, v, *kv, o, lse, listed, off, *strides, T, qk_scale, TT=group,
            **shared_constants, **launch_options(*_SHARED_PICK["wide" if _wide(dkp, dvp)
                                                               else "narrow"]))
    if gated is None:  # the combine's arguments go unread
        combine = (o, o, o, lse, lse, lse, 0, 0, 0)
        flags = dict(GATED=False, HAS_WIN=False, KEEP_BRANCH=True)
    else:
        og, o_cmp, o_win, g_cmp, g_slc, g_win = gated
        combine = (og, *gated_rows_args(o_cmp, o_win, g_cmp, g_slc, g_win))
        flags = dict(GATED=True, HAS_WIN=o_win is not None, KEEP_BRANCH=og is not o)
    launch(_fwd_kernel)[(T, B * H)](
        q, k, v, *kv, o, lse, rest if group else bidx, *queries.kernel_args(bidx), *strides,
        T, n, qk_scale, *combine, IS_VARLEN=queries.varlen, TMA=tma, TT=group, **constants,
        **flags, **_per_token_launch("fwd_tma" if tma else "fwd", q.dtype, _wide(dkp, dvp)))


def forward_constants(HQ: int, H: int, Dk: int, Dv: int, n: int, sel_block: int,
                      dtype: torch.dtype, tma: bool = False) -> dict:
    """The constexpr arguments of `selection_fwd_rows` for these shapes and loads (tma: through
    TMA descriptors; the Inductor template reads through pointers, as eager pointer loads do, so
    the two tile alike)."""
    dkp, dvp = pow2(Dk, 16), pow2(Dv, 16)
    return dict(H=H, G=HQ // H, GP=pow2(HQ // H, 16), DK=Dk, DV=Dv, DKP=dkp, DVP=dvp,
                SEL=sel_block, NP=pow2(n), PREC=dot_precision(dtype),
                BN=_key_tile_size("fwd_tma" if tma else "fwd", sel_block, dkp, dvp))


class _IndexRecipe(NamedTuple):
    """What an inverse index is built for: `selection_index`'s arguments after the queries,
    and the query windows it is cut into."""
    queries_per_chunk: int
    token_major: bool  # chunks in (KV head, first query) order; False: the deterministic mode's
    with_slots: bool   # the stored-dS backward's ent_slot
    window: Optional[int]  # query tokens per window (`_ds_window`; None: one, all of them)


class KeyChunks(NamedTuple):
    """`selection_index`'s four tensors, for one query window."""
    ent_tok: Tensor
    ent_pos: Tensor
    ent_slot: Optional[Tensor]
    chunks: Tensor


class BackwardIndex(NamedTuple):
    """The dK dV pass's inverse index, one `KeyChunks` per query window, started by
    `backward_index` before the backward needs it. ready: the side stream's event once it is
    built (None: built on the current stream); recipe: what it was built for (`_index_recipe`)."""
    windows: tuple[KeyChunks, ...]
    ready: Optional[torch.cuda.Event]
    recipe: _IndexRecipe


def _spans(T: int, window: Optional[int]) -> list[slice]:
    """The query windows of T queries, window tokens each (None: one, all of them, with no
    arithmetic on T, which a dynamic-length trace keeps symbolic)."""
    if window is None:
        return [slice(None)]
    return [slice(t0, min(T, t0 + window)) for t0 in range(0, T, window)]


def _index_recipe(q: Tensor, k: Tensor, v: Tensor, stored: bool, window: Optional[int],
                  sel_block: int) -> _IndexRecipe:
    """The index the backward of these inputs reads (stored: dS, over windows of window query
    tokens)."""
    gp2 = pow2(q.shape[2] // k.shape[2])
    _, bm, _, _ = _dkdv_config(q.dtype, sel_block, pow2(q.shape[3], 16), pow2(v.shape[3], 16),
                               gp2)
    ordered_adds = torch.are_deterministic_algorithms_enabled()
    return _IndexRecipe(bm // gp2 * max(1, ROWS_PER_CHUNK // bm), not ordered_adds, stored,
                        window)


def _start_index(bidx: Tensor, sel_block: int, queries: _Queries, recipe: _IndexRecipe,
                 fork: Optional[torch.cuda.Event]) -> BackwardIndex:
    """The index of recipe (`kernels/index.py`'s launches, a window at a time) on the side
    stream from event fork (a GPU, eager) or on the current stream (fork None)."""
    side = _index_stream(bidx.device) if fork is not None else None
    if side is not None:
        side.wait_event(fork)
    with torch.cuda.stream(side):  # no-op for None: the current stream
        windows = tuple(KeyChunks(*selection_index(
            bidx[:, rows], sel_block, span.Tk, span.cu_seqlens, span.cu_seqlens_k,
            recipe.queries_per_chunk, recipe.token_major, recipe.with_slots))
            for rows in _spans(queries.Tq, recipe.window) for span in (queries.span(rows),))
        ready = side.record_event() if side is not None else None
    return BackwardIndex(windows, ready, recipe)


def _fork(device: torch.device) -> Optional[torch.cuda.Event]:
    """The event the side stream starts the index from (None: no side stream, the CPU or a
    launch traced for AOTInductor)."""
    if device.type != "cuda" or traced():
        return None
    return torch.cuda.current_stream(device).record_event()


def _ds_choice(q: Tensor, n: int, sel_block: int, queries: _Queries, stored_ds: Optional[bool],
               early_index: bool) -> tuple[bool, Optional[int]]:
    """(whether the backward stores dS, its `_ds_window`) for stored_ds as
    `selection_attention_bwd` takes it."""
    stored = _stored_ds(stored_ds, _stored_ds_reason(q, n, sel_block, queries.varlen),
                        _stored_ds_preferred(q.is_cuda, q.shape[0] * q.shape[1], early_index))
    return stored, _ds_window(q, n, sel_block) if stored else None


def backward_index(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, sel_block: int,
                   cu_seqlens: Optional[Tensor] = None, *,
                   cu_seqlens_k: Optional[Tensor] = None,
                   stored_ds: Optional[bool] = None) -> BackwardIndex:
    """Starts the inverse index `selection_attention_bwd` on these inputs reads (its index=),
    on a GPU on the side stream, so that it builds while other work runs: the eager layer starts
    it before the window and compressed backward (nsa_ops.eager)."""
    _check(q, k, v, block_idx, sel_block, cu_seqlens)
    bidx = block_idx.to(torch.int32).contiguous()
    queries = _Queries(q.shape[1], k.shape[1], cu_seqlens, cu_seqlens_k)
    stored, window = _ds_choice(q, block_idx.shape[3], sel_block, queries, stored_ds, True)
    return _start_index(bidx, sel_block, queries,
                        _index_recipe(q, k, v, stored, window, sel_block), _fork(q.device))


def selection_attention_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                            dlse: Optional[Tensor], block_idx: Tensor, sel_block: int,
                            scale: float, cu_seqlens: Optional[Tensor] = None, *,
                            cu_seqlens_k: Optional[Tensor] = None,
                            dq_add: Sequence[Tensor] = (),
                            shared: Optional[bool] = None,
                            stored_ds: Optional[bool] = None,
                            index: Optional[BackwardIndex] = None,
                            do_gate: Optional[Tensor] = None,
                            delta: Optional[Tensor] = None
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the dtypes of (q, k, v); dlse (float32 [B,T,HQ]) may be None. dq_add: up
    to two gradients shaped like q that dq comes back summed with (the layer's other branches'
    dq), added in fp32 in the dq kernel's epilogue: no pass of their own. shared: run dq's
    shared pass first (`_shared_dq_kernel`; None: where `_shared_pass` allows, never for fp32),
    which hands the walk its share of dq rounded to dq's dtype. stored_ds: the dK dV pass runs
    first and stores dS, from which dq is summed (`_dq_ds_kernel`; None: where
    `_stored_ds_reason` allows and `_stored_ds_preferred` finds it pays; True forces it, False
    works dq out from K and V again); the passes run over windows of `_ds_window` query tokens,
    so that the dS buffer fits its budget. index: the dK dV pass's inverse index as
    `backward_index` started it on the same inputs (None: built here, on a GPU on the side
    stream while the passes before dK dV run). do_gate ([B, T, HQ]): the gradients of do_gate *
    do, from do (`utils.unscaled_do_gate`). delta: rowsum(dO * O) where the caller has it
    (`utils.given_delta`): no pass of its own, and no O read for it."""
    _check(q, k, v, block_idx, sel_block, cu_seqlens)
    B, T, HQ, Dk = q.shape
    Tk, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    n = block_idx.shape[3]
    if len(dq_add) > 2 or any(x.shape != q.shape or x.device != q.device for x in dq_add):
        raise ValueError(f"dq_add must hold at most two tensors shaped like q "
                         f"{tuple(q.shape)} on {q.device}, got "
                         f"{[(tuple(x.shape), str(x.device)) for x in dq_add]}")
    dq = torch.empty(B, T, HQ, Dk, dtype=q.dtype, device=q.device)
    dk = torch.zeros(B, Tk, H, Dk, dtype=torch.float32, device=q.device)
    dv = torch.zeros(B, Tk, H, Dv, dtype=torch.float32, device=q.device)
    if dq.numel() == 0 or n == 0:
        dq.zero_()
        for x in dq_add:
            dq += x
        return dq, dk.to(k.dtype), dv.to(v.dtype)
    # dO and O meet q's dtype in the dots (an fp32 upstream gradient is rounded like o was)
    q, k, v, o, do = (unit_last_stride(x) for x in (q, k, v, o.to(q.dtype), do.to(q.dtype)))
    lse = lse.to(torch.float32)
    dlse = dlse.to(torch.float32) if dlse is not None else None
    gate = unscaled_do_gate(do_gate, dlse)
    delta = given_delta(delta, dlse, do)
    bidx = block_idx.to(torch.int32).contiguous()
    queries = _Queries(T, Tk, cu_seqlens, cu_seqlens_k)
    stored, window = _ds_choice(q, n, sel_block, queries, stored_ds, index is not None)
    recipe = _index_recipe(q, k, v, stored, window, sel_block)
    if index is not None and index.recipe != recipe:
        raise ValueError(f"index: built for {index.recipe}, this backward reads {recipe}")
    # dq's layout, so that the kernel reads them at dq's offsets
    adds = [x.contiguous() for x in dq_add]
    # one buffer for every window's dS
    ds = torch.empty(B * (T if window is None else window) * HQ * n * sel_block, dtype=q.dtype,
                     device=q.device) if stored else None
    for i, rows in enumerate(_spans(T, window)):
        part = None if index is None else BackwardIndex((index.windows[i],), index.ready, recipe)
        _bwd_window(q[:, rows], k, v, o[:, rows], lse[:, rows].contiguous(), do[:, rows],
                    None if dlse is None else dlse[:, rows].contiguous(),
                    bidx[:, rows].contiguous(), sel_block, scale, queries.span(rows),
                    dq[:, rows], [x[:, rows] for x in adds], dk, dv, ds, shared, recipe, part,
                    *(None if x is None else x[:, rows].contiguous() for x in (gate, delta)))
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _bwd_window(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                dlse: Optional[Tensor], bidx: Tensor, sel_block: int, scale: float,
                queries: _Queries, dq: Tensor, adds: list[Tensor], dk: Tensor, dv: Tensor,
                ds: Optional[Tensor], shared: Optional[bool], recipe: _IndexRecipe,
                index: Optional[BackwardIndex], gate: Optional[Tensor],
                delta: Optional[Tensor]) -> None:
    """`selection_attention_bwd`'s passes for the queries of one window (q, o, lse, do, dlse,
    bidx, dq and adds cut to them; queries: their place among the keys): writes their dq and adds
    their share of dk / dv (fp32, every key of k) in place; ds: the dS buffer (None: dq is worked
    out from K and V again); index: this window's (None: built here); gate: the rows' gates of
    an unscaled dO (`utils.unscaled_do_gate`, cut to the window); delta: the rows' delta
    (`utils.given_delta`, cut to the window; None: worked out here)."""
    B, T, HQ, Dk = q.shape
    Tk, H, Dv = dk.shape[1], k.shape[2], v.shape[3]
    G, n = HQ // H, bidx.shape[3]
    stored = ds is not None
    dkp, dvp = pow2(Dk, 16), pow2(Dv, 16)
    prec = dot_precision(q.dtype)
    # the dK dV kernel's inverse index depends on block_idx alone: on a GPU it is built on a
    # side stream, from before the passes that precede dK dV
    fork = _fork(q.device) if index is None else None
    # the dK dV pass reads delta: with stored dS it runs before dq, so delta gets a pass of its
    # own, unless the caller gave it
    delta_done = delta is not None or stored
    if delta is None:
        delta = row_delta(o, do, dlse) if stored else \
            torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    bn = _key_tile_size("dq", sel_block, dkp, dvp)
    group = _shared_pass(shared, _shared_reason(queries.varlen, G, bn), G, bn, q.dtype)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(do),
               *_strides(dq))
    constants = dict(H=H, G=G, DK=Dk, DV=Dv, DKP=dkp, DVP=dvp, SEL=sel_block, BN=bn, NP=pow2(n),
                     HAS_DLSE=dlse is not None, PREC=prec, HAS_GATE=gate is not None)
    gate_arg = delta if gate is None else gate  # unread without a gate
    qk_scale = scale * LOG2E.value
    rows = bidx
    skip_passed = bool(group) and stored  # the plan marks the slots dq's shared pass takes
    if group:
        off = queries.Tk - T
        num_groups = _num_groups(T, off, group)
        rows = torch.empty_like(bidx)
        plan = torch.empty(num_groups * B * H, dtype=torch.int64, device=q.device)
        plan_blocks = torch.empty(num_groups * B * H, pow2(n), dtype=torch.int32,
                                  device=q.device)
        plan_len = torch.zeros(1, dtype=torch.int32, device=q.device)
        passed_slots = torch.empty(B, T, H, dtype=torch.int64, device=q.device) if stored \
            else plan_len
        launch(_dq_plan_kernel)[(num_groups, B * H)](
            bidx, rows, plan, plan_blocks, plan_len, passed_slots, off, T, n, H=H, SEL=sel_block,
            TT=group, NP=pow2(n), MIN_SHARED=SHARED_DQ_MIN, STORED_DS=stored,
            num_warps=_plan_warps(group, pow2(n)))
        num_warps, num_stages = _SHARED_DQ_PICK
        launch(_shared_dq_kernel)[(min(plan.numel(), _persistent_programs(q.device)),)](
            q, k, v, o, do, lse, dlse if dlse is not None else lse, delta, gate_arg, dq, plan,
            plan_blocks, plan_len, off, B * H, *strides, T, scale, qk_scale, GPD=pow2(G),
            TT=group, DELTA_DONE=delta_done, **constants, num_warps=num_warps,
            num_stages=num_stages)
    dq_adds = adds + [dq] * (2 - len(adds))
    if not stored:
        launch(_dq_kernel)[(T, B * H)](
            q, k, v, o, do, lse, dlse if dlse is not None else lse, delta, gate_arg, dq, *dq_adds,
            rows, *queries.kernel_args(bidx), *strides, T, n, scale, qk_scale, GP=pow2(G, 16),
            IS_VARLEN=queries.varlen, ADDS=len(adds), TT=group, DELTA_DONE=delta_done,
            **constants, **_per_token_launch("dq", q.dtype))

    gp2 = pow2(G)
    bn, bm, warps, stages = _dkdv_config(q.dtype, sel_block, dkp, dvp, gp2)
    ordered_adds = not recipe.token_major
    if index is None:
        index = _start_index(bidx, sel_block, queries, recipe, fork)
    (ent_tok, ent_pos, ent_slot, chunks), = index.windows
    if index.ready is not None:
        main = torch.cuda.current_stream(q.device)
        main.wait_event(index.ready)
        for x in (ent_tok, ent_pos, ent_slot, chunks):
            if x is not None:
                x.record_stream(main)
    grid = (chunks.shape[0], cdiv(sel_block, bn))
    sync = ordered.sync_buffer(grid[0] * grid[1], q.device) if ordered_adds else bidx
    launch(_dkdv_kernel)[(grid[0] * grid[1],) if ordered_adds else grid](
        q, k, v, do, lse, delta, gate_arg, dk, dv, ds if stored else dq, chunks, ent_tok, ent_pos,
        ent_slot if stored else ent_tok, passed_slots if skip_passed else ent_tok, sync,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        T, Tk, n, scale, qk_scale,
        H=H, G=G, GP2=gp2, DK=Dk, DV=Dv, DKP=dkp, DVP=dvp, SEL=sel_block, BN=bn, BM=bm,
        CE=pow2(index.recipe.queries_per_chunk), PREC=prec, ORDERED=ordered_adds,
        STORE_DS=stored, SKIP_PASSED=skip_passed, HAS_GATE=gate is not None, num_warps=warps,
        num_stages=stages)
    if stored:
        launch(_dq_ds_kernel)[(T, B * H)](
            k, ds, dq, *dq_adds, rows, bidx, *queries.kernel_args(bidx), *_strides(k),
            *_strides(dq), T, n, scale, H=H, G=G, GP=pow2(G, 16), DK=Dk, DKP=dkp,
            SEL=sel_block, BN=_key_tile_size("dq_ds", sel_block, dkp, dvp), NP=pow2(n),
            IS_VARLEN=queries.varlen, ADDS=len(adds), TT=group, PREC=prec,
            **_per_token_launch("dq_ds", q.dtype))
