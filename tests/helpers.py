"""Shared input builders for the tests: random data, fixed seeds, never zeros."""
from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from nsa_ops import reference, routing

# Small NSA geometry that keeps every branch non-trivial at T ~ 50-100: l=16, d=8, l'=16.
SMALL = dict(block_len=16, block_stride=8, sel_block=16, num_sel=3)
# the shortest sequence whose compressed attention (l = 32, d = 16) sm90 routes to cuDNN
CUDNN_COMPRESSED_T = 16 * routing.CUDNN_COMPRESSED_MIN_ROWS[(9, 0)]

# Per-dtype tolerances (atol, rtol) for comparisons against the reference.
TOL = {torch.float64: (1e-10, 1e-8), torch.float32: (2e-5, 1e-4),
       torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}


def random_blocks(rng: random.Random, refusal=None) -> dict:
    """An NSA block geometry drawn from what NSAConfig accepts (d | l, d | l', n >= 3); with
    refusal (geometry -> reason or None, e.g. the decode kernel's), drawn again until it has
    none."""
    while True:
        d = rng.choice((2, 4, 8, 16))
        geometry = dict(block_len=d * rng.randint(1, 4), block_stride=d,
                        sel_block=d * rng.randint(1, 8), num_sel=rng.randint(3, 9))
        if refusal is None or refusal(geometry) is None:
            return geometry


def random_window(rng: random.Random, T: int) -> int:
    """1, a window inside T tokens, or one past them."""
    return rng.choice((1, rng.randint(2, max(2, T)), T + rng.randint(1, 50)))


def qkv(B, T, HQ, H, Dk, Dv, dtype=torch.float32, seed=0, requires_grad=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    q, k, v = mk(B, T, HQ, Dk), mk(B, T, H, Dk), mk(B, T, H, Dv)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def gates(B, T, HQ, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(B, T, HQ, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


def cu_seqlens(lengths, device="cpu"):
    lens = torch.tensor([0] + list(lengths))
    return lens.cumsum(0).to(dtype=torch.int32, device=device)


def compressed(k, v, geo, cu=None):
    return (reference.compress_mean(k, geo["block_len"], geo["block_stride"], cu),
            reference.compress_mean(v, geo["block_len"], geo["block_stride"], cu))


def selection_for(q, k, v, geo, cu=None):
    """A realistic block_idx: what the reference NSA selects for these inputs."""
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        k_cmp, v_cmp = compressed(k, v, geo, cu)
        _, lse = reference.compressed_attention(q, k_cmp, v_cmp, geo["block_len"],
                                                geo["block_stride"], scale, cu)
        return reference.select_blocks(q, k_cmp, lse, geo["block_len"], geo["block_stride"],
                                       geo["sel_block"], geo["num_sel"], scale, cu)


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty / empty_like return NaN (floats) or -7 (ints): whatever a kernel leaves
    unwritten, in outputs or scratch, cannot pass as zeros."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(x):
        return x.fill_(float("nan") if x.is_floating_point() else -7)
    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def rel_err(got, want):
    """Relative Frobenius error ||got - want|| / ||want||, in float32."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


# ---- layouts: the same values as token-major, head-major or strided views ---------------------

# Layouts of a [B, T, heads, D] tensor that validation accepts:
#   token   contiguous [B, T, heads, D]
#   head    head-major: a contiguous [B, heads, T, D] transposed to [B, T, heads, D]
#   wide    x[..., :D] of a [B, T, heads, 2D] tensor (a slice of a fused projection's last dim)
#   tslice  x[:, 2:2+T] of a [B, T+5, heads, D] tensor (a slice along T)
#   heads   x[:, :, 1:1+heads] of a [B, T, heads+2, D] tensor (a slice of fused heads)
#   dstride x[..., ::2] of a [B, T, heads, 2D] tensor (no unit stride along D)
# What lies outside the view is NaN: an implementation that reads past its view returns NaN.
LAYOUTS = ("token", "head", "wide", "tslice", "heads", "dstride")
# Layouts of a [B, T, X] tensor (lse, dlse, gates):
#   contig; perm: a contiguous [B, X, T] transposed; wide: x[..., :X] of [B, T, X+3];
#   tslice: x[:, 1:1+T] of [B, T+3, X]; stack3: x[..., i] of [B, T, X, 3] (NSAAttention's gates)
ROW_LAYOUTS = ("contig", "perm", "wide", "tslice", "stack3")
# Layouts of block_idx [B, T, H, n]: contig; wide: bi[..., :n] of [B, T, H, n+3] (the extra
# slots hold valid block indices, so a kernel reading past n computes something else); perm: a
# contiguous [B, H, T, n] transposed; tslice: bi[:, 1:1+T] of [B, T+2, H, n].
INDEX_LAYOUTS = ("contig", "wide", "perm", "tslice")


def in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x [B, T, heads, D] with the same values in `layout` (see LAYOUTS), in new storage (a
    detached leaf: requires_grad_() keeps the layout)."""
    B, T, Hn, D = x.shape
    nan = float("nan")
    if layout == "token":
        return x.detach().clone().contiguous()
    if layout == "head":
        return x.detach().transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "wide":
        buf = x.new_full((B, T, Hn, 2 * D), nan)
        buf[..., :D] = x
        return buf[..., :D]
    if layout == "tslice":
        buf = x.new_full((B, T + 5, Hn, D), nan)
        buf[:, 2:2 + T] = x
        return buf[:, 2:2 + T]
    if layout == "heads":
        buf = x.new_full((B, T, Hn + 2, D), nan)
        buf[:, :, 1:1 + Hn] = x
        return buf[:, :, 1:1 + Hn]
    if layout == "dstride":
        buf = x.new_full((B, T, Hn, 2 * D), nan)
        buf[..., ::2] = x
        return buf[..., ::2]
    raise ValueError(f"unknown layout {layout!r}")


def rows_in_layout(x: torch.Tensor, layout: str, index: int = 1) -> torch.Tensor:
    """x [B, T, X] with the same values in `layout` (see ROW_LAYOUTS)."""
    B, T, X = x.shape
    nan = float("nan")
    if layout == "contig":
        return x.detach().clone().contiguous()
    if layout == "perm":
        return x.detach().transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "wide":
        buf = x.new_full((B, T, X + 3), nan)
        buf[..., :X] = x
        return buf[..., :X]
    if layout == "tslice":
        buf = x.new_full((B, T + 3, X), nan)
        buf[:, 1:1 + T] = x
        return buf[:, 1:1 + T]
    if layout == "stack3":
        buf = x.new_full((B, T, X, 3), nan)
        buf[..., index % 3] = x
        return buf[..., index % 3]
    raise ValueError(f"unknown row layout {layout!r}")


def index_in_layout(block_idx: torch.Tensor, layout: str, num_blocks: int,
                    seed: int = 0) -> torch.Tensor:
    """block_idx [B, T, H, n] with the same entries in `layout` (see INDEX_LAYOUTS)."""
    B, T, H, n = block_idx.shape
    if layout == "contig":
        return block_idx.clone().contiguous()
    if layout == "perm":
        return block_idx.transpose(1, 2).contiguous().transpose(1, 2)
    g = torch.Generator().manual_seed(seed)
    if layout == "wide":
        buf = torch.randint(0, num_blocks, (B, T, H, n + 3), generator=g).to(block_idx)
        buf[..., :n] = block_idx
        return buf[..., :n]
    if layout == "tslice":
        buf = torch.randint(0, num_blocks, (B, T + 2, H, n), generator=g).to(block_idx)
        buf[:, 1:1 + T] = block_idx
        return buf[:, 1:1 + T]
    raise ValueError(f"unknown index layout {layout!r}")


# sm_90's largest shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin, H100 / H200)
SM90_SHARED_BYTES = 232448


def compile_for_sm90(*args: object, ptxas_log: bool = False,
                     sass: bool = False) -> subprocess.CompletedProcess:
    """tests/sm90_compile.py with args, in a subprocess without TRITON_INTERPRET (ptxas needs
    the compiler's path, which the interpreter skips). ptxas_log: every kernel compiled afresh
    (not from Triton's cache) with ptxas' -v log (registers, spills) in stdout before its
    `compiled` line. sass: a `sass NAME narrow COUNT` line after it (2-byte global accesses)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if ptxas_log:
        env.update(TRITON_ALWAYS_COMPILE="1", TRITON_DUMP_PTXAS_LOG="1")
    if sass:
        env.update(SM90_SASS="1")
    script = Path(__file__).with_name("sm90_compile.py")
    return subprocess.run([sys.executable, str(script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=900)
