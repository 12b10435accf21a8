"""Triton kernels of the nsa ops, one module per kernel family (imported as nsa_ops.kernels)."""
