"""NSACache: the decode state of one NSA layer, per branch as in NSA-SPEC.md "Decode".

* selection: K/V of every cached token, ``[B, capacity, H, D]`` (positions 0..length-1);
* window: the last ``w`` tokens, served as a view of the selection K/V (``window_kv``): every
  token is already cached there, so a separate ring copy would only double the writes;
* compression: compressed K/V rows ``[B, num_cmp(capacity) + 1, H, D]``; block i is emitted by
  the ``append`` that makes ``length >= i*d + l``, i.e. once position i*d + l - 1 is cached. The
  raw tokens a future block needs are the newest ``l - 1`` (at most) rows of the selection K/V, so
  nothing else is kept for it. The extra last row is a write-off slot for `append_token`, which
  computes phi at every step and must write it somewhere when no block completes.

Keys are stored after RoPE, as attention and phi see them. ``capacity`` set: every tensor is
allocated once at construction and written in place (addresses never change, so a GPU decode
step can be CUDA-graph captured); appending past it raises. ``capacity=None``: storage grows by
doubling. The batch shares one length (B >= 1 sequences of equal length).

The length lives twice: ``length`` (host int, for shapes and checks) and ``device_length``
(int64 [1] on the cache's device, what the decode kernel and a CUDA-graph step read). ``append``
and ``reset`` keep both; `append_token` advances both without the host ever branching on device
values, so it can be captured in a CUDA graph (a replay advances only ``device_length``: whoever
replays bumps ``length``, as `nsa_ops.NSAAttention.cuda_graph_decoder` does).

The per-step read counter (``last_reads``, int64 [Tq], one entry per query row of the last
step) is written by `nsa_ops.decode.decode_attention`; see there for how rows are counted.
"""
from __future__ import annotations

import copy

from typing import Optional

import torch
from torch import Tensor

from .config import NSAConfig

_GROW_MIN = 256


class NSACache:
    def __init__(self, config: NSAConfig, batch_size: int = 1, capacity: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        config.validate()
        for name, value in (("batch_size", batch_size), ("capacity", capacity)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.config = config
        self.batch_size = batch_size
        self.capacity = capacity
        self.length = 0
        self.last_reads: Optional[Tensor] = None
        self.total_reads = torch.zeros((), dtype=torch.int64, device=device)
        self.device_length = torch.zeros(1, dtype=torch.int64, device=device)
        self._block_offsets = torch.arange(config.block_len, device=device)
        self._alloc(capacity or _GROW_MIN, dtype, torch.device(device))

    def _alloc(self, tokens: int, dtype, device) -> None:
        c, B, H = self.config, self.batch_size, self.config.num_kv_heads
        rows = c.num_cmp(tokens) + 1  # + the write-off row of append_token
        # zeros, not empty: masked-out rows still enter p @ v, where 0 * NaN garbage would be NaN
        self.k = torch.zeros(B, tokens, H, c.head_dim_qk, dtype=dtype, device=device)
        self.v = torch.zeros(B, tokens, H, c.head_dim_v, dtype=dtype, device=device)
        self.k_cmp = torch.zeros(B, rows, H, c.head_dim_qk, dtype=dtype, device=device)
        self.v_cmp = torch.zeros(B, rows, H, c.head_dim_v, dtype=dtype, device=device)

    def _grow(self, need: int) -> None:
        old_k, old_v, old_k_cmp, old_v_cmp = self.k, self.v, self.k_cmp, self.v_cmp
        self._alloc(max(need, 2 * self.k.shape[1]), self.k.dtype, self.k.device)
        n, rows = self.length, self.num_cmp  # only the valid prefix is ever read
        self.k[:, :n], self.v[:, :n] = old_k[:, :n], old_v[:, :n]
        self.k_cmp[:, :rows], self.v_cmp[:, :rows] = old_k_cmp[:, :rows], old_v_cmp[:, :rows]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def num_cmp(self) -> int:
        """Compressed rows emitted so far: num_cmp(length)."""
        return self.config.num_cmp(self.length)

    def reset(self) -> None:
        """Forget every token; static storage is kept (and reused in place)."""
        self.length = 0
        self.device_length.zero_()
        self.last_reads = None
        self.total_reads.zero_()

    def append(self, k: Tensor, v: Tensor, phi_k, phi_v) -> None:
        """Cache k [B,Tq,H,Dk] (rotated) and v [B,Tq,H,Dv]; emit the blocks they complete.

        phi_k / phi_v map tokens [B,T,H,D] to rows [B,rows,H,D] (phi(x, l, d, None)), row i
        block i; rows past num_cmp(T) (the padded layout of `reference.cmp_rows`) are dropped.
        Stored detached: decode is inference, training runs the prefill path.
        """
        self._check(k, v)
        old, new = self.length, self.length + k.shape[1]
        self.reserve(k.shape[1])
        self.k[:, old:new] = k.detach()
        self.v[:, old:new] = v.detach()
        self.length = new
        self.device_length.fill_(new)
        c = self.config
        first, last = c.num_cmp(old), c.num_cmp(new)
        if last > first:
            # the token span of blocks first..last-1; phi over it yields exactly those rows
            lo, hi = first * c.block_stride, (last - 1) * c.block_stride + c.block_len
            n = last - first
            with torch.no_grad():
                self.k_cmp[:, first:last] = phi_k(self.k[:, lo:hi], c.block_len, c.block_stride,
                                                  None)[:, :n]
                self.v_cmp[:, first:last] = phi_v(self.v[:, lo:hi], c.block_len, c.block_stride,
                                                  None)[:, :n]

    def fork(self) -> "NSACache":
        """An independent copy (tensors cloned): one cached prefix, several continuations."""
        twin = copy.copy(self)
        for name in ("k", "v", "k_cmp", "v_cmp", "total_reads", "device_length"):
            setattr(twin, name, getattr(self, name).clone())
        return twin

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more tokens: grow a growing cache, raise if a static one is
        full."""
        need = self.length + tokens
        if need <= self.k.shape[1]:
            return
        if self.capacity is not None:
            raise RuntimeError(f"NSACache is full: capacity={self.capacity} tokens, "
                               f"{self.length} cached, cannot append {tokens} more; allocate a "
                               f"larger capacity (or capacity=None to grow) or reset() it")
        self._grow(need)

    def append_token(self, k: Tensor, v: Tensor, phi_k, phi_v) -> None:
        """Cache one token per sequence, k [B,1,H,Dk] (rotated), v [B,1,H,Dv], at position
        ``device_length``: CUDA-graph safe (device-side positions, no host branch on values).

        phi runs at every step over the newest l tokens; the result lands in row
        (p - l + 1) / d when that block completes at p, else in the write-off row. The host
        ``length`` is advanced too (by one), so eager callers see the same state as after append.
        """
        self._check(k, v)
        if k.shape[1] != 1:
            raise ValueError(f"k must hold one token per sequence ([B, 1, H, Dk]), "
                             f"got {tuple(k.shape)}")
        self.reserve(1)
        c = self.config
        pos = self.device_length.clone()
        self.k.index_copy_(1, pos, k.detach())
        self.v.index_copy_(1, pos, v.detach())
        self.device_length.add_(1)
        self.length += 1
        first = pos - (c.block_len - 1)  # first token of the block that would end at pos
        tokens = (first + self._block_offsets).clamp_min(0)
        complete = (first >= 0) & (first % c.block_stride == 0)
        row = torch.where(complete, first // c.block_stride, self.k_cmp.shape[1] - 1)
        with torch.no_grad():
            # the one block of these l tokens is row 0 of phi's (possibly padded) output
            self.k_cmp.index_copy_(1, row, phi_k(self.k.index_select(1, tokens), c.block_len,
                                                 c.block_stride, None)[:, :1])
            self.v_cmp.index_copy_(1, row, phi_v(self.v.index_select(1, tokens), c.block_len,
                                                 c.block_stride, None)[:, :1])

    def _check(self, k: Tensor, v: Tensor) -> None:
        c = self.config
        want_k = (self.batch_size, k.shape[1], c.num_kv_heads, c.head_dim_qk)
        want_v = (self.batch_size, k.shape[1], c.num_kv_heads, c.head_dim_v)
        if k.dim() != 4 or tuple(k.shape) != want_k:
            raise ValueError(f"k must have shape [B, Tq, H, Dk] = {want_k}, got {tuple(k.shape)}")
        if v.dim() != 4 or tuple(v.shape) != want_v:
            raise ValueError(f"v must have shape [B, Tq, H, Dv] = {want_v}, got {tuple(v.shape)}")
        for name, t in (("k", k), ("v", v)):
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError(f"{name} must be {self.dtype} on {self.device} like the cache, "
                                 f"got {t.dtype} on {t.device} (build the cache in k's dtype: "
                                 f"module.new_cache() under the autocast that decoding runs "
                                 f"in, or new_cache(dtype=...))")

    # ---- per-branch views over the valid prefix ---------------------------------------------

    def selection_kv(self) -> tuple[Tensor, Tensor]:
        """K/V of all cached tokens, [B, length, H, D]."""
        return self.k[:, :self.length], self.v[:, :self.length]

    def compressed_kv(self) -> tuple[Tensor, Tensor]:
        """Emitted compressed rows, [B, num_cmp(length), H, D]."""
        return self.k_cmp[:, :self.num_cmp], self.v_cmp[:, :self.num_cmp]

    def window_kv(self, first_query: int) -> tuple[Tensor, Tensor, int]:
        """Tokens some query at position >= first_query may see in its window: (k, v, start)."""
        start = max(0, first_query - self.config.window + 1)
        return self.k[:, start:self.length], self.v[:, start:self.length], start
