"""Inductor lowering of nsa.selection_attention: a Triton template or packed SDPA, by routing.

On CUDA, the routing table (nsa_ops.routing) decides which family serves the input:

* "triton": the choices are the template below in several launch configs, the eager Triton
  forward (TMA loads and the shared pass of queries that select alike, which the template lacks)
  and packed SDPA, both as ExternKernelChoices, and Inductor's autotuner times them and keeps the
  fastest;
* "packed_sdpa": packed SDPA alone (an SM the kernel is not tuned for, or a short sequence);
* anything else (CPU, float64, old GPUs): Inductor's generic fallback, an opaque call of the op,
  which routes again at run time.

The template serves fixed length, packed sequences (cu_seqlens, or cu_seqlens_q with
cu_seqlens_k) and queries at an offset (Tq < Tk), as the eager kernel does.

The template runs the same device function as the eager kernel (`selection_fwd_rows` in
nsa_ops.kernels.selection); what it adds is Inductor's `store_output`, so the gate
multiply-add that consumes the output is fused into the template's epilogue instead of reading
the output back from HBM. With dynamic shapes the choice is made at the sequence length Inductor
hints (the first one compiled); every choice is correct at every length.

The op returns (o, lse); templates store one output, so lse is a buffer the kernel writes and the
graph records as mutated (as Inductor's flex attention does). The extern choice writes lse the
same way and gets the same mutation record.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from types import SimpleNamespace
from typing import Optional

import torch

from nsa_ops import routing

_OP = "selection_attention"

# The template's source in three variants (Inductor templates take a fixed list of input
# buffers): fixed length, where queries sit OFF = Tk - Tq keys in; packed sequences with one
# cu_seqlens; packed sequences with cu_seqlens_q and cu_seqlens_k.
_TEMPLATE_SOURCE = r'''
{{def_kernel("Q", "K", "V", "BIDX", CU_INPUTS"LSE")}}
    T = {{size("Q", 1)}}
KEYS
    t = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    # K, V stand in for the TMA descriptors and Q, 0, 0, 0, LSE for the shared pass's o and lse:
    # the template runs neither (TMA False, TT 0), so they go unread
    out, lse_row, heads, gmask = selection_fwd_rows(
        Q, K, V, K, V, BIDX, CU_Q, CU_K, OFF, NSEQ, b, t, h,
        {{stride("Q", 0)}}, {{stride("Q", 1)}}, {{stride("Q", 2)}},
        {{stride("K", 0)}}, {{stride("K", 1)}}, {{stride("K", 2)}},
        {{stride("V", 0)}}, {{stride("V", 1)}}, {{stride("V", 2)}},
        T, NSLOTS, QK_SCALE, Q, 0, 0, 0, LSE, H, G, GP, DK, DV, DKP, DVP, SEL, BN, NP,
        IS_VARLEN, PREC, False, 0)
    lse_off = b * {{stride("LSE", 0)}} + t * {{stride("LSE", 1)}} + heads * {{stride("LSE", 2)}}
    tl.store(LSE + lse_off, lse_row, mask=gmask)
    idx_b = b
    idx_t = t
    idx_hq = heads[:, None]
    idx_d = tl.arange(0, DVP)[None, :]
    mask = gmask[:, None] & (idx_d < DV)
    {{store_output(("idx_b", "idx_t", "idx_hq", "idx_d"), "out", "mask"STORE_SHAPE)}}


from nsa_ops.kernels.selection import selection_fwd_rows
'''
_KEYS = {
    "fixed": ("", """    CU_Q = BIDX  # unread
    CU_K = BIDX
    OFF = {{size("K", 1)}} - T
    NSEQ = 0"""),
    "varlen": ('"CU_Q", ', """    CU_K = CU_Q
    OFF = 0
    NSEQ = {{size("CU_Q", 0)}} - 1"""),
    "varlen_k": ('"CU_Q", "CU_K", ', """    OFF = 0
    NSEQ = {{size("CU_Q", 0)}} - 1"""),
}


_api: Optional[SimpleNamespace] = None
_api_error: Optional[str] = None


def inductor_api() -> Optional[SimpleNamespace]:
    """The private Inductor pieces the lowering needs, or None (warned once) if this torch lacks
    one of them."""
    global _api, _api_error
    if _api is not None or _api_error is not None:
        return _api
    try:
        _api = _build_api()
    except (ImportError, AttributeError, TypeError) as exc:
        _api_error = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"nsa_ops.lowering: this torch ({torch.__version__}) lacks an Inductor API "
                      f"the selection template needs ({_api_error}); torch.compile calls "
                      f"nsa.selection_attention as an opaque op instead", RuntimeWarning,
                      stacklevel=2)
    return _api


def _build_api() -> SimpleNamespace:
    from torch._inductor import ir
    from torch._inductor.lowering import empty_strided
    from torch._inductor.select_algorithm import (SymbolicGridFn, TritonTemplate,
                                                  TritonTemplateKernel, autotune_select_algorithm)
    from torch._inductor.virtualized import V

    for name in ("FixedLayout", "MutationOutput", "NoneLayout", "ExternKernel", "StorageBox"):
        getattr(ir, name)
    store_params = inspect.signature(TritonTemplateKernel.store_output).parameters
    shape = ', val_shape=("GP", "DVP")' if "val_shape" in store_params else ""

    @SymbolicGridFn
    def grid(B, T, HQ, Dk, meta, *, cdiv):
        return (T, B * meta["H"], 1)

    def template(variant: str):
        name = f"nsa_selection_attention_{variant}"
        cu_inputs, keys = _KEYS[variant]
        source = _TEMPLATE_SOURCE.replace("STORE_SHAPE", shape).replace(
            "CU_INPUTS", cu_inputs).replace("KEYS", keys)
        return TritonTemplate.all_templates.get(name) or TritonTemplate(name=name, grid=grid,
                                                                       source=source)
    return SimpleNamespace(ir=ir, V=V, empty_strided=empty_strided,
                           templates={variant: template(variant) for variant in _KEYS},
                           **register_extern_kernels(), autotune=autotune_select_algorithm,
                           autotune_params=inspect.signature(autotune_select_algorithm)
                           .parameters)


_extern_kernels: Optional[dict] = None


def register_extern_kernels() -> dict:
    """The extern choices, created once ({"packed": ..., "kernel": ...}): creating one registers
    its function as `extern_kernels.<name>` for the code Inductor writes (see nsa_ops.lowering)."""
    global _extern_kernels
    if _extern_kernels is None:
        from torch._inductor.select_algorithm import ExternKernelChoice
        # a reloaded nsa_ops finds its choices registered already (a second one of a name fails)
        found = getattr(ExternKernelChoice, "lookup", lambda name: None)
        _extern_kernels = {
            key: found(name) or ExternKernelChoice(fn, name=name, has_out_variant=True)
            for key, (name, fn) in {"packed": ("nsa_selection_packed_sdpa", _packed_sdpa_out),
                                    "kernel": ("nsa_selection_kernel", _kernel_out)}.items()}
    return _extern_kernels


def register_extern_kernels_at_import() -> None:
    """`register_extern_kernels` for the import hook, which must not break Inductor's import: a
    torch without this API is warned about by `inductor_api` when a graph is lowered."""
    try:
        register_extern_kernels()
    except (ImportError, AttributeError, TypeError):
        pass


def _kernel_out(q, k, v, block_idx, lse, *, sel_block, scale, out):
    """The extern choice of the eager Triton forward (TMA loads, the shared pass of groups of
    queries that select alike, which the template lacks) writing into Inductor's buffers."""
    from nsa_ops.kernels.selection import selection_attention_fwd
    selection_attention_fwd(q, k, v, block_idx, sel_block, scale, out=(out, lse))
    return out


def _packed_sdpa_out(q, k, v, block_idx, lse, *, sel_block, scale, out):
    """The extern choice: packed SDPA writing into Inductor's buffers."""
    from nsa_ops.packed import selection_attention_packed
    o, lse_new = selection_attention_packed(q, k, v, block_idx, sel_block, scale)
    out.copy_(o)
    lse.copy_(lse_new)
    return out


def _valid_block_idx(node, sel_block: int) -> torch.Tensor:
    """Autotuning input for block_idx: random indices would read out of bounds. Each token takes
    up to n distinct visible blocks spread over its prefix, as real selections do."""
    from torch._inductor.virtualized import V
    B, T, H, n = V.graph.sizevars.size_hints(node.get_size())
    dev = node.get_device()
    visible = torch.arange(T, device=dev)[:, None] // sel_block + 1
    slot = torch.arange(n, device=dev)[None, :]
    idx = torch.where(slot < visible, slot * torch.clamp(visible // n, min=1), -1)
    return idx.to(node.get_dtype())[None, :, None, :].expand(B, T, H, n).contiguous()


def _unit_last_stride(ir, V, x):
    """x realized with a unit stride along its last dim: kept if its fixed layout has one (a
    head-major view does), else laid out contiguously (a flexible layout is frozen so, anything
    else copied)."""
    x = ir.ExternKernel.realize_input(x)
    layout = x.maybe_get_layout()
    if isinstance(layout, ir.FixedLayout) and \
            V.graph.sizevars.statically_known_equals(layout.stride[-1], 1):
        return x
    return ir.ExternKernel.require_contiguous(x)


def _cu_seqlens_input(cu, total):
    """Autotuning input for cu_seqlens: random offsets would send queries to keys that do not
    exist. Equal sequences over the total, as many as the graph's hint."""
    from torch._inductor.virtualized import V
    num = V.graph.sizevars.size_hint(cu.get_size()[0])
    return torch.linspace(0, V.graph.sizevars.size_hint(total), num,
                          device=cu.get_device()).to(cu.get_dtype())


def lower_selection_attention(q, k, v, block_idx, sel_block, scale, cu_seqlens=None,
                              cu_seqlens_q=None, cu_seqlens_k=None):
    from torch._inductor.lowering import fallback_handler

    def fallback():
        return fallback_handler(torch.ops.nsa.selection_attention.default,
                                add_to_fallback_set=False)(q, k, v, block_idx, sel_block, scale,
                                                           cu_seqlens, cu_seqlens_q, cu_seqlens_k)

    device = q.get_device()
    if device is None or device.type != "cuda":
        return fallback()
    api = inductor_api()
    if api is None:
        return fallback()
    V, ir = api.V, api.ir
    # the op's fake has validated the pair: cu_seqlens alone, or cu_seqlens_q with cu_seqlens_k
    cu_q = cu_seqlens if cu_seqlens is not None else cu_seqlens_q
    cu_k = cu_seqlens_k
    B, T = q.get_size()[:2]
    Tk = k.get_size()[1]
    offset = cu_k is not None or not V.graph.sizevars.statically_known_equals(T, Tk)
    # heads, head dims and slots are static: they pick the template's constexprs
    HQ, Dk, H, Dv, n = (V.graph.sizevars.guard_int(d) for d in (
        q.get_size()[2], q.get_size()[3], k.get_size()[2], v.get_size()[3],
        block_idx.get_size()[3]))
    seqlen = V.graph.sizevars.size_hint(T)
    if V.aot_compilation and getattr(T, "free_symbols", None):
        seqlen = None  # symbolic, as the op's AOTInductor decomposition routes it (nsa_ops.ops)
    x = routing.Inputs("cuda", torch.cuda.get_device_capability(device), q.get_dtype(), Dk, Dv,
                       seqlen, cu_q is not None, offset=offset)
    impl = routing.choose(_OP, x).impl
    if impl not in ("triton", "packed_sdpa"):
        return fallback()

    # the template indexes q/k/v rows by their three leading strides and block_idx densely
    q, k, v = (_unit_last_stride(ir, V, t) for t in (q, k, v))
    block_idx = ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(block_idx))
    cus = [ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(cu))
           for cu in (cu_q, cu_k) if cu is not None]
    layout = ir.FixedLayout(device, q.get_dtype(), [B, T, HQ, Dv],
                            ir.FlexibleLayout.contiguous_strides([B, T, HQ, Dv]))
    lse = api.empty_strided([B, T, HQ], None, dtype=torch.float32, device=device)
    inputs = [q, k, v, block_idx, *cus, lse]
    input_gen_fns = {3: functools.partial(_valid_block_idx, sel_block=sel_block)}
    for i, total in enumerate((T, Tk)[:len(cus)]):
        input_gen_fns[4 + i] = functools.partial(_cu_seqlens_input, total=total)

    choices: list = []
    if impl == "triton":
        from nsa_ops.kernels.selection import PER_TOKEN_CONFIGS, forward_constants
        from nsa_ops.kernels.softmax import LOG2E
        template = api.templates[("fixed", "varlen", "varlen_k")[len(cus)]]
        constants = forward_constants(HQ, H, Dk, Dv, n, sel_block, q.get_dtype())
        constants["PREC"] = repr(constants["PREC"])  # rendered into the source as a literal
        for num_warps, num_stages in PER_TOKEN_CONFIGS:
            template.maybe_append_choice(
                choices, input_nodes=inputs, layout=layout, mutated_inputs=[lse],
                call_sizes=[B, T, HQ, Dk], num_stages=num_stages, num_warps=num_warps,
                NSLOTS=n, QK_SCALE=scale * LOG2E.value, IS_VARLEN=bool(cus), **constants)
    # the extern choices take one fixed length (queries at an offset included); packed batches
    # reach packed SDPA through the opaque op, which routes at run time. An AOTInductor package
    # has no Python to call them.
    externs = []
    if not cus and not V.aot_compilation:
        if impl == "triton":
            externs.append(api.kernel)
        if routing.route(_OP, "packed_sdpa").refuse(x) is None:
            externs.append(api.packed)
    for extern in externs:
        extern.maybe_append_choice(choices, input_nodes=inputs, layout=layout,
                                   sel_block=sel_block, scale=scale)
    if not choices:
        return fallback()

    kwargs = dict(input_gen_fns=input_gen_fns)
    if "return_multi_template" in api.autotune_params:
        kwargs["return_multi_template"] = False  # lse's mutation record needs the final node
    result = api.autotune("nsa_selection_attention", choices, inputs, layout, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    node = out.data.data if isinstance(out.data, ir.StorageBox) else out.data
    if isinstance(node, ir.ExternKernel):
        node.mutation_outputs.append(ir.MutationOutput(ir.NoneLayout(device=device), lse, node))
    return out, lse


_registered = False


def register() -> bool:
    """Register the lowering with Inductor (idempotent); False if this torch cannot take it."""
    global _registered
    if _registered:
        return True
    try:
        from torch._inductor.lowering import fallback_handler, register_lowering  # noqa: F401
    except ImportError as exc:
        warnings.warn(f"nsa_ops.lowering: Inductor's register_lowering is unavailable ({exc}); "
                      f"torch.compile calls the nsa ops as opaque ops", RuntimeWarning)
        return False
    register_lowering(torch.ops.nsa.selection_attention.default, type_promotion_kind=None)(
        lower_selection_attention)
    _registered = True
    return True


def registered() -> bool:
    return _registered


def unregister() -> None:
    """Drop the lowering (tests use this to check the generic fallback)."""
    global _registered
    from torch._inductor.lowering import lowerings
    lowerings.pop(torch.ops.nsa.selection_attention.default, None)
    _registered = False
