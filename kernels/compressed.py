"""Triton kernels of NSA's compressed branch: attention forward / backward, top-n block selection.

Row layout shared by every query-side kernel (group-centric): a program owns TOK consecutive query
tokens times the G query heads of one KV head, laid out as rows r -> (token t0 + r // G_PAD, head
r % G_PAD); heads >= G are padding and masked. One load of a compressed key tile thus feeds a single
[TOK * G_PAD, BLOCK_N] tl.dot for the whole group.

Visibility: token t sees the compressed rows [lo(t), hi(t)) of k_cmp, i.e. the rows of its own
sequence whose block [i*d, i*d + l) ends at or before t. Both bounds are non-decreasing in the
packed token index (rows are packed per sequence in order), so a query tile sees one contiguous row
range: tiles past it are skipped (causality) and tiles inside every row's range run unmasked.

Nothing here reads device values on the host: varlen layouts are built with torch ops on device.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_ops.kernels import ordered
from nsa_ops.kernels.delta import row_delta
from nsa_ops.kernels.softmax import LOG2E, attend_tile, finish
from nsa_ops.kernels.utils import (cdiv, cuda_core_dots, dot_precision, given_delta, launch,
                                   launch_options, pow2, row_bytes, unit_last_stride,
                                   unscaled_do_gate)
from nsa_ops.reference import cmp_layout, key_span, num_cmp, query_layout


# --------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------

@triton.jit
def _query_rows(t0, T, G, TOK: tl.constexpr, G_PAD: tl.constexpr):
    """Token index, head-in-group and validity of the TOK * G_PAD rows of a query tile."""
    r = tl.arange(0, TOK * G_PAD)
    tok = t0 + r // G_PAD
    head = r % G_PAD
    return tok, head, (tok < T) & (head < G)


@triton.jit
def _token_pos(tok, T, SEQ, POS, VARLEN: tl.constexpr):
    """(sequence id, position inside the sequence) of packed tokens."""
    if VARLEN:
        inb = tok < T
        return tl.load(SEQ + tok, mask=inb, other=0), tl.load(POS + tok, mask=inb, other=0)
    return tl.zeros_like(tok), tok


@triton.jit
def _visible_rows(tok, T, NC, SEQ, POS, CMP_CU, L: tl.constexpr, STRIDE: tl.constexpr,
                  VARLEN: tl.constexpr):
    """Compressed rows [lo, hi) of k_cmp visible to each token: block i iff i*d + l - 1 <= pos."""
    seq, pos = _token_pos(tok, T, SEQ, POS, VARLEN)
    if VARLEN:
        lo = tl.load(CMP_CU + seq)
    else:
        lo = tl.zeros_like(tok)
    # keep the dividend non-negative: GPU division truncates, the interpreter's floors
    nvis = tl.where(pos >= L - 1, tl.maximum(pos - L + 1, 0) // STRIDE + 1, 0)
    return lo, tl.minimum(lo + nvis, NC)


@triton.jit
def _load_rows(ptr, tok, hq, st, sh, D: tl.constexpr, D_PAD: tl.constexpr, valid):
    """[rows, D_PAD] tile of a [T, heads, D] tensor (last dim contiguous), zero where masked.
    int64 offsets: a head-major tensor's head stride is T * D."""
    d = tl.arange(0, D_PAD)
    offs = tok.to(tl.int64)[:, None] * st + hq.to(tl.int64)[:, None] * sh + d[None, :]
    return tl.load(ptr + offs, mask=valid[:, None] & (d[None, :] < D), other=0.0)


@triton.jit
def _load_keys(ptr, rows, sn, D: tl.constexpr, D_PAD: tl.constexpr, valid):
    """[keys, D_PAD] tile of compressed rows (one KV head), zero where masked."""
    d = tl.arange(0, D_PAD)
    return tl.load(ptr + rows[:, None] * sn + d[None, :],
                   mask=valid[:, None] & (d[None, :] < D), other=0.0)


@triton.jit
def _kv_tile(k_ptr, v_ptr, skn, svn, n0, end, DK: tl.constexpr, DV: tl.constexpr,
             DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """The BLOCK_N compressed rows from n0 (one KV head): (their indices, K, V), zero from end."""
    cols = n0 + tl.arange(0, BLOCK_N)
    inb = cols < end
    return (cols, _load_keys(k_ptr, cols, skn, DK, DK_PAD, inb),
            _load_keys(v_ptr, cols, svn, DV, DV_PAD, inb))


@triton.jit
def _row_stats(ptr, tok, hq, HQ, valid):
    """Per-row fp32 value of a [T, HQ] contiguous tensor (lse, delta)."""
    return tl.load(ptr + tok * HQ + hq, mask=valid, other=0.0)


@triton.jit
def _row_lse2(ptr, tok, hq, HQ, valid):
    """A row's lse (`_row_stats`) in base 2, a row that sees nothing (-inf) at 0: its p is
    masked, and the exponent stays finite."""
    lse = _row_stats(ptr, tok, hq, HQ, valid)
    return tl.where(lse == float("-inf"), 0.0, lse) * LOG2E


@triton.jit
def _tile_span(lo, hi, valid, BLOCK: tl.constexpr):
    """Loop bounds over a union of per-row ranges [lo, hi), in steps of BLOCK.

    Returns (start, end_unmasked, end): steps starting before end_unmasked lie inside every row's
    range (only when all rows share lo, i.e. the tile does not straddle two sequences).
    """
    start = tl.min(tl.where(valid, lo, 2147483647), 0)
    end = tl.max(tl.where(valid, hi, 0), 0)
    common_hi = tl.min(tl.where(valid, hi, 2147483647), 0)
    uniform = tl.max(tl.where(valid, lo, 0), 0) == start
    n_full = tl.where(uniform, tl.maximum(common_hi - start, 0) // BLOCK, 0)
    return start, start + n_full * BLOCK, end


# --------------------------------------------------------------------------------------------
# Forward: o = softmax(q k_cmp^T * scale) v_cmp over the visible rows, lse per row
# --------------------------------------------------------------------------------------------

@triton.jit
def _fwd_step(q, k_ptr, v_ptr, skn, svn, n0, end, lo, hi, m_i, l_i, acc, qk_scale,
              DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    cols, k, v = _kv_tile(k_ptr, v_ptr, skn, svn, n0, end, DK, DV, DK_PAD, DV_PAD, BLOCK_N)
    # unscaled scores: the scale (to log2 units) goes into the exponent's fused multiply-add
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if MASKED:
        vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        s = tl.where(vis, s, float("-inf"))
    return attend_tile(s, v, m_i, l_i, acc, qk_scale, PREC)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, SEQ, POS, CMP_CU,
                sqb, sqt, sqh, skb, skn, skh, svb, svn, svh, sob, sot, soh,
                T, NC, H, G, HQ, qk_scale,
                L: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, TOK: tl.constexpr,
                G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr,
                PREC: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # AOTInductor passes Python floats as fp64
    b = (tl.program_id(1) // H).to(tl.int64)  # batch offsets can pass 2**31 elements
    kvh = (tl.program_id(1) % H).to(tl.int64)  # head offsets too: head-major stride T * D
    tok, head, valid = _query_rows(tl.program_id(0) * TOK, T, G, TOK, G_PAD)
    hq = kvh * G + head
    q = _load_rows(Q + b * sqb, tok, hq, sqt, sqh, DK, DK_PAD, valid)
    lo, hi = _visible_rows(tok, T, NC, SEQ, POS, CMP_CU, L, STRIDE, VARLEN)
    k_ptr = K + b * skb + kvh * skh
    v_ptr = V + b * svb + kvh * svh

    # finite start for the running max (`softmax.running_max`); rows that see nothing keep l = 0
    m_i = tl.full([TOK * G_PAD], -1e30, tl.float32)
    l_i = tl.zeros([TOK * G_PAD], tl.float32)
    acc = tl.zeros([TOK * G_PAD, DV_PAD], tl.float32)
    start, mid, end = _tile_span(lo, hi, valid, BLOCK_N)
    for n0 in range(start, mid, BLOCK_N):
        m_i, l_i, acc = _fwd_step(q, k_ptr, v_ptr, skn, svn, n0, end, lo, hi, m_i, l_i, acc,
                                  qk_scale, DK, DV, DK_PAD, DV_PAD, BLOCK_N, False, PREC)
    for n0 in range(mid, end, BLOCK_N):
        m_i, l_i, acc = _fwd_step(q, k_ptr, v_ptr, skn, svn, n0, end, lo, hi, m_i, l_i, acc,
                                  qk_scale, DK, DV, DK_PAD, DV_PAD, BLOCK_N, True, PREC)

    o, lse = finish(m_i, l_i, acc)
    d = tl.arange(0, DV_PAD)
    o_offs = b * sob + tok.to(tl.int64)[:, None] * sot + hq[:, None] * soh + d[None, :]
    tl.store(O + o_offs, o.to(O.dtype.element_ty), mask=valid[:, None] & (d[None, :] < DV))
    tl.store(LSE + (b * T + tok) * HQ + hq, lse, mask=valid)


# --------------------------------------------------------------------------------------------
# Backward: delta preprocessing, dq (query-centric) and dk/dv (key-centric)
# --------------------------------------------------------------------------------------------

@triton.jit
def _dq_step(q, do, lse2, delta, k_ptr, v_ptr, skn, svn, n0, end, lo, hi, dq, qk_scale,
             DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    cols, k, v = _kv_tile(k_ptr, v_ptr, skn, svn, n0, end, DK, DV, DK_PAD, DV_PAD, BLOCK_N)
    p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse2[:, None])
    if MASKED:
        vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        p = tl.where(vis, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PREC)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, GATE, DQ, SEQ, POS, CMP_CU,
               sqb, sqt, sqh, skb, skn, skh, svb, svn, svh, sdb, sdt, sdh, sgb, sgt, sgh,
               T, NC, H, G, HQ, scale, qk_scale,
               L: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, TOK: tl.constexpr,
               G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr,
               PREC: tl.constexpr, HAS_GATE: tl.constexpr):
    """dq of TOK tokens x the G heads of one KV head. HAS_GATE: dO is the layer's, scaled by
    the rows' gates GATE (fp32), which dq takes last (`utils.unscaled_do_gate`)."""
    # AOTInductor passes Python floats as fp64
    scale = tl.cast(scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    b = (tl.program_id(1) // H).to(tl.int64)  # batch offsets can pass 2**31 elements
    kvh = (tl.program_id(1) % H).to(tl.int64)  # head offsets too: head-major stride T * D
    tok, head, valid = _query_rows(tl.program_id(0) * TOK, T, G, TOK, G_PAD)
    hq = kvh * G + head
    q = _load_rows(Q + b * sqb, tok, hq, sqt, sqh, DK, DK_PAD, valid)
    do = _load_rows(DO + b * sdb, tok, hq, sdt, sdh, DV, DV_PAD, valid)
    lse2 = _row_lse2(LSE + b * T * HQ, tok, hq, HQ, valid)
    delta = _row_stats(DELTA + b * T * HQ, tok, hq, HQ, valid)
    lo, hi = _visible_rows(tok, T, NC, SEQ, POS, CMP_CU, L, STRIDE, VARLEN)
    k_ptr = K + b * skb + kvh * skh
    v_ptr = V + b * svb + kvh * svh

    dq = tl.zeros([TOK * G_PAD, DK_PAD], tl.float32)
    start, mid, end = _tile_span(lo, hi, valid, BLOCK_N)
    for n0 in range(start, mid, BLOCK_N):
        dq = _dq_step(q, do, lse2, delta, k_ptr, v_ptr, skn, svn, n0, end, lo, hi, dq, qk_scale,
                      DK, DV, DK_PAD, DV_PAD, BLOCK_N, False, PREC)
    for n0 in range(mid, end, BLOCK_N):
        dq = _dq_step(q, do, lse2, delta, k_ptr, v_ptr, skn, svn, n0, end, lo, hi, dq, qk_scale,
                      DK, DV, DK_PAD, DV_PAD, BLOCK_N, True, PREC)

    if HAS_GATE:
        dq *= _row_stats(GATE + b * T * HQ, tok, hq, HQ, valid)[:, None]
    d = tl.arange(0, DK_PAD)
    offs = b * sgb + tok.to(tl.int64)[:, None] * sgt + hq[:, None] * sgh + d[None, :]
    tl.store(DQ + offs, (dq * scale).to(DQ.dtype.element_ty),
             mask=valid[:, None] & (d[None, :] < DK))


@triton.jit
def _key_viewers(c, cvalid, T, KSEQ, KIDX, CU, VSTART, L: tl.constexpr, STRIDE: tl.constexpr,
                 VARLEN: tl.constexpr):
    """Tokens [first, end) that see compressed row c: its sequence's queries from the one at key
    position i*d + l - 1 on, and the first token of that sequence. VSTART[s] = CU[s] - (keys -
    queries of s): the query index of key position 0, so queries at the end of longer keys see
    rows from their first token on."""
    if VARLEN:
        seq = tl.load(KSEQ + c, mask=cvalid, other=0)
        idx = tl.load(KIDX + c, mask=cvalid, other=0)
        seq_start = tl.load(CU + seq, mask=cvalid, other=0)
        seq_end = tl.load(CU + seq + 1, mask=cvalid, other=0)
        view_start = tl.load(VSTART + seq, mask=cvalid, other=0)
        return tl.maximum(view_start + idx * STRIDE + L - 1, seq_start), seq_end, seq_start
    return c * STRIDE + L - 1, tl.zeros_like(c) + T, tl.zeros_like(c)


@triton.jit
def _dkdv_step(k, v, dk, dv, c, t0, Q, DO, LSE, DELTA, GATE, sqt, sqh, sdt, sdh,
               kvh, T, NC, G, HQ, qk_scale, SEQ, POS, CMP_CU,
               L: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, TOK: tl.constexpr,
               G_PAD: tl.constexpr, MASKED: tl.constexpr, VARLEN: tl.constexpr,
               PREC: tl.constexpr, HAS_GATE: tl.constexpr):
    tok, head, valid = _query_rows(t0, T, G, TOK, G_PAD)
    hq = kvh * G + head
    q = _load_rows(Q, tok, hq, sqt, sqh, DK, DK_PAD, valid)
    do = _load_rows(DO, tok, hq, sdt, sdh, DV, DV_PAD, valid)
    lse2 = _row_lse2(LSE, tok, hq, HQ, valid)
    delta = _row_stats(DELTA, tok, hq, HQ, valid)
    # transposed scores [keys, rows]: dv and dk come out of the dots directly. Unmasked tiles
    # skip the row mask: padded head rows load q = dO = lse = delta = 0 and add exactly nothing.
    p = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse2[None, :])
    if MASKED:
        lo, hi = _visible_rows(tok, T, NC, SEQ, POS, CMP_CU, L, STRIDE, VARLEN)
        vis = (c[:, None] >= lo[None, :]) & (c[:, None] < hi[None, :]) & valid[None, :]
        p = tl.where(vis, p, 0.0)
    if HAS_GATE:  # dO unscaled: P takes the rows' gates (`utils.unscaled_do_gate`)
        p = p * _row_stats(GATE, tok, hq, HQ, valid)[None, :]
    dv += tl.dot(p.to(do.dtype), do, input_precision=PREC)
    dp = tl.dot(v, tl.trans(do), input_precision=PREC)
    ds = p * (dp - delta[None, :])
    dk += tl.dot(ds.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, GATE, DK_OUT, DV_OUT, SEQ, POS, CMP_CU, KSEQ, KIDX, CU,
                 VSTART, SYNC, sqb, sqt, sqh, skb, skn, skh, svb, svn, svh, sdb, sdt, sdh,
                 sgkb, sgkn, sgkh, sgvb, sgvn, sgvh,
                 T, NC, H, G, HQ, scale, qk_scale, KEY_TILES,
                 L: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, TOK: tl.constexpr,
                 G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr,
                 PREC: tl.constexpr, NSPLIT: tl.constexpr, ORDERED: tl.constexpr,
                 HAS_GATE: tl.constexpr):
    """dk/dv of one key tile from one split of the tokens viewing it. ORDERED (the deterministic
    mode, kernels/ordered.py): a 1-D grid of tickets, split fastest, and the splits of a key tile
    add in split order instead of atomically. HAS_GATE: as `_dq_kernel`'s; P takes the gates."""
    # AOTInductor passes Python floats as fp64
    scale = tl.cast(scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    if ORDERED:
        ticket = ordered.take_ticket(SYNC)
        split = ticket % NSPLIT
        tile = ticket // NSPLIT % KEY_TILES
        bh = ticket // NSPLIT // KEY_TILES
    else:
        split = tl.program_id(2)
        tile = tl.program_id(0)
        bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # batch offsets can pass 2**31 elements
    kvh = (bh % H).to(tl.int64)  # head offsets too: head-major stride T * D
    c = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cvalid = c < NC
    k = _load_keys(K + b * skb + kvh * skh, c, skn, DK, DK_PAD, cvalid)
    v = _load_keys(V + b * svb + kvh * svh, c, svn, DV, DV_PAD, cvalid)
    first, end, seq_start = _key_viewers(c, cvalid, T, KSEQ, KIDX, CU, VSTART, L, STRIDE, VARLEN)

    # token tiles on the TOK grid from token 0: [q_start, full_lo) masked, then whole tiles
    # inside [full_lo, full_hi) (every token sees every key of the tile) unmasked, then the rest
    # masked
    q_start = tl.min(tl.where(cvalid, first, T), 0) // TOK * TOK
    q_end = tl.max(tl.where(cvalid, end, 0), 0)
    full_lo = tl.max(tl.where(cvalid, first, 0), 0)
    full_hi = tl.min(tl.where(cvalid, end, T), 0)
    n_pre = tl.cdiv(tl.maximum(full_lo - q_start, 0), TOK)
    mid_lo = q_start + n_pre * TOK
    mid_hi = mid_lo + tl.maximum(full_hi - mid_lo, 0) // TOK * TOK
    # this program's share of the viewing tokens: split s takes those in [s, s + 1) * share from
    # the start of the tile's sequence, the same tokens for every key tile of that sequence, so
    # that the key tiles of a head, launched together, read the same Q / dO rows together (split
    # starts on the TOK grid keep the phase boundaries above on tile edges)
    origin = tl.min(tl.where(cvalid, seq_start, T), 0) // TOK * TOK
    share = tl.cdiv(tl.cdiv(tl.maximum(q_end - origin, 0), NSPLIT), TOK) * TOK
    s_lo = tl.maximum(origin + split * share, q_start)
    s_hi = tl.minimum(origin + split * share + share, q_end)

    qp, dop = Q + b * sqb, DO + b * sdb
    lsep, deltap, gatep = LSE + b * T * HQ, DELTA + b * T * HQ, GATE + b * T * HQ
    dk = tl.zeros([BLOCK_N, DK_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, DV_PAD], tl.float32)
    for t0 in range(s_lo, tl.minimum(mid_lo, s_hi), TOK):
        dk, dv = _dkdv_step(k, v, dk, dv, c, t0, qp, dop, lsep, deltap, gatep, sqt, sqh, sdt,
                            sdh, kvh, T, NC, G, HQ, qk_scale, SEQ, POS, CMP_CU, L, STRIDE, DK, DV,
                            DK_PAD, DV_PAD, TOK, G_PAD, True, VARLEN, PREC, HAS_GATE)
    for t0 in range(tl.maximum(mid_lo, s_lo), tl.minimum(mid_hi, s_hi), TOK):
        dk, dv = _dkdv_step(k, v, dk, dv, c, t0, qp, dop, lsep, deltap, gatep, sqt, sqh, sdt,
                            sdh, kvh, T, NC, G, HQ, qk_scale, SEQ, POS, CMP_CU, L, STRIDE, DK, DV,
                            DK_PAD, DV_PAD, TOK, G_PAD, False, VARLEN, PREC, HAS_GATE)
    for t0 in range(tl.maximum(mid_hi, s_lo), s_hi, TOK):
        dk, dv = _dkdv_step(k, v, dk, dv, c, t0, qp, dop, lsep, deltap, gatep, sqt, sqh, sdt,
                            sdh, kvh, T, NC, G, HQ, qk_scale, SEQ, POS, CMP_CU, L, STRIDE, DK, DV,
                            DK_PAD, DV_PAD, TOK, G_PAD, True, VARLEN, PREC, HAS_GATE)

    dk_offs = b * sgkb + kvh * sgkh + c[:, None] * sgkn + tl.arange(0, DK_PAD)[None, :]
    dv_offs = b * sgvb + kvh * sgvh + c[:, None] * sgvn + tl.arange(0, DV_PAD)[None, :]
    dk_mask = cvalid[:, None] & (tl.arange(0, DK_PAD)[None, :] < DK)
    dv_mask = cvalid[:, None] & (tl.arange(0, DV_PAD)[None, :] < DV)
    if NSPLIT == 1:
        tl.store(DK_OUT + dk_offs, (dk * scale).to(DK_OUT.dtype.element_ty), mask=dk_mask)
        tl.store(DV_OUT + dv_offs, dv.to(DV_OUT.dtype.element_ty), mask=dv_mask)
    elif ORDERED:  # fp32 buffers, zeroed by the host
        if split > 0:
            ordered.wait_for(SYNC, ticket - 1)
        # .cg: read what the previous split wrote through L2, not a stale L1 line
        tl.store(DK_OUT + dk_offs, tl.load(DK_OUT + dk_offs, mask=dk_mask, cache_modifier=".cg")
                 + dk * scale, mask=dk_mask)
        tl.store(DV_OUT + dv_offs, tl.load(DV_OUT + dv_offs, mask=dv_mask, cache_modifier=".cg")
                 + dv, mask=dv_mask)
        ordered.pass_turn(SYNC, ticket)
    else:  # fp32 buffers, zeroed by the host; splits of one key tile meet only here
        tl.atomic_add(DK_OUT + dk_offs, dk * scale, mask=dk_mask, sem="relaxed")
        tl.atomic_add(DV_OUT + dv_offs, dv, mask=dv_mask, sem="relaxed")


# --------------------------------------------------------------------------------------------
# Block selection: Eq.9 + Eq.10 scores in registers, then in-kernel top-n
# --------------------------------------------------------------------------------------------

@triton.constexpr_function
def _spill_share(o, L, STRIDE, SEL):
    """With l <= l': the share of the compressed block at offset o (in strides of d) inside
    selection block j that belongs to block j + 1 (its own share is 1 minus it)."""
    return max(o * STRIDE + L - SEL, 0) / L


@triton.constexpr_function
def _spills(L, STRIDE, SEL):
    """Whether a compressed block ever runs into the next selection block: the last offset's
    does if any does (l <= l' only: with l > l' the tiles recompute the blocks that start
    earlier instead)."""
    return L <= SEL and _spill_share(SEL // STRIDE - 1, L, STRIDE, SEL) > 0


@triton.jit
def _add_offset(own, spill, p, o: tl.constexpr, L: tl.constexpr, STRIDE: tl.constexpr,
                SEL: tl.constexpr):
    """own, spill += the offset-o scores p, weighted by their shares: the constant shares stay
    out of the math where they are 1 or 0 (most offsets), where a weighted sum paid a multiply
    per score."""
    share: tl.constexpr = _spill_share(o, L, STRIDE, SEL)
    if share == 0:
        own += p
    else:
        own += p * (1.0 - share)
        spill += p * share
    return own, spill


@triton.jit
def _add_offsets4(own, spill, p, first: tl.constexpr, step: tl.constexpr, L: tl.constexpr,
                  STRIDE: tl.constexpr, SEL: tl.constexpr):
    """`_add_offset` of p [rows, SB, 4], whose last index i holds offset first + step * i."""
    even, odd = tl.split(p.reshape(p.shape[0], p.shape[1], 2, 2))  # i = 2a + b: b = 0, b = 1
    p0, p2 = tl.split(even)
    p1, p3 = tl.split(odd)
    own, spill = _add_offset(own, spill, p0, first, L, STRIDE, SEL)
    own, spill = _add_offset(own, spill, p1, first + step, L, STRIDE, SEL)
    own, spill = _add_offset(own, spill, p2, first + 2 * step, L, STRIDE, SEL)
    own, spill = _add_offset(own, spill, p3, first + 3 * step, L, STRIDE, SEL)
    return own, spill


# The widest key tile `_score_tile` scores as one dot: a [128 rows x 128 keys] fp32 tile fits the
# 128 registers a thread that select_blocks' multi-load tiles cap at (_SELECT_TILES); 32 blocks
# of l' = 8d would take one wgmma whose accumulator alone needs 128 (ptxas refused them:
# "Insufficient registers"), so wider steps score their strided tiles one dot each.
_WIDE_KEYS = tl.constexpr(128)


@triton.jit
def _score_tile(q, lse2, rvalid, nvis, k_ptr, skn, base, ncmp, j, qk_scale,
                L: tl.constexpr, STRIDE: tl.constexpr, SEL: tl.constexpr, DK: tl.constexpr,
                DK_PAD: tl.constexpr, TOK: tl.constexpr, G_PAD: tl.constexpr,
                SB: tl.constexpr, PREC: tl.constexpr):
    """Group-summed Eq.9 scores of the selection blocks j (one sequence's rows): (own, spill),
    each [TOK, SB].

    With l <= l' a compressed block i = j*R + o (o in [0, R), R = l'/d) starts in selection
    block j and may run into j + 1 only: `own` holds what the R strided [SB] key tiles give
    block j, `spill` what they give block j + 1 (the caller shifts it by one block), so every
    q.k_cmp is computed once. With l > l' a block spans several selection blocks: each tile
    recomputes the HEAD = l/d - 1 blocks that start in earlier selection blocks, and `spill` is 0.
    The overlap weights are exact integer arithmetic on block extents.

    Rows past a query's visible blocks start at or after (t - l + 2) rounded up to a multiple of
    d, so with l <= l' + d their scores only reach the blocks a query is forced to take (its
    current and previous ones), future ones it may not, and block 0 (the rows before the sequence
    when l > l'): the per-element visibility mask, as costly as the exponentials, is left out
    there. Padding rows score 0 through their lse2 = +inf, rows of other sequences (varlen) score
    garbage the caller drops.
    """
    R: tl.constexpr = SEL // STRIDE
    HEAD: tl.constexpr = 0 if L <= SEL else L // STRIDE - 1
    own = tl.zeros([TOK * G_PAD, SB], tl.float32)
    spill = tl.zeros([TOK * G_PAD, SB], tl.float32)
    # per query row first: the sum over the group's heads is a layout change, done once per tile
    if HEAD == 0 and (R == 2 or R == 4 or R == 8) and R * SB <= _WIDE_KEYS:
        # the R strided key tiles as one [R * SB] tile, offset-major (row o * SB + c holds block
        # j[c] * R + o): one wide dot, and each offset's scores stay in a thread's registers,
        # split out without data movement. H100, bf16, spec geometry (R = 4), 64k: 8.48 -> 7.89 ms
        # as one dot, the same indices; 7.89 -> 6.98 with the offsets split out (the weighted
        # sum over offsets paid a multiply and an add per score, 11% of a step's instructions)
        # and `_join_top`. At R = 1 (l = d = l') the loop below is one dot too, and this form
        # took 4.54 ms against 3.68
        o = tl.arange(0, R)
        kr = (j[None, :] * R + o[:, None]).reshape(R * SB)
        k = _load_keys(k_ptr, base + kr, skn, DK, DK_PAD, kr < ncmp)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.exp2(s - lse2[:, None]).reshape(TOK * G_PAD, R, SB).permute(0, 2, 1)
        if R == 2:
            p0, p1 = tl.split(p)
            own, spill = _add_offset(own, spill, p0, 0, L, STRIDE, SEL)
            own, spill = _add_offset(own, spill, p1, 1, L, STRIDE, SEL)
        elif R == 4:
            own, spill = _add_offsets4(own, spill, p, 0, 1, L, STRIDE, SEL)
        else:  # offsets 2a + b: the even ones, then the odd ones
            even, odd = tl.split(p.reshape(TOK * G_PAD, SB, 4, 2))
            own, spill = _add_offsets4(own, spill, even, 0, 2, L, STRIDE, SEL)
            own, spill = _add_offsets4(own, spill, odd, 1, 2, L, STRIDE, SEL)
    else:
        for o in tl.static_range(HEAD + R):
            kr = j * R - HEAD + o  # block index inside the sequence
            k = _load_keys(k_ptr, base + kr, skn, DK, DK_PAD, (kr >= 0) & (kr < ncmp))
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            p = tl.exp2(s - lse2[:, None])
            if L > SEL + STRIDE:
                p = tl.where(rvalid[:, None] & (kr[None, :] >= 0) & (kr[None, :] < nvis[:, None]),
                             p, 0.0)
            if HEAD > 0:
                start = kr * STRIDE
                overlap = tl.minimum(start + L, (j + 1) * SEL) - tl.maximum(start, j * SEL)
                own += p * (tl.maximum(overlap, 0).to(tl.float32) / L)[None, :]
            else:
                own, spill = _add_offset(own, spill, p, o, L, STRIDE, SEL)
    return (tl.sum(tl.reshape(own, (TOK, G_PAD, SB)), 1),
            tl.sum(tl.reshape(spill, (TOK, G_PAD, SB)), 1))


@triton.jit
def _block_keys(score, j, pos, live, SEL: tl.constexpr):
    """`top_n_keys`'s keys [TOK, SB] of blocks j [SB] for the rows where `live` (-1 elsewhere)."""
    cur = (pos // SEL)[:, None]
    jj = j[None, :]
    allowed = live[:, None] & (jj * SEL <= pos[:, None])
    forced = allowed & ((jj == 0) | (jj == cur) | (jj == cur - 1))
    return rank_key(score, jj, allowed, forced)


@triton.jit
def _shift_in(spill, carry, N: tl.constexpr):
    """spill [TOK, N] moved one block right, `carry` [TOK] entering at block 0: what each block
    receives from the block before it."""
    col = tl.arange(0, N)[None, :]
    from_left = tl.gather(spill, tl.maximum(col - 1, 0) + tl.zeros_like(spill).to(tl.int32),
                          axis=1)
    return tl.where(col == 0, carry[:, None], from_left)


@triton.jit
def _join_top(top, keys, NSEL_PAD: tl.constexpr):
    """The NSEL_PAD largest of a descending running top-n and of `keys`, descending: the two
    sorted lists meet as one bitonic sequence (one merge network, not a second sort)."""
    return tl.bitonic_merge(tl.maximum(top, tl.flip(tl.topk(keys, NSEL_PAD), 1)),
                            descending=True)


@triton.jit
def _score_sequence(best, q, lse2, valid, tok, T, NC, seq_id, SEQ, POS, CMP_CU, k_ptr, skn,
                    pos, live, qk_scale, L: tl.constexpr, STRIDE: tl.constexpr,
                    SEL: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr,
                    TOK: tl.constexpr, G_PAD: tl.constexpr, SB: tl.constexpr,
                    MERGE: tl.constexpr, NSEL_PAD: tl.constexpr, VARLEN: tl.constexpr,
                    PREC: tl.constexpr):
    """best [TOK, NSEL_PAD] with the rows of sequence seq_id (`live` [TOK], at positions `pos`)
    replaced by their top-n keys, descending.

    A running top-n over tiles of SB blocks, merged every MERGE tiles: no row ever holds all
    its block scores, so no tile shape depends on the sequence length. Every allowed block
    (j * l' <= pos) takes part; the ones past the last visible compressed block score 0."""
    lo, hi = _visible_rows(tok, T, NC, SEQ, POS, CMP_CU, L, STRIDE, VARLEN)
    seq, _ = _token_pos(tok, T, SEQ, POS, VARLEN)
    rvalid = valid & (seq == seq_id)
    nvis = hi - lo
    if VARLEN:
        base = tl.load(CMP_CU + seq_id)
        ncmp = tl.load(CMP_CU + seq_id + 1) - base
    else:
        base = 0
        ncmp = NC
    n_blk = tl.max(tl.where(live, pos // SEL + 1, 0), 0)
    n_tiles = tl.cdiv(n_blk, SB)
    carry = tl.zeros([TOK], tl.float32)
    top = tl.full([TOK, NSEL_PAD], -1, tl.int64)
    SPILLS: tl.constexpr = _spills(L, STRIDE, SEL)
    # the scores of the last MERGE tiles wait in `pending` (slot it % MERGE); their top-n joins
    # the running top-n once: a merge per tile costs more than the tile's own scores at l = d = l'
    slot = tl.arange(0, MERGE)[None, :, None]
    pending = tl.zeros([TOK, MERGE, SB], tl.float32)
    for it in range(0, n_tiles):
        own, spill = _score_tile(q, lse2, rvalid, nvis, k_ptr, skn, base, ncmp,
                                 it * SB + tl.arange(0, SB), qk_scale, L, STRIDE, SEL, DK,
                                 DK_PAD, TOK, G_PAD, SB, PREC)
        if SPILLS:
            # per tile: spills waiting beside the scores until the merge doubled `pending`'s
            # registers and took 8.30 against 7.89 ms at 64k, 2.65 against 0.88 at G = 1 (H100,
            # spec geometry)
            own += _shift_in(spill, carry, SB)
            carry = tl.sum(tl.where(tl.arange(0, SB)[None, :] == SB - 1, spill, 0.0), 1)
        if MERGE == 1:
            # straight from `own`: through `pending` the compiler laid the keys out for the
            # merge network with 217 shuffles against 137 (8k, spec geometry: 0.258 / 0.187 ms)
            top = _join_top(top, _block_keys(own, it * SB + tl.arange(0, SB), pos, live, SEL),
                            NSEL_PAD)
        else:
            pending = tl.where(slot == it % MERGE, own[:, None, :], pending)
            if (it % MERGE == MERGE - 1) | (it == n_tiles - 1):
                # slots past the last tile hold stale scores of blocks j >= n_blk, which no live
                # row may select: their keys are -1
                j = (it - it % MERGE) * SB + tl.arange(0, MERGE * SB)
                keys = _block_keys(tl.reshape(pending, (TOK, MERGE * SB)), j, pos, live, SEL)
                top = _join_top(top, keys, NSEL_PAD)
    return tl.where(live[:, None], top, best)


@triton.jit
def top_n_keys(score, allowed, forced, NSEL_PAD: tl.constexpr, NBLK_PAD: tl.constexpr):
    """The selection rule of `reference.topn_blocks` as keys: (key [..., NBLK_PAD], its NSEL_PAD
    largest [..., NSEL_PAD], descending), NSEL_PAD <= NBLK_PAD. Decode ranks all its blocks at
    once with it; prefill (`_score_sequence`) merges tiles of blocks into a running top-n of the
    same keys.

    Each candidate block j is one int64 key, (score bits << 32) + (2**31 - 1 - j): scores are >= 0
    so their float bits order like the floats, forced blocks carry +inf, and among equal scores
    the lower j has the larger key. Keys are distinct, so one bitonic tl.topk (not n rounds of
    argmax) ranks them with the reference's tie-break. Blocks not allowed are -1: below every
    allowed block, and `key_block` of them is meaningless."""
    key = rank_key(score, tl.arange(0, NBLK_PAD), allowed, forced)
    return key, tl.topk(key, NSEL_PAD)


@triton.jit
def rank_key(score, j, allowed, forced):
    """`top_n_keys`' key of block j: -1 where not allowed. A NaN score (a NaN input's row)
    ranks as 0, as in `reference.topn_blocks`: its float bits would outrank the forced blocks'
    +inf. tl.maximum is max.f32 (the interpreter's fmax), which takes the number of a NaN pair."""
    bits = tl.where(forced, float("inf"), tl.maximum(score, 0.0)).to(tl.int32, bitcast=True)
    return tl.where(allowed, (bits.to(tl.int64) << 32) + (2147483647 - j), -1)


@triton.jit
def key_block(key):
    """The block index j of a `top_n_keys` key >= 0."""
    return (2147483647 - (key & 2147483647)).to(tl.int32)


@triton.jit
def _select_kernel(Q, K, LSE, OUT, SEQ, POS, CMP_CU,
                   sqb, sqt, sqh, skb, skn, skh, sob, sot, soh,
                   T, NC, H, G, HQ, qk_scale,
                   L: tl.constexpr, STRIDE: tl.constexpr, SEL: tl.constexpr, NSEL: tl.constexpr,
                   NSEL_PAD: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr,
                   TOK: tl.constexpr, G_PAD: tl.constexpr, SB: tl.constexpr,
                   MERGE: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # AOTInductor passes Python floats as fp64
    b = (tl.program_id(1) // H).to(tl.int64)  # batch offsets can pass 2**31 elements
    kvh = (tl.program_id(1) % H).to(tl.int64)  # head offsets too: head-major stride T * D
    t0 = tl.program_id(0) * TOK
    tok, head, valid = _query_rows(t0, T, G, TOK, G_PAD)
    hq = kvh * G + head
    q = _load_rows(Q + b * sqb, tok, hq, sqt, sqh, DK, DK_PAD, valid)
    # +inf on padding rows (heads past G, tokens past T): _score_tile gives them p = 0 unmasked
    lse2 = tl.where(valid, _row_lse2(LSE + b * T * HQ, tok, hq, HQ, valid), float("inf"))
    k_ptr = K + b * skb + kvh * skh
    t = t0 + tl.arange(0, TOK)
    seq_t, pos = _token_pos(t, T, SEQ, POS, VARLEN)

    # a varlen tile may straddle sequences: score each one with its own block numbering
    seq_first, _ = _token_pos(t0, T, SEQ, POS, VARLEN)
    seq_last, _ = _token_pos(tl.minimum(t0 + TOK, T) - 1, T, SEQ, POS, VARLEN)
    best = tl.full([TOK, NSEL_PAD], -1, tl.int64)
    for seq_id in range(seq_first, seq_last + 1):
        best = _score_sequence(best, q, lse2, valid, tok, T, NC, seq_id, SEQ, POS, CMP_CU,
                               k_ptr, skn, pos, (t < T) & (seq_t == seq_id), qk_scale, L,
                               STRIDE, SEL, DK, DK_PAD, TOK, G_PAD, SB, MERGE, NSEL_PAD, VARLEN,
                               PREC)

    # ascending output without a sort: a chosen block's slot is its rank among the chosen
    slot = tl.arange(0, NSEL_PAD)
    chosen = (best >= 0) & (slot < NSEL)[None, :]
    blocks = key_block(best)
    below = chosen[:, None, :] & (blocks[:, None, :] < blocks[:, :, None])
    rank = tl.sum(below.to(tl.int32), 2)
    count = tl.sum(chosen.to(tl.int32), 1)
    out = OUT + b * sob + t[:, None] * sot + kvh * soh
    tl.store(out + rank, blocks, mask=chosen & (t < T)[:, None])
    empty = (slot[None, :] >= count[:, None]) & (slot < NSEL)[None, :] & (t < T)[:, None]
    tl.store(out + slot[None, :], tl.full([TOK, NSEL_PAD], -1, tl.int32), mask=empty)


# --------------------------------------------------------------------------------------------
# Host side: layouts and configs (no device-to-host reads)
# --------------------------------------------------------------------------------------------

class _Layout(NamedTuple):
    """Per-token and per-row index arrays (int32, device) for varlen input and for queries at
    the end of longer keys; all None for aligned fixed-length batches (VARLEN off)."""
    seq: Optional[Tensor] = None      # [T] sequence of each packed query
    pos: Optional[Tensor] = None      # [T] key position it sits at inside its sequence
    cmp_cu: Optional[Tensor] = None   # [N+1] first compressed row of each sequence
    key_seq: Optional[Tensor] = None  # [NC] sequence of each compressed row
    key_idx: Optional[Tensor] = None  # [NC] block index inside its sequence
    cu: Optional[Tensor] = None       # [N+1] the queries' cu_seqlens
    view_start: Optional[Tensor] = None  # [N] query index of each sequence's key position 0

    @property
    def varlen(self) -> bool:
        return self.seq is not None


def _layout(T: int, NC: int, block_len: int, block_stride: int, cu_seqlens: Optional[Tensor],
            device, with_keys: bool = False, seqlen_k: Optional[int] = None,
            cu_seqlens_k: Optional[Tensor] = None) -> _Layout:
    """Fixed-length queries at an offset (seqlen_k > T) take the varlen path as one sequence
    (the arrays do not depend on the batch index)."""
    Tk = T if seqlen_k is None else seqlen_k
    if cu_seqlens is None and Tk == T:
        return _Layout()
    i64 = dict(device=device, dtype=torch.int64)
    if cu_seqlens is None:  # one sequence of T queries over Tk keys
        cu, cu_k = (torch.tensor([0, n], **i64) for n in (T, Tk))
    else:
        cu = cu_seqlens.to(**i64)
        cu_k = cu if cu_seqlens_k is None else cu_seqlens_k.to(**i64)
    seq, pos = query_layout(T, cu, device, None, cu_k)
    counts = num_cmp(cu_k.diff(), block_len, block_stride)
    cmp_cu = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    view_start = cu[:-1] - (cu_k.diff() - cu.diff())
    i32 = torch.int32
    key_seq = key_idx = None
    if with_keys:
        key_seq, key_idx = (x.to(i32) for x in cmp_layout(NC, cu_k, block_len, block_stride,
                                                            device))
    return _Layout(seq.to(i32), pos.to(i32), cmp_cu.to(i32), key_seq, key_idx, cu.to(i32),
                   view_start.to(i32))


class _Cfg(NamedTuple):
    tok: int        # query tokens per program
    g_pad: int      # rows per token (heads of the group, padded to a power of two)
    block_n: int    # compressed rows per key tile
    num_warps: int
    num_stages: int


# (query rows, key rows, warps, stages) per kernel and tier (_tier): tiers 0 / 1 / 2 by the padded
# head-row size in bytes, FP32_TIER for fp32 rows. Tiers 0 and 1 cover fp16/bf16 head dims <= 128
# and <= 256 and compile for sm_90 without register spills; tier 2 only keeps wider rows within
# shared memory. Query rows are TOK * G_PAD: TOK shrinks as G grows. Tier 1, H100, bf16, HQ=64,
# H=4, l=32, d=16, T=16k, ms at Dk=192, Dv=128 / at D=256:
# forward (128, 64, 8, 2) 1.16 / 1.47 against (128, 32, 8, 2) 1.41 / 1.71 (timed at D=256 in a
# later run, the two interleaved: 1.15 / 1.47 against 1.41 / 1.71; (128, 64, 8, 3): 1.10 at
# Dk=192, over sm_90's shared memory at D=256), 2.25 / 3.21 for the (64, 32, 8, 3) before and
# 1.23-2.38 / 2.13-2.63 for three others; backward with dq (128, 64, 8, 1),
# dK dV (64, 64, 8, 2) 6.22 / 9.05 against 13.07 / 16.38 for the (32, 64, 8, 3), (32, 32, 8, 3)
# before and 6.0-9.6 / 9.0-16.9 for eight other pairs, of which dq (128, 64, 8, 2) asked 256 KB of
# shared memory at D=256 (over sm_90's 227: tests/test_sm90_shared_memory.py).
# fp32 rows of up to 512 bytes (D <= 128; wider ones take tier 2) have tiles of their own: their
# dots run on CUDA cores (ieee precision), and the 16-bit tiles of their byte tier spill 57-91 KB
# a thread at D = 128 and 3-82 KB at D = 64 (ptxas for sm_90a, Triton 3.9, CPU machine), against
# 1.6-4.8 KB and 0-0.5 KB for these. H100, T = 8k, D = 128, HQ = 64, H = 4, l = 32, d = 16, one
# `.gpu`-style sweep, ms: forward (32, 32, 4, 1) 8.40 against 103.5 at the tier-1 tile, (32, 32, 4,
# 2) 9.41, (64, 32, 8, 2) 9.58, (16, 32, 4, 2) 12.7 and 77.8-98.2 for three others; the backward
# 283.9 at the tier-1 tiles, 157.0 with dq alone at (32, 32, 4, 2) ((64, 32, 8, 2) 157.1, (32, 32,
# 4, 1) 159.2, four others 168.5-259.7) and 159.5 with dK dV alone at (32, 32, 4, 1) ((32, 32, 4,
# 2) 160.7, (64, 32, 8, 2) 162.0, four others 163.7-174.7). Both together were not timed (the two
# kernels run one after the other: about 33 ms), nor was D = 64.
FP32_TIER = 3
_TILES = {
    "fwd": ((128, 64, 8, 3), (128, 64, 8, 2), (32, 32, 8, 3), (32, 32, 4, 1)),
    "dq": ((128, 64, 8, 3), (128, 64, 8, 1), (32, 32, 8, 3), (32, 32, 4, 2)),
    "dkdv": ((64, 128, 8, 2), (64, 64, 8, 2), (32, 16, 8, 3), (32, 32, 4, 1)),
}
# Tier 0's forward and dq where the keys are few (at most SHORT_KEYS compressed rows: T <= 16k at
# d = 16): each program walks a few key tiles, and smaller programs spread them over more SMs.
# H200, bf16, D = 128, two interleaved rounds (`.gpu`-style script), ms, tier-0 tile -> this one:
# forward (64, 32, 4, 3) at T = 8k, l = 32, d = 16: G = 16 0.327 -> 0.259, G = 64 (H = 1) 0.319
# -> 0.258, G = 1 0.329 -> 0.268, G = 4 0.089 -> 0.087; l = d = 64: 8k 0.233 -> 0.148, 64k (1024
# rows) 3.59 -> 3.48. The whole backward with dq at (64, 64, 4, 2): 8k 0.972 -> 0.929 (G = 16),
# 1.031 -> 0.977 (G = 64), 1.155 -> 1.115 (G = 1), 0.303 -> 0.294 (G = 4); l = d = 64 0.551 ->
# 0.499 at 8k, 11.70 -> 11.51 at 64k. H100 at 16k (G = 16): forward 0.908 -> 0.875, backward 3.02
# -> 2.98. Past that they lose: 64k, l = 32, d = 16 (4095 rows), G = 16 forward 10.42 against
# 11.66-12.04, backward 38.23 against 38.85-39.08 with dq at (64, 64, 4, 2); G = 4 2.58 against
# 3.21, 9.86 against 9.97. The dK dV tile stays: nine tiles x four split counts at 8k and 16k
# (H100) read 0.99-2.30 / 2.87-8.22 ms against 1.01 / 3.01 for the tier's. Tier 1 keeps its tiles
# at any length: H100, 8k, Dk = 192 / Dv = 128 the best of six others gained 3-4% (forward (64, 32,
# 4, 3) 0.39 against 0.41 ms, backward with dq at (64, 32, 4, 2) 1.78 against 1.85); at D = 256
# (HQ = 32, H = 2) none beat it (forward 0.28-0.54 against 0.28, backward 1.40-1.77 against 1.40);
# at 16k every other forward tile lost at both and dq gained 2% at most.
SHORT_KEYS = 1024
_SHORT_TILES = {"fwd": (64, 32, 4, 3), "dq": (64, 64, 4, 2)}
# select_blocks per tier, for a score step of one key load (l = d = l') and of several (see
# `loads` in select_blocks): (query rows, selection blocks scored per step, steps per top-n
# merge, num_warps, num_stages, maxnreg, step_merges: the most steps a sequence may have for a
# merge every step instead, where a step holds the top-n).
# step_merges of the tier-0 multi-load tile, H200, bf16, spec geometry, do_bench medians of
# select_blocks alone (`.gpu`-style sweep; identical indices), merging every 8 steps against
# every step: 16k (8 steps) 0.608 -> 0.542 ms, 32k 1.95 -> 1.83, 48k 4.02-4.15 -> 4.01-4.07,
# 64k (32 steps) 6.92-7.04 -> 6.76-6.89, 96k (48 steps) 15.1-15.5 -> 14.8-15.1, but 128k (64
# steps) 25.7 -> 26.6-27.3; the one-load tile (l = d = l' = 64) lost 2.2-2.7x at 32k-96k (64k
# 3.17 -> 8.09), so it keeps 0 (every 8 steps wherever 8 can gather).
# Tier 0: merging every 8 steps (H100, bf16, D=128, G=16, ms at T = 8k / 64k / 128k; steps per
# merge 1 -> 8): l=d=l'=64 0.20 / 10.37 / 40.17 -> 0.20 / 4.68 / 16.07; l=32, d=16, l'=64 0.32 /
# 11.28 / 42.94 -> 0.31 / 10.22 / 37.61 (4, 16 and 32 in between or worse), before `_join_top`
# made a merge one bitonic merge (step_merges above). Sequences with fewer steps than that merge
# every step (_select_cfg). maxnreg 128 lets two 8-warp programs share an SM (one scores while the
# other waits on its keys); ptxas gave the uncapped tier-0 kernel 177 registers, so one per SM. At
# l=32, d=16 that pays with 32 blocks per step, whose pipelined keys leave shared memory for two
# programs (99 KB each, 64 blocks: 166 KB): H100 64k 10.36 -> 9.22 ms (64 blocks capped: 11.22;
# l=d=l'=64 4.78 -> 4.21), spilling 16 bytes then (bench/results/README.md); 56 bytes of spill
# stores at `0ebfd40` and at the kernel before it (Triton 3.6, ptxas for sm_90, 64k).
# Tier 1 (16-bit Dk of 129-256), H100, bf16, G = 16, one sweep each (`.gpu`-style script on
# `8825260`), identical indices on every tile: several loads a step (l = 32, d = 16, l' = 64) at
# Dk = 192 (HQ = 64, H = 4) / D = 256 (HQ = 32, H = 2), 16k: (128, 16, 8, 8, 1, 128) 0.93 / 0.50
# ms against 3.16-3.18 / 1.62-1.64 for the (64, 32, 1, 8, 1, None) it had (a merge every step),
# (128, 16, 4 or 16, 8, 1, 128) 0.98-1.05 / 0.52-0.56, (64, 32, 8, 4, 1, None) 1.10 / 0.60, and
# 1.17-3.16 / 0.60-1.63 for thirteen others; 64k 11.99 / 6.24 against 42.84 / 21.93 (two others
# 13.62-13.95 / 7.16-7.28). One load a step (l = d = l' = 64, Dk = 192), 16k / 64k: (128, 32, 8,
# 8, 1, 128) 0.48 / 4.93 against 1.07 / 13.79, (64, 32, 8, 4, 1, None) 0.50 / 5.48, five others
# 0.58-0.99 / 6.67-9.47.
# Tier 2 serves fp32 Dk of 129-256 only (the Triton rows refuse 16-bit Dk over 256); one stage
# keeps its unrolled key loads within shared memory. Its fp32 dots bound it, not its merge every
# step: H100, T = 8k, one sweep of seven tiles (`.gpu`-style script on `adbce76`), identical
# indices but for 3e-5 of the rows at Dk = 192 on three tiles (near-ties summed in another
# order): D = 256 (HQ = 32, H = 2) 5.72 ms against 5.70 merging every 8 steps at (32, 16, 8, 8, 1,
# None) and 5.90-125 for five others; Dk = 192 (HQ = 64, H = 4) 11.33 against 11.25 and
# 11.76-251; one load a step (l = d = l' = 64, D = 256) 2.86 against 2.77-2.87 and 15.1.
# fp32 rows (FP32_TIER), H100, T = 8k, D = 128, spec geometry, one sweep: (32, 16, 8, 4, 1, None)
# 5.49 ms against 40.0 at tier 1's tile of then, (64, 32, 1, 8, 1, None), (64, 32, 8, 8, 1, 128)
# 25.6, five others 38.8-53.8; 5 of the 524288 indices differ from that tile's (fp32 dots summed
# in another order round otherwise, and near-ties flip). Its one-load step (l = d = l') is
# untimed; ptxas (as above): no spills at D = 64 and 128 against 364-1040 bytes for the tiles
# fp32 rows took before.
_SELECT_TILES = (((64, 64, 8, 4, 2, 128, 0), (128, 32, 8, 8, 2, 128, 48)),
                 ((128, 32, 8, 8, 1, 128, 0), (128, 16, 8, 8, 1, 128, 0)),
                 ((32, 16, 1, 8, 1, None, 0), (32, 16, 1, 8, 1, None, 0)),
                 ((32, 16, 8, 4, 1, None, 0), (32, 16, 8, 4, 1, None, 0)))
# The most key loads a step (`loads` in select_blocks) pipelined over the tile's stages; a step of
# more loads takes one stage. Triton double-buffers every unrolled load of a step: sm_90 compiles
# of the tier-0 multi-load tile at 2 stages (tests/sm90_compile.py, bf16, D = 128) asked 99 KB of
# shared memory at 4 loads (l' = 4d, the spec), 148 KB at 7, 164-168 KB at 8 and 233 KB at 12
# (l' = 12d: over sm_90's 227 KB, so the launch raised OutOfResources; D = 96, G = 4, fp16 found
# it on an H200); at one stage 12 loads took 41 KB.
PIPELINED_LOADS = 8
# Tier 0 picks measured with bench/tune_tiles.py on an H100 (T=64k, HQ=64, H=4, D=128, bf16).
# Backward ms at l=32, d=16 / l=d=64 with the other kernel at its old (64, 64, 8, 3): dq
# (128, 64, 8, 3) 49.5 / 14.9 vs (64, 64, 8, 3) 62.5 / 18.6 and 5 others 51.3-68.6 / 15.2-19.3;
# dk/dv (64, 128, 8, 2) 49.4 / 15.4 vs 61.7-72.2 / 18.5-22.1 for 7 others. select_blocks at
# l=32, d=16 (5 key loads per step) 11.9 ms vs 12.8-18.3 ms for 8 other (rows, SB, warps,
# stages), at l=d=l'=64 4.5 ms vs 5.2-7.3 ms.


def _tier(dtype: torch.dtype, *dims: int) -> int:
    """The row of _TILES and _SELECT_TILES: FP32_TIER for fp32 head rows of <= 512 bytes (padded),
    else 0 / 1 / 2 for rows of <= 256 / <= 512 / more bytes."""
    width = row_bytes(dtype, *dims)
    if cuda_core_dots(dtype) and width <= 512:
        return FP32_TIER
    return 0 if width <= 256 else 1 if width <= 512 else 2


def _rows_cfg(G: int, rows: int) -> tuple[int, int]:
    """(TOK, G_PAD): TOK * G_PAD == max(rows, G_PAD) rows, every row of a token in one program."""
    g_pad = pow2(G)
    return max(1, rows // g_pad), g_pad


def _attn_cfg(kind: str, G: int, tier: int, NC) -> _Cfg:
    """The tile of kernel kind at G query heads per KV head, for NC compressed rows (a sequence
    has at most NC; symbolic in a dynamic-length trace, which takes the tier's tile)."""
    short = tier == 0 and kind in _SHORT_TILES and isinstance(NC, int) and NC <= SHORT_KEYS
    rows, block_n, num_warps, num_stages = _SHORT_TILES[kind] if short else _TILES[kind][tier]
    return _Cfg(*_rows_cfg(G, rows), block_n, num_warps, num_stages)


def _select_cfg(G: int, tier: int, num_sel: int, nblk: Optional[int], loads_per_step: int
                ) -> tuple[int, int, int, int, dict]:
    """(TOK, G_PAD, SB, MERGE, launch options): >= 16 dot rows; SB no wider than the nblk
    blocks need (short sequences) and >= 16 (tl.dot); MERGE x SB >= the padded n (each merge's
    top-n). nblk None (a symbolic length): the table's SB and MERGE, which serve every length."""
    rows, table_sb, merge, num_warps, num_stages, maxnreg, step_merges = \
        _SELECT_TILES[tier][loads_per_step > 1]
    if loads_per_step > PIPELINED_LOADS:
        num_stages = 1
    tok, g_pad = _rows_cfg(G, rows)
    g_pad = max(g_pad, 16 // tok)
    sb = max(table_sb if nblk is None else min(table_sb, pow2(nblk)), 16)
    n_pad = pow2(num_sel)
    # a merge every step where the sequence has fewer steps than one merge would gather, or at
    # most the tile's step_merges steps that each hold the top-n
    steps = None if nblk is None else cdiv(nblk, sb)
    if steps is not None and (steps < merge or (steps <= step_merges and sb >= n_pad)):
        merge = 1
    # Only a top-n wider than one merge's pending scores widens the step: a step of n blocks
    # leaves _score_tile's one wide dot, and took n = 48 / 64 3.4x the time of n = 16 on an
    # H100 at 64k (26.8 / 27.2 against 7.9 ms; 12.5 with 32-block steps merged 8 at a time).
    if merge * sb < n_pad:
        # and merges as many fewer steps as it widens them, so a merge ranks n_pad scores, no
        # more: at n = 64 with one query head per KV head (128 tokens a program), merging 8 x 64
        # scores kept Triton compiling for over 6 minutes (CPU machine, sm_90 target), 8 x 32
        # for 58 s
        merge = max(1, merge * (merge * sb) // n_pad)
        sb = n_pad // merge
    return tok, g_pad, sb, merge, launch_options(num_warps, num_stages, maxnreg)


def _dims(q: Tensor, k: Tensor, v: Optional[Tensor] = None):
    B, T, HQ, DK = q.shape
    NC, H = k.shape[1], k.shape[2]
    if HQ % H:
        raise ValueError(f"query heads {HQ} not a multiple of KV heads {H}")
    DV = v.shape[3] if v is not None else DK
    return B, T, HQ, H, HQ // H, NC, DK, DV


def _check(block_len: int, block_stride: int, cu_seqlens: Optional[Tensor], B: int,
           sel_block: Optional[int] = None):
    if block_len % block_stride or (sel_block is not None and sel_block % block_stride):
        raise ValueError("block_stride must divide block_len and sel_block")
    if cu_seqlens is not None and B != 1:
        raise ValueError("varlen input (cu_seqlens) needs batch size 1")


def _s(x: Tensor, *dims: int) -> list[int]:
    return [x.stride(d) for d in dims]


def _pad(D: int) -> int:
    """Head dims pad to a power of two, at least tl.dot's minimum of 16."""
    return pow2(D, 16)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def compressed_attention_fwd(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, block_len: int,
                             block_stride: int, scale: float,
                             cu_seqlens: Optional[Tensor] = None, *,
                             seqlen_k: Optional[int] = None,
                             cu_seqlens_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Compressed-branch attention. Returns o [B,T,HQ,Dv] (q.dtype) and lse fp32 [B,T,HQ].
    seqlen_k / cu_seqlens_k: the keys k_cmp comes from, when queries sit at their end."""
    B, T, HQ, H, G, NC, DK, DV = _dims(q, k_cmp, v_cmp)
    _check(block_len, block_stride, cu_seqlens, B)
    q, k_cmp, v_cmp = (unit_last_stride(x) for x in (q, k_cmp, v_cmp))
    o = torch.empty(B, T, HQ, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    if B * T * HQ == 0:
        return o, lse
    lay = _layout(T, NC, block_len, block_stride, cu_seqlens, q.device,
                  seqlen_k=seqlen_k, cu_seqlens_k=cu_seqlens_k)
    cfg = _attn_cfg("fwd", G, _tier(q.dtype, DK, DV), NC)
    launch(_fwd_kernel)[(cdiv(T, cfg.tok), B * H)](
        q, k_cmp, v_cmp, o, lse, lay.seq, lay.pos, lay.cmp_cu,
        *_s(q, 0, 1, 2), *_s(k_cmp, 0, 1, 2), *_s(v_cmp, 0, 1, 2), *_s(o, 0, 1, 2),
        T, NC, H, G, HQ, scale * LOG2E.value,
        L=block_len, STRIDE=block_stride, DK=DK, DV=DV, DK_PAD=_pad(DK), DV_PAD=_pad(DV),
        TOK=cfg.tok, G_PAD=cfg.g_pad, BLOCK_N=cfg.block_n, VARLEN=lay.varlen,
        PREC=dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o, lse


def compressed_attention_bwd(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, o: Tensor, lse: Tensor,
                             do: Tensor, dlse: Optional[Tensor], block_len: int,
                             block_stride: int, scale: float,
                             cu_seqlens: Optional[Tensor] = None, *,
                             seqlen_k: Optional[int] = None,
                             cu_seqlens_k: Optional[Tensor] = None,
                             do_gate: Optional[Tensor] = None,
                             delta: Optional[Tensor] = None
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of compressed_attention_fwd: dS = P * (dO v^T - rowsum(dO * O) + dlse).
    do_gate ([B, T, HQ]): the gradients of do_gate * do, from do (`utils.unscaled_do_gate`);
    delta: rowsum(dO * O) where the caller has it (`utils.given_delta`): no pass of its own."""
    B, T, HQ, H, G, NC, DK, DV = _dims(q, k_cmp, v_cmp)
    _check(block_len, block_stride, cu_seqlens, B)
    q, k_cmp, v_cmp, o, do = (unit_last_stride(x) for x in (q, k_cmp, v_cmp, o, do))
    lse = lse.to(torch.float32).contiguous()
    # contiguous, as the fake kernels say, whatever the inputs' layout
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k_cmp, v_cmp))
    if B * T * HQ == 0:
        return dq, dk.zero_(), dv.zero_()
    gate = unscaled_do_gate(do_gate, dlse)
    given = given_delta(delta, dlse, do)
    delta = row_delta(o, do, dlse) if given is None else given
    gate_arg = delta if gate is None else gate  # unread without a gate
    lay = _layout(T, NC, block_len, block_stride, cu_seqlens, q.device, with_keys=True,
                  seqlen_k=seqlen_k, cu_seqlens_k=cu_seqlens_k)
    common = dict(L=block_len, STRIDE=block_stride, DK=DK, DV=DV, DK_PAD=_pad(DK),
                  DV_PAD=_pad(DV), VARLEN=lay.varlen, PREC=dot_precision(q.dtype))
    tier = _tier(q.dtype, DK, DV)
    cfg = _attn_cfg("dq", G, tier, NC)
    launch(_dq_kernel)[(cdiv(T, cfg.tok), B * H)](
        q, k_cmp, v_cmp, do, lse, delta, gate_arg, dq, lay.seq, lay.pos, lay.cmp_cu,
        *_s(q, 0, 1, 2), *_s(k_cmp, 0, 1, 2), *_s(v_cmp, 0, 1, 2), *_s(do, 0, 1, 2),
        *_s(dq, 0, 1, 2), T, NC, H, G, HQ, scale, scale * LOG2E.value,
        TOK=cfg.tok, G_PAD=cfg.g_pad, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, HAS_GATE=gate is not None, **common)
    if NC > 0:
        cfg = _attn_cfg("dkdv", G, tier, NC)
        key_tiles = cdiv(NC, cfg.block_n)
        nsplit = _dkdv_splits(key_tiles * B * H, T, cfg.tok, q.device)
        if nsplit > 1:
            dk_acc = torch.zeros(dk.shape, dtype=torch.float32, device=dk.device)
            dv_acc = torch.zeros(dv.shape, dtype=torch.float32, device=dv.device)
        else:
            dk_acc, dv_acc = dk, dv
        grid = (key_tiles, B * H, nsplit)
        ordered_adds = nsplit > 1 and torch.are_deterministic_algorithms_enabled()
        sync = ordered.sync_buffer(key_tiles * B * H * nsplit, q.device) if ordered_adds else dk
        launch(_dkdv_kernel)[(key_tiles * B * H * nsplit,) if ordered_adds else grid](
            q, k_cmp, v_cmp, do, lse, delta, gate_arg, dk_acc, dv_acc, lay.seq, lay.pos,
            lay.cmp_cu, lay.key_seq, lay.key_idx, lay.cu, lay.view_start, sync,
            *_s(q, 0, 1, 2), *_s(k_cmp, 0, 1, 2), *_s(v_cmp, 0, 1, 2), *_s(do, 0, 1, 2),
            *_s(dk_acc, 0, 1, 2), *_s(dv_acc, 0, 1, 2), T, NC, H, G, HQ, scale, scale * LOG2E.value,
            key_tiles, TOK=cfg.tok, G_PAD=cfg.g_pad, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, NSPLIT=nsplit,
            ORDERED=ordered_adds, HAS_GATE=gate is not None, **common)
        if nsplit > 1:
            dk.copy_(dk_acc)
            dv.copy_(dv_acc)
    return dq, dk, dv


def _dkdv_splits(programs: int, T: int, tok: int, device) -> int:
    """Query-range splits per key tile so that the dk/dv grid fills the GPU.

    One program per key tile leaves most SMs idle at long T (64k tokens, l=d=64, H=4: 128
    programs, each walking up to 64k * G query rows). Splitting the viewing tokens gives about
    eight programs per SM, of which about half have tokens in their range (a split is a range of
    the sequence, which later key tiles see less of); each split adds its partial sums with fp32
    atomics, or in split order under torch.use_deterministic_algorithms(True). H100, bf16, D =
    128, HQ = 64, H = 4, backward ms, two interleaved rounds (`.gpu`-style script), programs per
    SM (cap on splits): at l = 32, d = 16, T = 8k / 16k / 32k / 64k, 4 (64) 0.843 / 2.72-2.73 /
    9.44 / 35.9-36.2, 8 (128) 0.817 / 2.51-2.52 / 8.73 / 32.3-32.9, 16 (128) 0.874 / 2.48-2.49 /
    8.51-8.57 / 31.4-31.6, 16 (256) 0.874 / 2.47 / 8.56-8.61 / 31.3-31.5, against 0.862 / 2.78 /
    9.70 / 35.9-36.5 for 4 (64) when splits were shares of each key tile's own viewers; at l = d
    = 64, 16k / 32k / 64k / 128k, 8 (128) 1.07 / 2.86-2.90 / 9.86-9.90 / 34.6-34.9, 8 (64) 1.04 /
    2.94-2.96 / 9.80-9.85 / 35.0-35.4, 16 (128) 1.07 / 2.99-3.01 / 9.68 / 33.4, against 1.12 /
    3.21-3.25 / 10.7-10.9 / 38.9-39.2 before.
    """
    if device.type != "cuda" or not isinstance(programs, int):
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, min(cdiv(8 * sms, programs), 128))
    # a symbolic T (dynamic-length trace) must not pick a grid dimension: splits past the query
    # tokens are empty programs, never wrong ones
    return min(want, cdiv(T, 4 * tok)) if isinstance(T, int) else want


def select_blocks(q: Tensor, k_cmp: Tensor, lse: Tensor, block_len: int, block_stride: int,
                  sel_block: int, num_sel: int, scale: float,
                  cu_seqlens: Optional[Tensor] = None, *, seqlen_k: Optional[int] = None,
                  cu_seqlens_k: Optional[Tensor] = None) -> Tensor:
    """Top-n selection blocks per (token, KV head): int32 [B,T,H,num_sel], ascending, -1 last
    (seqlen_k / cu_seqlens_k: queries at the end of longer keys)."""
    B, T, HQ, H, G, NC, DK, _ = _dims(q, k_cmp)
    _check(block_len, block_stride, cu_seqlens, B, sel_block)
    q, k_cmp = (unit_last_stride(x) for x in (q, k_cmp))
    lse = lse.to(torch.float32).contiguous()
    out = torch.empty(B, T, H, num_sel, dtype=torch.int32, device=q.device)
    if B * T * H * num_sel == 0:
        return out
    lay = _layout(T, NC, block_len, block_stride, cu_seqlens, q.device, seqlen_k=seqlen_k,
                  cu_seqlens_k=cu_seqlens_k)
    span = key_span(T, NC, block_len, block_stride, seqlen_k, cu_seqlens_k)
    # a dynamic-length trace (AOTInductor) has a symbolic span: no constexpr may depend on it
    nblk = cdiv(span, sel_block) if isinstance(span, int) else None
    # key tiles per step: l'/d, plus the l/d - 1 recomputed ones when l > l' (_score_tile)
    loads = sel_block // block_stride + (block_len // block_stride - 1
                                         if block_len > sel_block else 0)
    tok, g_pad, sb, merge, options = _select_cfg(G, _tier(q.dtype, DK), num_sel, nblk,
                                                      loads)
    launch(_select_kernel)[(cdiv(T, tok), B * H)](
        q, k_cmp, lse, out, lay.seq, lay.pos, lay.cmp_cu,
        *_s(q, 0, 1, 2), *_s(k_cmp, 0, 1, 2), *_s(out, 0, 1, 2),
        T, NC, H, G, HQ, scale * LOG2E.value,
        L=block_len, STRIDE=block_stride, SEL=sel_block, NSEL=num_sel,
        NSEL_PAD=pow2(num_sel), DK=DK, DK_PAD=_pad(DK), TOK=tok, G_PAD=g_pad,
        SB=sb, MERGE=merge, VARLEN=lay.varlen, PREC=dot_precision(q.dtype),
        # each step issues `loads` unrolled key loads; pipelining them over 3 stages overflows
        # shared memory (l=32, d=16, l'=64, D=128)
        **options)
    return out
