"""Compiles the Triton kernels an op launches for sm_90 through ptxas, on a machine without a GPU.

Run as a script without TRITON_INTERPRET (the tests start it in a subprocess):

    python tests/sm90_compile.py select L D SEL N T HQ H DK
        nsa_ops.kernels.compressed.select_blocks at that geometry (bf16)
    python tests/sm90_compile.py plans HQ H N
        the selection's shared-pass plan kernels (forward and dq, as eager sm90 launches with
        stored dS) at HQ / H query heads per KV head and n = N (bf16, D = 128, T = 2048, l' = 64);
        the branch's other kernels are not compiled
    python tests/sm90_compile.py routed DTYPE DK DV HQ H
        every Triton kernel the routed ops launch at those head dims on a GPU (pointer loads,
        the GPU tile tables; T = 2048, l=32, d=16, l'=64, n=16, w=512), decode over a cache of
        T tokens both ways (one launch and split-K), and the eager layer's mean pooling both
        ways at that dtype and float64; the window and selection kernels both with pointer
        loads and as an eager sm90 launch picks them (TMA descriptors and the selection's shared
        pass where their routes take them)

Each kernel's `launch(kernel)[grid](...)` is swapped for triton.compile of the same arguments
with the specialization Triton's JIT gives them on a GPU (16-byte aligned pointers and integers
divisible by 16 marked divisible, integers equal to 1 made constants): without it the compiler
pipelines fewer loads and reports less shared memory than the GPU asks (the compressed dq at
D = 256, (128, 64) tiles, 2 stages: 192 KB here unspecialized, 256 KB on an H100 and here
specialized). Prints one line per kernel: `compiled NAME OPTIONS smem BYTES`, and with SM90_SASS=1
after it `sass NAME narrow COUNT instructions COUNT sha HASH`: its 2-byte global loads and stores
(`narrow_accesses`), its SASS instructions and a hash of its SASS text (a refactor that claims
the same machine code shows it).
"""
import hashlib
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.disasm import get_sass
from triton.tools.tensor_descriptor import TensorDescriptor

TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
         torch.float64: "fp64", torch.int32: "i32", torch.int64: "i64"}


class CompileForSm90:
    """Stands in for `launch(kernel)[grid]`: compiles instead of running."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return self.compile

    def compile(self, *args, num_warps=4, num_stages=3, maxnreg=None, enable_fp_fusion=None,
                **constexprs):
        sig, attrs = {}, {}
        for i, (name, arg) in enumerate(zip(self.kernel.arg_names, args)):
            if isinstance(arg, TensorDescriptor):  # as Triton's JIT names a host descriptor
                sig[name] = f"tensordesc<{TYPES[arg.base.dtype]}{list(arg.block_shape)}>"
            elif isinstance(arg, torch.Tensor):
                sig[name] = "*" + TYPES[arg.dtype]
                if arg.data_ptr() % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif arg is None:
                sig[name], constexprs[name] = "constexpr", None
            elif isinstance(arg, float):
                sig[name] = "fp32"
            elif arg == 1 and i not in self.kernel.do_not_specialize:
                sig[name], constexprs[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -2**31 <= arg < 2**31 else "i64"
                if arg % 16 == 0 and i not in self.kernel.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        sig.update((name, "constexpr") for name in constexprs)
        options = dict(num_warps=num_warps, num_stages=num_stages)
        if maxnreg is not None:
            options["maxnreg"] = maxnreg
        if enable_fp_fusion is not None:
            options["enable_fp_fusion"] = enable_fp_fusion
        compiled = triton.compile(ASTSource(self.kernel, sig, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        print("compiled", self.kernel.__name__, options, "smem", compiled.metadata.shared,
              flush=True)
        if os.environ.get("SM90_SASS") == "1":
            sass = get_sass(compiled.asm["cubin"])
            print("sass", self.kernel.__name__, "narrow", narrow_accesses(sass), "instructions",
                  len(re.findall(r"^[^\t\n]+\t(?!NOP)", sass, flags=re.M)),
                  "sha", hashlib.sha256(sass.encode()).hexdigest()[:16], flush=True)


def narrow_accesses(sass: str) -> int:
    """2-byte global loads and stores in a kernel's SASS (Triton's cuobjdump of its cubin): a
    16-bit tile moved an element at a time, where a mask varying along its contiguous dimension
    keeps Triton from vectorizing (kernels/selection.py's dq from dS did, 16 a tile)."""
    return len(re.findall(r"\b(?:LDG|STG)\.E\.(?:U16|S16|16)\b", sass))


def select(l, d, sel, n, T, HQ, H, D):
    from nsa_ops.kernels import compressed
    compressed.launch = CompileForSm90
    q = torch.randn(1, T, HQ, D, dtype=torch.bfloat16)
    k_cmp = torch.randn(1, (T - l) // d + 1, H, D, dtype=torch.bfloat16)
    compressed.select_blocks(q, k_cmp, torch.randn(1, T, HQ), l, d, sel, n, D ** -0.5)


class _PlansOnly(CompileForSm90):
    def compile(self, *args, **kwargs):
        if self.kernel.__name__ in ("_shared_plan_kernel", "_dq_plan_kernel"):
            super().compile(*args, **kwargs)


def _inputs(dt, dk, dv, HQ, H, T, sel, n):
    """Random q, k, v, o, lse, do of one sequence of T tokens and a block_idx of n blocks of sel
    keys a query."""
    from nsa_ops import reference
    q, do = (torch.randn(1, T, HQ, dim, dtype=dt) for dim in (dk, dv))
    k, v = (torch.randn(1, T, H, dim, dtype=dt) for dim in (dk, dv))
    o, lse = torch.randn(1, T, HQ, dv, dtype=dt), torch.randn(1, T, HQ)
    block_idx = reference.topn_blocks(torch.rand(1, T, H, T // sel), torch.arange(T), sel, n)
    return q, k, v, o, lse, do, block_idx


def plans(HQ, H, n):
    from nsa_ops.kernels import delta, index, selection, utils
    for module in (selection, delta, index):
        module.launch = _PlansOnly
    utils.tma_engine = lambda x: True
    sel, D = 64, 128
    q, k, v, o, lse, do, block_idx = _inputs(torch.bfloat16, D, D, HQ, H, 2048, sel, n)
    selection.selection_attention_fwd(q, k, v, block_idx, sel, D ** -0.5)
    selection.selection_attention_bwd(q, k, v, o, lse, do, None, block_idx, sel, D ** -0.5,
                                      stored_ds=True)


def routed(dtype, dk, dv, HQ, H):
    from nsa_ops.kernels import compressed, decode, delta, index, pooling, selection, utils, window
    for module in (window, compressed, selection, delta, index, pooling):
        module.launch = CompileForSm90
    cpu_tiles = window._tile_config
    window._tile_config = lambda kernel, kv_bytes, on_gpu: cpu_tiles(kernel, kv_bytes, True)
    T, l, d, sel, n, w, scale = 2048, 32, 16, 64, 16, 512, dk ** -0.5
    dt = getattr(torch, dtype)
    q, k, v, o, lse, do, block_idx = _inputs(dt, dk, dv, HQ, H, T, sel, n)
    # pointer loads, then as an eager launch on an sm90 GPU picks (tma=None: TMA descriptors and
    # the selection forward's shared pass where their routes allow)
    for engine in (False, True):
        utils.tma_engine = lambda x, engine=engine: engine
        window._triton_fwd(q, k, v, w, scale, None, tma=None)
        window._triton_bwd(q, k, v, o, lse, do, None, w, scale, None, tma=None)
        selection.selection_attention_fwd(q, k, v, block_idx, sel, scale)
    k_cmp, v_cmp = (x[:, :(T - l) // d + 1].contiguous() for x in (k, v))
    compressed.compressed_attention_fwd(q, k_cmp, v_cmp, l, d, scale)
    compressed.compressed_attention_bwd(q, k_cmp, v_cmp, o, lse, do, None, l, d, scale)
    compressed.select_blocks(q, k_cmp, lse, l, d, sel, n, scale)
    for stored_ds in (True, False):  # dq from the stored dS, or worked out again
        selection.selection_attention_bwd(q, k, v, o, lse, do, None, block_idx, sel, scale,
                                          stored_ds=stored_ds)
    # nsa_attention's eager layer pools k and v on a GPU, float64 layers' too
    for x in (k, k.double()):
        pooling.mean_pool(x, l, d)
        pooling.add_mean_pool_backward(x, x[:, :T // d + 2], l, d, x)
    # decode launches its kernels directly, over a cache of T tokens for 2 sequences
    for name in ("_fused_kernel", "_partials_kernel", "_select_kernel", "_combine_kernel"):
        setattr(decode, name, CompileForSm90(getattr(decode, name)))
    cache_k, cache_v = (x.expand(2, -1, -1, -1).contiguous() for x in (k, v))
    cmp_k, cmp_v = (x.expand(2, -1, -1, -1).contiguous() for x in (k_cmp, v_cmp))
    gates = [torch.rand(2, 1, HQ, dtype=dt) for _ in range(3)]
    for fused in (True, False):
        decode.nsa_decode(q[:1, :1].expand(2, -1, -1, -1).contiguous(), cache_k, cache_v, cmp_k,
                          cmp_v, torch.tensor([T]), *gates, block_len=l, block_stride=d,
                          sel_block=sel, num_sel=n, window=w, scale=scale, fused=fused)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "select":
        select(*map(int, rest))
    elif mode == "plans":
        plans(*map(int, rest))
    else:
        routed(rest[0], *map(int, rest[1:]))
