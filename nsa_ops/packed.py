"""Selection attention as packed SDPA: gather every token's selected K/V into a dense key set and
run one batched attention call over them.

Query token t of KV head h has G query heads and n * l' candidate keys (its selected blocks, empty
slots and the causally clamped tail masked by an additive -inf bias). Packing (batch, token) into
the SDPA batch dimension and the G heads into its query-length dimension turns the whole branch
into one dense `[B*T, H, G, n*l']` attention, which beats a block-sparse kernel where that kernel
cannot fill the GPU (short sequences) or is not tuned for the SM (see nsa_ops/routing.py). The
gathered K/V grow as T * n * l', so tokens are processed in chunks bounded by `GATHER_BUDGET`.

The forward needs the log-sum-exp as well as the output, so it calls the SDPA kernels that return
it: memory-efficient attention on CUDA, the flash kernel for CPU elsewhere.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .kernels.utils import unit_last_stride
from .reference import distinct_slots, token_layout

# Bytes of gathered K/V per chunk of tokens.
GATHER_BUDGET = 1 << 30


def _chunk_tokens(B: int, H: int, keys: int, Dk: int, Dv: int, itemsize: int) -> int:
    return max(1, GATHER_BUDGET // (B * H * keys * (Dk + Dv) * itemsize))


def _sdpa_with_lse(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float
                   ) -> tuple[Tensor, Tensor]:
    """o [N,H,G,Dv], lse [N,H,G] (float32) of softmax(q k^T * scale + bias) v."""
    if q.device.type == "cuda":
        q, k, v = (unit_last_stride(x) for x in (q, k, v))
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, scale=scale)[:2]
        return o, lse[..., :q.shape[2]]  # lse rows are padded to a multiple of 32
    # the CPU kernel wants one head size: zero columns change neither q.k nor the kept outputs
    Dk, Dv = q.shape[-1], v.shape[-1]
    D = max(Dk, Dv)
    pad = torch.nn.functional.pad
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        pad(q, (0, D - Dk)), pad(k, (0, D - Dk)), pad(v, (0, D - Dv)), attn_mask=bias,
        scale=scale)
    return o[..., :Dv], lse.float()


def selection_attention_packed(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor,
                               sel_block: int, scale: float,
                               cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Same contract as `reference.selection_attention`: o [B,T,HQ,Dv] in q.dtype, lse [B,T,HQ]
    float32; rows that see no token get o = 0, lse = -inf."""
    B, T, HQ, Dk = q.shape
    H, Dv, n = k.shape[2], v.shape[3], block_idx.shape[3]
    G, keys = HQ // H, n * sel_block
    dev = q.device
    if keys == 0 or B * T * HQ == 0:  # no slots: nothing to attend, as the reference
        return (q.new_zeros(B, T, HQ, Dv),
                torch.full((B, T, HQ), float("-inf"), dtype=torch.float32, device=dev))
    o = q.new_empty(B, T, HQ, Dv)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=dev)
    _, pos = token_layout(T, cu_seqlens, dev)
    starts = torch.arange(T, device=dev) - pos
    b = torch.arange(B, device=dev)[:, None, None, None]
    h = torch.arange(H, device=dev)[None, None, :, None]
    offsets = torch.arange(sel_block, device=dev)
    step = _chunk_tokens(B, H, keys, Dk, Dv, q.element_size())
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        idx = block_idx[:, t0:t1].to(torch.int64)  # [B,Tc,H,n]
        local = (idx[..., None] * sel_block + offsets).flatten(-2)  # [B,Tc,H,keys]
        # a row is a set of blocks: empty slots and repeats of a block stay closed
        seen = distinct_slots(idx).repeat_interleave(sel_block, -1) & \
            (local <= pos[t0:t1, None, None])
        tok = torch.where(seen, local + starts[t0:t1, None, None], 0)
        Tc = t1 - t0
        kg = k[b, tok, h].flatten(0, 1)  # [B*Tc, H, keys, Dk]
        vg = v[b, tok, h].flatten(0, 1)
        qg = q[:, t0:t1].reshape(B * Tc, H, G, Dk)
        seen = seen.flatten(0, 1)
        any_seen = seen.any(-1, keepdim=True)
        # a row that sees nothing keeps slot 0 open so the kernel yields no NaN; zeroed below
        open_ = seen | (~any_seen & (torch.arange(keys, device=dev) == 0))
        bias = torch.zeros(open_.shape, dtype=q.dtype, device=dev).masked_fill_(
            ~open_, float("-inf"))[:, :, None, :].expand(-1, -1, G, -1)
        oc, lc = _sdpa_with_lse(qg, kg, vg, bias, scale)
        any_seen = any_seen[..., None]  # [B*Tc, H, 1, 1]
        o[:, t0:t1] = torch.where(any_seen, oc, 0).reshape(B, Tc, HQ, Dv)
        lse[:, t0:t1] = torch.where(any_seen[..., 0], lc, float("-inf")).reshape(B, Tc, HQ)
    return o, lse
