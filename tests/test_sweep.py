"""Geometry sweep: every input validation accepts is computed right by every route that would
serve it, or refused by the routing table with a reason.

Each draw (seeded, so a failure reproduces by its id) picks from what validation accepts:
B, T, H, G = HQ/H, Dk, Dv, scale; block_len l = d*{1..4}, block_stride d, sel_block l' = any
multiple of d, num_sel n >= 3, window w (1, inside T, or past T); fixed-length or varlen
(cu_seqlens with empty and shorter-than-l sequences); the layout of every tensor argument
(helpers.LAYOUTS: token-major, head-major, slices of a wider last dim / of T / of fused heads,
a non-unit stride along D; the upstream do and dlse too); block_idx in ascending spec order,
shuffled, with duplicates and -1 anywhere, or uniformly random (future blocks included), as
int32 or int64, contiguous or a strided view; k_cmp / v_cmp with the emitted row count or,
where validation accepts it, the padded one (reference.cmp_rows; padding rows hold large values);
gates as strided slices; mixed gate dtypes; the gate's window branch present or not. The axes the
issue is about (q's layout, block_idx order, l'/d, fp16 on CPU) cycle with the draw index, so
every list of draws covers them (test_draws_cover_the_space).

Per op and draw:
* the op itself (torch.ops.nsa.*, forward and backward ops, dlse random and None) against the
  reference run in float64 on contiguous copies: values, dtypes, and contiguous outputs and
  gradients (what the ops' fake kernels promise);
* every route of the routing table that would serve the draw on a CUDA sm90 device (the Inputs
  the op builds, with device and SM faked; asked with the route forced, so preferences are
  lifted) and runs on CPU tensors: its implementation called directly (Triton kernels through
  TRITON_INTERPRET, packed SDPA), forward and backward, against the same reference (the routes
  that need CUDA, FA-2 and cuDNN, run in the GPU variant). A route that refuses must give a
  non-empty reason.
On CPU (16 draws per op, 12 for selection attention, T = 32..130: about 3-4 minutes in the
interpreter on 2 cores) outputs are compared elementwise with helpers.TOL; on the GPU (-m gpu:
24 larger draws, T up to 3000, head dims up to 320, bf16/fp16/fp32) by relative Frobenius error
(the elementwise atol where the reference is ~0), through torch.ops.nsa with the real routing,
then with each serving route forced by NSA_OPS_FORCE_IMPL_<OP>. select_blocks is checked by the
selection property (structure, forced blocks, no unselected block outscores a selected one by
more than a rounding tolerance), since near-tied scores may order differently.

Per draw, the layer too: nsa_attention (on the GPU the eager layer's fused routes: the gated
combine in the selection walk, the shared pass, stored dS, the early index) on the draw's layouts,
gate dtype and grads, window branch and varlen, every third fixed-length draw with its queries
at an offset (the last third of the rows, keys whole), block_idx its own selection (handed to
the reference) or the draw's; forward and every gradient against the float64 reference (offset
queries: those rows of the full-length call).

Every failure of a case is collected and reported together: which route, which output, the
largest error or the exception.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

import nsa_ops
from nsa_ops import reference as ref
from nsa_ops import routing, validation
from helpers import (INDEX_LAYOUTS, LAYOUTS, ROW_LAYOUTS, TOL, cu_seqlens, in_layout,
                     index_in_layout, poisoned_empty, rel_err, rows_in_layout)

SEED = 5150
CPU_DRAWS = 16          # per op; the interpreter is slow (see _draw's size bounds)
CPU_SELECTION_DRAWS = 12
GPU_DRAWS = 24
FAKE_SM = (9, 0)        # the SM the CPU sweep asks the routing table about
# routes whose implementations run on CPU tensors (Triton kernels through the interpreter)
CPU_IMPLS = ("triton", "packed_sdpa", "reference")
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
# GPU: relative Frobenius error of outputs (gradients: twice that) against the float64 reference
GPU_REL = {F32: 1e-5, F16: 1e-2, BF16: 2e-2}
# GPU: largest |lse - reference| on rows that see something
GPU_LSE = {F32: 1e-5, F16: 1e-2, BF16: 2e-2}
# select_blocks: an unselected block may outscore a selected one by at most this (rounding)
SELECT_TOL = {F32: 1e-5, F16: 1e-4, BF16: 1e-3}


# --------------------------------------------------------------------------------------------
# Draws
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Draw:
    index: int
    device: str
    dtype: torch.dtype
    B: int
    T: int
    H: int
    G: int
    Dk: int
    Dv: int
    l: int
    d: int
    lp: int
    n: int
    w: int
    scale: float
    lengths: Optional[tuple]
    # layouts (helpers.LAYOUTS / ROW_LAYOUTS / INDEX_LAYOUTS)
    q: str
    k: str
    v: str
    k_cmp: str
    v_cmp: str
    do: str
    dlse: str
    lse: str
    bi_order: str
    bi_layout: str
    bi_dtype: torch.dtype
    # gate_combine
    window_branch: bool
    gate_dtype: torch.dtype
    o_layouts: tuple
    g_layouts: tuple
    gate_grads: bool
    # k_cmp / v_cmp with the padded row count phi returns, where validation accepts it
    cmp_padded: bool

    @property
    def HQ(self) -> int:
        return self.H * self.G

    @property
    def id(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        s = (f"{self.index:02d}-{dt}-B{self.B}T{self.T}H{self.H}G{self.G}-D{self.Dk}x{self.Dv}"
             f"-l{self.l}d{self.d}s{self.lp}n{self.n}w{self.w}")
        if self.lengths is not None:
            s += "-cu" + "_".join(map(str, self.lengths))
        return s

    def cu(self) -> Optional[torch.Tensor]:
        return None if self.lengths is None else cu_seqlens(self.lengths, self.device)


BI_ORDERS = ("spec", "shuffled", "dups", "random")
LP_MULTIPLES = (1, 3, 2, 6, 4, 12, 8)  # l' = d * these: powers of two and not


def _draw(rng: random.Random, index: int, device: str) -> Draw:
    gpu = device == "cuda"
    d = rng.choice((8, 16, 16, 32, 64) if gpu else (4, 8, 8, 16, 16))
    l = d * rng.choice((1, 2, 2, 3, 4))
    lp = d * LP_MULTIPLES[index % len(LP_MULTIPLES)]
    if gpu:
        T = rng.choice((rng.randint(40, 300), rng.randint(300, 3000)))
        G = rng.choice((1, 2, 3, 4, 8, 16))
        # the float64 reference's [B, H, G, 256, T] score chunks stay within ~0.5 GiB
        B, H = rng.choice([(b, h) for b in (1, 2, 3) for h in (1, 2, 4, 8)
                           if b * h * G * T <= 2 ** 18] or [(1, 1)])
        Dk = rng.choice((16, 32, 40, 64, 64, 96, 128, 128, 192, 256, 320))
        Dv = Dk if rng.random() < 0.6 else rng.choice((32, 64, 128, 256))
        n = rng.randint(3, 20)
        dtype = rng.choice((BF16, F16, F32))
    else:
        # the interpreter's cost grows with the programs (B*H*T for selection, B*HQ*T rows
        # for the others) times the key tiles each one visits: bounded here
        T = rng.randint(40, 130)
        B, H = rng.choice([(b, h) for b in (1, 2) for h in (1, 2, 3) if b * h * T <= 140])
        G = rng.choice([g for g in (1, 2, 3, 4, 8, 16) if B * H * g * T <= 1100])
        Dk = rng.choice((8, 16, 24, 32, 48, 64))
        Dv = Dk if rng.random() < 0.5 else rng.choice((8, 16, 24, 32, 40))
        n = max(3, min(rng.randint(3, 7), 128 // lp))  # n * l' keys per query, bounded
        dtype = F16 if index % 5 == 2 else F32  # cycles: no reseed can drop fp16
    if rng.random() < 0.3:  # T a multiple of d (the cuDNN compressed route needs it)
        T = max(d, T - T % d)
    w = rng.choice((1, rng.randint(2, T), rng.randint(2, T), T + rng.randint(0, 64)))
    lengths = None
    if rng.random() < 0.25:
        B = 1
        cuts = sorted(rng.randint(0, T) for _ in range(rng.choice((1, 2, 3))))
        bounds = [0, *cuts, T]
        lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    gate_dtype = dtype if dtype == F32 or rng.random() < 0.7 else F32
    return Draw(
        index=index, device=device, dtype=dtype, B=B, T=T, H=H, G=G, Dk=Dk, Dv=Dv, l=l, d=d,
        lp=lp, n=n, w=w, scale=Dk ** -0.5 * rng.choice((0.5, 1.0, 1.0, 2.0)), lengths=lengths,
        # the axes the issue is about cycle, so that every draw list of 4+ (6+) covers them
        q=LAYOUTS[index % len(LAYOUTS)], k=rng.choice(LAYOUTS), v=rng.choice(LAYOUTS),
        k_cmp=rng.choice(LAYOUTS), v_cmp=rng.choice(LAYOUTS), do=rng.choice(LAYOUTS),
        dlse=rng.choice(ROW_LAYOUTS), lse=rng.choice(ROW_LAYOUTS),
        bi_order=BI_ORDERS[index % len(BI_ORDERS)],
        bi_layout=rng.choice(INDEX_LAYOUTS), bi_dtype=rng.choice((torch.int32, torch.int64)),
        window_branch=rng.random() < 0.7, gate_dtype=gate_dtype,
        o_layouts=tuple(rng.choice(LAYOUTS) for _ in range(3)),
        g_layouts=tuple(rng.choice(ROW_LAYOUTS) for _ in range(3)),
        gate_grads=rng.random() < 0.7, cmp_padded=rng.random() < 0.4)


def _draws(count: int, device: str, seed: int) -> list[Draw]:
    rng = random.Random(seed)
    return [_draw(rng, i, device) for i in range(count)]


CPU_CASES = _draws(CPU_DRAWS, "cpu", SEED)
GPU_CASES = _draws(GPU_DRAWS, "cuda", SEED + 1)


def _params(draws: list[Draw], gpu: bool = False):
    marks = [pytest.mark.gpu] if gpu else []
    return [pytest.param(x, id=x.id, marks=marks) for x in draws]


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

class _Data:
    """Seeded random values (never zeros) for one draw and op, made in float64 on CPU."""

    def __init__(self, draw: Draw, salt: int):
        self.draw = draw
        self.gen = torch.Generator().manual_seed(SEED * 1000 + draw.index * 10 + salt)

    def randn(self, *shape, dtype=None) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen, dtype=F64)
        return x.to(device=self.draw.device, dtype=dtype or self.draw.dtype)

    def rand(self, *shape, dtype=None) -> torch.Tensor:
        x = torch.rand(*shape, generator=self.gen, dtype=F64) + 0.05
        return x.to(device=self.draw.device, dtype=dtype or self.draw.dtype)

    def perm(self, *shape) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen).argsort(-1).to(self.draw.device)


def _f64(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.detach().to(F64).contiguous()


def _num_cmp(draw: Draw) -> int:
    if draw.lengths is None:
        return ref.num_cmp(draw.T, draw.l, draw.d)
    return sum(ref.num_cmp(s, draw.l, draw.d) for s in draw.lengths)


def _cmp_rows(draw: Draw) -> int:
    """Rows of k_cmp / v_cmp: the emitted ones, or (draw.cmp_padded) the padded layout's count
    (reference.cmp_rows) where validation accepts it."""
    emitted = _num_cmp(draw)
    padded = getattr(ref, "cmp_rows", None)
    if not draw.cmp_padded or padded is None:
        return emitted
    rows = int(padded(draw.T, draw.d))
    cu = None if draw.lengths is None else cu_seqlens(draw.lengths)  # on CPU: values are read
    try:
        meta = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731
        validation.check_cmp_rows("k_cmp", meta(draw.B, rows, draw.H, draw.Dk),
                                  meta(draw.B, draw.T, draw.HQ, draw.Dk), draw.l, draw.d, cu)
    except ValueError:  # validation refuses the padded count: only emitted rows
        return emitted
    return rows


def _cmp_inputs(draw: Draw, data: _Data, D: int, layout: str) -> torch.Tensor:
    """k_cmp or v_cmp [B, rows, H, D]; padding rows (past the emitted ones) hold large values,
    which change the result of any consumer that reads them."""
    emitted, rows = _num_cmp(draw), _cmp_rows(draw)
    x = data.randn(draw.B, rows, draw.H, D)
    x[:, emitted:] *= 10
    return in_layout(x, layout)


def _block_idx(draw: Draw, data: _Data, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """block_idx [B,T,H,n] in draw.bi_order, draw.bi_dtype and draw.bi_layout."""
    B, T, H, n = draw.B, draw.T, draw.H, draw.n
    nblk = -(-T // draw.lp)
    cu = draw.cu()
    if draw.bi_order == "random":  # any block, future ones included, -1 anywhere, repeats
        idx = torch.randint(-1, nblk, (B, T, H, n), generator=data.gen).to(draw.device)
    else:  # what NSA selects, then reordered / spoilt
        q32, k32 = q.detach().float().contiguous(), k.detach().float().contiguous()
        k_cmp = ref.compress_mean(k32, draw.l, draw.d, cu)
        _, lse = ref.compressed_attention(q32, k_cmp, k_cmp, draw.l, draw.d, draw.scale, cu)
        idx = ref.select_blocks(q32, k_cmp, lse, draw.l, draw.d, draw.lp, n, draw.scale, cu)
        if draw.bi_order == "dups":  # a third of the slots repeat another slot or are -1
            src = torch.randint(0, n, (B, T, H, n), generator=data.gen).to(draw.device)
            spoil = torch.rand(B, T, H, n, generator=data.gen).to(draw.device)
            idx = torch.where(spoil < 0.2, idx.gather(-1, src), idx)
            idx = torch.where(spoil > 0.87, -1, idx)
        if draw.bi_order != "spec":
            idx = idx.gather(-1, data.perm(B, T, H, n))
    idx = idx.to(draw.bi_dtype)
    return index_in_layout(idx, draw.bi_layout, max(nblk, 1), seed=draw.index)


# --------------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------------

def _mismatch(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, gpu: bool,
              grad: bool = False, lse: bool = False, width: int = 32) -> Optional[str]:
    """Why got is not want (float64 reference), or None. -inf must match exactly. width: the
    draw's widest head dim (the rounding of a reference of ~0 grows with it)."""
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.numel() == 0:
        return None
    g, w = got.detach().to(F64).cpu(), want.detach().to(F64).cpu()
    if torch.isnan(g).any():
        return f"{int(torch.isnan(g).sum())} of {g.numel()} elements NaN"
    ninf = torch.isneginf(w)
    if not torch.equal(torch.isneginf(g), ninf):
        return (f"-inf pattern differs: {int((torch.isneginf(g) & ~ninf).sum())} extra, "
                f"{int((~torch.isneginf(g) & ninf).sum())} missing")
    if torch.isinf(g.masked_fill(ninf, 0)).any():
        return f"{int(torch.isinf(g).sum())} elements inf"
    g, w = g.masked_fill(ninf, 0), w.masked_fill(ninf, 0)
    err = (g - w).abs()
    if gpu:
        if lse:
            worst = err.max().item()
            return None if worst <= GPU_LSE[dtype] else \
                f"max |err| {worst:.3e} > {GPU_LSE[dtype]:.0e}"
        limit = GPU_REL[dtype] * (2 if grad else 1)
        rel = rel_err(g, w)
        # a reference of ~0 (a dlse=None gradient where every query sees one key: dS = 0)
        # leaves only rounding, which the elementwise atol bounds: dS = P (dP - delta) cancels
        # two sums over Dv of size ~sqrt(Dv), whose rounding grows as sqrt(Dv) (H200, fp32, Dv
        # = 256, w = 1: 2.1e-5 - 2.8e-5 for the Triton and the reference routes alike)
        if rel <= limit or err.max().item() <= TOL[dtype][0] * max(1.0, (width / 32) ** 0.5):
            return None
        return f"relative error {rel:.3e} > {limit:.0e} (max |err| {err.max().item():.3e})"
    atol, rtol = TOL[dtype]
    excess = err - rtol * w.abs()
    bad = excess > atol
    if not bad.any():
        return None
    i = int(excess.flatten().argmax())
    where = tuple(int(c) for c in torch.unravel_index(torch.tensor(i), g.shape))
    return (f"max |err| {err.max().item():.3e}; {int(bad.sum())} of {g.numel()} elements "
            f"beyond {atol:.0e} + {rtol:.0e}*|ref| (worst at {where}: "
            f"{g.flatten()[i].item():.5g} vs {w.flatten()[i].item():.5g})")


class Failures:
    """Collects every failure of one case; raises them together at the end."""

    def __init__(self, draw: Draw):
        self.draw = draw
        self.items: list[str] = []

    def add(self, where: str, msg: Optional[str]):
        if msg:
            self.items.append(f"{where}: {msg}")

    def run(self, where: str, fn: Callable):
        """fn() or None, an exception recorded as a failure of `where`."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 (any exception of an accepted input is a defect)
            text = " ".join(str(e).split())
            self.items.append(f"{where}: raised {type(e).__name__}: {text[:400]}")
            return None

    def check(self):
        if self.items:
            lines = "\n  ".join(self.items)
            raise AssertionError(f"{len(self.items)} failure(s) for {self.draw}:\n  {lines}")


def _compare_outputs(f: Failures, where: str, outs, want, names, dtype, gpu, contiguous: bool,
                     dtypes=None, grad=False):
    for i, (name, got, ref_) in enumerate(zip(names, outs, want)):
        if got is None:
            f.add(f"{where} {name}", "missing")
            continue
        if dtypes is not None and got.dtype != dtypes[i]:
            f.add(f"{where} {name}", f"dtype {got.dtype}, expected {dtypes[i]}")
        if contiguous and not got.is_contiguous():
            f.add(f"{where} {name}", f"not contiguous (strides {got.stride()})")
        f.add(f"{where} {name}", _mismatch(got, ref_, dtype, gpu, grad=grad, lse=name == "lse",
                                           width=max(f.draw.Dk, f.draw.Dv)))


# --------------------------------------------------------------------------------------------
# Routing: which routes serve a draw
# --------------------------------------------------------------------------------------------

class _RouteSpy:
    """Records the Inputs each torch.ops.nsa op hands the routing table, and what it chose."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, routing.Inputs, str]] = []
        choose = routing.choose

        def spy(op, x):
            route = choose(op, x)
            self.calls.append((op, x, route.impl))
            return route
        monkeypatch.setattr(routing, "choose", spy)

    def last(self, op: str):
        for name, x, impl in reversed(self.calls):
            if name == op:
                return x, impl
        return None, None

    def clear(self):
        self.calls.clear()


def _force_var(op: str) -> str:
    return f"NSA_OPS_FORCE_IMPL_{op.upper()}"


def _serving(op: str, x: routing.Inputs, monkeypatch) -> dict[str, Optional[str]]:
    """impl -> None if the route serves x when forced (preferences lifted), else its refusal."""
    out = {}
    for route in routing.candidates(op):
        monkeypatch.setenv(_force_var(op), route.impl)
        out[route.impl] = dict(routing.explain(op, x))[route.impl]
    monkeypatch.delenv(_force_var(op))
    return out


def _fake_gpu(x: routing.Inputs) -> routing.Inputs:
    return dataclasses.replace(x, device_type="cuda", sm=FAKE_SM)


def _check_refusals(f: Failures, where: str, serving: dict[str, Optional[str]]):
    for impl, reason in serving.items():
        if reason is not None and not (isinstance(reason, str) and reason.strip()):
            f.add(f"{where} {impl}", f"refused without a reason ({reason!r})")


def _impl(route: routing.Route, backward: bool = False) -> Callable:
    fn = routing.resolve(route.backward if backward else route.forward)
    options = dict(route.options)
    return lambda *args: fn(*args, **options)


def _backward_variants(routes: list[routing.Route]) -> dict[str, tuple[str, ...]]:
    """Which dlse variants ("dlse": random, "none") each route's backward runs: every variant at
    least once per backward implementation, shared ones split between the routes (the
    interpreter is slow)."""
    out, by_target = {}, {}
    for r in routes:
        if r.backward:
            by_target.setdefault(r.backward, []).append(r.impl)
    for impls in by_target.values():
        if len(impls) == 1:
            out[impls[0]] = ("dlse", "none")
        else:
            for i, impl in enumerate(impls):
                out[impl] = (("dlse", "none")[i % 2],) if i < 2 else ("dlse",)
    return out


def _cpu_routes(f: Failures, op: str, spy: _RouteSpy, monkeypatch, fallback: routing.Inputs
                ) -> tuple[list[routing.Route], dict[str, tuple[str, ...]]]:
    """The routes that serve the draw on a faked sm90 and run on CPU, minus the one the op
    already ran; refusals are checked for a reason."""
    x, op_impl = spy.last(op)
    x = _fake_gpu(x if x is not None else fallback)
    serving = _serving(op, x, monkeypatch)
    _check_refusals(f, f"routing ({op}, faked sm90)", serving)
    routes = [r for r in routing.candidates(op)
              if serving[r.impl] is None and r.impl in CPU_IMPLS and r.impl != op_impl]
    return routes, _backward_variants(routes)


def _forced_gpu_runs(f: Failures, op: str, spy: _RouteSpy, monkeypatch, run_op: Callable):
    """On CUDA: run the op again with every other serving route forced."""
    x, chosen = spy.last(op)
    if x is None:
        f.add(op, "the op did not ask the routing table")
        return
    serving = _serving(op, x, monkeypatch)
    _check_refusals(f, f"routing ({op})", serving)
    for impl, reason in serving.items():
        if reason is not None or impl == chosen:
            continue
        monkeypatch.setenv(_force_var(op), impl)
        spy.clear()
        run_op(f"forced {impl}")
        _, ran = spy.last(op)
        if ran != impl:
            f.add(f"forced {impl}", f"the op ran {ran}")
    monkeypatch.delenv(_force_var(op), raising=False)


# --------------------------------------------------------------------------------------------
# The attention ops (compressed, selection, sliding window)
# --------------------------------------------------------------------------------------------

NAMES_FWD = ("o", "lse")
NAMES_BWD = ("dq", "dk", "dv")


def _attention_case(op: str, draw: Draw, monkeypatch, q, k, v, params: tuple,
                    ref_fwd: Callable, ref_bwd: Callable, data: _Data):
    """q, k, v (k, v compressed rows for compressed attention) in the draw's layouts; params
    are the op's arguments between v and cu_seqlens."""
    f = Failures(draw)
    gpu = draw.device == "cuda"
    cu = draw.cu()
    dt = draw.dtype
    q64, k64, v64 = _f64(q), _f64(k), _f64(v)
    o_ref, lse_ref = ref_fwd(q64, k64, v64, *params, cu)
    do = in_layout(data.randn(*o_ref.shape), draw.do)
    dlse = rows_in_layout(data.randn(*lse_ref.shape, dtype=F32), draw.dlse)
    grads_ref = {v_: ref_bwd(q64, k64, v64, o_ref, lse_ref, _f64(do), dl, *params, cu)
                 for v_, dl in (("dlse", _f64(dlse)), ("none", None))}
    empty = torch.isneginf(lse_ref)
    lse_dtype = F32
    fwd_dtypes = (dt, lse_dtype)
    grad_dtypes = (q.dtype, k.dtype, v.dtype)

    def check_run(where, fwd, bwd, variants, contiguous):
        out = f.run(f"{where} forward", lambda: fwd(q, k, v, *params, cu))
        if out is None:
            return
        o, lse = out
        _compare_outputs(f, f"{where} forward", (o, lse), (o_ref, lse_ref), NAMES_FWD, dt, gpu,
                         contiguous, fwd_dtypes)
        if o.shape == o_ref.shape and empty.any() and not bool((o[empty.to(o.device)] == 0).all()):
            f.add(f"{where} forward o", "rows that see nothing are not 0")
        if bwd is None:
            return
        for variant in variants:
            dl = dlse if variant == "dlse" else None
            label = f"{where} backward ({'random dlse' if dl is not None else 'dlse=None'})"
            grads = f.run(label, lambda: bwd(q, k, v, o, lse, do, dl, *params, cu))
            if grads is not None:
                _compare_outputs(f, label, grads,
                                 grads_ref[variant], NAMES_BWD, dt, gpu, contiguous,
                                 grad_dtypes, grad=True)

    op_fwd = getattr(torch.ops.nsa, op)
    op_bwd = getattr(torch.ops.nsa, op + "_backward")
    spy = _RouteSpy(monkeypatch)

    def run_op(where):
        with poisoned_empty():
            check_run(where, op_fwd, op_bwd, ("dlse", "none"), contiguous=True)

    run_op(f"torch.ops.nsa.{op}")
    if gpu:
        _forced_gpu_runs(f, op, spy, monkeypatch, run_op)
    else:
        fallback = (routing.Inputs.of_compressed(q, v, draw.l, draw.d, cu)
                    if op == "compressed_attention" else routing.Inputs.of(q, v, cu))
        routes, variants = _cpu_routes(f, op, spy, monkeypatch, fallback)
        for route in routes:
            with poisoned_empty():
                check_run(f"route {route.impl}", _impl(route),
                          _impl(route, backward=True) if route.backward else None,
                          variants.get(route.impl, ()), contiguous=False)
    f.check()


def _compressed(draw: Draw, monkeypatch):
    data = _Data(draw, 1)
    q = in_layout(data.randn(draw.B, draw.T, draw.HQ, draw.Dk), draw.q)
    k_cmp = _cmp_inputs(draw, data, draw.Dk, draw.k_cmp)
    v_cmp = _cmp_inputs(draw, data, draw.Dv, draw.v_cmp)
    _attention_case("compressed_attention", draw, monkeypatch, q, k_cmp, v_cmp,
                    (draw.l, draw.d, draw.scale), ref.compressed_attention,
                    ref.compressed_attention_backward, data)


def _qkv(draw: Draw, data: _Data):
    B, T = draw.B, draw.T
    return (in_layout(data.randn(B, T, draw.HQ, draw.Dk), draw.q),
            in_layout(data.randn(B, T, draw.H, draw.Dk), draw.k),
            in_layout(data.randn(B, T, draw.H, draw.Dv), draw.v))


def _selection(draw: Draw, monkeypatch):
    data = _Data(draw, 2)
    q, k, v = _qkv(draw, data)
    block_idx = _block_idx(draw, data, q, k)
    _attention_case("selection_attention", draw, monkeypatch, q, k, v, (block_idx, draw.lp,
                    draw.scale), ref.selection_attention, ref.selection_attention_backward, data)


def _window(draw: Draw, monkeypatch):
    data = _Data(draw, 3)
    q, k, v = _qkv(draw, data)
    _attention_case("sliding_window_attention", draw, monkeypatch, q, k, v,
                    (draw.w, draw.scale), ref.sliding_window_attention,
                    ref.sliding_window_attention_backward, data)


# --------------------------------------------------------------------------------------------
# select_blocks
# --------------------------------------------------------------------------------------------

def _block_scores(q, k_cmp, lse, draw: Draw) -> torch.Tensor:
    """Eq.9 + Eq.10 scores [B, T, H, ceil(T/l')] in float64, straight from the definitions."""
    B, T, HQ, D = q.shape
    nc, H = k_cmp.shape[1], k_cmp.shape[2]
    cu = draw.cu()
    qg = _f64(q).view(B, T, H, HQ // H, D)
    lse = _f64(lse).view(B, T, H, HQ // H, 1)
    mask = ref.compressed_mask_fn(T, nc, draw.l, draw.d, cu, q.device)(0, T)[0, 0]
    _, cidx = ref.cmp_layout(nc, cu, draw.l, draw.d, q.device)
    overlap = ref.overlap_matrix(cidx, draw.l, draw.d, draw.lp, max(1, -(-T // draw.lp))).to(F64)
    s = torch.einsum("bthgd,bshd->bthgs", qg, _f64(k_cmp)) * draw.scale
    visible = mask[None, :, None, None] & torch.isfinite(lse)
    p = torch.where(visible, torch.exp(s - lse), 0.0)
    return p.sum(3) @ overlap


def _selection_property(block_idx: torch.Tensor, score: torch.Tensor, draw: Draw,
                        tol: float) -> Optional[str]:
    """None if block_idx is a valid top-n of score: count, ascending with -1 last, no future
    block, forced blocks present, no unselected block above a selected one by more than tol."""
    B, T, H, n = draw.B, draw.T, draw.H, draw.n
    if tuple(block_idx.shape) != (B, T, H, n):
        return f"shape {tuple(block_idx.shape)}, expected {(B, T, H, n)}"
    if block_idx.dtype != torch.int32:
        return f"dtype {block_idx.dtype}, expected int32"
    idx = block_idx.cpu().to(torch.int64)
    score = score.cpu()
    nblk = score.shape[-1]
    if bool(((idx < -1) | (idx >= nblk)).any()):
        bad = sorted(set(idx[(idx < -1) | (idx >= nblk)].tolist()))[:8]
        return f"entries outside [-1, {nblk}): {bad}"
    _, pos = ref.token_layout(T, None if draw.lengths is None else draw.cu().cpu(), "cpu")
    j = torch.arange(nblk)
    cur = (pos // draw.lp)[:, None]
    allowed = (j[None] * draw.lp <= pos[:, None])[None, :, None]
    forced = allowed & ((j == 0) | (j == cur) | (j == cur - 1))[None, :, None]
    taken = idx >= 0
    count = taken.sum(-1)
    want = allowed.sum(-1).clamp(max=n).expand_as(count)
    if not torch.equal(count, want):
        bad = (count != want).nonzero()[0].tolist()
        return (f"wrong number of blocks at {bad}: {count[tuple(bad)].item()} vs "
                f"{want[tuple(bad)].item()}")
    if not torch.equal(taken, torch.arange(n) < count[..., None]):
        return "-1 slots not last"
    if not (idx[..., 1:] > idx[..., :-1])[taken[..., 1:]].all():
        return "valid entries not strictly ascending"
    onehot = torch.zeros(B, T, H, nblk + 1, dtype=torch.bool)
    onehot.scatter_(-1, torch.where(taken, idx, nblk), True)
    chosen = onehot[..., :nblk]
    if (chosen & ~allowed).any():
        return "selected a future block"
    if (forced & ~chosen).any():
        return "a forced block (0, current, previous) is missing"
    worst_kept = torch.where(chosen & ~forced, score, float("inf")).amin(-1)
    best_left = torch.where(allowed & ~chosen, score, float("-inf")).amax(-1)
    gap = (best_left - worst_kept).max().item()
    if gap > tol:
        return f"an unselected block outscores a selected one by {gap:.3e} (tol {tol:.0e})"
    return None


def _select_blocks(draw: Draw, monkeypatch):
    data = _Data(draw, 4)
    f = Failures(draw)
    cu = draw.cu()
    q = in_layout(data.randn(draw.B, draw.T, draw.HQ, draw.Dk), draw.q)
    k_cmp = _cmp_inputs(draw, data, draw.Dk, draw.k_cmp)
    # lse as compressed attention returns it for these rows (v_cmp = k_cmp)
    _, lse = ref.compressed_attention(_f64(q), _f64(k_cmp), _f64(k_cmp), draw.l, draw.d,
                                      draw.scale, cu)
    lse = rows_in_layout(lse.to(F32), draw.lse)
    score = _block_scores(q, k_cmp, lse, draw)
    args = (q, k_cmp, lse, draw.l, draw.d, draw.lp, draw.n, draw.scale, cu)
    tol = SELECT_TOL[draw.dtype]

    def check_run(where, fn, contiguous):
        with poisoned_empty():
            out = f.run(where, lambda: fn(*args))
        if out is None:
            return
        if contiguous and not out.is_contiguous():
            f.add(where, f"not contiguous (strides {out.stride()})")
        f.add(where, _selection_property(out, score, draw, tol))

    spy = _RouteSpy(monkeypatch)
    run_op = lambda where: check_run(where, torch.ops.nsa.select_blocks, True)  # noqa: E731
    run_op("torch.ops.nsa.select_blocks")
    if draw.device == "cuda":
        _forced_gpu_runs(f, "select_blocks", spy, monkeypatch, run_op)
    else:
        routes, _ = _cpu_routes(f, "select_blocks", spy, monkeypatch,
                                routing.Inputs.of(q, k_cmp, cu))
        for route in routes:
            check_run(f"route {route.impl}", _impl(route), False)
    f.check()


# --------------------------------------------------------------------------------------------
# gate_combine
# --------------------------------------------------------------------------------------------

def _gate(draw: Draw, monkeypatch):
    data = _Data(draw, 5)
    f = Failures(draw)
    gpu = draw.device == "cuda"
    B, T, HQ, Dv = draw.B, draw.T, draw.HQ, draw.Dv
    o = [in_layout(data.randn(B, T, HQ, Dv), lay) for lay in draw.o_layouts]
    g = [rows_in_layout(data.rand(B, T, HQ, dtype=draw.gate_dtype), lay, i)
         for i, lay in enumerate(draw.g_layouts)]
    if not draw.window_branch:
        o[2] = g[2] = None
    args = (*o, *g)
    out_dtype = torch.promote_types(draw.dtype, draw.gate_dtype)
    want = ref.gate_combine(*(_f64(x) for x in args))
    do = in_layout(data.randn(B, T, HQ, Dv, dtype=out_dtype), draw.do)
    grads_want = ref.gate_combine_backward(_f64(do), *(_f64(x) for x in args), draw.gate_grads)
    names = ("d_o_cmp", "d_o_slc", "d_o_win", "d_g_cmp", "d_g_slc", "d_g_win")
    like = (*o, *g)

    def check_run(where, fwd, bwd, contiguous):
        with poisoned_empty():
            out = f.run(f"{where} forward", lambda: fwd(*args))
        if out is not None:
            _compare_outputs(f, f"{where} forward", (out,), (want,), ("o",), out_dtype, gpu,
                             contiguous, (out_dtype,))
        with poisoned_empty():
            grads = f.run(f"{where} backward", lambda: bwd(do, *args, draw.gate_grads))
        if grads is None:
            return
        for name, got, exp, x in zip(names, grads, grads_want, like):
            present = x is not None and (draw.gate_grads or name.startswith("d_o"))
            if not present:
                if got.numel() != 0:
                    f.add(f"{where} backward {name}",
                          f"expected an empty tensor, got {tuple(got.shape)}")
                continue
            _compare_outputs(f, f"{where} backward", (got,), (exp,), (name,), x.dtype, gpu,
                             contiguous, (x.dtype,), grad=True)

    spy = _RouteSpy(monkeypatch)

    def run_op(where):
        check_run(where, torch.ops.nsa.gate_combine, torch.ops.nsa.gate_combine_backward, True)

    run_op("torch.ops.nsa.gate_combine")
    if gpu:
        _forced_gpu_runs(f, "gate_combine", spy, monkeypatch, run_op)
    else:
        fallback = dataclasses.replace(routing.Inputs.of(o[0], o[0]), dtype=out_dtype)
        routes, _ = _cpu_routes(f, "gate_combine", spy, monkeypatch, fallback)
        for route in routes:
            check_run(f"route {route.impl}", _impl(route), _impl(route, backward=True), False)
    f.check()


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------

def _query_rows(draw: Draw) -> slice:
    """The queries the layer gets: all, or (every third fixed-length draw) the last ones, keys
    and values kept whole: queries at an offset, which the reference reads as those rows of the
    full-length call."""
    if draw.lengths is not None or draw.index % 3 != 2:
        return slice(0, draw.T)
    return slice(draw.T - max(1, draw.T // 3), draw.T)


def _layer(draw: Draw):
    """nsa_attention (the eager layer's fused routes on the GPU) on the draw's layouts, gate
    dtype and grads, window branch, varlen or offset queries, and block_idx: its own selection
    (even draws), which the reference is handed, or the draw's (odd), against the float64
    reference, forward and every gradient."""
    data = _Data(draw, 6)
    f = Failures(draw)
    gpu = draw.device == "cuda"
    B, T, HQ = draw.B, draw.T, draw.HQ
    rows = _query_rows(draw)
    cu = draw.cu()
    q_full = data.randn(B, T, HQ, draw.Dk)
    k = in_layout(data.randn(B, T, draw.H, draw.Dk), draw.k).requires_grad_()
    v = in_layout(data.randn(B, T, draw.H, draw.Dv), draw.v).requires_grad_()
    q = in_layout(q_full[:, rows], draw.q).requires_grad_()
    gates = [rows_in_layout(data.rand(B, T, HQ, dtype=draw.gate_dtype), lay, i)
             for i, lay in enumerate(draw.g_layouts)]
    window = draw.w if draw.window_branch else 0
    given = None if draw.index % 2 == 0 else _block_idx(draw, data, q_full, k)
    out_dtype = torch.promote_types(draw.dtype, draw.gate_dtype)
    do_full = torch.zeros(B, T, HQ, draw.Dv, dtype=out_dtype, device=draw.device)
    do_full[:, rows] = data.randn(B, rows.stop - rows.start, HQ, draw.Dv, dtype=out_dtype)
    do = in_layout(do_full[:, rows], draw.do)

    ours_g = [g[:, rows].detach().requires_grad_(draw.gate_grads) for g in gates]
    used = []
    with poisoned_empty():
        o = f.run("nsa_attention forward", lambda: nsa_ops.nsa_attention(
            q, k, v, *ours_g[:2], ours_g[2] if window else None, block_len=draw.l,
            block_stride=draw.d, sel_block=draw.lp, num_sel=draw.n, window=window,
            scale=draw.scale, cu_seqlens=cu,
            block_idx=None if given is None else given[:, rows], on_block_idx=used.append))
    if o is None:
        f.check()
    leaves = [q, k, v, *(ours_g[:3 if window else 2] if draw.gate_grads else ())]
    with poisoned_empty():
        grads = f.run("nsa_attention backward", lambda: torch.autograd.grad(o, leaves, do))

    if given is None:  # the rows before the queries select nothing: their dO is zero
        idx = torch.full((B, T, draw.H, draw.n), -1, dtype=torch.int64, device=draw.device)
        idx[:, rows] = used[0].to(idx.dtype)
    else:
        idx = given
    ref_leaves = [_f64(x).requires_grad_() for x in (q_full, k, v, *gates)]
    want = ref.nsa(*ref_leaves, block_len=draw.l, block_stride=draw.d, sel_block=draw.lp,
                   num_sel=draw.n, window=window, scale=draw.scale,
                   cu_seqlens=cu, block_idx=idx)
    want_grads = torch.autograd.grad(want, ref_leaves, _f64(do_full), allow_unused=True)
    want_grads = [want_grads[0][:, rows], *want_grads[1:3],
                  *(None if g is None else g[:, rows] for g in want_grads[3:])]
    _compare_outputs(f, "nsa_attention forward", (o,), (want[:, rows],), ("o",), draw.dtype,
                     gpu, False, (out_dtype,))
    if grads is not None:
        names = ("dq", "dk", "dv", "d_g_cmp", "d_g_slc", "d_g_win")
        for name, got, exp, x in zip(names, grads, want_grads, leaves):
            if name == "d_g_win" and not window:  # no window branch: its gate is unread
                continue
            _compare_outputs(f, "nsa_attention backward", (got,), (exp,), (name,), draw.dtype,
                             gpu, False, (x.dtype,), grad=True)
    f.check()


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

def test_draws_cover_the_space():
    """The seeded draws reach the cases this sweep exists for (so reseeding cannot silently
    drop them): l' not a power of two, each block_idx order, head-major and strided layouts,
    varlen, fp16."""
    for draws in (CPU_CASES, CPU_CASES[:CPU_SELECTION_DRAWS], GPU_CASES):
        assert any(x.lp & (x.lp - 1) for x in draws)  # l' not a power of two
        assert {x.bi_order for x in draws} == set(BI_ORDERS)
        assert {x.q for x in draws} == set(LAYOUTS)
        assert any(x.lengths for x in draws)
        assert any(x.dtype == F16 for x in draws)
    for draws in (CPU_CASES, GPU_CASES):  # the layer's own axes
        assert any(_query_rows(x).start > 0 for x in draws)
        assert {x.index % 2 for x in draws if x.window_branch} == {0, 1}
        assert {x.gate_grads for x in draws} == {True, False}


@pytest.mark.parametrize("draw", _params(CPU_CASES))
def test_compressed_attention(draw, monkeypatch):
    _compressed(draw, monkeypatch)


@pytest.mark.parametrize("draw", _params(CPU_CASES))
def test_select_blocks(draw, monkeypatch):
    _select_blocks(draw, monkeypatch)


@pytest.mark.parametrize("draw", _params(CPU_CASES[:CPU_SELECTION_DRAWS]))
def test_selection_attention(draw, monkeypatch):
    _selection(draw, monkeypatch)


@pytest.mark.parametrize("draw", _params(CPU_CASES))
def test_sliding_window_attention(draw, monkeypatch):
    _window(draw, monkeypatch)


@pytest.mark.parametrize("draw", _params(CPU_CASES))
def test_gate_combine(draw, monkeypatch):
    _gate(draw, monkeypatch)


@pytest.mark.parametrize("draw", _params(GPU_CASES, gpu=True))
def test_compressed_attention_gpu(draw, monkeypatch):
    _compressed(draw, monkeypatch)


@pytest.mark.parametrize("draw", _params(GPU_CASES, gpu=True))
def test_select_blocks_gpu(draw, monkeypatch):
    _select_blocks(draw, monkeypatch)


@pytest.mark.parametrize("draw", _params(GPU_CASES, gpu=True))
def test_selection_attention_gpu(draw, monkeypatch):
    _selection(draw, monkeypatch)


@pytest.mark.parametrize("draw", _params(GPU_CASES, gpu=True))
def test_sliding_window_attention_gpu(draw, monkeypatch):
    _window(draw, monkeypatch)


@pytest.mark.parametrize("draw", _params(GPU_CASES, gpu=True))
def test_gate_combine_gpu(draw, monkeypatch):
    _gate(draw, monkeypatch)


@pytest.mark.parametrize("draw", _params(CPU_CASES))
def test_nsa_attention(draw):
    _layer(draw)


@pytest.mark.parametrize("draw", _params(GPU_CASES, gpu=True))
def test_nsa_attention_gpu(draw):
    _layer(draw)
