"""Helpers the kernel launchers share (as fla's ops/utils). Pure PyTorch, no Triton import: the
SDPA-based routes in nsa_ops (packed, compressed_sdpa) use them too."""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch._subclasses.fake_tensor import is_fake


def traced() -> bool:
    """Whether a torch dispatch mode is active, i.e. the launch is being traced (AOTInductor's
    export of the ops, nsa_ops.ops). torch's is_in_torch_dispatch_mode() flag is no test of it:
    it stays set while Inductor's autotuner runs real launches with its modes popped, which
    would then time another kernel than the compiled code runs."""
    return torch._C._len_torch_dispatch_stack() > 0 or _len_torch_dispatch_stack_pre_dispatch() > 0


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) on the host (ints or a dynamic-length trace's SymInts): triton.cdiv is a
    constexpr function there, 1.9 us a call (Triton 3.6, H200 host), some ten calls a layer step."""
    return (x + y - 1) // y


def pow2(x: int, lo: int = 1) -> int:
    """The smallest power of two >= x, at least lo: Triton block shapes are powers of two (and
    tl.dot operands at least 16 wide)."""
    return max(lo, 1 << max(0, x - 1).bit_length())


def row_bytes(dtype: torch.dtype, *dims: int) -> int:
    """The widest head row of a kernel's tiles in bytes: head dims padded as the tiles pad them
    (`pow2(D, 16)`). The tile tables are keyed by it."""
    return max(pow2(d, 16) for d in dims) * dtype.itemsize


def unit_last_stride(x: Tensor) -> Tensor:
    """x, or a contiguous copy when its last dim has a stride: the kernels (and SDPA) read a head
    row as one contiguous vector and take the leading strides as they are."""
    return x if x.stride(-1) == 1 else x.contiguous()


def tma_layout(x: Tensor) -> bool:
    """Whether a TMA descriptor can describe x: unit last stride, the other strides non-zero
    multiples of 16 bytes, a 16-byte aligned start (cuTensorMapEncodeTiled's rules). A tensor
    without an address (fake or functional, as AOTInductor traces the ops) has no start to
    check: no, and its launch keeps pointer loads."""
    if x.stride(-1) != 1 or is_fake(x) or x.data_ptr() % 16:
        return False
    return all(s > 0 and s * x.element_size() % 16 == 0 for s in x.stride()[:-1])


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """torch.cuda.get_device_capability(device), asked once per device: every op call asks (the
    routing table, the TMA choice), and each ask cost the H100 machine's host 15-20 us."""
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


def tma_engine(x: Tensor) -> bool:
    """Whether an eager launch on x's device can read tiles through TMA descriptors: Hopper's
    copy engine, on sm90+ GPUs. A launch traced for AOTInductor (`traced`) keeps pointer loads:
    torch.library.wrap_triton takes no descriptors."""
    return x.device.type == "cuda" and not traced() \
        and device_capability(x.device)[0] >= 9


def tma_kv_reason(k: Tensor, v: Tensor) -> Optional[str]:
    """Why TMA descriptors cannot describe k and v (None: they can)."""
    if not (tma_layout(k) and tma_layout(v)):
        return "k or v has a layout TMA cannot describe (16-byte strides and start, unit last)"
    return None


def use_tma(tma: Optional[bool], reason: Optional[str], x: Tensor) -> bool:
    """Whether a kernel reads its tiles through TMA descriptors, given why it cannot (reason,
    None: it can) and a tensor on the launch's device. tma=None: where it can and
    `tma_engine(x)`; True forces it (the CPU tests, under the interpreter; ValueError with the
    reason where it cannot); False: pointer loads."""
    if tma is None:
        return reason is None and tma_engine(x)
    if tma and reason is not None:
        raise ValueError(f"tma=True: {reason}")
    return tma


def tma_descriptors(k: Tensor, v: Tensor, bn: int, dkp: int, dvp: int) -> tuple:
    """TMA descriptors of k and v [B, Tk, H, D], one box a [bn, D] tile of one head (D padded to
    dkp / dvp: the box's columns past D read zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # this module imports no Triton
    return (TensorDescriptor.from_tensor(k, [1, bn, 1, dkp]),
            TensorDescriptor.from_tensor(v, [1, bn, 1, dvp]))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: fp32 inputs get true fp32 dots (no tf32), so the kernels match
    the reference to ~1e-6; 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cuda_core_dots(dtype: torch.dtype) -> bool:
    """Whether tl.dot runs this dtype's tiles on CUDA cores (`dot_precision` ieee): the tiles sized
    for 16-bit rows of the same bytes spill there, so such rows take tiles of their own."""
    return dot_precision(dtype) == "ieee"


def launch(kernel):
    """`kernel`, or its torch.library.wrap_triton form while a torch dispatch mode traces the op
    (AOTInductor decomposes the ops into their kernels, nsa_ops.ops): the launch then becomes a
    graph node Inductor compiles into the package. Eager launches skip the wrapper's dispatch."""
    return torch.library.wrap_triton(kernel) if traced() else kernel


def launch_options(num_warps: int, num_stages: int, maxnreg: int | None = None) -> dict:
    """Triton launch options. maxnreg caps the registers of a thread so that more programs share
    an SM. torch.library.wrap_triton (torch 2.11-2.13) takes only num_warps, num_stages and
    num_ctas, so a launch traced for AOTInductor goes without the cap: the same results, at the
    uncapped kernel's speed."""
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None and not traced():
        options["maxnreg"] = maxnreg
    return options


def unscaled_do_gate(do_gate: Optional[Tensor], dlse: Optional[Tensor]) -> Optional[Tensor]:
    """The rows' gates (fp32, contiguous [B, T, HQ]) of an attention backward given dO unscaled
    and the gate g of its branch (do_gate: nsa_attention's eager backward, so that the gate's
    backward need not write g * dO): its gradients are those of g * dO, with P taking g (dS =
    g P (dP - rowsum(dO * O)), dV = (g P)^T dO, dq scaled last). With an lse gradient delta
    would mix scaled and unscaled terms: refused."""
    if do_gate is None:
        return None
    if dlse is not None:
        raise ValueError("do_gate: a backward takes a gate for dO only without an lse gradient "
                         "(dlse must be None)")
    return do_gate.to(torch.float32).contiguous()


def given_delta(delta: Optional[Tensor], dlse: Optional[Tensor], do: Tensor
                ) -> Optional[Tensor]:
    """An attention backward's rows' delta = rowsum(dO * O) (fp32, contiguous [B, T, HQ]) where
    its caller has it already (nsa_attention's eager backward: the gate's backward sums dO * O
    for its gate gradient anyway), so that the backward reads no O for it. An lse gradient
    would belong in it: refused beside it, so that it is never subtracted twice or not at all."""
    if delta is None:
        return None
    if dlse is not None:
        raise ValueError("delta: give rowsum(dO * O) - dlse as delta, without dlse")
    if tuple(delta.shape) != tuple(do.shape[:-1]):
        raise ValueError(f"delta must be shaped like dO without its last dim "
                         f"{tuple(do.shape[:-1])}, got {tuple(delta.shape)}")
    return delta.to(torch.float32).contiguous()
