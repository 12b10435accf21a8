"""Sliding-window attention (NSA window branch): forward and backward over four backends.

Query t attends keys (t - w, t] of its own sequence. Layouts: q [B,T,HQ,Dk], k [B,T,H,Dk],
v [B,T,H,Dv], G = HQ // H; o [B,T,HQ,Dv] in q's dtype, lse float32 [B,T,HQ] (natural log).
Varlen: B == 1 and cu_seqlens int32 [N+1]; windows never cross sequences.

Backends (the routing table, nsa_ops.routing, states their limits and order; `backend=None`
takes the one routing would choose):
  flash_attn  the flash-attn (>= 2.7) package: FA-2 with window_size=(w-1, 0), causal.
  aten_fa2    the FA-2 kernels bundled with torch (aten::_flash_attention_forward/backward).
  triton      band-masked flash attention below; serves fp32, Dk != Dv, any G and queries at
              an offset, and is the faster one both ways on sm90 at the tuned head dims.
`backend_refusal` asks the routing table why a backend refuses; `select_backend` names the
backend a call will use.

The FA-2 backends take no lse gradient, so a given dlse costs them a second backward pass
(`_fa_backward`). Their varlen calls pass T as max_seqlen (a valid upper bound: FA-2 skips tiles
past each sequence's end), so no path reads cu_seqlens back to the host.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_ops import routing
from triton.tools.tensor_descriptor import TensorDescriptor

from nsa_ops.kernels.utils import (cdiv, cuda_core_dots, dot_precision, given_delta, launch,
                                   pow2, row_bytes, tma_descriptors, tma_kv_reason, tma_layout,
                                   unit_last_stride, unscaled_do_gate, use_tma)
from nsa_ops.kernels.softmax import LOG2E, attend_tile, finish
from nsa_ops.reference import query_keys
from nsa_ops.routing import Inputs

_OP = "sliding_window_attention"


# --------------------------------------------------------------------------------------------
# Triton kernels
#
# Programs are group-centric: one program owns one KV head and a tile of BLOCK_M "rows", row
# r = token * G + g (query head kvh * G + g), so every K/V tile it loads serves all G query
# heads of the group and G need not be a power of two. Key tiles outside the band of the row
# tile are never visited. Scores are kept in the log2 domain (qk_scale = scale * log2 e).
# Nested @jit helpers stay out of inner loops (the CPU interpreter pays milliseconds per nested
# call); inside them K/V pointers advance by whole tiles.
# --------------------------------------------------------------------------------------------

@triton.jit
def _rows(r0, kvh, T, G, BLOCK_M: tl.constexpr):
    """Token, query head and validity of rows r0 .. r0 + BLOCK_M."""
    rows = r0 + tl.arange(0, BLOCK_M)
    ok = rows < T * G
    tok = tl.where(ok, rows // G, 0)  # padding rows point at token 0 so their loads stay in bounds
    return tok, kvh * G + rows % G, ok


@triton.jit
def _offsets(b, tok, head, stride_b, stride_t, stride_h, d):
    """[len(tok), len(d)] element offsets of x[b, tok, head, d]; int64 for long sequences and
    head-major layouts (head stride T * D)."""
    row = tok.to(tl.int64) * stride_t + head.to(tl.int64) * stride_h
    return b.to(tl.int64) * stride_b + row[:, None] + d[None, :]


@triton.jit
def _band(tok, W, START, KEYPOS, OFF, VARLEN: tl.constexpr):
    """(first visible key, the key the query sits at) of query tokens: from the START / KEYPOS
    arrays for packed sequences, or t + OFF (OFF = Tk - T) at fixed length, which then needs no
    per-query arrays built before the launch."""
    if VARLEN:
        kpos = tl.load(KEYPOS + tok)
        return tl.maximum(kpos - W + 1, tl.load(START + tok)), kpos
    return tl.maximum(tok + OFF - W + 1, 0), tok + OFF


@triton.jit
def _key_span(r0, T, G, W, START, KEYPOS, OFF, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              VARLEN: tl.constexpr):
    """Keys [lo, hi) that rows r0 .. r0 + BLOCK_M can see, lo aligned down to BLOCK_N (a query's
    key position and first visible key grow with its index)."""
    lo, _ = _band(r0 // G, W, START, KEYPOS, OFF, VARLEN)
    _, last = _band((tl.minimum(r0 + BLOCK_M, T * G) - 1) // G, W, START, KEYPOS, OFF, VARLEN)
    return lo // BLOCK_N * BLOCK_N, last + 1


@triton.jit
def _whole_span(r0, T, G, W, START, KEYPOS, OFF, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                VARLEN: tl.constexpr):
    """Key tiles [lo, hi) that every row of rows r0 .. r0 + BLOCK_M sees whole: from the last
    row's first key (rounded up) to the first row's own key (rounded down); empty when the rows
    straddle two sequences. Their scores need no band mask."""
    _, last = _band(r0 // G, W, START, KEYPOS, OFF, VARLEN)
    first, _ = _band((tl.minimum(r0 + BLOCK_M, T * G) - 1) // G, W, START, KEYPOS, OFF, VARLEN)
    return tl.cdiv(first, BLOCK_N) * BLOCK_N, (last + 1) // BLOCK_N * BLOCK_N


@triton.jit
def _row_span(ROWSPAN, n0, T, G, W, OFF, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              VARLEN: tl.constexpr):
    """Rows [lo, hi) whose windows can reach the key tile n0 .. n0 + BLOCK_N - 1, lo aligned to
    BLOCK_M: from ROWSPAN (the query range per key tile) for packed sequences, else the tokens
    t with n0 <= t + OFF <= n0 + BLOCK_N + W - 2."""
    if VARLEN:
        tile = n0 // BLOCK_N
        lo = tl.load(ROWSPAN + 2 * tile)
        hi = tl.load(ROWSPAN + 2 * tile + 1)
    else:
        lo = tl.maximum(n0 - OFF, 0)
        hi = tl.minimum(n0 + BLOCK_N + W - 1 - OFF, T)
    return lo * G // BLOCK_M * BLOCK_M, hi * G


@triton.jit
def _kv_tile(KD, VD, k_ptrs, v_ptrs, b, n0, kvh, cols, TK, dk, dv, DK: tl.constexpr,
             DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
             BLOCK_DV: tl.constexpr, TMA: tl.constexpr):
    """The K and V tiles of keys cols = n0 .. n0 + BLOCK_N of head kvh: through the TMA
    descriptors KD, VD, or the pointer tiles k_ptrs, v_ptrs (zero past TK)."""
    if TMA:
        at = [b, n0, kvh, 0]  # int32: program ids and key positions
        k = tl.reshape(KD.load(at), (BLOCK_N, BLOCK_DK))
        v = tl.reshape(VD.load(at), (BLOCK_N, BLOCK_DV))
    else:
        k = tl.load(k_ptrs, mask=(cols[:, None] < TK) & (dk[None, :] < DK), other=0.0)
        v = tl.load(v_ptrs, mask=(cols[:, None] < TK) & (dv[None, :] < DV), other=0.0)
    return k, v


@triton.jit
def _fwd_kernel(Q, K, V, KD, VD, O, LSE, START, KEYPOS, OFF,
                sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
                T, TK, H, G, W, qk_scale,
                DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                VARLEN: tl.constexpr, TMA: tl.constexpr):
    """TMA: K/V tiles come through the TMA descriptors KD, VD (`utils.tma_descriptors`; a box
    past the last key reads zeros, as the masked loads do); without, KD and VD go unread."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # AOTInductor passes Python floats as fp64
    r0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1) // H
    kvh = tl.program_id(1) % H
    tok, head, ok = _rows(r0, kvh, T, G, BLOCK_M)
    first, kpos = _band(tok, W, START, KEYPOS, OFF, VARLEN)  # each row sees keys first .. kpos
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + _offsets(b, tok, head, sqb, sqt, sqh, dk),
                mask=ok[:, None] & (dk[None, :] < DK), other=0.0)

    # finite start for the running max (`softmax.running_max`): rows a tile masks whole then
    # give exp2(-inf - m) = 0, no NaN
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, hi = _key_span(r0, T, G, W, START, KEYPOS, OFF, BLOCK_M, BLOCK_N, VARLEN)
    # only the band's edge tiles need a mask (H100, T=64k, spec geometry, bf16: 4.13 -> 3.95 ms)
    whole_lo, whole_hi = _whole_span(r0, T, G, W, START, KEYPOS, OFF, BLOCK_M, BLOCK_N, VARLEN)
    n = lo + tl.arange(0, BLOCK_N)
    k_ptrs = K + _offsets(b, n, kvh, skb, skt, skh, dk)
    v_ptrs = V + _offsets(b, n, kvh, svb, svt, svh, dv)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k, v = _kv_tile(KD, VD, k_ptrs, v_ptrs, b, n0, kvh, cols, TK, dk, dv, DK, DV, BLOCK_N,
                        BLOCK_DK, BLOCK_DV, TMA)
        # unscaled scores: the scale goes into the exponent's fused multiply-add
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if (n0 < whole_lo) | (n0 >= whole_hi):
            band = ok[:, None] & (cols[None, :] >= first[:, None]) & \
                (cols[None, :] <= kpos[:, None])
            s = tl.where(band, s, float("-inf"))
        m, l, acc = attend_tile(s, v, m, l, acc, qk_scale, PRECISION)
        k_ptrs += BLOCK_N * skt
        v_ptrs += BLOCK_N * svt

    o, lse = finish(m, l, acc)
    tl.store(O + _offsets(b, tok, head, sob, sot, soh, dv), o.to(O.dtype.element_ty),
             mask=ok[:, None] & (dv[None, :] < DV))
    row = (b.to(tl.int64) * T + tok) * (H * G) + head
    tl.store(LSE + row, lse, mask=ok)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, QD, DOD, LSE, DELTA, GATE, START, KEYPOS, ROWSPAN, OFF, DKP,
                     DVP, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh,
                     sdkb, sdkt, sdkh, sdvb, sdvt, sdvh,
                     T, TK, H, G, W, qk_scale, scale,
                     DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                     BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr, VARLEN: tl.constexpr, TMA: tl.constexpr,
                     KEYS_AS_ROWS: tl.constexpr, ROTATE_ROWS: tl.constexpr,
                     HAS_GATE: tl.constexpr):
    """dK, dV of one key tile, summed over all G query heads of its group (no atomics).
    ROTATE_ROWS: step i visits the span's row tile whose index is i modulo the span's tile
    count, not its i-th: programs of neighbouring key tiles (launched together) then read the
    same Q / dO tiles at the same step, from L2, where in order they reach them BLOCK_N * G /
    BLOCK_M steps apart, after the other programs' loads have evicted them (spec geometry: 135
    MB of Q / dO in between; `TileConfig.rotate_rows_from` says from which length it pays).
    KEYS_AS_ROWS: the scores are kept transposed, [keys, rows], so P^T and dS^T feed the dV and
    dK dots from registers and Q / dO stay in shared memory; as [rows, keys] P and dS go through
    shared memory to be transposed, twice a step, but a step holds fewer registers
    (`TileConfig.keys_as_rows` says which tiles measured faster which way).
    TMA: Q/dO row tiles come through the descriptors QD, DOD, one box the BLOCK_M // G tokens
    x G heads of a tile (`_row_descriptors`: G divides BLOCK_M, and tiles start at whole
    tokens); without, QD and DOD go unread. Fixed length (VARLEN false) places queries at
    key t + OFF in-kernel, so START, KEYPOS and ROWSPAN go unread. HAS_GATE: dO is the
    layer's, which the rows' gates GATE (fp32, one per row) scale: P takes them
    (`utils.unscaled_do_gate`)."""
    # AOTInductor passes Python floats as fp64
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    n0 = tl.program_id(0) * BLOCK_N
    b = tl.program_id(1) // H
    kvh = tl.program_id(1) % H
    cols = n0 + tl.arange(0, BLOCK_N)
    dk_r = tl.arange(0, BLOCK_DK)
    dv_r = tl.arange(0, BLOCK_DV)
    k_mask = (cols[:, None] < TK) & (dk_r[None, :] < DK)
    v_mask = (cols[:, None] < TK) & (dv_r[None, :] < DV)
    k = tl.load(K + _offsets(b, cols, kvh, skb, skt, skh, dk_r), mask=k_mask, other=0.0)
    v = tl.load(V + _offsets(b, cols, kvh, svb, svt, svh, dv_r), mask=v_mask, other=0.0)
    q_base = Q + b.to(tl.int64) * sqb
    do_base = DO + b.to(tl.int64) * sdob
    row_base = b.to(tl.int64) * T * (H * G)

    dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, hi = _row_span(ROWSPAN, n0, T, G, W, OFF, BLOCK_M, BLOCK_N, VARLEN)
    n_tiles = tl.cdiv(hi - lo, BLOCK_M)
    if ROTATE_ROWS:
        phase = n_tiles - (lo // BLOCK_M) % tl.maximum(n_tiles, 1)
    for i in range(0, n_tiles):
        if ROTATE_ROWS:
            r0 = lo + (i + phase) % n_tiles * BLOCK_M
        else:
            r0 = lo + i * BLOCK_M
        # rows map to (token, head) by // and % G, so their offsets are recomputed per tile
        rows = r0 + tl.arange(0, BLOCK_M)
        ok = rows < T * G
        tok = tl.where(ok, rows // G, 0)
        head = kvh * G + rows % G
        first, kpos = _band(tok, W, START, KEYPOS, OFF, VARLEN)
        if TMA:
            at = [b, r0 // G, kvh * G, 0]  # rows past the last token read zeros
            q = tl.reshape(QD.load(at), (BLOCK_M, BLOCK_DK))
            do = tl.reshape(DOD.load(at), (BLOCK_M, BLOCK_DV))
        else:
            q = tl.load(q_base + (tok.to(tl.int64) * sqt + head.to(tl.int64) * sqh)[:, None]
                        + dk_r[None, :],
                        mask=ok[:, None] & (dk_r[None, :] < DK), other=0.0)
            do = tl.load(do_base + (tok.to(tl.int64) * sdot + head.to(tl.int64) * sdoh)[:, None]
                         + dv_r[None, :],
                         mask=ok[:, None] & (dv_r[None, :] < DV), other=0.0)
        row = row_base + tok.to(tl.int64) * (H * G) + head
        lse = tl.load(LSE + row, mask=ok, other=0.0) * LOG2E
        delta = tl.load(DELTA + row, mask=ok, other=0.0)

        # the band mask only where a row is padding or does not see the whole key tile
        whole_lo, whole_hi = _whole_span(r0, T, G, W, START, KEYPOS, OFF, BLOCK_M, BLOCK_N,
                                         VARLEN)
        edge = (r0 + BLOCK_M > T * G) | (n0 < whole_lo) | (n0 >= whole_hi)
        if KEYS_AS_ROWS:
            pt = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
                         - lse[None, :])
            if edge:
                band = ok[None, :] & (cols[:, None] >= first[None, :]) & \
                    (cols[:, None] <= kpos[None, :])
                pt = tl.where(band, pt, 0.0)
            if HAS_GATE:
                pt = pt * tl.load(GATE + row, mask=ok, other=0.0)[None, :]
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
            dst = pt * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
            dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
        else:
            p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                        - lse[:, None])
            if edge:
                band = ok[:, None] & (cols[None, :] >= first[:, None]) & \
                    (cols[None, :] <= kpos[:, None])
                p = tl.where(band, p, 0.0)
            if HAS_GATE:
                p = p * tl.load(GATE + row, mask=ok, other=0.0)[:, None]
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)

    tl.store(DKP + _offsets(b, cols, kvh, sdkb, sdkt, sdkh, dk_r),
             (dk * scale).to(DKP.dtype.element_ty), mask=k_mask)
    tl.store(DVP + _offsets(b, cols, kvh, sdvb, sdvt, sdvh, dv_r),
             dv.to(DVP.dtype.element_ty), mask=v_mask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, KD, VD, O, DO, LSE, DLSE, DELTA, GATE, START, KEYPOS, DQP,
                   sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, sdob, sdot, sdoh,
                   sdqb, sdqt, sdqh,
                   T, TK, H, G, W, OFF, qk_scale, scale,
                   DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr, HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr,
                   TMA: tl.constexpr, HAS_GATE: tl.constexpr, DELTA_GIVEN: tl.constexpr):
    """dQ of one row tile (tokens x the G heads of one KV head). It runs before the dK dV
    kernel and writes the rows' delta = rowsum(dO * O) - dlse for it: every row belongs to one
    program here, and dO is loaded anyway (a separate pass took 0.7 ms at 64k on an H100).
    DELTA_GIVEN: the caller wrote DELTA (`utils.given_delta`), so O goes unread.
    TMA: K/V tiles through the descriptors KD, VD, as in `_fwd_kernel`. HAS_GATE: dO is the
    layer's, scaled by the rows' gates GATE (fp32): delta stays rowsum(dO * O), and dq takes the
    gate last (`utils.unscaled_do_gate`)."""
    # AOTInductor passes Python floats as fp64
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    r0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1) // H
    kvh = tl.program_id(1) % H
    tok, head, ok = _rows(r0, kvh, T, G, BLOCK_M)
    first, kpos = _band(tok, W, START, KEYPOS, OFF, VARLEN)
    dk_r = tl.arange(0, BLOCK_DK)
    dv_r = tl.arange(0, BLOCK_DV)
    q_mask = ok[:, None] & (dk_r[None, :] < DK)
    q = tl.load(Q + _offsets(b, tok, head, sqb, sqt, sqh, dk_r), mask=q_mask, other=0.0)
    do_mask = ok[:, None] & (dv_r[None, :] < DV)
    do = tl.load(DO + _offsets(b, tok, head, sdob, sdot, sdoh, dv_r), mask=do_mask, other=0.0)
    row = (b.to(tl.int64) * T + tok) * (H * G) + head
    lse = tl.load(LSE + row, mask=ok, other=0.0) * LOG2E
    if DELTA_GIVEN:
        delta = tl.load(DELTA + row, mask=ok, other=0.0)
    else:
        o = tl.load(O + _offsets(b, tok, head, sob, sot, soh, dv_r), mask=do_mask, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        if HAS_DLSE:
            delta -= tl.load(DLSE + row, mask=ok, other=0.0)
        tl.store(DELTA + row, delta, mask=ok)

    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    lo, hi = _key_span(r0, T, G, W, START, KEYPOS, OFF, BLOCK_M, BLOCK_N, VARLEN)
    whole_lo, whole_hi = _whole_span(r0, T, G, W, START, KEYPOS, OFF, BLOCK_M, BLOCK_N, VARLEN)
    n = lo + tl.arange(0, BLOCK_N)
    k_ptrs = K + _offsets(b, n, kvh, skb, skt, skh, dk_r)
    v_ptrs = V + _offsets(b, n, kvh, svb, svt, svh, dv_r)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k, v = _kv_tile(KD, VD, k_ptrs, v_ptrs, b, n0, kvh, cols, TK, dk_r, dv_r, DK, DV,
                        BLOCK_N, BLOCK_DK, BLOCK_DV, TMA)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None])
        if (n0 < whole_lo) | (n0 >= whole_hi):
            band = ok[:, None] & (cols[None, :] >= first[:, None]) & \
                (cols[None, :] <= kpos[:, None])
            p = tl.where(band, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        k_ptrs += BLOCK_N * skt
        v_ptrs += BLOCK_N * svt

    if HAS_GATE:
        dq = dq * tl.load(GATE + row, mask=ok, other=0.0)[:, None]
    tl.store(DQP + _offsets(b, tok, head, sdqb, sdqt, sdqh, dk_r),
             (dq * scale).to(DQP.dtype.element_ty), mask=q_mask)


# --------------------------------------------------------------------------------------------
# Triton launchers
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int  # rows (token, query head) per program / per inner step of the dK dV kernel
    block_n: int  # keys per inner step / per program of the dK dV kernel
    num_warps: int
    num_stages: int
    # the dK dV kernel only: its scores as [keys, rows] (`_bwd_dkdv_kernel`'s KEYS_AS_ROWS)
    keys_as_rows: bool = False
    # the dK dV kernel only: from this many query tokens on it walks its rows rotated
    # (`_bwd_dkdv_kernel`'s ROTATE_ROWS); None: never (unmeasured)
    rotate_rows_from: Optional[int] = None


class Tiles(NamedTuple):
    fwd: TileConfig
    dkdv: TileConfig
    dq: TileConfig
    # the forward and dQ kernels reading K/V, the dK dV kernel Q/dO through TMA (sm90+); None:
    # unmeasured at these rows, the kernel keeps pointer loads
    fwd_tma: Optional[TileConfig] = None
    dq_tma: Optional[TileConfig] = None
    dkdv_tma: Optional[TileConfig] = None
    # the dK dV kernel with TMA where G >= WIDE_GROUP; None: dkdv_tma there too
    dkdv_tma_wide: Optional[TileConfig] = None
    # the dK dV kernel for fp32 rows on a GPU, pointer loads; None: the 16-bit tiles above
    dkdv_fp32: Optional[TileConfig] = None


# GPU tiles by the bytes one key's K and V rows take, padded as the tiles pad them (`_kv_bytes`:
# what a pipeline stage holds per key): (bytes up to, Tiles). Measured on H100s and an H200 but
# the last tier (a starting point), in 16 bits where the text below gives no dtype. The 512-byte
# rows (D = 128 in 16 bits), the fastest of bench/tune_window.py at T=64k, w=512, G=16
# (H100, bf16): forward (128, 32, 4, 3) 3.31-3.41 ms against 3.46-8.07 for ten others; dK dV (64,
# 64, 4, 2) 7.51 ms against 8.21-71 for fourteen others; dQ (128, 32, 4, 3) 4.19 ms against
# 4.32-10.8 for eleven others. With TMA loads (sm90+; T = 16k / 64k, two runs of the sweep,
# pointer loads 0.83-0.84 / 3.31-3.36 ms forward): forward (128, 64, 4, 2) 0.743, 0.77 / 3.151,
# 3.08 ms; (64, 64, 4, 3) 0.772, 0.91 / 3.179, 2.84; (128, 32, 4, 4) and (128, 32, 4, 3)
# 0.795-0.81 / 3.10-3.24; four others 0.85-0.99 / 3.34-4.09. The whole backward with the dQ
# kernel's TMA loads at (128, 32, 4, 3) 2.96 / 11.65 ms against 3.17 / 11.96 with pointer loads
# (one run; five other dQ tiles 3.17-3.90 / 11.99-15.14). With the dK dV kernel's Q/dO through TMA
# as well (one run): (64, 64, 4, 3) 2.69 / 10.89 ms against 2.94 / 11.57 at (64, 64, 4, 2) and
# 3.02-6.81 / 11.71-27.01 for six others; both kernels with pointer loads 3.02 / 11.88 at the
# pointer tile (64, 64, 4, 2). The 256-byte rows (D = 33-64 in 16 bits), one run at D = 64 (same
# geometry, T = 16k / 64k; FA-2 forward 1.11 / 5.87 ms, backward 2.18 / 8.56): forward with TMA
# (128, 64, 4, 3) 0.470 / 1.862, pointer loads (128, 32, 4, 3) 0.472 / 1.922; backward with TMA dQ
# (128, 32, 4, 3) and dK dV (64, 64, 4, 3) 1.594 / 6.256, pointer loads at the same tiles 1.621 /
# 6.480; the starting points before ((128, 64, 4, 3), (64, 64, 4, 2) both) 0.498 / 1.979 and 1.930
# / 7.550; five other sets 0.47-0.72 / 1.92-2.87 forward, 1.82-2.57 / 7.11-10.07 backward.
# The 768- and 1024-byte rows were one tier (keyed by the wider of K's and V's rows) until a
# forward tile that fits the first overflowed the second. Backward at Dk = 192, Dv = 128 (768
# bytes, T = 16k, H100, pointer loads): dQ (128, 32, 8, 2) with dK dV (64, 64, 8, 2) 6.37 ms
# against 10.33 for the (32, 32, 4, 1) both had and 6.48-10.07 for four other pairs; H200, two
# interleaved rounds (`.gpu`-style script): both kernels with TMA loads, dQ (128, 64, 8, 2) and
# dK dV (64, 64, 8, 2), 5.71 ms against 6.50 with pointer loads, four other dQ tiles 6.02-11.3 and
# five other dK dV tiles 7.37-13.5. The forward, H200, two interleaved rounds of 6 pointer and 7
# TMA tiles, ms at bf16 Dk = 192 / Dv = 128 (HQ = 64, H = 4, T = 16k), bf16 D = 256 (HQ = 32,
# H = 2, 16k) and fp32 D = 128 (HQ = 64, H = 4, 8k), both 1024 bytes: at 768 bytes TMA (128, 64,
# 8, 3) 1.03-1.05 (4.25 at 64k) and pointer loads (128, 64, 8, 3) 1.11, against 1.37 (5.47) for
# the pointer (64, 32, 4, 2) the tier had; at 1024 bytes, where (128, 64, 8, 3) is over sm_90's
# shared memory, TMA (128, 64, 8, 2) 0.70 / 9.63 against 0.96 / 11.37, pointer loads (128, 64, 8,
# 2) 0.80 / 10.41; the other tiles 1.09-1.72 / 0.77-2.35 / 10.07-20.07. At 1024 bytes the
# backward keeps pointer loads: with TMA, D = 256 took 4.95-14.7 ms against 3.99 (fp32 rows take
# `dkdv_fp32`, pointer loads). fp32 keys of 768 bytes (Dk = 128 with Dv <= 64, or the reverse)
# take the 16-bit tiles of their tier, unmeasured. The two backward kernels share one config
# where a tier was not measured.
_GPU_TILES = (
    (256, Tiles(TileConfig(128, 32, 4, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 32, 4, 3),
                fwd_tma=TileConfig(128, 64, 4, 3), dq_tma=TileConfig(128, 32, 4, 3),
                dkdv_tma=TileConfig(64, 64, 4, 3),
                dkdv_tma_wide=TileConfig(64, 64, 4, 3, keys_as_rows=True))),
    (512, Tiles(TileConfig(128, 32, 4, 3), TileConfig(64, 64, 4, 2), TileConfig(128, 32, 4, 3),
                fwd_tma=TileConfig(128, 64, 4, 2), dq_tma=TileConfig(128, 32, 4, 3),
                dkdv_tma=TileConfig(64, 64, 4, 3),
                dkdv_tma_wide=TileConfig(64, 128, 8, 3, keys_as_rows=True,
                                         rotate_rows_from=16384),
                dkdv_fp32=TileConfig(32, 64, 4, 2))),
    (768, Tiles(TileConfig(128, 64, 8, 3), TileConfig(64, 64, 8, 2), TileConfig(128, 32, 8, 2),
                fwd_tma=TileConfig(128, 64, 8, 3), dq_tma=TileConfig(128, 64, 8, 2),
                dkdv_tma=TileConfig(64, 64, 8, 2), dkdv_fp32=TileConfig(32, 32, 4, 1))),
    (1024, Tiles(TileConfig(128, 64, 8, 2), TileConfig(64, 64, 8, 2), TileConfig(128, 32, 8, 2),
                 fwd_tma=TileConfig(128, 64, 8, 2), dkdv_fp32=TileConfig(32, 32, 4, 1))),
    (math.inf, Tiles(TileConfig(32, 32, 4, 1), TileConfig(16, 32, 4, 1),
                     TileConfig(16, 32, 4, 1))),
)
# fp32 rows share the byte tiers with 16-bit ones, but their dots run on CUDA cores (ieee
# precision), where the 16-bit dK dV tiles spill: whole backward, H100, T = 8k, G = 16, pointer
# loads, `.gpu`-style sweep: D = 128 (64, 64, 8, 2) 332.9 ms, (32, 32, 4, 1) 50.9, (32, 32, 4, 2)
# 58.3, (32, 16, 4, 2) 68.4, (16, 32, 4, 1) 70.2, (32, 64, 8, 2) 72.1, three others 315-512; D =
# 64 (64, 64, 4, 2) 134.4, (32, 64, 4, 2) 20.4, (32, 32, 4, 2) 20.5, (32, 32, 4, 1) 21.5, four
# others 21.8-31.4. No dQ tile beat the routed one by 1% at either (eight tiles each) and the
# forward's fp32 D = 128 tile measured 11.3 ms against 11.2-21.2 for eight others: both stay.
# The dK dV kernel's transposed form (`TileConfig.keys_as_rows`) with TMA loads pays from G = 16
# on, where a row tile holds 4 tokens or fewer. H100, bf16, whole backward, against the [rows,
# keys] form at (64, 64, 4, 3), two interleaved rounds: D = 128 at 64k (64, 128, 8, 3) 10.33 ms
# against 10.55-10.74, (32, 128, 8, 3) 10.93-11.03, (64, 64, 4, 3) 10.97-11.05, (64, 128, 8, 2)
# 11.21, (128, 128, 8, 2) 31.8; D = 64 at 64k (64, 64, 4, 3) 6.03-6.07 against 6.28-6.45, (64,
# 128, 8, 3) 6.89-6.92. Every transposed tile loses with fewer heads: G = 8, D = 128, 16k / 64k
# 1.83-2.37 / 6.94-8.93 against 1.40-1.45 / 5.58-6.16; G = 4 0.93-2.28 against 0.70; D = 64, G =
# 8 / 4, 1.17-1.46 / 0.61-0.75 against 0.83-0.84 / 0.45. Routed, three rounds each: G = 16, D =
# 128, 64k 10.44-11.25 against 10.83-12.51 (two jobs), 16k 2.64-2.89 against 2.72-2.89; D = 64,
# 64k 6.20-6.52 against 6.35-7.53; G = 32, D = 128, 16k 5.24-5.77 against 5.30-6.02 but 64k
# 22.56-23.17 against 21.48-21.89; D = 64, 16k 3.06-3.45 against 3.19-3.77; G = 64, D = 128, 16k
# 10.43-10.78 against 10.70-11.89: one loss in six, taken for the spec's G = 16. Other tiles at
# G = 16, 64k, two rounds against the routed one: D = 128 (64, 128, 8, 4) 10.58-10.67 against
# 10.52-10.58, (32, 128, 8, 4) 11.39-13.33, (32, 128, 8, 2) 13.70-14.46, (128, 64, 8, 2)
# 15.20-17.89, (64, 64, 8, 3) 15.28-18.20, (128, 64, 8, 3) over shared memory, and the [rows,
# keys] form at (64, 128, 8, 3) 17.77-19.33; D = 64 (64, 64, 4, 4) 6.31-6.37 against 6.13-6.16,
# (32, 64, 4, 3) 6.37-6.38, (128, 64, 4, 3) 6.47-6.49, (64, 128, 8, 4) 6.91-6.95. 768- and
# 1024-byte rows keep the [rows, keys] form: transposed at (32, 128, 8, 2), Dk = 192 / Dv = 128
# took 5.22 ms against 6.40 at 16k, but D = 256 10.55 against 3.93 at 8k.
# The spec's dK dV tile walks its rows rotated (`rotate_rows_from`) from 16k tokens: whole
# backward, H100, bf16, G = 16, D = 128, three interleaved rounds, in order / rotated: 8k
# 1.35-1.36 / 1.39 ms, 12k 2.03-2.12 / 2.06-2.10, 16k 2.72-2.84 / 2.74, 24k 4.18-4.21 / 4.12-4.15,
# 32k 5.59-5.68 / 5.48-5.51, 48k 8.34-8.47 / 8.17-8.23, 64k 11.17-11.26 / 10.93-10.97; visiting a
# shared row tile 1-8 steps apart instead of together read the same or slower. Other tiles keep
# the order, unmeasured.
WIDE_GROUP = 16
# The CPU interpreter's cost grows with the number of tiles; these still leave several tiles
# (and skipped ones) in the small test shapes.
_INTERPRETER_TILES = TileConfig(32, 16, 4, 1)


def _kv_bytes(dtype: torch.dtype, dk: int, dv: int) -> int:
    """The bytes of one key's K and V rows, head dims padded as the tiles pad them: the key of
    `_GPU_TILES`."""
    return row_bytes(dtype, dk) + row_bytes(dtype, dv)


def _tile_config(kernel: str, kv_bytes: int, on_gpu: bool) -> Optional[TileConfig]:
    """The TileConfig of kernel "fwd", "dkdv", "dq", "fwd_tma", "dq_tma", "dkdv_tma",
    "dkdv_tma_wide" or "dkdv_fp32" for keys of kv_bytes (`_kv_bytes`; None: a TMA, wide-group
    or fp32 kernel unmeasured there)."""
    if not on_gpu:
        return _INTERPRETER_TILES
    tiles = next(t for limit, t in _GPU_TILES if kv_bytes <= limit)
    return getattr(tiles, kernel)


def _fp32_dkdv_tile(q: Tensor, width: int) -> Optional[TileConfig]:
    """The dK dV tile of fp32 keys of `width` bytes (`_kv_bytes`) on a GPU, where their tier has
    one (pointer loads); None: the tier's own tiles."""
    if not cuda_core_dots(q.dtype) or not q.is_cuda:
        return None
    return _tile_config("dkdv_fp32", width, True)


def _routed_tile(kernel: str, q: Tensor, k: Tensor, v: Tensor) -> Optional[TileConfig]:
    """The TileConfig kernel "fwd", "dq" or "dkdv", "_tma" appended where it reads through TMA,
    launches with (None: TMA tiles unmeasured for these rows): the tier's, but the dK dV kernel's
    own tiles for fp32 rows on a GPU and, with TMA, for groups of WIDE_GROUP heads or more, where
    the tier has them."""
    width = _kv_bytes(q.dtype, k.shape[3], v.shape[3])
    own = None
    if kernel == "dkdv":
        own = _fp32_dkdv_tile(q, width)
    elif kernel == "dkdv_tma" and q.shape[2] // k.shape[2] >= WIDE_GROUP:
        own = _tile_config("dkdv_tma_wide", width, q.is_cuda)
    return own or _tile_config(kernel, width, q.is_cuda)


def _tma_reason(kernel: str, q: Tensor, k: Tensor, v: Tensor, do: Optional[Tensor] = None
                ) -> Optional[str]:
    """Why kernel "fwd" or "dq" cannot read K/V, or "dkdv" Q/dO (do given), through TMA
    descriptors (None: it can)."""
    width = _kv_bytes(q.dtype, k.shape[3], v.shape[3])
    if kernel == "dkdv" and _fp32_dkdv_tile(q, width) is not None:
        return (f"fp32 K + V rows of {width} bytes take the dkdv_fp32 tile, measured with "
                f"pointer loads")
    tiles = _routed_tile(f"{kernel}_tma", q, k, v)
    if tiles is None:
        return f"no {kernel} TMA tiles measured for K + V rows of {width} bytes"
    if kernel != "dkdv":
        return tma_kv_reason(k, v)
    G = q.shape[2] // k.shape[2]
    if G & (G - 1) or tiles.block_m % G:
        return (f"G={G} query heads per KV head: not a power of two dividing the dK dV tile's "
                f"{tiles.block_m} rows (a box holds whole tokens)")
    if not (tma_layout(q) and tma_layout(do)):
        return "q or do has a layout TMA cannot describe (16-byte strides and start, unit last)"
    return None


def _tma_loads(kernel: str, tma: Optional[bool], q: Tensor, k: Tensor, v: Tensor,
               do: Optional[Tensor] = None) -> bool:
    """Whether kernel "fwd" or "dq" reads K/V tiles, or "dkdv" Q/dO tiles, through TMA
    descriptors (`utils.use_tma`: None where `_tma_reason` allows on sm90+, True forces)."""
    return use_tma(tma, _tma_reason(kernel, q, k, v, do), k)


def _operands(kernel: str, tma: Optional[bool], q: Tensor, k: Tensor, v: Tensor,
              do: Optional[Tensor] = None) -> tuple[dict, tuple, bool]:
    """(launch meta, the kernel's descriptor arguments, TMA) of kernel "fwd" or "dq" (KD, VD)
    or "dkdv" (QD, DOD): TMA descriptors where `_tma_loads` picks them, else the tensors
    themselves (unread)."""
    tma = _tma_loads(kernel, tma, q, k, v, do)
    meta = _kernel_meta(q, k, v, f"{kernel}_tma" if tma else kernel)
    if kernel == "dkdv":
        return meta, _row_descriptors(q, do, k.shape[2], meta) if tma else (q, do), tma
    kv = tma_descriptors(k, v, meta["BLOCK_N"], meta["BLOCK_DK"], meta["BLOCK_DV"]) if tma \
        else (k, v)
    return meta, kv, tma


def _row_descriptors(q: Tensor, do: Tensor, H: int, meta: dict) -> tuple:
    """TMA descriptors of q and do [B, T, HQ, D], one box a dK dV row tile of one KV head: its
    BLOCK_M // G tokens x the G query heads (D padded as the tile is)."""
    G = q.shape[2] // H
    box = [1, meta["BLOCK_M"] // G, G]
    return (TensorDescriptor.from_tensor(q, box + [meta["BLOCK_DK"]]),
            TensorDescriptor.from_tensor(do, box + [meta["BLOCK_DV"]]))


def _kernel_meta(q: Tensor, k: Tensor, v: Tensor, kernel: str) -> dict:
    dk, dv = k.shape[3], v.shape[3]
    block_dk = pow2(dk, 16)
    block_dv = pow2(dv, 16)
    cfg = _routed_tile(kernel, q, k, v)
    precision = dot_precision(q.dtype)
    meta = dict(DK=dk, DV=dv, BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, PRECISION=precision, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    if kernel.startswith("dkdv"):
        meta["KEYS_AS_ROWS"] = cfg.keys_as_rows
        # a symbolic length (a dynamic-length trace) keeps the order
        T = q.shape[1]
        meta["ROTATE_ROWS"] = cfg.rotate_rows_from is not None and isinstance(T, int) and \
            T >= cfg.rotate_rows_from
    return meta


def _strides(*xs: Tensor) -> list[int]:
    """(batch, token, head) strides of each [B,T,heads,D] tensor; D is unit-stride."""
    return [s for x in xs for s in x.stride()[:3]]


def _positions(q: Tensor, k: Tensor, cu_seqlens: Optional[Tensor],
               cu_seqlens_k: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(START, KEYPOS) int32 [Tq]: each query's first key and the key it sits at."""
    return tuple(x.to(torch.int32) for x in
                 query_keys(q.shape[1], k.shape[1], cu_seqlens, cu_seqlens_k, q.device))


def _triton_fwd(q, k, v, window, scale, cu_seqlens, cu_seqlens_k=None, tma=None):
    B, T, HQ, _ = q.shape
    Tk, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    o = torch.empty(B, T, HQ, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    meta, kv, tma = _operands("fwd", tma, q, k, v)
    grid = (cdiv(T * (HQ // H), meta["BLOCK_M"]), B * H)
    varlen = cu_seqlens is not None
    # fixed length: the kernel places query t at key t + Tk - T itself (no position arrays)
    starts, keypos = _positions(q, k, cu_seqlens, cu_seqlens_k) if varlen else (o, o)
    # sym_min: a dynamic-length trace (AOTInductor) keeps the clamp symbolic, no guard on Tk
    launch(_fwd_kernel)[grid](q, k, v, *kv, o, lse, starts, keypos, Tk - T,
                              *_strides(q, k, v, o), T, Tk, H, HQ // H,
                              torch.sym_min(window, Tk), scale * LOG2E.value, VARLEN=varlen,
                              TMA=tma, **meta)
    return o, lse


def _row_spans(keypos: Tensor, Tk: int, window: int, block_n: int) -> Tensor:
    """int32 [key tiles, 2]: the queries [lo, hi) whose windows reach each tile of block_n keys
    (query i sees keys (keypos[i] - w, keypos[i]]; keypos is non-decreasing)."""
    n0 = torch.arange(0, Tk, block_n, device=keypos.device, dtype=torch.int32)
    lo = torch.searchsorted(keypos, n0)
    hi = torch.searchsorted(keypos, n0 + block_n - 1 + window - 1, right=True)
    return torch.stack([lo, hi], 1).to(torch.int32)


def _triton_bwd(q, k, v, o, lse, do, dlse, window, scale, cu_seqlens, cu_seqlens_k=None,
                tma=None, do_gate=None, delta=None):
    B, T, HQ, Dk = q.shape
    Tk, H = k.shape[1], k.shape[2]
    G = HQ // H
    lse = lse.to(torch.float32).contiguous()
    given = given_delta(delta, dlse, do)
    delta = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device) if given is None \
        else given
    gate = unscaled_do_gate(do_gate, dlse)
    gate = delta if gate is None else gate  # unread without a gate
    dlse_arg = delta if dlse is None else dlse.to(torch.float32).contiguous()  # unread if absent
    varlen = cu_seqlens is not None
    # fixed length: the kernels place query t at key t + Tk - T themselves (no position arrays)
    starts, keypos = _positions(q, k, cu_seqlens, cu_seqlens_k) if varlen else (delta, delta)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    w = torch.sym_min(window, Tk)
    meta, kv, dq_tma = _operands("dq", tma, q, k, v)
    launch(_bwd_dq_kernel)[(cdiv(T * G, meta["BLOCK_M"]), B * H)](
        q, k, v, *kv, o, do, lse, dlse_arg, delta, gate, starts, keypos, dq,
        *_strides(q, k, v, o, do, dq), T, Tk, H, G, w, Tk - T, scale * LOG2E.value, scale,
        HAS_DLSE=dlse is not None, VARLEN=varlen, TMA=dq_tma, HAS_GATE=do_gate is not None,
        DELTA_GIVEN=given is not None, **meta)
    meta, rows, dkdv_tma = _operands("dkdv", tma, q, k, v, do)
    spans = _row_spans(keypos, Tk, w, meta["BLOCK_N"]) if varlen else delta
    launch(_bwd_dkdv_kernel)[(cdiv(Tk, meta["BLOCK_N"]), B * H)](
        q, k, v, do, *rows, lse, delta, gate, starts, keypos, spans, Tk - T, dk, dv,
        *_strides(q, k, v, do, dk, dv), T, Tk, H, G, w, scale * LOG2E.value, scale,
        VARLEN=varlen, TMA=dkdv_tma, HAS_GATE=do_gate is not None, **meta)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# FA-2 backends (flash_attn package, torch's bundled copy)
# --------------------------------------------------------------------------------------------

def _left(window: int, T: int) -> int:
    """FA-2 window_size_left: keys [t - left, t]. Clamped to T so it stays a valid int32."""
    return min(window, T) - 1


def _lse_fa_to_ours(lse: Tensor, varlen: bool) -> Tensor:
    """FA-2 lse [B,HQ,T] (varlen: packed [HQ,total]) -> ours [B,T,HQ], contiguous."""
    return (lse.t().unsqueeze(0) if varlen else lse.transpose(1, 2)).contiguous()


def _lse_ours_to_fa(lse: Tensor, varlen: bool) -> Tensor:
    """Inverse of `_lse_fa_to_ours`; FA-2 backward reads lse as a dense contiguous array."""
    return (lse[0].t() if varlen else lse.transpose(1, 2)).to(torch.float32).contiguous()


def _cu(cu_seqlens: Tensor, device) -> Tensor:
    return cu_seqlens.to(device=device, dtype=torch.int32).contiguous()


def _fa_backward(raw_bwd: Callable, q, k, v, o, lse, do, dlse, window, scale, cu_seqlens):
    """FA-2 backward plus the dlse term it has no input for.

    dS = P * (dP - delta + dlse). The extra part P * dlse comes from a second pass with V = 0 (so
    dP = 0) and dO', O' whose row dot is -dlse (FA-2 sums rowsum(dO' * O') in fp32): its dQ, dK
    are exactly the dlse contributions. Well conditioned for any dO, unlike folding dlse into O.
    dO' and O' are in o's dtype, so dlse goes in as `_split_rows`: three o-dtype parts carry its
    fp32 value, and a power-of-two row scale in dO' keeps fp16 parts below 65504.
    """
    grads = raw_bwd(do, q, k, v, o, lse, window, scale, cu_seqlens)
    if dlse is None:
        return grads
    scale_rows, parts = _split_rows(-dlse.to(torch.float32), o.dtype)
    unit = torch.zeros_like(o)
    unit[..., :3] = scale_rows.unsqueeze(-1)
    shifted = torch.zeros_like(o)
    shifted[..., :3] = parts
    dq1, dk1, _ = raw_bwd(unit, q, k, torch.zeros_like(v), shifted, lse, window, scale, cu_seqlens)
    dq, dk, dv = grads
    return dq + dq1, dk + dk1, dv


def _split_rows(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(s, parts [..., 3]) in dtype with s * parts.sum(-1) == x to about fp32 precision: parts are
    hi + mid + lo of x / s, s the power of two bringing |x| / s to [0.5, 1], kept within
    [2**-24, 2**14] so that s and the parts stay in fp16's range (its subnormals included)."""
    s = torch.exp2(torch.ceil(torch.log2(x.abs())).clamp(-24.0, 14.0))
    rest = x / s
    parts = []
    for _ in range(3):
        parts.append(rest.to(dtype))
        rest = rest - parts[-1].to(torch.float32)
    return s.to(dtype), torch.stack(parts, -1)


def _aten_fwd(q, k, v, window, scale, cu_seqlens):
    T = q.shape[1]
    win = dict(scale=scale, window_size_left=_left(window, T), window_size_right=0)
    if cu_seqlens is None:
        o, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, T, T, 0.0, True, False, **win)[:2]
        return o, _lse_fa_to_ours(lse, varlen=False)
    cu = _cu(cu_seqlens, q.device)
    o, lse = torch.ops.aten._flash_attention_forward(
        q[0], k[0], v[0], cu, cu, T, T, 0.0, True, False, **win)[:2]
    return o.unsqueeze(0), _lse_fa_to_ours(lse, varlen=True)


def _aten_raw_bwd(do, q, k, v, o, lse, window, scale, cu_seqlens):
    T = q.shape[1]
    win = dict(scale=scale, window_size_left=_left(window, T), window_size_right=0)
    # Stand-ins for the forward's rng_state / unused outputs: with dropout_p = 0 the kernel
    # never reads the philox state, and this API does not carry it from the forward.
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    fa_lse = _lse_ours_to_fa(lse, varlen=cu_seqlens is not None)
    if cu_seqlens is None:
        return torch.ops.aten._flash_attention_backward(
            do, q, k, v, o, fa_lse, None, None, T, T, 0.0, True, seed, offset, **win)
    cu = _cu(cu_seqlens, q.device)
    grads = torch.ops.aten._flash_attention_backward(
        do[0], q[0], k[0], v[0], o[0], fa_lse, cu, cu, T, T, 0.0, True, seed, offset, **win)
    return tuple(g.unsqueeze(0) for g in grads)


@functools.cache
def _flash_attn_interface():
    """flash_attn.flash_attn_interface if a usable flash-attn >= 2.7 is installed, else None.

    2.7 split window_size into window_size_left/right in the backward entry points used here.
    """
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except (ImportError, OSError):  # absent, or built against another torch/CUDA
        return None
    major, minor = (int(x) for x in flash_attn.__version__.split(".")[:2])
    return flash_attn_interface if (major, minor) >= (2, 7) else None


def _flash_fwd(q, k, v, window, scale, cu_seqlens):
    fa = _flash_attn_interface()
    T = q.shape[1]
    win = dict(dropout_p=0.0, softmax_scale=scale, causal=True, window_size=(_left(window, T), 0),
               return_attn_probs=True)
    with torch.no_grad():  # the op layer owns autograd; flash_attn's Function must not save
        if cu_seqlens is None:
            o, lse, _ = fa.flash_attn_func(q, k, v, **win)
            return o, _lse_fa_to_ours(lse, varlen=False)
        cu = _cu(cu_seqlens, q.device)
        o, lse, _ = fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, T, T, **win)
    return o.unsqueeze(0), _lse_fa_to_ours(lse, varlen=True)


def _flash_raw_bwd(do, q, k, v, o, lse, window, scale, cu_seqlens):
    fa = _flash_attn_interface()
    T = q.shape[1]
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    common = dict(dropout_p=0.0, softmax_scale=scale, causal=True,
                  window_size_left=_left(window, T), window_size_right=0, softcap=0.0,
                  alibi_slopes=None, deterministic=False, rng_state=None)
    fa_lse = _lse_ours_to_fa(lse, varlen=cu_seqlens is not None)
    if cu_seqlens is None:
        fa._flash_attn_backward(do, q, k, v, o, fa_lse, dq, dk, dv, **common)
    else:
        cu = _cu(cu_seqlens, q.device)
        fa._flash_attn_varlen_backward(do[0], q[0], k[0], v[0], o[0], fa_lse, dq[0], dk[0], dv[0],
                                       cu, cu, T, T, **common)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Capability checks and routing
# --------------------------------------------------------------------------------------------

_BACKENDS = {
    "flash_attn": (_flash_fwd, functools.partial(_fa_backward, _flash_raw_bwd)),
    "aten_fa2": (_aten_fwd, functools.partial(_fa_backward, _aten_raw_bwd)),
    "triton": (_triton_fwd, _triton_bwd),
}


def backend_refusal(backend: str, q: Tensor, v: Optional[Tensor] = None,
                    offset: bool = False) -> Optional[str]:
    """None if `backend` can serve q (and v, default shaped like q; queries at an offset if
    `offset`), else why not: the reason of its row in the routing table, which states every
    backend's limits (a backend named here counts as forced: under TRITON_INTERPRET, CPU
    tensors then stand in for a GPU's)."""
    if backend not in _BACKENDS:
        return f"unknown sliding-window backend {backend!r}; known: {', '.join(_BACKENDS)}"
    if backend == "flash_attn" and _flash_attn_interface() is None:
        return "flash_attn: the flash-attn package (>= 2.7, the backward API used here) is absent"
    return routing.forced_refusal(_OP, backend, Inputs.of(q, q if v is None else v,
                                                          offset=offset))


def select_backend(q: Tensor, v: Tensor, backend: Optional[str] = None,
                   offset: bool = False, backward: bool = False) -> str:
    """`backend` if it can serve the inputs, else (backend None) the backend routing would choose
    for the forward or, backward=True, the backward (its first row here that neither refuses nor
    defers). Raises ValueError with the refusal reason(s) when nothing fits."""
    if backend is None:
        rows = routing.reasons(_OP, Inputs.of(q, v, offset=offset, backward=backward))
        for row, reason, _ in rows:
            if reason is None and row.impl in _BACKENDS:
                return row.impl
        names = [row.impl for row, _, _ in rows if row.impl in _BACKENDS]
    else:
        names = [backend]
    reasons = {name: backend_refusal(name, q, v, offset) for name in names}
    for name, reason in reasons.items():
        if reason is None:
            return name
    raise ValueError("no sliding-window backend serves these inputs: "
                     + "; ".join(f"{name}: {reason}" for name, reason in reasons.items()))


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, window: int,
                  cu_seqlens: Optional[Tensor]) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, T, heads, D]")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] \
            or k.shape[1] < q.shape[1]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (k and v hold at least q's tokens)")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of KV heads {k.shape[2]}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if cu_seqlens is not None and (q.shape[0] != 1 or cu_seqlens.dim() != 1):
        raise ValueError("varlen input needs B == 1 and cu_seqlens [N + 1]")


def _backend_for(q: Tensor, k: Tensor, v: Tensor, backend: Optional[str],
                 cu_seqlens_k: Optional[Tensor], backward: bool = False) -> str:
    return select_backend(q, v, backend, offset=cu_seqlens_k is not None or
                          k.shape[1] != q.shape[1], backward=backward)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def sliding_window_fwd(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float,
                       cu_seqlens: Optional[Tensor] = None,
                       backend: Optional[str] = None, *,
                       cu_seqlens_k: Optional[Tensor] = None,
                       tma: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """(o [B,T,HQ,Dv] in q.dtype, lse float32 [B,T,HQ]); the query at key position p sees keys
    (p - w, p]: p = t, or Tk - Tq + t when k is longer (per sequence with cu_seqlens_k).
    tma (the triton backend): read K/V through TMA descriptors (None: where `_tma_loads`
    allows)."""
    _check_inputs(q, k, v, window, cu_seqlens)
    return routed_fwd(q, k, v, window, scale, cu_seqlens, _backend_for(q, k, v, backend,
                                                                       cu_seqlens_k),
                      cu_seqlens_k=cu_seqlens_k, tma=tma)


def routed_fwd(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float,
               cu_seqlens: Optional[Tensor], backend: str, *,
               cu_seqlens_k: Optional[Tensor] = None,
               tma: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """`sliding_window_fwd` on inputs the sliding_window_attention op checked and routed to
    `backend` (its routing row's target): without checking them or the backend again, which
    cost the op's call 14-19 us of host time (H200 host, hot)."""
    fwd, _ = _BACKENDS[backend]
    B, T, HQ, _ = q.shape
    if B * T == 0:
        return (q.new_empty(B, T, HQ, v.shape[3]),
                q.new_empty(B, T, HQ, dtype=torch.float32))
    q, k, v = (unit_last_stride(x) for x in (q, k, v))
    return fwd(q, k, v, int(window), float(scale), cu_seqlens,
               **_triton_extra(backend, cu_seqlens_k, tma))


def _triton_extra(backend: str, cu_seqlens_k: Optional[Tensor], tma: Optional[bool],
                  do_gate: Optional[Tensor] = None, delta: Optional[Tensor] = None) -> dict:
    """The keyword arguments a backend's call gets beyond the common ones; those only the
    triton backend takes are refused for the others, each by what it asks of the kernels."""
    extra = {} if cu_seqlens_k is None else dict(cu_seqlens_k=cu_seqlens_k)
    for name, value, label, asks in (
            ("tma", tma, f"tma={tma}", "reads K/V itself"),
            ("do_gate", do_gate, "do_gate", "takes dO's gate"),
            ("delta", delta, "delta", "takes the rows' delta")):
        if value is None:
            continue
        if backend != "triton":
            raise ValueError(f"{label}: only the triton backend {asks}, not {backend}")
        extra[name] = value
    return extra


def sliding_window_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                       dlse: Optional[Tensor], window: int, scale: float,
                       cu_seqlens: Optional[Tensor] = None,
                       backend: Optional[str] = None, *,
                       cu_seqlens_k: Optional[Tensor] = None,
                       tma: Optional[bool] = None,
                       do_gate: Optional[Tensor] = None,
                       delta: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the dtypes of q, k, v; dS = P * (dP - rowsum(dO * O) + dlse). tma (the
    triton backend): the dQ kernel reads K/V and the dK dV kernel Q/dO through TMA descriptors
    (None: each where `_tma_loads` allows; True forces both). do_gate (the triton backend, [B,
    T, HQ]): the gradients of do_gate * do, from do (`utils.unscaled_do_gate`). delta (the
    triton backend): rowsum(dO * O) where the caller has it (`utils.given_delta`)."""
    _check_inputs(q, k, v, window, cu_seqlens)
    return routed_bwd(q, k, v, o, lse, do, dlse, window, scale, cu_seqlens,
                      _backend_for(q, k, v, backend, cu_seqlens_k, backward=True),
                      cu_seqlens_k=cu_seqlens_k, tma=tma, do_gate=do_gate, delta=delta)


def routed_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
               dlse: Optional[Tensor], window: int, scale: float,
               cu_seqlens: Optional[Tensor], backend: str, *,
               cu_seqlens_k: Optional[Tensor] = None, tma: Optional[bool] = None,
               do_gate: Optional[Tensor] = None,
               delta: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """`sliding_window_bwd` on inputs the op's backward checked and routed to `backend`, as
    `routed_fwd`."""
    _, bwd = _BACKENDS[backend]
    if q.shape[0] * q.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q, k, v, o, do = (unit_last_stride(x) for x in (q, k, v, o, do))
    return bwd(q, k, v, o, lse, do, dlse, int(window), float(scale), cu_seqlens,
               **_triton_extra(backend, cu_seqlens_k, tma, do_gate, delta))
