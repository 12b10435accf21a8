"""Every environment variable nsa_ops reads, in one place. They exist for debugging and tuning
only: explicit arguments and the routing table decide behaviour; these merely force, tune or check.

NSA_OPS_FORCE_IMPL      force one implementation for every op where it can serve, e.g.
                        "reference" or "triton" (an impl that can't serve an input still refuses
                        with its reason). Per op: NSA_OPS_FORCE_IMPL_<OP>, e.g.
                        NSA_OPS_FORCE_IMPL_SLIDING_WINDOW_ATTENTION=aten_fa2.
                        nsa_ops.routing.force() in code overrides both.
NSA_OPS_ROUTING         a YAML file of routing thresholds over the built-in per-SM ones (format:
                        README, "Steering routing"; bench/bench_routing.py --write writes one),
                        read on first use; nsa_ops.routing.load(path) overrides it.
NSA_OPS_CHECK_VALUES    "1": also run value checks (cu_seqlens, block_idx range) on CUDA tensors,
                        at the cost of a device sync per call.
NSA_OPS_LOG             "info": log, on the `nsa_ops` logger, which implementation serves each (op,
                        impl, dtype, device) the first time it runs and why the rows ahead of it
                        did not; "debug": also every call. Installs a stderr handler on that logger
                        only (nsa_ops.observe).
NSA_OPS_PARITY          "1", or a fraction such as "0.1": recompute every round(1/fraction)-th
                        forward call of each op with the reference and log the error, warning above
                        nsa_ops.observe.TOLERANCE. Syncs the device on each checked call.
NSA_OPS_EAGER_LAYER     "0": nsa_ops.nsa_attention runs through the torch.ops.nsa ops in eager mode
                        too, an autograd node per op, instead of as one node over the ops' bodies
                        (nsa_ops.eager): the same computation, more host time per call.
TRITON_INTERPRET        Triton's own: "1" (before triton is imported) runs Triton kernels on CPU
                        tensors in its interpreter; a forced Triton row then serves CPU tensors.
                        python -m nsa_ops sets it where there is no CUDA.
NSA_COMMIT              the commit that written results (bench CSVs, the training showcase) name,
                        for checkouts without .git such as the copy a remote GPU runs.
"""
from __future__ import annotations

import os
from typing import Optional

VARIABLES = ("NSA_OPS_FORCE_IMPL", "NSA_OPS_FORCE_IMPL_<OP>", "NSA_OPS_CHECK_VALUES",
             "NSA_OPS_LOG", "NSA_OPS_PARITY", "NSA_OPS_ROUTING", "NSA_OPS_EAGER_LAYER",
             "TRITON_INTERPRET", "NSA_COMMIT")


def forced_impl(op: str) -> Optional[tuple[str, str]]:
    """(the variable that forces op's impl, the impl), or None."""
    for variable in (f"NSA_OPS_FORCE_IMPL_{op.upper()}", "NSA_OPS_FORCE_IMPL"):
        impl = os.environ.get(variable)
        if impl:
            return variable, impl
    return None


def routing_file() -> Optional[str]:
    return os.environ.get("NSA_OPS_ROUTING") or None


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpret_triton() -> None:
    """Run Triton kernels in the CPU interpreter: effective if triton is not imported yet."""
    os.environ["TRITON_INTERPRET"] = "1"


def check_values() -> bool:
    return os.environ.get("NSA_OPS_CHECK_VALUES", "0") == "1"


def eager_layer() -> bool:
    """Whether nsa_attention may run as one autograd node in eager mode (nsa_ops.eager)."""
    return os.environ.get("NSA_OPS_EAGER_LAYER", "1") != "0"


def log_level() -> Optional[str]:
    """One of "info" and "debug", or None when unset."""
    value = os.environ.get("NSA_OPS_LOG", "").strip().lower()
    if value not in ("", "info", "debug"):
        raise ValueError(f'NSA_OPS_LOG must be "info" or "debug", got {value!r}')
    return value or None


def parity_fraction() -> float:
    """The fraction of forward calls that parity mode checks; 0.0 (off) when unset."""
    value = os.environ.get("NSA_OPS_PARITY", "").strip()
    why = f'NSA_OPS_PARITY must be "1" or a fraction in [0, 1], got {value!r}'
    try:
        fraction = float(value or 0)
    except ValueError:
        raise ValueError(why) from None
    if not 0 <= fraction <= 1:
        raise ValueError(why)
    return fraction


def commit_override() -> Optional[str]:
    return os.environ.get("NSA_COMMIT") or None
