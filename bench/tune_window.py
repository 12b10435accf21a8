"""Sweep the Triton sliding-window kernel's tiles at one shape against FA-2 (where it serves);
prints median ms.

    python bench/tune_window.py [--seqlen 65536] [--kernels fwd dq ...] [geometry flags |
                                --config FILE.yaml]

Used to fill `_GPU_TILES` in kernels/window.py (bf16, at the geometry of bench/geometry.py: by
default the spec's, D=128: the tier of 512-byte K + V rows). Each row replaces one of that
tier's TileConfigs (the forward, dQ and dK dV kernels, each with pointer loads and with TMA loads
(sm90+), and the dK dV kernel's own TMA tile for groups of W.WIDE_GROUP heads or more) and
times the pass it belongs to; a backward row with TMA loads has them in both of its kernels. A
dkdv_tma row leaves the wide-group tile out, so that it runs at any G.
"""
import torch
import triton.testing

import geometry
from nsa_ops.kernels import window as W
from bench_kernels import spec_inputs

SWEEP = {
    "fwd": ((128, 32, 4, 3), (128, 32, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3),
            (64, 64, 4, 3), (256, 32, 8, 3)),
    "fwd_tma": ((128, 64, 4, 2), (128, 32, 4, 4), (128, 32, 4, 3), (64, 64, 4, 3),
                (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (256, 64, 8, 3)),
    "dkdv": ((64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 1), (32, 64, 4, 2), (64, 32, 4, 2),
             (128, 64, 8, 2), (64, 64, 8, 2), (32, 128, 8, 3)),
    "dkdv_tma": ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 2), (128, 64, 8, 2),
                 (128, 64, 8, 3), (32, 64, 4, 2), (128, 32, 4, 2), (64, 128, 8, 2),
                 (64, 64, 8, 2)),
    # the transposed form (keys_as_rows) measured faster with TMA at G >= W.WIDE_GROUP only
    "dkdv_tma_wide": ((64, 128, 8, 3, True), (64, 64, 4, 3, True), (32, 128, 8, 3, True),
                      (64, 128, 8, 2, True), (64, 64, 4, 3, False)),
    "dq_tma": ((128, 32, 4, 3), (128, 64, 4, 2), (128, 32, 4, 4), (64, 64, 4, 3),
               (128, 64, 4, 3), (64, 32, 4, 3)),
    "dq": ((128, 32, 4, 3), (128, 32, 4, 2), (128, 32, 4, 4), (64, 32, 4, 3), (128, 64, 8, 2),
           (128, 16, 4, 3), (256, 32, 8, 2)),
}


def main():
    p = geometry.parser(__doc__)
    p.add_argument("--seqlen", type=int, default=65536)
    p.add_argument("--kernels", nargs="+", choices=list(SWEEP), default=list(SWEEP))
    args, geo = geometry.parse(p)
    T, w = args.seqlen, geo.window
    q, k, v, do = spec_inputs(geo, args.batch, T)
    scale = geo.scale
    bench = lambda fn: triton.testing.do_bench(fn, warmup=3, rep=100, return_mode="median")
    o, lse = W.sliding_window_fwd(q, k, v, w, scale)
    refusal = W.backend_refusal("aten_fa2", q, v)
    if refusal is None:
        fa2 = (bench(lambda: W.sliding_window_fwd(q, k, v, w, scale, backend="aten_fa2")),
               bench(lambda: W.sliding_window_bwd(q, k, v, o, lse, do, None, w, scale,
                                                  backend="aten_fa2")))
        print(f"T={T} w={w} aten_fa2: fwd {fa2[0]:.2f} ms, bwd {fa2[1]:.2f} ms", flush=True)
    else:
        print(f"T={T} w={w} aten_fa2 refuses: {refusal}", flush=True)
    tiles = list(W._GPU_TILES)
    kv_bytes = W._kv_bytes(torch.bfloat16, geo.head_dim_qk, geo.head_dim_v)
    tier = next(i for i, (limit, _) in enumerate(tiles) if kv_bytes <= limit)
    limit, tuned = tiles[tier]
    for kernel in args.kernels:
        for cfg in SWEEP[kernel]:
            swap = {kernel: W.TileConfig(*cfg)}
            if kernel == "dkdv_tma":
                swap["dkdv_tma_wide"] = None
            W._GPU_TILES = tuple(tiles[:tier]) + ((limit, tuned._replace(**swap)),) + \
                tuple(tiles[tier + 1:])
            forward, tma = kernel.startswith("fwd"), "_tma" in kernel
            fn = (lambda: W.sliding_window_fwd(q, k, v, w, scale, backend="triton", tma=tma)) \
                if forward else \
                (lambda: W.sliding_window_bwd(q, k, v, o, lse, do, None, w, scale,
                                              backend="triton", tma=tma))
            try:
                ms = f"{bench(fn):.2f} ms"
            except Exception as exc:  # out of shared memory / registers: report and go on
                ms = type(exc).__name__
            step = "forward" if forward else "backward"
            print(f"T={T} w={w} triton {kernel} {cfg}: {step} {ms}", flush=True)
        W._GPU_TILES = tuple(tiles)


if __name__ == "__main__":
    main()
