"""The one routing table: which implementation runs each op for given inputs, and why not others.

Rows are data. For each op, candidates are tried in table order; the first without a refusal
runs. A row refuses for two kinds of reasons, each a string (like xformers'
not_supported_reasons), printed by `python -m nsa_ops routing`:

* `refuse`: the implementation cannot serve the input (device, dtype, head size, missing package);
* `defer`: it could, but measurements say a later row is faster here (an SM the kernels are not
  tuned for, a sequence too short to fill the GPU). Forcing the impl (nsa_ops/env.py) lifts these.

Implementations are named by "module:function" so the table stays data and importing nsa_ops
never imports Triton. The Inductor lowering (nsa_ops.lowering) asks the same table.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from . import env

PREFILL_OPS = ("compressed_attention", "select_blocks", "selection_attention",
               "sliding_window_attention", "gate_combine")
# decode: NSA of the newest token(s) over an NSACache (nsa_ops.decode), not a torch op
OPS = PREFILL_OPS + ("decode",)


class DecodeGeometry(NamedTuple):
    """What the decode kernel's limits depend on besides the tensors: the cache's NSA geometry."""
    block_len: int
    block_stride: int
    sel_block: int
    capacity: int  # tokens the cache can hold


class CompressedGeometry(NamedTuple):
    """What the compressed-attention routes depend on besides the tensors."""
    block_len: int
    block_stride: int


@dataclass(frozen=True)
class Inputs:
    """What routing may look at: never tensor values, so choosing costs no device sync."""
    device_type: str
    sm: Optional[tuple[int, int]]
    dtype: torch.dtype
    head_dim_qk: int
    head_dim_v: int
    seqlen: int  # query rows per sequence: T for the prefill ops, Tq for decode
    varlen: bool = False
    decode: Optional[DecodeGeometry] = None
    compressed: Optional[CompressedGeometry] = None
    offset: bool = False  # queries at the end of longer keys (Tq < Tk, or cu_seqlens_k given)
    capturing: bool = False  # called inside CUDA-graph capture

    @staticmethod
    def of(q: torch.Tensor, v: torch.Tensor, cu_seqlens=None, offset: bool = False) -> "Inputs":
        cuda = q.device.type == "cuda"
        sm = torch.cuda.get_device_capability(q.device) if cuda else None
        return Inputs(q.device.type, sm, q.dtype, q.shape[-1], v.shape[-1], q.shape[1],
                      cu_seqlens is not None, offset=offset,
                      capturing=cuda and torch.cuda.is_current_stream_capturing())

    @staticmethod
    def of_compressed(q: torch.Tensor, v_cmp: torch.Tensor, block_len: int, block_stride: int,
                      cu_seqlens=None, offset: bool = False) -> "Inputs":
        return dataclasses.replace(Inputs.of(q, v_cmp, cu_seqlens, offset),
                                   compressed=CompressedGeometry(block_len, block_stride))

    @staticmethod
    def of_cache(q: torch.Tensor, cache) -> "Inputs":
        """Decode inputs: the query rows q [B,Tq,HQ,Dk] over an NSACache."""
        c = cache.config
        geometry = DecodeGeometry(c.block_len, c.block_stride, c.sel_block, cache.k.shape[1])
        return dataclasses.replace(Inputs.of(q, cache.v), decode=geometry)


Refusal = Callable[[Inputs], Optional[str]]


def _first(*checks: Refusal) -> Refusal:
    def refuse(x: Inputs) -> Optional[str]:
        for check in checks:
            reason = check(x)
            if reason:
                return reason
        return None
    return refuse


def _needs_cuda(x: Inputs) -> Optional[str]:
    if x.device_type != "cuda":
        return f"needs a CUDA device, inputs are on {x.device_type}"
    return None


def _needs_triton(x: Inputs) -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install nsa-ops[triton])"
    return None


def _needs_sm80(x: Inputs) -> Optional[str]:
    if x.sm is not None and x.sm < (8, 0):
        return f"needs sm80+ (Ampere or newer), device is sm{x.sm[0]}{x.sm[1]}"
    return None


def _needs_half_or_fp32(x: Inputs) -> Optional[str]:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"kernels take float16/bfloat16/float32, got {x.dtype} (float64 runs the reference)"
    return None


def _head_dims_upto(limit: int) -> Refusal:
    def refuse(x: Inputs) -> Optional[str]:
        if max(x.head_dim_qk, x.head_dim_v) > limit:
            return f"head dims must be <= {limit}, got Dk={x.head_dim_qk}, Dv={x.head_dim_v}"
        return None
    return refuse


def _half_only(kernel: str) -> Refusal:
    def refuse(x: Inputs) -> Optional[str]:
        if x.dtype not in (torch.float16, torch.bfloat16):
            return f"{kernel} takes float16/bfloat16 only, got {x.dtype}"
        return None
    return refuse


def _equal_head_dims(kernel: str) -> Refusal:
    def refuse(x: Inputs) -> Optional[str]:
        if x.head_dim_qk != x.head_dim_v:
            return f"{kernel} needs Dk == Dv, got Dk={x.head_dim_qk}, Dv={x.head_dim_v}"
        return None
    return refuse


def _importable(module: str) -> Refusal:
    def refuse(x: Inputs) -> Optional[str]:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not importable"
        return None
    return refuse


def _has_aten_fa2(x: Inputs) -> Optional[str]:
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no bundled FlashAttention-2 (USE_FLASH_ATTENTION off)"
    return None


def _head_dim_multiple_of_8(kernel: str) -> Refusal:
    def refuse(x: Inputs) -> Optional[str]:
        if x.head_dim_qk % 8:
            return f"{kernel} needs head dims divisible by 8, got {x.head_dim_qk}"
        return None
    return refuse


def _always(x: Inputs) -> Optional[str]:
    return None


def _no_offset(x: Inputs) -> Optional[str]:
    if x.offset:
        return ("queries at an offset (Tq < Tk, or cu_seqlens_k): this kernel aligns queries with "
                "their keys, the reference serves them")
    return None


# Selection blocks (padded to a power of two) whose scores one decode program keeps in registers:
# a cache capacity of at most 8192 * l' tokens (512k at l' = 64).
DECODE_MAX_SEL_BLOCKS = 8192


def _decode_kernel_serves(x: Inputs) -> Optional[str]:
    if x.seqlen != 1:
        return (f"the decode kernel takes one query row per sequence (Tq == 1), got "
                f"Tq={x.seqlen}; several tokens at once run the prefill ops at an offset")
    if x.decode is None:
        return "no cache geometry given (use Inputs.of_cache)"
    return decode_geometry_refusal(x.decode)


def _several_rows(x: Inputs) -> Optional[str]:
    if x.seqlen == 1:
        return "one query row: the decode kernel or the reference serve a single token"
    return None


def decode_geometry_refusal(geometry: DecodeGeometry) -> Optional[str]:
    """Why the decode kernel cannot serve a cache of this geometry, or None (the kernel's own
    argument check raises with the same reason)."""
    l, d, sel, capacity = geometry
    rpb = sel // d
    if rpb & (rpb - 1) or l > sel + d:
        return (f"the decode kernel needs l'/d a power of two and l <= l' + d (a compressed "
                f"block spans at most two selection blocks), got l={l}, d={d}, l'={sel}")
    blocks = max(16, 1 << (-(-capacity // sel) - 1).bit_length())
    if blocks > DECODE_MAX_SEL_BLOCKS:
        return (f"a cache of {capacity} tokens holds {blocks} selection blocks (padded), more "
                f"than the {DECODE_MAX_SEL_BLOCKS} one decode program keeps in registers")
    return None


# SMs the selection kernel is tuned for, each with the sequence length below which packed SDPA
# runs instead. From bench/bench_routing.py (forward; both rows share the Triton backward): on
# sm90 the kernel won at every length measured, T = 16 .. 8192 at B = 1 and 8, by 25-60x
# (bench/results/routing.csv), so the threshold is 0. sm80 and sm100 are unmeasured and take
# sm90's value.
TRITON_SELECTION_MIN_SEQLEN = {(8, 0): 0, (9, 0): 0, (10, 0): 0}


def _selection_kernel_preferred(x: Inputs) -> Optional[str]:
    if x.sm == (8, 9):
        return ("sm89 (Ada) runs packed SDPA by design: the kernels are tuned for the 164-228 KB "
                "of shared memory per SM of sm80/sm90/sm100, Ada has 100 KB (force to override)")
    if x.sm not in TRITON_SELECTION_MIN_SEQLEN:
        sm = f"sm{x.sm[0]}{x.sm[1]}" if x.sm else "an unknown SM"
        tuned = ", ".join(f"sm{a}{b}" for a, b in TRITON_SELECTION_MIN_SEQLEN)
        return f"tuned for {tuned}, not {sm}: packed SDPA serves it (force to override)"
    min_len = TRITON_SELECTION_MIN_SEQLEN[x.sm]
    if x.seqlen < min_len:
        return (f"T={x.seqlen} < {min_len}, the length from which the kernel beats packed SDPA "
                f"on sm{x.sm[0]}{x.sm[1]} (bench/results/routing.csv)")
    return None


def _residue_views_fit(x: Inputs) -> Optional[str]:
    """What nsa_ops.compressed_sdpa's strided views of q need."""
    if x.varlen:
        return "varlen input: the residue views need one fixed length"
    if x.compressed is None:
        return "no block_len/block_stride given (use Inputs.of_compressed)"
    d = x.compressed.block_stride
    if x.seqlen % d:
        return f"T={x.seqlen} is not a multiple of block_stride d={d} (the residue views need it)"
    return None


def _has_cudnn9(x: Inputs) -> Optional[str]:
    if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) < 90000:
        return "needs cuDNN >= 9 (torch's cuDNN attention)"
    return None


# Compressed attention runs through cuDNN from this many queries per residue (T / d) on. Measured
# with `bench/bench_kernels.py --seqlens 8192 16384 32768 65536 --kernels compressed` on an H200
# (bench/results/compressed_routing.csv), bwd ms Triton vs cuDNN: at T/d = 512 Triton wins for
# l=32, d=16 (0.96 vs 1.10) and l=d=64 (3.65 vs 3.97); at T/d = 1024 cuDNN does (2.97 vs 2.66,
# 11.66 vs 10.27) with forwards within 1%; at 4096 (64k, l=32, d=16) 37.6 vs 26.1.
CUDNN_COMPRESSED_MIN_ROWS = {(9, 0): 1024}


def _cudnn_compressed_preferred(x: Inputs) -> Optional[str]:
    if x.sm not in CUDNN_COMPRESSED_MIN_ROWS:
        sm = f"sm{x.sm[0]}{x.sm[1]}" if x.sm else "an unknown SM"
        return f"measured on sm90 only, not {sm}: the Triton kernel serves it (force to override)"
    rows, need = x.seqlen // x.compressed.block_stride, CUDNN_COMPRESSED_MIN_ROWS[x.sm]
    if rows < need:
        return (f"T/d = {rows} queries per residue < {need}, below which the Triton kernel is "
                f"faster (bench/results/compressed_routing.csv)")
    return None


_triton = _first(_needs_cuda, _needs_triton, _needs_sm80, _needs_half_or_fp32, _head_dims_upto(256))
_fa2_common = _first(_needs_cuda, _no_offset, _needs_sm80, _half_only("FlashAttention-2"),
                     _equal_head_dims("FlashAttention-2"), _head_dims_upto(256),
                     _head_dim_multiple_of_8("FlashAttention-2"))


def _not_capturing(x: Inputs) -> Optional[str]:
    if x.capturing:
        return ("inside CUDA-graph capture: a first cuDNN call builds its plan with a device "
                "allocation that capture forbids, the Triton kernel serves")
    return None


# head dims up to 128: the shapes measured
_cudnn_compressed = _first(_needs_cuda, _no_offset, _not_capturing, _needs_triton, _needs_sm80,
                           _half_only("cuDNN attention"),
                           _equal_head_dims("cuDNN attention"), _head_dims_upto(128),
                           _head_dim_multiple_of_8("cuDNN attention"), _residue_views_fit,
                           _has_cudnn9)


@dataclass(frozen=True)
class Route:
    op: str
    impl: str
    forward: str            # "module:function"
    backward: Optional[str]  # None for non-differentiable ops
    refuse: Refusal
    options: tuple[tuple[str, str], ...] = ()  # extra keyword arguments for forward/backward
    defer: Refusal = _always  # soft refusal: a later row is preferred, unless this impl is forced


_REF = "nsa_ops.reference"
_WIN_FWD = "nsa_ops.kernels.window:sliding_window_fwd"
_WIN_BWD = "nsa_ops.kernels.window:sliding_window_bwd"
TABLE: tuple[Route, ...] = (
    # with an lse gradient the cudnn row's backward runs the Triton backward (cuDNN has no dlse)
    Route("compressed_attention", "cudnn", "nsa_ops.compressed_sdpa:compressed_attention_fwd",
          "nsa_ops.compressed_sdpa:compressed_attention_bwd",
          _cudnn_compressed,
          defer=_cudnn_compressed_preferred),
    Route("compressed_attention", "triton", "nsa_ops.kernels.compressed:compressed_attention_fwd",
          "nsa_ops.kernels.compressed:compressed_attention_bwd", _triton),
    Route("compressed_attention", "reference", f"{_REF}:compressed_attention",
          f"{_REF}:compressed_attention_backward", _always),
    Route("select_blocks", "triton", "nsa_ops.kernels.compressed:select_blocks", None, _triton),
    Route("select_blocks", "reference", f"{_REF}:select_blocks", None, _always),
    Route("selection_attention", "triton", "nsa_ops.kernels.selection:selection_attention_fwd",
          "nsa_ops.kernels.selection:selection_attention_bwd", _triton,
          defer=_selection_kernel_preferred),
    # the backward reuses the Triton kernels, which serve every input this row serves
    Route("selection_attention", "packed_sdpa", "nsa_ops.packed:selection_attention_packed",
          "nsa_ops.kernels.selection:selection_attention_bwd", _first(_triton, _no_offset)),
    Route("selection_attention", "reference", f"{_REF}:selection_attention",
          f"{_REF}:selection_attention_backward", _always),
    Route("sliding_window_attention", "flash_attn", _WIN_FWD, _WIN_BWD,
          _first(_importable("flash_attn"), _fa2_common), (("backend", "flash_attn"),)),
    Route("sliding_window_attention", "aten_fa2", _WIN_FWD, _WIN_BWD,
          _first(_fa2_common, _has_aten_fa2), (("backend", "aten_fa2"),)),
    Route("sliding_window_attention", "triton", _WIN_FWD, _WIN_BWD, _triton,
          (("backend", "triton"),)),
    Route("sliding_window_attention", "reference", f"{_REF}:sliding_window_attention",
          f"{_REF}:sliding_window_attention_backward", _always),
    # eager only: under torch.compile nsa_attention leaves the gate to Inductor, which fuses it
    Route("gate_combine", "triton", "nsa_ops.kernels.gate:gate_combine_fwd",
          "nsa_ops.kernels.gate:gate_combine_bwd",
          _first(_needs_cuda, _needs_triton, _needs_sm80, _needs_half_or_fp32)),
    Route("gate_combine", "reference", f"{_REF}:gate_combine", f"{_REF}:gate_combine_backward",
          _always),
    Route("decode", "triton", "nsa_ops.kernels.decode:decode_attention_fwd", None,
          _first(_triton, _decode_kernel_serves)),
    # chunked prefill: the prefill ops (and their kernels) with queries at an offset
    Route("decode", "prefill_ops", "nsa_ops.decode:decode_chunk", None, _several_rows),
    Route("decode", "reference", "nsa_ops.decode:decode_reference", None, _always),
)


def candidates(op: str) -> list[Route]:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return [r for r in TABLE if r.op == op]


def route(op: str, impl: str) -> Route:
    for r in candidates(op):
        if r.impl == impl:
            return r
    raise ValueError(f"nsa.{op} has no impl {impl!r}; it has "
                     f"{', '.join(r.impl for r in candidates(op))}")


def explain(op: str, x: Inputs) -> list[tuple[str, Optional[str]]]:
    """(impl, refusal reason or None) for every candidate of op, in preference order."""
    forced = env.forced_impl(op)
    rows = []
    for r in candidates(op):
        reason = r.refuse(x)
        if reason is None and forced and r.impl != forced:
            reason = f"not the forced impl (NSA_OPS_FORCE_IMPL*={forced})"
        if reason is None and r.impl != forced:
            reason = r.defer(x)
        rows.append((r.impl, reason))
    return rows


def choose(op: str, x: Inputs) -> Route:
    rows = explain(op, x)
    for route, (_, reason) in zip(candidates(op), rows):
        if reason is None:
            return route
    raise ValueError(f"no implementation of nsa.{op} serves {x}: "
                     + "; ".join(f"{impl}: {reason}" for impl, reason in rows))


_resolved: dict[str, Callable] = {}


def resolve(target: str) -> Callable:
    fn = _resolved.get(target)
    if fn is None:
        module, name = target.split(":")
        fn = _resolved[target] = getattr(importlib.import_module(module), name)
    return fn


def describe(examples: Optional[list[Inputs]] = None) -> str:
    """The table and, for each example input, which impl runs and why the others do not."""
    lines = ["nsa_ops routing table (first candidate without a refusal runs):"]
    for op in OPS:
        lines.append(f"  {op}: " + " -> ".join(r.impl for r in candidates(op)))
    for x in examples or default_examples():
        sm = f"sm{x.sm[0]}{x.sm[1]}" if x.sm else "-"
        shape = (f"decode Tq={x.seqlen} cache {x.decode.capacity} tokens" if x.decode else
                 f"T={x.seqlen}" + (" varlen" if x.varlen else ""))
        lines.append(f"\n{x.device_type} {sm} {str(x.dtype).replace('torch.', '')} "
                     f"Dk={x.head_dim_qk} Dv={x.head_dim_v} {shape}")
        for op in ("decode",) if x.decode else PREFILL_OPS:
            chosen = choose(op, x).impl
            lines.append(f"  {op:26s} -> {chosen}")
            for impl, reason in explain(op, x):
                if reason:
                    lines.append(f"      {impl:11s} refused: {reason}")
    return "\n".join(lines)


def default_examples() -> list[Inputs]:
    bf16 = torch.bfloat16
    cmp = CompressedGeometry(32, 16)  # the spec's defaults
    examples = [Inputs("cpu", None, torch.float32, 128, 128, 4096, compressed=cmp)]
    if torch.cuda.is_available():
        examples.append(Inputs("cuda", torch.cuda.get_device_capability(), bf16, 128, 128, 65536,
                               compressed=cmp))
    spec = DecodeGeometry(32, 16, 64, 65536)
    examples += [Inputs("cuda", (9, 0), bf16, 128, 128, 65536, compressed=cmp),
                 Inputs("cuda", (9, 0), bf16, 128, 128, 512, compressed=cmp),
                 Inputs("cuda", (9, 0), bf16, 192, 128, 32768, compressed=cmp),
                 Inputs("cuda", (8, 9), bf16, 128, 128, 32768, compressed=cmp),
                 Inputs("cuda", (7, 5), torch.float16, 128, 128, 8192, compressed=cmp),
                 Inputs("cuda", (9, 0), bf16, 128, 128, 1, decode=spec),
                 Inputs("cuda", (9, 0), bf16, 128, 128, 4, decode=spec),
                 Inputs("cpu", None, torch.float32, 128, 128, 1, decode=spec)]
    return examples
