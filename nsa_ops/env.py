"""Every environment variable nsa_ops reads, in one place. They exist for debugging only:
explicit arguments and the routing table decide behaviour; these merely force or check.

NSA_OPS_FORCE_IMPL      force one implementation for every op where it can serve, e.g.
                        "reference" or "triton" (an impl that can't serve an input still refuses
                        with its reason). Per op: NSA_OPS_FORCE_IMPL_<OP>, e.g.
                        NSA_OPS_FORCE_IMPL_SLIDING_WINDOW_ATTENTION=aten_fa2.
NSA_OPS_CHECK_VALUES    "1": also run value checks (cu_seqlens, block_idx range) on CUDA tensors,
                        at the cost of a device sync per call.
NSA_COMMIT              the commit that written results (bench CSVs, the training showcase) name,
                        for checkouts without .git such as the copy a remote GPU runs.
"""
from __future__ import annotations

import os
from typing import Optional

VARIABLES = ("NSA_OPS_FORCE_IMPL", "NSA_OPS_FORCE_IMPL_<OP>", "NSA_OPS_CHECK_VALUES", "NSA_COMMIT")


def forced_impl(op: str) -> Optional[str]:
    return os.environ.get(f"NSA_OPS_FORCE_IMPL_{op.upper()}") or \
        os.environ.get("NSA_OPS_FORCE_IMPL") or None


def check_values() -> bool:
    return os.environ.get("NSA_OPS_CHECK_VALUES", "0") == "1"


def commit_override() -> Optional[str]:
    return os.environ.get("NSA_COMMIT") or None
