"""Decode benchmark: one NSA decode step (Triton kernels) vs dense SDPA decode, per step latency and
achieved HBM bandwidth.

    python bench/bench_decode.py [--seqlens 4096 16384 65536] [--batch 1 16 64] [--out DIR]
                                 [geometry flags | --config FILE.yaml]

bf16 on one CUDA device, at the geometry of bench/geometry.py (default: the spec's).
The cache is filled with S random tokens (mean phi) and one attention step for the newest token
(`nsa_ops.kernels.decode.decode_attention_fwd`: the decode kernels, one launch or three as its
occupancy heuristic picks, shown in the "launches" column; no projections or cache append) is
captured in a CUDA graph. Dense is F.scaled_dot_product_attention of one query over
all S cached keys (enable_gqa=True, K/V read in place from the cache), captured the same way.
Each timing replays the graph once after reading a 512 MB buffer, so K/V come from HBM, not from
the 50 MB L2; the median of --reps replays is reported.

Bytes per NSA step = B * H * reads(S) * (Dk + Dv) * 2, reads(S) = num_cmp(S) + n*l' + min(w, S)
(NSA-SPEC "Decode": the K/V rows every (batch row, KV head) loads once for its G query heads).
Dense: B * H * S * (Dk + Dv) * 2. GB/s = bytes / median time; "% peak" divides by the device's
nominal HBM bandwidth (PEAK_TBPS, by device name) and "% copy" by a measured device-to-device
copy (read + write bytes / time), the practical ceiling. Prints a table; writes decode.csv and
decode.png (median step time, log scale) into --out.

Chunked prefill (--chunk C, 0 to skip): the last C of S cached tokens attended at once through
the prefill ops with the queries at an offset (`nsa_ops.decode.decode_chunk`, B=1), as
`layer(x_chunk, cache)` runs them; tokens/s = C / median time. Written to chunked_prefill.csv.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F

import geometry
import nsa_ops
from nsa_ops import reference
from nsa_ops.decode import decode_chunk
from bench_prefill import event_ms, median_ms, run_header
from nsa_ops.kernels import decode as decode_kernels
from nsa_ops.kernels.decode import decode_attention_fwd
from nsa_ops.results import new_figure, save_figure, write_csv

# nominal HBM bandwidth in TB/s, matched against torch.cuda.get_device_name() in this order
PEAK_TBPS = (("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35))
_FLUSH_BYTES = 512 << 20


def peak_tbps() -> float | None:
    name = torch.cuda.get_device_name()
    return next((tbps for key, tbps in PEAK_TBPS if key in name), None)


def copy_tbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, read + write bytes per second, in TB/s (median of 20)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = [event_ms(lambda: dst.copy_(src)) for _ in range(23)]
    return nbytes / (sorted(times[3:])[10] * 1e-3) / 1e12


def graph_of(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile / pick kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def median_replay_us(graph: torch.cuda.CUDAGraph, flush: torch.Tensor, reps: int) -> float:
    times = []
    for _ in range(reps):
        # read a buffer larger than L2: the replay's K/V come from HBM, and the L2 lines it
        # evicts are clean (a write flush would add its dirty write-backs to the replay)
        flush.max()
        times.append(event_ms(graph.replay) * 1e3)
    return sorted(times)[len(times) // 2]


def filled_cache(cfg: nsa_ops.NSAConfig, S: int, B: int, device="cuda"
                 ) -> tuple[nsa_ops.NSACache, torch.Tensor, list[torch.Tensor]]:
    """A static cache holding S random tokens (mean phi), a query row and gates."""
    dt = torch.bfloat16
    cache = nsa_ops.NSACache(cfg, B, capacity=S, dtype=dt, device=device)
    torch.manual_seed(0)
    cache.k.normal_()
    cache.v.normal_()
    rows = cfg.num_cmp(S)
    cache.k_cmp[:, :rows] = reference.compress_mean(cache.k, cfg.block_len,
                                                    cfg.block_stride)[:, :rows]
    cache.v_cmp[:, :rows] = reference.compress_mean(cache.v, cfg.block_len,
                                                    cfg.block_stride)[:, :rows]
    cache.length = S
    cache.device_length.fill_(S)
    q = torch.randn(B, 1, cfg.num_heads, cfg.head_dim_qk, device=device, dtype=dt)
    gates = [torch.rand(B, 1, cfg.num_heads, device=device, dtype=dt) for _ in range(3)]
    return cache, q, gates


def nsa_step_us(cache, q, gates, flush: torch.Tensor, reps: int) -> float:
    scale = cache.config.scale
    _, reads = decode_attention_fwd(q, cache, *gates, scale)
    assert reads.item() == cache.config.reads(cache.length), (reads.item(), cache.length)
    return median_replay_us(graph_of(lambda: decode_attention_fwd(q, cache, *gates, scale)),
                            flush, reps)


def dense_step_us(cache, q, flush: torch.Tensor, reps: int) -> float:
    qt, kt, vt = q.transpose(1, 2), cache.k.transpose(1, 2), cache.v.transpose(1, 2)
    return median_replay_us(
        graph_of(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)), flush,
        reps)


def chunked_prefill(cfg: nsa_ops.NSAConfig, S: int, chunk: int, device="cuda") -> dict:
    """Median ms of attending the last `chunk` of S cached tokens at once (B=1)."""
    cache, _, _ = filled_cache(cfg, S, 1, device)
    dt = cache.dtype
    q = torch.randn(1, chunk, cfg.num_heads, cfg.head_dim_qk, device=device, dtype=dt)
    gates = [torch.rand(1, chunk, cfg.num_heads, device=device, dtype=dt) for _ in range(3)]
    with torch.no_grad():
        ms = median_ms(lambda: decode_chunk(q, cache, *gates, cache.config.scale))
    return dict(S=S, chunk=chunk, ms=ms, tokens_per_s=chunk / ms * 1e3)


def measure(cfg: nsa_ops.NSAConfig, S: int, B: int, flush: torch.Tensor, reps: int) -> dict:
    cache, q, gates = filled_cache(cfg, S, B)
    nsa_us = nsa_step_us(cache, q, gates, flush, reps)
    dense_us = dense_step_us(cache, q, flush, reps)
    c = cache.config
    reads = c.reads(S)
    H = c.num_kv_heads
    plan = decode_kernels._plan(B, H, S, c.block_len, c.block_stride, c.sel_block, c.num_sel,
                                c.window, cache.device, None, None)
    del cache
    torch.cuda.empty_cache()
    nsa_bytes = B * H * reads * (c.head_dim_qk + c.head_dim_v) * 2
    dense_bytes = B * H * S * (c.head_dim_qk + c.head_dim_v) * 2
    return dict(S=S, B=B, launches=1 if plan.fused else 3, reads=reads, nsa_us=nsa_us,
                dense_us=dense_us,
                speedup=dense_us / nsa_us, nsa_MB=nsa_bytes / 1e6,
                nsa_GBps=nsa_bytes / nsa_us / 1e3, dense_GBps=dense_bytes / dense_us / 1e3)


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, ax = new_figure(figsize=(7, 4.2))
    for B in dict.fromkeys(r["B"] for r in rows):
        pts = [r for r in rows if r["B"] == B]
        line, = ax.plot([r["S"] for r in pts], [r["nsa_us"] for r in pts], marker="o",
                        label=f"NSA B={B}")
        ax.plot([r["S"] for r in pts], [r["dense_us"] for r in pts], marker="x", linestyle="--",
                color=line.get_color(), label=f"dense SDPA B={B}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached tokens S")
    ax.set_ylabel("decode step, median µs (CUDA graph)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path, "\n".join(textwrap.wrap(title, 120)))


def main() -> None:
    parser = geometry.parser(__doc__, batch=(1, 16, 64))
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--out", default="bench/results")
    args, cfg = geometry.parse(parser)
    from tqdm import tqdm

    header = f"{run_header()} {geometry.describe(cfg, args.batch)}"
    print(header)
    peak = peak_tbps()
    copy = copy_tbps()
    print(f"HBM: nominal peak {f'{peak:.2f} TB/s' if peak else 'unknown for this device'}, "
          f"measured device-to-device copy {copy:.2f} TB/s")
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    jobs = [(S, B) for S in args.seqlens for B in args.batch]
    for S, B in tqdm(jobs, desc="decode", unit="case"):
        r = measure(cfg, S, B, flush, args.reps)
        r["pct_peak"] = 100 * r["nsa_GBps"] / (peak * 1e3) if peak else float("nan")
        r["pct_copy"] = 100 * r["nsa_GBps"] / (copy * 1e3)
        rows.append(r)

    print(f"\n{'S':>6s} {'B':>3s} {'launch':>6s} {'reads':>6s} {'NSA us':>8s} {'dense us':>9s} "
          f"{'speedup':>8s} "
          f"{'NSA MB':>8s} {'NSA GB/s':>9s} {'% peak':>7s} {'% copy':>7s} {'dense GB/s':>10s}")
    for r in rows:
        print(f"{r['S']:6d} {r['B']:3d} {r['launches']:6d} {r['reads']:6d} {r['nsa_us']:8.1f} "
              f"{r['dense_us']:9.1f} "
              f"{r['speedup']:7.1f}x {r['nsa_MB']:8.1f} {r['nsa_GBps']:9.0f} "
              f"{r['pct_peak']:6.1f}% {r['pct_copy']:6.1f}% {r['dense_GBps']:10.0f}")

    out = Path(args.out)
    if args.chunk:
        chunks = [chunked_prefill(cfg, S, args.chunk) for S in args.seqlens]
        print(f"\nchunked prefill, {args.chunk} tokens per call (B=1)")
        print(f"{'S':>6s} {'ms':>8s} {'tokens/s':>10s}")
        for r in chunks:
            print(f"{r['S']:6d} {r['ms']:8.2f} {r['tokens_per_s']:10.0f}")
        write_csv(out / "chunked_prefill.csv", chunks, header)
    header += f" hbm_peak_TBps={peak} copy_TBps={copy:.3f}"
    write_csv(out / "decode.csv", rows, header)
    plot(rows, out / "decode.png", header)


if __name__ == "__main__":
    main()
