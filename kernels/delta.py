"""delta = rowsum(dO * O) - dlse, the per-row term of every attention backward
(dS = P * (dP - delta)), as one pass over O and dO: the compressed backward's, and the selection
backward's where its dK dV pass runs before dq (`selection._stored_ds`)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_ops.kernels.utils import cdiv, launch, pow2


@triton.jit
def _delta_kernel(O, DO, DLSE, DELTA, sob, sot, soh, sdb, sdt, sdh, T, HQ,
                  DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                  HAS_DLSE: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = r < T * HQ
    # int64 offsets: a head-major tensor's head stride is T * D
    tok = (r // HQ).to(tl.int64)
    hq = (r % HQ).to(tl.int64)
    d = tl.arange(0, DV_PAD)
    mask = valid[:, None] & (d[None, :] < DV)
    o = tl.load(O + b * sob + (tok * sot + hq * soh)[:, None] + d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + (tok * sdt + hq * sdh)[:, None] + d[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + b * T * HQ + r, mask=valid, other=0.0)
    tl.store(DELTA + b * T * HQ + r, delta, mask=valid)


def row_delta(o: Tensor, do: Tensor, dlse: Optional[Tensor]) -> Tensor:
    """rowsum(dO * O) - dlse as fp32 [B, T, HQ] of o, do [B, T, HQ, Dv] (any strides but a unit
    last one), dlse fp32 [B, T, HQ] or None."""
    B, T, HQ, DV = o.shape
    delta = torch.empty(B, T, HQ, dtype=torch.float32, device=o.device)
    block_r = max(16, 4096 // pow2(DV, 16))
    dlse = dlse.to(torch.float32).contiguous() if dlse is not None else None
    launch(_delta_kernel)[(cdiv(T * HQ, block_r), B)](
        o, do, dlse, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1),
        do.stride(2), T, HQ, DV=DV, DV_PAD=pow2(DV, 16), BLOCK_R=block_r,
        HAS_DLSE=dlse is not None)
    return delta
