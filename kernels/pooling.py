"""Mean pooling (phi of the spec) on the GPU, forward and backward, each one Triton pass in place
of the torch ops of `reference`:

- `mean_pool`: `reference.compress_mean(x, l, d)` at fixed length, any d, with the sums in the
  order torch's CUDA reduction gives them where it sums each output in one thread: bitwise its
  result there (H100, bf16 / fp16, l = 30, 32, 48 at the spec's heads); from l = 64 on the
  spec's heads torch splits each sum across warps, and the two agree to the sums' rounding. The
  torch ops (a pad copy, the unfold view's mean) held 13% of an 8k forward's sampled host time,
  the most of any one line (H100 host, py-spy at 1 kHz, `.gpu`-style script); one launch here.
- `add_mean_pool_backward`: `reference.compress_mean_backward(grad, T, l, d, out=dx)` (d dividing
  l, fixed length; float32 sums, float64 for float64 operands), optionally after dx += other (the
  window branch's dk / dv), bit for bit the same roundings in the same order. nsa_attention's
  eager backward ran those as some 14 torch ops a step for k and v (0.3 ms of the H100 host's
  time per 8k step).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_ops.kernels.utils import cdiv, launch, pow2
from nsa_ops.reference import cmp_rows


@triton.jit
def _mean_pool_fwd_kernel(X, OUT, sxb, sxt, sxh, sxd, T, ROWS, OUTPUTS, LEN: tl.constexpr,
                          STRIDE: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, ACC: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (head, dim) flattened
    cols = (c < H * D)[None, :]
    head, dim = (c // D).to(tl.int64)[None, :], (c % D).to(tl.int64)[None, :]
    at_x = X + b * sxb + head * sxh + dim * sxd
    first = (r * STRIDE).to(tl.int64)[:, None]
    # torch's CUDA reduction of this strided view: one thread per output, its l inputs in order
    # into four accumulators by index mod 4, then ((a0 + a1) + a2) + a3 (Reduce.cuh's
    # thread_reduce with vt0 = 4); tokens past T are the reference's zero padding
    a0 = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    a1 = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    a2 = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    a3 = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    for j in tl.static_range(0, LEN - LEN % 4, 4):
        a0 += _token(at_x, first + j, sxt, cols, T, ACC)
        a1 += _token(at_x, first + j + 1, sxt, cols, T, ACC)
        a2 += _token(at_x, first + j + 2, sxt, cols, T, ACC)
        a3 += _token(at_x, first + j + 3, sxt, cols, T, ACC)
    if LEN % 4 > 0:
        a0 += _token(at_x, first + LEN - LEN % 4, sxt, cols, T, ACC)
    if LEN % 4 > 1:
        a1 += _token(at_x, first + LEN - LEN % 4 + 1, sxt, cols, T, ACC)
    if LEN % 4 > 2:
        a2 += _token(at_x, first + LEN - LEN % 4 + 2, sxt, cols, T, ACC)
    # torch's factor: outputs / inputs as numbers of its accumulator, the quotient rounded
    outputs = OUTPUTS + tl.zeros([], tl.int64)
    factor = _quotient(outputs.to(ACC), (outputs * LEN).to(ACC), ACC)
    mean = (((a0 + a1) + a2) + a3) * factor
    out = OUT + (b * ROWS + r.to(tl.int64))[:, None] * (H * D) + c[None, :]
    tl.store(out, mean.to(OUT.dtype.element_ty), mask=(r < ROWS)[:, None] & cols)


@triton.jit
def _token(at_x, t, sxt, cols, T, ACC: tl.constexpr):
    """Tokens t [rows, 1] of x at the columns' offsets, zero past T, in ACC."""
    return tl.load(at_x + t * sxt, mask=(t < T) & cols, other=0.0).to(ACC)


@triton.jit
def _quotient(num, den, ACC: tl.constexpr):
    """num / den in ACC, rounded to nearest as torch's CUDA division rounds (Triton's float32
    division is approximate; float64's rounds to nearest)."""
    if ACC == tl.float64:
        quotient = num / den
    else:
        quotient = tl.math.div_rn(num, den)
    return quotient


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
    inv = _quotient(zero + 1.0, zero + LEN, ACC)
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


def _bwd_tiles(H: int, D: int) -> tuple[int, int]:
    """The backward pass's (padded width of a row's H * D values, rows per program): about 4096
    values a program."""
    width_pad = pow2(H * D)
    return width_pad, max(1, 4096 // width_pad)


# The forward's bytes of x in flight per program: ptxas issues a program's l token loads before
# their sums, so its registers grow with l * values * itemsize. At the 4096 values a program it
# had, the spec's bf16 k (l = 32, H * D = 512) spilled 9.2 KB a thread and float64 at l = 64
# about 8 KB; at 64 KB in flight, the same bits (H100, B = 1, H = 4, D = 128, `do_bench` medians
# of three rounds, us a call): bf16 l = 32 8k 167 -> 11-45, 64k 698 -> 35-43; fp32 64k 553 ->
# 60-113; bf16 l = d = 64 64k 288 -> 34-43; fp64 l = d = 64 8k 546 -> 20-41 (its GPU test 54 s
# -> under 3). ptxas for sm_90 (Triton 3.9, 4 warps) fits rows of 64 to 2048 values at l = 32
# and 64 in 16, 32 and 64 bits in 32-128 registers without spills; the tests' rows of 24 values
# take up to 255 in 16 bits, spilling 44 bytes at l = 64 (32 KB spilled more there, in float16).
_FWD_BYTES_IN_FLIGHT = 1 << 16


def _fwd_tiles(H: int, D: int, block_len: int, itemsize: int) -> tuple[int, int]:
    """The forward pass's (columns, rows) per program."""
    values = max(16, _FWD_BYTES_IN_FLIGHT // (pow2(block_len) * itemsize))
    block_c = min(pow2(H * D), values)
    return block_c, max(1, values // block_c)


def mean_pool(x: Tensor, block_len: int, block_stride: int) -> Tensor:
    """`reference.compress_mean(x, block_len, block_stride)` of a fixed-length x [B, T, H, D]
    (any strides): [B, cmp_rows(T), H, D], contiguous, the rows past the emitted ones pooled over
    the zero padding as the reference pools them."""
    if x.dim() != 4:
        raise ValueError(f"x must be [B, T, H, D], got shape {tuple(x.shape)}")
    B, T, H, D = x.shape
    rows = cmp_rows(T, block_stride)
    out = torch.empty(B, rows, H, D, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_c, block_r = _fwd_tiles(H, D, block_len, x.element_size())
    launch(_mean_pool_fwd_kernel)[(cdiv(rows, block_r), cdiv(H * D, block_c), B)](
        x, out, *x.stride(), T, rows, out.numel(), LEN=block_len,
        STRIDE=block_stride, H=H, D=D, BLOCK_C=block_c, BLOCK_R=block_r,
        ACC=_accumulator(x), num_warps=4)
    return out


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
    width_pad, block_t = _bwd_tiles(H, D)
    o = dx if other is None else other
    launch(_add_mean_pool_bwd_kernel)[(cdiv(T, block_t), B)](
        dx, o, grad, *dx.stride(), *o.stride(), *grad.stride(), T, float(block_len),
        STRIDE=block_stride, SPAN=block_len // block_stride, H=H, D=D, WIDTH_PAD=width_pad,
        BLOCK_T=block_t, HAS_OTHER=other is not None, ACC=_accumulator(dx, grad, other),
        num_warps=4,
        # each product rounded before its sum, as torch's separate multiply and add round it
        enable_fp_fusion=False)
    return dx
