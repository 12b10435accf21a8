"""Where the selection kernel overtakes packed SDPA: the per-SM minimum length of the routing table.

    python bench/bench_routing.py [--seqlens 256 512 1024 2048 4096 8192] [--batch 1 8]
                                  [geometry flags | --config FILE.yaml] [--write ROUTING.yaml]

Times the selection-attention forward of the two implementations the routing table chooses between
on CUDA (the Triton kernel and packed SDPA; both rows share the Triton backward, so the forward
decides) in bf16 at the geometry of bench/geometry.py (default the spec's: l'=64, n=16), on a
random selection of the op's format. Prints the table and the crossover (the shortest length
from which the kernel is faster at every longer length measured), and writes routing.csv +
routing.png into --out. The crossover is the routing table's selection_min_seqlen for the
device's SM (built in: nsa_ops.routing.TRITON_SELECTION_MIN_SEQLEN); --write puts it in a routing
file that NSA_OPS_ROUTING=ROUTING.yaml or nsa_ops.routing.load("ROUTING.yaml") applies.
"""
from __future__ import annotations

from pathlib import Path

import torch

import geometry
from nsa_ops import routing
from nsa_ops.kernels.selection import selection_attention_fwd
from nsa_ops.packed import selection_attention_packed
from nsa_ops.results import new_figure, save_figure, write_csv
from bench_kernels import median_ms_from_idle, random_selection, spec_inputs
from bench_prefill import run_header

IMPLS = {"triton": selection_attention_fwd, "packed_sdpa": selection_attention_packed}


def crossover(rows, batch: int) -> int:
    """Shortest T from which the kernel wins at every longer T measured (inf: never)."""
    lengths = sorted({r["T"] for r in rows if r["B"] == batch})
    ms = {(r["impl"], r["T"]): r["fwd_ms"] for r in rows if r["B"] == batch}
    wins = [ms["triton", T] <= ms["packed_sdpa", T] for T in lengths]
    best = float("inf")
    for T, win in zip(reversed(lengths), reversed(wins)):
        if not win:
            break
        best = T
    return best


def thresholds(rows, sm: tuple[int, int], batches) -> dict:
    """The routing file's entries this run measured: selection_min_seqlen on this SM, the largest
    crossover of the batch sizes (from there the kernel won at every one)."""
    shortest = min(r["T"] for r in rows)
    # a kernel that won from the shortest length measured is taken to win below it too, as the
    # built-in sm90 value (0) is
    min_len = max(crossover(rows, B) for B in batches)
    return {sm: {"selection_min_seqlen": 0 if min_len == shortest else min_len}}


def write_thresholds(path, rows, sm: tuple[int, int], batches, header: str) -> None:
    routing.save(path, thresholds(rows, sm, batches), f"bench/bench_routing.py: {header}")


def plot(rows, path: Path, title: str) -> None:
    fig, ax = new_figure(figsize=(6, 4.2))
    for key in dict.fromkeys((r["impl"], r["B"]) for r in rows):
        pts = [(r["T"], r["fwd_ms"]) for r in rows if (r["impl"], r["B"]) == key]
        ax.plot(*zip(*pts), marker="o", label=f"{key[0]} B={key[1]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("selection forward, median ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_figure(fig, path, title)


def main() -> None:
    p = geometry.parser(__doc__, batch=(1, 8))
    p.add_argument("--seqlens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--write", metavar="ROUTING.yaml",
                   help="also write the crossover as a routing file (selection_min_seqlen)")
    args, geo = geometry.parse(p)
    from tqdm import tqdm

    header = f"{run_header()} {geometry.describe(geo, args.batch)}"
    print(header)
    rows = []
    for B in args.batch:
        for T in tqdm(args.seqlens, desc=f"routing B={B}", unit="T"):
            torch.manual_seed(0)
            q, k, v, _ = spec_inputs(geo, B, T)
            idx = random_selection(T, geo.num_sel, geo.sel_block, geo.num_kv_heads, B, "cuda")
            for name, fn in IMPLS.items():
                ms = median_ms_from_idle(lambda: fn(q, k, v, idx, geo.sel_block, geo.scale))
                rows.append(dict(impl=name, B=B, T=T, fwd_ms=ms))
    print(f"\n{'impl':12s} {'B':>3s} {'T':>6s} {'fwd ms':>9s}")
    for r in rows:
        print(f"{r['impl']:12s} {r['B']:3d} {r['T']:6d} {r['fwd_ms']:9.3f}")
    sm = torch.cuda.get_device_capability()
    for B in args.batch:
        print(f"crossover sm{sm[0]}{sm[1]} B={B}: triton from T={crossover(rows, B)}")
    out = Path(args.out)
    write_csv(out / "routing.csv", rows, header)
    plot(rows, out / "routing.png", header)
    if args.write:
        write_thresholds(args.write, rows, sm, args.batch, header)
        print(f"wrote {args.write}: NSA_OPS_ROUTING={args.write} applies it")


if __name__ == "__main__":
    main()
