"""Prefill benchmark: forward and forward+backward of NSA vs SDPA causal vs fla's parallel_nsa.

    python bench/bench_prefill.py [--seqlens 8192 16384 32768 65536] [--out bench/results]
                                  [geometry flags | --config FILE.yaml]

bf16 on one CUDA device, at the geometry of bench/geometry.py (default: the spec's). Methods:
  nsa_full     our NSA at the geometry, phi mean
  nsa_fla_cfg  our NSA in fla's configuration (l=d=l'=64, n=16, no window branch)
  sdpa_causal  torch scaled_dot_product_attention, causal, GQA
  nsa_full_graphed  nsa_full as CUDA graphs (torch.cuda.make_graphed_callables, one capture per
               length): its kernels replayed without the host's Python and launch time (the
               capture runs cuDNN's compressed attention, whose plans its warm-up built); its
               peak memory counts the graphs' private pool
  nsa_full_deterministic  nsa_full under torch.use_deterministic_algorithms(True): its backward
               adds partial dk/dv in a fixed order (kernels/ordered.py), bitwise reproducible
  *_compiled   the two NSA methods under torch.compile (selection lowers to nsa_ops.lowering's
               template, the gate fuses into its epilogue)
  fla_nsa      fla.ops.nsa.parallel_nsa (l=d=l'=64, n=16, no window) when fla is importable
  flash_nsa    flash-nsa's HFNSACore at the geometry, when its source is under .peers/
               (bench/peers.py: how to get it, and the FA-2 shim its window branch runs on)
Prints a table; writes prefill.csv and prefill.png (median ms, log scale) into --out, with each
method's peak memory over the forward+backward step and, for flash_nsa, the relative error of
its output against nsa_full's on the same inputs.
"""
from __future__ import annotations

import gc
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import geometry
import nsa_ops
import peers
from nsa_ops.results import commit, new_figure, save_figure, write_csv


def run_header() -> str:
    """What every committed result names: device, versions, commit."""
    import triton
    return (f"device={torch.cuda.get_device_name()} torch={torch.__version__} "
            f"triton={triton.__version__} commit={commit()} python={platform.python_version()}")


def nsa_full(cfg: nsa_ops.NSAConfig):
    """Our NSA at cfg's geometry, as a method."""
    def run(q, k, v, g):
        return nsa_ops.nsa_attention(q, k, v, *g, block_len=cfg.block_len,
                                     block_stride=cfg.block_stride, sel_block=cfg.sel_block,
                                     num_sel=cfg.num_sel, window=cfg.window)
    return run


def graphed(run):
    """run(q, k, v, g) replayed from CUDA graphs that torch.cuda.make_graphed_callables captures
    on the first call at each input shape; `.release()` drops them and their memory pool, which
    main() calls after each measurement so that the next method's peak memory excludes it."""
    graphs = {}

    def release():
        graphs.clear()
        gc.collect()  # the graphed autograd Function's class keeps the graphs in a cycle
        torch.cuda.empty_cache()

    def replay(q, k, v, g):
        key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), len(g))
        if key not in graphs:
            release()
            sample = tuple(x.detach().clone().requires_grad_(x.requires_grad)
                           for x in (q, k, v, *g))
            with torch.enable_grad():  # capture records the backward too
                graphs[key] = torch.cuda.make_graphed_callables(
                    lambda q, k, v, *g: run(q, k, v, g), sample)
        return graphs[key](q, k, v, *g)
    replay.release = release
    replay.pooled = True
    return replay


def nsa_fla_cfg(q, k, v, g):
    """l = d = l' = 64, n = 16, no sliding-window branch: what fla's parallel_nsa computes."""
    return nsa_ops.nsa_attention(q, k, v, g[0], g[1], None, block_len=64, block_stride=64,
                                 sel_block=64, num_sel=16, window=0)


def sdpa_causal(q, k, v, g):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


def fla_nsa():
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception as exc:  # fla missing or incompatible: the table says so
        print(f"fla_nsa skipped: {type(exc).__name__}: {exc}")
        return None

    def run(q, k, v, g):
        return parallel_nsa(q, k, v, g[0], g[1], g[2], block_counts=16, block_size=64,
                            window_size=0)
    return run


class Gates(list):
    """The three branch gates [B,T,HQ] (the sigmoid of random logits) for our methods; `.logits`
    [B*T, HQ, 3] for flash-nsa, whose combine applies the sigmoid itself."""

    def __init__(self, logits: torch.Tensor):
        super().__init__(torch.sigmoid(logits).unbind(-1))
        self.logits = logits.flatten(0, 1).contiguous()


def median_ms(fn, warmup_s=0.25, reps=10) -> float:
    """Median of reps synced calls after warmup_s seconds of calls (at least 3): a few calls of
    a 4 ms step left the GPU below its boost clock, and the first method measured at each length
    read up to 20% slow (H100, 8k tokens). The warm-up starts after a first call, which may
    compile (torch.compile, autotuning) while the GPU idles: counted in the warm-up, the compiled
    layer's 8k forward read 8.16 ms in bench_compiled.py against 6.22 measured apart."""
    fn()
    torch.cuda.synchronize()
    warmup_start = time.perf_counter()
    calls = 0
    while calls < 3 or time.perf_counter() - warmup_start < warmup_s:
        fn()
        torch.cuda.synchronize()
        calls += 1
    times = [event_ms(fn) for _ in range(reps)]
    return sorted(times)[len(times) // 2]


def event_ms(fn) -> float:
    """ms between CUDA events recorded around one call of fn, synced after it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def measure(method, cfg: nsa_ops.NSAConfig, B: int, T: int, compare_with=None) -> dict:
    """Median fwd / fwd+bwd ms, peak GB over the fwd+bwd step and, given compare_with (a method
    computing the same function), the relative error of method's output against it."""
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    HQ, H, Dk, Dv = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim_qk, cfg.head_dim_v
    q = torch.randn(B, T, HQ, Dk, **bf16, requires_grad=True)
    k = torch.randn(B, T, H, Dk, **bf16, requires_grad=True)
    v = torch.randn(B, T, H, Dv, **bf16, requires_grad=True)
    g = Gates(torch.randn(B, T, HQ, 3, **bf16))
    do = torch.randn(B, T, HQ, Dv, **bf16)
    with torch.no_grad():
        fwd = median_ms(lambda: method(q, k, v, g))
        rel_err = float("nan")
        if compare_with is not None:
            want = compare_with(q, k, v, g).float()
            rel_err = ((method(q, k, v, g).float() - want).norm() / want.norm()).item()

    def step():
        q.grad = k.grad = v.grad = None
        method(q, k, v, g).backward(do)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(getattr(method, "deterministic", False))
    try:
        fwd_bwd = median_ms(step)
        torch.cuda.reset_peak_memory_stats()
        step()
        # a graphed method's activations live in its graphs' private pool, reserved whether or
        # not a tensor holds them: count the pool (main() empties the cache between methods)
        peak = torch.cuda.max_memory_reserved() if getattr(method, "pooled", False) \
            else torch.cuda.max_memory_allocated()
        peak_gb = peak / 2**30
    finally:
        torch.use_deterministic_algorithms(before)
    return dict(fwd_ms=fwd, fwd_bwd_ms=fwd_bwd, peak_mem_gb=peak_gb, rel_err=rel_err)


def main() -> None:
    parser = geometry.parser(__doc__)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--out", default="bench/results")
    args, cfg = geometry.parse(parser)
    from tqdm import tqdm

    full = nsa_full(cfg)
    deterministic = nsa_full(cfg)
    deterministic.deterministic = True  # measure() times its backward in that mode
    methods = {"nsa_full": full, "nsa_full_graphed": graphed(full),
               "nsa_full_deterministic": deterministic,
               "nsa_fla_cfg": nsa_fla_cfg, "sdpa_causal": sdpa_causal,
               # one compile per length: the template and its autotuning see the real shapes
               "nsa_full_compiled": torch.compile(full, fullgraph=True, dynamic=False),
               "nsa_fla_cfg_compiled": torch.compile(nsa_fla_cfg, fullgraph=True, dynamic=False)}
    fla = fla_nsa()
    if fla is not None:
        methods["fla_nsa"] = fla
    flash_nsa, why = peers.flash_nsa_method(cfg)
    if flash_nsa is not None and args.batch != 1:
        flash_nsa, why = None, "its HFNSACore takes packed sequences: run with --batch 1"
    if flash_nsa is not None:
        methods["flash_nsa"] = flash_nsa
    else:
        print(f"flash_nsa skipped: {why}")
    if args.methods:
        methods = {k: v for k, v in methods.items() if k in args.methods}

    header = f"{run_header()} {geometry.describe(cfg, args.batch)}"
    print(header)
    rows = []
    jobs = [(name, T) for T in args.seqlens for name in methods]
    for name, T in tqdm(jobs, desc="prefill", unit="case"):
        compare_with = full if name == "flash_nsa" else None
        try:
            row = measure(methods[name], cfg, args.batch, T, compare_with)
        except torch.cuda.OutOfMemoryError:
            row = dict.fromkeys(("fwd_ms", "fwd_bwd_ms", "peak_mem_gb", "rel_err"), float("nan"))
        getattr(methods[name], "release", torch.cuda.empty_cache)()
        rows.append(dict(method=name, T=T, **row))

    print(f"\n{'method':20s} {'T':>6s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'peak GB':>8s} "
          f"{'rel err':>8s}")
    for r in rows:
        print(f"{r['method']:20s} {r['T']:6d} {r['fwd_ms']:9.2f} {r['fwd_bwd_ms']:11.2f} "
              f"{r['peak_mem_gb']:8.2f} {r['rel_err']:8.1e}")

    out = Path(args.out)
    write_csv(out / "prefill.csv", rows, header)
    plot(rows, out / "prefill.png", header)


def plot(rows, path: Path, title: str) -> None:
    fig, axes = new_figure(1, 2, figsize=(11, 4.2))
    for ax, key in zip(axes, ("fwd_ms", "fwd_bwd_ms")):
        for name in dict.fromkeys(r["method"] for r in rows):
            pts = [(r["T"], r[key]) for r in rows if r["method"] == name]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(f"{key.replace('_ms', '')} median ms")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    save_figure(fig, path, title, fontsize=8)


if __name__ == "__main__":
    main()
