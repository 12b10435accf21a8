"""Decode: NSA for the newest Tq tokens over an NSACache.

`decode_attention` asks the routing table (op "decode") for an implementation: the Triton kernels
of `nsa_ops.kernels.decode` (CUDA, Tq == 1, reading the length from the cache's device tensor, so
CUDA-graph capturable), `decode_chunk` (Tq > 1: chunked prefill through the prefill ops with the
queries at the end of the cached keys) or `decode_reference` below. All count reads the same way.

Reference: query rows sit at positions p = length - Tq .. length - 1 (their K/V already
appended). Each branch reads only its own cache, through `reference.masked_attention` with
position masks:

* compressed: the emitted rows, visible iff i*d + l - 1 <= p;
* selection: block scores from the compressed branch's lse (Eq.9/10, `reference.overlap_matrix`,
  `reference.topn_blocks`), then a gather of the n selected l'-token blocks per (query, KV head);
* window: the view of the last w tokens, visible iff p - w < s <= p.

Read counter (``cache.last_reads[r]`` for query row r at position p, S = p + 1):
  compressed rows visible to the row      = num_cmp(S)
+ selection rows gathered: n slots x l'   = n*l'  (fixed-size gather, as a block-sparse kernel
  loads whole tiles: an empty slot (-1) or the causally clamped tail of the current block is a
  slot that was loaded and masked, so it counts; the count never depends on the scores)
+ window tokens visible to the row        = min(w, S)
which is reads(S) of NSA-SPEC.md exactly. The three terms come from the masks and the gather
actually used, not from the formula. Branch caches are separate, so a token that is both in a
selected block and in the window counts once per branch. The counts are the same for every
batch row and KV head, so one number per query row is kept; ``cache.total_reads`` sums them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import observe, reference, routing
from .cache import NSACache

# Query rows per pass: bounds the [rows, n*l'] gathered K/V when many tokens arrive at once.
ROW_CHUNK = 64


def _selection(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, pos: Tensor, sel_block: int,
               scale: float) -> tuple[Tensor, int]:
    """Attention of each row over its gathered blocks; returns (o [B,Tq,HQ,Dv], rows read)."""
    B, Tq, HQ, _ = q.shape
    H, n = block_idx.shape[2], block_idx.shape[3]
    idx = block_idx.to(torch.int64)
    tok = (idx[..., None] * sel_block + torch.arange(sel_block, device=q.device)).flatten(-2)
    ok = (idx >= 0).repeat_interleave(sel_block, -1) & (tok <= pos[None, :, None, None])
    tok = torch.where(ok, tok, 0)  # [B,Tq,H,n*l']
    b = torch.arange(B, device=q.device)[:, None, None, None]
    h = torch.arange(H, device=q.device)[None, None, :, None]
    # one row per (batch, query): fold Tq into the batch so each row has its own key set
    ks = k[b, tok, h].transpose(2, 3).reshape(B * Tq, n * sel_block, H, -1)
    vs = v[b, tok, h].transpose(2, 3).reshape(B * Tq, n * sel_block, H, -1)
    mask = ok.reshape(B * Tq, H, 1, n * sel_block)
    o, _ = reference.masked_attention(q.reshape(B * Tq, 1, HQ, -1), ks, vs, lambda t0, t1: mask,
                                      scale)
    return o.view(B, Tq, HQ, -1), n * sel_block


def _rows(q: Tensor, p0: int, cache: NSACache, g_cmp: Tensor, g_slc: Tensor, g_win: Tensor,
          scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Rows at positions p0 .. p0 + Tq - 1 (p0 a host int: no device sync to find the window).
    Returns (o, reads, block_idx [B,Tq,H,n]); tests compare the kernel's selection with it."""
    c = cache.config
    dev = q.device
    pos = torch.arange(p0, p0 + q.shape[1], device=dev)

    k_cmp, v_cmp = cache.compressed_kv()
    cidx = torch.arange(k_cmp.shape[1], device=dev)
    cmp_mask = (cidx[None] * c.block_stride + c.block_len - 1) <= pos[:, None]  # [Tq, rows]
    o_cmp, lse = reference.masked_attention(q, k_cmp, v_cmp,
                                            lambda t0, t1: cmp_mask[None, None, t0:t1], scale)

    k, v = cache.selection_kv()
    nblk = -(-cache.length // c.sel_block)
    overlap = reference.overlap_matrix(cidx, c.block_len, c.block_stride, c.sel_block, nblk)
    p_cmp = reference.cmp_probs(q, k_cmp, lse, cmp_mask[None, None], scale)
    score = (p_cmp @ overlap.to(p_cmp.dtype)).sum(2).permute(0, 2, 1, 3)  # Eq.9, Eq.10
    block_idx = reference.topn_blocks(score, pos, c.sel_block, c.num_sel)
    o_slc, slc_reads = _selection(q, k, v, block_idx, pos, c.sel_block, scale)

    k_win, v_win, start = cache.window_kv(p0)
    d = pos[:, None] - torch.arange(start, cache.length, device=dev)[None]
    win_mask = (d >= 0) & (d < c.window)
    o_win, _ = reference.masked_attention(q, k_win, v_win,
                                          lambda t0, t1: win_mask[None, None, t0:t1], scale)

    reads = cmp_mask.sum(-1) + slc_reads + win_mask.sum(-1)
    return reference.gate_combine(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win), reads, block_idx


def decode_reference(q: Tensor, cache: NSACache, g_cmp: Tensor, g_slc: Tensor, g_win: Tensor,
                     scale: float) -> tuple[Tensor, Tensor]:
    """Routing entry ("decode", reference): (o [B,Tq,HQ,Dv], reads int64 [Tq])."""
    outs, reads = [], []
    Tq = q.shape[1]
    for r0 in range(0, Tq, ROW_CHUNK):
        r1 = min(Tq, r0 + ROW_CHUNK)
        o, n, _ = _rows(q[:, r0:r1], cache.length - Tq + r0, cache, g_cmp[:, r0:r1],
                        g_slc[:, r0:r1], g_win[:, r0:r1], scale)
        outs.append(o)
        reads.append(n)
    return torch.cat(outs, 1), torch.cat(reads)


def decode_chunk(q: Tensor, cache: NSACache, g_cmp: Tensor, g_slc: Tensor, g_win: Tensor,
                 scale: float) -> tuple[Tensor, Tensor]:
    """Routing entry ("decode", prefill_ops): Tq > 1 newest tokens (chunked prefill, a prompt
    continued from a cached prefix) through the nsa ops with the queries at the end of the
    cached keys, so CUDA runs the Triton prefill kernels. Returns (o, reads int64 [Tq]); the
    reads are reads(S) of the spec, as the reference counts them."""
    c = cache.config
    Tq, length = q.shape[1], cache.length
    nsa = torch.ops.nsa
    k_cmp, v_cmp = cache.compressed_kv()
    geometry = (c.block_len, c.block_stride)
    o_cmp, lse = nsa.compressed_attention(q, k_cmp, v_cmp, *geometry, scale, seqlen_k=length)
    block_idx = nsa.select_blocks(q, k_cmp, lse, *geometry, c.sel_block, c.num_sel, scale,
                                  seqlen_k=length)
    k, v = cache.selection_kv()
    o_slc, _ = nsa.selection_attention(q, k, v, block_idx, c.sel_block, scale)
    k_win, v_win, _ = cache.window_kv(length - Tq)
    o_win, _ = nsa.sliding_window_attention(q, k_win, v_win, c.window, scale)
    seen = torch.arange(length - Tq + 1, length + 1, device=q.device)  # tokens up to each row
    reads = reference.num_cmp(seen, *geometry) + c.num_sel * c.sel_block + \
        seen.clamp(max=c.window)
    return nsa.gate_combine(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win), reads


def decode_attention(q: Tensor, cache: NSACache, g_cmp: Tensor, g_slc: Tensor, g_win: Tensor,
                     scale: float) -> Tensor:
    """NSA output [B,Tq,HQ,Dv] of the cache's newest Tq tokens; q [B,Tq,HQ,Dk] rotated, gates
    [B,Tq,HQ] activated. Sets cache.last_reads (int64 [Tq]) and adds to cache.total_reads."""
    Tq = q.shape[1]
    if not 0 < Tq <= cache.length:
        raise ValueError(f"q must hold 1..{cache.length} query rows (the cached tokens), "
                         f"got Tq={Tq}")
    route = observe.choose("decode", routing.Inputs.of_cache(q, cache))
    # as in the prefill ops: inputs arrive in the dtypes autocast chose, and inside, float32
    # accumulation holds rather than autocast's per-op casts, so decode equals prefill
    with torch.autocast(q.device.type, enabled=False):
        o, reads = routing.resolve(route.forward)(q, cache, g_cmp, g_slc, g_win, scale)
    cache.last_reads = reads
    cache.total_reads += reads.sum()
    return o
