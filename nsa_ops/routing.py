"""The one routing table: which implementation runs each op for given inputs, and why not others.

Rows are data. For each op, candidates are tried in table order; the first without a refusal
runs. A row refuses for two kinds of reasons, each a string (like xformers'
not_supported_reasons), printed by `python -m nsa_ops routing`:

* `refuse`: the implementation cannot serve the input (device, dtype, head size, missing package);
* `defer`: it could, but measurements say a later row is faster here (an SM the kernels are not
  tuned for, a sequence too short to fill the GPU). Forcing the impl lifts these: `force()` in
  code, or NSA_OPS_FORCE_IMPL[_<OP>] (nsa_ops/env.py), which force() overrides.

The measured numbers the `defer` rules compare against (THRESHOLDS, per SM) can be replaced from a
YAML file: NSA_OPS_ROUTING=file.yaml, or `load(path)`; bench/bench_routing.py --write writes one.

Implementations are named by "module:function" so the table stays data and importing nsa_ops
never imports Triton. The Inductor lowering (nsa_ops.lowering) asks the same table.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.util
import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, NamedTuple, Optional, Union

import torch
import yaml

from . import compressed_sdpa, env
from .kernels.utils import device_capability

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
    # query rows per sequence: T for the prefill ops, Tq for decode; None when symbolic (a
    # dynamic-length trace: AOTInductor decomposing the ops), where no row may depend on it
    seqlen: Optional[int]
    varlen: bool = False
    decode: Optional[DecodeGeometry] = None
    compressed: Optional[CompressedGeometry] = None
    offset: bool = False  # queries at the end of longer keys (Tq < Tk, or cu_seqlens_k given)
    capturing: bool = False  # called inside CUDA-graph capture
    deterministic: bool = False  # torch.use_deterministic_algorithms(True)
    # a backward op asks: each direction is routed on its own (as xformers dispatches its forward
    # and backward ops), so a backward may run another row than its forward did
    backward: bool = False
    # inside capture, compressed inputs only: an eager call on this thread built cuDNN's plans
    # for their layout (nsa_ops.compressed_sdpa.plans_built)
    cudnn_planned: bool = False

    @staticmethod
    def of(q: torch.Tensor, v: torch.Tensor, cu_seqlens=None, offset: bool = False,
           backward: bool = False, *, dtype: Optional[torch.dtype] = None,
           decode: Optional[DecodeGeometry] = None,
           compressed: Optional[CompressedGeometry] = None) -> "Inputs":
        """The inputs q, v (dtype: q's unless given) describe; the keywords as the fields.
        Built in one call: each op call routes, and dataclasses.replace costs 7 us a copy."""
        device = q.device  # not q.is_cuda: a FakeTensor's own device is "meta"
        cuda = device.type == "cuda"
        T = q.shape[1]
        return Inputs(device.type, device_capability(device) if cuda else None,
                      q.dtype if dtype is None else dtype, q.shape[-1], v.shape[-1],
                      T if isinstance(T, int) else T.node.maybe_as_int(),
                      cu_seqlens is not None, decode, compressed, offset,
                      cuda and torch.cuda.is_current_stream_capturing(),
                      torch.are_deterministic_algorithms_enabled(), backward)

    @staticmethod
    def of_compressed(q: torch.Tensor, v_cmp: torch.Tensor, block_len: int, block_stride: int,
                      cu_seqlens=None, offset: bool = False, backward: bool = False
                      ) -> "Inputs":
        x = Inputs.of(q, v_cmp, cu_seqlens, offset, backward,
                      compressed=CompressedGeometry(block_len, block_stride))
        if x.capturing and compressed_sdpa.plans_built(q, v_cmp, block_len, block_stride,
                                                       backward):
            return dataclasses.replace(x, cudnn_planned=True)
        return x

    @staticmethod
    def of_cache(q: torch.Tensor, cache) -> "Inputs":
        """Decode inputs: the query rows q [B,Tq,HQ,Dk] over an NSACache."""
        c = cache.config
        geometry = DecodeGeometry(c.block_len, c.block_stride, c.sel_block, cache.k.shape[1])
        return Inputs.of(q, cache.v, decode=geometry)

    def summary(self) -> str:
        """One line: everything routing looks at."""
        sm = f" {_sm_name(self.sm)}" if self.sm else ""
        parts = [f"{self.device_type}{sm}", str(self.dtype).replace("torch.", ""),
                 f"Dk={self.head_dim_qk} Dv={self.head_dim_v}"]
        if self.decode:
            l, d, sel, capacity = self.decode
            parts.append(f"decode Tq={self.seqlen} l={l} d={d} l'={sel} cache {capacity} tokens")
        else:
            parts.append("T symbolic" if self.seqlen is None else f"T={self.seqlen}")
        if self.compressed:
            parts.append(f"l={self.compressed.block_len} d={self.compressed.block_stride}")
        flags = (("varlen", self.varlen), ("queries at an offset", self.offset),
                 ("inside CUDA-graph capture", self.capturing),
                 ("cuDNN's plans built", self.cudnn_planned),
                 ("deterministic algorithms", self.deterministic), ("backward", self.backward))
        return " ".join(parts + [name for name, on in flags if on])


def _sm_name(sm: tuple[int, int]) -> str:
    return f"sm{sm[0]}{sm[1]}"


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


@functools.cache
def _module_available(module: str) -> bool:
    """Whether `module` can be imported; asked once per process: find_spec scans sys.path, which
    made routing cost 65-230 us per op call (2-core CPU), most of the host time of a forward."""
    return importlib.util.find_spec(module) is not None


def has_triton() -> bool:
    return _module_available("triton")


def _needs_triton(x: Inputs) -> Optional[str]:
    if not has_triton():
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
        if not _module_available(module):
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

# Compressed attention runs through cuDNN from this many queries per residue (T / d) on. Measured
# with `bench/bench_kernels.py --seqlens 8192 16384 32768 65536 --kernels compressed` on an H200
# (bench/results/compressed_routing.csv), bwd ms Triton vs cuDNN: at T/d = 512 Triton wins for
# l=32, d=16 (0.96 vs 1.10) and l=d=64 (3.65 vs 3.97); at T/d = 1024 cuDNN does (2.97 vs 2.66,
# 11.66 vs 10.27) with forwards within 1%; at 4096 (64k, l=32, d=16) 37.6 vs 26.1. Re-measured
# on an H100 once the Triton dK dV kernel's splits became ranges of the sequence (`.gpu`-style
# scripts, two or three rounds; bf16, D = 128, HQ = 64, H = 4): the ops alone, forward +
# backward ms (the backward given its delta, as the layer gives it), Triton / cuDNN, l = 32, d =
# 16 at T/d = 512 (8k) 1.08 / 1.66, 1024 (16k) 3.36 / 3.58-3.63, 2048 (32k) 11.58 / 10.34-10.63;
# l = d = 64 at 512 (32k) 3.87-3.91 / 5.59, 1024 (64k) 13.26-13.30 / 13.74-14.21, 2048 (128k)
# 46.1-46.3 / 40.7-42.7; cuDNN's forward ahead from 1024 (16k 0.80 against 0.85, 64k at l = d
# = 64 3.06 against 3.40). The layer's synced step (bench_prefill's, l = 32, d = 16) with either
# forced: 16k forward 6.35-6.48 (cuDNN) against 6.39-7.45, forward+backward 19.47-19.90 against
# 19.36-19.78, 20k (T/d = 1280) 24.85-25.03 against 25.08-25.24. So 1024 stays: the backward's
# gain there does not reach the layer's step, and the forward loses it.
CUDNN_COMPRESSED_MIN_ROWS = {(9, 0): 1024}


@dataclass(frozen=True)
class Threshold:
    """A measured number a `defer` rule compares against, per SM; an SM without one is
    unmeasured, and the rule defers there."""
    meaning: str
    defaults: Mapping[tuple[int, int], int]


THRESHOLDS = {
    "selection_min_seqlen": Threshold(
        "T from which the selection kernel runs rather than packed SDPA (bench/bench_routing.py)",
        TRITON_SELECTION_MIN_SEQLEN),
    "cudnn_compressed_min_rows": Threshold(
        "T/d from which compressed attention runs through cuDNN rather than the Triton kernel "
        "(bench/bench_kernels.py --kernels compressed)", CUDNN_COMPRESSED_MIN_ROWS),
}
Value = Union[int, float]  # float: only math.inf, "never" (.inf in YAML)


@dataclass(frozen=True)
class Thresholds:
    """The thresholds in effect: name -> SM -> (value, where it came from), and the routing file
    over the defaults as it was given ("NSA_OPS_ROUTING=path", or the path load() got), if any."""
    entries: Mapping[str, Mapping[tuple[int, int], tuple[Value, str]]]
    origin: Optional[str] = None

    def get(self, name: str, sm: Optional[tuple[int, int]]) -> Optional[tuple[Value, str]]:
        return self.entries[name].get(sm)

    def sms(self, name: str) -> list[tuple[int, int]]:
        return sorted(self.entries[name])


def _defaults() -> Thresholds:
    return Thresholds({name: {sm: (value, "default") for sm, value in t.defaults.items()}
                       for name, t in THRESHOLDS.items()})


def _parse_thresholds(data, origin: str) -> dict[tuple[int, int], dict[str, Value]]:
    """A routing file's content (SM -> name -> value), checked; origin names the file in errors."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: a routing file maps SMs (sm80, sm90, ...) to thresholds, "
                         f"got {data!r}")
    out: dict[tuple[int, int], dict[str, Value]] = {}
    for key, values in data.items():
        m = re.fullmatch(r"sm(\d+)(\d)", str(key))
        if m is None:
            raise ValueError(f"{origin}: key {key!r} is not an SM; keys are SMs such as sm80, "
                             f"sm90, sm100 (major then minor compute capability)")
        if not isinstance(values, dict):
            raise ValueError(f"{origin}: {key} must map threshold names to values, got "
                             f"{values!r}")
        for name, value in values.items():
            if name not in THRESHOLDS:
                raise ValueError(f"{origin}: unknown threshold {name!r} under {key}; valid: "
                                 f"{', '.join(THRESHOLDS)}")
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 0
                                               or value == math.inf):
                raise ValueError(f"{origin}: {key}.{name} must be a non-negative integer or "
                                 f".inf (never), got {value!r}")
            out.setdefault((int(m[1]), int(m[2])), {})[name] = value
    return out


def _read_thresholds(path, origin: str) -> Thresholds:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"{origin}: cannot read the routing file: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{origin}: not a YAML file: {e}") from None
    entries = {name: dict(by_sm) for name, by_sm in _defaults().entries.items()}
    for sm, values in _parse_thresholds(data, origin).items():
        for name, value in values.items():
            entries[name][sm] = (value, str(path))
    return Thresholds(entries, origin)


_active: Optional[Thresholds] = None  # None until first use, when NSA_OPS_ROUTING is read


def thresholds() -> Thresholds:
    """The thresholds in effect: the defaults, overridden by `load`'s file, else by the file
    NSA_OPS_ROUTING names (read on first use)."""
    global _active
    if _active is None:
        path = env.routing_file()
        _active = _read_thresholds(path, f"NSA_OPS_ROUTING={path}") if path else _defaults()
    return _active


def load(path) -> None:
    """Take the thresholds from the routing file at `path` (over the defaults; NSA_OPS_ROUTING is
    then ignored), or with None drop the loaded file: the defaults, overridden by NSA_OPS_ROUTING
    when set, hold again. Raises ValueError naming the file and the bad entry."""
    global _active
    _active = None if path is None else _read_thresholds(path, str(path))
    _choices.clear()


def save(path, values: Mapping[tuple[int, int], Mapping[str, Value]], comment: str = "") -> None:
    """Write a routing file that `load` reads: values SM -> threshold name -> value; comment goes
    on top (one line, e.g. what measured them)."""
    data = {_sm_name(sm): dict(by_name) for sm, by_name in sorted(values.items())}
    _parse_thresholds(data, str(path))
    with open(path, "w") as f:
        if comment:
            f.write(f"# {comment}\n")
        yaml.safe_dump(data, f, sort_keys=False)


def _value(v: Value) -> str:
    return ".inf" if v == math.inf else str(v)


def _selection_kernel_preferred(x: Inputs) -> Optional[str]:
    entry = thresholds().get("selection_min_seqlen", x.sm)
    if entry is None and x.sm == (8, 9):
        return ("sm89 (Ada) runs packed SDPA by design: the kernels are tuned for the 164-228 KB "
                "of shared memory per SM of sm80/sm90/sm100, Ada has 100 KB (force to override)")
    if entry is None:
        sm = _sm_name(x.sm) if x.sm else "an unknown SM"
        tuned = ", ".join(map(_sm_name, thresholds().sms("selection_min_seqlen")))
        return f"tuned for {tuned}, not {sm}: packed SDPA serves it (force to override)"
    min_len, source = entry
    # a symbolic T: the kernel, which serves every length
    if x.seqlen is not None and x.seqlen < min_len:
        return (f"T={x.seqlen} < {_value(min_len)}, the selection_min_seqlen of {_sm_name(x.sm)} "
                f"({source}): packed SDPA is faster below it")
    return None


def _residue_views_fit(x: Inputs) -> Optional[str]:
    """What nsa_ops.compressed_sdpa's strided views of q need."""
    if x.varlen:
        return "varlen input: the residue views need one fixed length"
    if x.compressed is None:
        return "no block_len/block_stride given (use Inputs.of_compressed)"
    if x.seqlen is None:
        return "T is symbolic (a dynamic-length trace): the residue views need a known T"
    return None


def _has_cudnn9(x: Inputs) -> Optional[str]:
    if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) < 90000:
        return "needs cuDNN >= 9 (torch's cuDNN attention)"
    return None


def _fa2_serves(x: Inputs) -> Optional[str]:
    """Why neither FlashAttention-2 row (the flash_attn package, torch's bundled copy) serves x."""
    why = _flash_attn_row(x)
    return None if why is None else _aten_fa2_row(x)


def _triton_window_preferred(x: Inputs) -> Optional[str]:
    # kernels/window.py's tuned tiles: 16-bit head dims 33-128 both ways and, forward only, up to
    # 256 (where FA-2 serves, the inputs are 16-bit with Dk == Dv)
    widest = 128 if x.backward else 256
    if not (x.sm == (9, 0) and 32 < x.head_dim_qk <= widest) and _fa2_serves(x) is None:
        return ("the Triton window kernels were measured faster than FA-2 on sm90 at head dims "
                "33-128 both ways and 129-256 forward only, with the tiles tuned there (H100, "
                "bf16, w=512; D=128 at T = 8k / 64k / 128k: forward 0.43 / 3.55 / 7.33 ms "
                "against 0.69 / 5.63 / 11.24, backward 1.56 / 13.09 / 25.03 against 1.86 / "
                "14.86 / 30.16, bench_kernels.py --kernels window; D=64 at T = 16k / 64k: "
                "forward 0.47 / 1.86 against 1.11 / 5.87, backward 1.59 / 6.26 against 2.18 / "
                "8.56; H200, D=256 (HQ=32, H=2) / 192 / 160 (HQ=64, H=4) at 16k: forward 0.71 / "
                "1.31 / 1.36 against 1.04 / 1.87 / 2.01, backward 4.02 / 8.04 / 8.04 against "
                "3.76 / 5.62 / 5.95); FA-2 runs here (force to override)")
    return None


def _cudnn_compressed_preferred(x: Inputs) -> Optional[str]:
    entry = thresholds().get("cudnn_compressed_min_rows", x.sm)
    if entry is None:
        sm = _sm_name(x.sm) if x.sm else "an unknown SM"
        measured = ", ".join(map(_sm_name, thresholds().sms("cudnn_compressed_min_rows")))
        return (f"measured on {measured} only, not {sm}: the Triton kernel serves it (force to "
                f"override)")
    need, source = entry
    rows = x.seqlen // x.compressed.block_stride
    if rows < need:
        return (f"T/d = {rows} queries per residue < {_value(need)}, the "
                f"cudnn_compressed_min_rows of {_sm_name(x.sm)} ({source}): the Triton kernel is "
                f"faster below it")
    return None


_triton = _first(_needs_cuda, _needs_triton, _needs_sm80, _needs_half_or_fp32, _head_dims_upto(256))
_fa2_common = _first(_needs_cuda, _no_offset, _needs_sm80, _half_only("FlashAttention-2"),
                     _equal_head_dims("FlashAttention-2"), _head_dims_upto(256),
                     _head_dim_multiple_of_8("FlashAttention-2"))
# the two FA-2 rows' refusals, also asked by the Triton row's defer rule
_flash_attn_row = _first(_importable("flash_attn"), _fa2_common)
_aten_fa2_row = _first(_fa2_common, _has_aten_fa2)


def _plans_before_capture(x: Inputs) -> Optional[str]:
    if x.capturing and not x.cudnn_planned:
        return ("inside CUDA-graph capture with no eager call of this layout on this thread "
                "before: a first cuDNN call builds its plan with a device allocation that "
                "capture forbids, the Triton kernel serves")
    return None


def _reproducible(x: Inputs) -> Optional[str]:
    if x.deterministic:
        return ("torch.use_deterministic_algorithms(True): cuDNN's attention backward gave "
                "gradients differing bitwise between two runs on one H100 "
                "(tests/test_determinism.py), the Triton kernel's ordered adds do not")
    return None


def _cudnn_head_dims(x: Inputs) -> Optional[str]:
    """The head dims measured: Dk = Dv <= 128, and Dk = 192 with Dv = 128 (DeepSeek's), where
    cuDNN took 10.19 / 36.20 ms forward / backward at T = 64k against the Triton kernel's 14.02 /
    81.11 (H100, bf16, HQ=64, H=4, l=32, d=16, cuDNN 9.19; outputs and gradients within 4e-3 of
    each other, as at Dk = Dv = 128). Its Hopper backward mishandled some unequal large head
    dims in cuDNN 9.11-9.12, fixed in 9.13 (cudnn-frontend v1.14.1's release notes)."""
    dk, dv = x.head_dim_qk, x.head_dim_v
    if dk == dv <= 128:
        return None
    if (dk, dv) != (192, 128):
        return (f"cuDNN attention serves Dk = Dv <= 128 and Dk = 192 with Dv = 128 (the head "
                f"dims measured), got Dk={dk}, Dv={dv}")
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if (version or 0) < 91300:
        return (f"Dk={dk} != Dv={dv} needs cuDNN >= 9.13 (9.11-9.12's Hopper backward "
                f"mishandled some unequal head dims; earlier versions unmeasured), got "
                f"{version or 'no cuDNN'}")
    return None


_cudnn_compressed = _first(_needs_cuda, _no_offset, _plans_before_capture, _reproducible,
                           _needs_triton, _needs_sm80,
                           _half_only("cuDNN attention"), _cudnn_head_dims,
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
    # forward and backward run on CPU tensors under TRITON_INTERPRET=1 (see INTERPRETER_SM)
    interpreted: bool = False
    # the backward takes dq_add=: gradients it sums into dq on the way (nsa_ops.eager's layer
    # hands the selection backward the other branches' dq), instead of a pass after it
    adds_dq: bool = False
    # "module:function" that starts what the backward will read, which it then takes as index=
    # (nsa_ops.eager's layer starts it before the other branches' backward, which hide it)
    index: Optional[str] = None
    # "module:function": the forward with the gated combine of the branches in its epilogue
    # (nsa_ops.eager's layer runs it instead of the forward and the gate_combine op)
    gated: Optional[str] = None
    # the backward takes do_gate=: the gradients of do_gate * do from do itself (nsa_ops.eager's
    # layer, whose gate backward then need not write that product for the branch), and beside
    # it delta=, the rows' rowsum(dO * o), which that gate backward sums for the branch
    scales_do: bool = False


_REF = "nsa_ops.reference"
_SELECTION_INDEX = "nsa_ops.kernels.selection:backward_index"
# the window kernels' entries for calls the op checked and routed (the row's backend option)
_WIN_FWD = "nsa_ops.kernels.window:routed_fwd"
_WIN_BWD = "nsa_ops.kernels.window:routed_bwd"
TABLE: tuple[Route, ...] = (
    # with an lse gradient the cudnn row's backward runs the Triton backward (cuDNN has no dlse)
    Route("compressed_attention", "cudnn", "nsa_ops.compressed_sdpa:compressed_attention_fwd",
          "nsa_ops.compressed_sdpa:compressed_attention_bwd",
          _cudnn_compressed,
          defer=_cudnn_compressed_preferred),
    Route("compressed_attention", "triton", "nsa_ops.kernels.compressed:compressed_attention_fwd",
          "nsa_ops.kernels.compressed:compressed_attention_bwd", _triton, interpreted=True,
          scales_do=True),
    Route("compressed_attention", "reference", f"{_REF}:compressed_attention",
          f"{_REF}:compressed_attention_backward", _always),
    Route("select_blocks", "triton", "nsa_ops.kernels.compressed:select_blocks", None, _triton,
          interpreted=True),
    Route("select_blocks", "reference", f"{_REF}:select_blocks", None, _always),
    Route("selection_attention", "triton", "nsa_ops.kernels.selection:selection_attention_fwd",
          "nsa_ops.kernels.selection:selection_attention_bwd", _triton,
          defer=_selection_kernel_preferred, interpreted=True, adds_dq=True,
          index=_SELECTION_INDEX, scales_do=True,
          gated="nsa_ops.kernels.selection:selection_attention_gated_fwd"),
    # the backward reuses the Triton kernels, which serve every input this row serves
    Route("selection_attention", "packed_sdpa", "nsa_ops.packed:selection_attention_packed",
          "nsa_ops.kernels.selection:selection_attention_bwd", _first(_triton, _no_offset),
          interpreted=True, adds_dq=True, index=_SELECTION_INDEX, scales_do=True),
    Route("selection_attention", "reference", f"{_REF}:selection_attention",
          f"{_REF}:selection_attention_backward", _always),
    Route("sliding_window_attention", "triton", _WIN_FWD, _WIN_BWD, _triton,
          (("backend", "triton"),), defer=_triton_window_preferred, interpreted=True,
          scales_do=True),
    Route("sliding_window_attention", "flash_attn", _WIN_FWD, _WIN_BWD,
          _flash_attn_row, (("backend", "flash_attn"),)),
    Route("sliding_window_attention", "aten_fa2", _WIN_FWD, _WIN_BWD,
          _aten_fa2_row, (("backend", "aten_fa2"),)),
    Route("sliding_window_attention", "reference", f"{_REF}:sliding_window_attention",
          f"{_REF}:sliding_window_attention_backward", _always),
    # eager only: under torch.compile nsa_attention leaves the gate to Inductor, which fuses it
    Route("gate_combine", "triton", "nsa_ops.kernels.gate:gate_combine_fwd",
          "nsa_ops.kernels.gate:gate_combine_bwd",
          _first(_needs_cuda, _needs_triton, _needs_sm80, _needs_half_or_fp32),
          interpreted=True),
    Route("gate_combine", "reference", f"{_REF}:gate_combine", f"{_REF}:gate_combine_backward",
          _always),
    Route("decode", "triton", "nsa_ops.kernels.decode:decode_attention_fwd", None,
          _first(_triton, _decode_kernel_serves), interpreted=True),
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


# Under TRITON_INTERPRET=1 Triton runs its kernels on CPU tensors, which then stand in for this
# SM (as in the tests). The interpreter is far slower than the reference, so a row marked
# `interpreted` serves CPU tensors only when forced.
INTERPRETER_SM = (9, 0)

_forced: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "nsa_ops_routing_force", default=MappingProxyType({}))


# the impls force(impl) takes for every op at once: those every op has
SHARED_IMPLS = tuple(impl for impl in dict.fromkeys(r.impl for r in TABLE)
                     if all(any(r.impl == impl for r in candidates(op)) for op in OPS))


@contextlib.contextmanager
def force(impl: Optional[str] = None, /, **impls: str) -> Iterator[None]:
    """Inside the block, run `impl` for every op, or impls[op] for each op named, e.g.
    force(selection_attention="packed_sdpa"), wherever it can serve (what it cannot serve raises
    with its reason; measured preferences are lifted). Overrides NSA_OPS_FORCE_IMPL[_<OP>] and
    any enclosing force() for the ops it names; per context (thread, asyncio task).

    Routing happens when an op runs; an op's backward routes under the forcing its forward saw
    (see forces), and a graph torch.compile built inside the block keeps the choice it lowered."""
    if impl is not None and impl not in SHARED_IMPLS:
        raise ValueError(f"force: every op has {', '.join(SHARED_IMPLS)}, not {impl!r}; force "
                         f"one op's impl with force(op=impl)")
    for op, name in impls.items():
        if op not in OPS:
            raise ValueError(f"force: unknown op {op!r}; ops are {', '.join(OPS)}")
        route(op, name)
    state = dict(_forced.get())
    if impl is not None:
        state.update(dict.fromkeys(OPS, impl))
    state.update(impls)
    token = _forced.set(MappingProxyType(state))
    try:
        yield
    finally:
        _forced.reset(token)


def forces() -> dict[str, str]:
    """What routing.force set in this context, {op: impl}: the ops' autograd setup saves it and
    their backward re-enters it, since autograd runs CUDA backward on its own threads, which a
    context variable does not reach."""
    return dict(_forced.get())


def forced(op: str) -> Optional[tuple[str, str]]:
    """(the impl forced for op, who forced it), or None."""
    impl = _forced.get().get(op)
    if impl is not None:
        return impl, "routing.force"
    by_env = env.forced_impl(op)
    if by_env is not None:
        variable, impl = by_env
        return impl, f"{variable}={impl}"
    return None


def _refusal(r: Route, x: Inputs, is_forced: bool) -> Optional[str]:
    if is_forced and r.interpreted and x.device_type == "cpu" and env.triton_interpret():
        if x.dtype == torch.bfloat16:
            return "the Triton interpreter mis-computes bfloat16 dots: float16/float32 on CPU"
        x = dataclasses.replace(x, device_type="cuda", sm=INTERPRETER_SM)
    return r.refuse(x)


def forced_refusal(op: str, impl: str, x: Inputs) -> Optional[str]:
    """Why `impl` cannot serve x even when forced (as a kernel called by name is), or None."""
    return _refusal(route(op, impl), x, True)


def reasons(op: str, x: Inputs) -> list[tuple[Route, Optional[str], str]]:
    """(row, reason or None, its kind: "refused", "deferred" or "skipped") per candidate."""
    who = forced(op)
    rows = []
    for r in candidates(op):
        is_forced = who is not None and r.impl == who[0]
        reason = _refusal(r, x, is_forced)
        if reason is not None:
            rows.append((r, reason, "refused"))
        elif who is not None and not is_forced:
            rows.append((r, f"not the forced impl ({who[1]})", "skipped"))
        else:
            rows.append((r, None if is_forced else r.defer(x), "deferred"))
    return rows


def explain(op: str, x: Inputs) -> list[tuple[str, Optional[str]]]:
    """(impl, refusal reason or None) for every candidate of op, in preference order."""
    return [(r.impl, reason) for r, reason, _ in reasons(op, x)]


class RoutingError(ValueError):
    """No row serves the inputs. The message names the inputs, then each row's reason; `brief`
    says it in one line (the forced impl's reason, when one is forced)."""
    brief: str


def _routing_error(op: str, x: Inputs, reasons: list[tuple[str, Optional[str]]]) -> RoutingError:
    who = forced(op)
    impls = [impl for impl, _ in reasons]
    lines = [f"no implementation of nsa.{op} serves these inputs", f"  inputs: {x.summary()}"]
    lines += [f"  {impl}{' (forced)' if who and impl == who[0] else ''}: {reason}"
              for impl, reason in reasons]
    error = RoutingError("\n".join(lines))
    if who is None:
        error.brief = (f"no implementation of nsa.{op} serves {x.summary()}: "
                       + "; ".join(f"{impl}: {reason}" for impl, reason in reasons))
    elif who[0] not in impls:
        error.brief = f"{who[1]}: nsa.{op} has no impl {who[0]!r}; it has {', '.join(impls)}"
    else:
        error.brief = (f"{who[1]}: {who[0]} cannot serve nsa.{op} for {x.summary()}: "
                       f"{dict(reasons)[who[0]]}")
    return error


# What routing chooses depends on the op, the inputs, what forces the op and, for CPU inputs,
# TRITON_INTERPRET, besides the thresholds (load() forgets the choices) and the process's
# packages: each choice is kept. Every op call asks, forward and backward: on the H200 machine's
# host a choice cost 10.7 us, 4.8 kept (most of that `forced`'s two environment reads). Bounded:
# packed batches bring a new T each.
_CHOICES_MAX = 4096
_choices: dict = {}


def choose(op: str, x: Inputs) -> Route:
    if torch.compiler.is_compiling():  # Dynamo traces the lookup otherwise (decode is compiled)
        return _choose(op, x)
    # an environment read costs 2 us; only CPU inputs are routed by this one
    key = (op, x, forced(op), x.device_type == "cpu" and env.triton_interpret())
    chosen = _choices.get(key)
    if chosen is None:
        if len(_choices) >= _CHOICES_MAX:
            _choices.clear()
        chosen = _choices[key] = _choose(op, x)
    return chosen


def _choose(op: str, x: Inputs) -> Route:
    rows = reasons(op, x)
    for r, reason, _ in rows:
        if reason is None:
            return r
    raise _routing_error(op, x, [(r.impl, reason) for r, reason, _ in rows])


_resolved: dict[str, Callable] = {}


def resolve(target: str) -> Callable:
    fn = _resolved.get(target)
    if fn is None:
        module, name = target.split(":")
        fn = _resolved[target] = getattr(importlib.import_module(module), name)
    return fn


def _eager_folds(row: Route) -> list[str]:
    """What nsa_attention's eager layer (nsa_ops.eager) folds into this row's kernels."""
    return [what for what, on in (
        ("the gated combine in its forward's epilogue", row.gated is not None),
        ("its backward's index built early on a side stream", row.index is not None),
        ("the other branches' dq summed in its backward", row.adds_dq),
        ("its gate taken in its backward, not g * dO", row.scales_do)) if on]


def describe(examples: Optional[list[Inputs]] = None) -> str:
    """The table, the thresholds in effect and where each came from, and for each example input
    which impl runs and why the others do not."""
    lines = ["nsa_ops routing table (first candidate without a refusal runs):"]
    for op in OPS:
        lines.append(f"  {op}: " + " -> ".join(r.impl for r in candidates(op)))
        lines += [f"      {r.impl}, in nsa_attention's eager layer: {', '.join(folds)}"
                  for r in candidates(op) if (folds := _eager_folds(r))]
    limits = thresholds()
    origin = "defaults" if limits.origin is None else f"{limits.origin} over the defaults"
    lines.append(f"\nthresholds ({origin}):")
    for name, t in THRESHOLDS.items():
        lines.append(f"  {name}: {t.meaning}")
        lines += [f"      {_sm_name(sm):6s} {_value(value):>6s}  {source}"
                  for sm, (value, source) in sorted(limits.entries[name].items())]
    for x in examples or default_examples():
        lines.append(f"\n{x.summary()}")
        ops = ("decode",) if x.decode else PREFILL_OPS
        for op in (o for o in ops if not x.backward or candidates(o)[0].backward):
            lines.append(f"  {op:26s} -> {choose(op, x).impl}")
            lines += [f"      {r.impl:11s} {kind}: {reason}"
                      for r, reason, kind in reasons(op, x) if reason]
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
                 Inputs("cuda", (9, 0), bf16, 256, 256, 16384, compressed=cmp),
                 Inputs("cuda", (9, 0), bf16, 256, 256, 16384, compressed=cmp, backward=True),
                 Inputs("cuda", (8, 9), bf16, 128, 128, 32768, compressed=cmp),
                 Inputs("cuda", (7, 5), torch.float16, 128, 128, 8192, compressed=cmp),
                 Inputs("cuda", (9, 0), bf16, 128, 128, 1, decode=spec),
                 Inputs("cuda", (9, 0), bf16, 128, 128, 4, decode=spec),
                 Inputs("cpu", None, torch.float32, 128, 128, 1, decode=spec)]
    return examples
