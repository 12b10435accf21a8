"""What an NSAAttention layer did, recorded on request (`NSAAttention.record_stats`): gate
statistics per branch and how often each block distance was selected. Everything accumulates on
the layer's device, so a recording step costs no host sync; `summary` reads it back."""
from __future__ import annotations

import torch
from torch import Tensor

BRANCHES = ("cmp", "sel", "win")


class LayerStats:
    """Running sums of one layer's gates ([3] sum and sum of squares, per branch) and a histogram
    of selected-block distances: bin j counts selections of the block j blocks before the query's
    own (0: its own block), the last bin every distance >= max_distance."""

    def __init__(self, max_distance: int, device):
        if isinstance(max_distance, bool) or not isinstance(max_distance, int) or \
                max_distance < 1:
            raise ValueError(f"max_distance must be a positive int, got {max_distance!r}")
        self.max_distance = max_distance
        self.gate_sum = torch.zeros(3, dtype=torch.float64, device=device)
        self.gate_sq_sum = torch.zeros(3, dtype=torch.float64, device=device)
        self.gate_count = torch.zeros((), dtype=torch.int64, device=device)
        # one bin past the histogram takes the empty slots, so no boolean indexing (a host sync)
        self.distance = torch.zeros(max_distance + 2, dtype=torch.int64, device=device)

    def add_gates(self, gates: tuple[Tensor, Tensor, Tensor]) -> None:
        g = torch.stack([x.detach().to(torch.float64) for x in gates]).flatten(1)
        self.gate_sum += g.sum(1)
        self.gate_sq_sum += (g * g).sum(1)
        self.gate_count += g.shape[1]

    def add_selection(self, block_idx: Tensor, pos: Tensor, sel_block: int) -> None:
        """block_idx [B,T,H,n] (-1 empty), pos [T] the queries' positions in their sequences."""
        own = (pos // sel_block)[None, :, None, None]
        d = (own - block_idx.to(torch.int64)).clamp(0, self.max_distance)
        d = torch.where(block_idx >= 0, d, self.max_distance + 1).flatten()
        self.distance.scatter_add_(0, d, torch.ones_like(d))

    def summary(self) -> dict:
        """{"gates": {branch: (mean, std)}, "distance": [count per bin]} (host values)."""
        n = max(int(self.gate_count), 1)
        mean = (self.gate_sum / n).tolist()
        var = (self.gate_sq_sum / n - (self.gate_sum / n) ** 2).clamp(min=0).tolist()
        return {"gates": {b: (m, v ** 0.5) for b, m, v in zip(BRANCHES, mean, var)},
                "distance": self.distance[:-1].tolist()}
