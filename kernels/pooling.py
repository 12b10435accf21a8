"""Mean pooling's backward added into the keys' gradient, in one pass: what
`reference.compress_mean_backward(grad, T, l, d, out=dx)` computes (with d dividing l, fixed
length; float32 sums, float64 for float64 operands), optionally after dx += other (the window
branch's dk / dv), bit for bit the same roundings in the same order. nsa_attention's eager
backward ran those as some 14 torch ops a step for k and v (0.3 ms of the H100 host's time per
8k step, `.gpu`-style py-spy samples)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_ops.kernels.utils import launch, pow2


@triton.jit
def _add_mean_pool_bwd_kernel(DX, OTHER, GRAD, sxb, sxt, sxh, sxd, sob, sot, soh, sod, sgb, sgt,
                              sgh, sgd, T, LEN, STRIDE: tl.constexpr, SPAN: tl.constexpr,
                              H: tl.constexpr, D: tl.constexpr, WIDTH_PAD: tl.constexpr,
                              BLOCK_T: tl.constexpr, HAS_OTHER: tl.constexpr,
                              ACC: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, WIDTH_PAD)  # (head, dim) flattened
    inside = (t < T)[:, None] & (c < H * D)[None, :]
    head, dim = (c // D).to(tl.int64)[None, :], (c % D).to(tl.int64)[None, :]
    t64 = t.to(tl.int64)[:, None]
    at_x = DX + b * sxb + t64 * sxt + head * sxh + dim * sxd
    x = tl.load(at_x, mask=inside, other=0.0)
    if HAS_OTHER:
        # dx += other, rounded to dx's dtype as the in-place add rounds it
        y = tl.load(OTHER + b * sob + t64 * sot + head * soh + dim * sod, mask=inside, other=0.0)
        x = (x.to(ACC) + y.to(ACC)).to(DX.dtype.element_ty)
    # token t lies in rows t // d - j, j < l / d: share = grad / l in ACC (times 1 / l, as
    # torch's CUDA division by a number computes it), summed from the token's own row down, as
    # the reference's loop adds them
    zero = tl.zeros((), ACC)
    if ACC == tl.float64:
        inv = (zero + 1.0) / (zero + LEN)  # float64 division rounds to nearest
    else:
        inv = tl.math.div_rn(zero + 1.0, zero + LEN)
    row = (t // STRIDE).to(tl.int64)
    at_g = GRAD + b * sgb + head * sgh + dim * sgd
    summed = tl.load(at_g + row[:, None] * sgt, mask=inside, other=0.0).to(ACC) * inv
    for j in tl.static_range(1, SPAN):
        earlier = inside & (row >= j)[:, None]
        g = tl.load(at_g + (row - j)[:, None] * sgt, mask=earlier, other=0.0)
        summed = tl.where(earlier, summed + g.to(ACC) * inv, summed)
    out = (x.to(ACC) + summed).to(DX.dtype.element_ty)  # rounded to nearest, as torch rounds
    tl.store(at_x, out, mask=inside)


def _accumulator(*xs: Optional[Tensor]):
    """The dtype the sums run in: float32 at least, float64 where an operand is (torch's
    promotion in the reference's ops)."""
    wide = any(x is not None and x.dtype == torch.float64 for x in xs)
    return tl.float64 if wide else tl.float32


def add_mean_pool_backward(dx: Tensor, grad: Tensor, block_len: int, block_stride: int,
                           other: Optional[Tensor] = None) -> Tensor:
    """dx (+= other) += the gradient of x from grad, that of its mean pooling, in place:
    dx, other [B, T, H, D] and grad [B, rows >= ceil(T / d), H, D], any strides;
    block_stride divides block_len."""
    if block_len % block_stride:
        raise ValueError(f"block_stride must divide block_len, got {block_stride} and "
                         f"{block_len}")
    B, T, H, D = dx.shape
    rows = -(-T // block_stride)
    if grad.shape[0] != B or grad.shape[1] < rows or grad.shape[2:] != dx.shape[2:]:
        raise ValueError(f"grad must be [{B}, >= {rows}, {H}, {D}], got {tuple(grad.shape)}")
    if other is not None and other.shape != dx.shape:
        raise ValueError(f"other must be shaped like dx {tuple(dx.shape)}, got "
                         f"{tuple(other.shape)}")
    if dx.numel() == 0:
        return dx
    width_pad = pow2(H * D)
    block_t = max(1, 4096 // width_pad)
    o = dx if other is None else other
    launch(_add_mean_pool_bwd_kernel)[(triton.cdiv(T, block_t), B)](
        dx, o, grad, *dx.stride(), *o.stride(), *grad.stride(), T, float(block_len),
        STRIDE=block_stride, SPAN=block_len // block_stride, H=H, D=D, WIDTH_PAD=width_pad,
        BLOCK_T=block_t, HAS_OTHER=other is not None, ACC=_accumulator(dx, grad, other),
        num_warps=4,
        # each product rounded before its sum, as torch's separate multiply and add round it
        enable_fp_fusion=False)
    return dx
