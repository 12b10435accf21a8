"""What an NSAAttention layer attends to, as heatmaps (`python -m nsa_ops inspect`): for one query
head, the compressed-attention probabilities over the compressed blocks, the importance of each
selection block (NSA-SPEC Eq.9/10, the scores top-n ranks) and the blocks chosen. Computed with the
pure-PyTorch reference on the first sequence of the batch; matplotlib draws the PNG."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from . import reference
from .module import NSAAttention


@torch.no_grad()
def maps(layer: NSAAttention, x: Tensor, head: int = 0) -> dict[str, Tensor]:
    """{"cmp_probs": [T, num_cmp], "block_scores": [T, blocks], "chosen": [T, blocks] bool} for
    query head `head` (its KV head for the last two) of x[0] ([B, T, hidden])."""
    c = layer.config
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < c.num_heads:
        raise ValueError(f"head must be an int in [0, {c.num_heads}), got {head!r}")
    x = x[:1]
    T = x.shape[1]
    pos = torch.arange(T, device=x.device)
    q, k, v = layer._qkv(x, pos)
    l, d, scale = c.block_len, c.block_stride, c.scale
    k_cmp, v_cmp = layer.phi_k(k, l, d, None), layer.phi_v(v, l, d, None)
    _, lse = reference.compressed_attention(q, k_cmp, v_cmp, l, d, scale)
    kv = head // c.group
    visible = reference.compressed_mask_fn(T, k_cmp.shape[1], l, d, None, x.device)(0, T)[0, 0]
    cdt = reference.compute_dtype(q.dtype)
    logits = q[0, :, head].to(cdt) @ k_cmp[0, :, kv].to(cdt).T * scale
    probs = torch.where(visible, torch.exp(logits - lse[0, :, head, None].to(cdt)), 0.0)
    scores = reference.block_scores(q, k_cmp, lse, l, d, c.sel_block, scale)[0, :, kv]
    idx = reference.select_blocks(q, k_cmp, lse, l, d, c.sel_block, c.num_sel, scale)[0, :, kv]
    blocks = scores.shape[-1]
    chosen = torch.zeros(T, blocks + 1, dtype=torch.bool, device=x.device)
    chosen.scatter_(1, torch.where(idx >= 0, idx, blocks).long(), True)
    rows = reference.num_cmp(T, l, d)
    return {"cmp_probs": probs[:, :rows], "block_scores": scores, "chosen": chosen[:, :blocks]}


def draw(layer: NSAAttention, x: Tensor, path, head: int = 0) -> Path:
    """maps() as one PNG of three heatmaps (queries down, keys across) at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = maps(layer, x, head)
    c = layer.config
    panels = (("cmp_probs", f"compressed attention p (head {head})", "compressed block"),
              ("block_scores", "selection importance (Eq.9/10, its KV head)", "selection block"),
              ("chosen", f"chosen blocks (n={c.num_sel})", "selection block"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    for ax, (key, title, xlabel) in zip(axes, panels):
        image = ax.imshow(m[key].float().cpu().numpy(), aspect="auto", interpolation="nearest",
                          cmap="viridis")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("query token")
        fig.colorbar(image, ax=ax)
    fig.suptitle(f"l={c.block_len} d={c.block_stride} l'={c.sel_block} n={c.num_sel} "
                 f"T={x.shape[1]}", fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
