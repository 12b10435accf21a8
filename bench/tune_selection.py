"""Sweep the launch configs of the selection forward and dq kernels at one shape; prints median ms.

    python bench/tune_selection.py [--seqlen 65536] [--kernels fwd_tma dq dq_ds]
        [--key-tiles 32 64] [--dtype float32] [geometry flags | --config FILE.yaml]

Used to pick `_PER_TOKEN_PICK` in kernels/selection.py among `PER_TOKEN_CONFIGS` (pointer loads)
and `TMA_CONFIGS` (the forward's TMA loads, sm90+), the key tiles of `_key_tile_size`
(--key-tiles: each kernel also at these tiles; default its own), then
`_SHARED_PICK` among `SHARED_CONFIGS` at 64 and 128 `SHARED_ROWS` (the forward's shared pass,
sm90+) (bf16, the selection bench_kernels.py times, at the geometry of bench/geometry.py, by
default the spec's). The backward is timed whole (dq, then dk/dv at its fixed config; "dq_ds":
dk/dv storing dS, then dq from it), so dq rows differ by the dq kernel alone.
--dtype float32 sweeps fp32's own picks (`fwd_fp32`, `dq_fp32`, `dq_ds_fp32`; the rest as in
bf16), with the shared passes off as fp32 runs them (`_cuda_core_default`), so there is no shared
sweep.
Wide heads (padded Dk + Dv over 256, `_wide`) sweep their own picks where the table has one
(`fwd_wide`).
"""
import contextlib

import torch
import triton.testing
from triton.runtime.errors import PTXASError

import geometry
from nsa_ops.kernels import selection as S
from nsa_ops.kernels.utils import pow2
from bench_kernels import random_selection, spec_inputs

KERNELS = ("fwd", "fwd_tma", "dq", "dq_ds", "shared")


@contextlib.contextmanager
def key_tile(kernel: str, keys):
    """`_key_tile_size` answers `keys` for this kernel ("fwd", "fwd_tma", "dq", "dq_ds"; None:
    unchanged)."""
    own = S._key_tile_size
    if keys is not None:
        S._key_tile_size = lambda k, sel, dkp, dvp: (S._key_tile(sel, keys) if k == kernel
                                                     else own(k, sel, dkp, dvp))
    try:
        yield
    finally:
        S._key_tile_size = own


def main():
    p = geometry.parser(__doc__)
    p.add_argument("--seqlen", type=int, default=65536)
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=KERNELS)
    p.add_argument("--key-tiles", nargs="+", type=int, default=[None])
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args, geo = geometry.parse(p)
    T, lp = args.seqlen, geo.sel_block
    fp32 = args.dtype == "float32"
    q, k, v, do = (x.to(getattr(torch, args.dtype)) for x in spec_inputs(geo, args.batch, T))
    idx = random_selection(T, geo.num_sel, lp, geo.num_kv_heads, args.batch, "cuda")
    scale = geo.scale
    wide = S._wide(pow2(geo.head_dim_qk, 16), pow2(geo.head_dim_v, 16))
    o, lse = S.selection_attention_fwd(q, k, v, idx, lp, scale)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=3, rep=100, return_mode="median")
    fwd = lambda tma: lambda: S.selection_attention_fwd(q, k, v, idx, lp, scale, tma=tma)
    fwd_unshared = lambda: S.selection_attention_fwd(q, k, v, idx, lp, scale, tma=True,
                                                     shared=False)
    picked = dict(S._PER_TOKEN_PICK)
    shared_rows, shared_pick = S.SHARED_ROWS, S._SHARED_PICK
    bwd = lambda stored_ds: lambda: S.selection_attention_bwd(q, k, v, o, lse, do, None, idx, lp,
                                                              scale, stored_ds=stored_ds)
    sweeps = {"fwd": (fwd(False), S.PER_TOKEN_CONFIGS), "fwd_tma": (fwd(True), S.TMA_CONFIGS),
              "dq": (bwd(False), S.PER_TOKEN_CONFIGS),
              "dq_ds": (bwd(True), S.PER_TOKEN_CONFIGS)}
    for kernel in (name for name in args.kernels if name in sweeps):
        fn, configs = sweeps[kernel]
        for keys in args.key_tiles:
            with key_tile(kernel, keys):
                for cfg in configs:
                    S._PER_TOKEN_PICK = {**picked, S._pick_name(kernel, q.dtype, wide): cfg}
                    print(f"T={T} {kernel} keys={keys or 'own'} (num_warps, num_stages)={cfg}: "
                          f"{bench(fn):.2f} ms", flush=True)
        S._PER_TOKEN_PICK = picked
    if "shared" not in args.kernels or fp32:
        return
    print(f"T={T} fwd_tma without the shared pass: {bench(fwd_unshared):.2f} ms", flush=True)
    for rows in (64, 128):
        S.SHARED_ROWS = rows
        for cfg in S.SHARED_CONFIGS:
            S._SHARED_PICK = {**shared_pick, "wide" if wide else "narrow": cfg}
            label = f"T={T} shared pass rows={rows} (num_warps, num_stages, maxnreg)={cfg}"
            try:
                print(f"{label}: {bench(fwd(True)):.2f} ms", flush=True)
            except PTXASError:  # a register cap too low for these rows' tiles
                print(f"{label}: ptxas refused it", flush=True)
    S.SHARED_ROWS, S._SHARED_PICK = shared_rows, shared_pick


if __name__ == "__main__":
    main()
