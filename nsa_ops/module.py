"""NSAAttention: the user-facing NSA layer (projections, RoPE, phi, gate MLP, GQA, decode cache)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import distributed, reference, routing
from .cache import NSACache
from .compression import PhiMLP, ZeroLinear
from .config import BRANCHES, NSAConfig
from .decode import decode_attention
from .functional import nsa_attention
from .stats import LayerStats
from . import validation as check


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary embedding (rotate-half pairing) of x [B,T,heads,D] at positions pos [T]."""
    D = x.shape[-1]
    cdt = reference.compute_dtype(x.dtype)
    inv_freq = theta ** -(torch.arange(0, D, 2, device=x.device, dtype=cdt) / D)
    angle = pos.to(cdt)[:, None] * inv_freq[None]  # [T, D/2]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[None, :, None]
    sin = torch.cat([angle.sin(), angle.sin()], -1)[None, :, None]
    xc = x.to(cdt)
    x1, x2 = xc[..., :D // 2], xc[..., D // 2:]
    return (xc * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class AttentionProjections(nn.Module):
    """The q/k/v/o projections and RoPE of an attention layer with this config's heads. Subclasses
    (NSAAttention, the training showcase's dense baseline) create these four first, so equal
    seeds give them equal weights.

    ``context_parallel_group``, a torch.distributed process group (e.g. ``dist.group.WORLD``),
    splits each sequence over its ranks: the layer then takes this rank's zigzag share of the
    tokens (`nsa_ops.distributed.shard`) and attends over the whole sequence."""

    context_parallel_group = None

    def __init__(self, config: NSAConfig):
        super().__init__()
        config.validate()
        self.config = c = config
        HQ, H = c.num_heads, c.num_kv_heads
        self.q_proj = nn.Linear(c.hidden_size, HQ * c.head_dim_qk, bias=c.bias)
        self.k_proj = nn.Linear(c.hidden_size, H * c.head_dim_qk, bias=c.bias)
        self.v_proj = nn.Linear(c.hidden_size, H * c.head_dim_v, bias=c.bias)
        self.o_proj = nn.Linear(HQ * c.head_dim_v, c.hidden_size, bias=c.bias)

    def _qkv(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B,T,HQ,Dk] and k [B,T,H,Dk] rotated at positions pos, v [B,T,H,Dv]."""
        c = self.config
        q = self.q_proj(x).unflatten(-1, (c.num_heads, c.head_dim_qk))
        k = self.k_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim_qk))
        v = self.v_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim_v))
        return rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta), v

    def _shard_positions(self, T: int, device) -> Tensor:
        """The positions, in the whole sequence, of this rank's T tokens under context
        parallelism."""
        group = self.context_parallel_group
        return distributed.shard(torch.arange(T * dist.get_world_size(group), device=device),
                                 group, dim=0)


class NSAAttention(AttentionProjections):
    """x [B,T,hidden] -> [B,T,hidden] through Native Sparse Attention (NSA-SPEC.md).

    RoPE rotates q and k before phi, so compressed keys are pooled from rotated keys. The gate MLP
    reads x and yields one gate per query head and branch; its last layer starts at zero, so the
    gates start at act(0): 0.5 each (sigmoid) or 1/3 each (softmax over the 3 branches).
    ``config.force_branch`` ("cmp" | "sel" | "win"), a diagnostic for ablations, zeroes the
    other two gates. `record_stats` turns on gate and selection statistics. `reset_parameters`
    initialises the layer again as construction did (after `to_empty` on a layer built on the
    meta device, say): the same weights for the same seed.
    """
    _stats: Optional[LayerStats] = None

    def __init__(self, config: NSAConfig):
        super().__init__(config)
        c = config
        self.gate = nn.Sequential(nn.Linear(c.hidden_size, c.hidden_size, bias=c.bias), nn.SiLU(),
                                  ZeroLinear(c.hidden_size, 3 * c.num_heads, bias=c.bias))
        if c.phi == "mlp":
            self.phi_k = PhiMLP(c.block_len, c.head_dim_qk)
            self.phi_v = PhiMLP(c.block_len, c.head_dim_v)
        else:
            self.phi_k = self.phi_v = reference.compress_mean

    def reset_parameters(self) -> None:
        """Every submodule's `reset_parameters`, in the order construction initialised them."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def kv_dtype(self) -> torch.dtype:
        """The dtype k and v leave the projections in, here and now: autocast's dtype while
        autocast is on for the weights' device (it leaves float64 alone), else the weights'."""
        w = self.k_proj.weight
        dev = w.device.type
        if torch.is_autocast_enabled(dev) and w.dtype != torch.float64:
            return torch.get_autocast_dtype(dev)
        return w.dtype

    def new_cache(self, batch_size: int = 1, capacity: Optional[int] = None,
                  dtype: Optional[torch.dtype] = None) -> NSACache:
        """An empty cache on this module's device, in ``dtype`` (default: `kv_dtype`, so a cache
        made under the autocast that decoding runs in matches its k and v); capacity defaults
        to max_position when the config sets one, None grows on demand."""
        w = self.q_proj.weight
        return NSACache(self.config, batch_size, capacity or self.config.max_position,
                        dtype=dtype or self.kv_dtype(), device=w.device)

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(g_cmp, g_slc, g_win), each [B,T,HQ], activated."""
        g = self.gate(x).unflatten(-1, (self.config.num_heads, 3))
        g = torch.sigmoid(g) if self.config.gate_act == "sigmoid" else torch.softmax(g, -1)
        forced = self.config.force_branch
        if forced is not None:
            keep = torch.tensor([b == forced for b in BRANCHES], dtype=g.dtype, device=g.device)
            g = g * keep
        if self._stats is not None:
            self._stats.add_gates(g.unbind(-1))
        return g.unbind(-1)

    def record_stats(self, enabled: bool = True, max_distance: int = 64) -> None:
        """Start (from zero) or stop recording gate statistics (every path) and selected-block
        distances (prefill without context parallelism): on-device sums, no host sync in the
        step. Off by default, and then nothing is computed. `stats()` reads them."""
        self._stats = LayerStats(max_distance, self.q_proj.weight.device) if enabled else None

    def stats(self) -> dict:
        """{"gates": {branch: (mean, std)}, "distance": counts per block distance, the last bin
        every distance >= max_distance} since `record_stats` (reads the device: a host sync)."""
        if self._stats is None:
            raise ValueError("stats: call record_stats() first, nothing is being recorded")
        return self._stats.summary()

    def _check_positions(self, end: int) -> None:
        limit = self.config.max_position
        if limit is not None and end > limit:
            raise ValueError(f"positions must be < max_position={limit}, got a sequence of "
                             f"{end} tokens")

    def forward(self, x: Tensor, cache: Optional[NSACache] = None,
                cu_seqlens: Optional[Tensor] = None) -> Tensor:
        """Prefill (cache=None): x [B,T,hidden], or varlen B == 1 with cu_seqlens int32 [N+1].
        Decode (cache given): x holds the next Tq tokens of every sequence; they are appended to
        the cache and their outputs returned (equal to the prefill outputs at those positions)."""
        check.check_tensor("x", x, 3, "[B, T, hidden]")
        if x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"x must have hidden size {self.config.hidden_size} "
                             f"([B, T, hidden]), got {tuple(x.shape)}")
        c = self.config
        B, T, _ = x.shape
        group = self.context_parallel_group
        if group is not None and (cache is not None or cu_seqlens is not None):
            raise ValueError("cache and cu_seqlens must be None while context_parallel_group is "
                             "set (context parallelism takes fixed-length prefill shards)")
        geometry = dict(block_len=c.block_len, block_stride=c.block_stride,
                        sel_block=c.sel_block, num_sel=c.num_sel, window=c.window,
                        phi=(self.phi_k, self.phi_v), scale=c.scale)
        if group is not None:
            pos = self._shard_positions(T, x.device)
            self._check_positions(T * dist.get_world_size(group))
            q, k, v = self._qkv(x, pos)
            o = distributed.context_parallel_nsa_attention(q, k, v, *self.gates(x), group=group,
                                                           **geometry)
        elif cache is None:
            check.check_cu_seqlens(cu_seqlens, x)
            _, pos = reference.token_layout(T, cu_seqlens, x.device)
            if c.max_position is not None and T > c.max_position:
                # no sequence is longer than T, so the lengths need reading only past the limit,
                # and like every value check only where that costs no device sync
                if cu_seqlens is None:
                    self._check_positions(T)
                elif check._values_readable(cu_seqlens):
                    self._check_positions(int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
            q, k, v = self._qkv(x, pos)
            record = None
            if self._stats is not None:
                stats = self._stats
                record = lambda idx: stats.add_selection(idx, pos, c.sel_block)  # noqa: E731
            o = nsa_attention(q, k, v, *self.gates(x), cu_seqlens=cu_seqlens, **geometry,
                              on_block_idx=record)
        else:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens must be None when decoding with a cache "
                                 "(a cache holds B sequences of equal length)")
            if cache.config != c:
                raise ValueError("cache must be built for this module's config "
                                 "(use module.new_cache())")
            self._check_positions(cache.length + T)
            pos = torch.arange(cache.length, cache.length + T, device=x.device)
            q, k, v = self._qkv(x, pos)
            cache.append(k, v, self.phi_k, self.phi_v)
            o = decode_attention(q, cache, *self.gates(x), scale=c.scale)
        return self.o_proj(o.flatten(-2))

    def cuda_graph_decoder(self, cache: NSACache) -> Callable[[Tensor], Tensor]:
        """One decode step captured in a CUDA graph: ``step(x_t [B,1,hidden]) -> y_t [B,1,hidden]``.

        ``step`` copies x_t into the graph's static input, replays, advances ``cache.length``
        and returns the graph's static output (overwritten by the next step: clone to keep it).
        Positions (RoPE, cache slots, compressed-row emission, the kernel's length) come from
        ``cache.device_length``, so one capture serves every later step. Eager calls
        ``self(x, cache)`` may be mixed in between: both paths keep the two lengths in sync.
        Needs a CUDA cache with static capacity (a CUDA graph replays fixed addresses) and the
        Triton decode kernel (the reference reads the length on the host). The step runs in the
        autocast state of this call (cache in `kv_dtype`); replays need no autocast around them.
        """
        c = self.config
        w = self.q_proj.weight
        if cache.config != c:
            raise ValueError("cache must be built for this module's config "
                             "(use module.new_cache())")
        if cache.capacity is None:
            raise ValueError("cache must have a static capacity for CUDA-graph decoding, e.g. "
                             "module.new_cache(batch_size, capacity=N): a growing cache "
                             "reallocates its tensors, and a graph replays fixed addresses")
        kv_dtype = self.kv_dtype()
        if cache.device.type != "cuda" or cache.device != w.device or cache.dtype != kv_dtype:
            raise ValueError(f"cache must be a CUDA cache on the module's device in the dtype "
                             f"of its k and v ({kv_dtype} on {w.device}: module.new_cache() "
                             f"under the same autocast), got {cache.dtype} on {cache.device}")
        B = cache.batch_size
        dev = w.device.type
        amp = dict(device_type=dev, dtype=torch.get_autocast_dtype(dev),
                   enabled=torch.is_autocast_enabled(dev))
        query_like = torch.empty(B, 1, c.num_heads, c.head_dim_qk, dtype=kv_dtype,
                                 device=w.device)
        x = routing.Inputs.of_cache(query_like, cache)
        if routing.choose("decode", x).impl != "triton":
            reasons = "; ".join(f"{impl}: {why}" for impl, why in routing.explain("decode", x))
            raise ValueError(f"CUDA-graph decoding needs the triton decode kernel, which reads "
                             f"the length on device; routing says {reasons}")
        cache.reserve(1)
        static_x = torch.zeros(B, 1, c.hidden_size, dtype=w.dtype, device=w.device)

        def body() -> Tensor:
            # autocast's weight-cast cache would hand the capture casts made before it, freed
            # when the caller's autocast exits: without it, the casts are captured too
            with torch.autocast(**amp, cache_enabled=False):
                q, k, v = self._qkv(static_x, cache.device_length)
                cache.append_token(k, v, self.phi_k, self.phi_v)
                o = decode_attention(q, cache, *self.gates(static_x), scale=c.scale)
                return self.o_proj(o.flatten(-2))

        last_reads, total_reads = cache.last_reads, cache.total_reads.clone()
        with torch.no_grad():
            # compile the Triton kernels outside the capture; the token this appends at slot
            # `length` is overwritten (with its compressed row) by the first real step
            side = torch.cuda.Stream(w.device)
            side.wait_stream(torch.cuda.current_stream(w.device))
            with torch.cuda.stream(side):
                body()
                cache.length -= 1
                cache.device_length.fill_(cache.length)
                cache.total_reads.copy_(total_reads)
            torch.cuda.current_stream(w.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = body()
        cache.length -= 1  # capturing ran no kernel: undo append_token's host-side advance
        static_reads, cache.last_reads = cache.last_reads, last_reads

        def step(x_t: Tensor) -> Tensor:
            if tuple(x_t.shape) != (B, 1, c.hidden_size):
                raise ValueError(f"x_t must be [B, 1, hidden] = [{B}, 1, {c.hidden_size}], got "
                                 f"{tuple(x_t.shape)}")
            cache.reserve(1)
            self._check_positions(cache.length + 1)
            static_x.copy_(x_t)
            graph.replay()
            cache.length += 1
            cache.last_reads = static_reads
            return static_y
        return step
