"""Sweep tile tables of the compressed-branch kernels at one shape; prints median ms per variant.

    python bench/tune_tiles.py [--seqlen 65536] [geometry flags | --config FILE.yaml]

Used to fill `_TILES` / `_SELECT_TILES` in kernels/compressed.py (bf16, at the geometry of
bench/geometry.py, by default the spec's, and at fla's l = d = l' = 64, n = 16).
"""
import triton.testing

import geometry
from nsa_ops import reference
from nsa_ops.kernels import compressed as C
from bench_kernels import spec_inputs


def main():
    p = geometry.parser(__doc__)
    p.add_argument("--seqlen", type=int, default=65536)
    args, cfg = geometry.parse(p)
    T = args.seqlen
    q, k, v, do = spec_inputs(cfg, args.batch, T)
    scale = cfg.scale
    bench = lambda fn: triton.testing.do_bench(fn, warmup=3, rep=100, return_mode="median")
    base_tiles, base_select = dict(C._TILES), C._SELECT_TILES
    fla = (64, 64, 64, 16)
    for l, d, lp, n in dict.fromkeys(((cfg.block_len, cfg.block_stride, cfg.sel_block,
                                       cfg.num_sel), fla)):
        k_cmp, v_cmp = reference.compress_mean(k, l, d), reference.compress_mean(v, l, d)
        o, lse = C.compressed_attention_fwd(q, k_cmp, v_cmp, l, d, scale)
        for tile in ((128, 64, 8, 8, 2, None), (128, 64, 8, 8, 1, 128), (128, 32, 8, 8, 2, None),
                     (128, 32, 8, 8, 2, 128), (128, 32, 16, 8, 2, 128), (128, 32, 4, 8, 2, 128),
                     (64, 64, 8, 4, 2, None), (64, 64, 8, 4, 2, 128), (64, 64, 8, 4, 1, 128),
                     (64, 64, 16, 4, 2, 128), (64, 32, 8, 4, 2, 128)):
            # step_merges 0: a merge every step only where MERGE steps cannot gather
            C._SELECT_TILES = (((*tile, 0), (*tile, 0)),) + base_select[1:]
            try:
                ms = f"{bench(lambda: C.select_blocks(q, k_cmp, lse, l, d, lp, n, scale)):.2f} ms"
            except Exception as exc:  # out of shared memory / registers: report and go on
                ms = type(exc).__name__
            print(f"l={l} d={d} select (rows, SB, merge, warps, stages, maxnreg)={tile}: {ms}",
                  flush=True)
        C._SELECT_TILES = base_select
        for kind, variants in (("fwd", ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3))),
                               ("dq", ((128, 64, 8, 3), (64, 64, 8, 3), (128, 64, 8, 2),
                                       (64, 64, 4, 3))),
                               ("dkdv", ((64, 128, 8, 2), (64, 64, 8, 3), (64, 64, 8, 4),
                                         (128, 64, 8, 2)))):
            for variant in variants:
                C._TILES = {**base_tiles, kind: (variant,) + base_tiles[kind][1:]}
                fn = (lambda: C.compressed_attention_fwd(q, k_cmp, v_cmp, l, d, scale)) \
                    if kind == "fwd" else \
                    (lambda: C.compressed_attention_bwd(q, k_cmp, v_cmp, o, lse, do, None, l, d,
                                                        scale))
                try:
                    print(f"l={l} d={d} {kind} {variant}: {bench(fn):.2f} ms", flush=True)
                except Exception as exc:  # out of shared memory / registers: report and go on
                    print(f"l={l} d={d} {kind} {variant}: {type(exc).__name__}", flush=True)
            C._TILES = dict(base_tiles)


if __name__ == "__main__":
    main()
