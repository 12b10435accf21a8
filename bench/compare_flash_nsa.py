"""Where flash-nsa and nsa-ops compute different things: each branch on the same inputs.

    python bench/compare_flash_nsa.py [--seqlens 8192 65536] [--out bench/results]
                                      [geometry flags | --config FILE.yaml]

bf16, B=1, random inputs, flash-nsa from .peers/ (bench/peers.py) configured to the spec's
semantics where its config reaches them (window w - 1 in FA's terms). Each branch gets the same
inputs on both sides (our compressed K/V, then each side's own lse for its top-n, then flash-nsa's
block choice for both selection attentions), so a row measures that branch alone. Writes
flash_nsa_diff.csv: per T and branch, the relative error of flash-nsa's output against ours, and
for the block choice the fraction of (token, KV head) rows whose sets differ and of chosen
blocks that differ.
"""
from __future__ import annotations

from pathlib import Path

import torch

import geometry
import peers
from bench_prefill import run_header
from nsa_ops import nsa_attention, reference
from nsa_ops.results import write_csv


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm()).item()


def block_sets(idx: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """bool [T, H, num_blocks]: which blocks each (token, KV head) row names; entries outside
    [0, num_blocks) (our -1, flash-nsa's ignore index) name none."""
    T, H, _ = idx.shape
    valid = (idx >= 0) & (idx < num_blocks)
    sets = torch.zeros(T, H, num_blocks + 1, dtype=torch.bool, device=idx.device)
    sets.scatter_(2, torch.where(valid, idx, num_blocks).long(), True)
    return sets[..., :num_blocks]


@torch.no_grad()
def compare(flash_nsa, cfg, T: int) -> list[dict]:
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    HQ, H, Dk, Dv = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim_qk, cfg.head_dim_v
    l, d, sel, n, w = cfg.block_len, cfg.block_stride, cfg.sel_block, cfg.num_sel, cfg.window
    q, k = torch.randn(T, HQ, Dk, **bf16), torch.randn(T, H, Dk, **bf16)
    v, logits = torch.randn(T, H, Dv, **bf16), torch.randn(T, HQ, 3, **bf16)
    scale = Dk ** -0.5
    core = peers.flash_nsa_core(flash_nsa, cfg)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    flash_nsa.NSAHelper.init_cu_seqlens(cu)
    rows = []

    def row(branch, err, **extra):
        rows.append(dict(T=T, branch=branch, rel_err=err, rows_differ=extra.get("rows", ""),
                         blocks_differ=extra.get("blocks", "")))

    num_cmp = reference.num_cmp(T, l, d)
    kc = reference.compress_mean(k[None], l, d, None)[0, :num_cmp]
    vc = reference.compress_mean(v[None], l, d, None)[0, :num_cmp]
    row("mean pooling (k)", rel_err(flash_nsa.mean_pooling(k), kc))
    o_f, lse_f = flash_nsa.compress_attn(q, kc, vc, sm_scale=scale)
    o_o, lse_o = torch.ops.nsa.compressed_attention(q[None], kc[None], vc[None], l, d, scale)
    row("compressed attention", rel_err(o_f, o_o[0]))

    num_blocks = -(-T // sel)
    idx_f, _ = flash_nsa.slc_topk_indices(q, kc, lse_f, sm_scale=scale,
                                          maybe_efficient_version=True, scale_slc_p=True)
    idx_o = torch.ops.nsa.select_blocks(q[None], kc[None], lse_o, l, d, sel, n, scale)[0]
    # flash-nsa's layout is [KH, T, n], ours [T, KH, n]
    sets_f = block_sets(idx_f.permute(1, 0, 2), num_blocks)
    sets_o = block_sets(idx_o, num_blocks)
    row("top-n block choice", float("nan"), rows=(sets_f != sets_o).any(-1).float().mean().item(),
        blocks=((sets_f & ~sets_o).sum() / sets_o.sum()).item())

    ours_idx = torch.where(idx_f < num_blocks, idx_f, -1).permute(1, 0, 2)[None]
    o_o, _ = torch.ops.nsa.selection_attention(q[None], k[None], v[None], ours_idx, sel, scale)
    row("selection attention", rel_err(flash_nsa.select_attn(q, k, v, idx_f, sm_scale=scale),
                                       o_o[0]))
    o_o, _ = torch.ops.nsa.sliding_window_attention(q[None], k[None], v[None], w, scale)
    row("sliding window", rel_err(flash_nsa.swa_varlen_func(q, k, v, scale), o_o[0]))

    gates = torch.sigmoid(logits).unbind(-1)
    o_o = nsa_attention(q[None], k[None], v[None], *(g[None] for g in gates), block_len=l,
                        block_stride=d, sel_block=sel, num_sel=n, window=w, scale=scale)
    row("whole layer", rel_err(core(q, k, v, logits, cu), o_o[0]))
    return rows


def main() -> None:
    parser = geometry.parser(__doc__)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--out", default="bench/results")
    args, cfg = geometry.parse(parser)
    flash_nsa, why = peers.load_flash_nsa()
    if flash_nsa is None:
        raise SystemExit(f"flash_nsa unavailable: {why}")
    header = f"{run_header()} {geometry.describe(cfg, 1)}"
    print(header)
    rows = [r for T in args.seqlens for r in compare(flash_nsa, cfg, T)]
    for r in rows:
        print(f"{r['T']:6d} {r['branch']:22s} rel err {r['rel_err']:.2e} "
              f"rows differ {r['rows_differ']} blocks differ {r['blocks_differ']}")
    write_csv(Path(args.out) / "flash_nsa_diff.csv", rows, header)


if __name__ == "__main__":
    main()
