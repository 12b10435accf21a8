"""Sweep the launch configs of the selection forward and dq kernels at one shape; prints median ms.

    python bench/tune_selection.py [--seqlen 65536] [geometry flags | --config FILE.yaml]

Used to pick `_PER_TOKEN_PICK` in kernels/selection.py among `PER_TOKEN_CONFIGS` (pointer loads)
and `TMA_CONFIGS` (the forward's TMA loads, sm90+), then `_SHARED_PICK` among `SHARED_CONFIGS`
at 64 and 128 `SHARED_ROWS` (the forward's shared pass, sm90+) (bf16, the
selection bench_kernels.py times, at the geometry of bench/geometry.py, by default the spec's).
The backward is timed whole (dq, then dk/dv at its fixed config), so dq rows differ by the dq
kernel alone.
"""
import triton.testing

import geometry
from nsa_ops.kernels import selection as S
from bench_kernels import random_selection, spec_inputs


def main():
    p = geometry.parser(__doc__)
    p.add_argument("--seqlen", type=int, default=65536)
    args, geo = geometry.parse(p)
    T, lp = args.seqlen, geo.sel_block
    q, k, v, do = spec_inputs(geo, args.batch, T)
    idx = random_selection(T, geo.num_sel, lp, geo.num_kv_heads, args.batch, "cuda")
    scale = geo.scale
    o, lse = S.selection_attention_fwd(q, k, v, idx, lp, scale)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=3, rep=100, return_mode="median")
    fwd = lambda tma: lambda: S.selection_attention_fwd(q, k, v, idx, lp, scale, tma=tma)
    fwd_unshared = lambda: S.selection_attention_fwd(q, k, v, idx, lp, scale, tma=True,
                                                     shared=False)
    picked = dict(S._PER_TOKEN_PICK)
    shared_rows, shared_pick = S.SHARED_ROWS, S._SHARED_PICK
    for kernel, fn, configs in (
            ("fwd", fwd(False), S.PER_TOKEN_CONFIGS), ("fwd_tma", fwd(True), S.TMA_CONFIGS),
            ("dq", lambda: S.selection_attention_bwd(q, k, v, o, lse, do, None, idx, lp, scale),
             S.PER_TOKEN_CONFIGS)):
        for cfg in configs:
            S._PER_TOKEN_PICK = {**picked, kernel: cfg}
            print(f"T={T} {kernel} (num_warps, num_stages)={cfg}: {bench(fn):.2f} ms", flush=True)
        S._PER_TOKEN_PICK = picked
    print(f"T={T} fwd_tma without the shared pass: {bench(fwd_unshared):.2f} ms", flush=True)
    for rows in (64, 128):
        S.SHARED_ROWS = rows
        for cfg in S.SHARED_CONFIGS:
            S._SHARED_PICK = cfg
            print(f"T={T} shared pass rows={rows} (num_warps, num_stages)={cfg}: "
                  f"{bench(fwd(True)):.2f} ms", flush=True)
    S.SHARED_ROWS, S._SHARED_PICK = shared_rows, shared_pick


if __name__ == "__main__":
    main()
