"""Other NSA implementations the benches time beside ours. Bench-only peers, never dependencies.

flash-nsa (mdy666/Scalable-Flash-Native-Sparse-Attention) is not on PyPI: its source goes into the
ignored folder `.peers/` at the repo root (`git -C <clone> archive HEAD flash_nsa | tar -x -C
.peers`), which travels to the GPU machine with the tree. Its sliding-window branch calls
flash-attn (FA3, else FA-2), which cannot be installed here; `_import_shims` gives it torch's bundled
FA-2 kernels (aten::_flash_attention_forward / backward) under the names it imports, only while
flash_nsa is imported: nsa_ops' routing looks for a real flash_attn and must not find the shim.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Callable, Optional

import torch

PEERS = Path(__file__).resolve().parents[1] / ".peers"


class _Fa2VarlenCausal(torch.autograd.Function):
    """flash_attn_varlen_func(causal=True, window_size=(left, -1)) on torch's bundled FA-2."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, left):
        o, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale,
            window_size_left=left, window_size_right=0)[:2]
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, left)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, left = ctx.args
        # dropout_p = 0: the kernel never reads the rng state these stand in for
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            do.contiguous(), q, k, v, o, lse, cu_q, cu_k, max_q, max_k, 0.0, True, seed, offset,
            scale=scale, window_size_left=left, window_size_right=0)
        return dq, dk, dv, None, None, None, None, None, None


def _fa2_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None,
                     causal=False, window_size=(-1, -1), **unused):
    if not causal or window_size[1] not in (-1, 0) or dropout_p:
        raise NotImplementedError("the bench's FA-2 shim serves causal, left-window, no dropout")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    left = window_size[0] if window_size[0] >= 0 else max_k
    return _Fa2VarlenCausal.apply(q, k, v, cu_q, cu_k, int(max_q), int(max_k), scale, left)


def _not_shimmed(name: str) -> Callable:
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{name} is not part of the bench's FA-2 shim (HFNSACore, "
                                  "the entry point timed, does not call it)")
    return refuse


def _import_shims() -> dict[str, types.ModuleType]:
    """The modules flash_nsa imports that this environment lacks: flash-attn's names over the
    bundled FA-2, and pkg_resources (gone from recent setuptools) for its Triton version test."""
    shims = {}
    if importlib.util.find_spec("pkg_resources") is None:
        from packaging.version import parse
        pkg_resources = types.ModuleType("pkg_resources")
        pkg_resources.parse_version = parse
        shims["pkg_resources"] = pkg_resources
    if importlib.util.find_spec("flash_attn") is not None:
        return shims
    flash_attn = types.ModuleType("flash_attn")
    flash_attn.flash_attn_varlen_func = _fa2_varlen_func
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._wrapped_flash_attn_varlen_backward = _not_shimmed("_wrapped_flash_attn_varlen_backward")
    flash_attn.flash_attn_interface = interface
    cuda = types.ModuleType("flash_attn_2_cuda")
    cuda.varlen_fwd = _not_shimmed("flash_attn_2_cuda.varlen_fwd")
    shims.update({"flash_attn": flash_attn, "flash_attn.flash_attn_interface": interface,
                  "flash_attn_2_cuda": cuda})
    return shims


@contextlib.contextmanager
def _shimmed_imports():
    """_import_shims() in sys.modules for the duration of the block only."""
    shims = _import_shims()
    sys.modules.update(shims)
    try:
        yield
    finally:
        for name in shims:
            sys.modules.pop(name, None)


def load_flash_nsa(root: Path = PEERS) -> tuple[Optional[types.ModuleType], str]:
    """(the flash_nsa package, "") or (None, why not)."""
    if not (root / "flash_nsa" / "__init__.py").is_file():
        return None, f"no flash_nsa source under {root} (see bench/peers.py)"
    sys.path.insert(0, str(root))
    try:
        with _shimmed_imports():
            import flash_nsa
    except Exception as exc:  # e.g. a Triton it was not written for: the table says so
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        sys.path.remove(str(root))
    return flash_nsa, ""


def flash_nsa_core(flash_nsa: types.ModuleType, cfg) -> torch.nn.Module:
    """flash-nsa's HFNSACore (mean pooling, sigmoid gate) at cfg's geometry, configured to the
    spec's semantics where its config reaches them. Constructing it sets flash-nsa's global
    hyperparameters (NSAHelper), which its functional ops read too."""
    return flash_nsa.HFNSACore(flash_nsa.NSAConfig(
        head_dim=cfg.head_dim_qk, qk_head_dim=cfg.head_dim_qk, v_head_dim=cfg.head_dim_v,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, kernel_size=cfg.block_len,
        stride=cfg.block_stride, block_size=cfg.sel_block, top_n=cfg.num_sel,
        # FA's window_size=(w, -1) covers w + 1 keys, the spec's window w keys
        num_init_blocks=1, num_local_blocks=2, window_size=cfg.window - 1))


def flash_nsa_method(cfg) -> tuple[Optional[Callable], str]:
    """flash-nsa's HFNSACore at cfg's geometry as a bench method run(q, k, v, gates), or (None,
    why not). q/k/v are [1, T, heads, D]; gates carry `.logits` [T, HQ, 3], which flash-nsa passes
    through a sigmoid itself (its fused combine)."""
    flash_nsa, why = load_flash_nsa()
    if flash_nsa is None:
        return None, why
    core = flash_nsa_core(flash_nsa, cfg)
    cu_seqlens = {}

    def run(q, k, v, gates):
        T = q.shape[1]
        if q.shape[0] != 1:
            raise ValueError(f"q: flash_nsa_method times B == 1, got B={q.shape[0]}")
        if T not in cu_seqlens:
            cu_seqlens[T] = torch.tensor([0, T], dtype=torch.int32, device=q.device)
        return core.to(q)(q[0], k[0], v[0], gates.logits, cu_seqlens[T]).unsqueeze(0)
    return run, ""
