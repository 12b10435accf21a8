"""NSA decode as Triton kernels: the newest query row of every sequence over an NSACache.

One step (Tq = 1, the query at position p = S - 1 of a cache holding S tokens) is one launch when
the (batch row, KV head) groups fill the GPU, three when they do not (split-K). All launches read
S from a device tensor, never from a host int, so a CUDA graph captured once replays correctly at
every later step; grids and scratch sizes depend on the cache capacity only. A program holds the
G query heads of one KV head as one [G_PAD, D] tile, so each K/V tile is read once per group.

The compressed branch also yields the un-normalised Eq.9 mass of every selection block, per head h,
    LP[h, j] = log2 sum_i exp2(s[h, i]) * w[i, j]       (w: the Eq.9 overlap weights),
split in two planes (the rows starting in block j, and the spill of block j - 1's last rows into
j; see `_cmp_chunk`) and kept in a scratch buffer. As log-sums they need no rescaling when softmax
partials merge: p_slc[h, j] = exp2(LP_own[h, j] - lse2[h]) + exp2(LP_spill[h, j] - lse2[h]).
From them `_group_scores` sums p_slc over the group (Eq.10) and `_top_n` takes the top-n exactly
as `reference.topn_blocks` (forced block 0 and the two local blocks, ties to the lower index, -1
for empty slots).

One launch, `_fused_kernel`, grid (B*H): one program per group streams the compressed rows
(writing LP), reads its own LP back for the scores and the top-n, attends the selected blocks and
the window, and writes the gated output. Nothing but LP and the compressed lse goes through
memory, and those are read back by the program that wrote them (from L2, mostly).

Split-K, for few groups:
1. `_partials_kernel`, grid (NC + NW, B*H): flash-decoding over the compressed rows, in NC chunks
   of whole selection blocks (each writing the LP of its blocks), and over the window, in NW
   chunks. Each writes per-head partials (running max m, sum l, unnormalised output acc, base-2
   units).
2. `_select_kernel`, grid (NS, B*H): merges the compressed partials into lse, computes the scores
   and the top-n, and attends its share of the n selected blocks (split-K over the slots). Every
   split redoes the top-n: that costs a few microseconds of one SM in parallel, a fourth launch
   would cost them in series.
3. `_combine_kernel`, grid (B*HQ): merges each branch's partials and applies the gates.

Reads (NSA-SPEC "Decode"): every program counts the cache rows it loaded and used: compressed rows
attended (num_cmp(S) in all), n*l' selection slots walked (an empty or causally clamped slot is a
masked tile load and counts, as in `nsa_ops.decode`), window tokens attended (min(w, S)). The
combine kernel sums the counts of batch row 0, KV head 0 into ``reads``; the other groups do the
same work. In the one-launch kernel, the program of batch row 0, KV head 0 writes its count.

Limits (ValueError otherwise): l'/d a power of two, l <= l' + d, head dims <= 256, and at most
nsa_ops.routing.DECODE_MAX_SEL_BLOCKS selection blocks (padded) in the cache capacity, whose top-n
one program runs in registers; `routing.decode_geometry_refusal` states the geometry limits for
both this check and the routing table.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_ops.kernels.compressed import key_block, top_n_keys
from nsa_ops.kernels.softmax import LOG2E
from nsa_ops.kernels.utils import cdiv, dot_precision, pow2, row_bytes
from nsa_ops.reference import num_cmp
from nsa_ops.routing import DecodeGeometry, decode_geometry_refusal

# fp32 elements of the [heads, blocks] LP tile loaded at once by the select kernel
_LP_TILE = 8192
# Programs per SM the split heuristic aims for in the partials and select launches, and their
# (num_warps, num_stages). Picked on an H100 (HQ=64, H=4, D=128, bf16, S=64k, B in {1, 16, 64}):
# 2 programs/SM beat 1 and 4 overall; (4, 2) beat (4, 3), (4, 4), (8, 2), (8, 3) by 3-12 %.
PROGRAMS_PER_SM = 2
# The one-launch kernel: "fused" when the groups outnumber the SMs, "fused_lone" at one group per
# SM or fewer, where 8 warps keep more loads in flight per SM. H100, same shapes: at 64k, B=64
# (4, 3) took 285 us against 295-417 us for the other (4|8, 2|3|4); at B=32 (8, 3) 154 us
# against 166-218 us.
LAUNCH = {"partials": (4, 2), "select": (4, 2), "fused": (4, 3), "fused_lone": (8, 3)}
# Head rows (padded) wider than this many bytes (fp32 head dims > 128) launch without pipelined
# loads: at fp32 D = 256 the partials kernel's 2 stages asked 272 KB of shared memory and the
# one-launch kernel's 3 stages 276 KB, over sm_90's 227 (tests/test_sm90_shared_memory.py); one
# stage takes 144 KB.
PIPELINED_ROW_BYTES = 512
# The one-launch kernel runs from this many (batch row, KV head) groups per SM up; below, split-K
# keeps the SMs busy. H100 at 64k: with 128 groups on 132 SMs it took 154 us against split-K's
# 179 us; with 64 groups 145 us against 107 us.
FUSED_MIN_GROUPS_PER_SM = 0.75


def _launch(kind: str, width: int) -> tuple[int, int]:
    """LAUNCH[kind] for head rows of `width` bytes: (num_warps, num_stages)."""
    num_warps, num_stages = LAUNCH[kind]
    return num_warps, num_stages if width <= PIPELINED_ROW_BYTES else 1


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------

@triton.jit
def _load_rows(ptr, rows, valid, stride, D: tl.constexpr, D_PAD: tl.constexpr):
    """[rows, D_PAD] tile of one KV head's rows (row r at ptr + r * stride), zero where masked."""
    d = tl.arange(0, D_PAD)
    return tl.load(ptr + rows.to(tl.int64)[:, None] * stride + d[None, :],
                   mask=valid[:, None] & (d[None, :] < D), other=0.0)


@triton.jit
def _attend(q, k, v, valid, m, l, acc, qk_scale, PREC: tl.constexpr):
    """One online-softmax step of the [G_PAD] query rows over a tile of keys (base-2 units).
    Also returns the tile's probabilities p and the shift m_ref they are relative to (p * 2^m_ref
    is the unnormalised weight), which the compressed branch turns into Eq.9 masses."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # rows that have seen nothing keep m = -inf: shift by 0 instead of inf - inf
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l * alpha + tl.sum(p, 1), acc, p, m_ref


@triton.jit
def _cmp_chunk(q, KC, VC, LP, lp_base, part, S, sct, svct, qk_scale,
               L: tl.constexpr, STRIDE: tl.constexpr, SEL: tl.constexpr, NC: tl.constexpr,
               G: tl.constexpr, G_PAD: tl.constexpr, NBLK_CAP: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
               JT: tl.constexpr, RPB: tl.constexpr, PREC: tl.constexpr):
    """Compressed attention partials of chunk `part` and the Eq.9 mass of its selection blocks.

    The chunk owns selection blocks [j0, j1) and the compressed rows starting in them (i in
    [j0*RPB, j1*RPB), RPB = l'/d rows per block), in tiles of JT blocks. Row i = j*RPB + o
    overlaps its own block j by min(l, l' - o*d) and, when l > l' - o*d, block j + 1 by the rest
    (never further: l <= l' + d). Both weights depend on o only, so a [G, JT, RPB] view of the
    probabilities gives each block's own mass and the spill into the next block without a
    matrix product. They go to two LP planes (own at j, spill at j + 1, in log2 with the tile's
    running max) and the select kernel adds them: the tile never needs rows of its neighbour.
    """
    ncmp = tl.where(S >= L, tl.maximum(S - L, 0) // STRIDE + 1, 0)
    nblk = (S + SEL - 1) // SEL
    per_chunk = ((nblk + NC - 1) // NC + JT - 1) // JT * JT
    j0 = part * per_chunk
    j1 = tl.minimum(j0 + per_chunk, nblk)
    row_end = tl.minimum(j1 * RPB, ncmp)

    g = tl.arange(0, G_PAD)
    r = tl.arange(0, JT * RPB)
    jb = tl.arange(0, JT)
    o = tl.arange(0, RPB) * STRIDE  # row start inside its block
    w_own = (tl.minimum(L, SEL - o).to(tl.float32) * (1.0 / L))[None, None, :]
    w_next = (tl.maximum(o + L - SEL, 0).to(tl.float32) * (1.0 / L))[None, None, :]
    lp_head = lp_base + g[:, None] * NBLK_CAP
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    count = tl.zeros([], tl.int32)
    for jt in range(j0, j1, JT):
        rows = jt * RPB + r
        used = rows < row_end
        k = _load_rows(KC, rows, used, sct, DK, DK_PAD)
        v = _load_rows(VC, rows, used, svct, DV, DV_PAD)
        m, l, acc, p, m_ref = _attend(q, k, v, used, m, l, acc, qk_scale, PREC)

        p3 = tl.reshape(p, (G_PAD, JT, RPB))
        blocks = jt + jb
        mine = (g[:, None] < G) & (blocks[None, :] < j1)
        tl.store(LP + lp_head + blocks[None, :],
                 m_ref[:, None] + tl.log2(tl.sum(p3 * w_own, 2)), mask=mine)
        tl.store(LP + lp_head + NBLK_CAP * G + blocks[None, :] + 1,
                 m_ref[:, None] + tl.log2(tl.sum(p3 * w_next, 2)),
                 mask=mine & (blocks[None, :] + 1 < nblk))
        count += tl.sum(used.to(tl.int32), 0)
    return m, l, acc, count


@triton.jit
def _window_chunk(q, K, V, wpart, S, skt, svt, qk_scale,
                  WINDOW: tl.constexpr, NW: tl.constexpr, G_PAD: tl.constexpr,
                  DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
                  DV_PAD: tl.constexpr, WN: tl.constexpr, PREC: tl.constexpr):
    """Sliding-window partials of window chunk `wpart`: tokens (p - w, p], p = S - 1."""
    first = tl.maximum(S - WINDOW, 0)
    per_chunk = ((S - first + NW - 1) // NW + WN - 1) // WN * WN
    t0 = first + wpart * per_chunk
    t1 = tl.minimum(t0 + per_chunk, S)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    count = tl.zeros([], tl.int32)
    for tt in range(t0, t1, WN):
        toks = tt + tl.arange(0, WN)
        used = toks < t1
        k = _load_rows(K, toks, used, skt, DK, DK_PAD)
        v = _load_rows(V, toks, used, svt, DV, DV_PAD)
        m, l, acc, _, _ = _attend(q, k, v, used, m, l, acc, qk_scale, PREC)
        count += tl.sum(used.to(tl.int32), 0)
    return m, l, acc, count


@triton.jit
def _store_partial(PM, PL, PACC, PCNT, slot, m, l, acc, count,
                   G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr,
                   DV_PAD: tl.constexpr):
    """Partials of one program: m, l [.., G], acc [.., G, DV], count [..] at flat index slot."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, DV_PAD)
    tl.store(PM + slot * G + g, m, mask=g < G)
    tl.store(PL + slot * G + g, l, mask=g < G)
    tl.store(PACC + (slot * G + g[:, None]) * DV + d[None, :], acc,
             mask=(g[:, None] < G) & (d[None, :] < DV))
    tl.store(PCNT + slot, count)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _partials_kernel(Q, K, V, KC, VC, LEN, LP, PM, PL, PACC, PCNT,
                     sqb, sqh, skb, skt, skh, svb, svt, svh, scb, sct, sch, svcb, svct, svch,
                     H, qk_scale,
                     L: tl.constexpr, STRIDE: tl.constexpr, SEL: tl.constexpr,
                     WINDOW: tl.constexpr, NC: tl.constexpr, NW: tl.constexpr,
                     NPART: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                     NBLK_CAP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, JT: tl.constexpr,
                     RPB: tl.constexpr, WN: tl.constexpr, PREC: tl.constexpr):
    part = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # batch offsets pass 2**31 elements at long contexts
    kvh = bh % H
    S = tl.load(LEN).to(tl.int32)
    g = tl.arange(0, G_PAD)
    q = _load_rows(Q + b * sqb + kvh * G * sqh, g, g < G, sqh, DK, DK_PAD)
    if part < NC:
        m, l, acc, count = _cmp_chunk(
            q, KC + b * scb + kvh * sch, VC + b * svcb + kvh * svch, LP,
            bh.to(tl.int64) * 2 * G * NBLK_CAP, part, S, sct, svct, qk_scale, L, STRIDE, SEL, NC,
            G, G_PAD, NBLK_CAP, DK, DV, DK_PAD, DV_PAD, JT, RPB, PREC)
    else:
        m, l, acc, count = _window_chunk(
            q, K + b * skb + kvh * skh, V + b * svb + kvh * svh, part - NC, S, skt, svt,
            qk_scale, WINDOW, NW, G_PAD, DK, DV, DK_PAD, DV_PAD, WN, PREC)
    _store_partial(PM, PL, PACC, PCNT, bh * NPART + part, m, l, acc, count, G, G_PAD, DV,
                   DV_PAD)


@triton.jit
def _group_scores(LP, PM, PL, bh, nblk, NC: tl.constexpr, NPART: tl.constexpr,
                  G: tl.constexpr, GH: tl.constexpr, NC_PAD: tl.constexpr,
                  NBLK_CAP: tl.constexpr, NBLK_PAD: tl.constexpr):
    """Eq.10 scores [NBLK_PAD] of the valid blocks: sum over the group of exp2(LP - lse2)."""
    j = tl.arange(0, NBLK_PAD)
    c = tl.arange(0, NC_PAD)
    score = tl.zeros([NBLK_PAD], tl.float32)
    for h0 in range(0, G, GH):
        h = h0 + tl.arange(0, GH)
        ok = (c[:, None] < NC) & (h[None, :] < G)
        offs = (bh * NPART + c[:, None]) * G + h[None, :]
        m = tl.load(PM + offs, mask=ok, other=float("-inf"))
        l = tl.load(PL + offs, mask=ok, other=0.0)
        mx = tl.max(m, 0)
        m_ref = tl.where(mx == float("-inf"), 0.0, mx)
        total = tl.sum(l * tl.exp2(m - m_ref[None, :]), 0)
        # no visible compressed row: p_cmp = 0 (the reference's rule); +inf makes exp2 give 0
        lse2 = tl.where(total > 0, m_ref + tl.log2(total), float("inf"))
        own = LP + (bh.to(tl.int64) * 2 * G + h[:, None]) * NBLK_CAP + j[None, :]
        ok = (h[:, None] < G) & (j[None, :] < nblk)
        lp = tl.load(own, mask=ok, other=float("-inf"))
        spill = tl.load(own + G * NBLK_CAP, mask=ok & (j[None, :] > 0), other=float("-inf"))
        score += tl.sum(tl.exp2(lp - lse2[:, None]) + tl.exp2(spill - lse2[:, None]), 0)
    return score


@triton.jit
def _top_n(score, nblk, cur, NSEL: tl.constexpr, NSEL_PAD: tl.constexpr,
           NBLK_PAD: tl.constexpr):
    """`reference.topn_blocks` for one row: [NSEL_PAD] block indices, ascending, -1 last (the
    rule's keys: `top_n_keys`)."""
    j = tl.arange(0, NBLK_PAD)
    valid = j < nblk
    forced = valid & ((j == 0) | (j == cur) | (j == cur - 1))
    _, best = top_n_keys(score, valid, forced, NSEL_PAD, NBLK_PAD)
    slot = tl.arange(0, NSEL_PAD)
    picked = tl.where((best >= 0) & (slot < NSEL), key_block(best), -1)
    # ascending, empty (-1) slots last: rank each pick among the others, then place it
    order = tl.where(picked >= 0, picked, NBLK_PAD + slot)
    rank = tl.sum((order[None, :] < order[:, None]).to(tl.int32), 1)
    return tl.sum(tl.where(rank[None, :] == slot[:, None], picked[None, :], 0), 1)


@triton.jit
def _select_slots(q, k_ptr, v_ptr, blocks, split, pos, skt, svt, qk_scale,
                  SEL: tl.constexpr, NSEL: tl.constexpr, NSEL_PAD: tl.constexpr,
                  SPS: tl.constexpr, G_PAD: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, BS: tl.constexpr,
                  BS_PAD: tl.constexpr, PREC: tl.constexpr):
    """Selection-attention partials over slots [split*SPS, split*SPS + SPS) of `blocks`, each
    walked in l'/BS tiles; an empty (-1) slot is a fully masked tile and still counts."""
    slot = tl.arange(0, NSEL_PAD)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    count = tl.zeros([], tl.int32)
    NSUB: tl.constexpr = SEL // BS
    t = tl.arange(0, BS_PAD)
    for it in range(SPS * NSUB):
        s = split * SPS + it // NSUB
        blk = tl.sum(tl.where(slot == s, blocks, 0), 0)
        toks = blk * SEL + (it % NSUB) * BS + t
        # (the interpreter mis-types a vector & scalar-bool mask, hence the where)
        used = tl.where((blk >= 0) & (s < NSEL), (t < BS) & (toks <= pos), False)
        k = _load_rows(k_ptr, toks, used, skt, DK, DK_PAD)
        v = _load_rows(v_ptr, toks, used, svt, DV, DV_PAD)
        m, l, acc, _, _ = _attend(q, k, v, used, m, l, acc, qk_scale, PREC)
        count += tl.where(s < NSEL, BS, 0)
    return m, l, acc, count


@triton.jit
def _select_kernel(Q, K, V, LEN, LP, PM, PL, PACC, PCNT, BIDX,
                   sqb, sqh, skb, skt, skh, svb, svt, svh,
                   H, qk_scale,
                   SEL: tl.constexpr, NSEL: tl.constexpr, NSEL_PAD: tl.constexpr,
                   NC: tl.constexpr, NW: tl.constexpr, NPART: tl.constexpr,
                   SPS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, GH: tl.constexpr,
                   NC_PAD: tl.constexpr, NBLK_CAP: tl.constexpr, NBLK_PAD: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
                   DV_PAD: tl.constexpr, BS: tl.constexpr, BS_PAD: tl.constexpr,
                   PREC: tl.constexpr):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    kvh = bh % H
    S = tl.load(LEN).to(tl.int32)
    pos = S - 1
    nblk = (S + SEL - 1) // SEL
    score = _group_scores(LP, PM, PL, bh, nblk, NC, NPART, G, GH, NC_PAD, NBLK_CAP, NBLK_PAD)
    blocks = _top_n(score, nblk, pos // SEL, NSEL, NSEL_PAD, NBLK_PAD)
    slot = tl.arange(0, NSEL_PAD)
    if split == 0:
        tl.store(BIDX + bh * NSEL + slot, blocks, mask=slot < NSEL)
    g = tl.arange(0, G_PAD)
    q = _load_rows(Q + b * sqb + kvh * G * sqh, g, g < G, sqh, DK, DK_PAD)
    m, l, acc, count = _select_slots(
        q, K + b * skb + kvh * skh, V + b * svb + kvh * svh, blocks, split, pos, skt, svt,
        qk_scale, SEL, NSEL, NSEL_PAD, SPS, G_PAD, DK, DV, DK_PAD, DV_PAD, BS, BS_PAD, PREC)
    _store_partial(PM, PL, PACC, PCNT, bh * NPART + NC + NW + split, m, l, acc, count, G, G_PAD,
                   DV, DV_PAD)


@triton.jit
def _merge(PM, PL, PACC, bh, g, lo: tl.constexpr, hi: tl.constexpr, NPART: tl.constexpr,
           G: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, PT: tl.constexpr):
    """Normalised output [DV_PAD] of one head from the partials lo..hi-1 of its branch."""
    i = tl.arange(0, PT)
    d = tl.arange(0, DV_PAD)
    mx = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([DV_PAD], tl.float32)
    for p0 in range(lo, hi, PT):
        ok = p0 + i < hi
        offs = (bh * NPART + p0 + i) * G + g
        m = tl.load(PM + offs, mask=ok, other=float("-inf"))
        l = tl.load(PL + offs, mask=ok, other=0.0)
        a = tl.load(PACC + offs[:, None] * DV + d[None, :], mask=ok[:, None] & (d[None, :] < DV),
                    other=0.0)
        mx_new = tl.maximum(mx, tl.max(m, 0))
        m_ref = tl.where(mx_new == float("-inf"), 0.0, mx_new)
        old = tl.exp2(mx - m_ref)
        w = tl.exp2(m - m_ref)
        total = total * old + tl.sum(l * w, 0)
        acc = acc * old + tl.sum(a * w[:, None], 0)
        mx = mx_new
    # a query that sees nothing in a branch gets 0 from it (the reference's rule)
    return acc / tl.where(total > 0, total, 1.0)


@triton.jit
def _combine_kernel(PM, PL, PACC, PCNT, GC, GS, GW, O, READS,
                    sgcb, sgch, sgsb, sgsh, sgwb, sgwh, sob, soh, H, HQ,
                    NC: tl.constexpr, NW: tl.constexpr, NPART: tl.constexpr,
                    NPART_PAD: tl.constexpr, G: tl.constexpr, DV: tl.constexpr,
                    DV_PAD: tl.constexpr, PT: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // HQ
    hq = pid % HQ
    bh = b * H + hq // G
    g = hq % G
    o_cmp = _merge(PM, PL, PACC, bh, g, 0, NC, NPART, G, DV, DV_PAD, PT)
    o_win = _merge(PM, PL, PACC, bh, g, NC, NC + NW, NPART, G, DV, DV_PAD, PT)
    o_slc = _merge(PM, PL, PACC, bh, g, NC + NW, NPART, NPART, G, DV, DV_PAD, PT)
    b64 = b.to(tl.int64)
    g_cmp = tl.load(GC + b64 * sgcb + hq * sgch).to(tl.float32)
    g_slc = tl.load(GS + b64 * sgsb + hq * sgsh).to(tl.float32)
    g_win = tl.load(GW + b64 * sgwb + hq * sgwh).to(tl.float32)
    o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win
    d = tl.arange(0, DV_PAD)
    tl.store(O + b64 * sob + hq * soh + d, o.to(O.dtype.element_ty), mask=d < DV)
    if pid == 0:
        i = tl.arange(0, NPART_PAD)
        reads = tl.sum(tl.load(PCNT + i, mask=i < NPART, other=0), 0)
        tl.store(READS, reads.to(tl.int64))


@triton.jit
def _gated(acc, l, gate):
    """gate * acc / l per query row; a row that sees nothing in a branch gets 0 from it (the
    reference's rule)."""
    return acc * (gate / tl.where(l > 0, l, 1.0))[:, None]


@triton.jit
def _fused_kernel(Q, K, V, KC, VC, LEN, LP, PM, PL, GC, GS, GW, O, BIDX, READS,
                  sqb, sqh, skb, skt, skh, svb, svt, svh, scb, sct, sch, svcb, svct, svch,
                  sgcb, sgch, sgsb, sgsh, sgwb, sgwh, sob, soh, H, qk_scale,
                  L: tl.constexpr, STRIDE: tl.constexpr, SEL: tl.constexpr,
                  WINDOW: tl.constexpr, NSEL: tl.constexpr, NSEL_PAD: tl.constexpr,
                  G: tl.constexpr, G_PAD: tl.constexpr, GH: tl.constexpr,
                  NBLK_CAP: tl.constexpr, NBLK_PAD: tl.constexpr, DK: tl.constexpr,
                  DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, JT: tl.constexpr,
                  RPB: tl.constexpr, WN: tl.constexpr, BS: tl.constexpr, BS_PAD: tl.constexpr,
                  PREC: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    kvh = bh % H
    S = tl.load(LEN).to(tl.int32)
    pos = S - 1
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, DV_PAD)
    q = _load_rows(Q + b * sqb + kvh * G * sqh, g, g < G, sqh, DK, DK_PAD)
    hq = kvh * G + g
    g_cmp = tl.load(GC + b * sgcb + hq * sgch, mask=g < G, other=0.0).to(tl.float32)
    g_slc = tl.load(GS + b * sgsb + hq * sgsh, mask=g < G, other=0.0).to(tl.float32)
    g_win = tl.load(GW + b * sgwb + hq * sgwh, mask=g < G, other=0.0).to(tl.float32)
    k_ptr = K + b * skb + kvh * skh
    v_ptr = V + b * svb + kvh * svh

    m, l, acc, n_cmp = _cmp_chunk(
        q, KC + b * scb + kvh * sch, VC + b * svcb + kvh * svch, LP,
        bh.to(tl.int64) * 2 * G * NBLK_CAP, 0, S, sct, svct, qk_scale, L, STRIDE, SEL, 1, G,
        G_PAD, NBLK_CAP, DK, DV, DK_PAD, DV_PAD, JT, RPB, PREC)
    o = _gated(acc, l, g_cmp)
    # the compressed softmax state, as the one partial _group_scores merges
    tl.store(PM + bh * G + g, m, mask=g < G)
    tl.store(PL + bh * G + g, l, mask=g < G)
    # the LP / PM / PL rows just stored by this program's threads are read back by others of it
    tl.debug_barrier()
    score = _group_scores(LP, PM, PL, bh, (S + SEL - 1) // SEL, 1, 1, G, GH, 1, NBLK_CAP,
                          NBLK_PAD)
    blocks = _top_n(score, (S + SEL - 1) // SEL, pos // SEL, NSEL, NSEL_PAD, NBLK_PAD)
    slot = tl.arange(0, NSEL_PAD)
    tl.store(BIDX + bh * NSEL + slot, blocks, mask=slot < NSEL)

    m, l, acc, n_slc = _select_slots(q, k_ptr, v_ptr, blocks, 0, pos, skt, svt, qk_scale, SEL,
                                     NSEL, NSEL_PAD, NSEL, G_PAD, DK, DV, DK_PAD, DV_PAD, BS,
                                     BS_PAD, PREC)
    o += _gated(acc, l, g_slc)
    m, l, acc, n_win = _window_chunk(q, k_ptr, v_ptr, 0, S, skt, svt, qk_scale, WINDOW, 1,
                                     G_PAD, DK, DV, DK_PAD, DV_PAD, WN, PREC)
    o += _gated(acc, l, g_win)
    tl.store(O + b * sob + hq[:, None] * soh + d[None, :], o.to(O.dtype.element_ty),
             mask=(g[:, None] < G) & (d[None, :] < DV))
    if bh == 0:
        tl.store(READS, (n_cmp + n_slc + n_win).to(tl.int64))


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

class _Plan(NamedTuple):
    """Launch geometry: fixed by shapes and the cache capacity, never by the current length."""
    fused: bool    # one launch, one program per (batch row, KV head); else three, split-K
    nc: int        # compressed chunks per (batch row, KV head)
    nw: int        # window chunks
    ns: int        # selection splits
    sps: int       # selection slots per split
    jt: int        # selection blocks per compressed tile
    nblk_cap: int  # selection blocks of a full cache


_WINDOW_TILE = 64


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _plan(B: int, H: int, capacity: int, block_len: int, block_stride: int, sel_block: int,
          num_sel: int, window: int, device: torch.device,
          splits: Optional[tuple[int, int, int]], fused: Optional[bool]) -> _Plan:
    rpb = sel_block // block_stride
    jt = max(1, 64 // rpb)  # 64 compressed rows per tile (rpb is a power of two)
    nblk_cap = cdiv(capacity, sel_block)
    if fused is None:
        fused = splits is None and B * H >= FUSED_MIN_GROUPS_PER_SM * _sm_count(device)
    if fused:
        return _Plan(True, 1, 1, 1, num_sel, jt, nblk_cap)
    if splits is None:
        # about PROGRAMS_PER_SM programs per SM in each launch (B=1 at 64k: 64 compressed
        # chunks of one tile per KV head), never more chunks than there are tiles to share
        per_group = max(1, cdiv(PROGRAMS_PER_SM * _sm_count(device), B * H))
        splits = (min(per_group, cdiv(nblk_cap, jt)),
                  min(per_group, cdiv(min(window, capacity), _WINDOW_TILE)),
                  min(per_group, num_sel))
    nc, nw, ns = splits
    sps = cdiv(num_sel, ns)
    return _Plan(False, nc, nw, cdiv(num_sel, sps), sps, jt, nblk_cap)


def _fail(msg: str):
    raise ValueError(msg)


def _check(q, k, v, k_cmp, v_cmp, length, gates, block_len, block_stride, sel_block, num_sel,
           window, splits, fused) -> None:
    names = ("q", "k", "v", "k_cmp", "v_cmp")
    layouts = ("[B, 1, HQ, Dk]", "[B, capacity, H, Dk]", "[B, capacity, H, Dv]",
               "[B, rows, H, Dk]", "[B, rows, H, Dv]")
    for name, t, layout in zip(names, (q, k, v, k_cmp, v_cmp), layouts):
        if not isinstance(t, Tensor) or t.dim() != 4:
            _fail(f"{name} must be a 4-d tensor {layout}, got "
                  f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32) or t.dtype != q.dtype:
            _fail(f"{name} must be float16/bfloat16/float32 like q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            _fail(f"{name} must be on q's device {q.device}, got {t.device}")
    B, Tq, HQ, Dk = q.shape
    if Tq != 1:
        _fail(f"q must hold one query row per sequence ([B, 1, HQ, Dk]), got {tuple(q.shape)}")
    H, Dv = k.shape[2], v.shape[3]
    if H == 0 or HQ % H:
        _fail(f"q heads HQ={HQ} must be a multiple of k heads H={H}")
    if k.shape != (B, k.shape[1], H, Dk) or v.shape[:3] != k.shape[:3]:
        _fail(f"k must be [B, capacity, H, Dk] = [{B}, *, *, {Dk}] and v [B, capacity, H, Dv] "
              f"with k's first three dims, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    rows = k_cmp.shape[1]
    if rows < num_cmp(k.shape[1], block_len, block_stride) \
            or k_cmp.shape != (B, rows, H, Dk) or v_cmp.shape != (B, rows, H, Dv):
        _fail(f"k_cmp / v_cmp must be [B, rows, H, Dk] / [B, rows, H, Dv] with rows >= "
              f"num_cmp(capacity) = {num_cmp(k.shape[1], block_len, block_stride)}, got "
              f"{tuple(k_cmp.shape)}, {tuple(v_cmp.shape)}")
    for name, t in zip(names, (q, k, v, k_cmp, v_cmp)):
        if t.stride(-1) != 1:
            _fail(f"{name} must have a unit stride along its last dim")
    if not isinstance(length, Tensor) or length.shape != (1,) or length.dtype != torch.int64 \
            or length.device != q.device:
        _fail(f"length must be an int64 tensor of shape [1] on {q.device} (the cached token "
              f"count, read on device), got {length!r}")
    for name, g in zip(("g_cmp", "g_slc", "g_win"), gates):
        if not isinstance(g, Tensor) or tuple(g.shape) != (B, 1, HQ) or g.device != q.device:
            _fail(f"{name} must be a [B, 1, HQ] = [{B}, 1, {HQ}] tensor on {q.device}, got "
                  f"{tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__}")
    for name, value in (("block_len", block_len), ("block_stride", block_stride),
                        ("sel_block", sel_block), ("num_sel", num_sel), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            _fail(f"{name} must be a positive int, got {value!r}")
    if block_len % block_stride or sel_block % block_stride:
        _fail(f"block_stride must divide block_len and sel_block, got l={block_len}, "
              f"d={block_stride}, l'={sel_block}")
    geometry = decode_geometry_refusal(
        DecodeGeometry(block_len, block_stride, sel_block, k.shape[1]))
    if geometry:
        _fail(geometry)
    if num_sel < 3:
        _fail(f"num_sel must be >= 3 (block 0 and the two local blocks), got {num_sel}")
    if max(Dk, Dv) > 256:
        _fail(f"head dims must be <= 256, got Dk={Dk}, Dv={Dv}")
    if splits is not None and (len(splits) != 3 or any(
            isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in splits)):
        _fail(f"splits must be three positive ints (compressed, window, selection), "
              f"got {splits!r}")
    if fused and splits is not None:
        _fail(f"splits={splits!r} needs the split-K launches: pass fused=None or False")


def nsa_decode(q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, length: Tensor,
               g_cmp: Tensor, g_slc: Tensor, g_win: Tensor, *, block_len: int,
               block_stride: int, sel_block: int, num_sel: int, window: int, scale: float,
               splits: Optional[tuple[int, int, int]] = None, fused: Optional[bool] = None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """NSA output of the newest token of each sequence over cache storage.

    q [B,1,HQ,Dk] rotated; k [B,capacity,H,Dk], v [B,capacity,H,Dv]: every cached token, valid
    up to ``length`` (int64 [1], on device; the query sits at position length - 1, its own K/V
    already stored); k_cmp / v_cmp [B,rows,H,D] with rows >= num_cmp(capacity), valid up to
    num_cmp(length); gates [B,1,HQ] activated. ``fused`` picks the one-launch kernel (True) or
    the split-K launches (False); None lets the occupancy heuristic choose. ``splits`` =
    (compressed chunks, window chunks, selection splits) per (batch row, KV head) sets the
    split-K launches' work division.

    Returns o [B,1,HQ,Dv] in q's dtype, reads int64 [1] (cache rows loaded, see the module
    docstring) and block_idx int32 [B,1,H,num_sel] (the selection, ascending, -1 last).
    The length is never read on the host: it must lie in [1, capacity] (unchecked).
    """
    gates = (g_cmp, g_slc, g_win)
    _check(q, k, v, k_cmp, v_cmp, length, gates, block_len, block_stride, sel_block, num_sel,
           window, splits, fused)
    B, _, HQ, Dk = q.shape
    H, Dv = k.shape[2], v.shape[3]
    G = HQ // H
    dev = q.device
    plan = _plan(B, H, k.shape[1], block_len, block_stride, sel_block, num_sel, window, dev,
                 splits, fused)
    npart = 1 if plan.fused else plan.nc + plan.nw + plan.ns
    f32 = torch.float32
    lp = torch.empty(B * H, 2, G, plan.nblk_cap, dtype=f32, device=dev)  # own / spill planes
    pm = torch.empty(B * H, npart, G, dtype=f32, device=dev)
    pl = torch.empty(B * H, npart, G, dtype=f32, device=dev)
    o = torch.empty(B, 1, HQ, Dv, dtype=q.dtype, device=dev)
    reads = torch.empty(1, dtype=torch.int64, device=dev)
    block_idx = torch.empty(B, 1, H, num_sel, dtype=torch.int32, device=dev)

    prec = dot_precision(q.dtype)
    width = row_bytes(q.dtype, Dk, Dv)
    shared = dict(G=G, G_PAD=pow2(G, 16), DK=Dk, DV=Dv, DK_PAD=pow2(Dk, 16),
                  DV_PAD=pow2(Dv, 16), PREC=prec, NBLK_CAP=plan.nblk_cap)
    cmp_geometry = dict(L=block_len, STRIDE=block_stride, SEL=sel_block, WINDOW=window,
                        JT=plan.jt, RPB=sel_block // block_stride, WN=_WINDOW_TILE)
    nblk_pad = pow2(max(plan.nblk_cap, num_sel), 16)  # >= NSEL_PAD, for top_n_keys
    bs = min(64, sel_block & -sel_block)  # largest power of two dividing l', at most 64
    selection = dict(NSEL=num_sel, NSEL_PAD=pow2(num_sel), NBLK_PAD=nblk_pad, BS=bs,
                     BS_PAD=max(16, bs), GH=min(pow2(G), max(1, _LP_TILE // nblk_pad)))
    qk_scale = scale * LOG2E.value
    strides = (q.stride(0), q.stride(2), *k.stride()[:3], *v.stride()[:3])
    cmp_strides = (*k_cmp.stride()[:3], *v_cmp.stride()[:3])
    gate_strides = (g_cmp.stride(0), g_cmp.stride(2), g_slc.stride(0), g_slc.stride(2),
                    g_win.stride(0), g_win.stride(2), o.stride(0), o.stride(2))
    if plan.fused:
        num_warps, num_stages = _launch("fused" if B * H > _sm_count(dev) else "fused_lone",
                                        width)
        _fused_kernel[(B * H,)](
            q, k, v, k_cmp, v_cmp, length, lp, pm, pl, g_cmp, g_slc, g_win, o, block_idx, reads,
            *strides, *cmp_strides, *gate_strides, H, qk_scale,
            num_warps=max(num_warps, 8 if nblk_pad > 2048 else 4), num_stages=num_stages,
            **shared, **cmp_geometry, **selection)
        return o, reads, block_idx

    pacc = torch.empty(B * H, npart, G, Dv, dtype=f32, device=dev)
    pcnt = torch.empty(B * H, npart, dtype=torch.int32, device=dev)
    shared.update(NC=plan.nc, NW=plan.nw, NPART=npart)
    num_warps, num_stages = _launch("partials", width)
    _partials_kernel[(plan.nc + plan.nw, B * H)](
        q, k, v, k_cmp, v_cmp, length, lp, pm, pl, pacc, pcnt, *strides, *cmp_strides, H,
        qk_scale, num_warps=num_warps, num_stages=num_stages, **shared, **cmp_geometry)
    num_warps, num_stages = _launch("select", width)
    _select_kernel[(plan.ns, B * H)](
        q, k, v, length, lp, pm, pl, pacc, pcnt, block_idx, *strides, H, qk_scale,
        SEL=sel_block, SPS=plan.sps, NC_PAD=pow2(plan.nc),
        num_warps=max(num_warps, 8 if nblk_pad > 2048 else 4), num_stages=num_stages,
        **shared, **selection)
    # PT: up to 64 partials of a branch merge in one step, so their loads are in flight together
    _combine_kernel[(B * HQ,)](
        pm, pl, pacc, pcnt, g_cmp, g_slc, g_win, o, reads, *gate_strides, H, HQ,
        NC=plan.nc, NW=plan.nw, NPART=npart, NPART_PAD=pow2(npart), G=G, DV=Dv,
        DV_PAD=pow2(Dv, 16), PT=min(64, pow2(max(plan.nc, plan.nw, plan.ns))), num_warps=4)
    return o, reads, block_idx


def decode_attention_fwd(q: Tensor, cache, g_cmp: Tensor, g_slc: Tensor, g_win: Tensor,
                         scale: float) -> tuple[Tensor, Tensor]:
    """Routing entry ("decode", triton): (o [B,1,HQ,Dv], reads int64 [1]) over an NSACache."""
    c = cache.config
    o, reads, _ = nsa_decode(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.device_length,
                             g_cmp, g_slc, g_win, block_len=c.block_len,
                             block_stride=c.block_stride, sel_block=c.sel_block,
                             num_sel=c.num_sel, window=c.window, scale=scale)
    return o, reads
