"""nsa-ops: DeepSeek's Native Sparse Attention as PyTorch custom operators.

Importing registers torch.ops.nsa.{compressed_attention, select_blocks, selection_attention,
sliding_window_attention} (and their backward ops) and their Inductor lowerings (nsa_ops.lowering,
registered when Inductor loads). See ../shared/NSA-SPEC.md for the contract.
"""
from . import lowering, observe, ops, reference, routing
from .cache import NSACache
from .compression import PhiMLP
from .config import NSAConfig
from .functional import nsa_attention
from .module import NSAAttention
from .observe import parity

lowering.install()
observe.configure_from_env()

__all__ = ["nsa_attention", "NSAAttention", "NSACache", "NSAConfig", "PhiMLP", "observe", "ops",
           "parity", "reference", "routing"]
__version__ = "0.1.0"
