"""torch.ops.nsa.*: the four NSA branch ops of the spec plus their backward ops.

Each op is thin: validate (nsa_ops.validation), then run what the routing table picks for the
inputs' device, SM, dtype and shape. The CPU and CUDA kernels share that one path; the fake
kernels run the same shape checks so torch.compile reports malformed inputs at trace time.
Backward ops are ops too, so compiled and exported backward graphs keep them opaque.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.library import custom_op

from . import observe, routing
from . import validation as check
from .routing import Inputs

_DEVICES = ("cpu", "cuda")


def _route(op: str, q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor],
           offset: bool = False, backward: bool = False) -> routing.Route:
    return observe.choose(op, Inputs.of(q, v, cu_seqlens, offset, backward))


def _compressed_route(q: Tensor, v_cmp: Tensor, block_len: int, block_stride: int,
                      cu_seqlens: Optional[Tensor], offset: bool, backward: bool = False
                      ) -> routing.Route:
    x = Inputs.of_compressed(q, v_cmp, block_len, block_stride, cu_seqlens, offset, backward)
    return observe.choose("compressed_attention", x)


def _keys(q: Tensor, Tk, cu_seqlens_k: Optional[Tensor], seqlen_k=None) -> tuple[dict, bool]:
    """(keyword arguments that place the queries at the end of longer keys, for the routes that
    take them, whether the queries sit at an offset): the routing table sends offset calls only
    to routes that take them; ({}, False) when queries align with their keys."""
    kw = {}
    if cu_seqlens_k is not None:
        kw["cu_seqlens_k"] = cu_seqlens_k
    if seqlen_k is not None and seqlen_k != q.shape[1]:
        kw["seqlen_k"] = seqlen_k
    return kw, bool(kw) or (Tk is not None and Tk != q.shape[1])


def _call(target: str, route: routing.Route, *args, **keys):
    """Run an implementation (keys: `_keys`'s arguments); its outputs come back contiguous, as
    the fake kernels promise.

    Implementations may follow their inputs' layout (FA-2 and TensorIterator arithmetic do, so a
    head-major q would give a head-major o or dq); the op's contract is one layout on every route.
    """
    # inputs arrive in the dtypes the caller's autocast chose; inside, the implementation's own
    # precision rules hold (float32 lse, float32 accumulation), not autocast's per-op casts.
    # Entering a disabled autocast costs the host ~10 us, so only where one is on
    device_type = args[0].device.type
    with torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) \
            else contextlib.nullcontext():
        out = routing.resolve(target)(*args, **keys, **dict(route.options))
        observe.ran(route, target, args, keys, out)
    if isinstance(out, Tensor):
        return out.contiguous()
    return tuple(t if t is None else t.contiguous() for t in out)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _fake_attention(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[-1]), q.new_empty(B, T, HQ, dtype=_lse_dtype(q))


def _fake_grads(*like: Tensor) -> tuple[Tensor, ...]:
    # contiguous whatever the inputs' strides: what _call returns
    return tuple(t.new_empty(t.shape) for t in like)


def _do_or_zeros(o: Tensor, do: Optional[Tensor]) -> Tensor:
    """Autograd's grad of o, which is None when only lse was used.

    The setup_context functions turn grad materialisation off so that an unused lse arrives as
    None rather than zeros: a zero dlse would cost the FA-2 window backward a second full pass
    and every kernel a pointless load. The o side still needs a tensor.
    """
    return torch.zeros_like(o) if do is None else do


# ---- compressed attention ------------------------------------------------------------------

@custom_op("nsa::compressed_attention", mutates_args=(), device_types=_DEVICES)
def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, block_len: int,
                         block_stride: int, scale: float, cu_seqlens: Optional[Tensor] = None,
                         cu_seqlens_q: Optional[Tensor] = None,
                         cu_seqlens_k: Optional[Tensor] = None,
                         seqlen_k: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """seqlen_k (fixed length) or cu_seqlens_q with cu_seqlens_k (varlen): the keys k_cmp was
    compressed from, when the queries are the last ones of longer sequences."""
    cu_q, cu_k = check.seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    check.compressed_attention_args(q, k_cmp, v_cmp, block_len, block_stride, scale, cu_q, cu_k,
                                    seqlen_k)
    kw, offset = _keys(q, None, cu_k, seqlen_k)
    route = _compressed_route(q, v_cmp, block_len, block_stride, cu_q, offset)
    return _call(route.forward, route, q, k_cmp, v_cmp, block_len, block_stride, scale, cu_q,
                 **kw)


@compressed_attention.register_fake
def _(q, k_cmp, v_cmp, block_len, block_stride, scale, cu_seqlens=None, cu_seqlens_q=None,
      cu_seqlens_k=None, seqlen_k=None):
    cu_q, cu_k = check.seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    check.compressed_attention_args(q, k_cmp, v_cmp, block_len, block_stride, scale, cu_q, cu_k,
                                    seqlen_k)
    return _fake_attention(q, v_cmp)


@custom_op("nsa::compressed_attention_backward", mutates_args=(), device_types=_DEVICES)
def compressed_attention_backward(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, o: Tensor, lse: Tensor,
                                  do: Tensor, dlse: Optional[Tensor], block_len: int,
                                  block_stride: int, scale: float,
                                  cu_seqlens: Optional[Tensor] = None,
                                  cu_seqlens_k: Optional[Tensor] = None,
                                  seqlen_k: Optional[int] = None
                                  ) -> tuple[Tensor, Tensor, Tensor]:
    return compressed_backward(q, k_cmp, v_cmp, o, lse, do, dlse, block_len, block_stride, scale,
                               cu_seqlens, cu_seqlens_k, seqlen_k)


def compressed_backward_route(q: Tensor, v_cmp: Tensor, block_len: int, block_stride: int,
                              cu_seqlens: Optional[Tensor] = None,
                              cu_seqlens_k: Optional[Tensor] = None,
                              seqlen_k: Optional[int] = None) -> routing.Route:
    """The route compressed_attention_backward takes for these inputs (as `backward_route`)."""
    _, offset = _keys(q, None, cu_seqlens_k, seqlen_k)
    return _compressed_route(q, v_cmp, block_len, block_stride, cu_seqlens, offset,
                             backward=True)


def compressed_backward(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, o: Tensor, lse: Tensor,
                        do: Tensor, dlse: Optional[Tensor], block_len: int, block_stride: int,
                        scale: float, cu_seqlens: Optional[Tensor] = None,
                        cu_seqlens_k: Optional[Tensor] = None, seqlen_k: Optional[int] = None,
                        do_gate: Optional[Tensor] = None, delta: Optional[Tensor] = None,
                        route: Optional[routing.Route] = None) -> tuple[Tensor, Tensor, Tensor]:
    """compressed_attention_backward's body (route: `compressed_backward_route`'s, already
    routed); do_gate, delta: as `window_backward`'s."""
    kw, _ = _keys(q, None, cu_seqlens_k, seqlen_k)
    if route is None:
        route = compressed_backward_route(q, v_cmp, block_len, block_stride, cu_seqlens,
                                          cu_seqlens_k, seqlen_k)
    do = _gated_do(route, do, do_gate, delta, o, kw)
    return _call(route.backward, route, q, k_cmp, v_cmp, o, lse, do, dlse, block_len,
                 block_stride, scale, cu_seqlens, **kw)


@compressed_attention_backward.register_fake
def _(q, k_cmp, v_cmp, o, lse, do, dlse, block_len, block_stride, scale, cu_seqlens=None,
      cu_seqlens_k=None, seqlen_k=None):
    return _fake_grads(q, k_cmp, v_cmp)


def _setup_compressed(ctx, inputs, output):
    q, k_cmp, v_cmp, block_len, block_stride, scale, cu, cu_q, cu_k, seqlen_k = inputs
    cu_q, cu_k = check.seqlens_pair(cu, cu_q, cu_k)
    ctx.save_for_backward(q, k_cmp, v_cmp, *output, cu_q, cu_k)
    ctx.set_materialize_grads(False)
    ctx.params = (block_len, block_stride, scale)
    ctx.seqlen_k = seqlen_k
    ctx.forces = routing.forces()


def _backward_compressed(ctx, do, dlse):
    q, k_cmp, v_cmp, o, lse, cu_q, cu_k = ctx.saved_tensors
    do = _do_or_zeros(o, do)
    with routing.force(**ctx.forces):
        dq, dk, dv = compressed_attention_backward(q, k_cmp, v_cmp, o, lse, do, dlse,
                                                   *ctx.params, cu_q, cu_k, ctx.seqlen_k)
    return dq, dk, dv, None, None, None, None, None, None, None


compressed_attention.register_autograd(_backward_compressed, setup_context=_setup_compressed)


# ---- block selection (non-differentiable) ----------------------------------------------------

@custom_op("nsa::select_blocks", mutates_args=(), device_types=_DEVICES)
def select_blocks(q: Tensor, k_cmp: Tensor, lse: Tensor, block_len: int, block_stride: int,
                  sel_block: int, num_sel: int, scale: float,
                  cu_seqlens: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                  cu_seqlens_k: Optional[Tensor] = None,
                  seqlen_k: Optional[int] = None) -> Tensor:
    cu_q, cu_k = check.seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    check.select_blocks_args(q, k_cmp, lse, block_len, block_stride, sel_block, num_sel, scale,
                             cu_q, cu_k, seqlen_k)
    kw, offset = _keys(q, None, cu_k, seqlen_k)
    route = _route("select_blocks", q, k_cmp, cu_q, offset)
    return _call(route.forward, route, q, k_cmp, lse, block_len, block_stride, sel_block, num_sel,
                 scale, cu_q, **kw)


@select_blocks.register_fake
def _(q, k_cmp, lse, block_len, block_stride, sel_block, num_sel, scale, cu_seqlens=None,
      cu_seqlens_q=None, cu_seqlens_k=None, seqlen_k=None):
    cu_q, cu_k = check.seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    check.select_blocks_args(q, k_cmp, lse, block_len, block_stride, sel_block, num_sel, scale,
                             cu_q, cu_k, seqlen_k)
    B, T = q.shape[:2]
    return q.new_empty(B, T, k_cmp.shape[2], num_sel, dtype=torch.int32)


def _no_grad_select(ctx, grad):
    # top-n is piecewise constant: no gradient reaches q, k_cmp or lse through the indices
    return (None,) * 12


select_blocks.register_autograd(_no_grad_select, setup_context=lambda ctx, inputs, output: None)


# ---- selection attention ---------------------------------------------------------------------

@custom_op("nsa::selection_attention", mutates_args=(), device_types=_DEVICES)
def selection_attention(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, sel_block: int,
                        scale: float, cu_seqlens: Optional[Tensor] = None,
                        cu_seqlens_q: Optional[Tensor] = None,
                        cu_seqlens_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """k/v may be longer than q: queries sit at the last Tq key positions (per sequence with
    cu_seqlens_q / cu_seqlens_k), block_idx [B, Tq, H, n] names blocks of the keys."""
    cu_q, cu_k = check.seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    check.selection_attention_args(q, k, v, block_idx, sel_block, scale, cu_q, cu_k)
    kw, offset = _keys(q, k.shape[1], cu_k)
    route = _route("selection_attention", q, v, cu_q, offset)
    return _call(route.forward, route, q, k, v, block_idx, sel_block, scale, cu_q, **kw)


def selection_gated(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, sel_block: int,
                    scale: float, cu_seqlens: Optional[Tensor] = None,
                    cu_seqlens_q: Optional[Tensor] = None,
                    cu_seqlens_k: Optional[Tensor] = None, *, o_cmp: Tensor,
                    o_win: Optional[Tensor], g_cmp: Tensor, g_slc: Tensor,
                    g_win: Optional[Tensor], keep_branch: bool
                    ) -> tuple[Optional[Tensor], Optional[Tensor], Tensor]:
    """nsa_attention's selection forward with the gated combine of the branches in the kernel's
    epilogue, where the route has that form (`Route.gated`) and the combine keeps q's dtype (not
    in parity mode, which checks each op's forward against its reference): (o, o_slc, lse_slc),
    o_slc None unless keep_branch. Elsewhere the selection op's body alone: (None, o_slc,
    lse_slc), and the caller runs gate_combine."""
    cu_q, cu_k = check.seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    check.selection_attention_args(q, k, v, block_idx, sel_block, scale, cu_q, cu_k)
    kw, offset = _keys(q, k.shape[1], cu_k)
    route = _route("selection_attention", q, v, cu_q, offset)
    if route.gated is not None and not observe.parity_on() and \
            _gate_dtype(o_cmp, q, o_win, g_cmp, g_slc, g_win) == q.dtype:
        check.gate_combine_args(o_cmp, o_cmp, o_win, g_cmp, g_slc, g_win)  # o_slc: o_cmp's shape
        return _call(route.gated, route, q, k, v, block_idx, sel_block, scale, cu_q, o_cmp=o_cmp,
                     o_win=o_win, g_cmp=g_cmp, g_slc=g_slc, g_win=g_win,
                     keep_branch=keep_branch, **kw)
    return None, *_call(route.forward, route, q, k, v, block_idx, sel_block, scale, cu_q, **kw)


@selection_attention.register_fake
def _(q, k, v, block_idx, sel_block, scale, cu_seqlens=None, cu_seqlens_q=None,
      cu_seqlens_k=None):
    cu_q, cu_k = check.seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    check.selection_attention_args(q, k, v, block_idx, sel_block, scale, cu_q, cu_k)
    return _fake_attention(q, v)


@custom_op("nsa::selection_attention_backward", mutates_args=(), device_types=_DEVICES)
def selection_attention_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                                 do: Tensor, dlse: Optional[Tensor], block_idx: Tensor,
                                 sel_block: int, scale: float,
                                 cu_seqlens: Optional[Tensor] = None,
                                 cu_seqlens_k: Optional[Tensor] = None
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    return selection_backward_adding((), q, k, v, o, lse, do, dlse, block_idx, sel_block, scale,
                                     cu_seqlens, cu_seqlens_k)


class SelectionBackward(NamedTuple):
    """A selection backward routed ahead of its run (`selection_backward_index`): the route,
    and what it reads that was started then (`Route.index`; None where the route has none)."""
    route: routing.Route
    index: Any


def backward_route(op: str, q: Tensor, k: Tensor, v: Tensor,
                   cu_seqlens: Optional[Tensor] = None,
                   cu_seqlens_k: Optional[Tensor] = None) -> routing.Route:
    """The route the backward of op ("selection_attention", "sliding_window_attention") takes
    for these inputs: nsa_attention's eager backward plans around it (whether it takes dO's
    gate, `Route.scales_do`) and hands it on (`selection_backward_index`, `window_backward`)."""
    _, offset = _keys(q, k.shape[1], cu_seqlens_k)
    return _route(op, q, v, cu_seqlens, offset, backward=True)


def selection_backward_index(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor,
                             sel_block: int, cu_seqlens: Optional[Tensor] = None,
                             cu_seqlens_k: Optional[Tensor] = None,
                             route: Optional[routing.Route] = None) -> SelectionBackward:
    """Routes the selection backward of these inputs now (route: `backward_route`'s, already
    routed) and starts what its route reads, for `selection_backward_adding`'s routed=."""
    kw, _ = _keys(q, k.shape[1], cu_seqlens_k)
    if route is None:
        route = backward_route("selection_attention", q, k, v, cu_seqlens, cu_seqlens_k)
    index = None if route.index is None else \
        routing.resolve(route.index)(q, k, v, block_idx, sel_block, cu_seqlens, **kw)
    return SelectionBackward(route, index)


def selection_backward_adding(dq_add: tuple[Tensor, ...], q: Tensor, k: Tensor, v: Tensor,
                              o: Tensor, lse: Tensor, do: Tensor, dlse: Optional[Tensor],
                              block_idx: Tensor, sel_block: int, scale: float,
                              cu_seqlens: Optional[Tensor] = None,
                              cu_seqlens_k: Optional[Tensor] = None,
                              routed: Optional[SelectionBackward] = None,
                              do_gate: Optional[Tensor] = None,
                              delta: Optional[Tensor] = None
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """selection_attention_backward's body, its dq summed with the gradients dq_add (shaped
    like q): inside the backward where the route takes them (`Route.adds_dq`), else after.
    routed: `selection_backward_index`'s, for the same inputs (None: routed here). do_gate,
    delta: as `window_backward`'s."""
    kw, offset = _keys(q, k.shape[1], cu_seqlens_k)
    if routed is None:
        routed = SelectionBackward(
            _route("selection_attention", q, v, cu_seqlens, offset, backward=True), None)
    route = routed.route
    if route.adds_dq:
        kw["dq_add"] = dq_add
    if routed.index is not None:
        kw["index"] = routed.index
    do = _gated_do(route, do, do_gate, delta, o, kw)
    dq, dk, dv = _call(route.backward, route, q, k, v, o, lse, do, dlse, block_idx, sel_block,
                       scale, cu_seqlens, **kw)
    if not route.adds_dq:
        for x in dq_add:
            dq += x
    return dq, dk, dv


@selection_attention_backward.register_fake
def _(q, k, v, o, lse, do, dlse, block_idx, sel_block, scale, cu_seqlens=None,
      cu_seqlens_k=None):
    return _fake_grads(q, k, v)


def _setup_selection(ctx, inputs, output):
    q, k, v, block_idx, sel_block, scale, cu, cu_q, cu_k = inputs
    cu_q, cu_k = check.seqlens_pair(cu, cu_q, cu_k)
    ctx.save_for_backward(q, k, v, *output, block_idx, cu_q, cu_k)
    ctx.set_materialize_grads(False)
    ctx.params = (sel_block, scale)
    ctx.forces = routing.forces()


def _backward_selection(ctx, do, dlse):
    q, k, v, o, lse, block_idx, cu_q, cu_k = ctx.saved_tensors
    do = _do_or_zeros(o, do)
    with routing.force(**ctx.forces):
        dq, dk, dv = selection_attention_backward(q, k, v, o, lse, do, dlse, block_idx,
                                                  *ctx.params, cu_q, cu_k)
    return dq, dk, dv, None, None, None, None, None, None


selection_attention.register_autograd(_backward_selection, setup_context=_setup_selection)


# ---- sliding window attention ----------------------------------------------------------------

@custom_op("nsa::sliding_window_attention", mutates_args=(), device_types=_DEVICES)
def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float,
                             cu_seqlens: Optional[Tensor] = None,
                             cu_seqlens_q: Optional[Tensor] = None,
                             cu_seqlens_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """k/v may be longer than q: queries sit at the last Tq key positions (per sequence with
    cu_seqlens_q / cu_seqlens_k)."""
    cu_q, cu_k = check.seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    check.sliding_window_attention_args(q, k, v, window, scale, cu_q, cu_k)
    kw, offset = _keys(q, k.shape[1], cu_k)
    route = _route("sliding_window_attention", q, v, cu_q, offset)
    return _call(route.forward, route, q, k, v, window, scale, cu_q, **kw)


@sliding_window_attention.register_fake
def _(q, k, v, window, scale, cu_seqlens=None, cu_seqlens_q=None, cu_seqlens_k=None):
    cu_q, cu_k = check.seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    check.sliding_window_attention_args(q, k, v, window, scale, cu_q, cu_k)
    return _fake_attention(q, v)


@custom_op("nsa::sliding_window_attention_backward", mutates_args=(), device_types=_DEVICES)
def sliding_window_attention_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                                      do: Tensor, dlse: Optional[Tensor], window: int,
                                      scale: float, cu_seqlens: Optional[Tensor] = None,
                                      cu_seqlens_k: Optional[Tensor] = None
                                      ) -> tuple[Tensor, Tensor, Tensor]:
    return window_backward(q, k, v, o, lse, do, dlse, window, scale, cu_seqlens, cu_seqlens_k)


def window_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                    dlse: Optional[Tensor], window: int, scale: float,
                    cu_seqlens: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                    do_gate: Optional[Tensor] = None,
                    route: Optional[routing.Route] = None,
                    delta: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """sliding_window_attention_backward's body (route: `backward_route`'s, already routed);
    do_gate ([B, T, HQ]): the gradients of do_gate * do, for a route whose kernels take the
    gate (`Route.scales_do`); delta (with do_gate): the rows' rowsum(dO * o), fp32 [B, T, HQ],
    which the gate's backward summed (`gate_backward`), so that the kernels read no o for it."""
    kw, _ = _keys(q, k.shape[1], cu_seqlens_k)
    if route is None:
        route = backward_route("sliding_window_attention", q, k, v, cu_seqlens, cu_seqlens_k)
    do = _gated_do(route, do, do_gate, delta, o, kw)
    return _call(route.backward, route, q, k, v, o, lse, do, dlse, window, scale, cu_seqlens,
                 **kw)


def _gated_do(route: routing.Route, do: Tensor, do_gate: Optional[Tensor],
              delta: Optional[Tensor], o: Tensor, kw: dict) -> Tensor:
    """do for a backward of do_gate * do, with do_gate (and delta, where given) in kw: in the
    branch's dtype (the layer's dO is wider where its gates are). Routes whose kernels take no
    gate (`Route.scales_do`) get g * dO from the gate's backward instead (nsa_ops.eager asks
    `backward_route` first)."""
    if do_gate is None:
        if delta is not None:
            raise ValueError("delta: given only with do_gate (the rows' rowsum(dO * o) of the "
                             "unscaled dO)")
        return do
    if not route.scales_do:
        raise ValueError(f"do_gate: the {route.impl} backward of nsa.{route.op} takes no gate "
                         f"for dO (Route.scales_do); pass do_gate * do as do")
    kw["do_gate"] = do_gate
    if delta is not None:
        kw["delta"] = delta
    return do.to(o.dtype)


@sliding_window_attention_backward.register_fake
def _(q, k, v, o, lse, do, dlse, window, scale, cu_seqlens=None, cu_seqlens_k=None):
    return _fake_grads(q, k, v)


def _setup_window(ctx, inputs, output):
    q, k, v, window, scale, cu, cu_q, cu_k = inputs
    cu_q, cu_k = check.seqlens_pair(cu, cu_q, cu_k)
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
    ctx.set_materialize_grads(False)
    ctx.params = (window, scale)
    ctx.forces = routing.forces()


def _backward_window(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    do = _do_or_zeros(o, do)
    with routing.force(**ctx.forces):
        dq, dk, dv = sliding_window_attention_backward(q, k, v, o, lse, do, dlse, *ctx.params,
                                                       cu_q, cu_k)
    return dq, dk, dv, None, None, None, None, None


sliding_window_attention.register_autograd(_backward_window, setup_context=_setup_window)


# ---- gated combine of the branches -------------------------------------------------------------

def _present(*tensors: Optional[Tensor]) -> list[Tensor]:
    return [t for t in tensors if t is not None]


def _gate_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """The dtype of the torch expression g_cmp*o_cmp + ...: every input's, promoted."""
    present = _present(*tensors)
    dtype = present[0].dtype
    for x in present[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _gate_route(*inputs: Optional[Tensor], backward: bool = False) -> routing.Route:
    o_cmp = inputs[0]
    x = Inputs.of(o_cmp, o_cmp, backward=backward, dtype=_gate_dtype(*inputs))
    return observe.choose("gate_combine", x)


@custom_op("nsa::gate_combine", mutates_args=(), device_types=_DEVICES)
def gate_combine(o_cmp: Tensor, o_slc: Tensor, o_win: Optional[Tensor], g_cmp: Tensor,
                 g_slc: Tensor, g_win: Optional[Tensor]) -> Tensor:
    """g_cmp*o_cmp + g_slc*o_slc + g_win*o_win; o_win = g_win = None: no window branch."""
    check.gate_combine_args(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win)
    route = _gate_route(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win)
    return _call(route.forward, route, o_cmp, o_slc, o_win, g_cmp, g_slc, g_win)


@gate_combine.register_fake
def _(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win):
    check.gate_combine_args(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win)
    return o_cmp.new_empty(o_cmp.shape, dtype=_gate_dtype(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win))


@custom_op("nsa::gate_combine_backward", mutates_args=(), device_types=_DEVICES)
def gate_combine_backward(do: Tensor, o_cmp: Tensor, o_slc: Tensor, o_win: Optional[Tensor],
                          g_cmp: Tensor, g_slc: Tensor, g_win: Optional[Tensor], gate_grads: bool
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d_o_cmp, d_o_slc, d_o_win, d_g_cmp, d_g_slc, d_g_win); an absent window branch's grads
    and, unless gate_grads, the gate grads are empty [0] tensors."""
    return gate_backward(do, o_cmp, o_slc, o_win, g_cmp, g_slc, g_win, gate_grads)


def gate_backward(do: Tensor, o_cmp: Tensor, o_slc: Tensor, o_win: Optional[Tensor],
                  g_cmp: Tensor, g_slc: Tensor, g_win: Optional[Tensor], gate_grads: bool,
                  branch_grads: tuple[bool, bool, bool] = (True, True, True)
                  ) -> tuple[Tensor, ...]:
    """gate_combine_backward's body; branch_grads (compressed, selection, window) False: that
    branch's slot holds its rows' rowsum(dO * o), fp32 [B, T, HQ], in place of g * dO
    (nsa_attention's eager backward, whose branch backward takes dO and the gate instead, and
    these sums as its delta: `selection_backward_adding`'s do_gate and delta)."""
    route = _gate_route(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win, backward=True)
    return _call(route.backward, route, do, o_cmp, o_slc, o_win, g_cmp, g_slc, g_win, gate_grads,
                 branch_grads=tuple(branch_grads))


@gate_combine_backward.register_fake
def _(do, o_cmp, o_slc, o_win, g_cmp, g_slc, g_win, gate_grads):
    d_o = [o.new_empty(o.shape) if o is not None else do.new_empty(0)
           for o in (o_cmp, o_slc, o_win)]
    d_g = [g.new_empty(g.shape if gate_grads else (0,)) if g is not None else do.new_empty(0)
           for g in (g_cmp, g_slc, g_win)]
    return (*d_o, *d_g)


def _setup_gate(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.gate_grads = any(ctx.needs_input_grad[3:])
    ctx.forces = routing.forces()


def _backward_gate(ctx, do):
    with routing.force(**ctx.forces):
        grads = gate_combine_backward(do, *ctx.saved_tensors, ctx.gate_grads)
    return tuple(d if need else None for d, need in zip(grads, ctx.needs_input_grad))


gate_combine.register_autograd(_backward_gate, setup_context=_setup_gate)


# ---- AOTInductor: the ops as their kernels -----------------------------------------------------
#
# A package AOTInductor builds runs without Python, so an opaque call of a Python op cannot be in
# it. While it compiles (only then: torch.compile keeps the ops opaque, routing at run time, and
# export keeps them as ops in the graph), each CUDA op is traced through its body instead, as
# torch.library.triton_op does: validation, the routing table's choice, then the chosen
# implementation, whose Triton launches (kernels/utils.launch) and aten calls become graph nodes
# Inductor compiles into the package. The selection forward stays an op where the Inductor
# lowering compiles it into its own template.

def _aot_compiling() -> bool:
    virtualized = sys.modules.get("torch._inductor.virtualized")
    return virtualized is not None and virtualized.V.aot_compilation


def _lowered_selection(args, kwargs) -> bool:
    """Whether the Inductor lowering compiles this nsa.selection_attention into its template."""
    from . import lowering
    if not lowering.registered():
        return False
    bound = inspect.signature(selection_attention._init_fn).bind(*args, **kwargs)
    a = bound.arguments
    cu_q, cu_k = check.seqlens_pair(a.get("cu_seqlens"), a.get("cu_seqlens_q"),
                                    a.get("cu_seqlens_k"))
    _, offset = _keys(a["q"], a["k"].shape[1], cu_k)
    return _route("selection_attention", a["q"], a["v"], cu_q, offset).impl == "triton"


def _traced_for_aoti(op_def, lowered=lambda args, kwargs: False) -> None:
    body = op_def._init_fn

    def rule(mode, op, types, args, kwargs):
        on_cuda = any(isinstance(a, Tensor) and a.device.type == "cuda" for a in args)
        if not (on_cuda and _aot_compiling()) or lowered(args, kwargs):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        if any(t is not Tensor and not issubclass(t, (FakeTensor, FunctionalTensor))
               for t in types):
            return NotImplemented
        with mode:
            return body(*args, **kwargs)

    op_def.register_torch_dispatch(FunctionalTensorMode, rule)


for _op in (compressed_attention, compressed_attention_backward, select_blocks,
            selection_attention_backward, sliding_window_attention,
            sliding_window_attention_backward, gate_combine, gate_combine_backward):
    _traced_for_aoti(_op)
_traced_for_aoti(selection_attention, lowered=_lowered_selection)
