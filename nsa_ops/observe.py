"""Seeing what runs: which implementation serves each op and why, and how far it is from the
reference. torch.profiler needs nothing from here: every torch.ops.nsa op, backward ops included,
goes through the dispatcher, which records it under its name (nsa::selection_attention, ...), and
nsa_attention's eager path (nsa_ops.eager), which runs the ops' bodies, records the same names.

Logging, on the `nsa_ops` logger: at INFO, the first time each (op, direction, impl, dtype,
device type) runs, the implementation that served it ("nsa.<op> backward runs ..." for a backward
op) and why every row ahead of it in the routing table refused or deferred; at DEBUG, every
call. Routing never reads tensor values, so neither does this: no device sync. Nothing is logged
while torch.compile traces. NSA_OPS_LOG=info|debug installs a stderr handler on that logger (and
stops its propagation, so lines print once).

Parity: `parity(fraction)` or NSA_OPS_PARITY recompute every round(1/fraction)-th forward call of
each op (the first included) with the reference in float32 (float64 for float64 inputs), log the
max abs error and the max relative error (max abs error / max |reference|) of each output at
INFO, and warn (RuntimeWarning) above TOLERANCE. A check reads its errors back to the host, one
device sync per checked call, and costs a reference forward; ops served by the reference are not
checked. Off by default; skipped while compiling or capturing a CUDA graph.
"""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
from typing import Iterator, NamedTuple, Optional

import torch
from torch import Tensor

from . import env, reference, routing

logger = logging.getLogger("nsa_ops")


class Tolerance(NamedTuple):
    max_rel: float  # max |impl - reference| / max |reference|, per output
    rows_differing: float  # select_blocks: fraction of (query, KV head) rows selecting otherwise


# Parity warns above these, by the dtype of the op's output (q's for select_blocks). 16-bit
# outputs round to 8 (bf16) or 11 (fp16) mantissa bits and the kernels round probabilities to
# that dtype before the P.V product; fp32 kernels use IEEE dots, not TF32. Two blocks whose
# scores tie to within rounding may swap places in a selection.
TOLERANCE = {
    torch.float64: Tolerance(1e-10, 0.0),
    torch.float32: Tolerance(1e-4, 1e-3),
    torch.float16: Tolerance(1e-2, 1e-2),
    torch.bfloat16: Tolerance(5e-2, 1e-2),
}

_OUTPUTS = {"compressed_attention": ("o", "lse"), "select_blocks": ("block_idx",),
            "selection_attention": ("o", "lse"), "sliding_window_attention": ("o", "lse"),
            "gate_combine": ("o",)}

_logged: set[tuple[str, bool, str, torch.dtype, str]] = set()
_handler: Optional[logging.Handler] = None
_every = 0  # parity checks every _every-th forward call of each op; 0: off
_calls: dict[str, int] = {}  # forward calls per op seen by parity mode


def configure_from_env() -> None:
    """Apply NSA_OPS_LOG and NSA_OPS_PARITY; nsa_ops does at import, call again after changing
    them."""
    global _handler
    level = env.log_level()
    if _handler is not None:
        logger.removeHandler(_handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
        _handler = None
    if level:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(_handler)
        logger.setLevel(level.upper())
        logger.propagate = False
    _set_every(env.parity_fraction(), "NSA_OPS_PARITY")


def _set_every(fraction: float, name: str) -> None:
    global _every
    if not 0 <= fraction <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {fraction}")
    _every = round(1 / fraction) if fraction else 0
    _calls.clear()


@contextlib.contextmanager
def parity(fraction: float = 1.0) -> Iterator[None]:
    """Check every round(1/fraction)-th forward call of each op inside the block against the
    reference (0: none); see the module docstring."""
    global _every
    saved = _every, dict(_calls)
    _set_every(fraction, "fraction")
    try:
        yield
    finally:
        _every = saved[0]
        _calls.clear()
        _calls.update(saved[1])


def parity_on() -> bool:
    """Whether parity mode samples forward calls (`parity`, NSA_OPS_PARITY)."""
    return _every > 0


def choose(op: str, x: routing.Inputs) -> routing.Route:
    """routing.choose, for a call that runs: the first time an (op, direction, impl, dtype,
    device type) runs, its INFO line."""
    route = routing.choose(op, x)
    # compiling first: Dynamo constant-folds it, and cannot trace Logger methods (decode may be
    # compiled)
    if torch.compiler.is_compiling() or not logger.isEnabledFor(logging.INFO):
        return route
    key = (op, x.backward, route.impl, x.dtype, x.device_type)
    if key in _logged:
        return route
    _logged.add(key)
    passed = []
    for row, reason, kind in routing.reasons(op, x):
        if row.impl == route.impl:
            break
        passed.append(f"{row.impl} {kind}: {reason}")
    sm = f" sm{x.sm[0]}{x.sm[1]}" if x.sm else ""
    logger.info("nsa.%s%s runs %s for %s on %s%s%s", op, " backward" if x.backward else "",
                route.impl, _name(x.dtype), x.device_type, sm,
                "; " + "; ".join(passed) if passed else " (first choice)")
    return route


def ran(route: routing.Route, target: str, args: tuple, keys: dict, out) -> None:
    """After an implementation ran (target: route.forward or route.backward): the DEBUG line of
    every call, and parity mode's check of the sampled forward calls."""
    if _every and target == route.forward:
        _check_parity(route, args, keys, out)
    if not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG):
        first = args[0]
        suffix = {route.forward: "", route.backward: "_backward", route.gated: " (gated)"}
        logger.debug("nsa.%s%s: %s on %s %s %s", route.op, suffix[target], route.impl,
                     _name(first.dtype), first.device.type, list(first.shape))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@contextlib.contextmanager
def _fp32_matmuls() -> Iterator[None]:
    # a float32 reference computed in TF32 (set_float32_matmul_precision("high")) would be
    # ~1e-3 off and trip the float32 tolerance
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _check_parity(route: routing.Route, args: tuple, keys: dict, out) -> None:
    first = args[0]
    if (route.impl == "reference" or torch.compiler.is_compiling()
            or (first.is_cuda and torch.cuda.is_current_stream_capturing())):
        return
    call = _calls.get(route.op, 0)
    _calls[route.op] = call + 1
    if call % _every:
        return
    outs = (out,) if isinstance(out, Tensor) else out
    dtype = next((t.dtype for t in outs if t.is_floating_point()), first.dtype)
    compute = reference.compute_dtype(dtype)
    ref = routing.route(route.op, "reference")
    wide = [a.to(compute) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args]
    with torch.no_grad(), torch.profiler.record_function(f"nsa::parity::{route.op}"), \
            _fp32_matmuls():
        want = routing.resolve(ref.forward)(*wide, **keys, **dict(ref.options))
        measured = []
        for got, exp in zip(outs, (want,) if isinstance(want, Tensor) else want):
            if not got.is_floating_point():
                measured.append((got != exp).any(-1).sum())
            elif got.numel():
                got = got.to(exp.dtype)
                # equal infinities (lse = -inf of a query that sees nothing) are no error
                measured += [torch.where(got == exp, 0, (got - exp).abs()).amax(),
                             torch.where(exp.isfinite(), exp.abs(), 0).amax()]
        # every error in one read: the one sync of a check
        values = iter(torch.stack([m.to(torch.float64) for m in measured]).tolist()
                      if measured else ())
    tol = TOLERANCE[dtype]
    parts, bad = [], False
    for name, got in zip(_OUTPUTS[route.op], outs):
        if not got.is_floating_point():
            rows = math.prod(got.shape[:-1])
            differing = next(values)
            parts.append(f"{name} rows differing {differing:.0f} of {rows}")
            bad |= not differing <= tol.rows_differing * rows
            continue
        err, top = (next(values), next(values)) if got.numel() else (0.0, 0.0)
        rel = err / top if top else (0.0 if err == 0 else float("inf"))
        parts.append(f"{name} max abs {err:.2e} max rel {rel:.2e}")
        bad |= not rel <= tol.max_rel  # NaN fails too
    line = (f"nsa.{route.op} parity, {route.impl} against the reference in {_name(compute)} "
            f"({_name(dtype)} on {first.device.type}, call {call}): {', '.join(parts)} "
            f"(tolerance: max rel {tol.max_rel:g}, rows differing {tol.rows_differing:g})")
    logger.info(line)
    if bad:
        warnings.warn(f"{line}: above tolerance", RuntimeWarning, stacklevel=2)
