"""torch.compile'd NSA layer step vs the same layer run eagerly, at T in {8k, 32k}.

    python bench/bench_compiled.py [--seqlens 8192 32768] [--out bench/results]
                                   [geometry flags | --config FILE.yaml]

One NSAAttention layer, bf16, forward and forward+backward, its config from bench/geometry.py
(default: the spec geometry, hidden 4096). Columns:
  eager_ms         the eager step, wall time (median)
  eager_kernel_ms  the sum of the device times of every kernel the eager step launches
                   (torch.profiler): what the step would cost with no launch or Python overhead
  compiled_ms      torch.compile(fullgraph=True) of the same step, wall time (median); the
                   selection branch lowers to nsa_ops.lowering's template or packed SDPA, the
                   gate and the other pointwise work fuse
Prints a table; writes compiled.csv + compiled.png into --out.
"""
from __future__ import annotations

from pathlib import Path

import torch

import geometry
import nsa_ops
from nsa_ops.results import new_figure, save_figure, write_csv
from bench_prefill import median_ms, run_header


def kernel_sum_ms(fn, reps=3) -> float:
    """Summed device time of the kernels fn launches, per call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e3 / reps


def steps(layer, x):
    def forward():
        with torch.no_grad():
            layer(x)

    def forward_backward():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).float().square().mean().backward()
    return {"fwd": forward, "fwd_bwd": forward_backward}


def plot(rows, path: Path, title: str) -> None:
    fig, axes = new_figure(1, 2, figsize=(10, 4))
    for ax, step in zip(axes, ("fwd", "fwd_bwd")):
        sub = [r for r in rows if r["step"] == step]
        labels = [str(r["T"]) for r in sub]
        width = 0.27
        for i, col in enumerate(("eager_ms", "eager_kernel_ms", "compiled_ms")):
            ax.bar([j + (i - 1) * width for j in range(len(sub))], [r[col] for r in sub], width,
                   label=col)
        ax.set_xticks(range(len(sub)), labels)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(f"{step} ms")
        ax.legend()
    save_figure(fig, path, title)


def main() -> None:
    p = geometry.parser(__doc__)
    p.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--out", default="bench/results")
    args, cfg = geometry.parse(p)
    from tqdm import tqdm

    header = f"{run_header()} {geometry.describe(cfg, args.batch)} hidden={cfg.hidden_size}"
    print(header)
    torch.manual_seed(0)
    layer = nsa_ops.NSAAttention(cfg).cuda().to(torch.bfloat16)
    with torch.no_grad():  # gates away from their initial 0.5 so every branch matters
        layer.gate[-1].weight.normal_(0, 0.02)
    compiled = torch.compile(layer, fullgraph=True)
    rows = []
    for T in tqdm(args.seqlens, desc="compiled vs eager", unit="T"):
        x = torch.randn(args.batch, T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        eager, comp = steps(layer, x), steps(compiled, x)
        for step in ("fwd", "fwd_bwd"):
            rows.append(dict(T=T, step=step, eager_ms=median_ms(eager[step]),
                             eager_kernel_ms=kernel_sum_ms(eager[step]),
                             compiled_ms=median_ms(comp[step])))
    print(f"\n{'T':>6s} {'step':8s} {'eager ms':>9s} {'kernels ms':>11s} {'compiled ms':>12s}")
    for r in rows:
        print(f"{r['T']:6d} {r['step']:8s} {r['eager_ms']:9.2f} {r['eager_kernel_ms']:11.2f} "
              f"{r['compiled_ms']:12.2f}")
    out = Path(args.out)
    write_csv(out / "compiled.csv", rows, header)
    plot(rows, out / "compiled.png", header)


if __name__ == "__main__":
    main()
