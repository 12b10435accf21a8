"""Per-kernel timings and achieved TFLOP/s at one prefill shape (B=1, HQ=64, H=4, D=128, bf16).

    python bench/bench_kernels.py [--seqlens 65536 ...] [--kernels selection window compressed select]

FLOPs count the useful work (causally visible pairs): 4*D per (query head, key) for forward,
10*D for backward (QK^T, dP, dQ, dK, dV, i.e. 2.5x the forward). Prints a table; writes
kernels.csv into --out. Compressed attention is timed both as the Triton kernel and through
cuDNN (nsa_ops.compressed_sdpa), which the routing table picks from CUDNN_COMPRESSED_MIN_ROWS on.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nsa_ops import reference
from nsa_ops.results import write_csv
from bench_prefill import run_header

HQ, H, D = 64, 4, 128


def median_ms(fn, reps=10):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=reps * 20, return_mode="median")


def random_selection(T, n, sel_block, device):
    """Forced blocks plus random distinct earlier blocks, in the op's output format."""
    g = torch.Generator(device=device).manual_seed(0)
    pos = torch.arange(T, device=device)
    nblk = -(-T // sel_block)
    score = torch.rand(1, T, H, nblk, device=device, generator=g)
    return reference.topn_blocks(score, pos, sel_block, n)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", type=int, nargs="+", default=[65536])
    p.add_argument("--kernels", nargs="+", default=["selection", "window", "compressed", "select"])
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    print(run_header())
    rows = []
    for T in args.seqlens:
        bench_length(T, args.kernels, rows)
        torch.cuda.empty_cache()
    write_csv(Path(args.out) / "kernels.csv", rows, run_header())


def spec_inputs(T: int, device="cuda") -> tuple[torch.Tensor, ...]:
    """(q, k, v, do) of the benchmarks' geometry at T tokens, bf16, seeded: what bench_kernels
    and the tune_* sweeps time."""
    torch.manual_seed(0)
    q = torch.randn(1, T, HQ, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, T, H, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, T, H, D, device=device, dtype=torch.bfloat16)
    return q, k, v, torch.randn_like(q)


def bench_length(T: int, kernels: list[str], rows: list[dict]) -> None:
    q, k, v, do = spec_inputs(T)
    scale = D ** -0.5

    def record(name, fwd, bwd, pairs):
        t_f = median_ms(fwd)
        t_b = median_ms(bwd) if bwd else float("nan")
        tf_f = 4 * D * pairs / t_f / 1e9
        tf_b = 10 * D * pairs / t_b / 1e9 if bwd else float("nan")
        rows.append(dict(kernel=name, T=T, fwd_ms=t_f, bwd_ms=t_b, fwd_tflops=tf_f,
                         bwd_tflops=tf_b))
        print(f"{name:24s} T={T:6d} fwd {t_f:8.2f} ms {tf_f:6.0f} TFLOP/s | bwd {t_b:8.2f} ms "
              f"{tf_b:6.0f} TFLOP/s", flush=True)

    if "selection" in kernels:
        from nsa_ops.kernels import selection as S
        for n, lp in ((16, 64),):
            idx = random_selection(T, n, lp, q.device)
            o, lse = S.selection_attention_fwd(q, k, v, idx, lp, scale)
            pairs = HQ * (idx >= 0).sum().item() / H * lp  # upper bound on causal pairs
            record(f"selection n={n} l'={lp}", lambda: S.selection_attention_fwd(q, k, v, idx, lp, scale),
                   lambda: S.selection_attention_bwd(q, k, v, o, lse, do, None, idx, lp, scale), pairs)
    if "window" in kernels:
        from nsa_ops.kernels import window as W
        for backend in ("aten_fa2", "triton"):
            try:
                o, lse = W.sliding_window_fwd(q, k, v, 512, scale, backend=backend)
            except Exception as exc:
                print(f"window {backend}: {type(exc).__name__}: {exc}")
                continue
            pairs = HQ * min(512, T) * T
            record(f"window w=512 {backend}",
                   lambda: W.sliding_window_fwd(q, k, v, 512, scale, backend=backend),
                   lambda: W.sliding_window_bwd(q, k, v, o, lse, do, None, 512, scale,
                                                backend=backend), pairs)
    if "compressed" in kernels or "select" in kernels:
        from nsa_ops import compressed_sdpa as CS
        from nsa_ops.kernels import compressed as C
        for l, d, lp in ((32, 16, 64), (64, 64, 64)):
            k_cmp = reference.compress_mean(k, l, d)
            v_cmp = reference.compress_mean(v, l, d)
            o, lse = C.compressed_attention_fwd(q, k_cmp, v_cmp, l, d, scale)
            pairs = HQ * T * reference.num_cmp(T, l, d) / 2  # k_cmp has padding rows too
            if "compressed" in kernels:
                for impl, K in (("triton", C), ("cudnn", CS)):
                    record(f"compressed l={l} d={d} {impl}",
                           lambda: K.compressed_attention_fwd(q, k_cmp, v_cmp, l, d, scale),
                           lambda: K.compressed_attention_bwd(q, k_cmp, v_cmp, o, lse, do, None,
                                                              l, d, scale), pairs)
            if "select" in kernels:
                record(f"select_blocks l={l} d={d}",
                       lambda: C.select_blocks(q, k_cmp, lse, l, d, lp, 16, scale), None,
                       pairs)


if __name__ == "__main__":
    main()
