"""python -m nsa_ops [demo|routing|check-config FILE|inspect [FILE]]: a short CPU/GPU demo, the
routing table, a YAML NSAConfig validated and summarised (exit code 1 if it is invalid), or the
heatmaps of what a layer attends to (nsa_ops.heatmaps: FILE's config, --layer its saved
state_dict, random input of --seqlen tokens, PNG into --out). A forced impl that
cannot serve, or a bad routing file (NSA_OPS_ROUTING), is a one-line error and exit code 2."""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch
import yaml

from . import NSAConfig, env, nsa_attention, reference, routing
from .routing import Inputs

# The shape the CPU demo runs the Triton kernels at: each kernel program is Python in the
# interpreter, so forward + backward take seconds even this small (l=16, d=8, l'=16 keep every
# branch non-trivial at T=64).
INTERPRETED = dict(T=64, heads_q=4, heads_kv=1, head_dim=32)
INTERPRETED_CFG = dict(block_len=16, block_stride=8, sel_block=16, num_sel=3, window=32)


def _inputs(T: int, heads_q: int, heads_kv: int, head_dim: int, device: str, dtype):
    torch.manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    q, k, v = make(1, T, heads_q, head_dim), make(1, T, heads_kv, head_dim), \
        make(1, T, heads_kv, head_dim)
    gates = [torch.rand(1, T, heads_q, device=device, dtype=dtype) for _ in range(3)]
    do = torch.randn(1, T, heads_q, head_dim, device=device, dtype=dtype)
    return q, k, v, gates, do


def _step(q, k, v, gates, do, cfg) -> list[torch.Tensor]:
    """Forward and backward through torch.ops.nsa.*: [out, dq, dk, dv]."""
    q.grad = k.grad = v.grad = None
    out = nsa_attention(q, k, v, *gates, **cfg)
    out.backward(do)
    if q.is_cuda:
        torch.cuda.synchronize()
    return [out.detach(), q.grad, k.grad, v.grad]


def _routed(q, v, cfg) -> str:
    """Which implementation runs each op for these inputs (under any force() in effect), one line
    per op; the impls, joined."""
    x = Inputs.of_compressed(q, v, cfg["block_len"], cfg["block_stride"])
    impls = {op: routing.choose(op, x).impl for op in routing.PREFILL_OPS}
    for op, impl in impls.items():
        print(f"  torch.ops.nsa.{op:26s} runs {impl}")
    return "/".join(dict.fromkeys(impls.values()))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _describe(T, heads_q, heads_kv, head_dim, cfg) -> str:
    return (f"B=1 T={T} HQ={heads_q} H={heads_kv} D={head_dim}, "
            + ", ".join(f"{k}={v}" for k, v in cfg.items()))


def demo(T: int = 1024, heads_q: int = 8, heads_kv: int = 2, head_dim: int = 64) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    has_triton = importlib.util.find_spec("triton") is not None
    if device == "cpu" and has_triton:
        env.interpret_triton()  # before nsa_ops.kernels imports triton
    # bf16 is what the GPU kernels are built for; the CPU reference runs float32
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = dict(block_len=32, block_stride=16, sel_block=64, num_sel=16, window=512)
    print(f"NSA demo on {device} ({str(dtype).replace('torch.', '')}): "
          f"{_describe(T, heads_q, heads_kv, head_dim, cfg)}")
    q, k, v, gates, do = _inputs(T, heads_q, heads_kv, head_dim, device, dtype)
    impls = _routed(q, v, cfg)

    start = time.perf_counter()
    _step(q, k, v, gates, do, cfg)  # first call compiles the Triton kernels on GPU
    first = time.perf_counter() - start
    start = time.perf_counter()
    o, dq, dk, _ = _step(q, k, v, gates, do, cfg)
    elapsed = time.perf_counter() - start
    print(f"  forward + backward through torch.ops.nsa.*: {elapsed * 1e3:.0f} ms "
          f"(first call {first * 1e3:.0f} ms), out {tuple(o.shape)}, "
          f"|dq|={dq.norm():.3f} |dk|={dk.norm():.3f}")
    n_cmp = reference.num_cmp(T, cfg["block_len"], cfg["block_stride"])
    reads = n_cmp + cfg["num_sel"] * cfg["sel_block"] + min(cfg["window"], T)
    print(f"  per-query key budget at T={T}: reads(T) = num_cmp + n*l' + min(w, T) = "
          f"{n_cmp} + {cfg['num_sel'] * cfg['sel_block']} + {min(cfg['window'], T)} = {reads}"
          f" (dense reads {T}; NSA wins once T >> {reads})")

    if device == "cuda" or not has_triton:
        if not has_triton:
            print("  triton is not installed (pip install nsa-ops[triton]): on CPU only the "
                  "reference runs, so it is checked in float32 against float64")
        with torch.no_grad():
            ref = reference.nsa(*(t.double() for t in (q, k, v, *gates)), **cfg)
        print(f"  {impls} (torch.ops.nsa.*, {str(dtype).replace('torch.', '')}) matches "
              f"nsa_ops.reference.nsa in float64: rel err out {_rel_err(o, ref):.1e}")
        return
    print(f"Triton kernels on CPU (Triton's interpreter, TRITON_INTERPRET=1, "
          f"routing.force(\"triton\")): {_describe(**INTERPRETED, cfg=INTERPRETED_CFG)}")
    small = _inputs(**INTERPRETED, device="cpu", dtype=torch.float32)
    want = _step(*small, INTERPRETED_CFG)
    with routing.force("triton"):
        kernels = _routed(small[0], small[2], INTERPRETED_CFG)
        start = time.perf_counter()
        got = _step(*small, INTERPRETED_CFG)
    print(f"  forward + backward in the interpreter: {time.perf_counter() - start:.1f} s")
    errs = ", ".join(f"{name} {_rel_err(a, b):.1e}"
                     for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True))
    print(f"  {kernels} matches reference (torch.ops.nsa.* as routed on CPU, float32): rel err "
          f"{errs}")


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


# the layer `inspect` draws without a config file: small enough for a CPU, several blocks deep
INSPECT_CFG = NSAConfig(hidden_size=64, num_heads=4, num_kv_heads=1, head_dim_qk=16,
                        head_dim_v=16, block_len=16, block_stride=8, sel_block=16, num_sel=4,
                        window=32)


def inspect(config_file, layer_file, seqlen: int, head: int, out: str) -> int:
    from . import NSAAttention, heatmaps
    config = NSAConfig.from_yaml(config_file) if config_file else INSPECT_CFG
    torch.manual_seed(0)
    layer = NSAAttention(config)
    if layer_file:
        layer.load_state_dict(torch.load(layer_file, map_location="cpu"))
    path = heatmaps.draw(layer, torch.randn(1, seqlen, config.hidden_size), f"{out}/inspect.png",
                         head)
    print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nsa_ops", description=__doc__)
    parser.add_argument("command", nargs="?", default="demo",
                        choices=["demo", "routing", "check-config", "inspect"])
    parser.add_argument("file", nargs="?", help="YAML NSAConfig (check-config, inspect)")
    parser.add_argument("--seqlen", type=int, default=None,
                        help="tokens (demo: 1024, inspect: 256)")
    parser.add_argument("--layer", help="inspect: a saved NSAAttention state_dict")
    parser.add_argument("--head", type=int, default=0, help="inspect: the query head drawn")
    parser.add_argument("--out", default=".", help="inspect: directory for inspect.png")
    args = parser.parse_args(argv)
    if args.command == "inspect":
        return inspect(args.file, args.layer, args.seqlen or 256, args.head, args.out)
    if args.command == "check-config":
        if args.file is None:
            parser.error("check-config needs a FILE")
        return check_config(args.file)
    if args.file is not None:
        parser.error(f"{args.command} takes no FILE")
    try:
        if args.command == "routing":
            print(routing.describe())
        else:
            demo(T=args.seqlen or 1024)
    except ValueError as e:  # a forced impl that cannot serve, a bad routing file
        brief = e.brief if isinstance(e, routing.RoutingError) else e
        print(f"python -m nsa_ops {args.command}: {brief}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
