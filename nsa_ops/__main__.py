"""python -m nsa_ops [demo|routing|check-config FILE]: a short CPU/GPU demo, the routing table,
or a YAML NSAConfig validated and summarised (exit code 1 if it is invalid)."""
from __future__ import annotations

import argparse
import sys
import time

import torch
import yaml

from . import NSAConfig, nsa_attention, reference, routing
from .routing import Inputs


def demo(T: int = 1024, heads_q: int = 8, heads_kv: int = 2, head_dim: int = 64) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # bf16 is what the GPU kernels are built for; the CPU reference runs float32
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = dict(block_len=32, block_stride=16, sel_block=64, num_sel=16, window=512)
    print(f"NSA demo on {device} ({str(dtype).replace('torch.', '')}): B=1 T={T} HQ={heads_q} "
          f"H={heads_kv} D={head_dim}, " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    q, k, v = make(1, T, heads_q, head_dim), make(1, T, heads_kv, head_dim), \
        make(1, T, heads_kv, head_dim)
    gates = [torch.rand(1, T, heads_q, device=device, dtype=dtype) for _ in range(3)]
    do = torch.randn(1, T, heads_q, head_dim, device=device, dtype=dtype)

    x = Inputs.of_compressed(q, v, cfg["block_len"], cfg["block_stride"])
    for op in routing.PREFILL_OPS:
        print(f"  torch.ops.nsa.{op:26s} runs {routing.choose(op, x).impl}")

    def step():
        q.grad = k.grad = v.grad = None
        out = nsa_attention(q, k, v, *gates, **cfg)
        out.backward(do)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    start = time.perf_counter()
    step()  # first call compiles and autotunes the Triton kernels on GPU
    first = time.perf_counter() - start
    start = time.perf_counter()
    o = step()
    elapsed = time.perf_counter() - start
    print(f"  forward + backward through torch.ops.nsa.*: {elapsed * 1e3:.0f} ms "
          f"(first call {first * 1e3:.0f} ms), out {tuple(o.shape)}, "
          f"|dq|={q.grad.norm():.3f} |dk|={k.grad.norm():.3f}")

    with torch.no_grad():
        ref = reference.nsa(*(t.float() for t in (q, k, v, *gates)), **cfg)
    err = ((o - ref).norm() / ref.norm()).item()
    print(f"  matches the pure-PyTorch reference: rel err {err:.2e}")

    n_cmp = reference.num_cmp(T, cfg["block_len"], cfg["block_stride"])
    reads = n_cmp + cfg["num_sel"] * cfg["sel_block"] + min(cfg["window"], T)
    print(f"  per-query key budget at T={T}: reads(T) = num_cmp + n*l' + min(w, T) = "
          f"{n_cmp} + {cfg['num_sel'] * cfg['sel_block']} + {min(cfg['window'], T)} = {reads}"
          f" (dense reads {T}; NSA wins once T >> {reads})")


def check_config(path: str) -> int:
    try:
        config = NSAConfig.from_yaml(path)
    except (OSError, yaml.YAMLError, ValueError) as e:
        print(f"{path}: invalid NSA config: {e}", file=sys.stderr)
        return 1
    print(f"{path}: valid NSA config")
    print(config.to_yaml(), end="")
    c = config
    print(f"derived: G = HQ/H = {c.group}, scale = Dk^-0.5 = {c.scale:.6g}")
    print("per-query reads(S) = num_cmp(S) + n*l' + min(w, S):")
    for S in sorted({c.block_len, c.window, 4096, 32768, 131072}):
        print(f"  S={S:>7}: {c.num_cmp(S)} + {c.num_sel * c.sel_block} + {min(c.window, S)} = "
              f"{c.reads(S)} (dense: {S})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nsa_ops", description=__doc__)
    parser.add_argument("command", nargs="?", default="demo",
                        choices=["demo", "routing", "check-config"])
    parser.add_argument("file", nargs="?", help="YAML NSAConfig (check-config)")
    parser.add_argument("--seqlen", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.command == "check-config":
        if args.file is None:
            parser.error("check-config needs a FILE")
        return check_config(args.file)
    if args.file is not None:
        parser.error(f"{args.command} takes no FILE")
    if args.command == "routing":
        print(routing.describe())
    else:
        demo(T=args.seqlen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
