"""Sweep the launch configs of the selection forward and dq kernels at one shape; prints median ms.

    python bench/tune_selection.py [--seqlen 65536]

Used to pick `_PER_TOKEN_PICK` in kernels/selection.py among `PER_TOKEN_CONFIGS` (B=1, HQ=64,
H=4, D=128, n=16, l'=64, bf16, the selection bench_kernels.py times). The backward is timed whole
(dq, then dk/dv at its fixed config), so dq rows differ by the dq kernel alone.
"""
import argparse

import triton.testing

from nsa_ops.kernels import selection as S
from bench_kernels import D, random_selection, spec_inputs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=65536)
    T = p.parse_args().seqlen
    q, k, v, do = spec_inputs(T)
    idx = random_selection(T, 16, 64, "cuda")
    scale = D ** -0.5
    o, lse = S.selection_attention_fwd(q, k, v, idx, 64, scale)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=3, rep=100, return_mode="median")
    picked = dict(S._PER_TOKEN_PICK)
    for kernel, fn in (("fwd", lambda: S.selection_attention_fwd(q, k, v, idx, 64, scale)),
                       ("dq", lambda: S.selection_attention_bwd(q, k, v, o, lse, do, None, idx,
                                                                64, scale))):
        for cfg in S.PER_TOKEN_CONFIGS:
            S._PER_TOKEN_PICK = {**picked, kernel: cfg}
            print(f"T={T} {kernel} (num_warps, num_stages)={cfg}: {bench(fn):.2f} ms", flush=True)
        S._PER_TOKEN_PICK = picked


if __name__ == "__main__":
    main()
