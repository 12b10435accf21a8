"""nsa_attention's eager path: the whole layer as one autograd node over the ops' own bodies.

Through torch.ops.nsa.*, each op of a layer pays torch's custom-op dispatch and, with grad, an
autograd node of its own: on the H100 machine's host (T = 2048) 200-570 us per op call with grad,
against 80-220 us for the routed implementation call (`ops._call`), so at 8k tokens the GPU
waited on the host. Here one torch.autograd.Function runs the same bodies (`CustomOpDef._init_fn`:
validation, the routing table's choice, the implementation, logging and parity checks) in the
same order (mean pooling as `reference.compress_mean` computes it, on a GPU one Triton pass for
k and one for v, `kernels.pooling`), and its backward runs the backward ops' bodies and sums the
branches' gradients itself: dq's three parts in the selection dq kernel's epilogue, which runs last
(`ops.selection_backward_adding`; autograd's two adds took 2.09 ms at 64k, a one-pass sum 1.38),
mean pooling's backward as `reference.compress_mean_backward` computes it, on a GPU one Triton
pass that also adds the window's dk / dv (`kernels.pooling`; autograd's unfold backward took
0.76 ms at 64k), and the selection backward's inverse index started early on a side stream
(`ops.selection_backward_index`), where the compressed backward hides it. Where the selection
forward runs the Triton kernel, its epilogue writes the gated combine of the three branches
(`ops.selection_gated`, `Route.gated`): the gate_combine op's pass would read the branch's
output back from memory (H100, bf16, spec geometry, synced forward without grad, three
interleaved rounds: 8k 2.70-2.71 -> 2.61-2.63 ms, 16k 6.22-6.23 -> 6.05-6.06, 64k 36.22-36.37 ->
35.56-35.65; forward+backward within the spread, 64k 106.3-107.5 -> 106.1-106.3). Its backward
hands the window and selection backward dO and their gate where their routes take it
(`ops.backward_route`, `Route.scales_do`: the Triton kernels), and the gate's backward writes
g * dO only for the others (cuDNN's compressed backward, FA-2's window): on sm90 two [B, T,
HQ, Dv] products neither written nor held (H100, three
rounds in alternating processes: the step's peak at 64k 16.16 -> 15.16 GiB, 16k 4.99 -> 4.74,
8k 2.35 -> 2.23; 64k step 104.6-105.7 -> 104.3-104.5 ms, 8k and 16k within the spread). Their
delta, rowsum(dO * o), comes from the gate's backward too, which sums it for the gate's gradient
anyway: no delta pass of the selection's, no o read in the window's dQ kernel (8k step with gate
grads 8.66-8.68 -> 8.53-8.54 ms, 64k 105.21-105.42 -> 104.45-104.95). The Triton compressed
backward (short sequences, packed ones, GPUs without cuDNN's) takes dO and its gate the same way
(three rounds, H100, gate grads: 4 x 8k 33.85-33.97 -> 33.49-33.57 ms). The one node
itself, H100, spec geometry, forward+backward from an idle GPU against NSA_OPS_EAGER_LAYER=0,
two readings each in one run: 8k 11.11 / 11.02 -> 10.84 / 10.38 ms, 16k 23.20 / 23.26 -> 22.14 /
22.04, 64k 117.45 / 117.57 -> 115.71 / 116.72 (before the early index, `c6fc1e7`). The cost is
memory: the node's saved branch outputs live until its backward is done, where the ops' nodes
free theirs one by one, and the three dq parts meet in the selection backward: the step's peak
3.89 -> 4.17 GB at 16k, 15.58 -> 16.70 at 64k.

It serves only where nothing could tell it from the ops: eager calls on plain tensors, no
torch.compile, export, FakeTensor, DTensor, dispatch or function modes or functorch transforms,
and the built-in mean pooling as phi (a learnable phi keeps the ops, so its parameters get their
gradients the usual way; packed sequences, or d not dividing l, take pooling's backward from
autograd). The torch profiler still
sees each op by its name (nsa::selection_attention, nsa::selection_attention_backward, ...;
nsa::gate_combine where the selection forward does not run the combine).
NSA_OPS_EAGER_LAYER=0 turns it off (nsa_ops.env).
"""
from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import env, ops, reference, routing


class Plan(NamedTuple):
    """The non-tensor arguments of one layer call, resolved by nsa_attention."""
    block_len: int
    block_stride: int
    sel_block: int
    num_sel: int
    window: int
    scale: float
    seqs: dict  # the window and selection ops' sequence arguments
    cmp_keys: dict  # the compressed and select_blocks ops' (seqs, plus seqlen_k at an offset)
    cu_q: Optional[Tensor]  # the queries' sequences (None: fixed length)
    cu_k: Optional[Tensor]  # the keys' sequences, where they differ from the queries'

    @property
    def cu_keys(self) -> Optional[Tensor]:
        """The sequences phi pools over."""
        return self.cu_q if self.cu_k is None else self.cu_k


def serves(phi_k: Callable, phi_v: Callable, tensors: list[Optional[Tensor]]) -> bool:
    """Whether the layer call can take this path (see the module docstring)."""
    if not env.eager_layer():
        return False
    if phi_k is not reference.compress_mean or phi_v is not reference.compress_mean:
        return False
    if (torch.compiler.is_compiling() or is_in_torch_dispatch_mode()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active()):
        return False
    return all(t is None or type(t) in (Tensor, torch.nn.Parameter) for t in tensors)


def nsa_attention(plan: Plan, q: Tensor, k: Tensor, v: Tensor, g_cmp: Tensor, g_slc: Tensor,
                  g_win: Optional[Tensor], block_idx: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(o, the block_idx the selection used)."""
    return _Layer.apply(plan, q, k, v, g_cmp, g_slc, g_win, block_idx)


@contextlib.contextmanager
def _named(op: str):
    """The op's name in a torch profiler trace, as the dispatcher would record it."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(f"nsa::{op}"):
            yield
    else:
        yield


class _Layer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: Plan, q, k, v, g_cmp, g_slc, g_win, block_idx):
        grad = any(ctx.needs_input_grad)
        o_win = lse_win = None
        if plan.window:
            with _named("sliding_window_attention"):
                o_win, lse_win = ops.sliding_window_attention._init_fn(
                    q, k, v, plan.window, plan.scale, **plan.seqs)
        k_cmp, v_cmp = _pool(k, plan), _pool(v, plan)
        with _named("compressed_attention"):
            o_cmp, lse_cmp = ops.compressed_attention._init_fn(
                q, k_cmp, v_cmp, plan.block_len, plan.block_stride, plan.scale, **plan.cmp_keys)
        if block_idx is None:
            with _named("select_blocks"):
                block_idx = ops.select_blocks._init_fn(
                    q, k_cmp, lse_cmp, plan.block_len, plan.block_stride,
                    plan.sel_block, plan.num_sel, plan.scale, **plan.cmp_keys)
        # the combine from the selection kernel's epilogue where its route has one
        with _named("selection_attention"):
            o, o_slc, lse_slc = ops.selection_gated(
                q, k, v, block_idx, plan.sel_block, plan.scale, **plan.seqs, o_cmp=o_cmp,
                o_win=o_win, g_cmp=g_cmp, g_slc=g_slc, g_win=g_win, keep_branch=grad)
        if o is None:
            with _named("gate_combine"):
                o = ops.gate_combine._init_fn(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win)
        ctx.mark_non_differentiable(block_idx)
        if grad:
            ctx.plan = plan
            ctx.forces = routing.forces()
            ctx.gate_grads = any(ctx.needs_input_grad[4:7])
            ctx.save_for_backward(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_win, o_cmp, lse_cmp,
                                  o_slc, lse_slc, o_win, lse_win, block_idx)
        return o, block_idx

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _):
        (q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_win, o_cmp, lse_cmp, o_slc, lse_slc, o_win,
         lse_win, block_idx) = ctx.saved_tensors
        plan = ctx.plan
        cu_q, cu_k = plan.cu_q, plan.cu_k
        # the gate's backward writes g * dO only for the branches whose kernels do not take the
        # gate (`Route.scales_do`): cuDNN's compressed backward, and FA-2's window; the Triton
        # kernels take dO and their gate (do_gate), scaling P, so their [B, T, HQ, Dv] products
        # are neither written nor held, and as their delta the rows' rowsum(dO * o) that the
        # gate's backward sums in the same pass (for the gate's gradient anyway), so that they
        # read no o for it. The saved outputs stay until the node is done, where the ops' nodes
        # free theirs one by one
        with routing.force(**ctx.forces):
            cmp_route = ops.compressed_backward_route(q, v_cmp, plan.block_len, plan.block_stride,
                                                      cu_q, cu_k, plan.cmp_keys.get("seqlen_k"))
            sel_route = ops.backward_route("selection_attention", q, k, v, cu_q, cu_k)
            win_route = ops.backward_route("sliding_window_attention", q, k, v, cu_q, cu_k) \
                if plan.window else None
            gated = (cmp_route.scales_do, sel_route.scales_do,
                     win_route is not None and win_route.scales_do)
            with _named("gate_combine_backward"):
                do_cmp, do_slc, do_win, dg_cmp, dg_slc, dg_win = ops.gate_backward(
                    do, o_cmp, o_slc, o_win, g_cmp, g_slc, g_win, ctx.gate_grads,
                    branch_grads=tuple(not x for x in gated))
            # a branch that takes the gate finds its delta in its slot
            (delta_cmp, do_cmp), (delta_slc, do_slc), (delta_win, do_win) = (
                (slot, do) if takes_gate else (None, slot)
                for slot, takes_gate in zip((do_cmp, do_slc, do_win), gated))
            g_cmp_do, g_slc_do, g_win_do = (g if takes_gate else None
                                            for g, takes_gate in zip((g_cmp, g_slc, g_win), gated))
            dq_parts = []
            if plan.window:
                with _named("sliding_window_attention_backward"):
                    dq_win, dk_win, dv_win = ops.window_backward(
                        q, k, v, o_win, lse_win, do_win, None, plan.window, plan.scale, cu_q,
                        cu_k, do_gate=g_win_do, route=win_route, delta=delta_win)
                del do_win, delta_win
                dq_parts.append(dq_win)
            # the selection backward's inverse index on a side stream, built while the compressed
            # backward runs; started after the gate and window backward are queued, so that the
            # GPU has work while the host launches it
            routed = ops.selection_backward_index(q, k, v, block_idx, plan.sel_block, cu_q, cu_k,
                                                  sel_route)
            with _named("compressed_attention_backward"):
                dq_cmp, dk_cmp, dv_cmp = ops.compressed_backward(
                    q, k_cmp, v_cmp, o_cmp, lse_cmp, do_cmp, None,
                    plan.block_len, plan.block_stride, plan.scale, cu_q, cu_k,
                    plan.cmp_keys.get("seqlen_k"), do_gate=g_cmp_do, delta=delta_cmp,
                    route=cmp_route)
            del do_cmp, delta_cmp
            dq_parts.append(dq_cmp)
            # last, so that its dq kernel sums the other branches' dq as it writes its own
            with _named("selection_attention_backward"):
                dq, dk, dv = ops.selection_backward_adding(
                    tuple(dq_parts), q, k, v, o_slc, lse_slc, do_slc, None, block_idx,
                    plan.sel_block, plan.scale, cu_q, cu_k, routed, do_gate=g_slc_do,
                    delta=delta_slc)
            del do_slc, delta_slc
        wins = (dk_win, dv_win) if plan.window else (None, None)
        _add_pool_backward(dk, dk_cmp, k, plan, wins[0])
        _add_pool_backward(dv, dv_cmp, v, plan, wins[1])
        gates = (dg_cmp, dg_slc, dg_win) if ctx.gate_grads else (None,) * 3
        return (None, dq, dk, dv, *(d if need else None for d, need in
                                    zip(gates, ctx.needs_input_grad[4:7])), None)


def _pooling_kernel(x: Tensor, plan: Plan) -> bool:
    """Whether mean pooling of x runs as `kernels.pooling`'s passes (a GPU, fixed length) rather
    than as the reference's torch ops (`kernels.pooling` says how their roundings compare)."""
    return plan.cu_keys is None and x.is_cuda and routing.has_triton()


def _pool(x: Tensor, plan: Plan) -> Tensor:
    """`reference.compress_mean` of x: one Triton pass where `_pooling_kernel`."""
    if _pooling_kernel(x, plan):
        from nsa_ops.kernels.pooling import mean_pool
        return mean_pool(x, plan.block_len, plan.block_stride)
    return reference.compress_mean(x, plan.block_len, plan.block_stride, plan.cu_keys)


def _add_pool_backward(dx: Tensor, grad: Tensor, x: Tensor, plan: Plan,
                       other: Optional[Tensor]) -> None:
    """dx += other (the window's gradient, or None), then the gradient of x from that of its
    mean pooling: on a GPU at fixed length with d dividing l one Triton pass
    (`kernels.pooling`, the same roundings as the torch ops), elsewhere
    `reference.compress_mean_backward` adding into dx, else autograd through the pooling done
    again (a graph kept from the forward would be gone after one backward, and retain_graph asks
    for more)."""
    fixed = plan.cu_keys is None and plan.block_len % plan.block_stride == 0
    if fixed and _pooling_kernel(dx, plan):
        from nsa_ops.kernels.pooling import add_mean_pool_backward
        add_mean_pool_backward(dx, grad, plan.block_len, plan.block_stride, other)
        return
    if other is not None:
        dx += other
    if fixed:
        reference.compress_mean_backward(grad, x.shape[1], plan.block_len, plan.block_stride,
                                         out=dx)
        return
    leaf = x.detach().requires_grad_()
    with torch.enable_grad():
        pooled = reference.compress_mean(leaf, plan.block_len, plan.block_stride, plan.cu_keys)
        dx += torch.autograd.grad(pooled, leaf, grad)[0]
