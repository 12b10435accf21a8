"""Input validation for the nsa ops: every malformed input raises ValueError naming the argument.

Shape, dtype and device checks always run (also on fake tensors, so torch.compile reports them
at trace time). Checks that read tensor *values* (cu_seqlens monotonic, block_idx in range) run
only where that costs no device sync: on CPU tensors, or everywhere when NSA_OPS_CHECK_VALUES=1
(see nsa_ops.env) — a hidden `.item()` on CUDA would break CUDA graphs and stall the stream.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import env
from .reference import cmp_rows, num_cmp, total_cmp

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(msg: str):
    raise ValueError(msg)


def _is_concrete(x) -> bool:
    return isinstance(x, int)


def _values_readable(t: Tensor) -> bool:
    # while torch.compile traces, values are unknown (Dynamo cannot trace is_fake either); the
    # op's real kernel runs these checks again at run time
    if torch.compiler.is_compiling() or t.device.type == "meta" \
            or torch._subclasses.fake_tensor.is_fake(t):
        return False
    return t.device.type == "cpu" or env.check_values()


def check_tensor(name: str, t, rank: int, layout: str):
    if not isinstance(t, Tensor):
        _fail(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        _fail(f"{name} must have rank {rank} ({layout}), got shape {tuple(t.shape)}")


def check_float(name: str, t: Tensor, like: Optional[Tensor] = None, like_name: str = "q"):
    if t.dtype not in FLOAT_DTYPES:
        _fail(f"{name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    if like is not None and t.dtype != like.dtype:
        _fail(f"{name} must have the same dtype as {like_name} ({like.dtype}), got {t.dtype}")


def check_device(name: str, t: Tensor, like: Tensor, like_name: str = "q"):
    if t.device != like.device:
        _fail(f"{name} must be on the same device as {like_name} ({like.device}), got {t.device}")


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        _fail(f"{name} must be a positive int, got {value!r}")


def check_scale(scale) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 \
            or scale == float("inf"):
        _fail(f"scale must be a finite positive float, got {scale!r}")


def check_block_params(block_len=None, block_stride=None, sel_block=None, num_sel=None,
                       window=None) -> None:
    for name, value in (("block_len", block_len), ("block_stride", block_stride),
                        ("sel_block", sel_block), ("num_sel", num_sel), ("window", window)):
        if value is not None:
            check_positive_int(name, value)
    if block_len is not None and block_stride is not None and block_len % block_stride:
        _fail(f"block_stride must divide block_len (d | l), got block_len={block_len}, "
              f"block_stride={block_stride}")
    if sel_block is not None and block_stride is not None and sel_block % block_stride:
        _fail(f"block_stride must divide sel_block (d | l'), got sel_block={sel_block}, "
              f"block_stride={block_stride}")
    if num_sel is not None and num_sel < 3:
        _fail(f"num_sel must be >= 3 (block 0 and the two local blocks are always selected), "
              f"got {num_sel}")


def check_qkv(q, k, v, k_name: str = "k", v_name: str = "v") -> None:
    """q [B,T,HQ,Dk], k [B,S,H,Dk], v [B,S,H,Dv] with HQ % H == 0, one dtype, one device."""
    check_tensor("q", q, 4, "[B, T, HQ, Dk]")
    check_tensor(k_name, k, 4, "[B, T, H, Dk]")
    check_tensor(v_name, v, 4, "[B, T, H, Dv]")
    check_float("q", q)
    check_float(k_name, k, q)
    check_float(v_name, v, q)
    check_device(k_name, k, q)
    check_device(v_name, v, q)
    B, T, HQ, Dk = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        _fail(f"{k_name} and {v_name} must have batch size B={B} like q, got "
              f"{k_name} {tuple(k.shape)}, {v_name} {tuple(v.shape)}")
    if k.shape[3] != Dk:
        _fail(f"{k_name} must have head dim Dk={Dk} like q ([B, T, H, Dk]), got {tuple(k.shape)}")
    if Dk == 0 or v.shape[3] == 0:
        _fail(f"head dims must be >= 1, got Dk={Dk} (q, {k_name}) and Dv={v.shape[3]} ({v_name})")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        _fail(f"{v_name} must have the same length and heads as {k_name} "
              f"({tuple(k.shape[:3])}), got {tuple(v.shape)}")
    H = k.shape[2]
    if H == 0 or HQ % H != 0:
        _fail(f"q heads HQ={HQ} must be a multiple of {k_name} heads H={H} (GQA group HQ/H)")


def seqlens_pair(cu_seqlens, cu_seqlens_q, cu_seqlens_k) -> tuple:
    """(query cu_seqlens, key cu_seqlens or None for the same lengths). cu_seqlens is the
    equal-length shorthand; cu_seqlens_q and cu_seqlens_k come together, as in flash-attn."""
    if cu_seqlens is not None and (cu_seqlens_q is not None or cu_seqlens_k is not None):
        _fail("pass cu_seqlens (queries and keys of equal lengths) or cu_seqlens_q with "
              "cu_seqlens_k, not both")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        _fail(f"cu_seqlens_q and cu_seqlens_k must be given together, got "
              f"cu_seqlens_q {type(cu_seqlens_q).__name__}, cu_seqlens_k "
              f"{type(cu_seqlens_k).__name__}")
    return (cu_seqlens, None) if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k)


def check_key_length(q: Tensor, Tk, cu_seqlens: Optional[Tensor],
                     cu_seqlens_k: Optional[Tensor], name: str = "k") -> None:
    """Tk keys for q's Tq queries: Tq <= Tk with queries bottom-right aligned (fixed length);
    varlen without cu_seqlens_k: the same packed length."""
    Tq = q.shape[1]
    if cu_seqlens is None and Tk < Tq:
        _fail(f"{name} must be at least as long as q (Tq={Tq} queries sit at the last Tq of Tk "
              f"key positions), got Tk={Tk}")
    if cu_seqlens is not None and cu_seqlens_k is None and Tk != Tq:
        _fail(f"{name} must have the same packed length T={Tq} as q with cu_seqlens (give "
              f"cu_seqlens_q and cu_seqlens_k for queries at an offset), got {Tk}")


def check_seqlen_k(seqlen_k, q: Tensor, cu_seqlens: Optional[Tensor]) -> None:
    """seqlen_k: the key length of a fixed-length call whose op takes no k (compressed rows)."""
    if seqlen_k is None:
        return
    if isinstance(seqlen_k, bool) or not isinstance(seqlen_k, (int, torch.SymInt)):
        _fail(f"seqlen_k must be an int (the keys' length) or None, got {seqlen_k!r}")
    if cu_seqlens is not None:
        _fail("seqlen_k is for fixed-length input; varlen queries at an offset give "
              "cu_seqlens_q and cu_seqlens_k")
    check_key_length(q, seqlen_k, None, None, "seqlen_k")


def _check_offsets(name: str, cu: Tensor, q: Tensor, length: Optional[int]) -> None:
    """cu: int32 [N+1] sequence offsets starting at 0, non-decreasing, ending at `length` (the
    packed length they split; None where the op sees no tensor of it)."""
    check_tensor(name, cu, 1, "int32 [N+1]")
    if cu.dtype != torch.int32:
        _fail(f"{name} must be int32 [N+1], got {cu.dtype}")
    check_device(name, cu, q)
    if cu.shape[0] < 2:
        _fail(f"{name} must have N+1 >= 2 entries, got shape {tuple(cu.shape)}")
    if q.shape[0] != 1:
        _fail(f"q must have B == 1 when {name} is given (sequences packed along T), "
              f"got B={q.shape[0]}")
    if _values_readable(cu):
        if int(cu[0]) != 0 or (length is not None and int(cu[-1]) != length):
            _fail(f"{name} must start at 0 and end at T={length}, got "
                  f"[{int(cu[0])}, ..., {int(cu[-1])}]")
        if bool((cu[1:] < cu[:-1]).any()):
            _fail(f"{name} must be non-decreasing")


def check_cu_seqlens(cu_seqlens, q: Tensor) -> None:
    if cu_seqlens is not None:
        _check_offsets("cu_seqlens", cu_seqlens, q, q.shape[1])


def check_cu_seqlens_k(cu_seqlens_k, cu_seqlens: Optional[Tensor], q: Tensor,
                       Tk: Optional[int] = None) -> None:
    """cu_seqlens_k: one entry per sequence like cu_seqlens_q, each key sequence at least as long
    as its queries, ending at Tk (k's packed length) where k is given."""
    if cu_seqlens_k is None:
        return
    _check_offsets("cu_seqlens_k", cu_seqlens_k, q, Tk)
    if tuple(cu_seqlens_k.shape) != tuple(cu_seqlens.shape):
        _fail(f"cu_seqlens_k must have the shape of cu_seqlens_q {tuple(cu_seqlens.shape)} (one "
              f"entry per sequence), got {tuple(cu_seqlens_k.shape)}")
    if _values_readable(cu_seqlens_k) and _values_readable(cu_seqlens) and \
            bool((cu_seqlens_k.diff() < cu_seqlens.diff()).any()):
        _fail("cu_seqlens_k must give every sequence at least as many keys as cu_seqlens_q "
              "gives it queries (queries sit at the end of their keys)")


def check_cmp_rows(name: str, k_cmp: Tensor, q: Tensor, block_len: int, block_stride: int,
                   cu_seqlens: Optional[Tensor], seqlen_k: Optional[int] = None,
                   cu_seqlens_k: Optional[Tensor] = None) -> None:
    """k_cmp must hold exactly the emitted rows (num_cmp(T), or sum_i num_cmp(S_i) packed per
    sequence in varlen), or the padded count cmp_rows(T) = T // d + 2 that phi returns; T counts
    the keys (seqlen_k, cu_seqlens_k) when queries sit at an offset."""
    if cu_seqlens_k is not None:
        cu_seqlens = cu_seqlens_k
        if not _values_readable(cu_seqlens_k):
            return
        T = int(cu_seqlens_k[-1])
    else:
        T = q.shape[1] if seqlen_k is None else seqlen_k
    rows = k_cmp.shape[1]
    if not (_is_concrete(T) and _is_concrete(rows)):
        return
    padded = cmp_rows(T, block_stride)
    if rows == padded:
        return
    if cu_seqlens is None:
        if rows != num_cmp(T, block_len, block_stride):
            _fail(f"{name} must have num_cmp(T) = {num_cmp(T, block_len, block_stride)} rows "
                  f"(emitted), or T // block_stride + 2 = {padded} (the padded layout phi "
                  f"returns), for T={T}, l={block_len}, d={block_stride} ([B, rows, H, D]), "
                  f"got {rows}")
    elif _values_readable(cu_seqlens):
        want = total_cmp(cu_seqlens, block_len, block_stride)
        if rows != want:
            _fail(f"{name} must pack sum_i num_cmp(S_i) = {want} rows for these cu_seqlens "
                  f"(emitted), or T // block_stride + 2 = {padded} (the padded layout phi "
                  f"returns) for T={T}, got {rows}")


def check_lse(lse, q: Tensor) -> None:
    check_tensor("lse", lse, 3, "float32 [B, T, HQ]")
    if tuple(lse.shape) != tuple(q.shape[:3]):
        _fail(f"lse must have shape [B, T, HQ] = {tuple(q.shape[:3])}, got {tuple(lse.shape)}")
    if lse.dtype not in (torch.float32, torch.float64):
        _fail(f"lse must be float32 (as returned by compressed_attention), got {lse.dtype}")
    check_device("lse", lse, q)


def check_block_idx(block_idx, q: Tensor, k: Tensor, sel_block: int) -> None:
    """block_idx [B, Tq, H, n] (q's rows, k's heads), entries -1 or blocks of k's length."""
    check_tensor("block_idx", block_idx, 4, "int32 [B, T, H, n]")
    if block_idx.dtype not in (torch.int32, torch.int64):
        _fail(f"block_idx must be int32 [B, T, H, n], got {block_idx.dtype}")
    check_device("block_idx", block_idx, k, "k")
    B, T, H = k.shape[0], q.shape[1], k.shape[2]
    if tuple(block_idx.shape[:3]) != (B, T, H):
        _fail(f"block_idx must have shape [B, T, H, n] with (B, T, H) = {(B, T, H)}, "
              f"got {tuple(block_idx.shape)}")
    if _values_readable(block_idx) and block_idx.numel():
        nblk = -(-k.shape[1] // sel_block)
        lo, hi = int(block_idx.min()), int(block_idx.max())
        if lo < -1 or hi >= nblk:
            _fail(f"block_idx entries must be -1 (empty) or in [0, ceil(T/sel_block)) = "
                  f"[0, {nblk}), got values in [{lo}, {hi}]")


def check_gate(name: str, g, q: Tensor) -> None:
    check_tensor(name, g, 3, "[B, T, HQ]")
    if tuple(g.shape) != tuple(q.shape[:3]):
        _fail(f"{name} must have shape [B, T, HQ] = {tuple(q.shape[:3])}, got {tuple(g.shape)}")
    check_float(name, g)
    check_device(name, g, q)


# ---- one entry point per op, shared by the real kernels and the fake kernels ------------------

# cu_seqlens here is the queries' (seqlens_pair's first); cu_seqlens_k / seqlen_k describe keys
# that queries sit at the end of, None for the queries' own lengths.

def compressed_attention_args(q, k_cmp, v_cmp, block_len, block_stride, scale, cu_seqlens,
                              cu_seqlens_k=None, seqlen_k=None):
    check_qkv(q, k_cmp, v_cmp, "k_cmp", "v_cmp")
    check_block_params(block_len=block_len, block_stride=block_stride)
    _compressed_rows_args(q, k_cmp, block_len, block_stride, scale, cu_seqlens, cu_seqlens_k,
                          seqlen_k)


def select_blocks_args(q, k_cmp, lse, block_len, block_stride, sel_block, num_sel, scale,
                       cu_seqlens, cu_seqlens_k=None, seqlen_k=None):
    check_qkv(q, k_cmp, k_cmp, "k_cmp", "k_cmp")
    check_lse(lse, q)
    check_block_params(block_len=block_len, block_stride=block_stride, sel_block=sel_block,
                       num_sel=num_sel)
    _compressed_rows_args(q, k_cmp, block_len, block_stride, scale, cu_seqlens, cu_seqlens_k,
                          seqlen_k)


def _compressed_rows_args(q, k_cmp, block_len, block_stride, scale, cu_seqlens, cu_seqlens_k,
                          seqlen_k):
    """What compressed attention and select_blocks check alike once their tensors and block
    sizes hold: the scale, the query and key lengths, and k_cmp's rows for those keys."""
    check_scale(scale)
    check_cu_seqlens(cu_seqlens, q)
    check_cu_seqlens_k(cu_seqlens_k, cu_seqlens, q)
    check_seqlen_k(seqlen_k, q, cu_seqlens)
    check_cmp_rows("k_cmp", k_cmp, q, block_len, block_stride, cu_seqlens, seqlen_k,
                   cu_seqlens_k)


def selection_attention_args(q, k, v, block_idx, sel_block, scale, cu_seqlens,
                             cu_seqlens_k=None):
    check_qkv(q, k, v)
    check_key_length(q, k.shape[1], cu_seqlens, cu_seqlens_k)
    check_block_params(sel_block=sel_block)
    check_scale(scale)
    check_cu_seqlens(cu_seqlens, q)
    check_cu_seqlens_k(cu_seqlens_k, cu_seqlens, q, k.shape[1])
    check_block_idx(block_idx, q, k, sel_block)


def sliding_window_attention_args(q, k, v, window, scale, cu_seqlens, cu_seqlens_k=None):
    check_qkv(q, k, v)
    check_key_length(q, k.shape[1], cu_seqlens, cu_seqlens_k)
    check_block_params(window=window)
    check_scale(scale)
    check_cu_seqlens(cu_seqlens, q)
    check_cu_seqlens_k(cu_seqlens_k, cu_seqlens, q, k.shape[1])


def gate_combine_args(o_cmp, o_slc, o_win, g_cmp, g_slc, g_win):
    check_tensor("o_cmp", o_cmp, 4, "[B, T, HQ, Dv]")
    check_float("o_cmp", o_cmp)
    if (o_win is None) != (g_win is None):
        _fail("o_win and g_win must both be tensors, or both None (no window branch), got "
              f"o_win {type(o_win).__name__} and g_win {type(g_win).__name__}")
    branches = [("o_slc", o_slc)]
    gates = [("g_cmp", g_cmp), ("g_slc", g_slc)]
    if o_win is not None:
        branches.append(("o_win", o_win))
        gates.append(("g_win", g_win))
    for name, o in branches:
        check_tensor(name, o, 4, "[B, T, HQ, Dv]")
        if tuple(o.shape) != tuple(o_cmp.shape):
            _fail(f"{name} must have the shape of o_cmp {tuple(o_cmp.shape)}, got "
                  f"{tuple(o.shape)}")
        check_float(name, o)
        check_device(name, o, o_cmp, "o_cmp")
    for name, g in gates:
        check_gate(name, g, o_cmp)


def check_window(window) -> None:
    """nsa_attention's window: a positive int, or 0 for no sliding-window branch."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        _fail(f"window must be a positive int, or 0 for no sliding-window branch, got {window!r}")
