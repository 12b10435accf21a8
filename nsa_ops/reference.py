"""Pure-PyTorch reference of every part of ../shared/NSA-SPEC.md.

Readable before fast, but vectorised: the only Python loops run over query *chunks* (to bound the
[chunk, keys] score matrices) and never over tokens. Every kernel in `nsa_ops.kernels` is tested
against these functions, and the CPU kernels of the ``torch.ops.nsa`` ops are these functions.

Layouts follow flash-attn / fla: q [B,T,HQ,Dk], k [B,T,H,Dk], v [B,T,H,Dv]; query head h reads KV
head h // G with G = HQ // H. Varlen packs N sequences into B == 1 with cu_seqlens int32 [N+1];
compressed rows (k_cmp / v_cmp) are then packed per sequence in the same order, num_cmp(S_i) each,
and block indices are local to their sequence. Rows past the emitted ones are padding that no
query sees (phi returns `cmp_rows(T)` rows, see there).

Nothing here reads tensor values back to the host except `total_cmp` (validation and tests), so
the functions can run on CUDA tensors inside CUDA graphs and torch.compile.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

# Query rows per chunk: bounds the [B, H, G, chunk, keys] fp32 score tensor on long sequences.
DEFAULT_CHUNK = 256


def num_cmp(seq_len, block_len: int, block_stride: int):
    """Number of compressed blocks emitted for a sequence of ``seq_len`` tokens (int or tensor)."""
    if isinstance(seq_len, Tensor):
        return torch.where(seq_len < block_len, 0, torch.div(seq_len - block_len, block_stride,
                                                              rounding_mode="floor") + 1)
    return 0 if seq_len < block_len else (seq_len - block_len) // block_stride + 1


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (gradcheck); everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# Token and compressed-row layout (varlen without host syncs)
# --------------------------------------------------------------------------------------------

def token_layout(T: int, cu_seqlens: Optional[Tensor], device) -> tuple[Tensor, Tensor]:
    """Per packed token: (sequence id, position inside its sequence), both int64 [T]."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        return torch.zeros_like(t), t
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    seq = torch.searchsorted(cu, t, right=True) - 1
    return seq, t - cu[seq]


def query_layout(T: int, cu_seqlens: Optional[Tensor], device, seqlen_k: Optional[int] = None,
                 cu_seqlens_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Per query row: (sequence id, the key position it sits at), both int64 [T].

    Queries are bottom-right aligned with their keys, as in flash-attn's causal attention with
    unequal lengths: row i of a sequence of Tq queries over Tk keys sits at key position
    Tk - Tq + i (chunked prefill over a cache, context parallelism). Fixed length: Tk = seqlen_k
    (default T); varlen: the lengths of cu_seqlens_k (default cu_seqlens) against cu_seqlens.
    """
    seq, pos = token_layout(T, cu_seqlens, device)
    if cu_seqlens is None:
        return seq, pos + ((seqlen_k if seqlen_k is not None else T) - T)
    if cu_seqlens_k is None:
        return seq, pos
    lens_q, lens_k = ((cu[1:] - cu[:-1]).to(device=device, dtype=torch.int64)
                      for cu in (cu_seqlens, cu_seqlens_k))
    return seq, pos + (lens_k - lens_q)[seq]


def key_layout(T: int, cu_seqlens: Optional[Tensor], device, seqlen_k: Optional[int] = None,
               cu_seqlens_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Per key token: (sequence id, position inside its sequence), int64 [Tk]: the keys that
    query_layout places T queries at the end of (Tk = seqlen_k, default T; cu_seqlens_k, default
    cu_seqlens)."""
    return token_layout(T if seqlen_k is None else seqlen_k,
                        cu_seqlens if cu_seqlens_k is None else cu_seqlens_k, device)


def query_keys(T: int, Tk: int, cu_seqlens: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
               device) -> tuple[Tensor, Tensor]:
    """Per query row, int64 [T]: (the first packed key of its sequence, the packed key it sits
    at), for kernels that index keys by packed position (see query_layout)."""
    seq, pos = query_layout(T, cu_seqlens, device, Tk, cu_seqlens_k)
    if cu_seqlens is None:
        return torch.zeros_like(pos), pos
    cu = (cu_seqlens if cu_seqlens_k is None else cu_seqlens_k).to(device, torch.int64)
    return cu[seq], cu[seq] + pos


def token_starts(T: int, cu_seqlens: Optional[Tensor], device) -> Tensor:
    """First packed token of every token's sequence, int32 [T] (all 0 without cu_seqlens)."""
    if cu_seqlens is None:
        return torch.zeros(T, dtype=torch.int32, device=device)
    _, pos = token_layout(T, cu_seqlens, device)
    return (torch.arange(T, device=device) - pos).to(torch.int32)


def cmp_layout(num_rows: int, cu_seqlens: Optional[Tensor], block_len: int, block_stride: int,
               device) -> tuple[Tensor, Tensor]:
    """Per compressed row: (sequence id, block index inside its sequence), both int64 [num_rows].

    Padding rows past the packed ones fall to the last sequence, as blocks past its end: every
    consumer's causal test (block end i*d + l - 1 <= position) then hides them with no extra mask.
    """
    r = torch.arange(num_rows, device=device)
    if cu_seqlens is None:
        return torch.zeros_like(r), r
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    # first row of every sequence, [N+1]; built from [N+1]-sized tensors only, as a size-N one
    # would make torch.compile specialise on N == 1 (one sequence)
    cmp_cu = num_cmp(torch.diff(cu, prepend=cu[:1]), block_len, block_stride).cumsum(0)
    # right=True skips sequences that emitted no rows (equal offsets) and lands on the owner;
    # the clamp keeps padding rows in the last sequence
    seq = (torch.searchsorted(cmp_cu, r, right=True) - 1).clamp(max=cu.shape[0] - 2)
    return seq, r - cmp_cu[seq]


def cmp_rows(seq_len, block_stride: int):
    """Rows of the padded compressed layout that phi returns for T tokens: T // d + 2.

    T // d bounds the emitted rows of any split of T into packed sequences (num_cmp(S) <= S // d
    as d | l, and a sum of floors is at most the floor of the sum), so varlen compression sizes
    its output without reading cu_seqlens on the host. The + 2 keeps the count off 0 and 1, the
    sizes torch.compile specialises on (contiguity, broadcasting): one graph compiled with
    dynamic T then also serves T < block_len.
    """
    return seq_len // block_stride + 2


def total_cmp(cu_seqlens: Tensor, block_len: int, block_stride: int) -> int:
    """Number of emitted compressed rows for varlen input (reads cu_seqlens on the host: for
    validation and tests, never on a hot path)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return int(num_cmp(lens, block_len, block_stride).sum())


# --------------------------------------------------------------------------------------------
# Compression (phi)
# --------------------------------------------------------------------------------------------

def gather_blocks(x: Tensor, block_len: int, block_stride: int,
                  cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """Blocks [i*d, i*d+l) of every sequence: x [B,T,H,D] -> [B, cmp_rows(T), H, l, D].

    Row i is block i (varlen: the blocks of each sequence, packed in order); the rows past the
    emitted ones are padding, which no query sees.
    """
    T = x.shape[1]
    pad = block_len + block_stride
    # zero tokens past the end keep every row in bounds, padding rows included, for any T
    padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
    if cu_seqlens is None:
        # (T + pad - l) // d + 1 = cmp_rows(T) windows; unfold puts the window last: [B,N,H,D,l]
        return padded.unfold(1, block_len, block_stride).transpose(-1, -2)
    rows = cmp_rows(T, block_stride)
    seq, idx = cmp_layout(rows, cu_seqlens, block_len, block_stride, x.device)
    start = cu_seqlens.to(device=x.device, dtype=torch.int64)[seq] + idx * block_stride
    tok = start[:, None] + torch.arange(block_len, device=x.device)  # [rows, l]
    # only padding rows reach past T: park them on the zero tokens
    tok = tok.clamp(max=T + pad - 1)
    return padded[:, tok].transpose(2, 3)  # [B, rows, l, H, D] -> [B, rows, H, l, D]


def compress_mean(x: Tensor, block_len: int, block_stride: int,
                  cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """phi = mean pooling: [B,T,H,D] -> [B, cmp_rows(T), H, D]."""
    return gather_blocks(x, block_len, block_stride, cu_seqlens).mean(dim=-2)


def compress_mean_backward(grad: Tensor, seq_len: int, block_len: int, block_stride: int,
                           out: Optional[Tensor] = None) -> Optional[Tensor]:
    """The gradient of compress_mean's input x [B, seq_len, H, D] from that of its output
    (fixed length; None where block_stride does not divide block_len, which autograd then
    serves): token t lies in rows t // d - j, j < l / d, each weighing it 1 / l. Sums in float32
    at least; autograd's unfold backward took 0.38 ms per 64 MB gradient on an H100. out (x's
    gradient so far): add into it, each group of d tokens from its row by broadcasting, in one
    pass over out instead of building the gradient and adding it."""
    if block_len % block_stride:
        return None
    d, span = block_stride, block_len // block_stride
    rows = -(-seq_len // d)  # the rows that reach a token: t // d for t < seq_len
    share = grad[:, :rows].to(torch.promote_types(grad.dtype, torch.float32)) / block_len
    summed = share.clone()
    for j in range(1, min(span, rows)):
        summed[:, j:] += share[:, :rows - j]
    if out is None:
        return summed.repeat_interleave(d, dim=1)[:, :seq_len].to(grad.dtype)
    whole = seq_len // d
    out[:, :whole * d].unflatten(1, (whole, d)).add_(summed[:, :whole, None])
    out[:, whole * d:].add_(summed[:, whole:])  # the last d - 1 tokens or fewer: one row
    return out


def compress_mlp(x: Tensor, block_len: int, block_stride: int, pos_emb: Tensor, w1: Tensor,
                 b1: Tensor, w2: Tensor, b2: Tensor, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """phi = learnable MLP with intra-block position embedding, residual on mean pooling.

    phi(x_blk) = mean(x_blk + pe) + W2 gelu(W1 flatten(x_blk + pe) + b1) + b2, with pe [l, D].
    With pe = 0 and W2 = b2 = 0 (the initialisation) it equals mean pooling exactly, which is how
    the spec's "initialised to equal mean pooling" is met without constraining the hidden layer.
    """
    blocks = gather_blocks(x, block_len, block_stride, cu_seqlens) + pos_emb  # [B,N,H,l,D]
    hidden = torch.nn.functional.gelu(blocks.flatten(-2) @ w1.t() + b1)
    # in x's dtype like mean pooling: under autocast, float32 parameters would promote the rows
    return (blocks.mean(dim=-2) + hidden @ w2.t() + b2).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Masked attention core: forward and backward, chunked over queries
# --------------------------------------------------------------------------------------------

MaskFn = Callable[[int, int], Tensor]
"""mask_fn(t0, t1) -> bool mask [B or 1, H or 1, t1 - t0, S]: query rows t0..t1 may see key s."""


def _group(q: Tensor, H: int) -> Tensor:
    B, T, HQ, D = q.shape
    return q.view(B, T, H, HQ // H, D)


def _rows_grouped(x: Tensor, H: int) -> Tensor:
    """Per-row stats [B,T,HQ] (lse, dlse) as [B,H,G,T], the layout _probs takes."""
    return _group(x[..., None], H)[..., 0].permute(0, 2, 3, 1)


def _probs(qc: Tensor, k: Tensor, mask: Tensor, lse: Optional[Tensor], scale: float):
    """Scores [B,H,G,tc,S] masked; returns (probs, lse [B,H,G,tc]). lse = -inf on empty rows."""
    s = torch.einsum("bthgd,bshd->bhgts", qc, k) * scale
    m = mask.unsqueeze(2)  # broadcast over the G heads of a group
    s = s.masked_fill(~m, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    # only an empty row (lse = -inf) gets p = 0: a NaN in q or in a visible key makes its rows
    # NaN, as SDPA, FlashAttention and the Triton kernels make them
    seen = lse != float("-inf")
    safe = torch.where(seen, lse, torch.zeros_like(lse))
    p = torch.where(m & seen.unsqueeze(-1), torch.exp(s - safe.unsqueeze(-1)), torch.zeros_like(s))
    return p, lse


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask_fn: MaskFn, scale: float,
                     chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale, masked) v. Returns o [B,T,HQ,Dv] in q's dtype and lse [B,T,HQ].

    lse is float32 (float64 for float64 inputs, so gradcheck sees exact values). A query row that
    sees no key returns o = 0 and lse = -inf (never NaN).
    """
    B, T, HQ, _ = q.shape
    H, Dv = k.shape[2], v.shape[3]
    cdt = compute_dtype(q.dtype)
    k32, v32 = k.to(cdt), v.to(cdt)
    outs, lses = [], []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        qc = _group(q[:, t0:t1].to(cdt), H)
        p, lse = _probs(qc, k32, mask_fn(t0, t1), None, scale)
        outs.append(torch.einsum("bhgts,bshd->bthgd", p, v32).reshape(B, t1 - t0, HQ, Dv))
        lses.append(lse.permute(0, 3, 1, 2).reshape(B, t1 - t0, HQ))
    o = torch.cat(outs, 1) if outs else q.new_zeros(B, 0, HQ, Dv, dtype=cdt)
    lse = torch.cat(lses, 1) if lses else q.new_zeros(B, 0, HQ, dtype=cdt)
    return o.to(q.dtype), lse


def masked_attention_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                              dlse: Optional[Tensor], mask_fn: MaskFn, scale: float,
                              chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `masked_attention` w.r.t. q, k, v given dO and (optionally) dlse.

    dS = P * (dO V^T - rowsum(dO * O) + dlse): the dlse term is d lse / d s = P, so a caller that
    back-propagates through lse (select_blocks consumers, custom mixers) gets exact gradients.
    """
    B, T, HQ, Dk = q.shape
    H = k.shape[2]
    cdt = compute_dtype(q.dtype)
    k32, v32 = k.to(cdt), v.to(cdt)
    dk = torch.zeros_like(k32)
    dv = torch.zeros_like(v32)
    dqs = []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        qc = _group(q[:, t0:t1].to(cdt), H)
        doc = _group(do[:, t0:t1].to(cdt), H)
        oc = _group(o[:, t0:t1].to(cdt), H)
        lsec = _rows_grouped(lse[:, t0:t1].to(cdt), H)
        p, _ = _probs(qc, k32, mask_fn(t0, t1), lsec, scale)
        dv += torch.einsum("bhgts,bthgd->bshd", p, doc)
        dp = torch.einsum("bthgd,bshd->bhgts", doc, v32)
        delta = (doc * oc).sum(-1).permute(0, 2, 3, 1)  # [B,H,G,tc]
        if dlse is not None:
            delta = delta - _rows_grouped(dlse[:, t0:t1].to(cdt), H)
        ds = p * (dp - delta.unsqueeze(-1))
        dqs.append((torch.einsum("bhgts,bshd->bthgd", ds, k32) * scale).reshape(B, t1 - t0, HQ, Dk))
        dk += torch.einsum("bhgts,bthgd->bshd", ds, qc) * scale
    dq = torch.cat(dqs, 1) if dqs else torch.zeros_like(q, dtype=cdt)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------
# Branch masks
# --------------------------------------------------------------------------------------------

def compressed_mask_fn(T: int, num_rows: int, block_len: int, block_stride: int,
                       cu_seqlens: Optional[Tensor], device, seqlen_k: Optional[int] = None,
                       cu_seqlens_k: Optional[Tensor] = None) -> MaskFn:
    """Query at position p sees compressed block i of its own sequence iff i*d + l - 1 <= p.
    Rows are packed per key sequence (cu_seqlens_k, default cu_seqlens); see query_layout."""
    seq, pos = query_layout(T, cu_seqlens, device, seqlen_k, cu_seqlens_k)
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    cseq, cidx = cmp_layout(num_rows, cu_k, block_len, block_stride, device)
    last = cidx * block_stride + block_len - 1

    def mask_fn(t0: int, t1: int) -> Tensor:
        m = (seq[t0:t1, None] == cseq[None]) & (last[None] <= pos[t0:t1, None])
        return m[None, None]
    return mask_fn


def window_mask_fn(T: int, window: int, cu_seqlens: Optional[Tensor], device,
                   seqlen_k: Optional[int] = None,
                   cu_seqlens_k: Optional[Tensor] = None) -> MaskFn:
    """Query at position p sees keys (p - w, p] of its own sequence (see query_layout)."""
    seq, pos = query_layout(T, cu_seqlens, device, seqlen_k, cu_seqlens_k)
    kseq, kpos = key_layout(T, cu_seqlens, device, seqlen_k, cu_seqlens_k)

    def mask_fn(t0: int, t1: int) -> Tensor:
        d = pos[t0:t1, None] - kpos[None]
        m = (seq[t0:t1, None] == kseq[None]) & (d >= 0) & (d < window)
        return m[None, None]
    return mask_fn


def distinct_slots(block_idx: Tensor) -> Tensor:
    """bool [..., n]: slots naming a block (>= 0) that no earlier slot of their row names.

    A block_idx row is a set: any order, -1 anywhere, a repeated block counts once. Routes that
    walk slots (packed SDPA, the kernels' inverse index) keep just these.
    """
    idx = block_idx.to(torch.int64)
    ordered, perm = torch.sort(idx, dim=-1, stable=True)  # equal values keep slot order
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    return (idx >= 0) & ~torch.empty_like(repeat).scatter_(-1, perm, repeat)


def selection_mask_fn(block_idx: Tensor, sel_block: int, cu_seqlens: Optional[Tensor],
                      seqlen_k: Optional[int] = None,
                      cu_seqlens_k: Optional[Tensor] = None) -> MaskFn:
    """Query at position p sees the keys of its selected blocks (per KV head) up to p."""
    B, T, H, n = block_idx.shape
    device = block_idx.device
    seq, pos = query_layout(T, cu_seqlens, device, seqlen_k, cu_seqlens_k)
    kseq, kpos = key_layout(T, cu_seqlens, device, seqlen_k, cu_seqlens_k)
    nblk = -(-kpos.shape[0] // sel_block)
    key_blk = kpos // sel_block  # [S]

    def mask_fn(t0: int, t1: int) -> Tensor:
        idx = block_idx[:, t0:t1].to(torch.int64)
        # -1 (empty slot) scatters into a spare column that no key maps to
        idx = torch.where(idx < 0, nblk, idx)
        sel = torch.zeros(B, t1 - t0, H, nblk + 1, dtype=torch.bool, device=device)
        sel.scatter_(-1, idx, True)
        allowed = sel[..., key_blk]  # [B, tc, H, S]
        causal = (seq[t0:t1, None] == kseq[None]) & (kpos[None] <= pos[t0:t1, None])  # [tc, S]
        return (allowed & causal[None, :, None]).permute(0, 2, 1, 3)
    return mask_fn


# --------------------------------------------------------------------------------------------
# The four branches
# --------------------------------------------------------------------------------------------

def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, block_len: int, block_stride: int,
                         scale: float, cu_seqlens: Optional[Tensor] = None,
                         chunk: int = DEFAULT_CHUNK, *, seqlen_k: Optional[int] = None,
                         cu_seqlens_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """seqlen_k / cu_seqlens_k: the keys k_cmp was compressed from, when queries sit at an offset
    (see query_layout); cu_seqlens then holds the queries' lengths."""
    mask_fn = compressed_mask_fn(q.shape[1], k_cmp.shape[1], block_len, block_stride, cu_seqlens,
                                 q.device, seqlen_k, cu_seqlens_k)
    return masked_attention(q, k_cmp, v_cmp, mask_fn, scale, chunk)


def compressed_attention_backward(q, k_cmp, v_cmp, o, lse, do, dlse, block_len, block_stride, scale,
                                  cu_seqlens=None, chunk: int = DEFAULT_CHUNK, *, seqlen_k=None,
                                  cu_seqlens_k=None):
    mask_fn = compressed_mask_fn(q.shape[1], k_cmp.shape[1], block_len, block_stride, cu_seqlens,
                                 q.device, seqlen_k, cu_seqlens_k)
    return masked_attention_backward(q, k_cmp, v_cmp, o, lse, do, dlse, mask_fn, scale, chunk)


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float,
                             cu_seqlens: Optional[Tensor] = None, chunk: int = DEFAULT_CHUNK, *,
                             cu_seqlens_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """k/v may be longer than q (queries at an offset, see query_layout)."""
    mask_fn = window_mask_fn(q.shape[1], window, cu_seqlens, q.device, k.shape[1], cu_seqlens_k)
    return masked_attention(q, k, v, mask_fn, scale, chunk)


def sliding_window_attention_backward(q, k, v, o, lse, do, dlse, window, scale, cu_seqlens=None,
                                      chunk: int = DEFAULT_CHUNK, *, cu_seqlens_k=None):
    mask_fn = window_mask_fn(q.shape[1], window, cu_seqlens, q.device, k.shape[1], cu_seqlens_k)
    return masked_attention_backward(q, k, v, o, lse, do, dlse, mask_fn, scale, chunk)


def selection_attention(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, sel_block: int,
                        scale: float, cu_seqlens: Optional[Tensor] = None,
                        chunk: int = DEFAULT_CHUNK, *,
                        cu_seqlens_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """k/v may be longer than q (queries at an offset, see query_layout)."""
    mask_fn = selection_mask_fn(block_idx, sel_block, cu_seqlens, k.shape[1], cu_seqlens_k)
    return masked_attention(q, k, v, mask_fn, scale, chunk)


def selection_attention_backward(q, k, v, o, lse, do, dlse, block_idx, sel_block, scale,
                                 cu_seqlens=None, chunk: int = DEFAULT_CHUNK, *, cu_seqlens_k=None):
    mask_fn = selection_mask_fn(block_idx, sel_block, cu_seqlens, k.shape[1], cu_seqlens_k)
    return masked_attention_backward(q, k, v, o, lse, do, dlse, mask_fn, scale, chunk)


def selection_index(block_idx: Tensor, sel_block: int, Tk: int, cu_seqlens: Optional[Tensor],
                    cu_seqlens_k: Optional[Tensor], queries_per_chunk: int, token_major: bool,
                    with_slots: bool) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """The inverse of block_idx [B, T, H, n] that the selection's dK dV kernel reads: which
    queries selected each (batch, KV head, block), cut into chunks of at most queries_per_chunk
    entries (`nsa_ops.kernels.index`, the Triton kernels, write the same tensors bit for bit).

    Returns ent_tok int32 [E] (query token of each (b, t, h, slot) entry, grouped by block,
    ascending inside a block; E = B*T*H*n), ent_pos int32 [E] (the packed key position that query
    sits at, see query_keys), with_slots: ent_slot int32 [E] (the entry's slot in its row; else
    None), and chunks int64 [P, 4] = (first entry, end entry, b * H + h, first packed key of the
    block). Entries no query may read (-1, or a block past the query) sort last and no chunk
    names them. A block a row names twice keeps one live entry: the repeat follows it and gets
    ent_tok = -1. P is a bound known from shapes alone (no host sync): chunks past the real
    count hold (0, 0, 0, 0). token_major: chunks ordered by (b * H + h, the key position of their
    first query), stably, so that the programs running at one time read the q / dO rows of a
    narrow range of tokens, which L2 then serves to each block those tokens picked; else by
    block, each block's chunks consecutive and in order (the deterministic mode's adds).
    """
    B, T, H, n = block_idx.shape
    device = block_idx.device
    idx = block_idx.to(torch.int64)
    num_seq = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    start, key_pos = query_keys(T, Tk, cu_seqlens, cu_seqlens_k, device)
    valid = (idx >= 0) & (idx * sel_block <= (key_pos - start)[None, :, None, None])
    # a block is named by (b, h, its first packed key): unique across sequences, < B*H*Tk
    first_tok = start[None, :, None, None] + idx * sel_block
    bh = torch.arange(B, device=device)[:, None] * H + torch.arange(H, device=device)
    num_keys = B * H * Tk
    key = torch.where(valid, bh[:, None, :, None] * Tk + first_tok, num_keys)
    key, order = torch.sort(key.flatten(), stable=True)  # invalid entries (num_keys) go last
    ent = (order // (H * n)) % T
    # stable: a row's entries for one block sit side by side, in slot order
    row = order // n
    repeat = torch.zeros_like(key, dtype=torch.bool)
    repeat[1:] = (key[1:] == key[:-1]) & (row[1:] == row[:-1])
    ent_tok = torch.where(repeat, -1, ent).to(torch.int32)
    ent_pos = key_pos[ent].to(torch.int32)
    ent_slot = (order % n).to(torch.int32) if with_slots else None

    C = queries_per_chunk
    bounds = torch.searchsorted(key, torch.arange(num_keys + 1, device=device))
    lo, hi = bounds[:-1], bounds[1:]
    nchunk = (hi - lo + C - 1) // C
    chunk_end = torch.cumsum(nchunk, 0)
    # sum of ceil(count / C) <= E / C + (number of distinct blocks); blocks per (b, h) are at most
    # Tk // l' + (number of sequences)
    E = idx.numel()
    P = max(1, -(-E // C) + min(E, B * H * (Tk // sel_block + num_seq)))
    pid = torch.arange(P, device=device)
    kid = torch.searchsorted(chunk_end, pid, right=True)
    real = kid < num_keys
    kid = kid.clamp(max=num_keys - 1)
    e0 = lo[kid] + (pid - chunk_end[kid] + nchunk[kid]) * C
    e1 = torch.minimum(e0 + C, hi[kid])
    chunks = torch.stack([e0, e1, kid // Tk, kid % Tk], dim=1)
    chunks = torch.where(real[:, None], chunks, 0)
    if token_major and E > 0:  # without entries no chunk is real: nothing to order
        first_query = ent_pos[chunks[:, 0]].to(torch.int64)  # e0 < E: unreal chunks hold 0
        rank = torch.where(real, chunks[:, 2] * (Tk + 1) + first_query, B * H * (Tk + 1))
        chunks = chunks[torch.argsort(rank, stable=True)]
    return ent_tok, ent_pos, ent_slot, chunks


# --------------------------------------------------------------------------------------------
# Block selection: Eq.9 overlap map, Eq.10 group sum, top-n
# --------------------------------------------------------------------------------------------

def overlap_matrix(cmp_block_idx: Tensor, block_len: int, block_stride: int, sel_block: int,
                   num_sel_blocks: int) -> Tensor:
    """Eq.9 weights [rows, num_sel_blocks]: |[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / l."""
    start = (cmp_block_idx * block_stride)[:, None]
    j = torch.arange(num_sel_blocks, device=cmp_block_idx.device)[None] * sel_block
    inter = (torch.minimum(start + block_len, j + sel_block) - torch.maximum(start, j)).clamp(min=0)
    return inter / block_len


def topn_blocks(score: Tensor, pos: Tensor, sel_block: int, num_sel: int) -> Tensor:
    """Top-n per (query, KV head) with forced block 0 and the two local blocks.

    score [B, tc, H, nblk] (Eq.10), pos [tc] query positions. Returns int32 [B, tc, H, num_sel],
    valid entries ascending, -1 last. Ties go to the lower block index (stable descending sort).
    """
    nblk = score.shape[-1]
    j = torch.arange(nblk, device=score.device)
    cur = (pos // sel_block)[:, None]
    valid = (j[None] * sel_block <= pos[:, None])  # [tc, nblk]
    forced = valid & ((j[None] == 0) | (j[None] == cur) | (j[None] == cur - 1))
    # a NaN score (a NaN input's row) ranks as 0, the least a score can be (as in the kernels'
    # keys): sorted first, it had pushed the forced blocks out
    score = torch.where(score.isnan(), 0.0, score)
    key = torch.where(forced[None, :, None], float("inf"),
                      torch.where(valid[None, :, None], score, float("-inf")))
    if nblk < num_sel:
        key = torch.nn.functional.pad(key, (0, num_sel - nblk), value=float("-inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :num_sel]
    taken = torch.gather(key, -1, order) > float("-inf")
    # ascending with -1 last: park empty slots past every real index, sort, then mark them -1
    parked = torch.where(taken, order, key.shape[-1])
    picked = torch.sort(parked, dim=-1).values
    return torch.where(picked == key.shape[-1], -1, picked).to(torch.int32)


def key_span(T: int, rows: int, block_len: int, block_stride: int, seqlen_k: Optional[int],
              cu_seqlens_k: Optional[Tensor]) -> int:
    """Tokens that bound every key sequence's length: T, or seqlen_k for queries at an offset;
    with cu_seqlens_k, what `rows` compressed rows can come from (no sequence is longer)."""
    if cu_seqlens_k is not None:
        return (rows + 1) * block_stride + block_len
    return T if seqlen_k is None else seqlen_k


def cmp_probs(q: Tensor, k_cmp: Tensor, lse: Tensor, mask: Tensor, scale: float) -> Tensor:
    """p_cmp [B,H,G,T,rows] = exp(q.k_cmp * scale - lse) where mask ([B or 1, H or 1, T, rows])
    lets a query see a compressed row, 0 elsewhere, in the compute dtype: what the Eq.9 / Eq.10
    scores sum."""
    H = k_cmp.shape[2]
    cdt = compute_dtype(q.dtype)
    return _probs(_group(q.to(cdt), H), k_cmp.to(cdt), mask, _rows_grouped(lse.to(cdt), H),
                  scale)[0]


def _block_scorer(q: Tensor, k_cmp: Tensor, lse: Tensor, block_len: int, block_stride: int,
                  sel_block: int, scale: float, cu_seqlens: Optional[Tensor],
                  seqlen_k: Optional[int] = None, cu_seqlens_k: Optional[Tensor] = None):
    """score(t0, t1) -> Eq.10 scores of query rows t0..t1; masks and Eq.9 weights built once."""
    T, rows = q.shape[1], k_cmp.shape[1]
    cdt = compute_dtype(q.dtype)
    mask_fn = compressed_mask_fn(T, rows, block_len, block_stride, cu_seqlens, q.device, seqlen_k,
                                 cu_seqlens_k)
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    _, cidx = cmp_layout(rows, cu_k, block_len, block_stride, q.device)
    span = key_span(T, rows, block_len, block_stride, seqlen_k, cu_seqlens_k)
    overlap = overlap_matrix(cidx, block_len, block_stride, sel_block,
                             max(1, -(-span // sel_block))).to(cdt)
    k32 = k_cmp.to(cdt)

    def score(t0: int, t1: int) -> Tensor:
        p_cmp = cmp_probs(q[:, t0:t1], k32, lse[:, t0:t1], mask_fn(t0, t1), scale)
        p_slc = p_cmp @ overlap  # Eq.9 -> [B,H,G,tc,nblk]
        return p_slc.sum(2).permute(0, 2, 1, 3)  # Eq.10: sum over the group's G query heads
    return score


def block_scores(q: Tensor, k_cmp: Tensor, lse: Tensor, block_len: int, block_stride: int,
                 sel_block: int, scale: float, cu_seqlens: Optional[Tensor] = None,
                 t0: int = 0, t1: Optional[int] = None) -> Tensor:
    """Eq.10 scores [B, t1-t0, H, ceil(T/l')] of query rows t0..t1 (p_cmp via the cmp lse, Eq.9)."""
    score = _block_scorer(q, k_cmp, lse, block_len, block_stride, sel_block, scale, cu_seqlens)
    return score(t0, q.shape[1] if t1 is None else t1)


def select_blocks(q: Tensor, k_cmp: Tensor, lse: Tensor, block_len: int, block_stride: int,
                  sel_block: int, num_sel: int, scale: float, cu_seqlens: Optional[Tensor] = None,
                  chunk: int = DEFAULT_CHUNK, *, seqlen_k: Optional[int] = None,
                  cu_seqlens_k: Optional[Tensor] = None) -> Tensor:
    """block_idx int32 [B,T,H,num_sel]: top-n of the Eq.10 scores with the forced blocks
    (seqlen_k / cu_seqlens_k: queries at an offset, see query_layout)."""
    B, T = q.shape[:2]
    H = k_cmp.shape[2]
    _, pos = query_layout(T, cu_seqlens, q.device, seqlen_k, cu_seqlens_k)
    score = _block_scorer(q, k_cmp, lse, block_len, block_stride, sel_block, scale, cu_seqlens,
                          seqlen_k, cu_seqlens_k)
    out = []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        out.append(topn_blocks(score(t0, t1), pos[t0:t1], sel_block, num_sel))
    if not out:
        return torch.empty(B, 0, H, num_sel, dtype=torch.int32, device=q.device)
    return torch.cat(out, 1)


# --------------------------------------------------------------------------------------------
# Gate and the full NSA forward
# --------------------------------------------------------------------------------------------

def gate_combine(o_cmp: Tensor, o_slc: Tensor, o_win: Optional[Tensor], g_cmp: Tensor,
                 g_slc: Tensor, g_win: Optional[Tensor]) -> Tensor:
    """o = g_cmp*o_cmp + g_slc*o_slc + g_win*o_win with gates [B,T,HQ] broadcast over Dv.
    o_win = g_win = None: no sliding-window branch (nsa_attention's window=0)."""
    o = g_cmp.unsqueeze(-1) * o_cmp + g_slc.unsqueeze(-1) * o_slc
    return o if o_win is None else o + g_win.unsqueeze(-1) * o_win


def gate_combine_backward(do: Tensor, o_cmp: Tensor, o_slc: Tensor, o_win: Optional[Tensor],
                          g_cmp: Tensor, g_slc: Tensor, g_win: Optional[Tensor],
                          gate_grads: bool,
                          branch_grads: tuple[bool, bool, bool] = (True, True, True)
                          ) -> tuple[Tensor, ...]:
    """(d_o_cmp, d_o_slc, d_o_win, d_g_cmp, d_g_slc, d_g_win) in the inputs' dtypes; an absent
    window branch's grads and the gate grads unless gate_grads (a caller whose gates need no
    grad skips reading the branch outputs) are empty [0] tensors. Where branch_grads
    (compressed, selection, window) says False, that branch's slot holds its rows' rowsum(dO *
    o) ([B, T, HQ], fp32 or float64) in place of g * dO: the delta of a backward that takes dO
    and the gate."""
    d_o, d_g = [], []
    for o, g, want in zip((o_cmp, o_slc, o_win), (g_cmp, g_slc, g_win), branch_grads):
        if o is None:
            d_o.append(do.new_empty(0))
            d_g.append(do.new_empty(0))
            continue
        if want:
            d_o.append((g.unsqueeze(-1) * do).to(o.dtype))
        else:
            acc = compute_dtype(torch.promote_types(do.dtype, o.dtype))
            d_o.append((do.to(acc) * o.to(acc)).sum(-1))
        d_g.append((do * o).sum(-1).to(g.dtype) if gate_grads else g.new_empty(0))
    return (*d_o, *d_g)


def nsa(q: Tensor, k: Tensor, v: Tensor, g_cmp: Tensor, g_slc: Tensor, g_win: Tensor, *,
        block_len: int = 32, block_stride: int = 16, sel_block: int = 64, num_sel: int = 16,
        window: int = 512, scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None,
        block_idx: Optional[Tensor] = None) -> Tensor:
    """Whole NSA (phi = mean) in reference arithmetic; the oracle for `nsa_ops.nsa_attention`.
    window=0: no sliding-window branch (g_win unused)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_cmp = compress_mean(k, block_len, block_stride, cu_seqlens)
    v_cmp = compress_mean(v, block_len, block_stride, cu_seqlens)
    o_cmp, lse_cmp = compressed_attention(q, k_cmp, v_cmp, block_len, block_stride, scale, cu_seqlens)
    if block_idx is None:
        block_idx = select_blocks(q, k_cmp, lse_cmp, block_len, block_stride, sel_block, num_sel,
                                  scale, cu_seqlens)
    o_slc, _ = selection_attention(q, k, v, block_idx, sel_block, scale, cu_seqlens)
    if not window:
        return gate_combine(o_cmp, o_slc, None, g_cmp, g_slc, None)
    o_win, _ = sliding_window_attention(q, k, v, window, scale, cu_seqlens)
    return gate_combine(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win)


def full_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
                          cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Plain causal attention, for small-T equivalence checks."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return sliding_window_attention(q, k, v, max(1, q.shape[1]), scale, cu_seqlens)
