"""Per-kernel timings and achieved TFLOP/s at one prefill shape (bf16, at the geometry of
bench/geometry.py, by default the spec's).

    python bench/bench_kernels.py [--seqlens 65536 ...] [--kernels selection window compressed select]
                                  [geometry flags | --config FILE.yaml]

FLOPs count the useful work (causally visible pairs): 2*(Dk+Dv) per (query head, key) for
forward, 5*(Dk+Dv) for backward (QK^T, dP, dQ, dK, dV, i.e. 2.5x the forward). fwd_ms / bwd_ms
(and the FLOP/s) are the GPU's time for the call's kernels, the host enqueueing it ahead
(`median_gpu_ms`); *_ms_from_idle are triton's do_bench medians, which also count the host's
latency to the first launch (`median_ms_from_idle`). Prints a table;
writes kernels.csv into --out. Compressed attention is timed both as the Triton kernel and through
cuDNN (nsa_ops.compressed_sdpa), which the routing table picks from CUDNN_COMPRESSED_MIN_ROWS on,
at the geometry's (l, d) and at fla's (l = d = l' = 64, n = 16).
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

import geometry
from nsa_ops import NSAConfig, reference
from nsa_ops.results import write_csv
from bench_prefill import event_ms, run_header
from selection_floor import selection_loads


def median_ms_from_idle(fn, reps=10):
    """triton's do_bench median: each call starts on a cold L2 and an idle GPU, so its time also
    holds the host's latency to the call's first launch (checks, routing, launch)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=reps * 20, return_mode="median")


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles torch.cuda._sleep spins per millisecond, timed once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # ramps the clock first
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def median_gpu_ms(fn, budget_ms=200.0, warmup=5):
    """Median GPU time of fn's work: each call starts on a cold L2 (a 256 MB write, as do_bench)
    behind a GPU sleep that outlasts the host's enqueueing of the call, so that the events
    bracket its kernels alone (`median_ms_from_idle` adds the host's latency to the first
    launch). Calls for about budget_ms of GPU time, 10 to 500 of them."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    host_start = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - host_start) * 1e3
    torch.cuda.synchronize()
    cycles = int((1.5 * host_ms + 0.2) * _sleep_cycles_per_ms())
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")
    times = []
    while len(times) < 10 or (sum(times) < budget_ms and len(times) < 500):
        flush.zero_()
        torch.cuda._sleep(cycles)
        times.append(event_ms(fn))
    return sorted(times)[len(times) // 2]


def random_selection(T, n, sel_block, kv_heads, batch, device, run=1):
    """Forced blocks plus random distinct earlier blocks, in the op's output format [B,T,H,n]
    (one selection, repeated over the batch). run > 1: runs of `run` consecutive tokens share
    their random blocks (their scores), as trained models' neighbouring tokens mostly do; the
    forced local blocks still follow each token."""
    g = torch.Generator(device=device).manual_seed(0)
    pos = torch.arange(T, device=device)
    nblk = -(-T // sel_block)
    score = torch.rand(1, -(-T // run), kv_heads, nblk, device=device, generator=g)
    score = score.repeat_interleave(run, dim=1)[:, :T]
    return reference.topn_blocks(score, pos, sel_block, n).expand(batch, -1, -1, -1).contiguous()


def main():
    p = geometry.parser(__doc__)
    p.add_argument("--seqlens", type=int, nargs="+", default=[65536])
    p.add_argument("--kernels", nargs="+", default=["selection", "window", "compressed", "select"])
    p.add_argument("--out", default="bench/results")
    args, cfg = geometry.parse(p)
    header = f"{run_header()} {geometry.describe(cfg, args.batch)}"
    print(header)
    rows = []
    for T in args.seqlens:
        bench_length(cfg, args.batch, T, args.kernels, rows)
        torch.cuda.empty_cache()
    write_csv(Path(args.out) / "kernels.csv", rows, header)


def spec_inputs(cfg: NSAConfig, B: int, T: int, device="cuda") -> tuple[torch.Tensor, ...]:
    """(q, k, v, do) of the geometry at B x T tokens, bf16, seeded: what bench_kernels and the
    tune_* sweeps time."""
    torch.manual_seed(0)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    q = torch.randn(B, T, cfg.num_heads, cfg.head_dim_qk, **bf16)
    k = torch.randn(B, T, cfg.num_kv_heads, cfg.head_dim_qk, **bf16)
    v = torch.randn(B, T, cfg.num_kv_heads, cfg.head_dim_v, **bf16)
    return q, k, v, torch.randn(B, T, cfg.num_heads, cfg.head_dim_v, **bf16)


def bench_length(cfg: NSAConfig, B: int, T: int, kernels: list[str], rows: list[dict]) -> None:
    q, k, v, do = spec_inputs(cfg, B, T)
    scale, HQ, w = cfg.scale, cfg.num_heads, cfg.window
    dims = cfg.head_dim_qk + cfg.head_dim_v

    def record(name, fwd, bwd, pairs):
        t_f = median_gpu_ms(fwd)
        t_b = median_gpu_ms(bwd) if bwd else float("nan")
        idle_f = median_ms_from_idle(fwd)
        idle_b = median_ms_from_idle(bwd) if bwd else float("nan")
        tf_f = 2 * dims * pairs / t_f / 1e9
        tf_b = 5 * dims * pairs / t_b / 1e9 if bwd else float("nan")
        rows.append(dict(kernel=name, T=T, fwd_ms=t_f, bwd_ms=t_b, fwd_tflops=tf_f,
                         bwd_tflops=tf_b, fwd_ms_from_idle=idle_f, bwd_ms_from_idle=idle_b))
        print(f"{name:24s} T={T:6d} fwd {t_f:8.2f} ms {tf_f:6.0f} TFLOP/s | bwd {t_b:8.2f} ms "
              f"{tf_b:6.0f} TFLOP/s | from an idle GPU {idle_f:8.2f} / {idle_b:8.2f} ms",
              flush=True)

    if "selection" in kernels:
        from nsa_ops.kernels import selection as S
        n, lp = cfg.num_sel, cfg.sel_block
        # random: what random inputs select; coherent: runs of 64 tokens share their blocks
        for selection, run in (("random", 1), ("coherent", 64)):
            idx = random_selection(T, n, lp, cfg.num_kv_heads, B, q.device, run)
            o, lse = S.selection_attention_fwd(q, k, v, idx, lp, scale)
            pairs = HQ * (idx >= 0).sum().item() / cfg.num_kv_heads * lp  # bounds causal pairs
            record(f"selection n={n} l'={lp} {selection}",
                   lambda: S.selection_attention_fwd(q, k, v, idx, lp, scale),
                   lambda: S.selection_attention_bwd(q, k, v, o, lse, do, None, idx, lp, scale),
                   pairs)
            if B == 1 and cfg.head_dim_qk == cfg.head_dim_v:
                # the floor: the same K/V loads with no math (bench/selection_floor.py)
                scratch = torch.empty(T, cfg.num_kv_heads, cfg.head_dim_qk, device=q.device)
                idx32 = idx.to(torch.int32)
                record(f"selection n={n} l'={lp} {selection} loads only",
                       lambda: selection_loads(k, v, idx32, lp, scratch), None, pairs)
    if "window" in kernels:
        from nsa_ops.kernels import window as W
        for backend in ("aten_fa2", "triton"):
            try:
                o, lse = W.sliding_window_fwd(q, k, v, w, scale, backend=backend)
            except Exception as exc:
                print(f"window {backend}: {type(exc).__name__}: {exc}")
                continue
            pairs = B * HQ * min(w, T) * T
            record(f"window w={w} {backend}",
                   lambda: W.sliding_window_fwd(q, k, v, w, scale, backend=backend),
                   lambda: W.sliding_window_bwd(q, k, v, o, lse, do, None, w, scale,
                                                backend=backend), pairs)
    if "compressed" in kernels or "select" in kernels:
        from nsa_ops import compressed_sdpa as CS
        from nsa_ops.kernels import compressed as C
        fla = (64, 64, 64, 16)
        for l, d, lp, n in dict.fromkeys(((cfg.block_len, cfg.block_stride, cfg.sel_block,
                                           cfg.num_sel), fla)):
            k_cmp = reference.compress_mean(k, l, d)
            v_cmp = reference.compress_mean(v, l, d)
            o, lse = C.compressed_attention_fwd(q, k_cmp, v_cmp, l, d, scale)
            pairs = B * HQ * T * reference.num_cmp(T, l, d) / 2  # k_cmp has padding rows too
            if "compressed" in kernels:
                for impl, K in (("triton", C), ("cudnn", CS)):
                    record(f"compressed l={l} d={d} {impl}",
                           lambda: K.compressed_attention_fwd(q, k_cmp, v_cmp, l, d, scale),
                           lambda: K.compressed_attention_bwd(q, k_cmp, v_cmp, o, lse, do, None,
                                                              l, d, scale), pairs)
            if "select" in kernels:
                record(f"select_blocks l={l} d={d}",
                       lambda: C.select_blocks(q, k_cmp, lse, l, d, lp, n, scale), None,
                       pairs)


if __name__ == "__main__":
    main()
