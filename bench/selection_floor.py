"""The selection forward's memory floor: a Triton kernel that makes exactly the K/V loads of
nsa_ops.kernels.selection's forward (one program per (token, KV head), token fastest in the grid,
each selected block read as [BN, D] tiles) and no attention math. Its time at a selection is what
moving the selected blocks through L2 costs a per-(token, KV head) kernel; bench_kernels.py
times it beside the real forward (the `selection ... loads only` rows of kernels.csv).
"""
import triton
import triton.language as tl
from torch import Tensor

# (num_warps, num_stages): the fastest of five on an H100 at T=64k, spec geometry
# (4, 3) 15.50 ms, (4, 2) 15.51, (2, 3) 15.04, (1, 2) 70.2, (8, 3) 16.15 on random selections
LAUNCH = dict(num_warps=2, num_stages=3)


@triton.jit
def _loads_kernel(k, v, out, bidx, N, sk_t, sk_h, sv_t, sv_h, H: tl.constexpr, D: tl.constexpr,
                  SEL: tl.constexpr, BN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = bidx + (t * H + h) * N
    cols = tl.arange(0, D)
    # one [BN, D] accumulator: a second one for V spills registers at 2 warps (29 ms, not 15)
    acc = tl.zeros([BN, D], tl.float32)
    NSUB: tl.constexpr = SEL // BN
    for it in range(N * NSUB):
        blk = tl.load(row + it // NSUB)
        # empty slots (-1) point past the query: masked off like the real kernel's
        toks = tl.where(blk >= 0, blk * SEL, t + 1) + (it % NSUB) * BN + tl.arange(0, BN)
        live = (toks <= t)[:, None]
        acc += tl.load(k + (toks * sk_t + h * sk_h)[:, None] + cols[None, :], mask=live,
                       other=0.0).to(tl.float32)
        acc += tl.load(v + (toks * sv_t + h * sv_h)[:, None] + cols[None, :], mask=live,
                       other=0.0).to(tl.float32)
    # a sum the compiler cannot drop, so every load stays
    tl.store(out + (t * H + h) * D + cols, tl.sum(acc, 0))


def selection_loads(k: Tensor, v: Tensor, block_idx: Tensor, sel_block: int, out: Tensor):
    """Load every selected K/V block of block_idx [1, T, H, n] (int32, T == k's length) once per
    (token, KV head); out: a float32 [T, H, D] scratch. Dk == Dv, a power of two."""
    _, T, H, n = block_idx.shape
    _loads_kernel[(T, H)](k, v, out, block_idx, n, k.stride(1), k.stride(2), v.stride(1),
                          v.stride(2), H=H, D=k.shape[3], SEL=sel_block, BN=min(sel_block, 64),
                          **LAUNCH)
