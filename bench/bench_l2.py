"""L2 -> SM bandwidth of random K/V tile reads: the floor of the per-(token, KV head) selection
kernels, measured without them.

    python bench/bench_l2.py [--sizes-mb 8 16 32 64 128] [geometry flags | --config FILE.yaml]

Each program reads ITERS random [BN, D] bf16 tiles (BN = min(l', 64) keys of one KV head, D = Dk)
of a buffer and keeps only their sum, so its time is what moving the tiles costs: from L2 while
the buffer fits, from HBM beyond. Two layouts: K's own ([tokens, H, D], one head read, rows
strided by H * D; the buffer's size counts all heads) and one contiguous head; pointer loads and
TMA loads (sm90+), each at several (num_warps, num_stages). Prints TB/s per case, the best per
(layout, loads, size), and writes l2.csv + l2.png into --out.

The selection forward moves 16 blocks of l' keys of K and V per (token, KV head) (13 in its
per-token walk on random selections, the forced 3 once per group of 4 queries in its shared
pass): bytes / time of `bench_kernels.py`'s selection rows set against these rates say how far
a kernel is from moving its blocks as fast as this GPU moves any random tiles.
"""
from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

import geometry
from bench_kernels import median_ms_from_idle
from bench_prefill import run_header
from nsa_ops.results import new_figure, save_figure, write_csv

ITERS = 26  # tiles per program: 13 blocks of 2 tiles (K and V), a random selection's walk
PROGRAMS_PER_SM = 64
POINTER_LAUNCHES = ((2, 3), (4, 3), (4, 4), (8, 3))
TMA_LAUNCHES = ((1, 2), (1, 3), (2, 3), (4, 3), (4, 4))


@triton.jit
def _pointer_kernel(x, out, tiles, NT, ROWSTRIDE: tl.constexpr, D: tl.constexpr,
                    BN: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D)
    acc = tl.zeros([BN, D], tl.float32)
    for i in range(ITERS):
        rows = tl.load(tiles + (pid * ITERS + i) % NT).to(tl.int64) * BN + tl.arange(0, BN)
        acc += tl.load(x + (rows * ROWSTRIDE)[:, None] + cols[None, :]).to(tl.float32)
    tl.store(out + pid * D + cols, tl.sum(acc, 0))


@triton.jit
def _tma_kernel(xd, out, tiles, NT, D: tl.constexpr, BN: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D)
    acc = tl.zeros([BN, D], tl.float32)
    for i in range(ITERS):
        first = tl.load(tiles + (pid * ITERS + i) % NT) * BN
        acc += tl.reshape(xd.load([first, 0, 0]), (BN, D)).to(tl.float32)
    tl.store(out + pid * D + cols, tl.sum(acc, 0))


def measure(size_mb: int, heads: int, D: int, BN: int) -> list[dict]:
    """TB/s of every launch of both kernels over a size_mb buffer of `heads` heads."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    tokens = size_mb * 2 ** 20 // (heads * D * 2)
    x = torch.randn(tokens, heads, D, device="cuda", dtype=torch.bfloat16)
    programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    tiles = torch.randint(0, tokens // BN, (programs * ITERS,), device="cuda", dtype=torch.int32,
                          generator=g)
    out = torch.empty(programs, D, device="cuda")
    gigabytes = programs * ITERS * BN * D * 2 / 1e9
    layout = "contiguous" if heads == 1 else f"rows strided by {heads} heads"
    rows = []

    def record(loads, launch, fn):
        rows.append(dict(size_mb=size_mb, layout=layout, loads=loads, num_warps=launch[0],
                         num_stages=launch[1], tb_per_s=gigabytes / median_ms_from_idle(fn)))

    for warps, stages in POINTER_LAUNCHES:
        record("pointer", (warps, stages), lambda: _pointer_kernel[(programs,)](
            x, out, tiles, tiles.numel(), ROWSTRIDE=heads * D, D=D, BN=BN, ITERS=ITERS,
            num_warps=warps, num_stages=stages))
    if torch.cuda.get_device_capability()[0] >= 9:
        desc = TensorDescriptor.from_tensor(x, [BN, 1, D])
        for warps, stages in TMA_LAUNCHES:
            record("tma", (warps, stages), lambda: _tma_kernel[(programs,)](
                desc, out, tiles, tiles.numel(), D=D, BN=BN, ITERS=ITERS, num_warps=warps,
                num_stages=stages))
    return rows


def best(rows: list[dict]) -> list[dict]:
    """The fastest launch of each (layout, loads, size)."""
    top = {}
    for r in rows:
        key = (r["layout"], r["loads"], r["size_mb"])
        if key not in top or r["tb_per_s"] > top[key]["tb_per_s"]:
            top[key] = r
    return list(top.values())


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, ax = new_figure(figsize=(6, 4.2))
    tops = best(rows)
    for key in dict.fromkeys((r["layout"], r["loads"]) for r in tops):
        pts = [(r["size_mb"], r["tb_per_s"]) for r in tops if (r["layout"], r["loads"]) == key]
        ax.plot(*zip(*pts), marker="o", label=f"{key[1]}, {key[0]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("buffer MB (all heads)")
    ax.set_ylabel("random tile reads, TB/s (best launch)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_figure(fig, path, title)


def main() -> None:
    p = geometry.parser(__doc__)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--out", default="bench/results")
    args, geo = geometry.parse(p)
    from tqdm import tqdm

    D, BN = geo.head_dim_qk, min(geo.sel_block, 64)
    header = f"{run_header()} D={D} BN={BN} iters={ITERS} programs/SM={PROGRAMS_PER_SM}"
    print(header)
    rows = []
    cases = [(mb, heads) for mb in args.sizes_mb for heads in (geo.num_kv_heads, 1)]
    for mb, heads in tqdm(cases, desc="l2", unit="case"):
        rows += measure(mb, heads, D, BN)
    print(f"\n{'MB':>5s} {'layout':28s} {'loads':8s} {'warps':>5s} {'stages':>6s} {'TB/s':>6s}")
    for r in rows:
        print(f"{r['size_mb']:5d} {r['layout']:28s} {r['loads']:8s} {r['num_warps']:5d} "
              f"{r['num_stages']:6d} {r['tb_per_s']:6.2f}")
    out = Path(args.out)
    write_csv(out / "l2.csv", rows, header)
    plot(rows, out / "l2.png", header)


if __name__ == "__main__":
    main()
