"""Seeing and steering what an NSA layer does: force_branch ablations, gate / selection statistics,
and the inspect heatmaps."""
import pytest
import torch

import nsa_ops
from nsa_ops import heatmaps, reference
from nsa_ops.config import BRANCHES

GEOMETRY = dict(block_len=16, block_stride=8, sel_block=16, num_sel=3, window=16)


def layer(force_branch=None, seed=0):
    torch.manual_seed(seed)
    cfg = nsa_ops.NSAConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim_qk=8,
                            head_dim_v=8, force_branch=force_branch, **GEOMETRY)
    m = nsa_ops.NSAAttention(cfg)
    torch.nn.init.normal_(m.gate[-1].weight, std=0.5)  # gates that differ per token and head
    return m


def branch_outputs(m, x):
    """(o_cmp, o_slc, o_win) of the layer's q, k, v through the ops, and the unforced gates."""
    T = x.shape[1]
    q, k, v = m._qkv(x, torch.arange(T))
    l, d, scale, nsa = m.config.block_len, m.config.block_stride, m.config.scale, torch.ops.nsa
    k_cmp, v_cmp = reference.compress_mean(k, l, d), reference.compress_mean(v, l, d)
    o_cmp, lse = nsa.compressed_attention(q, k_cmp, v_cmp, l, d, scale)
    idx = nsa.select_blocks(q, k_cmp, lse, l, d, m.config.sel_block, m.config.num_sel, scale)
    o_slc, _ = nsa.selection_attention(q, k, v, idx, m.config.sel_block, scale)
    o_win, _ = nsa.sliding_window_attention(q, k, v, m.config.window, scale)
    return (o_cmp, o_slc, o_win), idx


@pytest.mark.parametrize("branch", BRANCHES)
def test_force_branch_keeps_one_branch(branch):
    x = torch.randn(2, 50, 32)
    m = layer(branch)
    with torch.no_grad():
        outs, _ = branch_outputs(m, x)
        gates = layer().gates(x)
        i = BRANCHES.index(branch)
        want = m.o_proj((gates[i][..., None] * outs[i]).flatten(-2))
        torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)
        for j, g in enumerate(m.gates(x)):
            assert (g == 0).all() == (j != i)


def test_force_branch_is_validated():
    with pytest.raises(ValueError, match="force_branch must be one of"):
        layer("window")


def test_stats_record_gates_and_selection_distances():
    x = torch.randn(2, 70, 32)
    m = layer()
    with torch.no_grad():
        gates = torch.stack(m.gates(x)).flatten(1).double()
        _, idx = branch_outputs(m, x)
        with pytest.raises(ValueError, match="record_stats"):
            m.stats()
        m.record_stats(max_distance=2)
        m(x)
        m(x)
    stats = m.stats()
    for i, branch in enumerate(BRANCHES):
        mean, std = stats["gates"][branch]
        assert mean == pytest.approx(gates[i].mean().item(), rel=1e-6)
        assert std == pytest.approx(gates[i].std(unbiased=False).item(), rel=1e-5)
    own = (torch.arange(70) // 16)[None, :, None, None]
    dist = (own - idx)[idx >= 0]
    want = [2 * int((dist == 0).sum()), 2 * int((dist == 1).sum()), 2 * int((dist >= 2).sum())]
    assert stats["distance"] == want
    m.record_stats(False)
    with pytest.raises(ValueError):
        m.stats()


def test_heatmap_maps():
    m = layer()
    x = torch.randn(1, 90, 32)
    maps = heatmaps.maps(m, x, head=3)
    T, rows, blocks = 90, reference.num_cmp(90, 16, 8), -(-90 // 16)
    assert maps["cmp_probs"].shape == (T, rows)
    assert maps["block_scores"].shape == maps["chosen"].shape == (T, blocks)
    sees = torch.arange(T) >= 15  # the first compressed block ends at token 15
    torch.testing.assert_close(maps["cmp_probs"][sees].sum(-1).float(), torch.ones(int(sees.sum())))
    assert (maps["cmp_probs"][~sees] == 0).all()
    allowed = (torch.arange(T) // 16 + 1).clamp(max=3)
    assert torch.equal(maps["chosen"].sum(-1), allowed)
    with pytest.raises(ValueError, match="head must be"):
        heatmaps.maps(m, x, head=4)


def test_inspect_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = heatmaps.draw(layer(), torch.randn(1, 64, 32), tmp_path / "maps.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
