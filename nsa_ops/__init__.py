"""nsa-ops: DeepSeek's Native Sparse Attention as PyTorch custom operators.

Importing registers torch.ops.nsa.{compressed_attention, select_blocks, selection_attention,
sliding_window_attention} (and their backward ops) and their Inductor lowerings (nsa_ops.lowering,
registered when Inductor loads). See ../shared/NSA-SPEC.md for the contract.
"""
from . import lowering, ops, reference, routing
from .cache import NSACache
from .compression import PhiMLP
from .config import NSAConfig
from .functional import nsa_attention
from .module import NSAAttention

lowering.install()

__all__ = ["nsa_attention", "NSAAttention", "NSACache", "NSAConfig", "PhiMLP", "ops", "reference",
           "routing"]
__version__ = "0.1.0"
